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
// The gate keeps a duplicate of each connection it handed over, watched for the peer hanging up
// (EPOLLRDHUP): a client that closes or dies is uncounted at once. A connection gRPC closed
// itself is found when a bound would refuse one, at most once a second, by counting the
// connections whose socket the process holds only through the gate's duplicate (in
// /proc/self/fd); the gate then closes its duplicate too. So each admitted connection costs two
// descriptors (hiqcached_main.cc sizes max_connections to that).
//
// Calls without a session are served apart: a connection whose process holds no open session
// when it connects (SessionListener::HasSession) goes to a second gRPC server, with
// sessionless_message_bytes as its message limit, a resource quota of its own and connections
// that gRPC ends gracefully (GOAWAY) after a few seconds, so a stranger who never opens a session
// uses none of the memory the engines' calls need and holds a stalled call for seconds only. A
// process that connected before opening its session reaches the full server at its next
// connection; engines open their session before their first call.
//
// Out of descriptors (EMFILE), the gate still takes the connection off the backlog (with a
// descriptor kept in reserve) and closes it, so that a full table does not leave clients
// waiting in the kernel's queue. Thread-safe.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "hiqcache/mutex.h"
#include "hiqcache/status.h"

namespace hiqcache::server {

struct ConnectionLimits {
  size_t max_connections = 4096;
  size_t max_connections_per_uid = 128;
  size_t admin_reserve = 64;
};

class ConnectionGate {
 public:
  // Takes ownership of a connected, non-blocking socket; `sessionless`: its process held no
  // session when it connected.
  using HandOff = std::function<void(int fd, bool sessionless)>;
  using IsAdmin = std::function<bool(const ucred& peer)>;
  using HasSession = std::function<bool(const ucred& peer)>;

  // Listens on each of `paths` (absolute unix socket paths; a stale socket file there is
  // replaced) with `mode` and group `gid` (-1: the daemon's). Accepts nothing before Start.
  static StatusOr<std::unique_ptr<ConnectionGate>> Listen(const std::vector<std::string>& paths,
                                                          const ConnectionLimits& limits,
                                                          mode_t mode, gid_t gid, IsAdmin is_admin);
  // Stops accepting and unlinks the socket files; connections already handed over stay gRPC's.
  ~ConnectionGate();
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;

  // Starts accepting, handing each admitted connection to `hand_off` (on the gate's thread).
  // `has_session` (null: every connection has one) is asked once per connection, without the
  // gate's lock.
  void Start(HandOff hand_off, HasSession has_session = nullptr);

 private:
  struct Tracked {
    uint64_t inode = 0;
    uid_t uid = 0;
  };
  ConnectionGate(const ConnectionLimits& limits, IsAdmin is_admin);
  void Loop();
  void Accept(int listen_fd);
  void Refuse(int fd, const ucred& peer);
  // Uncounts the connection whose duplicate is `dup` and closes that.
  void ForgetLocked(int dup) REQUIRES(mu_);
  // Forgets the connections gRPC closed (held only through the duplicate).
  void RecountLocked() REQUIRES(mu_);
  // Whether a connection of `peer` fits the bounds as counted.
  bool FitsLocked(const ucred& peer, bool* admin_checked, bool* admin) REQUIRES(mu_);

  const ConnectionLimits limits_;
  const IsAdmin is_admin_;
  HandOff hand_off_;
  HasSession has_session_;
  std::vector<std::string> paths_;
  std::vector<int> listen_fds_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;     // eventfd: stops the loop
  int reserve_fd_ = -1;  // kept open, given up to refuse a connection when out of descriptors

  Mutex mu_;
  std::unordered_map<int, Tracked> open_ GUARDED_BY(mu_);  // duplicate fd -> its connection
  std::map<uid_t, size_t> per_uid_ GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point last_recount_ GUARDED_BY(mu_);
  std::map<uid_t, std::chrono::steady_clock::time_point> last_refusal_log_ GUARDED_BY(mu_);
  std::map<uid_t, uint64_t> unlogged_refusals_ GUARDED_BY(mu_);
  std::thread loop_;
};

}  // namespace hiqcache::server
