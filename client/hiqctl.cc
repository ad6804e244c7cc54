// hiqctl: admin CLI for hiqcached.
//
//   hiqctl [--target ADDR] [--timeout SECONDS] <command> [--json]
//     stats                               daemon and per-namespace statistics
//     pools                               registered pools
//     evict --pool-id N --key HEX [...]   drop blocks from pool N's namespace
//     health [--service NAME]             grpc.health.v1.Health/Check (service "" by default)
//     drain [--wait]                      stop taking new work (admin only)
//     watch [--interval S] [--count N]    stats, refreshed
//   hiqctl --version                      "hiqctl X.Y.Z" (the project version)
//
// For a unix target hiqctl opens a session with the daemon (hiqcache/session.h), so that the
// daemon knows who calls: Drain and Evict of other callers' blocks need an admin (root, the
// daemon's user or a configured admin uid or group); stats shows the caller's own pool ids only,
// unless it is an admin.
//
// Exit status: 0 success, 1 daemon unreachable or an error from it, 2 usage.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "channel.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/paths.h"
#include "hiqcache/session.h"
#include "hiqcache/session_protocol.h"
#include "hiqcache/v1/cache.grpc.pb.h"

// HIQ_VERSION: the project version ("X.Y.Z", from python/hiqcache/_version.py), defined for
// this file by client/CMakeLists.txt.

namespace hiqcache {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

constexpr char kUsage[] =
    "usage: hiqctl [--target ADDR] [--timeout SECONDS] <command> [--json]\n"
    "commands:\n"
    "  stats                               daemon and per-namespace statistics\n"
    "  pools                               registered pools\n"
    "  evict --pool-id N --key HEX [...]   drop blocks (32-hex-digit keys) from pool N's "
    "namespace\n"
    "  health [--service NAME]             gRPC health check\n"
    "  drain [--wait]                      stop taking new work (health NOT_SERVING); with\n"
    "                                      --wait, return once queued work has finished\n"
    "  watch [--interval S] [--count N]    stats, refreshed every S seconds (default 2)\n"
    "hiqctl --version prints the version.\n"
    "ADDR: unix:///path/to.sock, /path/to.sock or host:port (default: ";

struct Args {
  std::string target;
  double timeout_s = 3.0;
  std::string command;
  bool json = false;
  uint64_t pool_id = 0;
  bool has_pool_id = false;
  std::vector<std::string> keys;
  std::string service;
  bool wait = false;
  double interval_s = 2.0;
  uint64_t count = 0;  // watch: 0 = until interrupted
};

int Usage(const std::string& error) {
  if (!error.empty()) std::cerr << "hiqctl: " << error << "\n";
  std::cerr << kUsage << DefaultTarget() << ")\n";
  return kExitUsage;
}

// Parses argv into `args`; returns an error text, empty on success.
std::string Parse(int argc, char** argv, Args* args) {
  bool after_key = false;  // bare words after --key are more keys
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    const size_t eq = a.find('=');
    const bool has_inline = a.starts_with("--") && eq != std::string::npos;
    if (has_inline) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    auto next = [&](std::string* out) -> bool {
      if (has_inline) {
        *out = value;
        return true;
      }
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    if (a == "--target") {
      if (!next(&args->target)) return "--target needs a value";
    } else if (a == "--timeout") {
      std::string v;
      if (!next(&v)) return "--timeout needs a value";
      char* end = nullptr;
      args->timeout_s = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || args->timeout_s <= 0) return "bad --timeout " + v;
    } else if (a == "--json") {
      args->json = true;
    } else if (a == "--pool-id") {
      std::string v;
      if (!next(&v)) return "--pool-id needs a value";
      char* end = nullptr;
      args->pool_id = std::strtoull(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0') return "bad --pool-id " + v;
      args->has_pool_id = true;
    } else if (a == "--key") {
      std::string v;
      if (!next(&v)) return "--key needs a value";
      args->keys.push_back(v);
      after_key = true;
      continue;
    } else if (a == "--wait") {
      args->wait = true;
    } else if (a == "--interval" || a == "--count") {
      std::string v;
      if (!next(&v)) return a + " needs a value";
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || x <= 0) return "bad " + a + " " + v;
      if (a == "--interval")
        args->interval_s = x;
      else
        args->count = static_cast<uint64_t>(x);
    } else if (a == "--service") {
      if (!next(&args->service)) return "--service needs a value";
    } else if (a == "-h" || a == "--help") {
      return "help";
    } else if (a == "--version") {
      return "version";
    } else if (a.starts_with("-")) {
      return "unknown flag " + a;
    } else if (args->command.empty()) {
      args->command = a;
    } else if (after_key) {
      args->keys.push_back(a);
      continue;
    } else {
      return "unexpected argument " + a;
    }
    after_key = false;
  }
  if (args->command.empty()) return "no command";
  return "";
}

