#include "backends/cuda_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>
#include <thread>

#include "backends/device_completion.h"
#include "backends/residency.h"
#include "core/registration.h"
#include "hiqcache/log.h"
#include "hiqcache/xxh3.h"
#include "rope_turn.h"

namespace hiqcache::server {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr size_t kArenaAlign = 256;
// A pool's row indices of one request live in its job arrays: bounded so that a registration
// with huge blocks cannot pin gigabytes of device memory per pool.
constexpr size_t kMaxRowsArrayBytes = 256ull << 20;

size_t AlignUp256(size_t v) { return (v + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }

// `st` with `what` in front of its message, same code.
Status Ctx(const Status& st, const std::string& what) {
  if (st.ok()) return st;
  return Status(st.code(), what + ": " + st.message());
}

// The first error of the two.
Status Merge(const Status& a, const Status& b) { return a.ok() ? b : a; }

}  // namespace

bool NormalizeCudaUuid(const std::string& in, std::string* out) {
  std::string s = in;
  if (s.rfind("GPU-", 0) == 0 || s.rfind("gpu-", 0) == 0) s = s.substr(4);
  std::string hex;
  for (char c : s) {
    if (c == '-') continue;
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
    hex += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (hex.size() != 32) return false;
  *out = hex;
  return true;
}

StagingPlan StagingPlan::For(uint64_t staging_bytes) {
  StagingPlan p;
  // Pairs of at least 16 MiB slabs, up to 8 pairs (8 pools of one device on it at once).
  p.pairs = static_cast<uint32_t>(std::clamp<uint64_t>(staging_bytes / (32 * kMiB), 1, 8));
  p.slab_bytes = staging_bytes / (2ull * p.pairs) / kArenaAlign * kArenaAlign;
  if (p.slab_bytes == 0) p.pairs = 0;
  return p;
}

// ---------------------------------------------------------------------------------------------

struct CudaBackend::Mapping {
  DeviceApi* api = nullptr;
  int device = -1;
  uint8_t* data = nullptr;
  uint64_t size = 0;
  ~Mapping() {
    if (data != nullptr) api->CloseIpcBuffer(device, data);
  }
};

struct CudaBackend::DeviceState {
  // Device and page-locked host memory of one pool's job arrays.
  struct Arena {
    uint8_t* device = nullptr;
    uint8_t* host = nullptr;
    size_t bytes = 0;
  };

  DeviceApi* api = nullptr;
  int device = -1;
  std::string uuid;
  StagingPlan plan;
  uint8_t* staging = nullptr;
  std::function<void(int, const Status&)> on_failed;
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> device_bytes{0};  // staging + arenas

  Mutex mu;
  std::vector<uint32_t> free_pairs GUARDED_BY(mu);
  std::vector<Arena> spare GUARDED_BY(mu);  // arenas of released pools, for reuse
  Status failure GUARDED_BY(mu);
  // The completion threads of the device's bindings, failed with it.
  std::vector<CompletionThread*> waiters GUARDED_BY(mu);

  ~DeviceState() {
    for (const Arena& a : spare) {
      api->FreeDevice(device, a.device);
      api->FreePinned(a.host);
    }
    if (staging != nullptr) api->FreeDevice(device, staging);
  }

  uint8_t* Slab(uint32_t pair, uint32_t s) const {
    return staging + (2ull * pair + s) * plan.slab_bytes;
  }

  // A backup leaves the last free pair to restores (when the device has more than one): a
  // restore is on an engine's critical path, a backup is not.
  std::optional<uint32_t> TryAcquire(bool restore) EXCLUDES(mu) {
    MutexLock lock(&mu);
    if (free_pairs.empty()) return std::nullopt;
    if (!restore && plan.pairs > 1 && free_pairs.size() == 1) return std::nullopt;
    uint32_t p = free_pairs.back();
    free_pairs.pop_back();
    return p;
  }
  void Release(uint32_t pair) EXCLUDES(mu) {
    MutexLock lock(&mu);
    free_pairs.push_back(pair);
  }

  // A binding's completion thread, failed at once if the device already failed.
  void AddWaiter(CompletionThread* w) EXCLUDES(mu) {
    MutexLock lock(&mu);
    waiters.push_back(w);
    if (!failure.ok()) w->FailAll(failure);
  }
  void RemoveWaiter(CompletionThread* w) EXCLUDES(mu) {
    MutexLock lock(&mu);
    std::erase(waiters, w);
  }

  // Marks the device failed (first call: logs, fails its pending completions, tells the daemon)
  // and returns the status its requests fail with.
  Status Fail(const Status& cause) EXCLUDES(mu) {
    Status out;
    bool first = false;
    {
      MutexLock lock(&mu);
      if (failure.ok()) {
        failure = Unavailable("CUDA device " + std::to_string(device) + " (GPU-" + uuid +
                              ") failed: " + cause.message() +
                              "; hiqcached exits so that its service manager restarts it (the "
                              "cached blocks survive in the shared-memory pool)");
        failed.store(true, std::memory_order_release);
        first = true;
        // Under mu: a binding removes its thread under mu before destroying it.
        for (CompletionThread* w : waiters) w->FailAll(failure);
      }
      out = failure;
    }
    if (first) {
      HIQ_LOG(ERROR) << "event=device_failed device=" << device << " error=\"" << cause.message()
                     << "\"";
      if (on_failed) on_failed(device, cause);
    }
    return out;
  }
  Status Failure() EXCLUDES(mu) {
    MutexLock lock(&mu);
    return failure;
  }
  // What a request sees of a device call's error: a sticky one fails the device.
  Status Reported(const Status& st) EXCLUDES(mu) { return IsStickyDeviceError(st) ? Fail(st) : st; }

  StatusOr<Arena> TakeArena(size_t bytes) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      auto best = spare.end();
      for (auto it = spare.begin(); it != spare.end(); ++it) {
        if (it->bytes >= bytes && (best == spare.end() || it->bytes < best->bytes)) best = it;
      }
      if (best != spare.end()) {
        Arena a = *best;
        spare.erase(best);
        return a;
      }
    }
    Arena a;
    a.bytes = bytes;
    HIQ_ASSIGN_OR_RETURN(a.device, api->AllocDevice(device, bytes));
    auto host = api->AllocPinned(bytes);
    if (!host.ok()) {
      api->FreeDevice(device, a.device);
      return host.status();
    }
    a.host = *host;
    device_bytes.fetch_add(bytes);
    return a;
  }
  // Kept for a later bind: freeing device memory would synchronize the device.
  void ReturnArena(const Arena& a) EXCLUDES(mu) {
    MutexLock lock(&mu);
    spare.push_back(a);
  }
};

