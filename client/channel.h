// Internal to the client library and hiqctl: gRPC target parsing and channel creation.
// Pure functions; thread-safe.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include <memory>
#include <string>
#include <string_view>

#include "hiqcache/status.h"

namespace hiqcache::client_internal {

// "" -> DefaultTarget(); "/abs/path.sock" -> "unix:///abs/path.sock"; "unix:...",
// "unix-abstract:...", "dns:...", "ipv4:...", "ipv6:..." and "host:port" pass through.
StatusOr<std::string> NormalizeTarget(std::string_view target);

// An insecure channel with fast reconnects (<= 1 s backoff) and no idle timeout, so that a
// channel leaving READY means the connection to the daemon broke.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target);

// gRPC status -> hiqcache::Status (same codes). Transport failures name the target.
Status FromGrpc(const grpc::Status& status, const std::string& target);

}  // namespace hiqcache::client_internal
