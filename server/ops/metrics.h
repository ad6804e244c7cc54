// hiqcached's Prometheus metrics (the `--metrics-listen host:port` endpoint).
//
//   DaemonMetrics      a CoreObserver: counts what the core's snapshot does not hold (transfer
//                      durations and bytes, rejected requests) and renders everything, snapshot
//                      included, in the Prometheus text exposition format 0.0.4.
//   MetricsHttpServer  serves GET /metrics over HTTP (cpp-httplib) on its own threads.
//
// Names follow the Prometheus conventions: `hiqcache_` prefix, base units in the name
// (`_bytes`, `_seconds`), `_total` on counters. Includes neither gRPC nor CUDA. Thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "core/cache_core.h"
#include "hiqcache/mutex.h"
#include "hiqcache/status.h"

namespace hiqcache::server {

// A Prometheus histogram of durations with fixed buckets (50 us to 10 s), lock-free.
class DurationHistogram {
 public:
  static constexpr size_t kBuckets = 17;
  // Upper bounds in seconds, and the same as they are printed in `le` labels.
  static const std::array<double, kBuckets>& Bounds();
  static const std::array<const char*, kBuckets>& BoundLabels();

  void Observe(std::chrono::nanoseconds d);
  // Appends `name`_bucket/_sum/_count lines (cumulative buckets, +Inf last).
  void Render(const std::string& name, std::string* out) const;

 private:
  std::array<std::atomic<uint64_t>, kBuckets + 1> counts_{};  // last: above every bound
  std::atomic<uint64_t> sum_ns_{0};
};

// What the daemon knows about itself that the core does not.
struct DaemonInfo {
  std::string version;
  std::string device;             // "host" | "cuda"
  std::string codec_target;       // the CPU codec's SIMD target
  bool ready = false;             // serving (false while starting or draining)
  double start_time_seconds = 0;  // Unix time
};

class DaemonMetrics final : public CoreObserver {
 public:
  void OnTransfer(const TransferSample& sample) override;
  void OnRequestRejected(std::string_view rpc, StatusCode code) override;
  // Drops the namespace's transfer series: the exposition stays bounded whatever names clients
  // register and release.
  void OnNamespaceRemoved(std::string_view namespace_id) override;
  // One L3 fetch of a restore (L3Options::on_fetch): its duration.
  void OnL3Fetch(std::chrono::nanoseconds duration, bool ok);

  // At most this many namespaces keep their own transfer series; transfers of others are
  // counted under namespace="other" (bounded even while many namespaces live).
  static constexpr size_t kMaxNamespaceSeries = 1024;

  // The whole exposition: daemon info, the snapshot's pool and namespace figures, and this
  // object's counters.
  std::string Render(const CoreSnapshot& snapshot, const DaemonInfo& info) const;

 private:
  struct Moved {
    std::string model;
    uint64_t input_bytes = 0;
    uint64_t stored_bytes = 0;
    uint64_t failed_tasks = 0;
  };

  DurationHistogram encode_;
  DurationHistogram decode_;
  DurationHistogram l3_fetch_;

  mutable Mutex mu_;
  // (namespace_id, restore) -> bytes moved; at most kMaxNamespaceSeries namespaces and "other".
  std::map<std::pair<std::string, bool>, Moved> moved_ GUARDED_BY(mu_);
  std::map<std::pair<std::string, int>, uint64_t> rejected_ GUARDED_BY(mu_);  // (rpc, code)
};

// Escapes a label value for the text format (backslash, double quote, newline).
std::string EscapeLabelValue(std::string_view v);

class MetricsHttpServer {
 public:
  // Listens on `listen` ("host:port", "[v6]:port"; port 0 picks a free one) and serves
  // GET /metrics with the text `render` returns (called on an HTTP thread per scrape).
  static StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& listen,
                                                            std::function<std::string()> render);
  // Stops listening and joins the server's threads.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  struct Impl;
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

}  // namespace hiqcache::server
