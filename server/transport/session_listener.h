// SessionListener: the daemon's end of the session sockets (hiqcache/session_protocol.h), where
// the kernel tells who a client is and a client hands the daemon file descriptors.
//
// gRPC names no process: a call's peer on a unix socket is just the socket's path. So each unix
// gRPC socket PATH has a SOCK_SEQPACKET socket PATH.session beside it. A client connects once;
// SO_PEERCRED of that connection (pid, uid, gid, as the kernel saw them at connect time) is the
// caller of every RPC that carries the session's token, and the connection closing (the client
// exited or died: the kernel closes its fds) ends the session: its unconsumed fds are closed and
// `on_end` releases the pools registered through it, on a thread of its own so that a slow
// release never delays accepting or serving other sessions.
//
// Admins: uid 0, the daemon's effective uid, and the configured uids and groups (a session is an
// admin when its uid, primary gid or any supplementary group of its user is listed), provided it
// is a process of the host itself (in the daemon's pid namespace and in no pod or container) or
// of the daemon's own pod or container (`kubectl exec` into the DaemonSet's pod):
// peer_placement.h. uid 0 inside an engine's container or pod, or a peer whose pid the daemon
// cannot see, is no admin. Each session also records its caller's pod (Caller::pod), read at
// connect time.
//
// Bounds: at most max_sessions sessions, max_sessions_per_uid per uid, kMaxHeldFdsPerSession
// unconsumed fds per session and max_held_fds_per_uid per uid; a connection over a bound is
// answered "ERR" and closed, an FDS message over it is answered "ERR" and its fds closed.
// Thread-safe.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/requests.h"
#include "hiqcache/mutex.h"
#include "hiqcache/status.h"
#include "transport/peer_placement.h"

namespace hiqcache::server {

struct SessionOptions {
  std::vector<uid_t> admin_uids;  // besides 0 and the daemon's euid
  std::vector<gid_t> admin_gids;
  uint32_t socket_mode = 0660;
  gid_t socket_gid = static_cast<gid_t>(-1);  // -1: keep the daemon's group
  size_t max_sessions = 8192;
  size_t max_sessions_per_uid = 1024;
  // Unconsumed fds the sessions of one uid hold together (each session at most
  // kMaxHeldFdsPerSession): what keeps one user from filling the daemon's fd table.
  size_t max_held_fds_per_uid = 16384;
};

class SessionListener {
 public:
  using EndFn = std::function<void(uint64_t session)>;

  // Creates the socket files `paths` (absolute session socket paths; a stale socket file there
  // is replaced), with the options' mode and group, bound but refusing connections until Open:
  // the daemon's services take the listener's pointer first, so that a session socket that
  // accepts means a daemon that serves. `on_end` runs once per ended session, on the listener's
  // release thread; it must be thread-safe and may block.
  static StatusOr<std::unique_ptr<SessionListener>> Bind(const std::vector<std::string>& paths,
                                                         const SessionOptions& options,
                                                         EndFn on_end);
  // Listens and starts accepting. Call once.
  Status Open();
  // Bind, then Open.
  static StatusOr<std::unique_ptr<SessionListener>> Start(const std::vector<std::string>& paths,
                                                          const SessionOptions& options,
                                                          EndFn on_end);
  // Stops accepting, closes every session (without calling on_end for them) and unlinks the
  // socket files.
  ~SessionListener();
  SessionListener(const SessionListener&) = delete;
  SessionListener& operator=(const SessionListener&) = delete;

  // The caller `token` (32 lower-case hex digits) names, or nullopt-like Caller{} with session 0
  // when it names no live session.
  Caller Authenticate(std::string_view token) const;

  // The fds of one RegisterPool, taken out of their session: the holder owns them and closes them
  // when it is destroyed (the daemon's mappings keep the objects alive).
  class TakenFds {
   public:
    TakenFds() = default;
    TakenFds(TakenFds&& other) noexcept : fds_(std::move(other.fds_)) { other.fds_.clear(); }
    TakenFds& operator=(TakenFds&& other) noexcept {
      std::swap(fds_, other.fds_);  // ours close with `other`
      return *this;
    }
    TakenFds(const TakenFds&) = delete;
    ~TakenFds();
    // The fd taken for `id`, or -1 when the session held no fd with that id.
    int Get(uint64_t id) const;

   private:
    friend class SessionListener;
    std::map<uint64_t, int> fds_;
  };
  // Takes the fds `ids` of `session` (ids it does not hold are skipped: Get answers -1).
  TakenFds TakeFds(uint64_t session, const std::vector<uint64_t>& ids);

  size_t SessionCount() const;
  // Whether the process `peer` (SO_PEERCRED of another socket: same pid and uid) holds an open
  // session. A pid the daemon cannot see (0) matches a session of the same uid whose pid it
  // could not see either.
  bool HasSession(const ucred& peer) const;

  // Whether the peer `cred` (SO_PEERCRED) is an admin (see above).
  bool IsAdminPeer(const ucred& cred) const;

 private:
  struct Session {
    uint64_t id = 0;
    int fd = -1;
    Caller caller;
    std::string token;
    uint64_t next_fd_id = 1;
    // Guarded by the listener's mu_ (not annotated: the analysis cannot name another object's
    // lock from here).
    std::map<uint64_t, int> fds;
  };

  SessionListener(SessionOptions options, EndFn on_end);
  void Loop();
  void ReleaseLoop();
  void Accept(int listen_fd);
  // Reads one message of `s`; false when the session ended (or must end).
  bool Serve(Session* s);
  void Reply(int fd, const std::string& text);
  // Forgets `s`, closes its fds and queues its end.
  void EndLocked(uint64_t id) REQUIRES(mu_);
  // `n` fds of `uid`'s sessions were taken or closed.
  void ForgetHeldLocked(uid_t uid, size_t n) REQUIRES(mu_);
  bool IsAdmin(uid_t uid, gid_t gid) const;
  // Whether a process placed at `where` may hold admin rights (see above).
  bool MayAdminister(const PeerPlacement& where) const;

  const SessionOptions options_;
  const EndFn on_end_;
  const std::string own_pod_;  // the daemon's own pod or container ("" on the host)
  std::vector<std::string> paths_;
  std::vector<int> listen_fds_;
  int wake_fd_ = -1;  // eventfd: stops the loop

  mutable Mutex mu_;
  std::map<uint64_t, std::unique_ptr<Session>> sessions_ GUARDED_BY(mu_);
  std::unordered_map<std::string, uint64_t> by_token_ GUARDED_BY(mu_);
  std::map<uid_t, size_t> per_uid_ GUARDED_BY(mu_);
  std::map<std::pair<uid_t, pid_t>, size_t> per_process_ GUARDED_BY(mu_);
  std::map<uid_t, size_t> held_fds_per_uid_ GUARDED_BY(mu_);
  uint64_t next_session_ GUARDED_BY(mu_) = 1;
  std::deque<uint64_t> ended_ GUARDED_BY(mu_);
  CondVar ended_cv_;
  bool stop_ GUARDED_BY(mu_) = false;

  std::thread loop_;
  std::thread releaser_;
};

}  // namespace hiqcache::server
