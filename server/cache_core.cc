#include "cache_core.h"

#include <xxhash.h>

#include <algorithm>
#include <condition_variable>
#include <random>

#include "hiqcache/log.h"

namespace hiqcache::server {

struct CacheCore::Pool {
  uint64_t id = 0;
  const NamespaceInfo* ns = nullptr;
  kernels::BlockLayout layout;
  bool cuda = false;
  uint32_t client_pid = 0;
  std::string peer;
  std::unique_ptr<PoolBinding> binding;
  std::shared_ptr<TransferEngine::Strand> strand;
  std::atomic<uint64_t> next_ticket{0};
  std::atomic<uint64_t> backups{0};
  std::atomic<uint64_t> restores{0};

  // Tasks of this pool posted and not yet completed, so that a release can wait for them.
  std::mutex mu;
  std::condition_variable idle_cv;
  uint32_t outstanding = 0;     // GUARDED_BY(mu)
  bool released = false;        // GUARDED_BY(mu): no task may begin any more
  bool close_when_idle = false;  // GUARDED_BY(mu): a release gave up waiting; the last task closes

  // Counts a new task, unless the pool was released (then the caller answers NOT_FOUND).
  bool BeginTask() {
    std::lock_guard<std::mutex> lock(mu);
    if (released) return false;
    ++outstanding;
    return true;
  }
  // The end of a task begun with BeginTask (its on_complete). Closes the binding when a release
  // timed out waiting for this.
  void EndTask() {
    bool close = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      close = --outstanding == 0 && close_when_idle;
      if (close) close_when_idle = false;
    }
    idle_cv.notify_all();
    if (close) {
      binding->Close();
      HIQ_LOG(INFO) << "event=release_pool_closed pool=" << id << " (its last device work completed)";
    }
  }
};

namespace {

TransferEngine::StepResult StepOf(StartResult r) {
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

Status ReleasedPool(uint64_t pool_id) {
  return NotFound("pool_id: unknown pool " + std::to_string(pool_id) + " (released)");
}

std::vector<BlockKey> KeysOf(const std::vector<BlockSpec>& blocks, size_t n) {
  std::vector<BlockKey> keys;
  keys.reserve(n);
  for (size_t i = 0; i < n; ++i) keys.push_back(ToBlockKey(blocks[i].key));
  return keys;
}

TransferSample SampleOf(const NamespaceInfo& ns, const kernels::BlockLayout& l, bool restore,
                        size_t blocks, std::chrono::steady_clock::duration elapsed, bool ok) {
  TransferSample s;
  s.restore = restore;
  s.namespace_id = ns.hex_id;
  s.model = ns.desc.model;
  s.blocks = blocks;
  s.input_bytes = uint64_t{blocks} * l.num_layers * l.kv_planes * l.block_tokens *
                  l.row.InputRowBytes();
  s.stored_bytes = uint64_t{blocks} * l.BlockBytes();
  s.duration = std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed);
  s.ok = ok;
  return s;
}

}  // namespace

CacheCore::CacheCore(const CoreOptions& options, BlockStore* store, DeviceBackend* host,
                     DeviceBackend* cuda)
    : options_(options),
      store_(store),
      host_(host),
      cuda_(cuda),
      start_(std::chrono::steady_clock::now()),
      engine_(options.transfer_workers) {}

CacheCore::~CacheCore() { engine_.WaitIdle(); }

std::function<void(std::function<void()>)> CacheCore::DeferOnStrand(
    const std::shared_ptr<TransferEngine::Strand>& strand) {
  return [this, strand](std::function<void()> work) { engine_.Resume(strand, std::move(work)); };
}