namespace {

using DeviceState = CudaBackend::DeviceState;
using Mapping = CudaBackend::Mapping;

// How a pool's tasks are cut into staging chunks, and where its job arrays sit in its arena.
struct ChunkPlan {
  size_t layer_bytes = 0;       // one layer of one block
  uint32_t backup_layers = 0;   // layers per backup chunk
  uint32_t layer_chunks = 0;    // backup chunks per block range
  uint32_t backup_blocks = 0;   // blocks per backup chunk
  uint64_t slab_layers = 0;     // block-layers (layer_bytes each) a slab holds
  uint32_t restore_blocks = 0;  // blocks per restore unit of one layer (more than a slab holds)
  // The views, then (CODEC_INT5_ALLOT) the RoPE table: constant for the binding's life, in
  // [views_off, constant_bytes), uploaded with a lane's first task. Then the per-task arrays.
  size_t views_off = 0, rope_off = 0, rope_bytes = 0, constant_bytes = 0;
  size_t rows_off = 0, ptrs_off = 0, flags_off = 0, arena_bytes = 0;

  static StatusOr<ChunkPlan> For(const kernels::BlockLayout& layout, const StagingPlan& staging,
                                 uint32_t max_blocks) {
    ChunkPlan p;
    const uint32_t layers = layout.num_layers;
    p.layer_bytes = layout.LayerBytes();
    if (staging.slab_bytes < p.layer_bytes) {
      return InvalidArgument(
          "block_tokens: one layer of a block is " + std::to_string(p.layer_bytes) +
          " bytes, more than a CUDA staging slab (" + std::to_string(staging.slab_bytes) +
          " bytes): use smaller blocks, or raise hiqcached's cuda_staging_bytes");
    }
    const uint64_t per_slab_layers = staging.slab_bytes / p.layer_bytes;
    p.slab_layers = per_slab_layers;
    p.backup_layers = static_cast<uint32_t>(std::min<uint64_t>(layers, per_slab_layers));
    p.layer_chunks = (layers + p.backup_layers - 1) / p.backup_layers;
    const uint64_t chunk_bytes = uint64_t{p.backup_layers} * p.layer_bytes;
    p.backup_blocks = static_cast<uint32_t>(
        std::clamp<uint64_t>(staging.slab_bytes / chunk_bytes, 1, max_blocks));
    p.restore_blocks = static_cast<uint32_t>(std::clamp<uint64_t>(per_slab_layers, 1, max_blocks));
    const size_t rows_bytes = size_t{max_blocks} * layout.block_tokens * sizeof(uint32_t);
    if (rows_bytes > kMaxRowsArrayBytes) {
      return InvalidArgument("block_tokens: " + std::to_string(layout.block_tokens) + " tokens x " +
                             std::to_string(max_blocks) + " blocks per request need " +
                             std::to_string(rows_bytes >> 20) +
                             " MiB of row indices on the GPU per pool (at most " +
                             std::to_string(kMaxRowsArrayBytes >> 20) +
                             " MiB): use smaller blocks or a lower max_blocks_per_request");
    }
    const uint32_t max_ptrs = std::max(p.backup_blocks, p.restore_blocks);
    p.views_off = 0;
    p.rope_off = AlignUp256(p.views_off + size_t{layers} * sizeof(kernels::LayerViews));
    p.rope_bytes = kernels::RopeTableFloats(layout) * sizeof(float);
    p.constant_bytes = p.rope_off + p.rope_bytes;
    p.rows_off = AlignUp256(p.constant_bytes);
    p.ptrs_off = AlignUp256(p.rows_off + rows_bytes);
    p.flags_off = AlignUp256(p.ptrs_off + 2 * size_t{max_ptrs} * sizeof(uint8_t*));
    p.arena_bytes = AlignUp256(p.flags_off + size_t{max_blocks} * p.layer_chunks);
    return p;
  }
};

enum LaneIndex { kBackupLane = 0, kRestoreLane = 1 };

// Everything a binding holds on the device; released (never waiting) by Release().
struct BindingResources {
  DeviceApi* api = nullptr;
  std::shared_ptr<DeviceState> dev;
  std::vector<std::shared_ptr<Mapping>> buffers;
  // The engine's ticket slots, page-locked (RegisterHost) while the binding is open.
  std::unique_ptr<TicketSlots> slots;
  bool slots_registered = false;
  // What page-locking the slots faulted in on the client's account (their pages that were not
  // resident), given back when they are unlocked.
  std::shared_ptr<FaultBudget> budget;
  uint64_t charged = 0;
  // One lane per direction (kBackupLane, kRestoreLane), so that a pool's restore runs beside its
  // backup instead of behind it.
  struct Lane {
    DeviceStream compute, copy;
    // Daemon-owned: completion of the lane's task (a blocking event, waited for by `completion`);
    // per slab, "filled" (producer done) and "freed" (consumer done); the copy stream's tail,
    // joined into the compute stream.
    DeviceEvent complete, filled[2], freed[2], tail;
    std::unique_ptr<CompletionThread> completion;
    size_t arena_off = 0;  // the lane's job arrays: ChunkPlan::arena_bytes from here
    // Whether the views were copied to the lane's job arrays on the device. Only the lane's
    // Start* calls (one at a time) use it.
    bool views_uploaded = false;
  };
  Lane lanes[2];
  DeviceState::Arena arena;
  bool has_arena = false;