int Unreachable(const std::string& target, const std::string& detail) {
  std::cerr << "hiqctl: cannot reach hiqcached at " << target << ": " << detail << "\n";
  return kExitError;
}

// Reports a failed call: unreachable daemon or an error it returned.
int Fail(const std::string& target, const Status& s) {
  if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) {
    std::string detail = s.message();
    const std::string prefix = "hiqcached at " + target + ": ";
    if (detail.starts_with(prefix)) detail = detail.substr(prefix.size());
    return Unreachable(target, detail);
  }
  std::cerr << "hiqctl: hiqcached at " << target << ": " << s.ToString() << "\n";
  return kExitError;
}

std::string Bytes(uint64_t b) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, kUnits[u]);
  return buf;
}

std::string Duration(uint64_t s) {
  char buf[48];
  if (s >= 86400) {
    std::snprintf(buf, sizeof(buf), "%" PRIu64 "d%02" PRIu64 "h%02" PRIu64 "m", s / 86400,
                  s / 3600 % 24, s / 60 % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%" PRIu64 "h%02" PRIu64 "m%02" PRIu64 "s", s / 3600,
                  s / 60 % 60, s % 60);
  }
  return buf;
}

std::string Percent(uint64_t num, uint64_t den) {
  if (den == 0) return "-";
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.1f", 100.0 * static_cast<double>(num) / den);
  return buf;
}

// Left-aligned text columns, right-aligned numbers.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void Print(std::ostream& os) const {
    std::vector<size_t> width(rows_[0].size(), 0);
    std::vector<bool> numeric(rows_[0].size(), true);
    std::vector<bool> any_number(rows_[0].size(), false);
    for (size_t r = 0; r < rows_.size(); ++r) {
      for (size_t c = 0; c < rows_[r].size(); ++c) {
        width[c] = std::max(width[c], rows_[r][c].size());
        if (r > 0 && rows_[r][c] != "-" &&
            (rows_[r][c].empty() ||
             rows_[r][c].find_first_not_of("0123456789.") != std::string::npos)) {
          numeric[c] = false;
        }
        if (r > 0 && rows_[r][c] != "-") any_number[c] = true;
      }
    }
    for (size_t c = 0; c < numeric.size(); ++c) numeric[c] = numeric[c] && any_number[c];
    for (const auto& row : rows_) {
      std::string line;
      for (size_t c = 0; c < row.size(); ++c) {
        const std::string pad(width[c] - row[c].size(), ' ');
        line += numeric[c] ? pad + row[c] : row[c] + (c + 1 < row.size() ? pad : "");
        if (c + 1 < row.size()) line += "  ";
      }
      os << line << "\n";
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

// Minimal JSON writer: numbers stay numbers (proto3's JSON mapping would quote uint64).
class Json {
 public:
  static std::string Str(const std::string& s) {
    std::string out = "\"";
    for (unsigned char c : s) {
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
          } else {
            out += static_cast<char>(c);
          }
      }
    }
    return out + "\"";
  }
};

const char* DeviceEnumName(DeviceKind d) {
  return d == DeviceKind::kCuda ? "DEVICE_KIND_CUDA" : "DEVICE_KIND_HOST";
}

std::string NamespaceJson(const NamespaceStats& n, const std::string& indent) {
  std::ostringstream o;
  o << indent << "{\"namespace_id\": " << Json::Str(n.namespace_id)
    << ", \"model\": " << Json::Str(n.model) << ", \"tenant\": " << Json::Str(n.tenant)
    << ", \"codec\": " << Json::Str(CodecContractName(n.codec))
    << ", \"encoded_bytes_per_token\": " << n.encoded_bytes_per_token
    << ", \"blocks\": " << n.blocks << ", \"bytes\": " << n.bytes << ", \"hits\": " << n.hits
    << ", \"misses\": " << n.misses << ", \"backups\": " << n.backups
    << ", \"restores\": " << n.restores << ", \"evictions\": " << n.evictions
    << ", \"rejected\": " << n.rejected << ", \"pools\": " << n.pools
    << ", \"capacity_blocks\": " << n.capacity_blocks << "}";
  return o.str();
}

