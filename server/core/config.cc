#include "core/config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>

#include "core/cache_core.h"
#include "core/l3_tier.h"
#include "hiqcache/paths.h"

// HIQ_VERSION: the project version ("X.Y.Z", from python/hiqcache/_version.py), defined for
// this file by server/CMakeLists.txt.

namespace hiqcache::server {
namespace {

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

// Strips a trailing comment that is not inside a string.
std::string StripComment(const std::string& line) {
  bool in_str = false;
  for (size_t i = 0; i < line.size(); ++i) {
    if (line[i] == '"') in_str = !in_str;
    if (line[i] == '#' && !in_str) return line.substr(0, i);
  }
  return line;
}

StatusOr<std::string> ParseString(const std::string& v, const std::string& where) {
  if (v.size() < 2 || v.front() != '"' || v.back() != '"') {
    return InvalidArgument(where + ": expected a double-quoted string, got " + v);
  }
  return v.substr(1, v.size() - 2);
}

StatusOr<std::vector<std::string>> ParseStringArray(const std::string& v,
                                                    const std::string& where) {
  if (v.size() < 2 || v.front() != '[' || v.back() != ']') {
    return InvalidArgument(where + ": expected an array of strings, got " + v);
  }
  std::vector<std::string> out;
  std::string inner = Trim(v.substr(1, v.size() - 2));
  std::stringstream ss(inner);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = Trim(item);
    if (item.empty()) continue;
    HIQ_ASSIGN_OR_RETURN(std::string s, ParseString(item, where));
    out.push_back(s);
  }
  return out;
}

StatusOr<uint64_t> ParseUint(const std::string& v, const std::string& where) {
  if (v.empty() || v.size() > 19) return InvalidArgument(where + ": expected an integer");
  uint64_t out = 0;
  for (char c : v) {
    if (!std::isdigit(static_cast<unsigned char>(c))) {
      return InvalidArgument(where + ": expected an integer, got " + v);
    }
    out = out * 10 + static_cast<uint64_t>(c - '0');
  }
  return out;
}

// "a, b,c" -> {"a", "b", "c"}; empty items dropped.
std::vector<std::string> SplitList(const std::string& list) {
  std::vector<std::string> out;
  std::string item;
  for (char ch : list + ",") {
    if (ch == ',') {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else if (ch != ' ' && ch != '\t') {
      item += ch;
    }
  }
  return out;
}

StatusOr<bool> ParseBool(const std::string& v, const std::string& where) {
  if (v == "true") return true;
  if (v == "false") return false;
  return InvalidArgument(where + ": expected true or false, got " + v);
}

}  // namespace

bool IsLocalAddress(const std::string& addr) {
  if (addr.rfind("unix:", 0) == 0) return true;
  std::string host = addr;
  if (host.rfind("ipv4:", 0) == 0 || host.rfind("ipv6:", 0) == 0) host = host.substr(5);
  if (!host.empty() && host.front() == '[') {
    const size_t close = host.find(']');
    host = close == std::string::npos ? host : host.substr(1, close - 1);
  } else if (const size_t colon = host.rfind(':'); colon != std::string::npos) {
    host = host.substr(0, colon);
  }
  if (host == "localhost" || host == "::1") return true;
  // 127.a.b.c, digits and dots only.
  return host.rfind("127.", 0) == 0 && host.find_first_not_of("0123456789.") == std::string::npos &&
         std::count(host.begin(), host.end(), '.') == 3;
}

namespace {

Status Validate(const DaemonConfig& c) {
  if (c.listen.empty()) return InvalidArgument("listen: at least one address is needed");
  const bool tls = !c.tls_cert_file.empty() || !c.tls_key_file.empty();
  if (tls && (c.tls_cert_file.empty() || c.tls_key_file.empty())) {
    return InvalidArgument("tls_cert_file and tls_key_file: give both or neither");
  }
  if (!c.tls_client_ca_file.empty() && !tls) {
    return InvalidArgument("tls_client_ca_file: needs tls_cert_file and tls_key_file");
  }
  for (const std::string& addr : c.listen) {
    if (!IsLocalAddress(addr) && !tls) {
      return InvalidArgument(
          "listen: " + addr +
          " is reachable beyond this node, and hiqcached serves such an address only over TLS: "
          "set tls_cert_file and tls_key_file (and tls_client_ca_file to require client "
          "certificates), or listen on a unix socket or loopback (127.0.0.1) address");
    }
  }
  if (c.pool_bytes < (16ull << 20)) return InvalidArgument("pool_bytes: at least 16MiB");
  if (c.shm_name.empty()) return InvalidArgument("shm_name: must not be empty");
  if (c.device != "auto" && c.device != "host" && c.device != "cuda") {
    return InvalidArgument("device: must be auto, host or cuda, got " + c.device);
  }
  if (c.namespace_scope != "uid" && c.namespace_scope != "pod" && c.namespace_scope != "node") {
    return InvalidArgument("namespace_scope: must be uid, pod or node, got " + c.namespace_scope);
  }
  auto positive = [](uint64_t v, const char* key) -> Status {
    if (v == 0) return InvalidArgument(std::string(key) + ": must be > 0");
    return Status::Ok();
  };
  HIQ_RETURN_IF_ERROR(positive(c.max_pools_per_client, "max_pools_per_client"));
  HIQ_RETURN_IF_ERROR(positive(c.max_buffers_per_client, "max_buffers_per_client"));
  HIQ_RETURN_IF_ERROR(positive(c.max_mapped_bytes_per_client, "max_mapped_bytes_per_client"));
  HIQ_RETURN_IF_ERROR(positive(c.max_pending_bytes_per_client, "max_pending_bytes_per_client"));
  HIQ_RETURN_IF_ERROR(positive(c.max_reserved_slots_per_client, "max_reserved_slots_per_client"));
  HIQ_RETURN_IF_ERROR(positive(c.max_faulted_bytes_per_client, "max_faulted_bytes_per_client"));
  HIQ_RETURN_IF_ERROR(positive(c.transfer_chunk_blocks, "transfer_chunk_blocks"));
  HIQ_RETURN_IF_ERROR(positive(c.max_connections, "max_connections"));
  if (c.max_block_bytes < (1ull << 20)) {
    return InvalidArgument("max_block_bytes: at least 1MiB, got " +
                           std::to_string(c.max_block_bytes));
  }
  HIQ_RETURN_IF_ERROR(positive(c.max_connections_per_uid, "max_connections_per_uid"));
  HIQ_RETURN_IF_ERROR(positive(c.max_streams_per_connection, "max_streams_per_connection"));
  if (c.grpc_memory_bytes < (16ull << 20)) {
    return InvalidArgument("grpc_memory_bytes: at least 16MiB, got " +
                           std::to_string(c.grpc_memory_bytes));
  }
  if (c.sessionless_message_bytes < 4096 ||
      c.sessionless_message_bytes > std::max<uint64_t>(c.max_message_bytes, 4096)) {
    return InvalidArgument("sessionless_message_bytes: from 4KiB to max_message_bytes (" +
                           std::to_string(c.max_message_bytes) + "), got " +
                           std::to_string(c.sessionless_message_bytes));
  }
  HIQ_RETURN_IF_ERROR(positive(c.transfer_chunk_bytes, "transfer_chunk_bytes"));
  if (!c.l3_seeds.empty()) {
    if (!L3Available()) {
      return InvalidArgument(
          "l3_seeds: this hiqcached was built without the L3 store (hiredis, libhiredis-dev, "
          "was not found at build time): unset l3_seeds or rebuild with hiredis");
    }
    for (const std::string& seed : c.l3_seeds) {
      const size_t colon = seed.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == seed.size() ||
          seed.find_first_not_of("0123456789", colon + 1) != std::string::npos ||
          seed.size() - colon - 1 > 5 || std::stoul(seed.substr(colon + 1)) > 65535) {
        return InvalidArgument("l3_seeds: '" + seed + "' is not host:port");
      }
    }
  }
  if (c.l3_write_policy != "write_through" && c.l3_write_policy != "on_evict") {
    return InvalidArgument("l3_write_policy: must be write_through or on_evict, got '" +
                           c.l3_write_policy + "'");
  }
  HIQ_RETURN_IF_ERROR(positive(c.l3_connect_timeout_ms, "l3_connect_timeout_ms"));
  HIQ_RETURN_IF_ERROR(positive(c.l3_command_timeout_ms, "l3_command_timeout_ms"));
  HIQ_RETURN_IF_ERROR(positive(c.l3_lookup_deadline_ms, "l3_lookup_deadline_ms"));
  HIQ_RETURN_IF_ERROR(positive(c.l3_fetch_deadline_ms, "l3_fetch_deadline_ms"));
  HIQ_RETURN_IF_ERROR(positive(c.l3_write_queue_bytes, "l3_write_queue_bytes"));
  HIQ_RETURN_IF_ERROR(positive(c.l3_write_queue_blocks, "l3_write_queue_blocks"));
  HIQ_RETURN_IF_ERROR(positive(c.l3_writer_threads, "l3_writer_threads"));
  if (c.cuda_staging_bytes < (4ull << 20) || c.cuda_staging_bytes > (64ull << 30)) {
    return InvalidArgument("cuda_staging_bytes: must be in [4MiB, 64GiB], got " +
                           std::to_string(c.cuda_staging_bytes));
  }
  return Status::Ok();
}

// Applies one key. `value` is raw text (quoted strings stay quoted) for the file, and for flags.
Status ApplyKey(const std::string& key, const std::string& value, const std::string& where,
                DaemonConfig* c, bool from_flag) {
  auto str = [&]() -> StatusOr<std::string> {
    if (from_flag) return value;
    return ParseString(value, where);
  };
  // A size: "8GiB" (quoted in the file, or a bare integer of bytes).
  auto size = [&]() -> StatusOr<uint64_t> {
    std::string v = value;
    if (!from_flag && !v.empty() && v.front() == '"') {
      HIQ_ASSIGN_OR_RETURN(v, ParseString(value, where));
    }
    auto parsed = ParseSize(v);
    if (!parsed.ok()) return InvalidArgument(where + ": " + parsed.status().message());
    return *parsed;
  };
  auto count = [&](uint64_t max) -> StatusOr<uint32_t> {
    HIQ_ASSIGN_OR_RETURN(uint64_t v, ParseUint(value, where));
    return static_cast<uint32_t>(std::min<uint64_t>(v, max));
  };
  // Keys are written with '_' in the file and '-' as flags; either is accepted in both.
  std::string k = key;
  for (char& ch : k) {
    if (ch == '-') ch = '_';
  }
  if (k == "namespace_scope") {
    HIQ_ASSIGN_OR_RETURN(c->namespace_scope, str());
    return Status::Ok();
  }
  auto ms = [&](uint64_t max) -> StatusOr<uint32_t> { return count(max); };
  if (k == "l3_seeds") {
    HIQ_ASSIGN_OR_RETURN(std::string list, str());
    c->l3_seeds = SplitList(list);
    return Status::Ok();
  }
  if (k == "l3_user") {
    HIQ_ASSIGN_OR_RETURN(c->l3_user, str());
    return Status::Ok();
  }
  if (k == "tls_cert_file" || k == "tls_key_file" || k == "tls_client_ca_file") {
    HIQ_ASSIGN_OR_RETURN(std::string v, str());
    (k == "tls_cert_file"  ? c->tls_cert_file
     : k == "tls_key_file" ? c->tls_key_file
                           : c->tls_client_ca_file) = std::move(v);
    return Status::Ok();
  }
  if (k == "l3_mac_key_file" || k == "l3_mac_previous_key_file") {
    HIQ_ASSIGN_OR_RETURN(std::string v, str());
    (k == "l3_mac_key_file" ? c->l3_mac_key_file : c->l3_mac_previous_key_file) = std::move(v);
    return Status::Ok();
  }
  if (k == "l3_password_file") {
    HIQ_ASSIGN_OR_RETURN(c->l3_password_file, str());
    return Status::Ok();
  }
  if (k == "l3_key_prefix") {
    HIQ_ASSIGN_OR_RETURN(c->l3_key_prefix, str());
    return Status::Ok();
  }
  if (k == "l3_write_policy") {
    HIQ_ASSIGN_OR_RETURN(c->l3_write_policy, str());
    return Status::Ok();
  }
  if (k == "l3_ttl") {
    HIQ_ASSIGN_OR_RETURN(c->l3_ttl, count(10u * 365 * 86400));
    return Status::Ok();
  }
  if (k == "l3_budget_bytes") {
    HIQ_ASSIGN_OR_RETURN(c->l3_budget_bytes, size());
    return Status::Ok();
  }
  if (k == "l3_connect_timeout_ms") {
    HIQ_ASSIGN_OR_RETURN(c->l3_connect_timeout_ms, ms(60000));
    return Status::Ok();
  }
  if (k == "l3_command_timeout_ms") {
    HIQ_ASSIGN_OR_RETURN(c->l3_command_timeout_ms, ms(60000));
    return Status::Ok();
  }
  if (k == "l3_lookup_deadline_ms") {
    HIQ_ASSIGN_OR_RETURN(c->l3_lookup_deadline_ms, ms(10000));
    return Status::Ok();
  }
  if (k == "l3_fetch_deadline_ms") {
    HIQ_ASSIGN_OR_RETURN(c->l3_fetch_deadline_ms, ms(60000));
    return Status::Ok();
  }
  if (k == "l3_write_queue_bytes") {
    HIQ_ASSIGN_OR_RETURN(c->l3_write_queue_bytes, size());
    return Status::Ok();
  }
  if (k == "l3_write_queue_blocks") {
    HIQ_ASSIGN_OR_RETURN(c->l3_write_queue_blocks, count(1u << 24));
    return Status::Ok();
  }
  if (k == "l3_writer_threads") {
    HIQ_ASSIGN_OR_RETURN(c->l3_writer_threads, count(64));
    return Status::Ok();
  }
  if (k == "max_pools_per_client") {
    HIQ_ASSIGN_OR_RETURN(c->max_pools_per_client, count(1u << 20));
    return Status::Ok();
  }
  if (k == "max_buffers_per_client") {
    HIQ_ASSIGN_OR_RETURN(c->max_buffers_per_client, count(1u << 24));
    return Status::Ok();
  }
  if (k == "max_mapped_bytes_per_client") {
    HIQ_ASSIGN_OR_RETURN(c->max_mapped_bytes_per_client, size());
    return Status::Ok();
  }
  if (k == "max_pending_bytes_per_client") {
    HIQ_ASSIGN_OR_RETURN(c->max_pending_bytes_per_client, size());
    return Status::Ok();
  }
  if (k == "max_reserved_slots_per_client") {
    HIQ_ASSIGN_OR_RETURN(c->max_reserved_slots_per_client, count(1u << 30));
    return Status::Ok();
  }
  if (k == "max_faulted_bytes_per_client") {
    HIQ_ASSIGN_OR_RETURN(c->max_faulted_bytes_per_client, size());
    return Status::Ok();
  }
  if (k == "max_block_bytes") {
    HIQ_ASSIGN_OR_RETURN(c->max_block_bytes, size());
    return Status::Ok();
  }
  if (k == "max_repeated_rows_per_request") {
    HIQ_ASSIGN_OR_RETURN(c->max_repeated_rows_per_request, count(UINT32_MAX));
    return Status::Ok();
  }
  if (k == "max_connections") {
    HIQ_ASSIGN_OR_RETURN(c->max_connections, count(1u << 20));
    return Status::Ok();
  }
  if (k == "max_connections_per_uid") {
    HIQ_ASSIGN_OR_RETURN(c->max_connections_per_uid, count(1u << 20));
    return Status::Ok();
  }
  if (k == "max_streams_per_connection") {
    HIQ_ASSIGN_OR_RETURN(c->max_streams_per_connection, count(1u << 16));
    return Status::Ok();
  }
  if (k == "grpc_memory_bytes") {
    HIQ_ASSIGN_OR_RETURN(c->grpc_memory_bytes, size());
    return Status::Ok();
  }
  if (k == "sessionless_message_bytes") {
    HIQ_ASSIGN_OR_RETURN(c->sessionless_message_bytes, size());
    return Status::Ok();
  }
  if (k == "transfer_chunk_blocks") {
    HIQ_ASSIGN_OR_RETURN(c->transfer_chunk_blocks, count(1u << 20));
    return Status::Ok();
  }
  if (k == "transfer_chunk_bytes") {
    HIQ_ASSIGN_OR_RETURN(c->transfer_chunk_bytes, size());
    return Status::Ok();
  }
  if (key == "listen") {
    if (from_flag) {
      c->listen.push_back(value);
    } else {
      HIQ_ASSIGN_OR_RETURN(c->listen, ParseStringArray(value, where));
    }
  } else if (key == "pool_bytes" || key == "pool-bytes") {
    std::string v = value;
    if (!from_flag && !v.empty() && v.front() == '"') {
      HIQ_ASSIGN_OR_RETURN(v, ParseString(value, where));
    }
    auto size = ParseSize(v);
    if (!size.ok()) return InvalidArgument(where + ": " + size.status().message());
    c->pool_bytes = *size;
  } else if (key == "shm_name" || key == "shm-name") {
    HIQ_ASSIGN_OR_RETURN(c->shm_name, str());
  } else if (key == "device") {
    HIQ_ASSIGN_OR_RETURN(c->device, str());
  } else if (key == "metrics_listen" || key == "metrics-listen") {
    HIQ_ASSIGN_OR_RETURN(c->metrics_listen, str());
  } else if (key == "log_level" || key == "log-level") {
    HIQ_ASSIGN_OR_RETURN(c->log_level, str());
  } else if (key == "socket_mode" || key == "socket-mode") {
    HIQ_ASSIGN_OR_RETURN(std::string m, str());
    if (m.empty() || m.size() > 4 || m.find_first_not_of("01234567") != std::string::npos) {
      return InvalidArgument(where + ": expected an octal mode like \"0660\"");
    }
    c->socket_mode = static_cast<uint32_t>(std::stoul(m, nullptr, 8));
  } else if (key == "socket_group" || key == "socket-group") {
    HIQ_ASSIGN_OR_RETURN(c->socket_group, str());
  } else if (key == "transfer_workers" || key == "transfer-workers") {
    HIQ_ASSIGN_OR_RETURN(uint64_t v, ParseUint(value, where));
    c->transfer_workers = static_cast<uint32_t>(std::min<uint64_t>(v, 256));
  } else if (key == "codec_threads" || key == "codec-threads") {
    HIQ_ASSIGN_OR_RETURN(uint64_t v, ParseUint(value, where));
    c->codec_threads = static_cast<uint32_t>(std::min<uint64_t>(v, 1024));
  } else if (key == "wait_timeout_ms" || key == "wait-timeout-ms") {
    HIQ_ASSIGN_OR_RETURN(uint64_t v, ParseUint(value, where));
    c->wait_timeout_ms = static_cast<uint32_t>(std::min<uint64_t>(v, 3600000));
  } else if (key == "max_blocks_per_request" || key == "max-blocks-per-request") {
    HIQ_ASSIGN_OR_RETURN(uint64_t v, ParseUint(value, where));
    c->max_blocks_per_request = static_cast<uint32_t>(std::min<uint64_t>(v, 1u << 20));
  } else if (key == "max_message_bytes" || key == "max-message-bytes") {
    std::string v = value;
    if (!from_flag && !v.empty() && v.front() == '"') {
      HIQ_ASSIGN_OR_RETURN(v, ParseString(value, where));
    }
    auto size = ParseSize(v);
    if (!size.ok()) return InvalidArgument(where + ": " + size.status().message());
    c->max_message_bytes = *size;
  } else if (key == "cuda_staging_bytes" || key == "cuda-staging-bytes") {
    std::string v = value;
    if (!from_flag && !v.empty() && v.front() == '"') {
      HIQ_ASSIGN_OR_RETURN(v, ParseString(value, where));
    }
    auto size = ParseSize(v);
    if (!size.ok()) return InvalidArgument(where + ": " + size.status().message());
    c->cuda_staging_bytes = *size;
  } else if (key == "release_timeout_ms" || key == "release-timeout-ms") {
    HIQ_ASSIGN_OR_RETURN(uint64_t v, ParseUint(value, where));
    c->release_timeout_ms = static_cast<uint32_t>(std::min<uint64_t>(v, 600000));
  } else if (key == "prefault") {
    HIQ_ASSIGN_OR_RETURN(c->prefault, ParseBool(value, where));
  } else if (key == "verify_reads_one_in" || key == "verify-reads-one-in") {
    HIQ_ASSIGN_OR_RETURN(uint64_t v, ParseUint(value, where));
    c->verify_reads_one_in = static_cast<uint32_t>(std::min<uint64_t>(v, 1u << 20));
  } else if (key == "allow_anonymous" || key == "allow-anonymous") {
    HIQ_ASSIGN_OR_RETURN(c->allow_anonymous, ParseBool(value, where));
  } else if (key == "admin_uids" || key == "admin-uids") {
    HIQ_ASSIGN_OR_RETURN(std::string list, str());
    c->admin_uids.clear();
    for (const std::string& item : SplitList(list)) {
      HIQ_ASSIGN_OR_RETURN(uint64_t uid, ParseUint(item, where));
      if (uid > 0xFFFFFFFEull) return InvalidArgument(where + ": uid " + item + " out of range");
      c->admin_uids.push_back(static_cast<uint32_t>(uid));
    }
  } else if (key == "admin_groups" || key == "admin-groups") {
    HIQ_ASSIGN_OR_RETURN(std::string list, str());
    c->admin_groups = SplitList(list);
  } else {
    return InvalidArgument(where + ": unknown setting '" + key + "'");
  }
  return Status::Ok();
}

}  // namespace