  ~BindingResources() { Release(); }
  void Release() {
    if (api == nullptr) return;
    const int d = dev->device;
    for (Lane& ln : lanes) {
      if (ln.completion != nullptr) {
        // No task is pending (Close's precondition): the thread is idle and joins at once.
        dev->RemoveWaiter(ln.completion.get());
        ln.completion.reset();
      }
      if (ln.compute) api->DestroyStream(d, std::exchange(ln.compute, DeviceStream{}));
      if (ln.copy) api->DestroyStream(d, std::exchange(ln.copy, DeviceStream{}));
      for (DeviceEvent* e :
           {&ln.complete, &ln.filled[0], &ln.filled[1], &ln.freed[0], &ln.freed[1], &ln.tail}) {
        if (*e) api->DestroyEvent(d, std::exchange(*e, DeviceEvent{}));
      }
    }
    if (slots_registered) api->UnregisterHost(slots->data());
    slots_registered = false;
    if (slots) slots->Close();
    if (budget != nullptr) budget->Refund(std::exchange(charged, 0));
    buffers.clear();  // a mapping closes with its last binding
    if (has_arena) dev->ReturnArena(arena);
    has_arena = false;
    api = nullptr;
  }
};

class CudaBinding : public PoolBinding {
 public:
  using Lane = BindingResources::Lane;
  CudaBinding(std::unique_ptr<BindingResources> res, kernels::BlockLayout layout, ChunkPlan plan,
              uint32_t num_rows, std::chrono::milliseconds wait_timeout,
              kernels::ThreadPool* hash_pool)
      : hash_pool_(hash_pool),
        res_(std::move(res)),
        api_(res_->api),
        dev_(res_->dev),
        device_(dev_->device),
        layout_(layout),
        plan_(plan),
        num_rows_(num_rows),
        event_count_(res_->slots->count()),
        ticket_floor_(res_->slots->floor()),
        wait_timeout_(wait_timeout) {}
  ~CudaBinding() override { Close(); }

  // Constant (requests racing a release validate against it while Close runs).
  uint32_t event_count() const override { return event_count_; }
  uint32_t num_rows() const override { return num_rows_; }
  uint64_t TicketFloor() const override { return ticket_floor_; }
  bool SignalsOnDevice() const override { return true; }
  void Cancel() override { cancelled_.store(true, std::memory_order_release); }
  // A failed device refuses requests before they are queued (asynchronous ones included).
  Status Failure() const override {
    return dev_->failed.load(std::memory_order_acquire) ? dev_->Failure() : Status::Ok();
  }
  void Close() override {
    MutexLock lock(&close_mu_);
    res_->Release();
  }

  // Writes the views and the RoPE table (CODEC_INT5_ALLOT's; constant for the binding's life)
  // into the host side of its job arrays. Host memory only: binding enqueues no device work. The
  // device copy goes with the first job arrays a task uploads (UploadJobArrays), so that every
  // device access to the arena belongs to a task, whose completion is observed before the
  // binding can be closed and its arena reused or freed. (A copy enqueued here would be ordered
  // before nothing: a pool released, or a backend torn down, before any task ran would return or
  // free the arena under it.)
  void StageConstants(const std::vector<kernels::LayerViews>& views) {
    const std::vector<float> rope = plan_.rope_bytes > 0
                                        ? kernels::RopeTable(layout_.row, layout_.block_tokens)
                                        : std::vector<float>{};
    for (const Lane& ln : res_->lanes) {
      std::memcpy(Host(ln) + plan_.views_off, views.data(),
                  views.size() * sizeof(kernels::LayerViews));
      if (!rope.empty()) std::memcpy(Host(ln) + plan_.rope_off, rope.data(), plan_.rope_bytes);
    }
  }

  StartResult StartBackup(const std::shared_ptr<BackupTask>& task) override {
    std::optional<Status> wait = Settle(*task);
    if (!wait) return StartResult::kNotReady;
    if (const Status& settled = *wait; !settled.ok()) {
      // Nothing reached the device: the slots are released from here at once.
      FailSlots(*task);
      FinishBackup(*task, settled);
      return StartResult::kCompleted;
    }
    std::optional<uint32_t> pair = dev_->TryAcquire(/*restore=*/false);
    if (!pair) return StartResult::kNotReady;  // every slab pair is on the device: retry
    Lane& ln = res_->lanes[kBackupLane];
    Status st = Ctx(EnqueueBackup(ln, *task, *pair), "backup");
    if (!st.ok()) st = Merge(st, JoinCopyStream(ln));
    if (st.ok()) st = StoreSlot(ln, task->done_event, task->ticket, "done_event");
    return Submit(ln, task, *pair, st,
                  [this](BackupTask& t, const Status& s) { FinishBackup(t, s); });
  }