std::string PoolJson(const PoolStats& p, const std::string& indent) {
  std::ostringstream o;
  o << indent << "{\"pool_id\": " << p.pool_id
    << ", \"namespace_id\": " << Json::Str(p.namespace_id) << ", \"model\": " << Json::Str(p.model)
    << ", \"tenant\": " << Json::Str(p.tenant)
    << ", \"device\": " << Json::Str(DeviceEnumName(p.device))
    << ", \"client_pid\": " << p.client_pid << ", \"uid\": " << p.uid
    << ", \"owned\": " << (p.owned ? "true" : "false") << ", \"backups\": " << p.backups
    << ", \"restores\": " << p.restores << ", \"peer\": " << Json::Str(p.peer) << "}";
  return o.str();
}

template <typename T, typename F>
std::string JsonArray(const std::vector<T>& items, F element, const std::string& indent) {
  if (items.empty()) return "[]";
  std::string out = "[\n";
  for (size_t i = 0; i < items.size(); ++i) {
    out += element(items[i], indent + "  ");
    out += i + 1 < items.size() ? ",\n" : "\n";
  }
  return out + indent + "]";
}

std::unique_ptr<Client> MakeClient(const Args& args, const std::string& target) {
  ClientOptions options;
  options.target = target;
  options.call_timeout = std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));
  auto client = Client::Connect(options);
  return client.ok() ? std::move(client).value() : nullptr;
}

// The L3 store's counters (GetStats' l3) as one JSON object; {"enabled": false} without L3.
std::string L3Json(const L3Stats& l) {
  std::ostringstream o;
  o << "{\"enabled\": " << (l.enabled ? "true" : "false");
  if (l.enabled) {
    o << ", \"lookup_hits\": " << l.lookup_hits << ", \"lookup_misses\": " << l.lookup_misses
      << ", \"lookup_errors\": " << l.lookup_errors << ", \"fetches\": " << l.fetches
      << ", \"fetched_blocks\": " << l.fetched_blocks << ", \"fetch_errors\": " << l.fetch_errors
      << ", \"corrupt_values\": " << l.corrupt_values
      << ", \"promoted_blocks\": " << l.promoted_blocks << ", \"writes\": " << l.writes
      << ", \"write_errors\": " << l.write_errors << ", \"dropped_writes\": " << l.dropped_writes
      << ", \"skipped_writes\": " << l.skipped_writes
      << ", \"write_queue_bytes\": " << l.write_queue_bytes
      << ", \"write_queue_blocks\": " << l.write_queue_blocks << ", \"bytes_in\": " << l.bytes_in
      << ", \"bytes_out\": " << l.bytes_out
      << ", \"fetch_latency_samples\": " << l.fetch_latency_samples
      << ", \"fetch_p50_us\": " << l.fetch_p50_us << ", \"fetch_p99_us\": " << l.fetch_p99_us
      << ", \"write_policy\": " << Json::Str(l.write_policy)
      << ", \"spilled_blocks\": " << l.spilled_blocks << ", \"budget_bytes\": " << l.budget_bytes
      << ", \"budget_used_bytes\": " << l.budget_used_bytes
      << ", \"budget_deletes\": " << l.budget_deletes;
  }
  o << "}";
  return o.str();
}

// GetStats with every namespace: pages of at most kStatsPage until namespaces_total are read (or
// a page comes back empty: namespaces went away meanwhile).
constexpr uint32_t kStatsPage = 4096;
StatusOr<DaemonStats> GetAllStats(Client& client) {
  auto first = client.GetStats(0, kStatsPage);
  if (!first.ok()) return first.status();
  DaemonStats all = std::move(first).value();
  while (all.namespaces.size() < all.namespaces_total) {
    auto page = client.GetStats(static_cast<uint32_t>(all.namespaces.size()), kStatsPage);
    if (!page.ok()) return page.status();
    if (page->namespaces.empty()) break;
    for (NamespaceStats& n : page->namespaces) all.namespaces.push_back(std::move(n));
  }
  return all;
}

