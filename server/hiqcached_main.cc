// hiqcached: the per-node KV cache daemon. Wires the configuration, the shared-memory pool, the
// block store, the device backends, the core and the gRPC service together, then serves until
// SIGTERM/SIGINT: in-flight work finishes, new work is refused with UNAVAILABLE, exit 0.
//
// Start-up: the sockets listen first, then the pool is opened, pre-faulted (with progress in the
// log every 5 s) and reattached; meanwhile health answers NOT_SERVING and every Cache RPC
// UNAVAILABLE with the phase and its progress (startup_progress.h), and SIGTERM/SIGINT during the
// pre-fault exits at once.
//
// Service-manager integration (deploy/hiqcached.service): READY=1 goes out only once the pool is
// pre-faulted and the health service reports SERVING; STATUS= lines follow each phase; WATCHDOG=1
// pings run from start to exit; STOPPING=1 on SIGTERM/SIGINT, when the health service turns
// NOT_SERVING. Metrics are served on --metrics-listen (metrics.h).
#include <grp.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server_posix.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

#include "backends/cuda_backend.h"
#include "backends/host_backend.h"
#include "codec_cpu.h"
#include "core/cache_core.h"
#include "core/client_watcher.h"
#include "core/config.h"
#include "core/l3_tier.h"
#include "hiqcache/log.h"
#include "hiqcache/mutex.h"
#include "hiqcache/session_protocol.h"
#include "hiqcache/socket_trust.h"
#include "hiqcache/thread_annotations.h"
#include "pool/block_store.h"
#include "transport/cache_service.h"
#include "transport/connection_gate.h"
#ifdef HIQ_HAVE_L3
#include "l3/redis_l3_tier.h"
#endif
#include "ops/metrics.h"
#include "ops/service_notify.h"
#include "pool/pool_region.h"
#include "transport/session_listener.h"
#include "transport/startup_progress.h"
#ifdef HIQ_HAVE_CUDA
#include "backends/cuda_device_api.h"
#include "cuda_runtime_check.h"
#endif

namespace hiqcache::server {
namespace {

constexpr const char* kUnixPrefix = "unix://";

bool IsUnix(const std::string& addr) { return addr.rfind(kUnixPrefix, 0) == 0; }
std::string UnixPath(const std::string& addr) { return addr.substr(std::strlen(kUnixPrefix)); }

// Prepares a unix socket path: creates its directory (mode 0755) when missing and refuses one
// that is not its own or that others may write (socket_trust.h: clients refuse it too); removes
// a stale socket file that nothing listens on. Refuses to take over a socket another daemon is
// serving.
Status PrepareUnixSocket(const std::string& path) {
  std::error_code ec;
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  if (!std::filesystem::exists(dir, ec)) {
    if (dir.has_parent_path()) std::filesystem::create_directories(dir.parent_path(), ec);
    if (::mkdir(dir.c_str(), 0755) == 0) {
      ::chmod(dir.c_str(), 0755);  // whatever the umask: no write for others
    } else if (errno != EEXIST) {
      return FailedPrecondition("listen: cannot create " + dir.string() + ": " +
                                std::strerror(errno));
    }
  }
  HIQ_RETURN_IF_ERROR(CheckOwnSocketDirectory(dir.string(), ::geteuid()));
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return Status::Ok();
  if (!S_ISSOCK(st.st_mode)) {
    return FailedPrecondition("listen: " + path + " exists and is not a socket");
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
  bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
  ::close(fd);
  if (live) return FailedPrecondition("listen: another process serves " + path);
  ::unlink(path.c_str());
  return Status::Ok();
}

// Raises the soft descriptor limit to the hard one (each client connection, session and
// registered buffer holds a descriptor); returns the soft limit now in force.
uint64_t RaiseDescriptorLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 1024;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return lim.rlim_cur == RLIM_INFINITY ? (1ull << 20) : static_cast<uint64_t>(lim.rlim_cur);
}

// The whole of a PEM file named by config key `key`; an error naming the key when unreadable.
StatusOr<std::string> ReadPem(const std::string& path, const char* key) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgument(std::string(key) + ": cannot read '" + path + "'");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.find("-----BEGIN ") == std::string::npos) {
    return InvalidArgument(std::string(key) + ": '" + path + "' is not a PEM file");
  }
  return text;
}

