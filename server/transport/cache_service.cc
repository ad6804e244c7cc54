#include "transport/cache_service.h"

#include <algorithm>
#include <chrono>

#include "hiqcache/log.h"
#include "hiqcache/session_protocol.h"

namespace hiqcache::server {
namespace {

namespace v1 = hiqcache::v1;

ViewSpec ToView(bool present, const v1::TensorView& t) {
  ViewSpec v;
  v.present = present;
  v.buffer = t.buffer();
  v.offset_bytes = t.offset_bytes();
  v.row_stride_bytes = t.row_stride_bytes();
  v.num_rows = t.num_rows();
  v.head_stride_bytes = t.head_stride_bytes();
  v.page_rows = t.page_rows();
  v.page_stride_bytes = t.page_stride_bytes();
  v.row_group = t.row_group();
  v.row_group_stride_bytes = t.row_group_stride_bytes();
  v.dim_run = t.dim_run();
  v.dim_run_stride_bytes = t.dim_run_stride_bytes();
  v.dim_stride_bytes = t.dim_stride_bytes();
  return v;
}

// RegisterPoolRequest and NamespaceRef spell the namespace's parts with the same fields.
template <typename Req>
void ToNamespaceSpec(const Req& r, NamespaceSpec* s) {
  s->model = r.model();
  s->tenant = r.tenant();
  const auto& g = r.geometry();
  s->num_layers = g.num_layers();
  s->num_kv_heads = g.num_kv_heads();
  s->head_dim = g.head_dim();
  s->dtype = g.dtype();
  s->attention = g.attention();
  s->tp_rank = g.tp_rank();
  s->tp_size = g.tp_size();
  s->rope_theta = g.rope().theta();
  s->rope_interleaved = g.rope().interleaved();
  s->block_tokens = r.block_tokens();
  s->codec = r.codec();
}

RegisterSpec ToRegisterSpec(const v1::RegisterPoolRequest& r, const std::string& peer) {
  RegisterSpec s;
  ToNamespaceSpec(r, &s);
  s.device_kind = r.device().kind();
  s.cuda_device_uuid = r.device().cuda_device_uuid();
  for (const auto& b : r.buffers()) {
    BufferSpec bs;
    bs.has_host_shm_name = b.has_host_shm_name();
    bs.host_shm_name = b.host_shm_name();
    bs.has_cuda_ipc_handle = b.has_cuda_ipc_handle();
    bs.cuda_ipc_handle = b.cuda_ipc_handle();
    bs.has_host_fd = b.has_host_fd_id();
    bs.host_fd_id = b.host_fd_id();
    bs.size_bytes = b.size_bytes();
    s.buffers.push_back(std::move(bs));
  }
  for (const auto& l : r.layers()) {
    s.layers.push_back({ToView(l.has_k(), l.k()), ToView(l.has_v(), l.v())});
  }
  s.events.host_shm_name = r.events().host_shm_name();
  s.events.host_fd_id = r.events().host_fd_id();
  s.events.count = r.events().count();
  for (const auto& h : r.events().cuda_ipc_event_handles()) {
    s.events.cuda_ipc_event_handles.push_back(h);
  }
  s.client_pid = r.client_pid();
  s.peer = peer;
  return s;
}

template <typename Req>
TransferSpec ToTransferSpec(const Req& r) {
  TransferSpec s;
  s.pool_id = r.pool_id();
  s.blocks.reserve(r.blocks_size());
  for (const auto& b : r.blocks()) {
    s.blocks.push_back({b.key(), std::vector<uint32_t>(b.rows().begin(), b.rows().end())});
  }
  s.wait_event = r.wait_event();
  s.wait_value = r.wait_value();
  s.done_event = r.done_event();
  s.sync = r.sync();
  return s;
}

std::vector<std::string> ToKeys(const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

LookupSpec ToLookupSpec(const v1::LookupRequest& r) {
  LookupSpec s;
  s.pool_id = r.pool_id();
  s.keys = ToKeys(r.keys());
  s.namespaces.resize(r.namespaces_size());
  for (int i = 0; i < r.namespaces_size(); ++i) ToNamespaceSpec(r.namespaces(i), &s.namespaces[i]);
  return s;
}

static_assert(wire::kDTypeBf16 == v1::DTYPE_BF16 && wire::kDTypeFp16 == v1::DTYPE_FP16);
static_assert(wire::kAttentionMha == v1::ATTENTION_MHA && wire::kAttentionMla == v1::ATTENTION_MLA);
static_assert(wire::kDeviceHost == v1::DEVICE_KIND_HOST &&
              wire::kDeviceCuda == v1::DEVICE_KIND_CUDA);

// CodecKind is numbered as the wire's Codec (record_format.h; codec_names_test checks each name).
static_assert(v1::Codec_ARRAYSIZE == kCodecCount,
              "a Codec value of the proto needs its row in kCodecNames (hiqcache/codec_names.h)");
v1::Codec ToProtoCodec(kernels::CodecKind codec) { return static_cast<v1::Codec>(codec); }

// Counts an error answer for the metrics (CoreObserver), if the core has an observer.
void CountRejection(const CacheCore* core, const Status& st, const char* rpc) {
  if (!st.ok() && core->observer() != nullptr) core->observer()->OnRequestRejected(rpc, st.code());
}

void Finish(const CacheCore* core, grpc::ServerUnaryReactor* reactor, const Status& st,
            const char* rpc) {
  if (!st.ok()) HIQ_LOG(DEBUG) << rpc << " rejected: " << LogSafe(st.ToString());
  CountRejection(core, st, rpc);
  reactor->Finish(ToGrpcStatus(st));
}

}  // namespace

RegisterSpec RegisterSpecFromProto(const v1::RegisterPoolRequest& req, const std::string& peer) {
  return ToRegisterSpec(req, peer);
}
TransferSpec BackupSpecFromProto(const v1::BackupRequest& req) { return ToTransferSpec(req); }
TransferSpec RestoreSpecFromProto(const v1::RestoreRequest& req) {
  TransferSpec spec = ToTransferSpec(req);
  spec.layer_event_base = req.layer_event_base();
  return spec;
}
LookupSpec LookupSpecFromProto(const v1::LookupRequest& req) { return ToLookupSpec(req); }

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

bool CacheService::FinishedStarting(grpc::ServerUnaryReactor* reactor) const {
  if (ready_.load(std::memory_order_acquire)) return false;
  reactor->Finish(ToGrpcStatus(
      Unavailable(progress_ != nullptr ? progress_->Describe() : std::string("starting"))));
  return true;
}

StatusOr<Caller> CacheService::CallerOf(grpc::CallbackServerContext* ctx) const {
  const auto& md = ctx->client_metadata();
  auto it = md.find(grpc::string_ref(kSessionMetadataKey.data(), kSessionMetadataKey.size()));
  if (it == md.end()) return Caller{};
  Caller caller;
  if (sessions_ != nullptr) {
    caller = sessions_->Authenticate(std::string_view(it->second.data(), it->second.size()));
  }
  if (!caller.authenticated()) {
    return Unauthenticated(std::string(kSessionMetadataKey) +
                           ": names no open session of this hiqcached (it restarted, or the "
                           "session socket closed): open a new session");
  }
  return caller;
}

StatusOr<Caller> CacheService::OwnerCallerOf(grpc::CallbackServerContext* ctx,
                                             const char* rpc) const {
  HIQ_ASSIGN_OR_RETURN(Caller caller, CallerOf(ctx));
  if (!caller.authenticated() && !allow_anonymous_) {
    return Unauthenticated(std::string(rpc) + " needs a session: connect to the session socket " +
                           "beside the gRPC socket (PATH" + std::string(kSessionSocketSuffix) +
                           ") and send its token as '" + std::string(kSessionMetadataKey) +
                           "' metadata (the hiqcache client libraries do)");
  }
  return caller;
}

grpc::ServerUnaryReactor* CacheService::RegisterPool(grpc::CallbackServerContext* ctx,
                                                     const v1::RegisterPoolRequest* req,
                                                     v1::RegisterPoolResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (FinishedStarting(reactor)) return reactor;
  auto caller = OwnerCallerOf(ctx, "RegisterPool");
  if (!caller.ok()) {
    Finish(core_, reactor, caller.status(), "RegisterPool");
    return reactor;
  }
  RegisterSpec spec = ToRegisterSpec(*req, ctx->peer());
  spec.caller = *caller;
  // The fds this request names leave the session now, whatever the outcome; they are closed when
  // `taken` goes (the binding maps or dups what it keeps).
  SessionListener::TakenFds taken;
  if (sessions_ != nullptr && caller->authenticated()) {
    std::vector<uint64_t> ids;
    for (const auto& b : spec.buffers) {
      if (b.has_host_fd) ids.push_back(b.host_fd_id);
    }
    if (spec.events.host_fd_id != 0) ids.push_back(spec.events.host_fd_id);
    if (!ids.empty()) taken = sessions_->TakeFds(caller->session, ids);
  }
  for (auto& b : spec.buffers) {
    if (b.has_host_fd) b.fd = taken.Get(b.host_fd_id);
  }
  if (spec.events.host_fd_id != 0) spec.events.fd = taken.Get(spec.events.host_fd_id);
  auto result = core_->RegisterPool(spec);
  if (result.ok()) {
    resp->set_pool_id(result->pool_id);
    resp->set_namespace_id(result->namespace_id);
    resp->set_encoded_bytes_per_token(result->encoded_bytes_per_token);
    resp->set_block_bytes(result->block_bytes);
    resp->set_capacity_tokens(result->capacity_tokens);
  } else {
    HIQ_LOG(INFO) << "RegisterPool from pid " << caller->pid << " uid " << caller->uid
                  << " rejected: " << LogSafe(result.status().ToString());
  }
  CountRejection(core_, result.status(), "RegisterPool");
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

grpc::ServerUnaryReactor* CacheService::ReleasePool(grpc::CallbackServerContext* ctx,
                                                    const v1::ReleasePoolRequest* req,
                                                    v1::ReleasePoolResponse*) {
  auto* reactor = ctx->DefaultReactor();
  if (FinishedStarting(reactor)) return reactor;
  auto caller = OwnerCallerOf(ctx, "ReleasePool");
  Status st = caller.ok() ? core_->ReleasePool(req->pool_id(), *caller) : caller.status();
  Finish(core_, reactor, st, "ReleasePool");
  return reactor;
}

grpc::ServerUnaryReactor* CacheService::Lookup(grpc::CallbackServerContext* ctx,
                                               const v1::LookupRequest* req,
                                               v1::LookupResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (FinishedStarting(reactor)) return reactor;
  auto caller = OwnerCallerOf(ctx, "Lookup");
  if (!caller.ok()) {
    Finish(core_, reactor, caller.status(), "Lookup");
    return reactor;
  }
  LookupSpec spec = ToLookupSpec(*req);
  spec.caller = *caller;
  auto result = core_->Lookup(spec);
  if (result.ok()) resp->set_prefix_blocks(*result);
  Finish(core_, reactor, result.status(), "Lookup");
  return reactor;
}

grpc::ServerUnaryReactor* CacheService::Evict(grpc::CallbackServerContext* ctx,
                                              const v1::EvictRequest* req,
                                              v1::EvictResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (FinishedStarting(reactor)) return reactor;
  auto caller = OwnerCallerOf(ctx, "Evict");
  if (!caller.ok()) {
    Finish(core_, reactor, caller.status(), "Evict");
    return reactor;
  }
  auto result = core_->Evict(req->pool_id(), ToKeys(req->keys()), *caller);
  if (result.ok()) resp->set_evicted(*result);
  Finish(core_, reactor, result.status(), "Evict");
  return reactor;
}

namespace {

// The call's gRPC deadline on the steady clock (work not started by then never touches the
// engine's memory); max() when the caller set none.
std::chrono::steady_clock::time_point CallerDeadlineOf(const grpc::CallbackServerContext& ctx) {
  const auto deadline = ctx.deadline();
  const auto now = std::chrono::system_clock::now();
  // gRPC reports "no deadline" as a time point decades ahead.
  if (deadline - now > std::chrono::hours(24 * 365)) {
    return std::chrono::steady_clock::time_point::max();
  }
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(deadline - now);
}

}  // namespace

grpc::ServerUnaryReactor* CacheService::Backup(grpc::CallbackServerContext* ctx,
                                               const v1::BackupRequest* req,
                                               v1::BackupResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (FinishedStarting(reactor)) return reactor;
  auto caller = OwnerCallerOf(ctx, "Backup");
  if (!caller.ok()) {
    Finish(core_, reactor, caller.status(), "Backup");
    return reactor;
  }
  TransferSpec spec = ToTransferSpec(*req);
  spec.caller = *caller;
  spec.deadline = CallerDeadlineOf(*ctx);
  CacheCore* core = core_;
  core_->Backup(std::move(spec), [core, reactor, resp](StatusOr<BackupResult> result) {
    if (result.ok()) {
      for (BlockResult r : result->results) {
        resp->add_results(static_cast<v1::BlockStatus>(static_cast<int>(r)));
      }
      resp->set_ticket(result->ticket);
    }
    Finish(core, reactor, result.status(), "Backup");
  });
  return reactor;
}

grpc::ServerUnaryReactor* CacheService::Restore(grpc::CallbackServerContext* ctx,
                                                const v1::RestoreRequest* req,
                                                v1::RestoreResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (FinishedStarting(reactor)) return reactor;
  auto caller = OwnerCallerOf(ctx, "Restore");
  if (!caller.ok()) {
    Finish(core_, reactor, caller.status(), "Restore");
    return reactor;
  }
  TransferSpec spec = RestoreSpecFromProto(*req);
  spec.caller = *caller;
  spec.deadline = CallerDeadlineOf(*ctx);
  CacheCore* core = core_;
  core_->Restore(std::move(spec), [core, reactor, resp](StatusOr<RestoreResult> result) {
    if (result.ok()) {
      resp->set_restored_blocks(result->restored_blocks);
      resp->set_ticket(result->ticket);
    }
    Finish(core, reactor, result.status(), "Restore");
  });
  return reactor;
}

grpc::ServerUnaryReactor* CacheService::GetStats(grpc::CallbackServerContext* ctx,
                                                 const v1::GetStatsRequest* req,
                                                 v1::GetStatsResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (FinishedStarting(reactor)) return reactor;
  auto caller = CallerOf(ctx);
  if (!caller.ok()) {
    Finish(core_, reactor, caller.status(), "GetStats");
    return reactor;
  }
  constexpr uint32_t kDefaultNamespaces = 256;
  constexpr uint32_t kMaxNamespaces = 4096;
  if (req->namespaces_limit() > kMaxNamespaces) {
    Finish(core_, reactor,
           InvalidArgument("namespaces_limit: " + std::to_string(req->namespaces_limit()) +
                           ", at most " + std::to_string(kMaxNamespaces)),
           "GetStats");
    return reactor;
  }
  const uint32_t limit =
      req->namespaces_limit() != 0 ? req->namespaces_limit() : kDefaultNamespaces;
  // A page of the namespaces, in namespace_id order, so that the answer stays small whatever
  // clients register.
  CoreSnapshot snap = core_->Snapshot(*caller, req->namespaces_offset(), limit);
  resp->set_pool_bytes(snap.store.pool_bytes);
  resp->set_used_bytes(snap.store.used_bytes);
  resp->set_blocks(snap.store.blocks);
  resp->set_clients(snap.clients);
  resp->set_uptime_seconds(snap.uptime_seconds);
  resp->set_capacity_bytes(snap.store.capacity_bytes);
  resp->set_cuda_staging_bytes(snap.staging_device_bytes);
  resp->set_device(device_);
  resp->set_shm_name(shm_name_);
  resp->set_caller_uid(caller->uid);
  resp->set_caller_admin(caller->admin);
  resp->set_namespaces_total(snap.namespaces_total);
  resp->set_corrupt_blocks(snap.store.corrupt);
  if (snap.l3.enabled) {
    const L3Stats& l3 = snap.l3;
    v1::L3Stats* out = resp->mutable_l3();
    out->set_enabled(true);
    out->set_lookup_hits(l3.lookup_hits);
    out->set_lookup_misses(l3.lookup_misses);
    out->set_lookup_errors(l3.lookup_errors);
    out->set_fetches(l3.fetches);
    out->set_fetched_blocks(l3.fetched_blocks);
    out->set_fetch_errors(l3.fetch_errors);
    out->set_corrupt_values(l3.corrupt_values);
    out->set_promoted_blocks(l3.promotions);
    out->set_writes(l3.writes);
    out->set_write_errors(l3.write_errors);
    out->set_dropped_writes(l3.dropped_writes);
    out->set_skipped_writes(l3.skipped_writes);
    out->set_write_queue_bytes(l3.write_queue_bytes);
    out->set_write_queue_blocks(l3.write_queue_blocks);
    out->set_bytes_in(l3.bytes_in);
    out->set_bytes_out(l3.bytes_out);
    out->set_fetch_latency_samples(l3.fetch_latency_samples);
    out->set_fetch_p50_us(l3.fetch_p50_us);
    out->set_fetch_p99_us(l3.fetch_p99_us);
    out->set_write_policy(l3.on_evict ? "on_evict" : "write_through");
    out->set_spilled_blocks(l3.spilled_blocks);
    out->set_budget_bytes(l3.budget_bytes);
    out->set_budget_used_bytes(l3.budget_used_bytes);
    out->set_budget_deletes(l3.budget_deletes);
  }
  for (const NamespaceSnapshot& n : snap.namespaces) {
    auto* out = resp->add_namespaces();
    out->set_namespace_id(n.namespace_id);
    out->set_model(n.model);
    out->set_tenant(n.tenant);
    out->set_codec(ToProtoCodec(n.codec));
    out->set_encoded_bytes_per_token(n.encoded_bytes_per_token);
    out->set_blocks(n.counters.blocks);
    out->set_bytes(n.counters.bytes);
    out->set_hits(n.counters.hits);
    out->set_misses(n.counters.misses);
    out->set_backups(n.counters.backups);
    out->set_restores(n.counters.restores);
    out->set_evictions(n.counters.evictions);
    out->set_rejected(n.counters.rejected);
    out->set_pools(n.pools);
    out->set_capacity_blocks(n.counters.capacity_blocks);
    out->set_corrupt(n.counters.corrupt);
  }
  for (const auto& p : snap.pools) {
    auto* out = resp->add_pools();
    out->set_pool_id(p.pool_id);
    out->set_namespace_id(p.namespace_id);
    out->set_model(p.model);
    out->set_tenant(p.tenant);
    out->set_device(p.cuda ? v1::DEVICE_KIND_CUDA : v1::DEVICE_KIND_HOST);
    out->set_client_pid(p.client_pid);
    out->set_backups(p.backups);
    out->set_restores(p.restores);
    out->set_peer(p.peer);
    out->set_uid(p.uid);
    out->set_owned(p.owned);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* CacheService::Drain(grpc::CallbackServerContext* ctx,
                                              const v1::DrainRequest*, v1::DrainResponse* resp) {
  auto* reactor = ctx->DefaultReactor();
  if (FinishedStarting(reactor)) return reactor;
  auto caller = CallerOf(ctx);
  if (caller.ok() && !caller->admin) {
    std::string why = " (this call carried no session)";
    if (caller->authenticated()) {
      why = " (this session's uid " + std::to_string(caller->uid) +
            (caller->pod.empty()
                 ? std::string(" is not)")
                 : " runs in " + LogSafe(caller->pod) + ", where no uid is an admin)");
    }
    caller = PermissionDenied(
        "Drain is for admins (uid 0, the daemon's user, or admin_uids/admin_groups, on the host "
        "or in the daemon's own pod): open a session as one of them" +
        why);
  }
  if (!caller.ok()) {
    HIQ_LOG(WARN) << "event=drain_refused peer=" << LogSafe(ctx->peer()) << " "
                  << caller.status().ToString();
    Finish(core_, reactor, caller.status(), "Drain");
    return reactor;
  }
  std::call_once(drain_once_, [&] {
    HIQ_LOG(INFO) << "event=drain pid=" << caller->pid << " uid=" << caller->uid;
    if (drain_hook_) drain_hook_();
    core_->StartDraining();
  });
  resp->set_pending_tasks(core_->PendingTasks());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace hiqcache::server
