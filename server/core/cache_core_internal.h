// Private to hiq_core's cache_core*.cc files: CacheCore's pool and request records, and the
// helpers that the registry (cache_core.cc) and the backup and restore request machines
// (cache_core_backup.cc, cache_core_restore.cc) share. Thread-safety: as each record says.
#pragma once

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "core/cache_core.h"
#include "hiqcache/log.h"
#include "hiqcache/mutex.h"

namespace hiqcache::server {

inline uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  uint64_t out;
  return __builtin_mul_overflow(a, b, &out) ? UINT64_MAX : out;
}

inline uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  return __builtin_add_overflow(a, b, &out) ? UINT64_MAX : out;
}

// Engine-side (BF16/FP16) bytes of one block: what a backup reads and a restore writes.
inline uint64_t InputBlockBytes(const kernels::BlockLayout& l) {
  return uint64_t{l.num_layers} * l.kv_planes * l.block_tokens * l.row.InputRowBytes();
}

// Hash of a BlockKey (its bytes are uniformly random already).
struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const {
    uint64_t a, b;
    std::memcpy(&a, k.data(), 8);
    std::memcpy(&b, k.data() + 8, 8);
    return static_cast<size_t>(a ^ (b * 0x9E3779B97F4A7C15ull));
  }
};

struct CacheCore::Pool {
  CacheCore* core = nullptr;  // set once the pool holds quota: RetirePool gives it back
  uint64_t id = 0;
  std::shared_ptr<const NamespaceInfo> ns;  // a use of the namespace (NamespaceTable::Acquire)
  kernels::BlockLayout layout;
  bool cuda = false;
  Caller owner;             // who registered it
  uint64_t client = 0;      // quota key (ClientOf(owner))
  uint32_t client_pid = 0;  // the kernel's pid when authenticated, else the reported one
  std::string peer;
  uint32_t buffers = 0;       // charged against max_buffers_per_client
  uint64_t mapped_bytes = 0;  // charged against max_mapped_bytes_per_client
  std::atomic<bool> retired{false};
  std::unique_ptr<PoolBinding> binding;
  // Backups run on `strand`. Restores of a pool whose device signals (CUDA) run on
  // `restore_strand`, so that a restore never waits behind the pool's backups on the device;
  // HOST pools have one strand for both.
  std::shared_ptr<TransferEngine::Strand> strand;
  std::shared_ptr<TransferEngine::Strand> restore_strand;
  // Requests of a pool with two strands, posted and not finished, in ticket order. A request
  // starts only once no earlier request of the other direction that it conflicts with (a row
  // one writes and the other touches, or a slot both signal) is left: tickets that share a slot
  // or rows still complete in ticket order.
  struct InFlight {
    uint64_t ticket = 0;
    bool restore = false;
    std::vector<uint32_t> rows;  // sorted
    std::vector<int32_t> slots;  // done_event and layer slots the daemon stores into, sorted
  };
  Mutex flight_mu;
  std::deque<InFlight> in_flight GUARDED_BY(flight_mu);
  // Held while a request takes its ticket and posts its sub-tasks: tickets reach the strand in
  // order, and one request's sub-tasks stay contiguous.
  Mutex post_mu;
  std::atomic<uint64_t> next_ticket{0};
  std::atomic<uint64_t> backups{0};
  std::atomic<uint64_t> restores{0};

  // Tasks of this pool posted and not yet completed, so that a release can wait for them.
  Mutex mu;
  CondVar idle_cv;
  uint32_t outstanding GUARDED_BY(mu) = 0;
  bool released GUARDED_BY(mu) = false;         // no task may begin any more
  bool close_when_idle GUARDED_BY(mu) = false;  // a release gave up waiting; the last task closes

  ~Pool() {
    binding.reset();  // the mappings close before the quota they were charged to is given back
    if (core != nullptr) core->RetirePool(*this);
  }