  StartResult StartRestore(const std::shared_ptr<RestoreTask>& task) override {
    std::optional<Status> wait = Settle(*task);
    if (!wait) return StartResult::kNotReady;
    if (const Status& settled = *wait; !settled.ok()) {
      FailSlots(*task);
      task->on_complete(settled);
      return StartResult::kCompleted;
    }
    std::optional<uint32_t> pair = dev_->TryAcquire(/*restore=*/true);
    if (!pair) return StartResult::kNotReady;
    Lane& ln = res_->lanes[kRestoreLane];
    Status st = Ctx(EnqueueRestore(ln, *task, *pair), "restore");
    if (!st.ok()) st = Merge(st, JoinCopyStream(ln));
    if (st.ok()) st = StoreSlot(ln, task->done_event, task->ticket, "done_event");
    return Submit(ln, task, *pair, st, [](RestoreTask& t, const Status& s) { t.on_complete(s); });
  }

 private:
  Status Refusal() const {
    if (cancelled_.load(std::memory_order_acquire)) {
      return Status(StatusCode::kCancelled, "pool released: its queued work was cancelled");
    }
    if (dev_->failed.load(std::memory_order_acquire)) return dev_->Failure();
    return Status::Ok();
  }

  // Where a task stands before anything of it is enqueued, without blocking: refused (pool
  // released, device failed), DEADLINE_EXCEEDED once its caller gave up, else the state of its
  // wait on the host (TicketSlots::CheckWait: nullopt while waiting; stamps its first try).
  template <typename Task>
  std::optional<Status> Settle(Task& task) {
    HIQ_RETURN_IF_ERROR(Refusal());
    HIQ_RETURN_IF_ERROR(CheckCallerDeadline(task.caller_deadline, task.ticket));
    if (task.first_try == std::chrono::steady_clock::time_point{}) {
      task.first_try = std::chrono::steady_clock::now();
    }
    return res_->slots->CheckWait(task.wait_event, task.wait_value, task.first_try, wait_timeout_,
                                  cancelled_.load(std::memory_order_acquire));
  }

  // `ticket | failed` into every slot the task names, from the host. Only before any of its work
  // was enqueued, or once that work stopped (completed, or the device was lost).
  void FailSlots(const BackupTask& t) const { res_->slots->Store(t.done_event, t.ticket, true); }
  void FailSlots(const RestoreTask& t) const {
    if (t.layer_event_base >= 0) {
      for (uint32_t l = 0; l < layout_.num_layers; ++l) {
        res_->slots->Store(t.layer_event_base + static_cast<int32_t>(l), t.ticket, true);
      }
    }
    res_->slots->Store(t.done_event, t.ticket, true);
  }

  // Enqueues the store of `ticket` into slot `event` on the lane's compute stream, behind
  // everything enqueued there so far. event < 0: nothing.
  Status StoreSlot(Lane& ln, int32_t event, uint64_t ticket, const char* field) {
    if (event < 0 || static_cast<uint32_t>(event) >= event_count_) return Status::Ok();
    return Ctx(api_->WriteValue64(device_, ln.compute,
                                  res_->slots->slot(static_cast<uint32_t>(event)), ticket),
               std::string("storing the ticket into ") + field + " slot " + std::to_string(event));
  }

  // Records the completion event after everything the task enqueued, answers an asynchronous
  // request, and hands the rest to the lane's completion thread.
  template <typename Task, typename Finish>
  StartResult Submit(Lane& ln, const std::shared_ptr<Task>& task, uint32_t pair, Status st,
                     Finish finish) {
    Status rec = api_->RecordEvent(device_, ln.complete, ln.compute);
    if (!rec.ok()) {
      // Nothing would tell when the device is done with the slabs, the pool's payloads and the
      // engine's buffers: the device's state is unknown, so it is failed.
      Status failed = dev_->Fail(Ctx(rec, "recording the completion event"));
      dev_->Release(pair);
      FailSlots(*task);
      finish(*task, failed);
      return StartResult::kCompleted;
    }
    st = dev_->Reported(st);
    if (!st.ok()) {
      HIQ_LOG(WARN) << "event=enqueue_failed device=" << device_ << " ticket=" << task->ticket
                    << " code=" << StatusCodeName(st.code()) << " error=\"" << st.message()
                    << "\" (its slots get the failed bit once the work enqueued before the error "
                       "stopped)";
    }
    // The callback hands its reference to the task (and through it to the pool and this
    // binding) over to the worker: the last one is never dropped on the completion thread.
    // `task = task`, not `task`: a by-copy capture of the const reference would be a const
    // member, and std::move of it below a copy, leaving a reference here that the completion
    // thread drops after the worker ran the continuation (the last one, once the core let go).
    ln.completion->Watch(
        ln.complete, [this, task = task, pair, st, finish](const Status& q) mutable {
          dev_->Release(pair);
          Status out = st.ok() ? dev_->Reported(Ctx(q, "device work")) : st;
          // The device work stopped: whatever of it did not land is released as failed (a slot
          // that already holds the ticket keeps it: that layer was written).
          if (!out.ok()) FailSlots(*task);
          // A copy: the task, and `defer` in it, may be gone as soon as the work has run.
          auto defer = task->defer;
          defer([this, task = std::move(task), out, finish] { finish(*task, out); });
        });
    return StartResult::kPending;
  }

  void FinishBackup(BackupTask& task, const Status& st) {
    const size_t n = task.payloads.size();
    std::vector<uint8_t> nonfinite(n, 0);
    if (st.ok() && n > 0) {
      const uint8_t* flags = Host(res_->lanes[kBackupLane]) + plan_.flags_off;
      for (uint32_t c = 0; c < plan_.layer_chunks; ++c) {
        for (size_t b = 0; b < n; ++b) nonfinite[b] |= flags[c * n + b];
      }
      // The pool headers' checksums, in parallel (the core hashes on one thread otherwise).
      task.checksums.assign(n, 0);
      const size_t bytes = layout_.BlockBytes();
      hash_pool_->ParallelFor(n, [&](size_t b) {
        if (!nonfinite[b]) task.checksums[b] = XXH3_64bits(task.payloads[b], bytes);
      });
    }
    task.on_written(nonfinite, st);
    task.on_complete(st);
  }

