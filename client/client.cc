#include "hiqcache/client.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>
#include <unordered_map>
#include <utility>

#include "channel.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/log.h"
#include "hiqcache/mutex.h"
#include "hiqcache/session.h"
#include "hiqcache/session_protocol.h"
#include "hiqcache/v1/cache.grpc.pb.h"
#include "pool_slots.h"
#include "session_watcher.h"

namespace hiqcache {
namespace {

namespace v1 = ::hiqcache::v1;
using client_internal::AttachSession;
using client_internal::FromGrpc;
using client_internal::PoolSlots;
using client_internal::SessionWatcher;
using Clock = std::chrono::steady_clock;

// --- PoolSpec -> proto -------------------------------------------------------------------------

void ToProto(const TensorView& in, v1::TensorView* out) {
  out->set_buffer(in.buffer);
  out->set_offset_bytes(in.offset_bytes);
  out->set_row_stride_bytes(in.row_stride_bytes);
  out->set_num_rows(in.num_rows);
  out->set_head_stride_bytes(in.head_stride_bytes);
  out->set_page_rows(in.page_rows);
  out->set_page_stride_bytes(in.page_stride_bytes);
  out->set_row_group(in.row_group);
  out->set_row_group_stride_bytes(in.row_group_stride_bytes);
  out->set_dim_run(in.dim_run);
  out->set_dim_run_stride_bytes(in.dim_run_stride_bytes);
  out->set_dim_stride_bytes(in.dim_stride_bytes);
}

void ToProto(const Geometry& in, v1::Geometry* g) {
  g->set_num_layers(in.num_layers);
  g->set_num_kv_heads(in.num_kv_heads);
  g->set_head_dim(in.head_dim);
  g->set_dtype(in.dtype == DType::kFP16 ? v1::DTYPE_FP16 : v1::DTYPE_BF16);
  g->set_attention(in.attention == Attention::kMLA ? v1::ATTENTION_MLA : v1::ATTENTION_MHA);
  g->set_tp_rank(in.tp_rank);
  g->set_tp_size(in.tp_size);
  // Unset when absent: other codecs' requests stay as they were.
  if (in.rope_theta != 0 || in.rope_interleaved) {
    g->mutable_rope()->set_theta(in.rope_theta);
    g->mutable_rope()->set_interleaved(in.rope_interleaved);
  }
}

// Codec is numbered as the wire's (pool_spec.h; codec_names_test checks each name).
static_assert(v1::Codec_ARRAYSIZE == kCodecCount,
              "a Codec value of the proto needs its row in kCodecNames (hiqcache/codec_names.h)");
v1::Codec ToProto(Codec c) { return static_cast<v1::Codec>(c); }

void ToProto(const NamespaceRef& in, v1::NamespaceRef* out) {
  out->set_model(in.model);
  out->set_tenant(in.tenant);
  ToProto(in.geometry, out->mutable_geometry());
  out->set_block_tokens(in.block_tokens);
  out->set_codec(ToProto(in.codec));
}

v1::RegisterPoolRequest ToProto(const PoolSpec& spec) {
  v1::RegisterPoolRequest req;
  req.set_model(spec.model);
  req.set_tenant(spec.tenant);
  ToProto(spec.geometry, req.mutable_geometry());
  req.set_block_tokens(spec.block_tokens);
  req.set_codec(ToProto(spec.codec));
  req.mutable_device()->set_kind(spec.device == DeviceKind::kCuda ? v1::DEVICE_KIND_CUDA
                                                                  : v1::DEVICE_KIND_HOST);
  req.mutable_device()->set_cuda_device_uuid(spec.cuda_device_uuid);
  for (const SharedBuffer& b : spec.buffers) {
    v1::SharedBuffer* out = req.add_buffers();
    if (!b.cuda_ipc_handle.empty()) {
      out->set_cuda_ipc_handle(b.cuda_ipc_handle);
    } else if (!b.host_shm_name.empty() || b.host_fd < 0) {
      out->set_host_shm_name(b.host_shm_name);
    }  // else fd only: RegisterLocked sets host_fd_id
    out->set_size_bytes(b.size_bytes);
  }
  for (const LayerView& l : spec.layers) {
    v1::LayerView* out = req.add_layers();
    ToProto(l.k, out->mutable_k());
    if (l.v) ToProto(*l.v, out->mutable_v());
  }
  v1::EventPool* ev = req.mutable_events();
  ev->set_host_shm_name(spec.events.host_shm_name);
  ev->set_count(spec.events.count);
  for (const std::string& h : spec.events.cuda_ipc_event_handles) ev->add_cuda_ipc_event_handles(h);
  req.set_client_pid(static_cast<uint32_t>(::getpid()));
  return req;
}

// A value this library does not know (a newer daemon's codec) stays unknown: CodecName says so.
Codec FromProto(v1::Codec c) {
  const int v = static_cast<int>(c);
  return v >= 0 && static_cast<uint32_t>(v) < kCodecCount ? static_cast<Codec>(v)
                                                          : static_cast<Codec>(0xFF);
}

DaemonStats FromProto(const v1::GetStatsResponse& r) {
  DaemonStats s;
  s.pool_bytes = r.pool_bytes();
  s.used_bytes = r.used_bytes();
  s.capacity_bytes = r.capacity_bytes();
  s.cuda_staging_bytes = r.cuda_staging_bytes();
  s.blocks = r.blocks();
  s.clients = r.clients();
  s.uptime_seconds = r.uptime_seconds();
  s.device = r.device();
  s.shm_name = r.shm_name();
  for (const v1::NamespaceStats& n : r.namespaces()) {
    NamespaceStats o;
    o.namespace_id = n.namespace_id();
    o.model = n.model();
    o.tenant = n.tenant();
    o.codec = FromProto(n.codec());
    o.encoded_bytes_per_token = n.encoded_bytes_per_token();
    o.blocks = n.blocks();
    o.bytes = n.bytes();
    o.hits = n.hits();
    o.misses = n.misses();
    o.backups = n.backups();
    o.restores = n.restores();
    o.evictions = n.evictions();
    o.rejected = n.rejected();
    o.pools = n.pools();
    o.capacity_blocks = n.capacity_blocks();
    s.namespaces.push_back(std::move(o));
  }
  s.namespaces_total = r.namespaces_total();
  s.caller_uid = r.caller_uid();
  s.caller_admin = r.caller_admin();
  if (r.has_l3()) {
    const v1::L3Stats& l = r.l3();
    s.l3.enabled = l.enabled();
    s.l3.lookup_hits = l.lookup_hits();
    s.l3.lookup_misses = l.lookup_misses();
    s.l3.lookup_errors = l.lookup_errors();
    s.l3.fetches = l.fetches();
    s.l3.fetched_blocks = l.fetched_blocks();
    s.l3.fetch_errors = l.fetch_errors();
    s.l3.corrupt_values = l.corrupt_values();
    s.l3.promoted_blocks = l.promoted_blocks();
    s.l3.writes = l.writes();
    s.l3.write_errors = l.write_errors();
    s.l3.dropped_writes = l.dropped_writes();
    s.l3.skipped_writes = l.skipped_writes();
    s.l3.write_queue_bytes = l.write_queue_bytes();
    s.l3.write_queue_blocks = l.write_queue_blocks();
    s.l3.bytes_in = l.bytes_in();
    s.l3.bytes_out = l.bytes_out();
    s.l3.fetch_latency_samples = l.fetch_latency_samples();
    s.l3.fetch_p50_us = l.fetch_p50_us();
    s.l3.fetch_p99_us = l.fetch_p99_us();
    s.l3.write_policy = l.write_policy();
    s.l3.spilled_blocks = l.spilled_blocks();
    s.l3.budget_bytes = l.budget_bytes();
    s.l3.budget_used_bytes = l.budget_used_bytes();
    s.l3.budget_deletes = l.budget_deletes();
  }
  for (const v1::PoolInfo& p : r.pools()) {
    PoolStats o;
    o.pool_id = p.pool_id();
    o.namespace_id = p.namespace_id();
    o.model = p.model();
    o.tenant = p.tenant();
    o.device = p.device() == v1::DEVICE_KIND_CUDA ? DeviceKind::kCuda : DeviceKind::kHost;
    o.client_pid = p.client_pid();
    o.backups = p.backups();
    o.restores = p.restores();
    o.peer = p.peer();
    o.uid = p.uid();
    o.owned = p.owned();
    s.pools.push_back(std::move(o));
  }
  return s;
}

BlockStatus FromProto(v1::BlockStatus s) {
  switch (s) {
    case v1::BLOCK_STORED:
      return BlockStatus::kStored;
    case v1::BLOCK_ALREADY_PRESENT:
      return BlockStatus::kAlreadyPresent;
    default:
      return BlockStatus::kRejected;
  }
}

void AddBlocks(std::span<const BlockKey> keys, std::span<const uint32_t> rows,
               uint32_t block_tokens, google::protobuf::RepeatedPtrField<v1::Block>* blocks) {
  blocks->Reserve(static_cast<int>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) {
    v1::Block* b = blocks->Add();
    b->set_key(reinterpret_cast<const char*>(keys[i].data()), keys[i].size());
    b->mutable_rows()->Add(rows.begin() + i * block_tokens, rows.begin() + (i + 1) * block_tokens);
  }
}

// Errors after which the pool id may no longer name our registration: the daemon is gone or
// restarted (UNAVAILABLE), it does not know the id (NOT_FOUND), or it does not know the session
// the call named (UNAUTHENTICATED: it restarted between the session check and the call).
bool IsStalePool(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kNotFound ||
         s.code() == StatusCode::kUnauthenticated;
}

// gRPC takes system_clock deadlines; the client keeps steady ones so that clock steps cannot
// stretch a call.
std::chrono::system_clock::time_point GrpcDeadline(Clock::time_point deadline) {
  const auto left = std::max(deadline - Clock::now(), Clock::duration::zero());
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(left);
}

bool IsUnreachable(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded;
}

// An fd this client opened, closed when the registration no longer needs it (the daemon keeps
// its own copy, passed over the session).
class OwnedFd {
 public:
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  OwnedFd& operator=(OwnedFd&&) = delete;
  ~OwnedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

uint32_t BackupResult::held() const {
  uint32_t n = 0;
  for (BlockStatus b : blocks) n += b == BlockStatus::kStored || b == BlockStatus::kAlreadyPresent;
  return n;
}

// ---------------------------------------------------------------------------------------------

class Client::Impl {
 public:
  Impl(ClientOptions options, std::string target)
      : options_(std::move(options)),
        target_(std::move(target)),
        channel_(client_internal::MakeChannel(target_)),
        stub_(v1::Cache::NewStub(channel_)),
        session_capable_(!SessionSocketPathForTarget(target_).empty()),
        watcher_([this] { WatchChannel(); }) {}

