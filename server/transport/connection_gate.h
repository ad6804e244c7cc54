// ConnectionGate: the daemon's end of the unix gRPC sockets, where a connection is counted
// against its user before gRPC takes it.
//
// gRPC keeps every connection it accepts for as long as the peer holds it, and each costs the
// daemon a descriptor and transport memory whether or not a call ever comes. So the gate accepts
// on the gRPC socket paths itself, reads the peer's uid (SO_PEERCRED), and hands the connection
// to gRPC (grpc::AddInsecureChannelFromFd) only while that uid holds fewer than
// max_connections_per_uid and everyone together fewer than max_connections; admins may use
// admin_reserve more beyond that, so root's `hiqctl` connects to a daemon that others filled.
// A connection over a bound is closed at once (the client's call fails UNAVAILABLE) and logged,
// at most once per uid every 10 s.
//
// The gate learns that gRPC closed a connection lazily: when a bound would refuse one, it
// counts again the sockets it handed over that the process still holds (their inodes in
// /proc/self/fd), at most every 200 ms (so that a flood of connections costs the daemon one count
// per 200 ms, not one per connection). A connection refused within 200 ms of the last count
// waits for the next one (at most 2 per uid and 64 in all wait; beyond that it is refused), so
// a connection is never refused for closes the gate has not counted yet, and never admitted
// over a bound.
//
// Out of descriptors (EMFILE), the gate still takes the connection off the backlog (with a
// descriptor kept in reserve) and closes it, so that a full table does not leave clients
// waiting in the kernel's queue. Thread-safe.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "hiqcache/status.h"

namespace hiqcache::server {

struct ConnectionLimits {
  size_t max_connections = 4096;
  size_t max_connections_per_uid = 128;
  size_t admin_reserve = 64;
};

class ConnectionGate {
 public:
  // Takes ownership of a connected, non-blocking socket.
  using HandOff = std::function<void(int fd)>;
  using IsAdmin = std::function<bool(const ucred& peer)>;

  // Listens on each of `paths` (absolute unix socket paths; a stale socket file there is
  // replaced) with `mode` and group `gid` (-1: the daemon's). Accepts nothing before Start.
  static StatusOr<std::unique_ptr<ConnectionGate>> Listen(const std::vector<std::string>& paths,
                                                          const ConnectionLimits& limits,
                                                          mode_t mode, gid_t gid,
                                                          IsAdmin is_admin);
  // Stops accepting and unlinks the socket files; connections already handed over stay gRPC's.
  ~ConnectionGate();
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;

  // Starts accepting, handing each admitted connection to `hand_off` (on the gate's thread).
  void Start(HandOff hand_off);

  // Connections handed over and not yet seen closed, and connections refused so far.
  size_t Open() const;
  uint64_t Refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  ConnectionGate(const ConnectionLimits& limits, IsAdmin is_admin);
  struct Pending {
    int fd = -1;
    ucred cred{};
    uint64_t inode = 0;
    bool admin_checked = false, admin = false;
  };
  void Loop();
  void Accept(int listen_fd);
  void Admit(const Pending& p);
  void Refuse(const Pending& p);
  // Counts again (when 200 ms have passed) and admits or refuses every deferred connection.
  void DecideDeferred();
  // REQUIRES: mu_ held. Forgets the connections the process no longer holds.
  void RecountLocked();
  // REQUIRES: mu_ held. Whether a connection of (uid, gid) fits the bounds as counted.
  bool FitsLocked(const ucred& peer, bool* admin_checked, bool* admin);

  const ConnectionLimits limits_;
  const IsAdmin is_admin_;
  HandOff hand_off_;
  std::vector<std::string> paths_;
  std::vector<int> listen_fds_;
  int wake_fd_ = -1;     // eventfd: stops the loop
  int reserve_fd_ = -1;  // kept open, given up to refuse a connection when out of descriptors

  mutable std::mutex mu_;
  std::unordered_map<uint64_t, uid_t> open_;  // GUARDED_BY(mu_): socket inode -> peer uid
  std::map<uid_t, size_t> per_uid_;           // GUARDED_BY(mu_)
  std::chrono::steady_clock::time_point last_recount_;                      // GUARDED_BY(mu_)
  std::map<uid_t, std::chrono::steady_clock::time_point> last_refusal_log_;  // GUARDED_BY(mu_)
  std::map<uid_t, uint64_t> unlogged_refusals_;                              // GUARDED_BY(mu_)
  std::atomic<uint64_t> refused_{0};
  std::vector<Pending> deferred_;           // the loop thread's only
  std::map<uid_t, size_t> deferred_per_uid_;  // the loop thread's only
  std::thread loop_;
};

}  // namespace hiqcache::server