StatusOr<RegisterResult> CacheCore::RegisterPool(const RegisterSpec& spec) {
  if (draining()) return Unavailable("hiqcached is shutting down");
  HIQ_ASSIGN_OR_RETURN(ValidatedRegistration reg,
                       ValidateRegistration(spec, options_.limits, store_->CapacityBytes()));
  DeviceBackend* backend = reg.cuda ? cuda_ : host_;
  if (backend == nullptr) {
    return FailedPrecondition(
        "device.kind: DEVICE_KIND_CUDA requested, but this hiqcached has no CUDA device "
        "(built without CUDA, no GPU visible, or started with --device host)");
  }
  HIQ_ASSIGN_OR_RETURN(std::unique_ptr<PoolBinding> binding, backend->Bind(spec, reg.layout));

  const NamespaceInfo& ns = namespaces_.Intern(reg.ns);
  store_->AddNamespace(ns);
  auto pool = std::make_shared<Pool>();
  pool->ns = &ns;
  pool->layout = reg.layout;
  pool->cuda = reg.cuda;
  pool->client_pid = spec.client_pid;
  pool->peer = spec.peer;
  pool->binding = std::move(binding);
  pool->strand = engine_.NewStrand();
  pool->next_ticket.store(pool->binding->TicketFloor());

  RegisterResult out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Unguessable ids from the kernel's generator: a pool id is what lets a caller write into
    // an engine's KV buffers, so one process must not be able to predict another's, and an id
    // held from before a restart never names another pool.
    std::random_device rd;
    do {
      pool->id = ((uint64_t{rd()} << 32) | rd()) & 0x7FFFFFFFFFFFFFFFull;
    } while (pool->id == 0 || pools_.count(pool->id) != 0);
    pools_[pool->id] = pool;
  }
  out.pool_id = pool->id;
  out.namespace_id = ns.hex_id;
  out.encoded_bytes_per_token = reg.layout.BytesPerToken();
  out.block_bytes = reg.layout.BlockBytes();
  out.capacity_tokens = store_->CapacityBlocks(reg.layout.BlockBytes()) * reg.layout.block_tokens;
  HIQ_LOG(INFO) << "event=register_pool pool=" << out.pool_id << " device=" << backend->name()
                << " pid=" << spec.client_pid << " namespace=" << ns.hex_id << " desc=\""
                << ns.desc.CanonicalText() << "\" bytes_per_token=" << out.encoded_bytes_per_token
                << " capacity_tokens=" << out.capacity_tokens;
  return out;
}

StatusOr<std::shared_ptr<CacheCore::Pool>> CacheCore::FindPool(uint64_t pool_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pools_.find(pool_id);
  if (it == pools_.end()) {
    return NotFound("pool_id: unknown pool " + std::to_string(pool_id) +
                    " (released, or hiqcached restarted: register again)");
  }
  return it->second;
}

Status CacheCore::ReleasePool(uint64_t pool_id) {
  std::shared_ptr<Pool> pool;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pools_.find(pool_id);
    if (it == pools_.end()) {
      return NotFound("pool_id: unknown pool " + std::to_string(pool_id));
    }
    pool = std::move(it->second);
    pools_.erase(it);
  }
  {
    std::lock_guard<std::mutex> lock(pool->mu);
    pool->released = true;  // a request that found the pool just before cannot begin now
  }
  // Queued work stops touching the engine's buffers and events (CUDA), and a HOST task waiting
  // for an event of this pool stops now, so its pins and its worker are freed. Work already on
  // the device completes: the mappings are closed only after it did (DESIGN.md "CUDA completion
  // and event rules": the engine may free its buffers once this returns OK).
  pool->binding->Cancel();
  const auto t0 = std::chrono::steady_clock::now();
  bool drained;
  {
    std::unique_lock<std::mutex> lock(pool->mu);
    drained = pool->idle_cv.wait_for(lock, options_.release_timeout,
                                     [&] { return pool->outstanding == 0; });
    if (!drained) pool->close_when_idle = true;
  }
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - t0);
  if (!drained) {
    HIQ_LOG(WARN) << "event=release_pool_pending pool=" << pool_id
                  << " waited_ms=" << waited.count()
                  << " (device work still pending: its mappings and events stay open until it "
                     "completes)";
    return DeadlineExceeded(
        "pool_id: pool " + std::to_string(pool_id) + " is released, but its device work was "
        "still pending after " + std::to_string(options_.release_timeout.count()) +
        " ms (a wait_event never completed?): its buffers and events stay open until that work "
        "completes, so the engine must not free them yet");
  }
  pool->binding->Close();
  HIQ_LOG(INFO) << "event=release_pool pool=" << pool_id << " waited_ms=" << waited.count();
  return Status::Ok();
}