  ~Impl() {
    {
      // First, so that nothing is released for the sessions closed below.
      MutexLock lock(&session_watcher_mu_);
      session_watcher_.reset();
    }
    stop_.store(true);
    watcher_.join();
  }

  const std::string& target() const { return target_; }

  StatusOr<PoolHandle> RegisterPool(const PoolSpec& spec, bool pending_if_unavailable);
  StatusOr<RegisteredPool> PoolInfo(PoolHandle h) const;
  Status ReleasePool(PoolHandle h);
  LookupResult Lookup(PoolHandle h, std::span<const BlockKey> keys);
  LookupResult LookupGroup(std::span<const NamespaceRef> namespaces,
                           std::span<const BlockKey> keys);
  BackupResult Backup(PoolHandle h, std::span<const BlockKey> keys, std::span<const uint32_t> rows,
                      const BackupOptions& o);
  RestoreResult Restore(PoolHandle h, std::span<const BlockKey> keys,
                        std::span<const uint32_t> rows, const RestoreOptions& o);
  StatusOr<uint32_t> Evict(PoolHandle h, std::span<const BlockKey> keys);
  StatusOr<DaemonStats> GetStats(uint32_t namespaces_offset, uint32_t namespaces_limit);

 private:
  struct Pool {
    uint64_t handle = 0;
    v1::RegisterPoolRequest request;  // kept for re-registration; names, never fd ids
    uint32_t block_tokens = 0;
    std::vector<int> buffer_fds;  // SharedBuffer::host_fd per buffer (borrowed; -1 = none)
    int events_fd = -1;           // EventPoolSpec::host_fd (borrowed)
    // The client's own mapping of the event slots (null: none), released when the session of
    // the registration ends without the client closing it.
    std::shared_ptr<PoolSlots> slots;
    uint32_t num_layers = 0;

