// The session socket: how a client proves who it is and hands the daemon its memory.
//
// gRPC cannot tell the daemon which process sent a call, nor carry file descriptors. So beside
// each unix gRPC socket PATH the daemon listens on PATH + kSessionSocketSuffix, an AF_UNIX
// SOCK_SEQPACKET socket with the same mode and group. A client connects once; the kernel's
// SO_PEERCRED of that connection (pid, uid, gid) is the caller's identity for as long as the
// connection stays open, and the connection closing (the process exited or died) releases every
// pool registered through it. Messages are one ASCII line per packet:
//
//   daemon -> client, on accept:  "HIQ-SESSION 1 token=<32 hex> pid=<pid> uid=<uid> gid=<gid>"
//   client -> daemon:             "FDS" with 1..kMaxFdsPerMessage fds attached (SCM_RIGHTS)
//   daemon -> client:             "OK <id> <id> ..." (one id per fd, in order) or "ERR <why>"
//
// Every gRPC call then carries the token as metadata kSessionMetadataKey; the daemon maps it to
// the session's credentials (a token is a bearer secret: a client must not hand it to processes
// it does not trust). The fd ids name the fds in RegisterPoolRequest (SharedBuffer.host_fd_id,
// EventPool.host_fd_id); a RegisterPool consumes the fds it names, whatever its outcome, and the
// daemon closes every fd still held when the session ends. A session holds at most
// kMaxHeldFdsPerSession unconsumed fds (one registration's worth: its buffers and its event
// object), and the sessions of one uid together a configured number ("ERR" beyond either).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace hiqcache {

inline constexpr std::string_view kSessionSocketSuffix = ".session";
inline constexpr std::string_view kSessionMetadataKey = "hiq-session";
inline constexpr std::string_view kSessionGreeting = "HIQ-SESSION 1 ";
inline constexpr size_t kMaxFdsPerMessage = 16;
inline constexpr size_t kMaxHeldFdsPerSession = 4097;
inline constexpr size_t kMaxSessionMessageBytes = 4096;

// The session socket path for a gRPC target "unix:PATH", "unix://PATH" (PATH absolute) or
// "unix:///abs/path"; empty for any other target (TCP has no session: its callers are anonymous).
inline std::string SessionSocketPathForTarget(std::string_view target) {
  std::string_view path;
  if (target.substr(0, 7) == "unix://") {
    path = target.substr(7);
  } else if (target.substr(0, 5) == "unix:") {
    path = target.substr(5);
  } else {
    return {};
  }
  if (path.empty()) return {};
  return std::string(path) + std::string(kSessionSocketSuffix);
}

}  // namespace hiqcache
