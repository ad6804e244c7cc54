// StartupProgress: what hiqcached is doing before it serves, for the callers that reach it
// meanwhile. The daemon listens on its sockets before it opens and pre-faults the pool (a pool of
// hundreds of GiB takes minutes), so `hiqctl health` and engines get an answer at once: health
// NOT_SERVING, and every Cache RPC UNAVAILABLE with Describe() as its message ("starting:
// pre-faulting pool hiqcache-0: 1.5 of 4.0 GiB (37%)"), which engines treat as a miss.
//
// Thread-safety: SetPhase and Describe take a lock; the done counter is an atomic that the
// pre-fault threads add to without it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace hiqcache::server {

class StartupProgress {
 public:
  // Starts a phase: `what` is shown as is ("pre-faulting pool hiqcache-0"); `total_bytes`, when
  // not 0, is the work the phase counts in done() (progress is shown then).
  void SetPhase(std::string what, uint64_t total_bytes = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    phase_ = std::move(what);
    total_ = total_bytes;
    done_.store(0, std::memory_order_relaxed);
  }
  // The counter of the current phase's work done, in bytes.
  std::atomic<uint64_t>* done() { return &done_; }

  std::string Describe() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::string out = "starting: " + phase_;
    if (total_ != 0) {
      const uint64_t done = std::min(done_.load(std::memory_order_relaxed), total_);
      char buf[96];
      std::snprintf(buf, sizeof(buf), ": %.1f of %.1f GiB (%d%%)", done / double(1ull << 30),
                    total_ / double(1ull << 30), static_cast<int>(done * 100 / total_));
      out += buf;
    }
    return out;
  }

 private:
  mutable std::mutex mu_;
  std::string phase_ = "opening";  // GUARDED_BY(mu_)
  uint64_t total_ = 0;             // GUARDED_BY(mu_)
  std::atomic<uint64_t> done_{0};
};

}  // namespace hiqcache::server