    Mutex mu;                               // serializes (re)registration; guards the fields below
    uint64_t server_id GUARDED_BY(mu) = 0;  // 0 = not registered
    uint64_t epoch GUARDED_BY(mu) = 0;      // connection epoch of the registration
    // The session the registration went through (null: none, the pool is anonymous and
    // epoch-checked). While it is alive the daemon has not restarted and server_id is ours.
    std::shared_ptr<Session> session GUARDED_BY(mu);
    RegisteredPool info GUARDED_BY(mu);
    bool registered_once GUARDED_BY(mu) = false;
    bool attempted GUARDED_BY(mu) = false;
    Clock::time_point last_attempt GUARDED_BY(mu);
    Status last_error GUARDED_BY(mu);
  };

  std::shared_ptr<Pool> Find(PoolHandle h) const {
    MutexLock lock(&mu_);
    auto it = pools_.find(h.id);
    return it == pools_.end() ? nullptr : it->second;
  }
  // Marks the slots a request names for the daemon's tickets; returns the pool's slots (null:
  // none, or an unknown handle).
  std::shared_ptr<PoolSlots> NoteRequest(PoolHandle h, int32_t done_event,
                                         int32_t layer_event_base) const {
    std::shared_ptr<Pool> pool = Find(h);
    if (pool == nullptr || pool->slots == nullptr) return nullptr;
    pool->slots->NoteDaemonSlots(done_event, layer_event_base, pool->num_layers);
    return pool->slots;
  }
  // Has the session watcher (started on first use) release `slots` when `session` ends.
  void WatchSession(const std::shared_ptr<Session>& session,
                    const std::shared_ptr<PoolSlots>& slots);

  // Whether pool.server_id still names this registration on the daemon.
  bool IdIsCurrent(const Pool& pool) const REQUIRES(pool.mu) {
    if (pool.server_id == 0) return false;
    if (pool.session != nullptr) return pool.session->alive();
    return pool.epoch == epoch_.load();
  }
  // This client's session with the daemon, opened when there is none or it died (the daemon
  // restarted); null for targets without sessions, or when it cannot be opened. After a failed
  // open the next one waits reregister_interval unless `force`. Never blocks longer than
  // min(call_timeout, 2 s).
  std::shared_ptr<Session> CurrentSession(bool force);
  // Sets the deadline and the session token of a call; PERMISSION_DENIED (the call must not
  // be made) while the listener at the target is not one this process trusts.
  Status Prepare(grpc::ClientContext* ctx, Clock::time_point deadline) {
    ctx->set_deadline(GrpcDeadline(deadline));
    std::shared_ptr<Session> session = CurrentSession(false);
    if (session == nullptr) HIQ_RETURN_IF_ERROR(TrustError());
    AttachSession(session.get(), ctx);
    return Status::Ok();
  }
  // Why the last session open refused the listener (socket_trust.h); OK when it did not.
  Status TrustError() {
    MutexLock lock(&session_mu_);
    return trust_error_;
  }
  // Fills `out` (a copy of pool.request) with fd ids for the HOST buffers and the event object,
  // passing their fds over `session`. False when nothing went by fd.
  StatusOr<bool> PassFds(const Pool& pool, Session& session, v1::RegisterPoolRequest* out);
  Status RegisterLocked(Pool& pool, Clock::time_point deadline) REQUIRES(pool.mu);
  // The pool's current daemon id, registering it first when needed (rate-limited).
  StatusOr<uint64_t> EnsureRegistered(Pool& pool, Clock::time_point deadline);
  // Forgets `stale_id` unless another thread has re-registered already.
  void Invalidate(Pool& pool, uint64_t stale_id, const Status& why);
  // Runs rpc(context, server pool id) with the call deadline, re-registering and retrying once
  // when the id has gone stale.
  template <typename Rpc>
  Status WithPool(PoolHandle h, Rpc&& rpc);

