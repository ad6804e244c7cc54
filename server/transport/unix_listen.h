// One listening unix socket of the daemon, created owner-only and then given the configured
// group and mode, so that it never accepts a connection while more open than intended.
#pragma once

#include <sys/types.h>

#include <string>

#include "hiqcache/status.h"

namespace hiqcache::server {

// Binds `path` (`type`: SOCK_STREAM or SOCK_SEQPACKET; close-on-exec and non-blocking),
// replacing a stale socket file there (the caller has checked that nothing serves it) and
// refusing any other kind of file. The socket is created with umask 0177 and then chowned to
// `gid` (unless -1) and chmodded to `mode`. Returns the bound fd: until listen(2) on it, a
// connect to `path` is refused (ECONNREFUSED), as when no daemon runs.
StatusOr<int> BindUnix(const std::string& path, int type, mode_t mode, gid_t gid);

// BindUnix, then listen(2) with `backlog`. Returns the listening fd.
StatusOr<int> ListenUnix(const std::string& path, int type, int backlog, mode_t mode, gid_t gid);

}  // namespace hiqcache::server
