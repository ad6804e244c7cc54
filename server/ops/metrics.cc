#include "ops/metrics.h"

#include <cinttypes>
#include <cstdio>
#include <thread>

#include "hiqcache/log.h"

#ifdef HIQ_HAVE_HTTPLIB
#include <httplib.h>
#endif

namespace hiqcache::server {
namespace {

constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

// HELP text escapes backslash and newline only.
std::string EscapeHelp(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

void Header(std::string* out, const char* name, const char* type, std::string_view help) {
  *out += "# HELP ";
  *out += name;
  *out += ' ';
  *out += EscapeHelp(help);
  *out += "\n# TYPE ";
  *out += name;
  *out += ' ';
  *out += type;
  *out += '\n';
}

void Sample(std::string* out, const std::string& name, const std::string& labels, uint64_t v) {
  *out += name;
  if (!labels.empty()) *out += "{" + labels + "}";
  *out += ' ';
  *out += std::to_string(v);
  *out += '\n';
}

void SampleDouble(std::string* out, const std::string& name, const std::string& labels, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  *out += name;
  if (!labels.empty()) *out += "{" + labels + "}";
  *out += ' ';
  *out += buf;
  *out += '\n';
}

// `key="value"` pairs, values escaped.
std::string Labels(std::initializer_list<std::pair<const char*, std::string_view>> kv) {
  std::string out;
  for (const auto& [k, v] : kv) {
    if (!out.empty()) out += ',';
    out += k;
    out += "=\"";
    out += EscapeLabelValue(v);
    out += '"';
  }
  return out;
}

void Gauge(std::string* out, const char* name, std::string_view help, uint64_t v) {
  Header(out, name, "gauge", help);
  Sample(out, name, "", v);
}

}  // namespace

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// DurationHistogram

const std::array<double, DurationHistogram::kBuckets>& DurationHistogram::Bounds() {
  static const std::array<double, kBuckets> kBounds = {
      0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,    0.1,    0.25,    0.5,    1,     2.5,    5,     10};
  return kBounds;
}

const std::array<const char*, DurationHistogram::kBuckets>& DurationHistogram::BoundLabels() {
  static const std::array<const char*, kBuckets> kLabels = {
      "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025",
      "0.05",  "0.1",    "0.25",    "0.5",    "1",     "2.5",    "5",     "10"};
  return kLabels;
}

void DurationHistogram::Observe(std::chrono::nanoseconds d) {
  const int64_t ns = std::max<int64_t>(0, d.count());
  const double s = static_cast<double>(ns) * 1e-9;
  size_t i = 0;
  while (i < kBuckets && s > Bounds()[i]) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
}

void DurationHistogram::Render(const std::string& name, std::string* out) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < kBuckets; ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    Sample(out, name + "_bucket", Labels({{"le", BoundLabels()[i]}}), cumulative);
  }
  cumulative += counts_[kBuckets].load(std::memory_order_relaxed);
  Sample(out, name + "_bucket", "le=\"+Inf\"", cumulative);
  SampleDouble(out, name + "_sum", "",
               static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) * 1e-9);
  Sample(out, name + "_count", "", cumulative);
}

// ---------------------------------------------------------------------------------------------
// DaemonMetrics

void DaemonMetrics::OnTransfer(const TransferSample& sample) {
  (sample.restore ? decode_ : encode_).Observe(sample.duration);
  MutexLock lock(&mu_);
  std::pair<std::string, bool> key{std::string(sample.namespace_id), sample.restore};
  std::string_view model = sample.model;
  // Two entries (backup, restore) per namespace.
  if (moved_.count(key) == 0 && moved_.size() >= 2 * kMaxNamespaceSeries) {
    key.first = "other";
    model = "";
  }
  Moved& m = moved_[key];
  if (m.model.empty()) m.model = std::string(model);
  if (sample.ok) {
    m.input_bytes += sample.input_bytes;
    m.stored_bytes += sample.stored_bytes;
  } else {
    m.failed_tasks += 1;
  }
}

void DaemonMetrics::OnNamespaceRemoved(std::string_view namespace_id) {
  MutexLock lock(&mu_);
  moved_.erase({std::string(namespace_id), false});
  moved_.erase({std::string(namespace_id), true});
}

void DaemonMetrics::OnL3Fetch(std::chrono::nanoseconds duration, bool ok) {
  (void)ok;
  l3_fetch_.Observe(duration);
}

void DaemonMetrics::OnRequestRejected(std::string_view rpc, StatusCode code) {
  MutexLock lock(&mu_);
  rejected_[{std::string(rpc), static_cast<int>(code)}] += 1;
}