size_t CacheCore::ReleasePoolsOfClient(uint32_t pid) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, pool] : pools_) {
      if (pool->client_pid == pid) ids.push_back(id);
    }
  }
  for (uint64_t id : ids) (void)ReleasePool(id);
  if (!ids.empty()) {
    HIQ_LOG(INFO) << "event=client_exit pid=" << pid << " pools_released=" << ids.size();
  }
  return ids.size();
}

StatusOr<std::vector<BlockKey>> CacheCore::CheckedKeys(const std::vector<std::string>& keys) const {
  HIQ_RETURN_IF_ERROR(ValidateKeys(keys, options_.limits.max_keys_per_lookup, "keys"));
  std::vector<BlockKey> out;
  out.reserve(keys.size());
  for (const auto& s : keys) out.push_back(ToBlockKey(s));
  return out;
}

StatusOr<uint32_t> CacheCore::Lookup(const LookupSpec& spec) {
  if (draining()) return Unavailable("hiqcached is shutting down");
  if (spec.pool_id == 0 && spec.namespaces.empty()) {
    return InvalidArgument("pool_id: 0 names no pool, and namespaces is empty: set either");
  }
  if (spec.namespaces.size() > kMaxLookupNamespaces) {
    // As for keys: a per-request bound (a caller may split the group and take the minimum).
    return ResourceExhausted("namespaces: " + std::to_string(spec.namespaces.size()) +
                             " entries, at most " + std::to_string(kMaxLookupNamespaces) +
                             " per request");
  }
  std::vector<NamespaceDesc> descs;
  descs.reserve(spec.namespaces.size());
  for (size_t i = 0; i < spec.namespaces.size(); ++i) {
    HIQ_ASSIGN_OR_RETURN(
        NamespaceDesc desc,
        ValidateNamespace(spec.namespaces[i], options_.limits, store_->CapacityBytes(),
                          "namespaces[" + std::to_string(i) + "]."));
    descs.push_back(std::move(desc));
  }
  std::shared_ptr<Pool> pool;
  if (spec.pool_id != 0) {
    HIQ_ASSIGN_OR_RETURN(pool, FindPool(spec.pool_id));
  }
  HIQ_ASSIGN_OR_RETURN(std::vector<BlockKey> k, CheckedKeys(spec.keys));
  // The whole request is valid: only now may resolving a ref adopt a rebuilt namespace.
  std::vector<uint32_t> ids;
  ids.reserve(descs.size() + 1);
  for (const NamespaceDesc& desc : descs) {
    const NamespaceInfo* ns = FindOrAdoptNamespace(desc);
    ids.push_back(ns != nullptr ? ns->id : kNoNamespace);  // unknown = holds nothing
  }
  if (pool != nullptr) ids.push_back(pool->ns->id);
  return store_->LookupPrefix(ids, k);
}

const NamespaceInfo* CacheCore::FindOrAdoptNamespace(const NamespaceDesc& desc) {
  if (const NamespaceInfo* ns = namespaces_.Find(desc)) return ns;
  // After a warm restart the pool's blocks sit under namespaces nobody registered yet. A
  // scheduler's lookup must see them before any of its workers registers again (they register
  // when they load), so a ref that names such blocks adopts them as RegisterPool would. Any
  // other ref creates nothing: lookups of arbitrary namespaces cost no memory. Adoptions are
  // bounded by the namespaces the rebuild found; racing a RegisterPool of the same namespace is
  // harmless (Intern and AddNamespace are idempotent).
  if (!store_->HoldsOrphan(desc.Hash(), desc.layout.BlockBytes())) return nullptr;
  const NamespaceInfo& ns = namespaces_.Intern(desc);
  if (store_->AddNamespace(ns)) {
    HIQ_LOG(INFO) << "event=adopt_namespace by=lookup namespace=" << ns.hex_id << " desc=\""
                  << desc.CanonicalText() << "\"";
  }
  return &ns;
}

