#include "core/quota_ledger.h"

#include <algorithm>
#include <iterator>

namespace hiqcache::server {

namespace {

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  return __builtin_add_overflow(a, b, &out) ? UINT64_MAX : out;
}

}  // namespace

std::string QuotaLedger::ClientName(uint64_t client) {
  return client == kAnonymousClient ? std::string("anonymous callers (no session)")
                                    : "uid " + std::to_string(client);
}

StatusOr<std::shared_ptr<FaultBudget>> QuotaLedger::ChargePool(uint64_t client, uint64_t buffers,
                                                               uint64_t mapped_bytes) {
  MutexLock lock(&mu_);
  ClientUsage& u = usage_[client];
  const Quotas& q = quotas_;
  Status over;
  if (u.pools + 1 > q.max_pools_per_client) {
    over =
        ResourceExhausted(ClientName(client) + " already have " + std::to_string(u.pools) +
                          " pools registered, at most " + std::to_string(q.max_pools_per_client) +
                          " per client (quota max_pools_per_client)");
  } else if (u.buffers + buffers > q.max_buffers_per_client) {
    over = ResourceExhausted(
        "buffers: this registration maps " + std::to_string(buffers) + " buffers and " +
        ClientName(client) + " already have " + std::to_string(u.buffers) + " mapped, at most " +
        std::to_string(q.max_buffers_per_client) + " per client (quota max_buffers_per_client)");
  } else if (SaturatingAdd(u.mapped_bytes, mapped_bytes) > q.max_mapped_bytes_per_client) {
    over = ResourceExhausted("buffers: this registration maps " + std::to_string(mapped_bytes) +
                             " bytes (buffers and events) and " + ClientName(client) +
                             " already have " + std::to_string(u.mapped_bytes) +
                             " bytes mapped, at most " +
                             std::to_string(q.max_mapped_bytes_per_client) +
                             " per client (quota max_mapped_bytes_per_client)");
  }
  if (!over.ok()) {
    if (u.empty()) usage_.erase(client);
    return over;
  }
  u.pools += 1;
  u.buffers += buffers;
  u.mapped_bytes += mapped_bytes;
  return FaultBudgetOfLocked(client);
}

void QuotaLedger::UnchargePool(uint64_t client, uint64_t buffers, uint64_t mapped_bytes) {
  MutexLock lock(&mu_);
  auto it = usage_.find(client);
  if (it == usage_.end()) return;
  ClientUsage& u = it->second;
  u.pools -= std::min<uint64_t>(1, u.pools);
  u.buffers -= std::min(buffers, u.buffers);
  u.mapped_bytes -= std::min(mapped_bytes, u.mapped_bytes);
  if (u.empty()) usage_.erase(it);
}

Status QuotaLedger::ChargePending(uint64_t client, uint64_t bytes) {
  MutexLock lock(&mu_);
  ClientUsage& u = usage_[client];
  const uint64_t max = quotas_.max_pending_bytes_per_client;
  if (SaturatingAdd(u.pending_bytes, bytes) > max) {
    const uint64_t have = u.pending_bytes;
    if (u.empty()) usage_.erase(client);
    return ResourceExhausted(
        "blocks: this request moves " + std::to_string(bytes) + " bytes and " + ClientName(client) +
        " already have " + std::to_string(have) +
        " bytes of backups and restores queued or running, at most " + std::to_string(max) +
        " per client (quota max_pending_bytes_per_client): retry once earlier work completed");
  }
  u.pending_bytes += bytes;
  return Status::Ok();
}

void QuotaLedger::UnchargePending(uint64_t client, uint64_t bytes) {
  MutexLock lock(&mu_);
  auto it = usage_.find(client);
  if (it == usage_.end()) return;
  it->second.pending_bytes -= std::min(bytes, it->second.pending_bytes);
  if (it->second.empty()) usage_.erase(it);
}

bool QuotaLedger::MayReserve(uint64_t client, uint64_t slots) {
  MutexLock lock(&mu_);
  auto it = usage_.find(client);
  const uint64_t held = it == usage_.end() ? 0 : it->second.reserved_slots;
  // A client holding none may always go on (its requests are refused up front when one sub-task
  // alone exceeds the quota), so waiting here always ends.
  return held == 0 || held + slots <= quotas_.max_reserved_slots_per_client;
}

void QuotaLedger::AddReserved(uint64_t client, int64_t slots) {
  MutexLock lock(&mu_);
  ClientUsage& u = usage_[client];
  if (slots >= 0) {
    u.reserved_slots += static_cast<uint64_t>(slots);
  } else {
    u.reserved_slots -= std::min<uint64_t>(static_cast<uint64_t>(-slots), u.reserved_slots);
  }
  if (u.empty()) usage_.erase(client);
}

std::shared_ptr<FaultBudget> QuotaLedger::FaultBudgetOfLocked(uint64_t client) {
  std::weak_ptr<FaultBudget>& slot = fault_budgets_[client];
  std::shared_ptr<FaultBudget> budget = slot.lock();
  if (budget == nullptr) {
    budget = std::make_shared<FaultBudget>(quotas_.max_faulted_bytes_per_client);
    slot = budget;
  }
  // Budgets no binding holds any more are dropped now and then (one entry per uid seen).
  if (fault_budgets_.size() > 64 && fault_budgets_.size() > 2 * usage_.size()) {
    std::erase_if(fault_budgets_, [](const auto& e) { return e.second.expired(); });
  }
  return budget;
}

}  // namespace hiqcache::server