std::string DaemonMetrics::Render(const CoreSnapshot& snap, const DaemonInfo& info) const {
  std::string out;
  out.reserve(8192);

  Header(&out, "hiqcache_build_info", "gauge",
         "Always 1; labels name the hiqcached version, device backend and CPU codec target.");
  Sample(&out, "hiqcache_build_info",
         Labels({{"version", info.version},
                 {"device", info.device},
                 {"codec_target", info.codec_target}}),
         1);
  Gauge(&out, "hiqcache_ready", "1 while hiqcached serves requests; 0 while it starts or drains.",
        info.ready ? 1 : 0);
  Header(&out, "hiqcache_start_time_seconds", "gauge",
         "Start time of hiqcached since the Unix epoch, in seconds.");
  SampleDouble(&out, "hiqcache_start_time_seconds", "", info.start_time_seconds);

  Gauge(&out, "hiqcache_pool_bytes", "Size of the shared-memory pool in bytes.",
        snap.store.pool_bytes);
  Gauge(&out, "hiqcache_pool_capacity_bytes",
        "Bytes of the pool available to block slots (pool size less its metadata).",
        snap.store.capacity_bytes);
  Gauge(&out, "hiqcache_pool_used_bytes", "Bytes of the pool held by live blocks.",
        snap.store.used_bytes);
  Gauge(&out, "hiqcache_pool_claimed_bytes",
        "Bytes of the pool the namespaces' extents hold, free slots included.",
        snap.store.claimed_bytes);
  Gauge(&out, "hiqcache_blocks", "Blocks held in the pool, all namespaces.", snap.store.blocks);
  Gauge(&out, "hiqcache_client_faulted_bytes",
        "Bytes of clients' shared memory the daemon faulted in on their behalf (pages not in "
        "memory when touched), every registered pool; each client's are bounded by "
        "max_faulted_bytes_per_client.",
        snap.faulted_bytes);
  Gauge(&out, "hiqcache_clients", "Client processes (or peers) with at least one registered pool.",
        snap.clients);
  Gauge(&out, "hiqcache_registered_pools", "Engine KV pools registered now.", snap.pools.size());
  Gauge(&out, "hiqcache_namespaces", "Namespaces known to the daemon.", snap.namespaces.size());

  // Per-namespace figures from the block store.
  struct NsMetric {
    const char* name;
    const char* type;
    const char* help;
    uint64_t (*get)(const NamespaceSnapshot&);
  };
  static const NsMetric kNs[] = {
      {"hiqcache_namespace_blocks", "gauge", "Blocks the namespace holds.",
       [](const NamespaceSnapshot& n) { return n.counters.blocks; }},
      {"hiqcache_namespace_used_bytes", "gauge", "Pool bytes held by the namespace's blocks.",
       [](const NamespaceSnapshot& n) { return n.counters.bytes; }},
      {"hiqcache_namespace_capacity_blocks", "gauge",
       "Blocks of this namespace the whole pool would hold alone.",
       [](const NamespaceSnapshot& n) { return n.counters.capacity_blocks; }},
      {"hiqcache_namespace_encoded_bytes_per_token", "gauge",
       "Stored bytes per token of the namespace, all layers.",
       [](const NamespaceSnapshot& n) { return n.encoded_bytes_per_token; }},
      {"hiqcache_namespace_pools", "gauge", "Engine pools registered in the namespace.",
       [](const NamespaceSnapshot& n) { return uint64_t{n.pools}; }},
      {"hiqcache_namespace_hits_total", "counter",
       "Blocks Lookup found: the leading run of present keys.",
       [](const NamespaceSnapshot& n) { return n.counters.hits; }},
      {"hiqcache_namespace_misses_total", "counter",
       "Keys Lookup asked for after the leading run of present keys.",
       [](const NamespaceSnapshot& n) { return n.counters.misses; }},
      {"hiqcache_namespace_backups_total", "counter", "Blocks stored by Backup.",
       [](const NamespaceSnapshot& n) { return n.counters.backups; }},
      {"hiqcache_namespace_restores_total", "counter", "Blocks written back by Restore.",
       [](const NamespaceSnapshot& n) { return n.counters.restores; }},
      {"hiqcache_namespace_evictions_total", "counter", "Blocks removed to make room or by Evict.",
       [](const NamespaceSnapshot& n) { return n.counters.evictions; }},
      {"hiqcache_namespace_rejected_blocks_total", "counter",
       "Blocks Backup rejected: NaN/Inf in the input, or no room.",
       [](const NamespaceSnapshot& n) { return n.counters.rejected; }},
  };
  for (const NsMetric& m : kNs) {
    Header(&out, m.name, m.type, m.help);
    for (const NamespaceSnapshot& n : snap.namespaces) {
      Sample(&out, m.name, Labels({{"namespace", n.namespace_id}, {"model", n.model}}), m.get(n));
    }
  }

  Header(&out, "hiqcache_encode_duration_seconds", "histogram",
         "Duration of backup tasks in the device backend, per task: waiting for wait_event, "
         "gathering, encoding and copying the blocks into the pool.");
  encode_.Render("hiqcache_encode_duration_seconds", &out);
  Header(&out, "hiqcache_decode_duration_seconds", "histogram",
         "Duration of restore tasks in the device backend, per task: waiting for wait_event, "
         "copying, decoding and scattering the blocks into the engine's KV.");
  decode_.Render("hiqcache_decode_duration_seconds", &out);

  // L3 (docs/design.md "Beyond one node (L3)"): only when the daemon has an L3 tier.
  if (snap.l3.enabled) {
    const L3Stats& l3 = snap.l3;
    auto counter = [&out](const char* name, const char* help, uint64_t v) {
      Header(&out, name, "counter", help);
      Sample(&out, name, "", v);
    };
    counter("hiqcache_l3_lookup_hits_total",
            "Blocks Lookup found in L3 after the pool's leading run.", l3.lookup_hits);
    counter("hiqcache_l3_lookup_misses_total", "Keys Lookup asked L3 for after the run L3 held.",
            l3.lookup_misses);
    Header(&out, "hiqcache_l3_errors_total", "counter",
           "L3 calls that failed or ran out of their deadline (each a miss), by operation.");
    Sample(&out, "hiqcache_l3_errors_total", Labels({{"op", "lookup"}}), l3.lookup_errors);
    Sample(&out, "hiqcache_l3_errors_total", Labels({{"op", "fetch"}}), l3.fetch_errors);
    Sample(&out, "hiqcache_l3_errors_total", Labels({{"op", "write"}}), l3.write_errors);
    counter("hiqcache_l3_fetches_total", "Restores that fetched blocks from L3.", l3.fetches);
    counter("hiqcache_l3_fetched_blocks_total", "Blocks fetched from L3 and verified.",
            l3.fetched_blocks);
    counter("hiqcache_l3_promoted_blocks_total",
            "Blocks fetched from L3 and written into the pool.", l3.promotions);
    counter("hiqcache_l3_corrupt_values_total",
            "Values fetched from L3 that failed to decode (header, namespace, key, length or "
            "checksum): dropped, a miss.",
            l3.corrupt_values);
    counter("hiqcache_l3_writes_total", "Blocks written to L3.", l3.writes);
    counter("hiqcache_l3_dropped_writes_total",
            "Blocks not written to L3 because the write queue was full.", l3.dropped_writes);
    counter("hiqcache_l3_skipped_writes_total",
            "Queued L3 writes whose block had left the pool before its turn.", l3.skipped_writes);
    counter("hiqcache_l3_spilled_blocks_total",
            "Blocks the pool evicted and copied into the L3 write queue (l3_write_policy "
            "on_evict).",
            l3.spilled_blocks);
    counter("hiqcache_l3_budget_deletes_total",
            "Blocks this daemon deleted from L3 to stay within l3_budget_bytes.",
            l3.budget_deletes);
    Gauge(&out, "hiqcache_l3_budget_bytes", "l3_budget_bytes (0 = no budget).", l3.budget_bytes);
    Gauge(&out, "hiqcache_l3_budget_used_bytes",
          "Value bytes in L3 that this daemon wrote and its budget ledger still counts.",
          l3.budget_used_bytes);
    Gauge(&out, "hiqcache_l3_write_queue_bytes", "Payload bytes queued for L3 writes.",
          l3.write_queue_bytes);
    Gauge(&out, "hiqcache_l3_write_queue_blocks", "Blocks queued for L3 writes.",
          l3.write_queue_blocks);
    Header(&out, "hiqcache_l3_transferred_bytes_total", "counter",
           "Value bytes moved to and from L3: direction=\"in\" fetched, \"out\" written.");
    Sample(&out, "hiqcache_l3_transferred_bytes_total", Labels({{"direction", "in"}}), l3.bytes_in);
    Sample(&out, "hiqcache_l3_transferred_bytes_total", Labels({{"direction", "out"}}),
           l3.bytes_out);
    Header(&out, "hiqcache_l3_fetch_duration_seconds", "histogram",
           "Duration of a restore's L3 fetch (MultiGet and verification).");
    l3_fetch_.Render("hiqcache_l3_fetch_duration_seconds", &out);
  }

  MutexLock lock(&mu_);
  Header(&out, "hiqcache_transferred_bytes_total", "counter",
         "Bytes moved by completed backup and restore tasks; form=\"bf16_equivalent\" counts "
         "the engine-side 16-bit bytes, form=\"stored\" the encoded bytes in the pool.");
  for (const auto& [key, m] : moved_) {
    const char* dir = key.second ? "restore" : "backup";
    Sample(&out, "hiqcache_transferred_bytes_total",
           Labels({{"namespace", key.first},
                   {"model", m.model},
                   {"direction", dir},
                   {"form", "bf16_equivalent"}}),
           m.input_bytes);
    Sample(
        &out, "hiqcache_transferred_bytes_total",
        Labels(
            {{"namespace", key.first}, {"model", m.model}, {"direction", dir}, {"form", "stored"}}),
        m.stored_bytes);
  }
  Header(&out, "hiqcache_failed_transfers_total", "counter",
         "Backup and restore tasks the device backend failed (the engine sees a miss).");
  for (const auto& [key, m] : moved_) {
    Sample(&out, "hiqcache_failed_transfers_total",
           Labels({{"namespace", key.first},
                   {"model", m.model},
                   {"direction", key.second ? "restore" : "backup"}}),
           m.failed_tasks);
  }
  Header(&out, "hiqcache_rejected_requests_total", "counter",
         "RPCs answered with an error, by method and gRPC status code.");
  for (const auto& [key, n] : rejected_) {
    Sample(
        &out, "hiqcache_rejected_requests_total",
        Labels({{"rpc", key.first}, {"code", StatusCodeName(static_cast<StatusCode>(key.second))}}),
        n);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// MetricsHttpServer

namespace {

// Splits "host:port" / "[v6]:port".
Status SplitHostPort(const std::string& listen, std::string* host, int* port) {
  const std::string where = "metrics_listen '" + listen + "'";
  size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size()) {
    return InvalidArgument(where + ": expected host:port, e.g. 127.0.0.1:9464");
  }
  *host = listen.substr(0, colon);
  if (host->front() == '[') {
    if (host->back() != ']') return InvalidArgument(where + ": unbalanced [ in the host");
    *host = host->substr(1, host->size() - 2);
  } else if (host->find(':') != std::string::npos) {
    return InvalidArgument(where + ": write an IPv6 host in brackets, e.g. [::1]:9464");
  }
  const std::string p = listen.substr(colon + 1);
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(p) > 65535) {
    return InvalidArgument(where + ": port must be 0..65535");
  }
  *port = std::stoi(p);
  return Status::Ok();
}

}  // namespace

