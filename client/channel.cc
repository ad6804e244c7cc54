#include "channel.h"

#include <grpc/grpc.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <climits>

#include "hiqcache/paths.h"
#include "hiqcache/session_protocol.h"

namespace hiqcache::client_internal {

StatusOr<std::string> NormalizeTarget(std::string_view target) {
  if (target.empty()) return DefaultTarget();
  if (target.front() == '/') return "unix://" + std::string(target);
  for (std::string_view scheme : {"unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:"}) {
    if (target.starts_with(scheme)) {
      if (target.size() == scheme.size()) {
        return InvalidArgument("target \"" + std::string(target) + "\" has no address");
      }
      return std::string(target);
    }
  }
  const size_t colon = target.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == target.size()) {
    return InvalidArgument("target \"" + std::string(target) +
                           "\": expected unix:///path/to.sock, /path/to.sock or host:port");
  }
  return std::string(target);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS, INT_MAX);
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

Status FromGrpc(const grpc::Status& status, const std::string& target) {
  if (status.ok()) return Status::Ok();
  const auto code = static_cast<StatusCode>(status.error_code());
  if (code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded) {
    return Status(code, "hiqcached at " + target + ": " + status.error_message());
  }
  return Status(code, status.error_message());
}

void AttachSession(const Session* session, grpc::ClientContext* ctx) {
  if (session != nullptr) ctx->AddMetadata(std::string(kSessionMetadataKey), session->token());
}

}  // namespace hiqcache::client_internal