void ApplyCoreSettings(const DaemonConfig& c, CoreOptions* o) {
  o->namespace_scope = c.namespace_scope == "node"  ? NamespaceScope::kNode
                       : c.namespace_scope == "pod" ? NamespaceScope::kPod
                                                    : NamespaceScope::kUid;
  o->quotas.max_pools_per_client = c.max_pools_per_client;
  o->quotas.max_buffers_per_client = c.max_buffers_per_client;
  o->quotas.max_mapped_bytes_per_client = c.max_mapped_bytes_per_client;
  o->quotas.max_pending_bytes_per_client = c.max_pending_bytes_per_client;
  o->quotas.max_reserved_slots_per_client = c.max_reserved_slots_per_client;
  o->quotas.max_faulted_bytes_per_client = c.max_faulted_bytes_per_client;
  o->limits.max_repeated_rows_per_request = c.max_repeated_rows_per_request;
  o->limits.max_block_bytes = c.max_block_bytes;
  o->transfer_chunk_blocks = c.transfer_chunk_blocks;
  o->transfer_chunk_bytes = c.transfer_chunk_bytes;
}

namespace {

// A MAC key file (config key `key`): the whole file without a trailing newline, at least 32
// bytes, and no permission for group or others (it is the fleet's secret). "" = none.
Status ReadMacKey(const std::string& path, const char* key, std::string* out) {
  out->clear();
  if (path.empty()) return Status::Ok();
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return InvalidArgument(std::string(key) + ": cannot read '" + path + "'");
  }
  if ((st.st_mode & 077) != 0) {
    return InvalidArgument(std::string(key) + ": '" + path +
                           "' may be read by group or others; chmod 600 it (it is the fleet's "
                           "secret: whoever reads it can plant KV every daemon restores)");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgument(std::string(key) + ": cannot read '" + path + "'");
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  while (!out->empty() && (out->back() == '\n' || out->back() == '\r')) out->pop_back();
  if (out->size() < 32) {
    return InvalidArgument(std::string(key) + ": '" + path + "' holds " +
                           std::to_string(out->size()) +
                           " bytes; a key needs at least 32 (e.g. head -c 32 /dev/urandom)");
  }
  return Status::Ok();
}

}  // namespace