  // What request `spec` touches, for a pool with two strands (nothing for the others). Made
  // before post_mu is taken: sorting a request's rows is not done under it.
  InFlight Touches(bool restore, const TransferSpec& spec) const {
    InFlight f;
    if (restore_strand == strand) return f;
    f.restore = restore;
    for (const BlockSpec& b : spec.blocks)
      f.rows.insert(f.rows.end(), b.rows.begin(), b.rows.end());
    std::sort(f.rows.begin(), f.rows.end());
    if (spec.done_event >= 0) f.slots.push_back(spec.done_event);
    if (restore && spec.layer_event_base >= 0) {
      for (uint32_t l = 0; l < layout.num_layers; ++l) {
        f.slots.push_back(spec.layer_event_base + static_cast<int32_t>(l));
      }
    }
    std::sort(f.slots.begin(), f.slots.end());
    return f;
  }
  // Notes request `ticket` of a two-strand pool; called with post_mu held, so tickets enter in
  // order.
  void AddInFlight(uint64_t ticket, InFlight f) REQUIRES(post_mu) {
    if (restore_strand == strand) return;
    f.ticket = ticket;
    MutexLock lock(&flight_mu);
    in_flight.push_back(std::move(f));
  }
  void RemoveInFlight(uint64_t ticket) {
    MutexLock lock(&flight_mu);
    std::erase_if(in_flight, [&](const InFlight& f) { return f.ticket == ticket; });
  }
  // Whether request `ticket` must still wait for an earlier request of the other direction.
  bool WaitsForOtherDirection(uint64_t ticket) {
    MutexLock lock(&flight_mu);
    auto me = std::find_if(in_flight.begin(), in_flight.end(),
                           [&](const InFlight& f) { return f.ticket == ticket; });
    if (me == in_flight.end()) return false;
    for (auto it = in_flight.begin(); it != me; ++it) {
      if (it->restore == me->restore) continue;
      if (Intersect(it->rows, me->rows) || Intersect(it->slots, me->slots)) return true;
    }
    return false;
  }
  template <typename T>
  static bool Intersect(const std::vector<T>& a, const std::vector<T>& b) {
    for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
      if (a[i] == b[j]) return true;
      if (a[i] < b[j])
        ++i;
      else
        ++j;
    }
    return false;
  }

  // Counts a new request, unless the pool was released (then the caller answers NOT_FOUND).
  bool BeginTask() {
    MutexLock lock(&mu);
    if (released) return false;
    ++outstanding;
    return true;
  }
  // The end of a request begun with BeginTask. Closes the binding when a release timed out
  // waiting for this.
  void EndTask() {
    bool close = false;
    {
      MutexLock lock(&mu);
      close = --outstanding == 0 && close_when_idle;
      if (close) close_when_idle = false;
    }
    idle_cv.NotifyAll();
    if (close) {
      binding->Close();
      HIQ_LOG(INFO) << "event=release_pool_closed pool=" << id
                    << " (its last device work completed)";
      if (core != nullptr) core->RetirePool(*this);
    }
  }
};

// One Backup request, shared by its sub-tasks (which run one at a time, in order, on the pool's
// strand: no lock is needed between them).
struct CacheCore::BackupRequest {
  std::shared_ptr<Pool> pool;
  TransferSpec spec;
  std::vector<BlockKey> keys;  // of every block of the request
  std::vector<size_t> unique;  // request indexes of the first occurrence of each key
  // Sub-tasks: ranges of `unique`. With `gated`, the first one is the wait for wait_event alone.
  std::vector<std::pair<size_t, size_t>> chunks;
  bool gated = false;
  bool device = false;  // CUDA: one task; the device waits and signals
  bool sync = false;
  BackupResult result;
  std::shared_ptr<BackupDone> reply;
  bool replied = false;
  bool finished = false;
  uint64_t pending_bytes = 0;  // charged to the pool's client until the request finishes
  Status error;                // the first failure of a sub-task
  std::chrono::steady_clock::time_point started{};
  bool has_started = false;
  uint64_t moved = 0;  // blocks written into the pool
};

// Splits [0, n) into ranges of at most `per` (at least one range, possibly empty).
inline std::vector<std::pair<size_t, size_t>> Ranges(size_t n, size_t per) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t b = 0; b < n; b += per) out.emplace_back(b, std::min(n, b + per));
  if (out.empty()) out.emplace_back(0, 0);
  return out;
}

// One sub-task of a Restore: blocks [begin, end) of its pinned run, layers [first_layer,
// end_layer) of them.
struct RestorePiece {
  size_t begin = 0;
  size_t end = 0;
  uint32_t first_layer = 0;
  uint32_t end_layer = 0;
};

