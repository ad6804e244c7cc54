#include "channel.h"

#include <grpc/grpc.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "hiqcache/log.h"
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

namespace {

// The file named by environment variable `env` ("" when unset); false when it is set but cannot
// be read.
bool ReadEnvFile(const char* env, std::string* out) {
  out->clear();
  const char* path = std::getenv(env);
  if (path == nullptr || path[0] == '\0') return true;
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !out->empty();
}

std::shared_ptr<grpc::ChannelCredentials> CredentialsFor(const std::string& target) {
  if (target.starts_with("unix:") || target.starts_with("unix-abstract:")) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  if (!ReadEnvFile("HIQ_TLS_CA_FILE", &ssl.pem_root_certs) ||
      !ReadEnvFile("HIQ_TLS_CERT_FILE", &ssl.pem_cert_chain) ||
      !ReadEnvFile("HIQ_TLS_KEY_FILE", &ssl.pem_private_key)) {
    return nullptr;
  }
  if (ssl.pem_root_certs.empty()) return grpc::InsecureChannelCredentials();
  return grpc::SslCredentials(ssl);
}

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = CredentialsFor(target);
  if (credentials == nullptr) {
    // An unreadable TLS file: a channel that cannot connect rather than a plain one.
    HIQ_LOG(ERROR) << "hiqcache client: HIQ_TLS_CA_FILE, HIQ_TLS_CERT_FILE or HIQ_TLS_KEY_FILE "
                      "names a file that cannot be read; no call goes to "
                   << target;
    return grpc::CreateChannel("unix:///nonexistent/hiqcache-tls-file-unreadable",
                               grpc::InsecureChannelCredentials());
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  // gRPC takes each connection attempt's timeout from the minimum reconnect backoff: 20 s (its
  // own default), so that a daemon on a loaded machine has time to answer the HTTP/2 handshake
  // (with 100 ms to 1 s, attempts failed "before receiving SETTINGS frame" at load 20). Calls
  // still end at their own deadlines.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 20000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS, INT_MAX);
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(target, credentials, args);
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