StatusOr<uint32_t> CacheCore::Lookup(uint64_t pool_id, const std::vector<std::string>& keys) {
  LookupSpec spec;
  spec.pool_id = pool_id;
  spec.keys = keys;
  return Lookup(spec);
}

StatusOr<uint32_t> CacheCore::Evict(uint64_t pool_id, const std::vector<std::string>& keys) {
  if (draining()) return Unavailable("hiqcached is shutting down");
  HIQ_ASSIGN_OR_RETURN(auto pool, FindPool(pool_id));
  HIQ_ASSIGN_OR_RETURN(std::vector<BlockKey> k, CheckedKeys(keys));
  return store_->Evict(pool->ns->id, k);
}

void CacheCore::Backup(TransferSpec spec, BackupDone done) {
  if (draining()) return done(Unavailable("hiqcached is shutting down"));
  auto found = FindPool(spec.pool_id);
  if (!found.ok()) return done(found.status());
  std::shared_ptr<Pool> pool = std::move(found).value();
  Status st = ValidateTransfer(spec, pool->layout, pool->binding->num_rows(),
                               pool->binding->event_count(), /*restore=*/false, options_.limits);
  if (!st.ok()) return done(st);
  if (!pool->BeginTask()) return done(ReleasedPool(spec.pool_id));

  const size_t n = spec.blocks.size();
  std::vector<BlockKey> keys = KeysOf(spec.blocks, n);
  auto reservations = store_->ReserveWrites(pool->ns->id, keys);

  auto result = std::make_shared<BackupResult>();
  result->results.resize(n);
  result->ticket = ++pool->next_ticket;
  auto task = std::make_shared<BackupTask>();
  task->ticket = result->ticket;
  task->wait_event = spec.wait_event;
  task->wait_value = spec.wait_value;
  task->done_event = spec.done_event;
  std::vector<size_t> reserved_index;  // request index of each reserved block
  for (size_t i = 0; i < n; ++i) {
    switch (reservations[i].outcome) {
      case BlockStore::WriteOutcome::kReserved:
        result->results[i] = BlockResult::kStored;
        reserved_index.push_back(i);
        task->payloads.push_back(reservations[i].payload);
        task->rows.insert(task->rows.end(), spec.blocks[i].rows.begin(),
                          spec.blocks[i].rows.end());
        break;
      case BlockStore::WriteOutcome::kPresent:
        result->results[i] = BlockResult::kAlreadyPresent;
        break;
      case BlockStore::WriteOutcome::kNoSpace:
        result->results[i] = BlockResult::kRejected;
        break;
    }
  }
  BlockStore* store = store_;
  const size_t payload_bytes = pool->layout.BlockBytes();
  const size_t moved = task->payloads.size();
  // The callbacks live in the task: they hold a raw pointer to it, never a reference that would
  // make the task own itself. The backend keeps the task alive while it calls them.
  BackupTask* raw_task = task.get();
  task->on_written = [store, reservations = std::move(reservations), reserved_index, result,
                      payload_bytes, raw_task](const std::vector<uint8_t>& nonfinite,
                                               const Status& st) {
    const std::vector<uint64_t>& sums = raw_task->checksums;
    for (size_t j = 0; j < reserved_index.size(); ++j) {
      const auto& r = reservations[reserved_index[j]];
      if (!st.ok() || nonfinite[j]) {
        store->AbortWrite(r.handle, /*rejected=*/st.ok());
        result->results[reserved_index[j]] = BlockResult::kRejected;
        continue;
      }
      store->CommitWrite(r.handle, j < sums.size() ? sums[j] : XXH3_64bits(r.payload, payload_bytes));
    }
  };

  // `reply` runs exactly once: at once (HOST, asynchronous), once the device work is enqueued
  // (CUDA, asynchronous: an enqueue failure answers the error, never STORED), or on completion.
  auto reply = std::make_shared<BackupDone>(std::move(done));
  const bool sync = spec.sync;
  if (!sync && pool->binding->SignalsOnDevice()) {
    task->on_enqueued = [reply, result](const Status& enqueued) {
      if (enqueued.ok()) (*reply)(*result);
      else (*reply)(enqueued);
    };
  } else if (!sync) {
    (*reply)(*result);
  }
  CoreObserver* observer = options_.observer;
  // on_complete holds the pool (and so its binding) until the task ends: a released pool's
  // binding outlives the device work of its last task.
  Pool* raw_pool = pool.get();
  auto started = std::make_shared<std::chrono::steady_clock::time_point>();
  task->defer = DeferOnStrand(pool->strand);
  task->on_complete = [pool, raw_pool, result, sync, observer, reply, moved, started,
                       ticket = task->ticket](const Status& run) {
    if (observer != nullptr && moved > 0) {
      observer->OnTransfer(SampleOf(*raw_pool->ns, raw_pool->layout, /*restore=*/false, moved,
                                    std::chrono::steady_clock::now() - *started, run.ok()));
    }
    raw_pool->backups.fetch_add(moved, std::memory_order_relaxed);
    if (!run.ok()) {
      HIQ_LOG(WARN) << "event=backup_failed pool=" << raw_pool->id << " ticket=" << ticket
                    << " code=" << StatusCodeName(run.code()) << " error=\"" << run.message()
                    << "\"";
    }
    if (sync) {
      if (run.ok()) (*reply)(*result);
      else (*reply)(run);
    }
    raw_pool->EndTask();
  };
  engine_.PostStep(pool->strand, [pool, task, started] {
    *started = std::chrono::steady_clock::now();
    return StepOf(pool->binding->StartBackup(task));
  });
}