  // Counts breaks of the connection: each time the channel leaves READY the daemon may have
  // restarted, and every pool id it handed out may now name someone else's pool.
  void WatchChannel() {
    grpc_connectivity_state state = channel_->GetState(false);
    while (!stop_.load(std::memory_order_relaxed)) {
      if (channel_->WaitForStateChange(
              state, std::chrono::system_clock::now() + std::chrono::milliseconds(100))) {
        const grpc_connectivity_state next = channel_->GetState(false);
        if (state == GRPC_CHANNEL_READY && next != GRPC_CHANNEL_READY) {
          epoch_.fetch_add(1);
          HIQ_LOG(DEBUG) << "hiqcache client: connection to " << target_ << " broke";
        }
        state = next;
      }
    }
  }

  const ClientOptions options_;
  const std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Cache::Stub> stub_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<bool> stop_{false};

  const bool session_capable_;  // a unix target: the daemon may serve a session beside it
  Mutex session_mu_;
  std::shared_ptr<Session> session_ GUARDED_BY(session_mu_);
  Clock::time_point session_retry_at_ GUARDED_BY(session_mu_) = {};
  bool session_warned_ GUARDED_BY(session_mu_) = false;
  // Set while the listener is not trusted: no call goes to it, not even anonymous ones.
  Status trust_error_ GUARDED_BY(session_mu_);

  mutable Mutex mu_;
  uint64_t next_handle_ GUARDED_BY(mu_) = 1;
  std::unordered_map<uint64_t, std::shared_ptr<Pool>> pools_ GUARDED_BY(mu_);

  Mutex session_watcher_mu_;
  std::unique_ptr<SessionWatcher> session_watcher_ GUARDED_BY(session_watcher_mu_);
  bool session_watcher_failed_ GUARDED_BY(session_watcher_mu_) = false;