Status L3OptionsFromConfig(const DaemonConfig& c, L3Options* o) {
  o->seeds = c.l3_seeds;
  o->user = c.l3_user;
  o->password.clear();
  if (!c.l3_password_file.empty()) {
    std::ifstream in(c.l3_password_file);
    if (!in) {
      return InvalidArgument("l3_password_file: cannot read '" + c.l3_password_file + "'");
    }
    std::getline(in, o->password);
    while (!o->password.empty() && (o->password.back() == '\r' || o->password.back() == ' ')) {
      o->password.pop_back();
    }
    if (o->password.empty()) {
      return InvalidArgument("l3_password_file: '" + c.l3_password_file +
                             "' holds no password on its first line");
    }
  }
  HIQ_RETURN_IF_ERROR(ReadMacKey(c.l3_mac_key_file, "l3_mac_key_file", &o->mac_key));
  HIQ_RETURN_IF_ERROR(
      ReadMacKey(c.l3_mac_previous_key_file, "l3_mac_previous_key_file", &o->mac_previous_key));
  if (o->mac_key.empty() && !o->mac_previous_key.empty()) {
    return InvalidArgument("l3_mac_previous_key_file: needs l3_mac_key_file (the current key)");
  }
  o->key_prefix = c.l3_key_prefix;
  o->policy =
      c.l3_write_policy == "on_evict" ? L3WritePolicy::kOnEvict : L3WritePolicy::kWriteThrough;
  o->budget_bytes = c.l3_budget_bytes;
  o->ttl = std::chrono::milliseconds(uint64_t{c.l3_ttl} * 1000);
  o->connect_timeout = std::chrono::milliseconds(c.l3_connect_timeout_ms);
  o->command_timeout = std::chrono::milliseconds(c.l3_command_timeout_ms);
  o->lookup_deadline = std::chrono::milliseconds(c.l3_lookup_deadline_ms);
  o->fetch_deadline = std::chrono::milliseconds(c.l3_fetch_deadline_ms);
  o->write_queue_bytes = c.l3_write_queue_bytes;
  o->write_queue_blocks = c.l3_write_queue_blocks;
  o->writer_threads = c.l3_writer_threads;
  return Status::Ok();
}