// The sub-tasks of a restore of `blocks` blocks of `layers` layers for an engine that waits
// layer by layer: layer l of every block comes before layer l + 1 of any, a sub-task taking whole
// layers of every block where they fit and ranges of the blocks of one layer where they do not,
// so that a layer's event can go out once its last block is written, not after the whole
// request. Each is at most `chunk_bytes` of engine-side bytes (`layer_block_bytes` per block and
// layer) and `chunk_blocks` blocks' worth of them, or one block's layer. At least one piece
// (blocks 0: one empty piece of every layer). Restores without layer events go block-major
// (Ranges of ChunkBlocks).
inline std::vector<RestorePiece> LayerMajorPieces(size_t blocks, uint32_t layers,
                                                  uint64_t layer_block_bytes, uint64_t chunk_bytes,
                                                  size_t chunk_blocks) {
  if (blocks == 0 || layers == 0) return {{0, blocks, 0, layers}};
  // Block-layers per piece: the bytes bound, and the blocks bound counted in block-layers.
  const uint64_t most = std::max<uint64_t>(
      1, std::min<uint64_t>(chunk_bytes / std::max<uint64_t>(1, layer_block_bytes),
                            SaturatingMul(std::max<size_t>(1, chunk_blocks), layers)));
  std::vector<RestorePiece> out;
  if (blocks <= most) {
    const uint32_t per = static_cast<uint32_t>(std::min<uint64_t>(layers, most / blocks));
    for (uint32_t l = 0; l < layers; l += per) {
      out.push_back({0, blocks, l, std::min<uint32_t>(layers, l + per)});
    }
    return out;
  }
  for (uint32_t l = 0; l < layers; ++l) {
    for (const auto& [b, e] : Ranges(blocks, static_cast<size_t>(most))) {
      out.push_back({b, e, l, l + 1});
    }
  }
  return out;
}

// One Restore request, as BackupRequest.
struct CacheCore::RestoreRequest {
  std::shared_ptr<Pool> pool;
  TransferSpec spec;
  std::vector<BlockStore::ReadPin> pins;  // the restored leading run
  std::vector<RestorePiece> chunks;       // its sub-tasks
  bool device = false;
  bool sync = false;
  RestoreResult result;
  std::shared_ptr<RestoreDone> reply;
  bool replied = false;
  bool finished = false;
  uint64_t pending_bytes = 0;
  Status error;
  std::chrono::steady_clock::time_point started{};
  bool has_started = false;
  uint64_t restored = 0;  // blocks of sub-tasks that completed
  // Layers whose events went out without the failure bit: a failure after them leaves them so.
  uint32_t layers_signalled = 0;
};

// The end both request machines share, once their own bookkeeping is done: the request leaves
// its pool's in-flight list, a failure is logged, the caller is answered if it was not yet, the
// pending bytes are given back and the pool's task ends.
template <typename Request>
void CacheCore::EndRequest(Request& req, const char* kind) {
  Pool& pool = *req.pool;
  const Status& run = req.error;
  if (pool.restore_strand != pool.strand) pool.RemoveInFlight(req.result.ticket);
  if (!run.ok()) {
    HIQ_LOG(WARN) << "event=" << kind << "_failed pool=" << pool.id
                  << " ticket=" << req.result.ticket << " code=" << StatusCodeName(run.code())
                  << " error=\"" << LogSafe(run.message()) << "\"";
  }
  if (!req.replied) {
    req.replied = true;
    if (run.ok())
      (*req.reply)(req.result);
    else
      (*req.reply)(run);
  }
  quotas_.UnchargePending(pool.client, req.pending_bytes);
  pool.EndTask();
}

inline TransferEngine::StepResult StepOf(StartResult r) {
  switch (r) {
    case StartResult::kNotReady:
      return TransferEngine::StepResult::kNotReady;
    case StartResult::kCompleted:
      return TransferEngine::StepResult::kDone;
    case StartResult::kPending:
      break;
  }
  return TransferEngine::StepResult::kDetached;
}

inline std::string UnknownPoolText(uint64_t pool_id) {
  return "pool_id: unknown pool " + std::to_string(pool_id) +
         " (released, or hiqcached restarted: register again)";
}

inline Status ReleasedPool(uint64_t pool_id) {
  return NotFound("pool_id: unknown pool " + std::to_string(pool_id) + " (released)");
}

inline Status OutOfMemory(const char* what) {
  return ResourceExhausted(std::string(what) + ": hiqcached is out of memory");
}

template <typename Request>
Status CacheCore::Admit(Request& req, uint64_t pool_id) {
  Pool& pool = *req.pool;
  HIQ_RETURN_IF_ERROR(quotas_.ChargePending(pool.client, req.pending_bytes));
  if (!pool.BeginTask()) {
    quotas_.UnchargePending(pool.client, req.pending_bytes);
    return ReleasedPool(pool_id);
  }
  return Status::Ok();
}