  // Makes the compute stream wait for everything enqueued on the copy stream so far.
  Status JoinCopyStream(Lane& ln) {
    HIQ_RETURN_IF_ERROR(api_->RecordEvent(device_, ln.tail, ln.copy));
    return api_->StreamWaitEvent(device_, ln.compute, ln.tail);
  }

  uint8_t* Host(const Lane& ln) const { return res_->arena.host + ln.arena_off; }
  uint8_t* Dev(const Lane& ln) const { return res_->arena.device + ln.arena_off; }
  const uint32_t* DeviceRows(const Lane& ln, uint32_t first_block) const {
    return reinterpret_cast<const uint32_t*>(Dev(ln) + plan_.rows_off) +
           size_t{first_block} * layout_.block_tokens;
  }
  const kernels::LayerViews* DeviceViews(const Lane& ln, uint32_t layer) const {
    return reinterpret_cast<const kernels::LayerViews*>(Dev(ln) + plan_.views_off) + layer;
  }
  const float* DeviceRope(const Lane& ln) const {
    return plan_.rope_bytes > 0 ? reinterpret_cast<const float*>(Dev(ln) + plan_.rope_off)
                                : nullptr;
  }
  // Uploads the task's rows and, per slab of `pair`, the staging address of each of `per_slab`
  // blocks `stride` bytes apart; returns the device array of slab 0 (slab 1's follows it).
  StatusOr<uint8_t**> UploadJobArrays(Lane& ln, const std::vector<uint32_t>& rows, uint32_t pair,
                                      uint32_t per_slab, size_t stride) {
    uint8_t* host = Host(ln);
    uint8_t* dev = Dev(ln);
    const size_t rows_bytes = rows.size() * sizeof(uint32_t);
    std::memcpy(host + plan_.rows_off, rows.data(), rows_bytes);
    auto** ptrs = reinterpret_cast<uint8_t**>(host + plan_.ptrs_off);
    for (uint32_t s = 0; s < 2; ++s) {
      for (uint32_t i = 0; i < per_slab; ++i)
        ptrs[s * per_slab + i] = dev_->Slab(pair, s) + i * stride;
    }
    const DeviceApi::Copy up[3] = {
        {dev + plan_.rows_off, host + plan_.rows_off, rows_bytes},
        {dev + plan_.ptrs_off, host + plan_.ptrs_off, 2 * size_t{per_slab} * sizeof(uint8_t*)},
        {dev + plan_.views_off, host + plan_.views_off, plan_.constant_bytes}};
    // The views and the RoPE table once, with the first task's arrays (StageConstants): later
    // tasks run behind that copy on the same stream.
    const size_t n = ln.views_uploaded ? 2 : 3;
    HIQ_RETURN_IF_ERROR(Ctx(api_->CopyAsync(device_, {up, n}, ln.compute), "uploading job arrays"));
    ln.views_uploaded = true;
    return reinterpret_cast<uint8_t**>(dev + plan_.ptrs_off);
  }

  Status EnqueueBackup(Lane& ln, BackupTask& t, uint32_t pair) {
    const uint32_t n = static_cast<uint32_t>(t.payloads.size());
    if (n == 0) return Status::Ok();
    const uint32_t cb = plan_.backup_blocks;
    const uint32_t lc = plan_.backup_layers;
    const size_t stride = size_t{lc} * plan_.layer_bytes;  // one block's chunk in a slab
    HIQ_ASSIGN_OR_RETURN(uint8_t * *dev_ptrs, UploadJobArrays(ln, t.rows, pair, cb, stride));
    uint8_t* dev_flags = Dev(ln) + plan_.flags_off;
    std::vector<DeviceApi::Copy> copies;
    uint32_t k = 0;  // chunk number: slab k % 2
    for (uint32_t b0 = 0; b0 < n; b0 += cb) {
      const uint32_t bc = std::min(cb, n - b0);
      for (uint32_t c = 0; c < plan_.layer_chunks; ++c, ++k) {
        const uint32_t l0 = c * lc;
        const uint32_t lcount = std::min(lc, layout_.num_layers - l0);
        const uint32_t s = k % 2;
        if (k >= 2) {
          // The D2H copies of chunk k - 2 read this slab: encode into it only after them.
          HIQ_RETURN_IF_ERROR(
              Ctx(api_->StreamWaitEvent(device_, ln.compute, ln.freed[s]), "staging ring"));
        }
        kernels::EncodeJob job;
        job.layout = layout_;
        job.layout.num_layers = lcount;
        job.layers = DeviceViews(ln, l0);
        job.rows = DeviceRows(ln, b0);
        job.blocks = dev_ptrs + s * cb;
        job.num_blocks = bc;
        job.nonfinite = dev_flags + size_t{c} * n + b0;
        job.rope = DeviceRope(ln);
        HIQ_RETURN_IF_ERROR(Ctx(api_->LaunchEncode(device_, job, ln.compute), "encode"));
        HIQ_RETURN_IF_ERROR(api_->RecordEvent(device_, ln.filled[s], ln.compute));
        HIQ_RETURN_IF_ERROR(api_->StreamWaitEvent(device_, ln.copy, ln.filled[s]));
        copies.clear();
        for (uint32_t j = 0; j < bc; ++j) {
          copies.push_back({t.payloads[b0 + j] + size_t{l0} * plan_.layer_bytes,
                            dev_->Slab(pair, s) + j * stride, size_t{lcount} * plan_.layer_bytes});
        }
        HIQ_RETURN_IF_ERROR(
            Ctx(api_->CopyAsync(device_, copies, ln.copy), "copying into the pool"));
        HIQ_RETURN_IF_ERROR(api_->RecordEvent(device_, ln.freed[s], ln.copy));
      }
    }
    HIQ_RETURN_IF_ERROR(JoinCopyStream(ln));
    const DeviceApi::Copy flags{Host(ln) + plan_.flags_off, dev_flags,
                                size_t{n} * plan_.layer_chunks};
    return Ctx(api_->CopyAsync(device_, {&flags, 1}, ln.compute), "copying non-finite flags");
  }

