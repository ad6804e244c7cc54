// FaultBudget: the bytes of a client's shared memory that the daemon may fault in on the
// client's behalf (quota max_faulted_bytes_per_client).
//
// A page of a client's memfd or /dev/shm object that is not in memory when the daemon touches
// it (never written, hole-punched with FALLOC_FL_PUNCH_HOLE, or swapped out) is allocated or read
// back by the daemon's access, and a newly allocated shmem page is charged to the memory cgroup
// of the process that faulted it: the daemon's, not the client's. Before a backend touches a
// client's rows or event slots it counts the pages that are not resident (mincore; or, where no
// swap is active, one fstat per buffer showing every page of its object, sealed against growing,
// allocated: nothing to count, ShmMapping::FullyAllocated) and charges them here; over the
// budget the work is refused instead (a miss, or a backup not stored), so that no client can
// grow the daemon's memory by lending it memory it never touched. Charges are given back when
// the pool that made them is released (its pages go with the client's object).
//
// The same object bounds the daemon's registration-time mapping of a client's resident pages
// (HostBackend::Bind, ResidencyProbe::MapResident: mincore walks every page looked at, so the
// walk's time grows with the bytes): the bytes looked at by the client's registered pools
// together stay within map_ahead_limit, so that many pools, or many registrations at once, of
// one client hold no more registration time than one pool of that size.
//
// One budget per client (uid), shared by the client's pools. Thread-safe (lock-free).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace hiqcache::server {

class FaultBudget {
 public:
  static constexpr uint64_t kDefaultMapAheadBytes = uint64_t{8} << 30;

  explicit FaultBudget(uint64_t limit, uint64_t map_ahead_limit = kDefaultMapAheadBytes)
      : limit_(limit), map_ahead_limit_(map_ahead_limit) {}

  // Takes `bytes` if the charges stay within the limit; else takes nothing and returns false.
  bool TryCharge(uint64_t bytes) {
    uint64_t cur = charged_.load(std::memory_order_relaxed);
    do {
      if (bytes > limit_ || cur > limit_ - bytes) return false;
    } while (!charged_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
    return true;
  }
  // Gives back `bytes` taken by TryCharge.
  void Refund(uint64_t bytes) { charged_.fetch_sub(bytes, std::memory_order_relaxed); }

  uint64_t limit() const { return limit_; }
  uint64_t charged() const { return charged_.load(std::memory_order_relaxed); }

  // Takes up to `want` bytes of the map-ahead allowance and returns how many it took (0 once
  // the client's pools hold it all).
  uint64_t TakeMapAhead(uint64_t want) {
    uint64_t cur = map_ahead_.load(std::memory_order_relaxed);
    uint64_t take = 0;
    do {
      take = std::min(want, map_ahead_limit_ - std::min(cur, map_ahead_limit_));
      if (take == 0) return 0;
    } while (!map_ahead_.compare_exchange_weak(cur, cur + take, std::memory_order_relaxed));
    return take;
  }
  // Gives back `bytes` taken by TakeMapAhead.
  void GiveBackMapAhead(uint64_t bytes) { map_ahead_.fetch_sub(bytes, std::memory_order_relaxed); }
  uint64_t map_ahead() const { return map_ahead_.load(std::memory_order_relaxed); }

 private:
  const uint64_t limit_;
  const uint64_t map_ahead_limit_;
  std::atomic<uint64_t> charged_{0};
  std::atomic<uint64_t> map_ahead_{0};
};

}  // namespace hiqcache::server