template <typename Request>
bool CacheCore::WaitsToStart(Request& req, size_t chunk, bool new_task) {
  if (!req.has_started) {
    req.started = std::chrono::steady_clock::now();
    req.has_started = true;
  }
  const Pool& pool = *req.pool;
  return new_task && chunk == 0 && pool.restore_strand != pool.strand &&
         req.pool->WaitsForOtherDirection(req.result.ticket);
}

template <typename Request, typename InFlight>
bool CacheCore::PostRequest(Request& req, const std::shared_ptr<TransferEngine::Strand>& strand,
                            InFlight touches, std::vector<TransferEngine::StepTask> steps,
                            const char* rpc) {
  Pool& pool = *req.pool;
  {
    MutexLock lock(&pool.post_mu);
    const uint64_t ticket = ++pool.next_ticket;
    req.result.ticket = ticket;
    // An asynchronous caller's answer is the acceptance below, sent by this thread: no sub-task
    // may answer it, which `replied`, set before any is posted, says.
    req.replied = !req.sync;
    const auto accepted = req.result;
    bool posted = false;
    try {
      pool.AddInFlight(ticket, std::move(touches));
      engine_.PostSteps(strand, std::move(steps));  // all or nothing
      posted = true;
    } catch (const std::bad_alloc&) {
      pool.RemoveInFlight(ticket);
      --pool.next_ticket;  // post_mu held: no later ticket was handed out
      req.replied = true;
    }
    if (posted) {
      if (!req.sync) (*req.reply)(accepted);
      return true;
    }
  }
  quotas_.UnchargePending(pool.client, req.pending_bytes);
  pool.EndTask();
  (*req.reply)(OutOfMemory(rpc));
  return false;
}

// Logs what a sub-task of `rpc` ("Backup", "Restore") threw and the error its request ends with.
inline Status TaskThrew(const char* rpc, uint64_t pool_id, uint64_t ticket,
                        const std::exception& ex) {
  const bool oom = dynamic_cast<const std::bad_alloc*>(&ex) != nullptr;
  std::string event = rpc;
  for (char& c : event) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  HIQ_LOG(ERROR) << "event=" << event << "_failed pool=" << pool_id << " ticket=" << ticket
                 << " error=\"" << (oom ? std::string("out of memory") : LogSafe(ex.what()))
                 << "\"";
  return oom ? OutOfMemory(rpc) : Status(StatusCode::kInternal, event + " failed");
}

inline std::vector<BlockKey> KeysOf(const std::vector<BlockSpec>& blocks, size_t n) {
  std::vector<BlockKey> keys;
  keys.reserve(n);
  for (size_t i = 0; i < n; ++i) keys.push_back(ToBlockKey(blocks[i].key));
  return keys;
}

inline TransferSample SampleOf(const NamespaceInfo& ns, const kernels::BlockLayout& l, bool restore,
                               size_t blocks, std::chrono::steady_clock::duration elapsed,
                               bool ok) {
  TransferSample s;
  s.restore = restore;
  s.namespace_id = ns.hex_id;
  s.model = ns.desc.model;
  s.blocks = blocks;
  s.input_bytes = uint64_t{blocks} * InputBlockBytes(l);
  s.stored_bytes = uint64_t{blocks} * l.BlockBytes();
  s.duration = std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed);
  s.ok = ok;
  return s;
}

// A wait that a HOST binding answers at once with a failure (CANCELLED once the pool is
// released, else DEADLINE_EXCEEDED): a slot never holds UINT64_MAX, and the task's first try lies
// further back than any wait timeout (host_backend.cc CheckWait). The last sub-task of a request
// that already failed runs with it, so that its events get the failure bit and nothing is read
// or written.
inline constexpr uint64_t kNeverValue = UINT64_MAX;
inline std::chrono::steady_clock::time_point LongAgo() {
  return std::chrono::steady_clock::now() - std::chrono::hours(24);
}

// An event of the request a HOST binding can check (any valid index), or -1.
inline int32_t ProbeEvent(const TransferSpec& spec) {
  if (spec.wait_event >= 0) return spec.wait_event;
  if (spec.done_event >= 0) return spec.done_event;
  return spec.layer_event_base;
}

}  // namespace hiqcache::server
