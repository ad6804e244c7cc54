// hiqcache::Session: a client's session with hiqcached (common/hiqcache/session_protocol.h).
//
// gRPC tells the daemon neither which process called nor carries file descriptors, so beside its
// unix gRPC socket PATH the daemon listens on PATH.session (SOCK_SEQPACKET). A Session is one
// connection to it: the kernel's credentials of the connection (SO_PEERCRED) are the caller's
// identity for as long as it stays open, the greeting hands out a token that every gRPC call
// carries as metadata, and SendFds passes the fds of HOST buffers and event objects (SCM_RIGHTS)
// so that the daemon never opens a client's memory by name with its own rights. Closing the
// session (this object's destruction, or the process dying) makes the daemon release every pool
// registered through it. A TCP target has no session: its callers are anonymous.
//
// The token is a bearer secret: whoever holds it acts as this process. Do not log it or hand it
// to processes you do not trust.
//
// Thread-safety: all methods are safe to call concurrently; SendFds calls are serialized (a
// mutex around each request and its answer). Move-free: hold it by unique_ptr or shared_ptr.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "hiqcache/status.h"

namespace hiqcache {

class Session {
 public:
  // Connects to the session socket of `target` ("unix:///abs.sock", "unix:/abs.sock" or an
  // absolute socket path) and reads the daemon's greeting, all within `timeout`.
  // FAILED_PRECONDITION for a target with no session (TCP) or a greeting of another protocol
  // version; UNAVAILABLE when nothing listens there (daemon down, or a daemon that predates
  // sessions); INVALID_ARGUMENT for a socket path too long for sockaddr_un; PERMISSION_DENIED
  // when the listener is not one this process trusts as its daemon (hiqcache/socket_trust.h:
  // the socket's directory, both socket files and the connected peer's uid are checked before
  // anything is sent).
  static StatusOr<std::unique_ptr<Session>> Open(const std::string& target,
                                                 std::chrono::milliseconds timeout);

  ~Session();  // closes the connection: the daemon releases the pools registered through it
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Passes `fds` to the daemon (SCM_RIGHTS; at most kMaxFdsPerMessage per message, more in
  // several messages) and returns the id the daemon gave each, in order. The caller keeps its own
  // fds (the kernel duplicates them) and may close them once this returns. Each answer is awaited
  // for at most the timeout given to Open. UNAVAILABLE when the connection is broken or the
  // answer does not come; RESOURCE_EXHAUSTED or FAILED_PRECONDITION when the daemon answers
  // "ERR" (its text is in the message). When a later message fails, the fds of earlier ones stay
  // with the daemon until the session ends. An empty `fds` sends nothing.
  StatusOr<std::vector<uint64_t>> SendFds(std::span<const int> fds);

  // The token gRPC calls carry as metadata kSessionMetadataKey ("hiq-session").
  const std::string& token() const { return token_; }
  // The caller as the daemon's kernel saw it, from the greeting.
  uint32_t pid() const { return pid_; }
  uint32_t uid() const { return uid_; }
  uint32_t gid() const { return gid_; }
  // The session socket's path.
  const std::string& path() const { return path_; }

  // False once the daemon has closed the connection (it exited or restarted, or refused this
  // session): its pools are gone and its token is void. Never blocks.
  bool alive() const;
  // The connection's descriptor, for poll() only (POLLRDHUP or POLLHUP: the daemon closed it).
  // Owned by this object: never read, write or close it.
  int poll_fd() const { return fd_; }

 private:
  Session(int fd, std::string path, std::chrono::milliseconds timeout);

  const int fd_;  // CLOEXEC; closed by the destructor
  const std::string path_;
  const std::chrono::milliseconds timeout_;
  std::string token_;
  uint32_t pid_ = 0;
  uint32_t uid_ = 0;
  uint32_t gid_ = 0;
  std::mutex mu_;  // serializes SendFds: one request and its answer at a time
};

}  // namespace hiqcache