// What TCP listeners serve with: TLS from tls_cert_file/tls_key_file (client certificates
// required and checked against tls_client_ca_file when set), else insecure (Validate allows that
// on loopback only).
StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(const DaemonConfig& config) {
  if (config.tls_cert_file.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      config.tls_client_ca_file.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  HIQ_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(config.tls_cert_file, "tls_cert_file"));
  HIQ_ASSIGN_OR_RETURN(pair.private_key, ReadPem(config.tls_key_file, "tls_key_file"));
  ssl.pem_key_cert_pairs.push_back(std::move(pair));
  if (!config.tls_client_ca_file.empty()) {
    HIQ_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                         ReadPem(config.tls_client_ca_file, "tls_client_ca_file"));
  }
  return grpc::SslServerCredentials(ssl);
}

#ifndef HIQ_VERSION
#define HIQ_VERSION "unknown"
#endif

// Resolves a group name or number; -1 when unknown.
gid_t LookupGroup(const std::string& group) {
  if (!group.empty() && group.find_first_not_of("0123456789") == std::string::npos) {
    return static_cast<gid_t>(std::stoul(group));
  }
  std::vector<char> buf(16384);
  struct group gr;
  struct group* found = nullptr;
  if (::getgrnam_r(group.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    return static_cast<gid_t>(-1);
  }
  return found->gr_gid;
}

std::string HumanBytes(uint64_t b) {
  char buf[32];
  if (b >= (1ull << 30))
    std::snprintf(buf, sizeof(buf), "%.1f GiB", b / double(1ull << 30));
  else
    std::snprintf(buf, sizeof(buf), "%.1f MiB", b / double(1ull << 20));
  return buf;
}

// What the watchdog's liveness probe may call; Publish withdraws the core before it is destroyed.
struct LiveCore {
  Mutex mu;
  CacheCore* core GUARDED_BY(mu) = nullptr;
  class Publish {
   public:
    Publish(LiveCore* live, CacheCore* core) : live_(live) { Set(core); }
    ~Publish() { Set(nullptr); }

   private:
    void Set(CacheCore* core) {
      MutexLock lock(&live_->mu);
      live_->core = core;
    }
    LiveCore* live_;
  };
};

void LogIfError(const Status& st) {
  if (!st.ok()) HIQ_LOG(WARN) << "sd_notify: " << st.ToString();
}

// Exit status after a CUDA device reported a sticky error: the service manager restarts the
// daemon (deploy/hiqcached.service: Restart=on-failure); the pool survives in shared memory.
constexpr int kExitDeviceFailed = 3;
// How long gRPC keeps a connection of a process without a session, and the grace its calls then
// get (connection_gate.h).
constexpr int kSessionlessConnectionAgeMs = 5000;
std::atomic<bool> g_device_failed{false};

int Run(int argc, char** argv) {
  // Signals are taken by sigwait below: block them before any thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  bool exit_now = false;
  std::string message;
  auto loaded = LoadConfig(argc, argv, &exit_now, &message);
  if (!loaded.ok()) {
    std::cerr << "hiqcached: " << loaded.status().message() << "\n" << UsageText();
    return 2;
  }
  if (exit_now) {
    std::cout << message;
    return 0;
  }
  DaemonConfig config = std::move(loaded).value();
  LogLevel level;
  if (!ParseLogLevel(config.log_level, &level)) {
    std::cerr << "hiqcached: log_level: unknown level '" << config.log_level << "'\n";
    return 2;
  }
  SetLogLevel(level);

  const double start_time =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // The watchdog's liveness probe takes the core's lock: a deadlocked core stops the pings.
  LiveCore live;
  ServiceNotifier notifier = ServiceNotifier::FromEnvironment();
  notifier.StartWatchdog([&live] {
    MutexLock lock(&live.mu);
    if (live.core != nullptr) (void)live.core->ClientPids();
    return true;
  });
  gid_t socket_gid = static_cast<gid_t>(-1);
  if (!config.socket_group.empty()) {
    socket_gid = LookupGroup(config.socket_group);
    if (socket_gid == static_cast<gid_t>(-1)) {
      HIQ_LOG(ERROR) << "socket_group: unknown group '" << config.socket_group << "'";
      return 1;
    }
  }
  SessionOptions session_options;
  session_options.socket_mode = config.socket_mode;
  session_options.socket_gid = socket_gid;
  for (uint32_t uid : config.admin_uids) session_options.admin_uids.push_back(uid);
  for (const auto& group : config.admin_groups) {
    const gid_t gid = LookupGroup(group);
    if (gid == static_cast<gid_t>(-1)) {
      HIQ_LOG(ERROR) << "admin_groups: unknown group '" << LogSafe(group) << "'";
      return 1;
    }
    session_options.admin_gids.push_back(gid);
  }
  auto tcp_credentials = TcpCredentials(config);
  if (!tcp_credentials.ok()) {
    HIQ_LOG(ERROR) << tcp_credentials.status().message();
    return 1;
  }

  // The sockets listen first, before the pool is opened and pre-faulted (minutes for hundreds of
  // GiB): until the core is ready, health answers NOT_SERVING and every Cache RPC UNAVAILABLE
  // with what the daemon is doing (startup_progress.h), so that `hiqctl health`, probes and
  // engines get an answer, not "No such file or directory".
  StartupProgress progress;
  std::vector<std::string> session_paths;
  std::vector<std::string> grpc_paths;
  for (const auto& addr : config.listen) {
    if (!IsUnix(addr)) continue;
    Status st = PrepareUnixSocket(UnixPath(addr));
    if (!st.ok()) {
      HIQ_LOG(ERROR) << st.ToString();
      return 1;
    }
    grpc_paths.push_back(UnixPath(addr));
    session_paths.push_back(UnixPath(addr) + std::string(kSessionSocketSuffix));
  }
  // The session listener starts with the core; the gate's thread asks it about each connection.
  std::atomic<SessionListener*> live_sessions{nullptr};
  CacheService service(&progress, config.allow_anonymous);
  CacheService sessionless_service(&progress, config.allow_anonymous);
  std::atomic<bool> serving{false};
  std::unique_ptr<grpc::Server> servers[2];  // full, sessionless
  std::atomic<bool> servers_built{false};
  // Health for the server as a whole ("") and the service by name (Kubernetes gRPC probes and
  // grpc_health_probe -service ask for hiqcache.v1.Cache): the bool overload sets both.
  auto set_health = [&](bool ok) {
    if (!servers_built.load()) return;
    for (auto& srv : servers) {
      if (srv) srv->GetHealthCheckService()->SetServingStatus(ok);
    }
  };
  // `hiqctl drain`: health first, so probes and balancers stop sending work before the core
  // refuses it; the daemon keeps running until it is stopped.
  auto drain = [&] {
    set_health(false);
    serving.store(false);
    LogIfError(notifier.SetStatus("draining (hiqctl drain): refusing new work"));
  };
  service.SetDrainHook(drain);
  sessionless_service.SetDrainHook(drain);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // Two servers of the same service: the full one (TCP listeners, and unix connections of
  // processes holding a session) and one for unix connections of processes without a session,
  // with a small message limit and a share of gRPC's memory of its own (connection_gate.h).
  auto build = [&](CacheService* svc, uint64_t max_message, uint64_t memory, const char* name,
                   bool sessionless) {
    grpc::ServerBuilder builder;
    if (!sessionless) {
      for (const auto& addr : config.listen) {
        if (!IsUnix(addr)) builder.AddListeningPort(addr, *tcp_credentials);
      }
    }
    const int max_msg =
        static_cast<int>(std::min<uint64_t>(max_message, std::numeric_limits<int>::max()));
    builder.SetMaxReceiveMessageSize(max_msg);
    builder.SetMaxSendMessageSize(static_cast<int>(
        std::min<uint64_t>(config.max_message_bytes, std::numeric_limits<int>::max())));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                               static_cast<int>(config.max_streams_per_connection));
    if (sessionless) {
      // gRPC ends each connection gracefully (GOAWAY; calls in flight get the grace) after a
      // few seconds: a stalled call is dropped, and a process that opened its session since
      // reconnects to the full server without a failed call.
      builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, kSessionlessConnectionAgeMs);
      builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, kSessionlessConnectionAgeMs);
    }
    grpc::ResourceQuota quota(name);
    quota.Resize(static_cast<size_t>(memory));
    builder.SetResourceQuota(quota);
    builder.RegisterService(svc);
    return builder.BuildAndStart();
  };
  servers[0] = build(&service, config.max_message_bytes, config.grpc_memory_bytes, "hiqcached",
                     /*sessionless=*/false);
  servers[1] = build(&sessionless_service, config.sessionless_message_bytes,
                     std::max<uint64_t>(16ull << 20, config.grpc_memory_bytes / 8),
                     "hiqcached-sessionless", /*sessionless=*/true);
  if (!servers[0] || !servers[1]) {
    HIQ_LOG(ERROR) << "cannot listen on the configured addresses";
    return 1;
  }
  for (auto& srv : servers) {
    srv->GetHealthCheckService()->SetServingStatus(hiqcache::v1::Cache::service_full_name(), false);
    srv->GetHealthCheckService()->SetServingStatus(false);
  }
  servers_built.store(true);

  // The unix gRPC sockets are the gate's: it counts each connection against its uid before
  // gRPC takes it (connection_gate.h). TCP listeners (loopback, or TLS) are gRPC's own. Declared
  // after the servers, so that on every return it stops handing connections to them first.
  std::unique_ptr<ConnectionGate> gate;
  if (!grpc_paths.empty()) {
    ConnectionLimits limits;
    limits.max_connections = config.max_connections;
    limits.max_connections_per_uid = config.max_connections_per_uid;
    const uint64_t fds = RaiseDescriptorLimit();
    // Every admitted connection is two descriptors (gRPC's and the gate's duplicate); the rest
    // of the table stays for the session listener, pool mappings, L3 and metrics connections.
    const uint64_t kept = std::max<uint64_t>(1024, fds / 4);
    const uint64_t room =
        fds > kept + 2 * limits.admin_reserve ? (fds - kept - 2 * limits.admin_reserve) / 2 : 1;
    if (limits.max_connections > room) {
      HIQ_LOG(WARN) << "max_connections " << limits.max_connections << " lowered to " << room
                    << ": the descriptor limit is " << fds << " (LimitNOFILE)";
      limits.max_connections = room;
    }
    auto listening = ConnectionGate::Listen(grpc_paths, limits, config.socket_mode, socket_gid,
                                            [&live_sessions](const ucred& peer) {
                                              SessionListener* s = live_sessions.load();
                                              return s != nullptr && s->IsAdminPeer(peer);
                                            });
    if (!listening.ok()) {
      HIQ_LOG(ERROR) << listening.status().ToString();
      return 1;
    }
    gate = std::move(listening).value();
    HIQ_LOG(INFO) << "event=connection_limits max_connections=" << limits.max_connections
                  << " per_uid=" << limits.max_connections_per_uid
                  << " admin_reserve=" << limits.admin_reserve << " descriptors=" << fds;
    // Before the session listener starts, no process holds a session: every connection goes to
    // the sessionless server (all it can be answered then is health and "starting").
    gate->Start(
        [full = servers[0].get(), apart = servers[1].get()](int fd, bool sessionless) {
          grpc::AddInsecureChannelFromFd(sessionless ? apart : full, fd);
        },
        [&live_sessions](const ucred& peer) {
          SessionListener* s = live_sessions.load();
          return s != nullptr && s->HasSession(peer);
        });
  }
  std::string addrs;
  for (const auto& a : config.listen) addrs += (addrs.empty() ? "" : ", ") + a;
  HIQ_LOG(INFO) << "listening on " << addrs << " (NOT_SERVING until the pool is ready)";

  progress.SetPhase("opening pool " + config.shm_name + " (" + HumanBytes(config.pool_bytes) + ")");
  LogIfError(notifier.SetStatus(progress.Describe()));
  auto region = PoolRegion::Open(config.shm_name, config.pool_bytes);
  if (!region.ok()) {
    HIQ_LOG(ERROR) << region.status().ToString();
    return 1;
  }
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  auto t0 = std::chrono::steady_clock::now();
  if (config.prefault) {
    // Pre-faulted by `cores` threads while this thread reports progress (log and STATUS= every
    // 5 s) and takes SIGTERM/SIGINT: a daemon stopped while it pre-faults exits at once.
    progress.SetPhase("pre-faulting pool " + (*region)->name(), (*region)->size());
    LogIfError(notifier.SetStatus(progress.Describe()));
    std::atomic<bool> stop{false};
    std::atomic<bool> finished{false};
    Status prefaulted;
    std::thread prefault([&] {
      prefaulted = (*region)->Prefault(cores, progress.done(), &stop);
      finished.store(true);
    });
    int sig = 0;
    auto last_report = std::chrono::steady_clock::now();
    while (!finished.load()) {
      const timespec tick{0, 100 * 1000 * 1000};
      sig = ::sigtimedwait(&sigs, nullptr, &tick);
      if (sig > 0) break;
      if (std::chrono::steady_clock::now() - last_report >= std::chrono::seconds(5)) {
        last_report = std::chrono::steady_clock::now();
        const double s = std::chrono::duration<double>(last_report - t0).count();
        char rate[32];
        std::snprintf(rate, sizeof(rate), "%.2f GiB/s",
                      progress.done()->load() / double(1ull << 30) / s);
        HIQ_LOG(INFO) << "event=prefault_progress " << progress.Describe() << ", " << rate;
        LogIfError(notifier.SetStatus(progress.Describe()));
      }
    }
    if (sig > 0) {
      stop.store(true);
      prefault.join();
      HIQ_LOG(INFO) << "signal " << sig << " while pre-faulting the pool: stopped before serving";
      notifier.StopWatchdog();
      return 0;
    }
    prefault.join();
    if (!prefaulted.ok()) {
      HIQ_LOG(ERROR) << prefaulted.ToString();
      return 1;
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  if (config.prefault) {
    const double seconds = std::max(1e-3, std::chrono::duration<double>(t1 - t0).count());
    char rate[64];
    std::snprintf(rate, sizeof(rate), "%.0f ms (%.2f GiB/s)", seconds * 1000,
                  (*region)->size() / double(1ull << 30) / seconds);
    HIQ_LOG(INFO) << "pool " << (*region)->name() << ": " << (*region)->size()
                  << " bytes, pre-faulted in " << rate;
  } else {
    HIQ_LOG(INFO) << "pool " << (*region)->name() << ": " << (*region)->size() << " bytes";
  }

  // Reattach: blocks a previous daemon completed stay cached across a restart (or a crash).
  RebuildReport rebuild;
  progress.SetPhase("reading block headers of pool " + (*region)->name());
  LogIfError(notifier.SetStatus(progress.Describe()));
  auto t2 = std::chrono::steady_clock::now();
  StoreOptions store_options;
  store_options.reattach = true;
  store_options.rebuild_threads = cores;
  store_options.verify_reads_one_in = config.verify_reads_one_in;
  BlockStore store((*region)->data(), (*region)->size(), store_options, &rebuild);
  auto t3 = std::chrono::steady_clock::now();
  if (rebuild.reattached) {
    HIQ_LOG(INFO) << "reattached pool in "
                  << std::chrono::duration_cast<std::chrono::milliseconds>(t3 - t2).count()
                  << " ms: " << rebuild.blocks_kept << " blocks kept in " << rebuild.namespaces
                  << " namespace(s), " << rebuild.blocks_incomplete << " incomplete and "
                  << rebuild.blocks_corrupt << " corrupt dropped, " << rebuild.extents_corrupt
                  << " corrupt extent(s) dropped";
  } else {
    HIQ_LOG(INFO) << "formatted pool (" << rebuild.reason << ")";
  }
  kernels::CpuCodec codec(config.codec_threads);
  HostBackend host(&codec, std::chrono::milliseconds(config.wait_timeout_ms));
  // A shmem buffer keeps a descriptor of its object so that a task can tell from one fstat that
  // none of its pages is missing (ShmMapping::FullyAllocated) instead of asking mincore per
  // layer and block: at most an eighth of the descriptor table, the rest of the mappings ask.
  ShmMapping::SetKeptDescriptors(RaiseDescriptorLimit() / 8);
  // No client may register the pool itself as its buffer (by name or fd): that would be read and
  // write access to every tenant's cached payloads.
  if (Status st = host.SetPoolObject((*region)->name()); !st.ok()) {
    HIQ_LOG(ERROR) << "pool " << (*region)->name() << ": " << st.ToString();
    return 1;
  }
  DaemonMetrics metrics;
  CoreOptions options;
  ApplyCoreSettings(config, &options);
  options.observer = &metrics;
  options.transfer_workers = config.transfer_workers != 0 ? config.transfer_workers : 2;
  options.release_timeout = std::chrono::milliseconds(config.release_timeout_ms);
  if (config.max_blocks_per_request != 0) {
    options.limits.max_blocks_per_request = config.max_blocks_per_request;
  }
  // CUDA pools are served where the build has the CUDA backend and a GPU is visible; HOST pools
  // always are.
  std::unique_ptr<DeviceApi> cuda_api;
  std::unique_ptr<CudaBackend> cuda;
  std::string device_name = "host";
  if (config.device != "host") {
#ifdef HIQ_HAVE_CUDA
    std::string why;
    if (kernels::CudaDeviceAvailable(&why)) {
      progress.SetPhase("page-locking pool " + (*region)->name() + " for CUDA");
      LogIfError(notifier.SetStatus(progress.Describe()));
      auto api = CreateCudaDeviceApi();
      if (api.ok()) {
        cuda_api = std::move(api).value();
        CudaBackendOptions cuda_options;
        cuda_options.staging_bytes = config.cuda_staging_bytes;
        cuda_options.wait_timeout = std::chrono::milliseconds(config.wait_timeout_ms);
        cuda_options.client_objects = &host;
        cuda_options.max_blocks_per_request = options.limits.max_blocks_per_request;
        cuda_options.register_chunk_bytes = kPoolRegisterChunkBytes;
        // A sticky error leaves the device unusable for this process: stop (draining HOST
        // work), exit non-zero, and let the service manager start a fresh daemon.
        cuda_options.on_device_failed = [](int device, const Status& st) {
          if (g_device_failed.exchange(true)) return;
          HIQ_LOG(ERROR) << "CUDA device " << device << " failed (" << st.message()
                         << "): hiqcached stops and exits " << kExitDeviceFailed
                         << " to be restarted";
          ::kill(::getpid(), SIGTERM);
        };
        auto created = CudaBackend::Create(cuda_api.get(), (*region)->data(), (*region)->size(),
                                           std::move(cuda_options));
        if (created.ok()) {
          cuda = std::move(created).value();
          device_name = "cuda";
        } else {
          why = created.status().message();
        }
      } else {
        why = api.status().message();
      }
    }
    if (!cuda) {
      if (config.device == "cuda") {
        HIQ_LOG(ERROR) << "device = cuda, but CUDA is not usable: " << why;
        return 1;
      }
      HIQ_LOG(INFO) << "CUDA backend off (" << why << "): serving HOST pools only";
    }
#else
    if (config.device == "cuda") {
      HIQ_LOG(ERROR) << "device = cuda, but this hiqcached was built without CUDA";
      return 1;
    }
#endif
  }
  // L3 (docs/design.md "Beyond one node (L3)"): on when l3_seeds names the cluster. Its connections
  // open in the background; an unreachable cluster is a miss, never a failure to start.
  std::unique_ptr<L3Tier> l3;
  if (!config.l3_seeds.empty()) {
    L3Options l3_options;
    if (Status st = L3OptionsFromConfig(config, &l3_options); !st.ok()) {
      HIQ_LOG(ERROR) << st.message();
      return 2;
    }
    if (l3_options.mac_key.empty()) {
      HIQ_LOG(WARN) << "l3: no l3_mac_key_file: values are checksummed, not authenticated; "
                       "anyone who can write to the cluster under l3_key_prefix can plant KV "
                       "that this daemon restores";
    }
    l3_options.on_fetch = [&metrics](std::chrono::nanoseconds d, bool ok) {
      metrics.OnL3Fetch(d, ok);
    };
#ifdef HIQ_HAVE_L3
    auto created = CreateRedisL3Tier(l3_options, &store);
#else
    // Unreachable: Validate refuses l3_seeds in a build without L3 (L3Available).
    StatusOr<std::unique_ptr<L3Tier>> created = FailedPrecondition(
        "l3_seeds: this hiqcached was built without the L3 store (hiredis, "
        "libhiredis-dev, was not found at build time)");
#endif
    if (!created.ok()) {
      HIQ_LOG(ERROR) << created.status().message();
      return 2;
    }
    l3 = std::move(created).value();
    options.l3 = l3.get();
    HIQ_LOG(INFO) << "event=l3_enabled seeds=" << config.l3_seeds.size() << " prefix=\""
                  << LogSafe(config.l3_key_prefix) << "\" policy=" << config.l3_write_policy
                  << " ttl_s=" << config.l3_ttl;
  }
  auto core = std::make_unique<CacheCore>(options, &store, &host, cuda.get());
  LiveCore::Publish publish(&live, core.get());

  // Metrics listen before READY=1 and before the session sockets accept (which tests and tools
  // take as the daemon serving), so that a scrape after either never fails. Failing to listen is a
  // configuration error: the daemon does not start half-observable.
  std::unique_ptr<MetricsHttpServer> metrics_server;
  if (!config.metrics_listen.empty()) {
    DaemonInfo info;
    info.version = HIQ_VERSION;
    info.device = device_name;
    info.codec_target = kernels::CpuCodec::TargetName();
    info.start_time_seconds = start_time;
    auto started = MetricsHttpServer::Start(config.metrics_listen, [&, info]() mutable {
      info.ready = serving.load();
      // Metrics are for the node's operator: every pool, no id hidden.
      return metrics.Render(core->Snapshot(Caller::Operator()), info);
    });
    if (!started.ok()) {
      HIQ_LOG(ERROR) << started.status().ToString();
      return 1;
    }
    metrics_server = std::move(started).value();
  }
  // The session sockets beside the unix gRPC sockets: who each caller is (SO_PEERCRED), the fds
  // it hands over, and its death (the connection closes) releasing its pools. They refuse
  // connections until the services have attached and health says SERVING: tests, tools and
  // engines take a session socket that accepts as a daemon that serves.
  std::unique_ptr<SessionListener> sessions;
  if (!session_paths.empty()) {
    auto bound = SessionListener::Bind(session_paths, session_options, [&core](uint64_t session) {
      core->ReleasePoolsOfSession(session);
    });
    if (!bound.ok()) {
      HIQ_LOG(ERROR) << bound.status().ToString();
      return 1;
    }
    sessions = std::move(bound).value();
  }
  service.Attach(core.get(), device_name, (*region)->name(), sessions.get());
  sessionless_service.Attach(core.get(), device_name, (*region)->name(), sessions.get());
  live_sessions.store(sessions.get());
  set_health(true);
  serving.store(true);
  if (sessions) {
    Status opened = sessions->Open();
    if (!opened.ok()) {
      HIQ_LOG(ERROR) << opened.ToString();
      return 1;
    }
  }

  // The pre-fault allocated the pool's pages; its page tables are filled in the background, so
  // that a request's first touch of a page takes no minor fault either.
  std::atomic<bool> stop_mapping{false};
  std::thread map_pages;
  if (config.prefault) {
    map_pages = std::thread([&region, &stop_mapping] {
      const auto t = std::chrono::steady_clock::now();
      const uint64_t mapped = (*region)->MapPages(&stop_mapping);
      HIQ_LOG(DEBUG) << "pool " << (*region)->name() << ": " << mapped << " bytes mapped in "
                     << std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - t)
                            .count()
                     << " ms";
    });
  }
  struct JoinOnExit {
    std::atomic<bool>* stop;
    std::thread* thread;
    ~JoinOnExit() {
      stop->store(true);
      if (thread->joinable()) thread->join();
    }
  } join_map_pages{&stop_mapping, &map_pages};

  // Stopped before the core is destroyed (its thread calls into the core).
  auto watcher = std::make_unique<ClientWatcher>(
      [&] { return core->ClientPids(); }, [&](uint32_t pid) { core->ReleasePoolsOfClient(pid); },
      std::chrono::milliseconds(200));
  HIQ_LOG(INFO) << "hiqcached serving on " << addrs << " (device " << device_name << ", codec "
                << kernels::CpuCodec::TargetName() << " x" << codec.threads() << " threads)";
  LogIfError(notifier.Ready("serving on " + addrs + "; pool " + (*region)->name() + " " +
                            HumanBytes((*region)->size()) + ", device " + device_name));

  int sig = 0;
  sigwait(&sigs, &sig);
  HIQ_LOG(INFO) << "signal " << sig << ": draining";
  // Health first: a load balancer or probe stops sending work before the core refuses it.
  set_health(false);
  serving.store(false);
  LogIfError(notifier.Stopping("draining: finishing in-flight transfers"));
  core->StartDraining();
  // Bounded: device work that waits for an event its engine never records cannot be drained.
  if (!core->WaitIdleFor(std::chrono::seconds(30))) {
    HIQ_LOG(ERROR) << "device work still pending after 30 s: exiting without waiting for it "
                      "(blocks it was writing are dropped when the pool is reattached)";
    notifier.StopWatchdog();
    std::_Exit(g_device_failed.load() ? kExitDeviceFailed : 1);
  }
  gate.reset();  // hands nothing more to the servers
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(5);
  for (auto& srv : servers) srv->Shutdown(deadline);
  for (auto& srv : servers) srv->Wait();
  metrics_server.reset();  // its render callback uses the core
  watcher.reset();
  sessions.reset();  // its release thread calls into the core
  { LiveCore::Publish withdraw(&live, nullptr); }
  core.reset();
  l3.reset();  // its writers read the store: stopped before the store goes
  cuda.reset();
  for (const auto& addr : config.listen) {
    if (IsUnix(addr)) ::unlink(UnixPath(addr).c_str());
  }
  notifier.StopWatchdog();
  if (g_device_failed.load()) {
    HIQ_LOG(ERROR) << "hiqcached stopped after a CUDA device failure";
    return kExitDeviceFailed;
  }
  HIQ_LOG(INFO) << "hiqcached stopped";
  return 0;
}

}  // namespace
}  // namespace hiqcache::server

int main(int argc, char** argv) { return hiqcache::server::Run(argc, argv); }