const char* EmbeddedDefaultConfig() {
  return R"(# hiqcached embedded default configuration
# listen: unix sockets ("unix:///path") and/or TCP ("host:port"); empty = the default socket,
# $XDG_RUNTIME_DIR/hiqcache/hiqcached.sock or /tmp/hiqcache-$UID/hiqcached.sock
listen = []
pool_bytes = "4GiB"
shm_name = "/hiqcache-pool"
device = "auto"
metrics_listen = ""
log_level = "info"
socket_mode = "0660"
socket_group = ""
transfer_workers = 2
codec_threads = 0
wait_timeout_ms = 10000
max_blocks_per_request = 4096
max_message_bytes = "64MiB"
# Connections to the unix gRPC sockets: all users together (admins may open 64 more) and per
# uid; one over a bound is closed at once.
max_connections = 4096
max_connections_per_uid = 128
# Concurrent calls per gRPC connection, and the memory gRPC's buffers may hold in all.
max_streams_per_connection = 32
grpc_memory_bytes = "256MiB"
# Largest message from a process without a session (its calls are served apart, with an eighth of
# grpc_memory_bytes).
sessionless_message_bytes = "1MiB"
prefault = true
cuda_staging_bytes = "128MiB"
release_timeout_ms = 5000
# Admins besides root and the daemon's own user (comma-separated uids / group names).
admin_uids = ""
admin_groups = ""
# Callers without a session may register pools (no isolation between them): off.
allow_anonymous = false
# Restore verifies the checksum of one block read in N (1 = every read, 0 = never).
verify_reads_one_in = 32
# Who shares a namespace's blocks: "uid" (each user its own), "pod" (each user in each pod or
# container its own) or "node" (every caller, as before).
namespace_scope = "uid"
# Per-client quotas (client = uid; all callers without a session count as one client).
max_pools_per_client = 256
max_buffers_per_client = 8192
max_mapped_bytes_per_client = "16TiB"
max_pending_bytes_per_client = "64GiB"
max_reserved_slots_per_client = 16384
max_faulted_bytes_per_client = "4GiB"
max_repeated_rows_per_request = 1024
# Engine-side bytes of one block (the smallest unit of work) at most.
max_block_bytes = "64MiB"
# HOST requests run in sub-tasks of at most this many blocks / bytes, so clients share workers.
transfer_chunk_blocks = 64
transfer_chunk_bytes = "16MiB"
)";
}