  // A restore goes through the slab pair in units of (group of consecutive layers, chunk of
  // blocks). When every block of the request fits a slab with at least one layer, a unit holds
  // all of them with as many layers as fit (block-major in the slab: block j's layers at
  // j * group * layer_bytes), so each block's layers of a unit arrive with one H2D copy of its
  // contiguous pool payload: n x ceil(layers / group) copies instead of n x layers. Otherwise a
  // unit is one layer of restore_blocks blocks. Layer slots are stored as each layer's last decode
  // is enqueued, so the engine's layer l still starts once layer l is written.
  Status EnqueueRestore(Lane& ln, RestoreTask& t, uint32_t pair) {
    const uint32_t n = static_cast<uint32_t>(t.payloads.size());
    const uint32_t layers = layout_.num_layers;
    if (n == 0) {
      // Nothing to write: the layer slots still get the ticket.
      for (uint32_t l = 0; t.layer_event_base >= 0 && l < layers; ++l) {
        HIQ_RETURN_IF_ERROR(StoreSlot(ln, t.layer_event_base + static_cast<int32_t>(l), t.ticket,
                                      "layer_event_base"));
      }
      return Status::Ok();
    }
    uint32_t cr = plan_.restore_blocks;  // blocks per unit
    uint32_t group = 1;                  // layers per unit
    if (n <= plan_.slab_layers) {
      cr = n;
      group = static_cast<uint32_t>(std::min<uint64_t>(layers, plan_.slab_layers / n));
    }
    const size_t stride = size_t{group} * plan_.layer_bytes;  // one block's layers in a slab
    HIQ_ASSIGN_OR_RETURN(uint8_t * *dev_ptrs, UploadJobArrays(ln, t.rows, pair, cr, stride));
    std::vector<DeviceApi::Copy> copies;
    uint32_t k = 0;  // unit number: slab k % 2
    for (uint32_t l0 = 0; l0 < layers; l0 += group) {
      const uint32_t gc = std::min(group, layers - l0);
      for (uint32_t b0 = 0; b0 < n; b0 += cr, ++k) {
        const uint32_t bc = std::min(cr, n - b0);
        const uint32_t s = k % 2;
        if (k >= 2) {
          // The decodes of unit k - 2 read this slab: copy into it only after them.
          HIQ_RETURN_IF_ERROR(
              Ctx(api_->StreamWaitEvent(device_, ln.copy, ln.freed[s]), "staging ring"));
        }
        copies.clear();
        for (uint32_t j = 0; j < bc; ++j) {
          copies.push_back({dev_->Slab(pair, s) + j * stride,
                            t.payloads[b0 + j] + size_t{l0} * plan_.layer_bytes,
                            size_t{gc} * plan_.layer_bytes});
        }
        HIQ_RETURN_IF_ERROR(Ctx(api_->CopyAsync(device_, copies, ln.copy), "copying into staging"));
        HIQ_RETURN_IF_ERROR(api_->RecordEvent(device_, ln.filled[s], ln.copy));
        HIQ_RETURN_IF_ERROR(api_->StreamWaitEvent(device_, ln.compute, ln.filled[s]));
        kernels::DecodeJob job;
        job.layout = layout_;
        job.layout.num_layers = gc;
        job.layers = DeviceViews(ln, l0);
        job.rows = DeviceRows(ln, b0);
        job.blocks = dev_ptrs + s * cr;
        job.num_blocks = bc;
        job.rope = DeviceRope(ln);
        const bool last_chunk = b0 + bc == n;
        for (uint32_t i = 0; i < gc; ++i) {
          HIQ_RETURN_IF_ERROR(Ctx(api_->LaunchDecode(device_, job, i, 1, ln.compute), "decode"));
          // Copy, decode and scatter of layer l0 + i (every chunk) are enqueued before its slot
          // store.
          if (last_chunk && t.layer_event_base >= 0) {
            HIQ_RETURN_IF_ERROR(StoreSlot(ln, t.layer_event_base + static_cast<int32_t>(l0 + i),
                                          t.ticket, "layer_event_base"));
          }
        }
        HIQ_RETURN_IF_ERROR(api_->RecordEvent(device_, ln.freed[s], ln.compute));
      }
    }
    return Status::Ok();
  }