  std::thread watcher_;  // last: starts after everything it reads
};

void Client::Impl::WatchSession(const std::shared_ptr<Session>& session,
                                const std::shared_ptr<PoolSlots>& slots) {
  if (session == nullptr || slots == nullptr) return;
  MutexLock lock(&session_watcher_mu_);
  if (session_watcher_ == nullptr && !session_watcher_failed_) {
    auto started = SessionWatcher::Start(target_);
    if (started.ok()) {
      session_watcher_ = std::move(started).value();
    } else {
      session_watcher_failed_ = true;
      HIQ_LOG(WARN) << "hiqcache client: " << started.status().ToString()
                    << "; waiters are not released if hiqcached dies";
    }
  }
  if (session_watcher_ != nullptr) session_watcher_->Watch(session, slots);
}

std::shared_ptr<Session> Client::Impl::CurrentSession(bool force) {
  if (!session_capable_) return nullptr;
  MutexLock lock(&session_mu_);
  if (session_ != nullptr && session_->alive()) return session_;
  const auto now = Clock::now();
  if (!force && now < session_retry_at_) return nullptr;
  const bool reopen = session_ != nullptr;
  session_.reset();
  auto opened = Session::Open(
      target_, std::min<std::chrono::milliseconds>(options_.call_timeout, std::chrono::seconds(2)));
  if (!opened.ok()) {
    session_retry_at_ = now + options_.reregister_interval;
    if (opened.status().code() == StatusCode::kPermissionDenied) {
      if (trust_error_.ok()) {
        HIQ_LOG(ERROR) << "hiqcache client: " << opened.status().ToString() << "; no call goes to "
                       << target_ << " (every lookup is a miss)";
      }
      trust_error_ = opened.status();
      return nullptr;
    }
    if (!session_warned_) {
      session_warned_ = true;
      HIQ_LOG(WARN) << "hiqcache client: no session with hiqcached at " << target_ << ": "
                    << opened.status().ToString()
                    << "; calls are anonymous and HOST buffers are registered by name";
    }
    return nullptr;
  }
  session_ = std::move(opened).value();
  session_warned_ = false;
  trust_error_ = Status::Ok();
  HIQ_LOG(DEBUG) << "hiqcache client: " << (reopen ? "reopened" : "opened") << " session "
                 << session_->path() << " (pid " << session_->pid() << ", uid " << session_->uid()
                 << ")";
  return session_;
}

StatusOr<bool> Client::Impl::PassFds(const Pool& pool, Session& session,
                                     v1::RegisterPoolRequest* out) {
  *out = pool.request;
  std::vector<OwnedFd> opened;  // ours, closed on return: the daemon holds its own copies
  std::vector<int> fds;
  std::vector<int> slot;  // per fd: buffer index, or -1 for the event object
  auto open_name = [&](const std::string& name) -> int {
    if (name.empty()) return -1;
    // With the caller's own rights: the daemon then needs none of its own on the object.
    const int fd = ::shm_open(HostShm::NormalizeName(name).c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) return -1;  // sent by name: the daemon reports it with the field it names
    opened.emplace_back(fd);
    return fd;
  };
  for (int i = 0; i < pool.request.buffers_size(); ++i) {
    if (pool.request.buffers(i).has_cuda_ipc_handle()) continue;
    int fd = pool.buffer_fds[i];
    if (fd < 0) fd = open_name(pool.request.buffers(i).host_shm_name());
    if (fd < 0) continue;
    fds.push_back(fd);
    slot.push_back(i);
  }
  int ev_fd = pool.events_fd;
  if (ev_fd < 0) ev_fd = open_name(pool.request.events().host_shm_name());
  if (ev_fd >= 0) {
    fds.push_back(ev_fd);
    slot.push_back(-1);
  }
  if (fds.empty()) return false;
  HIQ_ASSIGN_OR_RETURN(std::vector<uint64_t> ids, session.SendFds(fds));
  for (size_t k = 0; k < ids.size(); ++k) {
    if (slot[k] < 0) {
      out->mutable_events()->clear_host_shm_name();
      out->mutable_events()->set_host_fd_id(ids[k]);
    } else {
      out->mutable_buffers(slot[k])->set_host_fd_id(ids[k]);  // replaces host_shm_name (oneof)
    }
  }
  return true;
}

Status Client::Impl::RegisterLocked(Pool& pool, Clock::time_point deadline) {
  pool.attempted = true;
  pool.last_attempt = Clock::now();
  const uint64_t epoch = epoch_.load();
  std::shared_ptr<Session> session = CurrentSession(/*force=*/true);
  bool fd_only = pool.events_fd >= 0 && pool.request.events().host_shm_name().empty();
  for (int i = 0; i < pool.request.buffers_size(); ++i) {
    fd_only |= pool.buffer_fds[i] >= 0 && pool.request.buffers(i).host_shm_name().empty();
  }
  v1::RegisterPoolRequest by_fd;
  const v1::RegisterPoolRequest* request = &pool.request;
  Status s;
  if (session != nullptr) {
    StatusOr<bool> passed = PassFds(pool, *session, &by_fd);
    if (passed.ok() && *passed) {
      request = &by_fd;
    } else if (!passed.ok()) {
      s = passed.status();
      if (!fd_only) {
        HIQ_LOG(WARN) << "hiqcache client: cannot pass the fds of pool " << pool.handle << ": "
                      << s.ToString() << "; registering its buffers by name";
        s = Status::Ok();
      }
    }
  } else if (Status untrusted = TrustError(); !untrusted.ok()) {
    s = untrusted;
  } else if (fd_only && session_capable_) {
    // A unix target whose session cannot be opened now is a daemon that is down or restarting:
    // UNAVAILABLE, so that a pending pool registers once it is back.
    s = Unavailable(
        "buffers: a buffer or event object given only by host_fd needs a session "
        "with hiqcached at " +
        target_ + ", which cannot be opened now");
  } else if (fd_only) {
    s = FailedPrecondition(
        "buffers: a buffer or event object given only by host_fd needs a session with hiqcached "
        "at " +
        target_ + " (a unix target, and a daemon that serves sessions)");
  }
  v1::RegisterPoolResponse resp;
  if (s.ok()) {
    grpc::ClientContext ctx;
    ctx.set_deadline(GrpcDeadline(deadline));
    AttachSession(session.get(), &ctx);
    s = FromGrpc(stub_->RegisterPool(&ctx, *request, &resp), target_);
  }
  if (!s.ok()) {
    pool.server_id = 0;
    pool.session.reset();
    pool.last_error = s;
    return s;
  }
  if (pool.registered_once) {
    // A re-registered HOST pool starts from zeroed slots. The daemon took its ticket floor
    // from them during RegisterPool, so its new tickets lie above every value they held.
    if (pool.slots != nullptr && pool.request.device().kind() != v1::DEVICE_KIND_CUDA) {
      pool.slots->Reset();
    }
    HIQ_LOG(INFO) << "hiqcache client: pool " << pool.handle << " re-registered with " << target_
                  << " as pool " << resp.pool_id();
  }
  pool.server_id = resp.pool_id();
  pool.epoch = epoch;
  pool.session = std::move(session);
  pool.info.pool_id = resp.pool_id();
  pool.info.namespace_id = resp.namespace_id();
  pool.info.encoded_bytes_per_token = resp.encoded_bytes_per_token();
  pool.info.block_bytes = resp.block_bytes();
  pool.info.capacity_tokens = resp.capacity_tokens();
  pool.registered_once = true;
  pool.last_error = Status::Ok();
  WatchSession(pool.session, pool.slots);
  return Status::Ok();
}

StatusOr<uint64_t> Client::Impl::EnsureRegistered(Pool& pool, Clock::time_point deadline) {
  MutexLock lock(&pool.mu);
  if (pool.server_id != 0) {
    if (IdIsCurrent(pool)) return pool.server_id;
    // The session died (the daemon restarted) or, without a session, the connection broke
    // since: the id may be stale.
    pool.server_id = 0;
  }
  const auto now = Clock::now();
  if (pool.attempted && now - pool.last_attempt < options_.reregister_interval) {
    return Unavailable("pool not registered with hiqcached at " + target_ +
                       " (next attempt rate-limited); last error: " + pool.last_error.ToString());
  }
  const bool was_registered = pool.registered_once;
  Status s = RegisterLocked(pool, deadline);
  if (!s.ok()) {
    if (was_registered) {
      HIQ_LOG(DEBUG) << "hiqcache client: re-registering pool " << pool.handle
                     << " failed: " << s.ToString();
    }
    return s;
  }
  return pool.server_id;
}

void Client::Impl::Invalidate(Pool& pool, uint64_t stale_id, const Status& why) {
  MutexLock lock(&pool.mu);
  if (pool.server_id != stale_id) return;
  if (why.code() == StatusCode::kUnavailable && pool.session != nullptr && pool.session->alive()) {
    // The same daemon still holds the session, so the id is still ours (a reconnect, or a
    // draining daemon): keep it.
    return;
  }
  HIQ_LOG(WARN) << "hiqcache client: pool " << pool.handle << " (daemon pool " << stale_id
                << ") lost: " << why.ToString() << "; will re-register";
  pool.server_id = 0;
  pool.last_error = why;
  // Allow an immediate re-registration unless one was attempted very recently.
}

template <typename Rpc>
Status Client::Impl::WithPool(PoolHandle h, Rpc&& rpc) {
  std::shared_ptr<Pool> pool = Find(h);
  if (pool == nullptr) return InvalidArgument("unknown pool handle " + std::to_string(h.id));
  const auto deadline = Clock::now() + options_.call_timeout;
  Status status;
  for (int attempt = 0; attempt < 2; ++attempt) {
    StatusOr<uint64_t> id = EnsureRegistered(*pool, deadline);
    if (!id.ok()) return id.status();
    grpc::ClientContext ctx;
    HIQ_RETURN_IF_ERROR(Prepare(&ctx, deadline));
    status = FromGrpc(rpc(&ctx, *id, pool->block_tokens), target_);
    if (status.ok() || !IsStalePool(status)) return status;
    Invalidate(*pool, *id, status);
  }
  return status;
}

StatusOr<PoolHandle> Client::Impl::RegisterPool(const PoolSpec& spec, bool pending_if_unavailable) {
  if (spec.block_tokens == 0) return InvalidArgument("block_tokens: must be > 0");
  auto pool = std::make_shared<Pool>();
  pool->request = ToProto(spec);
  pool->block_tokens = spec.block_tokens;
  for (const SharedBuffer& b : spec.buffers) {
    pool->buffer_fds.push_back(b.cuda_ipc_handle.empty() ? b.host_fd : -1);
  }
  pool->events_fd = spec.events.host_fd;
  pool->num_layers = spec.geometry.num_layers;
  if (auto slots = PoolSlots::Map(spec.events); slots.ok()) {
    pool->slots = std::move(slots).value();
  } else {
    // The daemon reports the same object when it opens it; without a mapping here, waiters are
    // not released should it die.
    HIQ_LOG(WARN) << "hiqcache client: cannot map the event slots of a pool: "
                  << slots.status().ToString();
  }
  {
    MutexLock lock(&mu_);
    pool->handle = next_handle_++;
  }
  {
    MutexLock lock(&pool->mu);
    Status s = RegisterLocked(*pool, Clock::now() + options_.register_timeout);
    if (!s.ok() && !(pending_if_unavailable && IsUnreachable(s))) return s;
    if (!s.ok()) {
      HIQ_LOG(WARN) << "hiqcache client: " << s.ToString()
                    << "; pool kept pending, registers once the daemon is back";
    }
  }
  MutexLock lock(&mu_);
  pools_.emplace(pool->handle, pool);
  return PoolHandle{pool->handle};
}

StatusOr<RegisteredPool> Client::Impl::PoolInfo(PoolHandle h) const {
  std::shared_ptr<Pool> pool = Find(h);
  if (pool == nullptr) return InvalidArgument("unknown pool handle " + std::to_string(h.id));
  MutexLock lock(&pool->mu);
  if (!IdIsCurrent(*pool)) {
    return Unavailable("pool not registered with hiqcached at " + target_ +
                       (pool->last_error.ok() ? "" : ": " + pool->last_error.ToString()));
  }
  return pool->info;
}

Status Client::Impl::ReleasePool(PoolHandle h) {
  std::shared_ptr<Pool> pool;
  {
    MutexLock lock(&mu_);
    auto it = pools_.find(h.id);
    if (it == pools_.end()) return InvalidArgument("unknown pool handle " + std::to_string(h.id));
    pool = std::move(it->second);
    pools_.erase(it);
  }
  if (pool->slots != nullptr) pool->slots->Forget();
  MutexLock lock(&pool->mu);
  if (!IdIsCurrent(*pool)) return Status::Ok();
  grpc::ClientContext ctx;
  ctx.set_deadline(GrpcDeadline(Clock::now() + options_.call_timeout));
  AttachSession(pool->session.get(), &ctx);
  v1::ReleasePoolRequest req;
  req.set_pool_id(pool->server_id);
  v1::ReleasePoolResponse resp;
  pool->server_id = 0;
  return FromGrpc(stub_->ReleasePool(&ctx, req, &resp), target_);
}

LookupResult Client::Impl::Lookup(PoolHandle h, std::span<const BlockKey> keys) {
  LookupResult result;
  if (keys.empty()) {
    result.status = Find(h) ? Status::Ok() : InvalidArgument("unknown pool handle");
    return result;
  }
  v1::LookupResponse resp;
  result.status = WithPool(h, [&](grpc::ClientContext* ctx, uint64_t id, uint32_t) {
    v1::LookupRequest req;
    req.set_pool_id(id);
    for (const BlockKey& k : keys) req.add_keys(reinterpret_cast<const char*>(k.data()), k.size());
    return stub_->Lookup(ctx, req, &resp);
  });
  if (result.status.ok())
    result.prefix_blocks = std::min<uint32_t>(resp.prefix_blocks(), keys.size());
  return result;
}

LookupResult Client::Impl::LookupGroup(std::span<const NamespaceRef> namespaces,
                                       std::span<const BlockKey> keys) {
  LookupResult result;
  if (namespaces.empty()) {
    result.status = InvalidArgument("namespaces: must not be empty");
    return result;
  }
  if (keys.empty()) return result;
  // No pool, so nothing to re-register: one call, no retry.
  v1::LookupRequest req;
  for (const NamespaceRef& ns : namespaces) ToProto(ns, req.add_namespaces());
  for (const BlockKey& k : keys) req.add_keys(reinterpret_cast<const char*>(k.data()), k.size());
  grpc::ClientContext ctx;
  result.status = Prepare(&ctx, Clock::now() + options_.call_timeout);
  if (!result.status.ok()) return result;
  v1::LookupResponse resp;
  result.status = FromGrpc(stub_->Lookup(&ctx, req, &resp), target_);
  if (result.status.ok()) {
    result.prefix_blocks = std::min<uint32_t>(resp.prefix_blocks(), keys.size());
  }
  return result;
}

BackupResult Client::Impl::Backup(PoolHandle h, std::span<const BlockKey> keys,
                                  std::span<const uint32_t> rows, const BackupOptions& o) {
  BackupResult result;
  result.blocks.assign(keys.size(), BlockStatus::kNotStored);
  const std::shared_ptr<PoolSlots> slots = NoteRequest(h, o.done_event, -1);
  v1::BackupResponse resp;
  result.status = WithPool(h, [&](grpc::ClientContext* ctx, uint64_t id, uint32_t block_tokens) {
    if (rows.size() != keys.size() * block_tokens) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "rows: expected " + std::to_string(keys.size() * block_tokens) +
                              " (keys * block_tokens), got " + std::to_string(rows.size()));
    }
    v1::BackupRequest req;
    req.set_pool_id(id);
    AddBlocks(keys, rows, block_tokens, req.mutable_blocks());
    req.set_wait_event(o.wait_event);
    req.set_wait_value(o.wait_value);
    req.set_done_event(o.done_event);
    req.set_sync(o.sync);
    return stub_->Backup(ctx, req, &resp);
  });
  if (!result.status.ok()) return result;
  for (int i = 0; i < resp.results_size() && i < static_cast<int>(keys.size()); ++i) {
    result.blocks[i] = FromProto(resp.results(i));
  }
  if (resp.results_size() != static_cast<int>(keys.size())) {
    result.status = Internal("BackupResponse has " + std::to_string(resp.results_size()) +
                             " results for " + std::to_string(keys.size()) + " blocks");
  }
  result.ticket = resp.ticket();
  if (slots != nullptr) slots->NoteTicket(result.ticket);
  return result;
}

RestoreResult Client::Impl::Restore(PoolHandle h, std::span<const BlockKey> keys,
                                    std::span<const uint32_t> rows, const RestoreOptions& o) {
  RestoreResult result;
  const std::shared_ptr<PoolSlots> slots = NoteRequest(h, o.done_event, o.layer_event_base);
  v1::RestoreResponse resp;
  result.status = WithPool(h, [&](grpc::ClientContext* ctx, uint64_t id, uint32_t block_tokens) {
    if (rows.size() != keys.size() * block_tokens) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "rows: expected " + std::to_string(keys.size() * block_tokens) +
                              " (keys * block_tokens), got " + std::to_string(rows.size()));
    }
    v1::RestoreRequest req;
    req.set_pool_id(id);
    AddBlocks(keys, rows, block_tokens, req.mutable_blocks());
    req.set_wait_event(o.wait_event);
    req.set_wait_value(o.wait_value);
    req.set_layer_event_base(o.layer_event_base);
    req.set_done_event(o.done_event);
    req.set_sync(o.sync);
    return stub_->Restore(ctx, req, &resp);
  });
  if (!result.status.ok()) return result;
  result.restored_blocks = std::min<uint32_t>(resp.restored_blocks(), keys.size());
  result.ticket = resp.ticket();
  if (slots != nullptr) slots->NoteTicket(result.ticket);
  return result;
}