void CacheCore::Restore(TransferSpec spec, RestoreDone done) {
  if (draining()) return done(Unavailable("hiqcached is shutting down"));
  auto found = FindPool(spec.pool_id);
  if (!found.ok()) return done(found.status());
  std::shared_ptr<Pool> pool = std::move(found).value();
  Status st = ValidateTransfer(spec, pool->layout, pool->binding->num_rows(),
                               pool->binding->event_count(), /*restore=*/true, options_.limits);
  if (!st.ok()) return done(st);
  if (!pool->BeginTask()) return done(ReleasedPool(spec.pool_id));

  std::vector<BlockKey> keys = KeysOf(spec.blocks, spec.blocks.size());
  std::vector<BlockStore::ReadPin> pins = store_->PinReads(pool->ns->id, keys);
  RestoreResult result;
  result.restored_blocks = static_cast<uint32_t>(pins.size());
  result.ticket = ++pool->next_ticket;
  auto task = std::make_shared<RestoreTask>();
  task->ticket = result.ticket;
  task->wait_event = spec.wait_event;
  task->wait_value = spec.wait_value;
  task->layer_event_base = spec.layer_event_base;
  task->done_event = spec.done_event;
  for (size_t i = 0; i < pins.size(); ++i) {
    task->payloads.push_back(pins[i].payload);
    task->rows.insert(task->rows.end(), spec.blocks[i].rows.begin(), spec.blocks[i].rows.end());
  }
  // As for Backup: an asynchronous CUDA restore whose enqueue failed answers the error (the rows
  // hold garbage), never restored_blocks = n.
  auto reply = std::make_shared<RestoreDone>(std::move(done));
  const bool sync = spec.sync;
  if (!sync && pool->binding->SignalsOnDevice()) {
    task->on_enqueued = [reply, result](const Status& enqueued) {
      if (enqueued.ok()) (*reply)(result);
      else (*reply)(enqueued);
    };
  } else if (!sync) {
    (*reply)(result);
  }
  BlockStore* store = store_;
  CoreObserver* observer = options_.observer;
  Pool* raw_pool = pool.get();
  auto started = std::make_shared<std::chrono::steady_clock::time_point>();
  task->defer = DeferOnStrand(pool->strand);
  task->on_complete = [pool, raw_pool, pins = std::move(pins), store, result, sync, observer, reply,
                       started, ticket = task->ticket](const Status& run) {
    if (observer != nullptr && !pins.empty()) {
      observer->OnTransfer(SampleOf(*raw_pool->ns, raw_pool->layout, /*restore=*/true,
                                    pins.size(), std::chrono::steady_clock::now() - *started,
                                    run.ok()));
    }
    // The device has finished reading the payloads: they may be evicted from now on.
    for (const auto& p : pins) store->Unpin(p.handle);
    raw_pool->restores.fetch_add(pins.size(), std::memory_order_relaxed);
    if (!run.ok()) {
      HIQ_LOG(WARN) << "event=restore_failed pool=" << raw_pool->id << " ticket=" << ticket
                    << " code=" << StatusCodeName(run.code()) << " error=\"" << run.message()
                    << "\"";
    }
    if (sync) {
      if (run.ok()) (*reply)(result);
      else (*reply)(run);
    }
    raw_pool->EndTask();
  };
  engine_.PostStep(pool->strand, [pool, task, started] {
    *started = std::chrono::steady_clock::now();
    return StepOf(pool->binding->StartRestore(task));
  });
}