StatusOr<uint64_t> ParseSize(const std::string& raw) {
  std::string text = Trim(raw);
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  if (i == 0 || i > 19) return InvalidArgument("size '" + raw + "': expected e.g. 8GiB");
  uint64_t n = std::stoull(text.substr(0, i));
  std::string unit;
  for (char c : Trim(text.substr(i))) unit += static_cast<char>(std::tolower(c));
  uint64_t mul = 1;
  if (unit.empty() || unit == "b")
    mul = 1;
  else if (unit == "k" || unit == "kib")
    mul = 1ull << 10;
  else if (unit == "m" || unit == "mib")
    mul = 1ull << 20;
  else if (unit == "g" || unit == "gib")
    mul = 1ull << 30;
  else if (unit == "t" || unit == "tib")
    mul = 1ull << 40;
  else if (unit == "kb")
    mul = 1000ull;
  else if (unit == "mb")
    mul = 1000000ull;
  else if (unit == "gb")
    mul = 1000000000ull;
  else if (unit == "tb")
    mul = 1000000000000ull;
  else
    return InvalidArgument("size '" + raw + "': unknown unit '" + unit + "'");
  uint64_t out;
  if (__builtin_mul_overflow(n, mul, &out)) return InvalidArgument("size '" + raw + "': too big");
  return out;
}

