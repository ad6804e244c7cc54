// RedisCluster: a small synchronous client of a Redis Cluster, the L3 store of docs/design.md
// "Beyond one node (L3)", over hiredis 0.14 (RESP2, blocking sockets with timeouts).
//
// What it does, and nothing more: key slots (CRC16 of the key or of its {hash tag}); the slot map
// from CLUSTER SLOTS, asked of any reachable node; one connection per master, opened lazily with
// a connect timeout and AUTH (ACL user + password, or a password alone); MOVED (the slot is
// remapped and the map refreshed, then the command retried) and ASK (ASKING + the command, once,
// at the node named) redirections, at most `max_redirects` per key; a node that fails (refused,
// reset, timed out) is disconnected, the map refreshed (so a promoted replica takes over its
// slots), and the node reconnected only after an exponential backoff. Commands: GET, EXISTS,
// SET (optional PX ttl), DEL, and pipelined multi-key GET / EXISTS grouped by node: every node
// works at once, each with a window of requests in flight (all EXISTS; GETs up to
// `pipeline_bytes` of values, at least 2), topped up as its replies arrive (poll over the nodes'
// sockets), so that large values stream without piling up in the servers' output buffers.
// Every call has a deadline: it returns by then (plus one socket timeout at most; a pipelined
// read stops at the deadline itself), with UNAVAILABLE or DEADLINE_EXCEEDED for what it could
// not do.
// Reads go to masters only, so a value read is the latest write the master acknowledged.
//
// A connection the server closed while idle (timeout, CLIENT KILL, restart) is reopened at once;
// only a fresh connection's failure puts a node in backoff. SIGPIPE from writing to a closed
// socket is blocked in the calling thread for the duration of a call and discarded.
//
// Thread-safety: none. One instance per thread (each has its own connections); calls on one
// instance must not overlap. Move-only (it owns sockets).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hiqcache/status.h"

namespace hiqcache::server::l3 {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

constexpr uint16_t kClusterSlots = 16384;

// The cluster slot of `key`: CRC16-XMODEM of the key, or of the text between the first '{' and
// the next '}' when that is non-empty, modulo 16384 (the Redis Cluster spec).
uint16_t KeySlot(std::string_view key);

struct RedisClusterOptions {
  std::vector<std::string> seeds;  // "host:port" of any nodes; the rest are learnt
  std::string user;                // ACL user; empty: AUTH with the password alone
  std::string password;            // empty: no AUTH
  Millis connect_timeout{200};
  Millis command_timeout{200};   // socket read/write timeout of one round trip
  Millis default_deadline{500};  // calls without a deadline get now + this
  int max_redirects = 5;         // per key and call
  Millis backoff_min{20};        // after a node's first failure; doubles per failure
  Millis backoff_max{1000};
  Millis min_refresh_interval{50};  // slot map refreshes on errors come at most this often
  // Multi-key calls keep at most this many reply bytes in flight per node (judged by the
  // largest value seen so far in the call), and never fewer than 2 requests.
  size_t pipeline_bytes = 8 << 20;
  // The longest value a reply may carry; a longer one fails its key (RESOURCE_EXHAUSTED)
  // before anything is allocated for it, and its connection is dropped. MultiGet may lower it
  // per call.
  size_t max_value_bytes = 512 << 20;
};

struct RedisClusterStats {
  uint64_t commands = 0;        // commands sent (ASKING included)
  uint64_t moved = 0;           // MOVED replies
  uint64_t ask = 0;             // ASK replies
  uint64_t slot_refreshes = 0;  // CLUSTER SLOTS answered
  uint64_t connects = 0;        // connections opened (AUTH included)
  uint64_t node_failures = 0;   // connections lost or refused
  uint64_t errors = 0;          // calls (or keys of a multi-key call) that returned an error
};

// One key of a multi-key call.
struct KeyResult {
  Status status;  // OK: `found` is the answer
  bool found = false;
  std::string value;  // GET only, when found
};

class RedisCluster {
 public:
  // Connects to the seeds in turn until one answers CLUSTER SLOTS, and loads the slot map from
  // it. Fails (UNAVAILABLE) when none does within `connect_timeout` each, UNAUTHENTICATED when
  // AUTH is refused, INVALID_ARGUMENT for a malformed seed. Slots the map leaves unassigned fail
  // their commands with UNAVAILABLE.
  static StatusOr<RedisCluster> Open(RedisClusterOptions options);
  RedisCluster(RedisCluster&&) noexcept;
  RedisCluster& operator=(RedisCluster&&) noexcept;
  ~RedisCluster();

  // Deadline of a call: now + options.default_deadline when unset.
  using Deadline = std::optional<Clock::time_point>;

  // The value, nullopt when the key does not exist.
  StatusOr<std::optional<std::string>> Get(std::string_view key, Deadline deadline = {});
  StatusOr<bool> Exists(std::string_view key, Deadline deadline = {});
  // `ttl` zero: no expiry; else PX ttl.
  Status Set(std::string_view key, std::string_view value, Millis ttl = Millis(0),
             Deadline deadline = {});
  // Whether the key existed.
  StatusOr<bool> Del(std::string_view key, Deadline deadline = {});

  // One result per key, in order; keys are grouped by node and each node's commands pipelined.
  // A key whose node is down or that ran out of redirects or time has a non-OK status; the
  // others are answered. The call as a whole returns by the deadline.
  // `max_value_bytes` (0 = options.max_value_bytes): a longer value fails its key.
  std::vector<KeyResult> MultiGet(std::span<const std::string> keys, Deadline deadline = {},
                                  size_t max_value_bytes = 0);
  std::vector<KeyResult> MultiExists(std::span<const std::string> keys, Deadline deadline = {});

  // Reloads the slot map now (from any reachable node).
  Status RefreshSlots(Deadline deadline = {});
  // "host:port" of the master the map names for `slot` (empty when unknown).
  std::string MasterOf(uint16_t slot) const;
  const RedisClusterStats& stats() const;

 private:
  struct Impl;
  explicit RedisCluster(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hiqcache::server::l3
