// Who may be the daemon behind a unix socket path (docs/design.md, "Sessions: whom a client
// trusts"). A client hands the process listening on its target its KV memory (memfds over the
// session) and a bearer token (on every call), so before either leaves it checks that the
// listener is one it trusts:
//
//   * the directory holding the socket is not writable by group or others (nobody else could
//     have put or swapped a socket there), and
//   * its owner is trusted: root, the client's own effective uid, the uid HIQ_DAEMON_UID names,
//     or any uid when the directory's parent is root's and not writable by group or others (only
//     root could have created the directory and chosen its owner: /run/hiqcache made by systemd
//     for User=hiqcache), and
//   * the gRPC socket file and the session's peer (SO_PEERCRED of the connection) belong to a
//     trusted uid: root, the client's own, HIQ_DAEMON_UID's, or the directory's owner.
//
// So a squatter who creates /tmp/hiqcache-<victim uid>/ first (the parent /tmp is world-writable)
// gets refused, while the systemd layout and a per-user daemon need no configuration.
//
// The daemon side: a daemon puts its sockets only in a directory it owns that group and others
// cannot write.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hiqcache/status.h"

namespace hiqcache {

// The environment variable naming the daemon's uid (a number or a user name) for layouts the
// directory rule does not cover.
inline constexpr const char* kDaemonUidEnv = "HIQ_DAEMON_UID";

// The uids a client accepts as the daemon serving the unix socket `socket_path` (a path, not a
// target). PERMISSION_DENIED when the socket's directory may have been made or written by
// someone untrusted (the message says who and how to proceed); UNAVAILABLE when the directory
// does not exist (nothing can be listening); INVALID_ARGUMENT for a bad HIQ_DAEMON_UID.
StatusOr<std::vector<uint32_t>> TrustedDaemonUids(const std::string& socket_path);

// PERMISSION_DENIED when the socket file at `socket_path` exists and belongs to a uid outside
// `trusted`; OK when it is trusted or does not exist (connecting then fails on its own).
Status CheckSocketOwner(const std::string& socket_path, const std::vector<uint32_t>& trusted);

// PERMISSION_DENIED unless the process at the other end of the connected unix socket `fd` runs
// as a uid in `trusted` (SO_PEERCRED, as the kernel recorded it at connect time).
Status CheckPeerUid(int fd, const std::vector<uint32_t>& trusted, const std::string& path);

// The daemon's check of the directory `dir` it is about to listen in: it must be a directory
// owned by `uid` (the daemon's effective uid) that group and others cannot write
// (FAILED_PRECONDITION otherwise, naming the owner and mode found).
Status CheckOwnSocketDirectory(const std::string& dir, uid_t uid);

}  // namespace hiqcache