Status ApplyConfigText(const std::string& text, const std::string& source, DaemonConfig* c) {
  std::stringstream ss(text);
  std::string line;
  int lineno = 0;
  // Tables: [l3], whose keys are the l3_* settings without their prefix ("seeds" is l3_seeds),
  // and [hiqcached], the top-level settings (as if no table had been opened).
  std::string table;
  while (std::getline(ss, line)) {
    ++lineno;
    line = Trim(StripComment(line));
    if (line.empty()) continue;
    std::string where = source + ":" + std::to_string(lineno);
    if (line[0] == '[') {
      if (line.back() != ']') return InvalidArgument(where + ": malformed table header");
      table = Trim(line.substr(1, line.size() - 2));
      if (table == "hiqcached") {
        table.clear();
      } else if (table != "l3") {
        return InvalidArgument(where + ": unknown table [" + table +
                               "] (tables: [hiqcached], the top-level settings, and [l3])");
      }
      continue;
    }
    size_t eq = line.find('=');
    if (eq == std::string::npos) return InvalidArgument(where + ": expected key = value");
    std::string key = Trim(line.substr(0, eq));
    if (!table.empty()) {
      where += " [" + table + "]";
      key = table + "_" + key;
    }
    HIQ_RETURN_IF_ERROR(ApplyKey(key, Trim(line.substr(eq + 1)), where, c, false));
  }
  return Status::Ok();
}