int CmdStats(const Args& args, const std::string& target) {
  auto client = MakeClient(args, target);
  if (client == nullptr) return Usage("bad target " + target);
  auto stats = GetAllStats(*client);
  if (!stats.ok()) return Fail(target, stats.status());
  const DaemonStats& s = *stats;
  if (args.json) {
    std::cout << "{\n  \"target\": " << Json::Str(target) << ",\n  \"pool_bytes\": " << s.pool_bytes
              << ",\n  \"used_bytes\": " << s.used_bytes
              << ",\n  \"capacity_bytes\": " << s.capacity_bytes << ",\n  \"blocks\": " << s.blocks
              << ",\n  \"cuda_staging_bytes\": " << s.cuda_staging_bytes
              << ",\n  \"clients\": " << s.clients
              << ",\n  \"uptime_seconds\": " << s.uptime_seconds
              << ",\n  \"device\": " << Json::Str(s.device)
              << ",\n  \"shm_name\": " << Json::Str(s.shm_name)
              << ",\n  \"caller_uid\": " << s.caller_uid
              << ",\n  \"caller_admin\": " << (s.caller_admin ? "true" : "false")
              << ",\n  \"namespaces_total\": " << s.namespaces_total
              << ",\n  \"namespaces\": " << JsonArray(s.namespaces, NamespaceJson, "  ")
              << ",\n  \"pools\": " << JsonArray(s.pools, PoolJson, "  ")
              << ",\n  \"l3\": " << L3Json(s.l3) << "\n}\n";
    return kExitOk;
  }
  std::cout << "hiqcached at " << target << "\n"
            << "  device    " << (s.device.empty() ? "-" : s.device) << "\n"
            << "  shm       " << (s.shm_name.empty() ? "-" : s.shm_name) << "\n"
            << "  pool      " << Bytes(s.pool_bytes) << " (" << Bytes(s.capacity_bytes)
            << " for blocks)\n"
            << "  used      " << Bytes(s.used_bytes) << " ("
            << Percent(s.used_bytes, s.capacity_bytes ? s.capacity_bytes : s.pool_bytes) << "%), "
            << s.blocks << " blocks\n"
            << "  clients   " << s.clients << ", " << s.namespaces_total << " namespaces\n"
            << "  caller    uid " << s.caller_uid << (s.caller_admin ? " (admin)" : "") << "\n";
  if (s.cuda_staging_bytes > 0) {
    std::cout << "  staging   " << Bytes(s.cuda_staging_bytes) << " of GPU memory\n";
  }
  std::cout << "  uptime    " << Duration(s.uptime_seconds) << "\n";
  if (s.l3.enabled) {
    const L3Stats& l = s.l3;
    std::cout << "  l3 lookup " << l.lookup_hits << " hits, " << l.lookup_misses << " misses, "
              << l.lookup_errors << " errors\n"
              << "  l3 fetch  " << l.fetches << " fetches, " << l.fetched_blocks << " blocks ("
              << Bytes(l.bytes_in) << "), " << l.promoted_blocks << " promoted, "
              << l.corrupt_values << " corrupt, " << l.fetch_errors << " errors";
    if (l.fetch_latency_samples > 0) {
      std::cout << "; p50 " << l.fetch_p50_us << " us, p99 " << l.fetch_p99_us << " us (last "
                << l.fetch_latency_samples << ")";
    }
    std::cout << "\n"
              << "  l3 write  " << l.write_policy << ": " << l.writes << " written ("
              << Bytes(l.bytes_out) << "), " << l.dropped_writes << " dropped, " << l.skipped_writes
              << " skipped, " << l.write_errors << " errors";
    if (l.write_policy == "on_evict") std::cout << ", " << l.spilled_blocks << " spilled";
    std::cout << "; queue " << l.write_queue_blocks << " blocks (" << Bytes(l.write_queue_bytes)
              << ")\n";
    if (l.budget_bytes > 0) {
      std::cout << "  l3 budget " << Bytes(l.budget_used_bytes) << " of " << Bytes(l.budget_bytes)
                << " used, " << l.budget_deletes << " deleted to stay within it\n";
    }
  }
  std::cout << "\n";
  if (s.namespaces.empty()) {
    std::cout << "no namespaces\n";
    return kExitOk;
  }
  Table t({"NAMESPACE", "MODEL", "TENANT", "CODEC", "B/TOKEN", "BLOCKS", "CAPACITY", "BYTES",
           "HIT%", "HITS", "MISSES", "BACKUPS", "RESTORES", "EVICTIONS", "REJECTED", "POOLS"});
  for (const NamespaceStats& n : s.namespaces) {
    t.Add({n.namespace_id, n.model, n.tenant.empty() ? "-" : n.tenant, CodecName(n.codec),
           std::to_string(n.encoded_bytes_per_token), std::to_string(n.blocks),
           std::to_string(n.capacity_blocks), Bytes(n.bytes), Percent(n.hits, n.hits + n.misses),
           std::to_string(n.hits), std::to_string(n.misses), std::to_string(n.backups),
           std::to_string(n.restores), std::to_string(n.evictions), std::to_string(n.rejected),
           std::to_string(n.pools)});
  }
  t.Print(std::cout);
  return kExitOk;
}

