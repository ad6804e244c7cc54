// QuotaLedger: what each client holds against its quotas, and each client's fault budget.
//
// A client is the uid of an authenticated caller; every anonymous caller together is one client
// (kAnonymousClient). A per-process limit would be bypassed by forking. CacheCore charges a pool
// registration (pools, buffers, mapped bytes) before it opens anything and gives it back when
// the pool retires; a backup or restore charges its engine-side bytes while it is queued or
// running; a backup's sub-task reserves pool slots while its writes are in flight. A charge over
// a quota is refused with RESOURCE_EXHAUSTED naming the quota's config key, and changes nothing.
// Includes neither gRPC nor CUDA. Thread-safe: one mutex guards the ledger.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "core/fault_budget.h"
#include "hiqcache/mutex.h"
#include "hiqcache/status.h"

namespace hiqcache::server {

// Per-client quotas. Defaults fit an 8-GPU node whose engines register pools of hundreds of GiB
// with a buffer per layer and plane.
struct Quotas {
  uint32_t max_pools_per_client = 256;                 // max_pools_per_client
  uint32_t max_buffers_per_client = 8192;              // max_buffers_per_client (mappings)
  uint64_t max_mapped_bytes_per_client = 16ull << 40;  // max_mapped_bytes_per_client
  // Engine-side bytes of the client's backups and restores queued or running.
  uint64_t max_pending_bytes_per_client = 64ull << 30;  // max_pending_bytes_per_client
  // Pool slots reserved by the client's backups and not yet written (committed or dropped).
  uint32_t max_reserved_slots_per_client = 16384;  // max_reserved_slots_per_client
  // Bytes of the client's shared memory the daemon may fault in on the client's behalf (pages
  // of its buffers and event slots that were not in memory when touched: fault_budget.h).
  uint64_t max_faulted_bytes_per_client = 4ull << 30;  // max_faulted_bytes_per_client
};

class QuotaLedger {
 public:
  // The client every anonymous caller shares: above any uid.
  static constexpr uint64_t kAnonymousClient = uint64_t{1} << 32;
  // "uid N", or "anonymous callers (no session)": the subject of a quota's error text.
  static std::string ClientName(uint64_t client);

  explicit QuotaLedger(const Quotas& quotas) : quotas_(quotas) {}
  QuotaLedger(const QuotaLedger&) = delete;
  QuotaLedger& operator=(const QuotaLedger&) = delete;

  // Charges one pool of `buffers` mappings and `mapped_bytes` to `client` and returns the
  // client's fault budget (shared by its pools), or RESOURCE_EXHAUSTED naming the quota.
  StatusOr<std::shared_ptr<FaultBudget>> ChargePool(uint64_t client, uint64_t buffers,
                                                    uint64_t mapped_bytes);
  // Gives back what ChargePool took.
  void UnchargePool(uint64_t client, uint64_t buffers, uint64_t mapped_bytes);
  // Charges `bytes` of pending work to `client`, or answers RESOURCE_EXHAUSTED.
  Status ChargePending(uint64_t client, uint64_t bytes);
  void UnchargePending(uint64_t client, uint64_t bytes);
  // Whether `client` may reserve `slots` more slots now (below its quota, or it holds none).
  bool MayReserve(uint64_t client, uint64_t slots);
  // Adds (negative: gives back) reserved slots of `client`.
  void AddReserved(uint64_t client, int64_t slots);

 private:
  // What a client holds against its quotas.
  struct ClientUsage {
    uint64_t pools = 0;
    uint64_t buffers = 0;
    uint64_t mapped_bytes = 0;
    uint64_t pending_bytes = 0;
    uint64_t reserved_slots = 0;
    bool empty() const {
      return pools == 0 && buffers == 0 && mapped_bytes == 0 && pending_bytes == 0 &&
             reserved_slots == 0;
    }
  };
  // The budget of `client`, the live one if a binding holds it.
  std::shared_ptr<FaultBudget> FaultBudgetOfLocked(uint64_t client) REQUIRES(mu_);

  const Quotas quotas_;
  Mutex mu_;
  std::map<uint64_t, ClientUsage> usage_ GUARDED_BY(mu_);
  // Each client's fault budget, shared by its pools' bindings for as long as one holds it.
  std::map<uint64_t, std::weak_ptr<FaultBudget>> fault_budgets_ GUARDED_BY(mu_);
};

}  // namespace hiqcache::server
