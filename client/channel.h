// Internal to the client library and hiqctl: gRPC target parsing, channel creation and the
// session token on calls. Pure functions; thread-safe.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>

#include <memory>
#include <string>
#include <string_view>

#include "hiqcache/session.h"
#include "hiqcache/status.h"

namespace hiqcache::client_internal {

// "" -> DefaultTarget(); "/abs/path.sock" -> "unix:///abs/path.sock"; "unix:...",
// "unix-abstract:...", "dns:...", "ipv4:...", "ipv6:..." and "host:port" pass through.
StatusOr<std::string> NormalizeTarget(std::string_view target);

// A channel with fast reconnects (<= 1 s backoff) and no idle timeout, so that a channel leaving
// READY means the connection to the daemon broke. Unix targets: plain (the kernel carries it).
// TCP targets: TLS when HIQ_TLS_CA_FILE names the PEM roots to verify the daemon with (and
// HIQ_TLS_CERT_FILE / HIQ_TLS_KEY_FILE this client's certificate for a daemon that requires one),
// else plain, which a daemon serves on loopback only. A file that cannot be read gives a channel
// whose every call fails (UNAVAILABLE; the reason is logged), never a plain one.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target);

// gRPC status -> hiqcache::Status (same codes). Transport failures name the target.
Status FromGrpc(const grpc::Status& status, const std::string& target);

// Names the caller on a call: adds `session`'s token as metadata kSessionMetadataKey. Call before
// the RPC starts; a null `session` adds nothing (an anonymous call).
void AttachSession(const Session* session, grpc::ClientContext* ctx);

}  // namespace hiqcache::client_internal