std::string UsageText() {
  return "usage: hiqcached [--config FILE] [--listen ADDR]... [--pool-bytes SIZE]\n"
         "                 [--shm-name NAME] [--device auto|host|cuda]\n"
         "                 [--metrics-listen HOST:PORT] [--log-level debug|info|warn|error]\n"
         "                 [--socket-mode OCTAL] [--socket-group GROUP]\n"
         "                 [--admin-uids UID,...] [--admin-groups GROUP,...] [--allow-anonymous "
         "true|false]\n"
         "                 [--verify-reads-one-in N]\n"
         "                 [--cuda-staging-bytes SIZE] [--release-timeout-ms MS]\n"
         "                 [--namespace-scope uid|pod|node] [--max-pools-per-client N]\n"
         "                 [--max-buffers-per-client N] [--max-mapped-bytes-per-client SIZE]\n"
         "                 [--max-pending-bytes-per-client SIZE]\n"
         "                 [--max-reserved-slots-per-client N] [--max-faulted-bytes-per-client "
         "SIZE]\n"
         "                 [--max-repeated-rows-per-request N]\n"
         "                 [--transfer-chunk-blocks N] [--transfer-chunk-bytes SIZE]\n"
         "                 [--max-connections N] [--max-connections-per-uid N] [--max-block-bytes "
         "SIZE]\n"
         "                 [--max-streams-per-connection N] [--grpc-memory-bytes SIZE]\n"
         "                 [--sessionless-message-bytes SIZE]\n"
         "                 [--l3-seeds HOST:PORT,...] [--l3-user USER] [--l3-password-file FILE]\n"
         "                 [--l3-key-prefix TEXT] [--l3-ttl SECONDS]\n"
         "                 [--l3-write-policy write_through|on_evict] [--l3-budget-bytes SIZE]\n"
         "                 [--l3-lookup-deadline-ms MS] [--l3-fetch-deadline-ms MS]\n"
         "                 (each key K of the config's [l3] table is also a flag, --l3-K)\n"
         "                 [--print-default-config] [--check-config] [--version]\n"
         "ADDR: unix:///path/to.sock or host:port (repeatable). SIZE: 8GiB, 8GB, 8589934592.\n"
         "Without arguments hiqcached uses its embedded default configuration.\n";
}

StatusOr<DaemonConfig> LoadConfig(int argc, char** argv, bool* exit_now, std::string* message) {
  *exit_now = false;
  DaemonConfig c;
  HIQ_RETURN_IF_ERROR(ApplyConfigText(EmbeddedDefaultConfig(), "<embedded default>", &c));
  // Two passes: --config first, so flags override the file whatever their order.
  std::vector<std::pair<std::string, std::string>> flags;
  bool check_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      *exit_now = true;
      *message = UsageText();
      return c;
    }
    if (arg == "--version") {
      *exit_now = true;
      *message = "hiqcached " HIQ_VERSION "\n";
      return c;
    }
    if (arg == "--print-default-config") {
      *exit_now = true;
      *message = EmbeddedDefaultConfig();
      return c;
    }
    if (arg == "--check-config") {
      check_only = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) return InvalidArgument("unexpected argument '" + arg + "'");
    std::string key = arg.substr(2), value;
    size_t eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else {
      if (i + 1 >= argc) return InvalidArgument("--" + key + ": missing value");
      value = argv[++i];
    }
    flags.emplace_back(key, value);
  }
  bool listen_from_flags = false;
  for (const auto& [key, value] : flags) {
    if (key != "config") continue;
    std::ifstream in(value);
    if (!in) return InvalidArgument("--config: cannot read '" + value + "'");
    std::stringstream buf;
    buf << in.rdbuf();
    HIQ_RETURN_IF_ERROR(ApplyConfigText(buf.str(), value, &c));
  }
  for (const auto& [key, value] : flags) {
    if (key == "config") continue;
    if (key == "listen" && !listen_from_flags) {
      c.listen.clear();  // flags replace the file's listeners
      listen_from_flags = true;
    }
    HIQ_RETURN_IF_ERROR(ApplyKey(key, value, "--" + key, &c, true));
  }
  if (c.listen.empty()) c.listen.push_back(DefaultTarget());
  HIQ_RETURN_IF_ERROR(Validate(c));
  if (check_only) {
    *exit_now = true;
    *message = "# hiqcached: configuration OK; effective settings:\n" + RenderConfig(c);
  }
  return c;
}