  kernels::ThreadPool* const hash_pool_;
  std::unique_ptr<BindingResources> res_;
  DeviceApi* const api_;
  const std::shared_ptr<DeviceState> dev_;
  const int device_;
  const kernels::BlockLayout layout_;
  const ChunkPlan plan_;
  const uint32_t num_rows_;
  const uint32_t event_count_;
  const uint64_t ticket_floor_;
  const std::chrono::milliseconds wait_timeout_;
  std::atomic<bool> cancelled_{false};
  Mutex close_mu_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------

CudaBackend::CudaBackend(DeviceApi* api, CudaBackendOptions options,
                         std::vector<std::pair<uint8_t*, uint64_t>> registered)
    : api_(api),
      options_(std::move(options)),
      hash_pool_(std::make_unique<kernels::ThreadPool>(std::clamp(
          options_.hash_threads, 1u, std::max(1u, std::thread::hardware_concurrency())))),
      registered_(std::move(registered)) {}

StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(DeviceApi* api, uint8_t* pool,
                                                           uint64_t pool_bytes,
                                                           CudaBackendOptions options) {
  if (options.register_chunk_bytes == 0) options.register_chunk_bytes = 64ull << 30;
  std::vector<std::pair<uint8_t*, uint64_t>> done;
  for (uint64_t off = 0; off < pool_bytes; off += options.register_chunk_bytes) {
    const uint64_t len = std::min(options.register_chunk_bytes, pool_bytes - off);
    Status st = api->RegisterHost(pool + off, len);
    if (!st.ok()) {
      for (auto& [p, l] : done) api->UnregisterHost(p);
      return FailedPrecondition("page-locking the pool for DMA (is LimitMEMLOCK unlimited?): " +
                                st.message());
    }
    done.emplace_back(pool + off, len);
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(api, std::move(options), std::move(done)));
}

CudaBackend::~CudaBackend() {
  {
    MutexLock lock(&mu_);
    devices_.clear();  // frees staging and spare arenas
  }
  for (auto& [p, l] : registered_) api_->UnregisterHost(p);
}

uint64_t CudaBackend::StagingDeviceBytes() const {
  MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [d, state] : devices_) total += state->device_bytes.load();
  return total;
}

Status CudaBackend::DeviceFailure() const {
  MutexLock lock(&mu_);
  for (const auto& [d, state] : devices_) {
    Status st = state->Failure();
    if (!st.ok()) return st;
  }
  return Status::Ok();
}

StatusOr<int> CudaBackend::DeviceForUuid(const std::string& uuid) {
  std::string want;
  if (!NormalizeCudaUuid(uuid, &want)) {
    return InvalidArgument(
        "device.cuda_device_uuid: expected a GPU UUID like GPU-xxxxxxxx-..., "
        "got '" +
        uuid.substr(0, 64) + "'");
  }
  MutexLock lock(&mu_);
  if (uuids_.empty()) {
    auto listed = api_->DeviceUuids();
    if (!listed.ok() || listed->empty()) {
      return FailedPrecondition("device.kind: no CUDA device is visible to hiqcached" +
                                (listed.ok() ? std::string() : ": " + listed.status().message()));
    }
    uuids_ = std::move(listed).value();
  }
  for (size_t d = 0; d < uuids_.size(); ++d) {
    if (uuids_[d] == want) return static_cast<int>(d);
  }
  return FailedPrecondition("device.cuda_device_uuid: no GPU visible to hiqcached has UUID " +
                            uuid.substr(0, 64));
}

StatusOr<std::shared_ptr<CudaBackend::DeviceState>> CudaBackend::Device(int device) {
  MutexLock lock(&mu_);
  auto it = devices_.find(device);
  if (it != devices_.end()) return it->second;
  auto state = std::make_shared<DeviceState>();
  state->api = api_;
  state->device = device;
  state->uuid = uuids_[device];
  state->plan = StagingPlan::For(options_.staging_bytes);
  state->on_failed = options_.on_device_failed;
  if (state->plan.pairs == 0) {
    return FailedPrecondition("cuda_staging_bytes: " + std::to_string(options_.staging_bytes) +
                              " bytes is too small for two staging slabs");
  }
  const uint64_t bytes = 2ull * state->plan.pairs * state->plan.slab_bytes;
  auto staging = api_->AllocDevice(device, bytes);
  if (!staging.ok()) {
    return ResourceExhausted("allocating " + std::to_string(bytes >> 20) +
                             " MiB of CUDA staging (cuda_staging_bytes) on device " +
                             std::to_string(device) + ": " + staging.status().message());
  }
  state->staging = *staging;
  state->device_bytes.store(bytes);
  {
    MutexLock state_lock(&state->mu);  // not yet shared: taken for the analysis
    for (uint32_t p = state->plan.pairs; p-- > 0;) state->free_pairs.push_back(p);
  }
  HIQ_LOG(INFO) << "event=cuda_device_bound device=" << device << " staging_bytes=" << bytes
                << " slab_pairs=" << state->plan.pairs << " slab_bytes=" << state->plan.slab_bytes;
  devices_[device] = state;
  return state;
}

StatusOr<std::shared_ptr<CudaBackend::Mapping>> CudaBackend::OpenMapping(int device,
                                                                         const std::string& handle,
                                                                         uint64_t size_bytes,
                                                                         const std::string& field) {
  MutexLock lock(&mu_);
  auto key = std::make_pair(device, handle);
  auto it = mappings_.find(key);
  if (it != mappings_.end()) {
    if (auto existing = it->second.lock()) {
      if (existing->size < size_bytes) {
        return InvalidArgument(field + ": size_bytes exceeds the allocation opened earlier");
      }
      return existing;
    }
    mappings_.erase(it);
  }
  auto opened = api_->OpenIpcBuffer(device, handle, size_bytes);
  if (!opened.ok()) {
    return FailedPrecondition(
        field + ": cannot open the CUDA IPC handle: " + opened.status().message() +
        " (the handle must be of a cudaMalloc allocation's base; memory from cuMemCreate/VMM, "
        "cudaMallocAsync pools or PyTorch's expandable segments cannot be shared: with PyTorch "
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)");
  }
  auto m = std::make_shared<Mapping>();
  m->api = api_;
  m->device = device;
  m->data = opened->data;
  m->size = size_bytes;
  if (opened->memory_device != device) {
    // Opened as a peer mapping of another GPU's memory (e.g. over NVLink): the engine named
    // the wrong GPU. `m` closes the mapping.
    const std::string other =
        opened->memory_device >= 0 && static_cast<size_t>(opened->memory_device) < uuids_.size()
            ? "GPU-" + uuids_[opened->memory_device]
            : "device " + std::to_string(opened->memory_device);
    return InvalidArgument("device.cuda_device_uuid: names GPU-" + uuids_[device] + ", but " +
                           field + " is memory of " + other +
                           ": set cuda_device_uuid to the GPU that holds the KV buffers");
  }
  mappings_[key] = m;
  return m;
}

StatusOr<std::unique_ptr<PoolBinding>> CudaBackend::Bind(
    const RegisterSpec& spec, const kernels::BlockLayout& layout,
    std::shared_ptr<FaultBudget> fault_budget) {
  HIQ_ASSIGN_OR_RETURN(int device, DeviceForUuid(spec.cuda_device_uuid));
  HIQ_ASSIGN_OR_RETURN(std::shared_ptr<DeviceState> dev, Device(device));
  if (dev->failed.load()) return dev->Failure();
  HIQ_ASSIGN_OR_RETURN(ChunkPlan plan,
                       ChunkPlan::For(layout, dev->plan, options_.max_blocks_per_request));
  auto res = std::make_unique<BindingResources>();
  res->api = api_;
  res->dev = dev;
  std::vector<uint8_t*> bases;
  for (size_t i = 0; i < spec.buffers.size(); ++i) {
    const std::string field = "buffers[" + std::to_string(i) + "].cuda_ipc_handle";
    HIQ_ASSIGN_OR_RETURN(auto m, OpenMapping(device, spec.buffers[i].cuda_ipc_handle,
                                             spec.buffers[i].size_bytes, field));
    bases.push_back(m->data);
    res->buffers.push_back(std::move(m));
  }
  const ClientObjectRules rules = options_.client_objects != nullptr
                                      ? options_.client_objects->RulesFor(&spec.caller)
                                      : ClientObjectRules{&spec.caller};
  HIQ_ASSIGN_OR_RETURN(res->slots, TicketSlots::Open(spec.events, rules));
  if (res->slots->count() > 0) {
    // Page-locked and mapped for the device, whose streams store the tickets.
    // Whole pages: the registration pins the pages the slots lie in.
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t pinned = (res->slots->bytes() + page - 1) / page * page;
    if (fault_budget != nullptr && !res->slots->hugetlb()) {
      // Pinning faults in every page of the slots: the ones the client never touched are
      // allocated on the daemon's account, so they are charged to the client's budget (not
      // those of a hugetlbfs object, which TicketSlots::Open maps only when all are allocated).
      ResidencyProbe probe;
      const uint64_t missing = probe.RangeNotResident(res->slots->data(), pinned);
      if (missing > 0 && !fault_budget->TryCharge(missing)) {
        return ResourceExhausted(
            "events: " + std::to_string(missing) +
            " bytes of the ticket slots are not in memory, and page-locking them would fault "
            "them in on the daemon's account beyond this client's max_faulted_bytes_per_client (" +
            std::to_string(fault_budget->charged()) + " of " +
            std::to_string(fault_budget->limit()) + " bytes charged): write the slots first");
      }
      res->budget = fault_budget;
      res->charged = missing;
    }
    Status reg = api_->RegisterHost(res->slots->data(), pinned);
    if (!reg.ok()) {
      return FailedPrecondition("events: cannot page-lock the ticket slots for the device: " +
                                reg.message());
    }
    res->slots_registered = true;
  }
  DeviceState* raw = dev.get();
  for (int i : {kBackupLane, kRestoreLane}) {
    BindingResources::Lane& ln = res->lanes[i];
    // Restores at the device's greatest priority, backups at its least.
    const auto prio = i == kRestoreLane ? DeviceApi::Priority::kHigh : DeviceApi::Priority::kLow;
    HIQ_ASSIGN_OR_RETURN(ln.compute, api_->CreateStream(device, prio));
    HIQ_ASSIGN_OR_RETURN(ln.copy, api_->CreateStream(device, prio));
    // The completion event is waited for by the lane's completion thread; the others only
    // order streams.
    HIQ_ASSIGN_OR_RETURN(ln.complete, api_->CreateBlockingEvent(device));
    for (DeviceEvent* e : {&ln.filled[0], &ln.filled[1], &ln.freed[0], &ln.freed[1], &ln.tail}) {
      HIQ_ASSIGN_OR_RETURN(*e, api_->CreateEvent(device));
    }
    ln.completion = std::make_unique<CompletionThread>(
        api_, device, [raw](const Status& st) { return raw->Fail(st); });
    dev->AddWaiter(ln.completion.get());
    ln.arena_off = i * plan.arena_bytes;
  }
  auto arena = dev->TakeArena(2 * plan.arena_bytes);
  if (!arena.ok()) {
    return ResourceExhausted("allocating " + std::to_string(2 * plan.arena_bytes) +
                             " bytes of job arrays on device " + std::to_string(device) + ": " +
                             arena.status().message());
  }
  res->arena = *arena;
  res->has_arena = true;
  std::vector<kernels::LayerViews> views = ResolveViews(spec, layout, bases);
  auto binding = std::make_unique<CudaBinding>(std::move(res), layout, plan, MinRows(spec),
                                               options_.wait_timeout, hash_pool_.get());
  binding->StageConstants(views);
  return std::unique_ptr<PoolBinding>(std::move(binding));
}

}  // namespace hiqcache::server