#ifdef HIQ_HAVE_HTTPLIB

struct MetricsHttpServer::Impl {
  httplib::Server server;
  std::thread thread;
};

StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::function<std::string()> render) {
  std::string host;
  int port = 0;
  HIQ_RETURN_IF_ERROR(SplitHostPort(listen, &host, &port));
  auto impl = std::make_unique<Impl>();
  // Scrapes are rare and cheap: two threads, not httplib's default of one per core.
  impl->server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  impl->server.set_read_timeout(5, 0);
  impl->server.set_write_timeout(5, 0);
  impl->server.Get("/metrics", [render](const httplib::Request&, httplib::Response& res) {
    res.set_content(render(), kContentType);
  });
  impl->server.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("hiqcached: metrics at /metrics\n", "text/plain; charset=utf-8");
  });
  if (port == 0) {
    port = impl->server.bind_to_any_port(host);
    if (port < 0) port = 0;
  } else if (!impl->server.bind_to_port(host, port)) {
    port = 0;
  }
  if (port == 0) {
    return FailedPrecondition("metrics_listen '" + listen +
                              "': cannot listen (address in use or not local)");
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->server.listen_after_bind(); });
  HIQ_LOG(INFO) << "metrics on http://" << listen.substr(0, listen.rfind(':')) << ":" << port
                << "/metrics";
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl), port));
}

MetricsHttpServer::~MetricsHttpServer() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

#else  // !HIQ_HAVE_HTTPLIB

struct MetricsHttpServer::Impl {};

StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::function<std::string()>) {
  std::string host;
  int port = 0;
  HIQ_RETURN_IF_ERROR(SplitHostPort(listen, &host, &port));
  return FailedPrecondition(
      "metrics_listen: this hiqcached was built without cpp-httplib "
      "(install libcpp-httplib-dev and rebuild)");
}

MetricsHttpServer::~MetricsHttpServer() = default;

#endif  // HIQ_HAVE_HTTPLIB

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

}  // namespace hiqcache::server