StatusOr<uint32_t> Client::Impl::Evict(PoolHandle h, std::span<const BlockKey> keys) {
  v1::EvictResponse resp;
  Status s = WithPool(h, [&](grpc::ClientContext* ctx, uint64_t id, uint32_t) {
    v1::EvictRequest req;
    req.set_pool_id(id);
    for (const BlockKey& k : keys) req.add_keys(reinterpret_cast<const char*>(k.data()), k.size());
    return stub_->Evict(ctx, req, &resp);
  });
  if (!s.ok()) return s;
  return resp.evicted();
}

StatusOr<DaemonStats> Client::Impl::GetStats(uint32_t namespaces_offset,
                                             uint32_t namespaces_limit) {
  grpc::ClientContext ctx;
  HIQ_RETURN_IF_ERROR(Prepare(&ctx, Clock::now() + options_.call_timeout));
  v1::GetStatsRequest req;
  req.set_namespaces_offset(namespaces_offset);
  req.set_namespaces_limit(namespaces_limit);
  v1::GetStatsResponse resp;
  Status s = FromGrpc(stub_->GetStats(&ctx, req, &resp), target_);
  if (!s.ok()) return s;
  return FromProto(resp);
}

// ---------------------------------------------------------------------------------------------

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  auto target = client_internal::NormalizeTarget(options.target);
  if (!target.ok()) return target.status();
  // gRPC may throw std::bad_alloc and little else; keep the no-exceptions promise regardless.
  try {
    auto impl = std::make_unique<Impl>(std::move(options), std::move(target).value());
    return std::unique_ptr<Client>(new Client(std::move(impl)));
  } catch (const std::exception& e) {
    return Internal(std::string("hiqcache client: ") + e.what());
  }
}