int CmdPools(const Args& args, const std::string& target) {
  auto client = MakeClient(args, target);
  if (client == nullptr) return Usage("bad target " + target);
  auto stats = client->GetStats(0, 1);  // the pools are not paged
  if (!stats.ok()) return Fail(target, stats.status());
  if (args.json) {
    std::cout << JsonArray(stats->pools, PoolJson, "") << "\n";
    return kExitOk;
  }
  if (stats->pools.empty()) {
    std::cout << "no pools registered\n";
    return kExitOk;
  }
  Table t({"POOL", "NAMESPACE", "MODEL", "TENANT", "DEVICE", "PID", "UID", "OWNED", "BACKUPS",
           "RESTORES", "PEER"});
  for (const PoolStats& p : stats->pools) {
    // Another caller's pool id is not shown (0) unless the caller is an admin.
    t.Add({p.pool_id == 0 ? "-" : std::to_string(p.pool_id), p.namespace_id, p.model,
           p.tenant.empty() ? "-" : p.tenant, DeviceKindName(p.device),
           std::to_string(p.client_pid), std::to_string(p.uid), p.owned ? "yes" : "no",
           std::to_string(p.backups), std::to_string(p.restores), p.peer.empty() ? "-" : p.peer});
  }
  t.Print(std::cout);
  return kExitOk;
}

std::chrono::system_clock::time_point Deadline(const Args& args) {
  return std::chrono::system_clock::now() +
         std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000));
}

// A session for the raw calls (Evict, Drain) to a unix target; null (and a note on stderr) when
// none can be opened, in which case the call goes anonymous and the daemon decides.
std::unique_ptr<Session> OpenSession(const Args& args, const std::string& target) {
  auto session =
      Session::Open(target, std::chrono::milliseconds(static_cast<int64_t>(args.timeout_s * 1000)));
  if (session.ok()) return std::move(session).value();
  if (!SessionSocketPathForTarget(target).empty()) {  // TCP targets have none: no note
    std::cerr << "hiqctl: no session with hiqcached at " << target << " ("
              << session.status().ToString() << "); calling anonymously\n";
  }
  return nullptr;
}

int CmdEvict(const Args& args, const std::string& target) {
  if (!args.has_pool_id) return Usage("evict needs --pool-id N");
  if (args.keys.empty()) return Usage("evict needs at least one --key HEX");
  v1::EvictRequest req;
  req.set_pool_id(args.pool_id);
  for (const std::string& hex : args.keys) {
    BlockKey key;
    if (!BlockKeyFromHex(hex, &key)) return Usage("bad key \"" + hex + "\": need 32 hex digits");
    req.add_keys(reinterpret_cast<const char*>(key.data()), key.size());
  }
  auto stub = v1::Cache::NewStub(client_internal::MakeChannel(target));
  const std::unique_ptr<Session> session = OpenSession(args, target);
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(args));
  client_internal::AttachSession(session.get(), &ctx);
  v1::EvictResponse resp;
  Status s = client_internal::FromGrpc(stub->Evict(&ctx, req, &resp), target);
  if (!s.ok()) return Fail(target, s);
  if (args.json) {
    std::cout << "{\"pool_id\": " << args.pool_id << ", \"requested\": " << args.keys.size()
              << ", \"evicted\": " << resp.evicted() << "}\n";
  } else {
    std::cout << "evicted " << resp.evicted() << " of " << args.keys.size() << " blocks\n";
  }
  return kExitOk;
}

