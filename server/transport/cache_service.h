// CacheService: the gRPC adapter (callback API) of hiqcache.v1.Cache. Each handler converts the
// protobuf request into a core request, calls CacheCore, and converts the result back; it holds no
// state. Backup and Restore finish their reactor from the transfer worker when `sync` is set, so no
// gRPC thread waits on codec work. Thread-safe.
//
// Callers: a call whose metadata carries a session token (hiq-session, session_protocol.h) is
// made by that session's process, as the kernel identified it (SessionListener); a token that
// names no open session is UNAUTHENTICATED. A call without one is anonymous: it may read
// GetStats (no pool ids) and nothing that needs an owner, unless allow_anonymous (a compatibility
// switch for callers that cannot open a session; anonymous pools are then shared by every
// anonymous caller, so it is off by default). Drain is for admins only (PERMISSION_DENIED).
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <string>

#include "core/cache_core.h"
#include "hiqcache/v1/cache.grpc.pb.h"
#include "transport/session_listener.h"
#include "transport/startup_progress.h"

namespace hiqcache::server {

class CacheService final : public hiqcache::v1::Cache::CallbackService {
 public:
  // `core` must outlive the service.
  // `device` ("host"/"cuda") and `shm_name` are reported by GetStats.
  // `sessions` may be null (no unix socket: every caller is anonymous); it must outlive the
  // service.
  CacheService(CacheCore* core, std::string device, std::string shm_name,
               SessionListener* sessions = nullptr, bool allow_anonymous = false)
      : allow_anonymous_(allow_anonymous) {
    Attach(core, std::move(device), std::move(shm_name), sessions);
  }
  // A service that is not ready yet: until Attach, every RPC answers UNAVAILABLE with
  // `progress->Describe()` (the daemon listens while it opens and pre-faults its pool).
  // `progress` must outlive the service.
  CacheService(const StartupProgress* progress, bool allow_anonymous)
      : allow_anonymous_(allow_anonymous), progress_(progress) {}

  // Makes the service ready: from then on the handlers call `core`. Once, before or while the
  // server runs; the arguments are as for the first constructor.
  void Attach(CacheCore* core, std::string device, std::string shm_name,
              SessionListener* sessions) {
    core_ = core;
    sessions_ = sessions;
    device_ = std::move(device);
    shm_name_ = std::move(shm_name);
    ready_.store(true, std::memory_order_release);
  }

  grpc::ServerUnaryReactor* RegisterPool(grpc::CallbackServerContext* ctx,
                                         const v1::RegisterPoolRequest* req,
                                         v1::RegisterPoolResponse* resp) override;
  grpc::ServerUnaryReactor* ReleasePool(grpc::CallbackServerContext* ctx,
                                        const v1::ReleasePoolRequest* req,
                                        v1::ReleasePoolResponse* resp) override;
  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext* ctx, const v1::LookupRequest* req,
                                   v1::LookupResponse* resp) override;
  grpc::ServerUnaryReactor* Backup(grpc::CallbackServerContext* ctx, const v1::BackupRequest* req,
                                   v1::BackupResponse* resp) override;
  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* ctx, const v1::RestoreRequest* req,
                                    v1::RestoreResponse* resp) override;
  grpc::ServerUnaryReactor* Evict(grpc::CallbackServerContext* ctx, const v1::EvictRequest* req,
                                  v1::EvictResponse* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const v1::GetStatsRequest* req,
                                     v1::GetStatsResponse* resp) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx, const v1::DrainRequest* req,
                                  v1::DrainResponse* resp) override;

  // Runs once, on the first Drain, before the core starts refusing work (the daemon turns its
  // health to NOT_SERVING there). Set before the server starts.
  void SetDrainHook(std::function<void()> hook) { drain_hook_ = std::move(hook); }

 private:
  // The caller of `ctx` (anonymous without a token), or UNAUTHENTICATED for a token that names
  // no open session.
  StatusOr<Caller> CallerOf(grpc::CallbackServerContext* ctx) const;
  // CallerOf, then: an anonymous caller is refused unless allow_anonymous_.
  StatusOr<Caller> OwnerCallerOf(grpc::CallbackServerContext* ctx, const char* rpc) const;

  // Before Attach: finishes `reactor` UNAVAILABLE with the start-up progress and returns true.
  bool FinishedStarting(grpc::ServerUnaryReactor* reactor) const;

  // Written once by Attach before ready_ is set (release), read by handlers after they saw it.
  CacheCore* core_ = nullptr;
  SessionListener* sessions_ = nullptr;
  std::string device_;
  std::string shm_name_;
  std::atomic<bool> ready_{false};
  const bool allow_anonymous_;
  const StartupProgress* const progress_ = nullptr;
  std::function<void()> drain_hook_;
  std::once_flag drain_once_;
};

grpc::Status ToGrpcStatus(const Status& status);

// The handlers' request conversions (field by field, no checks: the core validates), exposed so
// that the request fuzzer (tests/fuzz) drives the core through exactly the adapter's code.
RegisterSpec RegisterSpecFromProto(const v1::RegisterPoolRequest& req, const std::string& peer);
TransferSpec BackupSpecFromProto(const v1::BackupRequest& req);
TransferSpec RestoreSpecFromProto(const v1::RestoreRequest& req);
LookupSpec LookupSpecFromProto(const v1::LookupRequest& req);

}  // namespace hiqcache::server