StatusOr<std::unique_ptr<Client>> Client::Connect(std::string_view target) {
  ClientOptions options;
  options.target = std::string(target);
  return Connect(std::move(options));
}

const std::string& Client::target() const { return impl_->target(); }

// The library promises not to throw: gRPC and protobuf can still throw std::bad_alloc.
#define HIQ_CLIENT_NOTHROW(result_init, expr)                                  \
  try {                                                                        \
    return expr;                                                               \
  } catch (const std::exception& e) {                                          \
    auto hiq_result = result_init;                                             \
    hiq_result.status = Internal(std::string("hiqcache client: ") + e.what()); \
    return hiq_result;                                                         \
  }
#define HIQ_CLIENT_NOTHROW_STATUS(expr)                           \
  try {                                                           \
    return expr;                                                  \
  } catch (const std::exception& e) {                             \
    return Internal(std::string("hiqcache client: ") + e.what()); \
  }

StatusOr<PoolHandle> Client::RegisterPool(const PoolSpec& spec, bool pending_if_unavailable) {
  HIQ_CLIENT_NOTHROW_STATUS(impl_->RegisterPool(spec, pending_if_unavailable));
}
StatusOr<RegisteredPool> Client::PoolInfo(PoolHandle pool) const {
  HIQ_CLIENT_NOTHROW_STATUS(impl_->PoolInfo(pool));
}
Status Client::ReleasePool(PoolHandle pool) { HIQ_CLIENT_NOTHROW_STATUS(impl_->ReleasePool(pool)); }
LookupResult Client::Lookup(PoolHandle pool, std::span<const BlockKey> keys) {
  HIQ_CLIENT_NOTHROW(LookupResult{}, impl_->Lookup(pool, keys));
}
LookupResult Client::LookupGroup(std::span<const NamespaceRef> namespaces,
                                 std::span<const BlockKey> keys) {
  HIQ_CLIENT_NOTHROW(LookupResult{}, impl_->LookupGroup(namespaces, keys));
}
BackupResult Client::Backup(PoolHandle pool, std::span<const BlockKey> keys,
                            std::span<const uint32_t> rows, const BackupOptions& options) {
  HIQ_CLIENT_NOTHROW(
      (BackupResult{std::vector<BlockStatus>(keys.size(), BlockStatus::kNotStored), 0, {}}),
      impl_->Backup(pool, keys, rows, options));
}
RestoreResult Client::Restore(PoolHandle pool, std::span<const BlockKey> keys,
                              std::span<const uint32_t> rows, const RestoreOptions& options) {
  HIQ_CLIENT_NOTHROW(RestoreResult{}, impl_->Restore(pool, keys, rows, options));
}
StatusOr<uint32_t> Client::Evict(PoolHandle pool, std::span<const BlockKey> keys) {
  HIQ_CLIENT_NOTHROW_STATUS(impl_->Evict(pool, keys));
}
StatusOr<DaemonStats> Client::GetStats() { HIQ_CLIENT_NOTHROW_STATUS(impl_->GetStats(0, 0)); }
StatusOr<DaemonStats> Client::GetStats(uint32_t namespaces_offset, uint32_t namespaces_limit) {
  HIQ_CLIENT_NOTHROW_STATUS(impl_->GetStats(namespaces_offset, namespaces_limit));
}

#undef HIQ_CLIENT_NOTHROW
#undef HIQ_CLIENT_NOTHROW_STATUS

}  // namespace hiqcache
