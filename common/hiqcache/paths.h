// Where hiqcached listens by default, shared by the daemon, the client library and hiqctl.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace hiqcache {

// $XDG_RUNTIME_DIR/hiqcache/hiqcached.sock, else /tmp/hiqcache-$UID/hiqcached.sock.
inline std::string DefaultSocketPath() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && xdg[0] != '\0') return std::string(xdg) + "/hiqcache/hiqcached.sock";
  return "/tmp/hiqcache-" + std::to_string(::getuid()) + "/hiqcached.sock";
}

// The gRPC target of the default socket: "unix:///.../hiqcached.sock".
inline std::string DefaultTarget() { return "unix://" + DefaultSocketPath(); }

}  // namespace hiqcache