std::string RenderConfig(const DaemonConfig& c) {
  auto q = [](const std::string& s) { return "\"" + s + "\""; };
  std::string listen;
  for (const auto& a : c.listen) listen += (listen.empty() ? "" : ", ") + q(a);
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", c.socket_mode);
  std::string out;
  out += "listen = [" + listen + "]\n";
  out += "pool_bytes = " + std::to_string(c.pool_bytes) + "\n";
  out += "shm_name = " + q(c.shm_name) + "\n";
  out += "device = " + q(c.device) + "\n";
  out += "metrics_listen = " + q(c.metrics_listen) + "\n";
  out += "log_level = " + q(c.log_level) + "\n";
  out += "socket_mode = " + q(mode) + "\n";
  out += "socket_group = " + q(c.socket_group) + "\n";
  out += "transfer_workers = " + std::to_string(c.transfer_workers) + "\n";
  out += "codec_threads = " + std::to_string(c.codec_threads) + "\n";
  out += "wait_timeout_ms = " + std::to_string(c.wait_timeout_ms) + "\n";
  out += "max_blocks_per_request = " + std::to_string(c.max_blocks_per_request) + "\n";
  out += "max_message_bytes = " + std::to_string(c.max_message_bytes) + "\n";
  out += "max_connections = " + std::to_string(c.max_connections) + "\n";
  out += "max_connections_per_uid = " + std::to_string(c.max_connections_per_uid) + "\n";
  out += "max_streams_per_connection = " + std::to_string(c.max_streams_per_connection) + "\n";
  out += "grpc_memory_bytes = " + std::to_string(c.grpc_memory_bytes) + "\n";
  out += "sessionless_message_bytes = " + std::to_string(c.sessionless_message_bytes) + "\n";
  out += "prefault = " + std::string(c.prefault ? "true" : "false") + "\n";
  out += "cuda_staging_bytes = " + std::to_string(c.cuda_staging_bytes) + "\n";
  out += "release_timeout_ms = " + std::to_string(c.release_timeout_ms) + "\n";
  std::string uids, groups;
  for (uint32_t u : c.admin_uids) uids += (uids.empty() ? "" : ",") + std::to_string(u);
  for (const auto& g : c.admin_groups) groups += (groups.empty() ? "" : ",") + g;
  out += "admin_uids = " + q(uids) + "\n";
  out += "admin_groups = " + q(groups) + "\n";
  out += "allow_anonymous = " + std::string(c.allow_anonymous ? "true" : "false") + "\n";
  out += "verify_reads_one_in = " + std::to_string(c.verify_reads_one_in) + "\n";
  out += "namespace_scope = " + q(c.namespace_scope) + "\n";
  out += "max_pools_per_client = " + std::to_string(c.max_pools_per_client) + "\n";
  out += "max_buffers_per_client = " + std::to_string(c.max_buffers_per_client) + "\n";
  out += "max_mapped_bytes_per_client = " + std::to_string(c.max_mapped_bytes_per_client) + "\n";
  out += "max_pending_bytes_per_client = " + std::to_string(c.max_pending_bytes_per_client) + "\n";
  out +=
      "max_reserved_slots_per_client = " + std::to_string(c.max_reserved_slots_per_client) + "\n";
  out += "max_faulted_bytes_per_client = " + std::to_string(c.max_faulted_bytes_per_client) + "\n";
  out += "max_block_bytes = " + std::to_string(c.max_block_bytes) + "\n";
  out +=
      "max_repeated_rows_per_request = " + std::to_string(c.max_repeated_rows_per_request) + "\n";
  out += "transfer_chunk_blocks = " + std::to_string(c.transfer_chunk_blocks) + "\n";
  out += "transfer_chunk_bytes = " + std::to_string(c.transfer_chunk_bytes) + "\n";
  std::string seeds;
  for (const auto& s : c.l3_seeds) seeds += (seeds.empty() ? "" : ",") + s;
  out += "l3_seeds = " + q(seeds) + "\n";
  out += "l3_user = " + q(c.l3_user) + "\n";
  out += "l3_password_file = " + q(c.l3_password_file) + "\n";
  out += "l3_mac_key_file = " + q(c.l3_mac_key_file) + "\n";
  out += "l3_mac_previous_key_file = " + q(c.l3_mac_previous_key_file) + "\n";
  out += "tls_cert_file = " + q(c.tls_cert_file) + "\n";
  out += "tls_key_file = " + q(c.tls_key_file) + "\n";
  out += "tls_client_ca_file = " + q(c.tls_client_ca_file) + "\n";
  out += "l3_key_prefix = " + q(c.l3_key_prefix) + "\n";
  out += "l3_write_policy = " + q(c.l3_write_policy) + "\n";
  out += "l3_ttl = " + std::to_string(c.l3_ttl) + "\n";
  out += "l3_budget_bytes = " + std::to_string(c.l3_budget_bytes) + "\n";
  out += "l3_connect_timeout_ms = " + std::to_string(c.l3_connect_timeout_ms) + "\n";
  out += "l3_command_timeout_ms = " + std::to_string(c.l3_command_timeout_ms) + "\n";
  out += "l3_lookup_deadline_ms = " + std::to_string(c.l3_lookup_deadline_ms) + "\n";
  out += "l3_fetch_deadline_ms = " + std::to_string(c.l3_fetch_deadline_ms) + "\n";
  out += "l3_write_queue_bytes = " + std::to_string(c.l3_write_queue_bytes) + "\n";
  out += "l3_write_queue_blocks = " + std::to_string(c.l3_write_queue_blocks) + "\n";
  out += "l3_writer_threads = " + std::to_string(c.l3_writer_threads) + "\n";
  return out;
}

}  // namespace hiqcache::server