int CmdHealth(const Args& args, const std::string& target) {
  auto stub = grpc::health::v1::Health::NewStub(client_internal::MakeChannel(target));
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(args));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(args.service);
  grpc::health::v1::HealthCheckResponse resp;
  Status s = client_internal::FromGrpc(stub->Check(&ctx, req, &resp), target);
  if (!s.ok()) return Fail(target, s);
  const std::string status =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  // The health protocol carries no reason: a daemon still starting answers every Cache RPC
  // UNAVAILABLE with what it is doing ("starting: pre-faulting pool ...: 1.5 of 4.0 GiB (37%)").
  std::string reason;
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    auto cache = v1::Cache::NewStub(client_internal::MakeChannel(target));
    grpc::ClientContext stats_ctx;
    stats_ctx.set_deadline(Deadline(args));
    v1::GetStatsRequest stats_req;
    stats_req.set_namespaces_limit(1);
    v1::GetStatsResponse stats_resp;
    const grpc::Status st = cache->GetStats(&stats_ctx, stats_req, &stats_resp);
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE) {
      reason = st.error_message();
    } else if (st.ok()) {
      reason = "draining: refusing new work";
    }
  }
  if (args.json) {
    std::cout << "{\"target\": " << Json::Str(target)
              << ", \"service\": " << Json::Str(args.service)
              << ", \"status\": " << Json::Str(status);
    if (!reason.empty()) std::cout << ", \"reason\": " << Json::Str(reason);
    std::cout << "}\n";
  } else {
    std::cout << status << (reason.empty() ? "" : " (" + reason + ")") << "\n";
  }
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk : kExitError;
}

int CmdDrain(const Args& args, const std::string& target) {
  auto stub = v1::Cache::NewStub(client_internal::MakeChannel(target));
  // Drain is admin-only: the daemon tells the caller by the session.
  const std::unique_ptr<Session> session = OpenSession(args, target);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(10);
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(args));
    client_internal::AttachSession(session.get(), &ctx);
    v1::DrainRequest req;
    v1::DrainResponse resp;
    Status s = client_internal::FromGrpc(stub->Drain(&ctx, req, &resp), target);
    if (!s.ok()) return Fail(target, s);
    const bool done = resp.pending_tasks() == 0;
    if (!args.wait || done || std::chrono::steady_clock::now() > give_up) {
      if (args.json) {
        std::cout << "{\"target\": " << Json::Str(target)
                  << ", \"draining\": true, \"pending_tasks\": " << resp.pending_tasks() << "}\n";
      } else {
        std::cout << "draining: new work is refused; " << resp.pending_tasks()
                  << " queued transfer(s) left\n";
      }
      return done || !args.wait ? kExitOk : kExitError;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

int CmdWatch(const Args& args, const std::string& target) {
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  for (uint64_t i = 0; args.count == 0 || i < args.count; ++i) {
    if (i > 0) {
      std::this_thread::sleep_for(
          std::chrono::milliseconds(static_cast<int64_t>(args.interval_s * 1000)));
    }
    if (tty && !args.json) std::cout << "\033[H\033[2J";  // clear the screen
    const int rc = CmdStats(args, target);
    std::cout << std::flush;
    if (rc != kExitOk) return rc;
  }
  return kExitOk;
}

int Main(int argc, char** argv) {
  Args args;
  const std::string error = Parse(argc, argv, &args);
  if (error == "help") return Usage(""), kExitOk;
  if (error == "version") {
    std::cout << "hiqctl " HIQ_VERSION "\n";
    return kExitOk;
  }
  if (!error.empty()) return Usage(error);
  auto target = client_internal::NormalizeTarget(args.target);
  if (!target.ok()) return Usage(target.status().message());
  if (args.command == "stats") return CmdStats(args, *target);
  if (args.command == "pools") return CmdPools(args, *target);
  if (args.command == "evict") return CmdEvict(args, *target);
  if (args.command == "health") return CmdHealth(args, *target);
  if (args.command == "drain") return CmdDrain(args, *target);
  if (args.command == "watch") return CmdWatch(args, *target);
  return Usage("unknown command " + args.command);
}

}  // namespace
}  // namespace hiqcache

int main(int argc, char** argv) {
  try {
    return hiqcache::Main(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "hiqctl: " << e.what() << "\n";
    return 1;
  }
}