std::vector<uint32_t> CacheCore::ClientPids() const {
  std::vector<uint32_t> pids;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, pool] : pools_) {
    if (pool->client_pid != 0) pids.push_back(pool->client_pid);
  }
  std::sort(pids.begin(), pids.end());
  pids.erase(std::unique(pids.begin(), pids.end()), pids.end());
  return pids;
}

CoreSnapshot CacheCore::Snapshot() const {
  CoreSnapshot snap;
  snap.store = store_->Stats();
  snap.uptime_seconds = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::seconds>(
                                                  std::chrono::steady_clock::now() - start_)
                                                  .count());
  std::map<uint32_t, uint32_t> pools_per_ns;
  std::map<std::pair<uint32_t, std::string>, int> clients;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, pool] : pools_) {
      PoolSnapshot p;
      p.pool_id = id;
      p.namespace_id = pool->ns->hex_id;
      p.model = pool->ns->desc.model;
      p.tenant = pool->ns->desc.tenant;
      p.cuda = pool->cuda;
      p.client_pid = pool->client_pid;
      p.peer = pool->peer;
      p.backups = pool->backups.load();
      p.restores = pool->restores.load();
      snap.pools.push_back(std::move(p));
      pools_per_ns[pool->ns->id] += 1;
      clients[{pool->client_pid, pool->client_pid == 0 ? pool->peer : std::string()}] = 1;
    }
  }
  snap.clients = clients.size();
  snap.staging_device_bytes = cuda_ != nullptr ? cuda_->StagingDeviceBytes() : 0;
  for (const NamespaceInfo* ns : namespaces_.All()) {
    NamespaceSnapshot n;
    n.namespace_id = ns->hex_id;
    n.model = ns->desc.model;
    n.tenant = ns->desc.tenant;
    n.raw_codec = ns->desc.layout.row.codec == kernels::CodecKind::kRaw;
    n.encoded_bytes_per_token = ns->desc.layout.BytesPerToken();
    n.pools = pools_per_ns[ns->id];
    auto it = snap.store.namespaces.find(ns->id);
    if (it != snap.store.namespaces.end()) n.counters = it->second;
    snap.namespaces.push_back(std::move(n));
  }
  return snap;
}

}  // namespace hiqcache::server
