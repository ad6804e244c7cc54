// hiqcached's configuration: the embedded default, the config file, and the command line
// (docs/design.md "Command line"). Flags override the file, which overrides the default.
//
// The file is a small TOML subset: `key = value` lines, strings in double quotes, integers,
// sizes as strings ("8GiB"), string arrays (`listen = ["unix:///run/hiqcache/hiqcached.sock"]`),
// `#` comments. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hiqcache/status.h"

namespace hiqcache::server {

struct DaemonConfig {
  std::vector<std::string> listen;  // "unix:///path" or "host:port"
  uint64_t pool_bytes = 0;
  std::string shm_name;
  std::string device;  // auto | host | cuda
  std::string metrics_listen;
  std::string log_level;
  uint32_t socket_mode = 0660;
  std::string socket_group;       // group name or number the unix sockets are chowned to; "" = keep
  uint32_t transfer_workers = 0;  // 0 = automatic
  uint32_t codec_threads = 0;     // 0 = every core
  uint32_t wait_timeout_ms = 0;
  uint32_t max_blocks_per_request = 0;
  uint64_t max_message_bytes = 0;
  // Connections to the unix gRPC sockets (ConnectionGate): all users together, and per uid.
  uint32_t max_connections = 0;
  uint32_t max_connections_per_uid = 0;
  // gRPC: concurrent calls per connection, and the memory all its buffers may hold.
  uint32_t max_streams_per_connection = 0;
  uint64_t grpc_memory_bytes = 0;
  // Largest message a call on a unix connection of a process without a session may send
  // (connection_gate.h).
  uint64_t sessionless_message_bytes = 0;
  bool prefault = true;
  // GPU memory per device for the CUDA backend's staging slabs, allocated when the first pool
  // binds to the device (CudaBackendOptions::staging_bytes).
  uint64_t cuda_staging_bytes = 0;
  // How long ReleasePool (and a client's death) waits for the pool's device work.
  uint32_t release_timeout_ms = 0;
  // Admins (Drain, and any pool's ReleasePool) besides uid 0 and the daemon's own uid: uids, and
  // groups (names or numbers) whose members are admins. Comma-separated in file and flags.
  std::vector<uint32_t> admin_uids;
  std::vector<std::string> admin_groups;
  // Whether callers without a session (session_protocol.h) may register and use pools. Off: every
  // caller must be identified by the kernel. On: anonymous pools are shared by every anonymous
  // caller (and TCP listeners serve them), which is no isolation at all.
  bool allow_anonymous = false;
  // Restore verifies the checksum of one block read in this many (1 = every read, 0 = never):
  // StoreOptions::verify_reads_one_in.
  uint32_t verify_reads_one_in = 32;
  // Who shares a namespace: "uid" (each user its own; the default), "pod" (each user in each
  // pod or container its own) or "node" (every caller, as daemons before scopes: their warm
  // pools stay readable). CoreOptions::namespace_scope.
  std::string namespace_scope;
  // Per-client quotas (client = uid; every anonymous caller together is one): CoreOptions::quotas.
  uint32_t max_pools_per_client = 0;
  uint32_t max_buffers_per_client = 0;
  uint64_t max_mapped_bytes_per_client = 0;
  uint64_t max_pending_bytes_per_client = 0;
  uint32_t max_reserved_slots_per_client = 0;
  uint64_t max_faulted_bytes_per_client = 0;
  // Per-request limit: Limits::max_repeated_rows_per_request.
  uint32_t max_repeated_rows_per_request = 0;
  // Engine-side bytes of one block at most: Limits::max_block_bytes.
  uint64_t max_block_bytes = 0;
  // HOST sub-task size (fair service): CoreOptions::transfer_chunk_blocks / _bytes.
  uint32_t transfer_chunk_blocks = 0;
  uint64_t transfer_chunk_bytes = 0;
  // TLS for TCP listeners (PEM files, read at start-up): a TCP address that is not loopback is
  // served only with a certificate and key, and refused at start-up without them. With
  // tls_client_ca_file, clients must present a certificate that CA signed (mutual TLS).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // The store beyond the node (docs/design.md "Beyond one node (L3)"): off while l3_seeds is empty.
  // Not in the embedded default; these are its defaults (deploy/hiqcached.toml documents each).
  std::vector<std::string> l3_seeds;  // host:port of any Redis Cluster nodes (comma-separated)
  std::string l3_user;                // ACL user ("" = AUTH with the password alone)
  std::string l3_password_file;       // first line = the password ("" = no AUTH)
  // The fleet's secret for authenticating values (HMAC-SHA-256): the whole file, at least 32
  // bytes, readable by the daemon's user only; the previous key is accepted on reads (rotation).
  std::string l3_mac_key_file;
  std::string l3_mac_previous_key_file;
  std::string l3_key_prefix = "hiq:";
  std::string l3_write_policy = "write_through";  // or "on_evict"
  uint32_t l3_ttl = 0;                            // seconds; 0 = no expiry
  uint64_t l3_budget_bytes = 0;  // value bytes of this daemon in L3; 0 = the cluster's maxmemory
  uint32_t l3_connect_timeout_ms = 200;
  uint32_t l3_command_timeout_ms = 200;
  uint32_t l3_lookup_deadline_ms = 5;
  uint32_t l3_fetch_deadline_ms = 500;  // a 2,048-token Qwen3-8B int8 prefix with margin
  uint64_t l3_write_queue_bytes = 1ull << 30;
  uint32_t l3_write_queue_blocks = 4096;
  uint32_t l3_writer_threads = 2;
};

// Whether the gRPC listen address `addr` is a unix socket or a TCP address on loopback
// (127.0.0.0/8, ::1, localhost): reachable only from this node, so served without TLS.
bool IsLocalAddress(const std::string& addr);

struct L3Options;  // l3_tier.h

// The L3 tier's options from `config` (l3_password_file read here). REQUIRES: l3_seeds is set.
// Errors name the key (an unreadable or empty password file).
Status L3OptionsFromConfig(const DaemonConfig& config, L3Options* options);

struct CoreOptions;  // cache_core.h

// Copies the settings the core applies itself (namespace_scope, quotas, repeated rows per
// request, HOST sub-task size) into `options`. REQUIRES: `config` came from LoadConfig.
void ApplyCoreSettings(const DaemonConfig& config, CoreOptions* options);

// The configuration compiled into the binary: `hiqcached` with no arguments uses it.
const char* EmbeddedDefaultConfig();

// Parses "8GiB", "8GB", "512MiB", "8589934592" (binary and decimal suffixes, case-insensitive).
StatusOr<uint64_t> ParseSize(const std::string& text);

// Applies the settings of a config file's text onto `config`.
Status ApplyConfigText(const std::string& text, const std::string& source, DaemonConfig* config);

// Builds the configuration from argv: the embedded default, then --config FILE, then the other
// flags. Sets `*exit_now` (exit 0) and `*message`: the usage for --help, "hiqcached X.Y.Z" for
// --version, the embedded default for --print-default-config, the effective configuration for
// --check-config (after validating it).
StatusOr<DaemonConfig> LoadConfig(int argc, char** argv, bool* exit_now, std::string* message);

std::string UsageText();

// `config` in the config file's syntax (what --check-config prints).
std::string RenderConfig(const DaemonConfig& config);

}  // namespace hiqcache::server
