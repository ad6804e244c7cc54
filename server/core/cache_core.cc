#include "core/cache_core.h"

#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <exception>
#include <new>
#include <random>
#include <set>
#include <unordered_set>

#include "hiqcache/log.h"

namespace hiqcache::server {
namespace {

uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  uint64_t out;
  return __builtin_mul_overflow(a, b, &out) ? UINT64_MAX : out;
}

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  return __builtin_add_overflow(a, b, &out) ? UINT64_MAX : out;
}

// Engine-side (BF16/FP16) bytes of one block: what a backup reads and a restore writes.
uint64_t InputBlockBytes(const kernels::BlockLayout& l) {
  return uint64_t{l.num_layers} * l.kv_planes * l.block_tokens * l.row.InputRowBytes();
}

struct KeyHash {
  size_t operator()(const BlockKey& k) const {
    uint64_t a, b;
    std::memcpy(&a, k.data(), 8);
    std::memcpy(&b, k.data() + 8, 8);
    return static_cast<size_t>(a ^ (b * 0x9E3779B97F4A7C15ull));
  }
};

}  // namespace

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
  std::shared_ptr<TransferEngine::Strand> strand;
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

// One Restore request, as BackupRequest.
struct CacheCore::RestoreRequest {
  std::shared_ptr<Pool> pool;
  TransferSpec spec;
  std::vector<BlockStore::ReadPin> pins;          // the restored leading run
  std::vector<std::pair<size_t, size_t>> chunks;  // ranges of `pins`
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

std::string UnknownPoolText(uint64_t pool_id) {
  return "pool_id: unknown pool " + std::to_string(pool_id) +
         " (released, or hiqcached restarted: register again)";
}

Status ReleasedPool(uint64_t pool_id) {
  return NotFound("pool_id: unknown pool " + std::to_string(pool_id) + " (released)");
}

Status OutOfMemory(const char* what) {
  return ResourceExhausted(std::string(what) + ": hiqcached is out of memory");
}

// Logs what a sub-task of `rpc` ("Backup", "Restore") threw and the error its request ends with.
Status TaskThrew(const char* rpc, uint64_t pool_id, uint64_t ticket, const std::exception& ex) {
  const bool oom = dynamic_cast<const std::bad_alloc*>(&ex) != nullptr;
  std::string event = rpc;
  for (char& c : event) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  HIQ_LOG(ERROR) << "event=" << event << "_failed pool=" << pool_id << " ticket=" << ticket
                 << " error=\"" << (oom ? std::string("out of memory") : LogSafe(ex.what()))
                 << "\"";
  return oom ? OutOfMemory(rpc) : Status(StatusCode::kInternal, event + " failed");
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
  s.input_bytes = uint64_t{blocks} * InputBlockBytes(l);
  s.stored_bytes = uint64_t{blocks} * l.BlockBytes();
  s.duration = std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed);
  s.ok = ok;
  return s;
}

// Splits [0, n) into ranges of at most `per` (at least one range, possibly empty).
std::vector<std::pair<size_t, size_t>> Ranges(size_t n, size_t per) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t b = 0; b < n; b += per) out.emplace_back(b, std::min(n, b + per));
  if (out.empty()) out.emplace_back(0, 0);
  return out;
}

// A wait that a HOST binding answers at once with a failure (CANCELLED once the pool is
// released, else DEADLINE_EXCEEDED): a slot never holds UINT64_MAX, and the task's first try lies
// further back than any wait timeout (host_backend.cc CheckWait). The last sub-task of a request
// that already failed runs with it, so that its events get the failure bit and nothing is read
// or written.
constexpr uint64_t kNeverValue = UINT64_MAX;
std::chrono::steady_clock::time_point LongAgo() {
  return std::chrono::steady_clock::now() - std::chrono::hours(24);
}

// An event of the request a HOST binding can check (any valid index), or -1.
int32_t ProbeEvent(const TransferSpec& spec) {
  if (spec.wait_event >= 0) return spec.wait_event;
  if (spec.done_event >= 0) return spec.done_event;
  return spec.layer_event_base;
}

}  // namespace

CacheCore::CacheCore(const CoreOptions& options, BlockStore* store, DeviceBackend* host,
                     DeviceBackend* cuda)
    : options_(options),
      store_(store),
      host_(host),
      cuda_(cuda),
      start_(std::chrono::steady_clock::now()),
      quotas_(options.quotas),
      engine_(options.transfer_workers) {}

CacheCore::~CacheCore() {
  engine_.WaitIdle();
  // The store keeps what it holds for a warm restart: pools destroyed from here on give their
  // quota back but remove no namespace.
  destroying_.store(true);
}

std::function<void(std::function<void()>)> CacheCore::DeferOnStrand(
    const std::shared_ptr<TransferEngine::Strand>& strand) {
  return [this, strand](std::function<void()> work) { engine_.Resume(strand, std::move(work)); };
}

uint64_t CacheCore::ClientOf(const Caller& caller) {
  return caller.authenticated() ? uint64_t{caller.uid} : QuotaLedger::kAnonymousClient;
}

bool CacheCore::Owns(const Pool& pool, const Caller& caller) {
  // An anonymous pool is today's pool: any anonymous caller may use it, no authenticated one.
  if (!pool.owner.authenticated()) return !caller.authenticated();
  return caller.authenticated() && caller.uid == pool.owner.uid && caller.pid == pool.owner.pid;
}

NamespaceDesc CacheCore::Scoped(NamespaceDesc desc, const Caller& caller) const {
  if (options_.namespace_scope != NamespaceScope::kNode) {
    desc.scope = caller.authenticated() ? "uid:" + std::to_string(caller.uid) : "anonymous";
    if (options_.namespace_scope == NamespaceScope::kPod && caller.authenticated() &&
        !caller.pod.empty()) {
      desc.scope += "/" + caller.pod;
    }
  } else {
    desc.scope.clear();
  }
  return desc;
}

size_t CacheCore::ChunkBlocks(const kernels::BlockLayout& layout) const {
  const uint64_t per_block = std::max<uint64_t>(1, InputBlockBytes(layout));
  const uint64_t by_bytes = options_.transfer_chunk_bytes / per_block;
  const uint64_t blocks =
      std::min<uint64_t>(std::max<uint32_t>(1, options_.transfer_chunk_blocks), by_bytes);
  return static_cast<size_t>(std::max<uint64_t>(1, blocks));
}

void CacheCore::RetirePool(Pool& pool) {
  if (pool.retired.exchange(true)) return;
  quotas_.UnchargePool(pool.client, pool.buffers, pool.mapped_bytes);
  if (pool.ns == nullptr || destroying_.load()) return;
  if (namespaces_.Release(pool.ns->id,
                          [this](uint32_t id) { return store_->RemoveNamespace(id); })) {
    NamespaceRemoved(*pool.ns);
  }
}

void CacheCore::NamespaceRemoved(const NamespaceInfo& ns) {
  HIQ_LOG(DEBUG) << "event=namespace_removed namespace=" << ns.hex_id;
  if (options_.observer != nullptr) options_.observer->OnNamespaceRemoved(ns.hex_id);
}

void CacheCore::SweepNamespaces() {
  for (uint32_t id : store_->TakeEmptiedNamespaces()) {
    auto gone = namespaces_.RemoveIfUnused(
        id, [this](uint32_t ns_id) { return store_->RemoveNamespace(ns_id); });
    if (gone != nullptr) NamespaceRemoved(*gone);
  }
}

StatusOr<RegisterResult> CacheCore::RegisterPool(const RegisterSpec& spec) {
  if (draining()) return Unavailable("hiqcached is shutting down");
  try {
    HIQ_ASSIGN_OR_RETURN(ValidatedRegistration reg,
                         ValidateRegistration(spec, options_.limits, store_->CapacityBytes()));
    DeviceBackend* backend = reg.cuda ? cuda_ : host_;
    if (backend == nullptr) {
      return FailedPrecondition(
          "device.kind: DEVICE_KIND_CUDA requested, but this hiqcached has no CUDA device "
          "(built without CUDA, no GPU visible, or started with --device host)");
    }
    auto pool = std::make_shared<Pool>();
    pool->client = ClientOf(spec.caller);
    pool->buffers = static_cast<uint32_t>(spec.buffers.size());
    for (const BufferSpec& b : spec.buffers) {
      pool->mapped_bytes = SaturatingAdd(pool->mapped_bytes, b.size_bytes);
    }
    if (!reg.cuda) {
      pool->mapped_bytes = SaturatingAdd(pool->mapped_bytes, 64ull * spec.events.count);
    }
    // Quotas are checked and charged at once, before anything is opened.
    HIQ_ASSIGN_OR_RETURN(std::shared_ptr<FaultBudget> budget,
                         quotas_.ChargePool(pool->client, pool->buffers, pool->mapped_bytes));
    pool->core = this;  // from here on the pool gives its quota back when it goes
    HIQ_ASSIGN_OR_RETURN(pool->binding, backend->Bind(spec, reg.layout, std::move(budget)));

    SweepNamespaces();
    pool->ns = namespaces_.Acquire(Scoped(reg.ns, spec.caller));
    const NamespaceInfo& ns = *pool->ns;
    store_->AddNamespace(ns.ForStore());
    pool->layout = reg.layout;
    pool->cuda = reg.cuda;
    pool->owner = spec.caller;
    pool->client_pid = spec.caller.authenticated() ? spec.caller.pid : spec.client_pid;
    pool->peer = spec.peer;
    pool->strand = engine_.NewStrand(pool->client);
    pool->next_ticket.store(pool->binding->TicketFloor());

    RegisterResult out;
    {
      MutexLock lock(&mu_);
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
                  << " pid=" << pool->client_pid << " uid=" << spec.caller.uid
                  << " session=" << spec.caller.session << " peer=\"" << LogSafe(spec.peer)
                  << "\" namespace=" << ns.hex_id << " desc=\"" << LogSafe(ns.desc.CanonicalText())
                  << "\" bytes_per_token=" << out.encoded_bytes_per_token
                  << " capacity_tokens=" << out.capacity_tokens;
    return out;
  } catch (const std::bad_alloc&) {
    return OutOfMemory("RegisterPool");
  }
}

StatusOr<std::shared_ptr<CacheCore::Pool>> CacheCore::FindPool(uint64_t pool_id,
                                                               const Caller& caller,
                                                               bool admin_may) const {
  MutexLock lock(&mu_);
  auto it = pools_.find(pool_id);
  // Another caller's pool reads exactly as an unknown one: no oracle of which ids exist.
  if (it == pools_.end() || !((admin_may && caller.admin) || Owns(*it->second, caller))) {
    return NotFound(UnknownPoolText(pool_id));
  }
  return it->second;
}

Status CacheCore::ReleasePool(uint64_t pool_id, const Caller& caller) {
  std::shared_ptr<Pool> pool;
  {
    MutexLock lock(&mu_);
    auto it = pools_.find(pool_id);
    if (it == pools_.end() || !(caller.admin || Owns(*it->second, caller))) {
      return NotFound(UnknownPoolText(pool_id));
    }
    pool = std::move(it->second);
    pools_.erase(it);
  }
  {
    MutexLock lock(&pool->mu);
    pool->released = true;  // a request that found the pool just before cannot begin now
  }
  // Queued work stops touching the engine's buffers and events (CUDA), and a HOST task waiting
  // for an event of this pool stops now, so its pins and its worker are freed. Work already on
  // the device completes: the mappings are closed only after it did (docs/design.md "Completion:
  // ticket slots and event rules": the engine may free its buffers once this returns OK).
  pool->binding->Cancel();
  const auto t0 = std::chrono::steady_clock::now();
  bool drained;
  {
    MutexLock lock(&pool->mu);
    drained = pool->idle_cv.WaitFor(&pool->mu, options_.release_timeout,
                                    [&]() REQUIRES(pool->mu) { return pool->outstanding == 0; });
    if (!drained) pool->close_when_idle = true;
  }
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  if (!drained) {
    HIQ_LOG(WARN) << "event=release_pool_pending pool=" << pool_id
                  << " waited_ms=" << waited.count()
                  << " (device work still pending: its mappings and events stay open until it "
                     "completes)";
    return DeadlineExceeded(
        "pool_id: pool " + std::to_string(pool_id) +
        " is released, but its device work was "
        "still pending after " +
        std::to_string(options_.release_timeout.count()) +
        " ms (a wait_event never completed?): its buffers and events stay open until that work "
        "completes, so the engine must not free them yet");
  }
  pool->binding->Close();
  RetirePool(*pool);
  SweepNamespaces();
  HIQ_LOG(INFO) << "event=release_pool pool=" << pool_id << " waited_ms=" << waited.count();
  return Status::Ok();
}

size_t CacheCore::ReleasePoolsOfClient(uint32_t pid) {
  std::vector<uint64_t> ids;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, pool] : pools_) {
      if (pool->client_pid == pid) ids.push_back(id);
    }
  }
  Caller daemon;
  daemon.admin = true;
  for (uint64_t id : ids) (void)ReleasePool(id, daemon);
  if (!ids.empty()) {
    HIQ_LOG(INFO) << "event=client_exit pid=" << pid << " pools_released=" << ids.size();
  }
  return ids.size();
}

size_t CacheCore::ReleasePoolsOfSession(uint64_t session) {
  if (session == 0) return 0;
  std::vector<uint64_t> ids;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, pool] : pools_) {
      if (pool->owner.session == session) ids.push_back(id);
    }
  }
  Caller daemon;
  daemon.admin = true;
  for (uint64_t id : ids) (void)ReleasePool(id, daemon);
  if (!ids.empty()) {
    HIQ_LOG(INFO) << "event=session_closed session=" << session << " pools_released=" << ids.size();
  }
  return ids.size();
}

size_t CacheCore::PromoteFromL3(const Pool& pool, std::span<const BlockKey> keys) {
  const uint64_t payload_bytes = pool.layout.BlockBytes();
  std::vector<L3Block> fetched = options_.l3->Fetch(pool.ns->hash, payload_bytes, keys);
  if (fetched.empty()) return 0;
  auto res = store_->ReserveWrites(pool.ns->id, keys.first(fetched.size()));
  size_t run = 0, promoted = 0;
  bool whole = true;
  for (size_t j = 0; j < res.size(); ++j) {
    switch (res[j].outcome) {
      case BlockStore::WriteOutcome::kReserved:
        std::memcpy(res[j].payload, fetched[j].payload(), payload_bytes);
        store_->CommitWrite(res[j].handle, fetched[j].payload_checksum, /*from_l3=*/true);
        ++promoted;
        break;
      case BlockStore::WriteOutcome::kPresent:  // a concurrent backup or promotion
        break;
      case BlockStore::WriteOutcome::kNoSpace:
        whole = false;
        break;
    }
    if (whole) ++run;
  }
  options_.l3->CountPromoted(promoted);
  HIQ_LOG(DEBUG) << "event=l3_promote pool=" << pool.id << " fetched=" << fetched.size()
                 << " promoted=" << promoted;
  return run;
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
  try {
    std::vector<NamespaceDesc> descs;
    descs.reserve(spec.namespaces.size());
    for (size_t i = 0; i < spec.namespaces.size(); ++i) {
      HIQ_ASSIGN_OR_RETURN(
          NamespaceDesc desc,
          ValidateNamespace(spec.namespaces[i], options_.limits, store_->CapacityBytes(),
                            "namespaces[" + std::to_string(i) + "]."));
      descs.push_back(Scoped(std::move(desc), spec.caller));
    }
    std::shared_ptr<Pool> pool;
    if (spec.pool_id != 0) {
      HIQ_ASSIGN_OR_RETURN(pool, FindPool(spec.pool_id, spec.caller));
    }
    HIQ_ASSIGN_OR_RETURN(std::vector<BlockKey> k, CheckedKeys(spec.keys));
    // The whole request is valid: only now may resolving a ref adopt a rebuilt namespace.
    std::vector<uint32_t> ids;
    ids.reserve(descs.size() + 1);
    for (const NamespaceDesc& desc : descs) {
      auto ns = FindOrAdoptNamespace(desc);
      ids.push_back(ns != nullptr ? ns->id : kNoNamespace);  // unknown = holds nothing
    }
    if (pool != nullptr) ids.push_back(pool->ns->id);
    uint32_t prefix = store_->LookupPrefix(ids, k);
    if (options_.l3 != nullptr && prefix < k.size()) {
      // L3 can only extend the pool's answer: its errors and deadline are a shorter run.
      std::vector<NamespaceHash> hashes;
      hashes.reserve(descs.size() + 1);
      for (const NamespaceDesc& desc : descs) hashes.push_back(desc.Hash());
      if (pool != nullptr) hashes.push_back(pool->ns->hash);
      std::sort(hashes.begin(), hashes.end());
      hashes.erase(std::unique(hashes.begin(), hashes.end()), hashes.end());
      prefix += options_.l3->Probe(hashes, std::span<const BlockKey>(k).subspan(prefix));
    }
    return prefix;
  } catch (const std::bad_alloc&) {
    return OutOfMemory("Lookup");
  }
}

std::shared_ptr<const NamespaceInfo> CacheCore::FindOrAdoptNamespace(const NamespaceDesc& desc) {
  if (auto ns = namespaces_.Find(desc)) return ns;
  // After a warm restart the pool's blocks sit under namespaces nobody registered yet. A
  // scheduler's lookup must see them before any of its workers registers again (they register
  // when they load), so a ref that names such blocks adopts them as RegisterPool would. Any
  // other ref creates nothing: lookups of arbitrary namespaces cost no memory. Adoptions are
  // bounded by the namespaces the rebuild found; racing a RegisterPool of the same namespace is
  // harmless (Acquire and AddNamespace are idempotent).
  if (!store_->HoldsOrphan(desc.Hash(), desc.layout.BlockBytes())) return nullptr;
  // Held while the store adopts, so that no sweep removes it in between; released at once (it
  // stays while the pool holds its blocks).
  std::shared_ptr<const NamespaceInfo> ns = namespaces_.Acquire(desc);
  if (store_->AddNamespace(ns->ForStore())) {
    HIQ_LOG(INFO) << "event=adopt_namespace by=lookup namespace=" << ns->hex_id << " desc=\""
                  << LogSafe(desc.CanonicalText()) << "\"";
  }
  if (namespaces_.Release(ns->id, [this](uint32_t id) { return store_->RemoveNamespace(id); })) {
    NamespaceRemoved(*ns);  // its blocks went meanwhile
  }
  return ns;
}

StatusOr<uint32_t> CacheCore::Lookup(uint64_t pool_id, const std::vector<std::string>& keys,
                                     const Caller& caller) {
  LookupSpec spec;
  spec.pool_id = pool_id;
  spec.keys = keys;
  spec.caller = caller;
  return Lookup(spec);
}

StatusOr<uint32_t> CacheCore::Evict(uint64_t pool_id, const std::vector<std::string>& keys,
                                    const Caller& caller) {
  if (draining()) return Unavailable("hiqcached is shutting down");
  try {
    HIQ_ASSIGN_OR_RETURN(auto pool, FindPool(pool_id, caller, /*admin_may=*/true));
    HIQ_ASSIGN_OR_RETURN(std::vector<BlockKey> k, CheckedKeys(keys));
    const uint32_t n = store_->Evict(pool->ns->id, k);
    return n;
  } catch (const std::bad_alloc&) {
    return OutOfMemory("Evict");
  }
}

StatusOr<std::shared_ptr<CacheCore::Pool>> CacheCore::PoolForTransfer(const TransferSpec& spec,
                                                                      bool restore) const {
  if (draining()) return Unavailable("hiqcached is shutting down");
  HIQ_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, FindPool(spec.pool_id, spec.caller));
  // A pool whose client memory broke (PoolBinding::Failure) fails every later request up front,
  // asynchronous ones included.
  HIQ_RETURN_IF_ERROR(pool->binding->Failure());
  HIQ_RETURN_IF_ERROR(ValidateTransfer(spec, pool->layout, pool->binding->num_rows(),
                                       pool->binding->event_count(), restore, options_.limits));
  return pool;
}

void CacheCore::Backup(TransferSpec spec, BackupDone done) {
  try {
    BackupImpl(std::move(spec), &done);
  } catch (const std::bad_alloc&) {
    // Thrown before anything was queued or charged (BackupImpl allocates first), and before
    // `done` was moved from.
    if (done) done(OutOfMemory("Backup"));
  }
}

void CacheCore::BackupImpl(TransferSpec spec, BackupDone* done) {
  auto found = PoolForTransfer(spec, /*restore=*/false);
  if (!found.ok()) return (*done)(found.status());
  std::shared_ptr<Pool> pool = std::move(found).value();

  auto req = std::make_shared<BackupRequest>();
  req->pool = pool;
  const size_t n = spec.blocks.size();
  req->keys = KeysOf(spec.blocks, n);
  req->result.results.assign(n, BlockResult::kStored);
  {
    // A key repeated within the request is reserved (and written) once.
    std::unordered_set<BlockKey, KeyHash> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (seen.insert(req->keys[i]).second) {
        req->unique.push_back(i);
      } else {
        req->result.results[i] = BlockResult::kAlreadyPresent;
      }
    }
  }
  req->device = pool->binding->SignalsOnDevice();
  const size_t per_task = req->device ? req->unique.size() : ChunkBlocks(pool->layout);
  if (std::min(per_task, req->unique.size()) > options_.quotas.max_reserved_slots_per_client) {
    return (*done)(ResourceExhausted(
        "blocks: this backup reserves " + std::to_string(req->unique.size()) +
        " pool slots at once, more than the " +
        std::to_string(options_.quotas.max_reserved_slots_per_client) +
        " a client may hold (quota max_reserved_slots_per_client): split the request"));
  }
  if (req->device) {
    req->chunks.emplace_back(0, req->unique.size());
  } else {
    // HOST: the wait for wait_event is a sub-task of its own, so that no slot is reserved before
    // the engine's data is there.
    req->gated = spec.wait_event >= 0;
    if (req->gated) req->chunks.emplace_back(0, 0);
    for (const auto& r : Ranges(req->unique.size(), per_task)) req->chunks.push_back(r);
  }
  req->pending_bytes = SaturatingMul(req->unique.size(), InputBlockBytes(pool->layout));
  req->sync = spec.sync;
  std::vector<TransferEngine::StepTask> steps;
  steps.reserve(req->chunks.size());
  for (size_t c = 0; c < req->chunks.size(); ++c) {
    steps.push_back([this, req, c, task = std::shared_ptr<BackupTask>()]() mutable {
      return BackupStep(req, c, &task);
    });
  }
  req->reply = std::make_shared<BackupDone>();

  // Nothing below throws before the work is posted, except PostSteps (then nothing is queued).
  Status st = quotas_.ChargePending(pool->client, req->pending_bytes);
  if (!st.ok()) return (*done)(st);
  if (!pool->BeginTask()) {
    quotas_.UnchargePending(pool->client, req->pending_bytes);
    return (*done)(ReleasedPool(spec.pool_id));
  }
  *req->reply = std::move(*done);
  req->spec = std::move(spec);
  {
    MutexLock lock(&pool->post_mu);
    req->result.ticket = ++pool->next_ticket;
    if (!req->sync) {
      // Accepted: see cache_core.h (Reservations) for what BLOCK_STORED means here.
      req->replied = true;
      (*req->reply)(req->result);
    }
    engine_.PostSteps(pool->strand, std::move(steps));
  }
}

// The reservations of one backup sub-task, shared by its callbacks.
struct BackupChunkWrites {
  std::vector<BlockStore::WriteReservation> reservations;
  std::vector<size_t> index;  // request index of each reserved block
  bool settled = false;       // committed or aborted
};

TransferEngine::StepResult CacheCore::BackupStep(const std::shared_ptr<BackupRequest>& req,
                                                 size_t c, std::shared_ptr<BackupTask>* slot) {
  Pool& pool = *req->pool;
  const bool last = c + 1 == req->chunks.size();
  const TransferSpec& spec = req->spec;
  std::shared_ptr<BackupChunkWrites> writes;
  try {
    if (!req->has_started) {
      req->started = std::chrono::steady_clock::now();
      req->has_started = true;
    }
    if (*slot == nullptr) {
      auto task = std::make_shared<BackupTask>();
      task->ticket = req->result.ticket;
      task->caller_deadline = spec.deadline;
      task->defer = DeferOnStrand(pool.strand);
      BackupTask* raw = task.get();
      if (!req->error.ok()) {
        // An earlier sub-task failed: the rest reserve and read nothing; the last one still
        // releases done_event, with the failure bit.
        if (!last) return TransferEngine::StepResult::kDone;
        if (spec.done_event < 0) {
          FinishBackup(req);
          return TransferEngine::StepResult::kDone;
        }
        task->wait_event = ProbeEvent(spec);
        task->wait_value = kNeverValue;
        task->first_try = LongAgo();
        task->done_event = spec.done_event;
        task->on_written = [](const std::vector<uint8_t>&, const Status&) {};
        task->on_complete = [this, req](const Status&) { FinishBackup(req); };
      } else if (req->gated && c == 0) {
        task->wait_event = spec.wait_event;
        task->wait_value = spec.wait_value;
        task->on_written = [](const std::vector<uint8_t>&, const Status&) {};
        task->on_complete = [req](const Status& run) {
          if (!run.ok() && req->error.ok()) req->error = run;
        };
      } else {
        const auto [b, e] = req->chunks[c];
        if (!quotas_.MayReserve(pool.client, e - b)) return TransferEngine::StepResult::kNotReady;
        task->wait_event = req->device ? spec.wait_event : -1;  // HOST: the gate waited
        task->wait_value = spec.wait_value;
        task->done_event = last ? spec.done_event : -1;
        std::vector<BlockKey> keys;
        keys.reserve(e - b);
        for (size_t j = b; j < e; ++j) keys.push_back(req->keys[req->unique[j]]);
        writes = std::make_shared<BackupChunkWrites>();
        writes->index.reserve(e - b);
        task->payloads.reserve(e - b);
        task->rows.reserve((e - b) * pool.layout.block_tokens);
        // Reserved now that the task starts: a backup still waiting holds no slot.
        auto res = store_->ReserveWrites(pool.ns->id, keys);
        for (size_t j = 0; j < res.size(); ++j) {
          const size_t i = req->unique[b + j];
          switch (res[j].outcome) {
            case BlockStore::WriteOutcome::kReserved:
              writes->index.push_back(i);
              writes->reservations.push_back(res[j]);
              task->payloads.push_back(res[j].payload);
              task->rows.insert(task->rows.end(), spec.blocks[i].rows.begin(),
                                spec.blocks[i].rows.end());
              break;
            case BlockStore::WriteOutcome::kPresent:
              req->result.results[i] = BlockResult::kAlreadyPresent;
              break;
            case BlockStore::WriteOutcome::kNoSpace:
              req->result.results[i] = BlockResult::kRejected;
              break;
          }
        }
        const int64_t reserved = static_cast<int64_t>(writes->reservations.size());
        quotas_.AddReserved(pool.client, reserved);
        BlockStore* store = store_;
        const size_t payload_bytes = pool.layout.BlockBytes();
        const uint64_t client = pool.client;
        // The callbacks live in the task: they hold a raw pointer to it, never a reference that
        // would make the task own itself. The backend keeps the task alive while it calls them.
        L3Tier* l3 = options_.l3;
        task->on_written = [this, store, l3, req, writes, payload_bytes, raw, client, reserved](
                               const std::vector<uint8_t>& nonfinite, const Status& st) {
          if (writes->settled) return;
          writes->settled = true;
          const std::vector<uint64_t>& sums = raw->checksums;
          for (size_t j = 0; j < writes->reservations.size(); ++j) {
            const auto& r = writes->reservations[j];
            if (!st.ok() || j >= nonfinite.size() || nonfinite[j]) {
              store->AbortWrite(r.handle, /*rejected=*/st.ok());
              req->result.results[writes->index[j]] = BlockResult::kRejected;
              continue;
            }
            store->CommitWrite(r.handle,
                               j < sums.size() ? sums[j] : XXH3_64bits(r.payload, payload_bytes));
            ++req->moved;
            if (l3 != nullptr) {
              const NamespaceInfo& ns = *req->pool->ns;
              l3->Published(ns.id, ns.hash, payload_bytes, req->keys[writes->index[j]]);
            }
          }
          quotas_.AddReserved(client, -reserved);
        };
        task->on_complete = [this, req, writes, last, raw](const Status& run) {
          if (!writes->settled) {
            // The backend ended the task without on_written: nothing of it is valid.
            raw->on_written(std::vector<uint8_t>(writes->reservations.size(), 0),
                            run.ok() ? Status(StatusCode::kInternal, "no payloads written") : run);
          }
          if (!run.ok() && req->error.ok()) req->error = run;
          if (last) FinishBackup(req);
        };
      }
      *slot = std::move(task);
    }
    std::shared_ptr<BackupTask> task = *slot;
    return StepOf(pool.binding->StartBackup(task));
  } catch (const std::exception& ex) {
    Status threw = TaskThrew("Backup", pool.id, req->result.ticket, ex);
    if (req->error.ok()) req->error = threw;
    if (*slot != nullptr && (*slot)->on_complete) {
      // Settles the sub-task's reservations (and, for the last one, finishes the request).
      std::shared_ptr<BackupTask> task = *slot;
      task->on_complete(req->error);
    } else if (writes != nullptr && !writes->settled) {
      writes->settled = true;
      for (const auto& r : writes->reservations) store_->AbortWrite(r.handle, false);
      quotas_.AddReserved(pool.client, -static_cast<int64_t>(writes->reservations.size()));
    }
    if (last) FinishBackup(req);
    return TransferEngine::StepResult::kDone;
  }
}

void CacheCore::FinishBackup(const std::shared_ptr<BackupRequest>& req) {
  if (req->finished) return;
  req->finished = true;
  Pool& pool = *req->pool;
  const Status& run = req->error;
  CoreObserver* observer = options_.observer;
  if (observer != nullptr && req->moved > 0) {
    observer->OnTransfer(SampleOf(*pool.ns, pool.layout, /*restore=*/false, req->moved,
                                  std::chrono::steady_clock::now() - req->started, run.ok()));
  }
  pool.backups.fetch_add(req->moved, std::memory_order_relaxed);
  if (!run.ok()) {
    HIQ_LOG(WARN) << "event=backup_failed pool=" << pool.id << " ticket=" << req->result.ticket
                  << " code=" << StatusCodeName(run.code()) << " error=\"" << LogSafe(run.message())
                  << "\"";
  }
  if (!req->replied) {
    req->replied = true;
    if (run.ok())
      (*req->reply)(req->result);
    else
      (*req->reply)(run);
  }
  quotas_.UnchargePending(pool.client, req->pending_bytes);
  pool.EndTask();
}

void CacheCore::Restore(TransferSpec spec, RestoreDone done) {
  try {
    RestoreImpl(std::move(spec), &done);
  } catch (const std::bad_alloc&) {
    if (done) done(OutOfMemory("Restore"));
  }
}

void CacheCore::RestoreImpl(TransferSpec spec, RestoreDone* done) {
  // Also refuses a restore that names a row twice: its cost is bounded by the rows it writes.
  auto found = PoolForTransfer(spec, /*restore=*/true);
  if (!found.ok()) return (*done)(found.status());
  std::shared_ptr<Pool> pool = std::move(found).value();

  auto req = std::make_shared<RestoreRequest>();
  req->pool = pool;
  std::vector<BlockKey> keys = KeysOf(spec.blocks, spec.blocks.size());
  {
    // A key named twice is restored once: the leading run ends before its second occurrence
    // (the engine recomputes the rest, as for a missing block).
    std::unordered_set<BlockKey, KeyHash> seen;
    seen.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!seen.insert(keys[i]).second) {
        keys.resize(i);
        break;
      }
    }
  }
  req->device = pool->binding->SignalsOnDevice();
  req->sync = spec.sync;
  const uint64_t per_block = InputBlockBytes(pool->layout);
  req->pending_bytes = SaturatingMul(keys.size(), per_block);
  req->pins.reserve(keys.size());
  req->reply = std::make_shared<RestoreDone>();
  Status st = quotas_.ChargePending(pool->client, req->pending_bytes);
  if (!st.ok()) return (*done)(st);
  if (!pool->BeginTask()) {
    quotas_.UnchargePending(pool->client, req->pending_bytes);
    return (*done)(ReleasedPool(spec.pool_id));
  }
  std::vector<TransferEngine::StepTask> steps;
  try {
    // Pinned on arrival: the answer says how many leading blocks will be restored.
    req->pins = store_->PinReads(pool->ns->id, keys);
    if (options_.l3 != nullptr && req->pins.size() < keys.size()) {
      // The blocks after the pool's run come from L3 into the pool, then are restored from the
      // pool as any other block (same tasks, same events).
      const size_t have = req->pins.size();
      const std::span<const BlockKey> rest = std::span<const BlockKey>(keys).subspan(have);
      if (PromoteFromL3(*pool, rest) > 0) {
        std::vector<BlockStore::ReadPin> more = store_->PinReads(pool->ns->id, rest);
        req->pins.insert(req->pins.end(), more.begin(), more.end());
      }
    }
    const uint64_t pinned_bytes = SaturatingMul(req->pins.size(), per_block);
    quotas_.UnchargePending(pool->client, req->pending_bytes - pinned_bytes);
    req->pending_bytes = pinned_bytes;
    req->chunks = req->device ? Ranges(req->pins.size(), std::max<size_t>(1, req->pins.size()))
                              : Ranges(req->pins.size(), ChunkBlocks(pool->layout));
    steps.reserve(req->chunks.size());
    for (size_t c = 0; c < req->chunks.size(); ++c) {
      steps.push_back([this, req, c, task = std::shared_ptr<RestoreTask>()]() mutable {
        return RestoreStep(req, c, &task);
      });
    }
  } catch (const std::bad_alloc&) {
    for (const auto& p : req->pins) store_->Unpin(p.handle);
    quotas_.UnchargePending(pool->client, req->pending_bytes);
    pool->EndTask();
    return (*done)(OutOfMemory("Restore"));
  }
  req->result.restored_blocks = static_cast<uint32_t>(req->pins.size());
  *req->reply = std::move(*done);
  req->spec = std::move(spec);
  MutexLock lock(&pool->post_mu);
  req->result.ticket = ++pool->next_ticket;
  if (!req->sync) {
    req->replied = true;
    (*req->reply)(req->result);
  }
  engine_.PostSteps(pool->strand, std::move(steps));
}

TransferEngine::StepResult CacheCore::RestoreStep(const std::shared_ptr<RestoreRequest>& req,
                                                  size_t c, std::shared_ptr<RestoreTask>* slot) {
  Pool& pool = *req->pool;
  const bool last = c + 1 == req->chunks.size();
  const TransferSpec& spec = req->spec;
  const auto [b, e] = req->chunks[c];
  // Drops the pins of this sub-task once: the device has finished reading those payloads (or
  // never will), so they may be evicted from now on.
  auto unpin = [this, req, b = b, e = e] {
    for (size_t j = b; j < e; ++j) {
      if (req->pins[j].handle != nullptr) store_->Unpin(req->pins[j].handle);
      req->pins[j].handle = nullptr;
    }
  };
  try {
    if (!req->has_started) {
      req->started = std::chrono::steady_clock::now();
      req->has_started = true;
    }
    if (*slot == nullptr) {
      auto task = std::make_shared<RestoreTask>();
      task->ticket = req->result.ticket;
      task->caller_deadline = spec.deadline;
      task->defer = DeferOnStrand(pool.strand);
      if (!req->error.ok()) {
        // An earlier sub-task failed: the rest write nothing; the last one still releases the
        // layer events and done_event, with the failure bit.
        unpin();
        if (!last) return TransferEngine::StepResult::kDone;
        if (spec.done_event < 0 && spec.layer_event_base < 0) {
          FinishRestore(req);
          return TransferEngine::StepResult::kDone;
        }
        task->wait_event = ProbeEvent(spec);
        task->wait_value = kNeverValue;
        task->first_try = LongAgo();
        task->layer_event_base = spec.layer_event_base;
        task->done_event = spec.done_event;
        task->on_complete = [this, req](const Status&) { FinishRestore(req); };
      } else {
        // The first sub-task waits for wait_event; the last signals the layer and done events.
        task->wait_event = c == 0 ? spec.wait_event : -1;
        task->wait_value = spec.wait_value;
        task->layer_event_base = last ? spec.layer_event_base : -1;
        task->done_event = last ? spec.done_event : -1;
        task->payloads.reserve(e - b);
        task->rows.reserve((e - b) * pool.layout.block_tokens);
        for (size_t j = b; j < e; ++j) {
          task->payloads.push_back(req->pins[j].payload);
          task->rows.insert(task->rows.end(), spec.blocks[j].rows.begin(),
                            spec.blocks[j].rows.end());
        }
        task->on_complete = [this, req, unpin, last, n = e - b](const Status& run) {
          unpin();
          if (run.ok())
            req->restored += n;
          else if (req->error.ok())
            req->error = run;
          if (last) FinishRestore(req);
        };
      }
      *slot = std::move(task);
    }
    std::shared_ptr<RestoreTask> task = *slot;
    return StepOf(pool.binding->StartRestore(task));
  } catch (const std::exception& ex) {
    Status threw = TaskThrew("Restore", pool.id, req->result.ticket, ex);
    if (req->error.ok()) req->error = threw;
    unpin();
    if (last) FinishRestore(req);
    return TransferEngine::StepResult::kDone;
  }
}

void CacheCore::FinishRestore(const std::shared_ptr<RestoreRequest>& req) {
  if (req->finished) return;
  req->finished = true;
  Pool& pool = *req->pool;
  const Status& run = req->error;
  // Pins of sub-tasks that never ran (an exception) go now.
  for (auto& p : req->pins) {
    if (p.handle != nullptr) store_->Unpin(p.handle);
    p.handle = nullptr;
  }
  CoreObserver* observer = options_.observer;
  if (observer != nullptr && !req->pins.empty()) {
    observer->OnTransfer(SampleOf(*pool.ns, pool.layout, /*restore=*/true, req->pins.size(),
                                  std::chrono::steady_clock::now() - req->started, run.ok()));
  }
  pool.restores.fetch_add(req->restored, std::memory_order_relaxed);
  if (!run.ok()) {
    HIQ_LOG(WARN) << "event=restore_failed pool=" << pool.id << " ticket=" << req->result.ticket
                  << " code=" << StatusCodeName(run.code()) << " error=\"" << LogSafe(run.message())
                  << "\"";
  }
  if (!req->replied) {
    req->replied = true;
    if (run.ok())
      (*req->reply)(req->result);
    else
      (*req->reply)(run);
  }
  quotas_.UnchargePending(pool.client, req->pending_bytes);
  pool.EndTask();
}

std::vector<uint32_t> CacheCore::ClientPids() const {
  std::vector<uint32_t> pids;
  MutexLock lock(&mu_);
  for (const auto& [id, pool] : pools_) {
    if (pool->client_pid != 0) pids.push_back(pool->client_pid);
  }
  std::sort(pids.begin(), pids.end());
  pids.erase(std::unique(pids.begin(), pids.end()), pids.end());
  return pids;
}

CoreSnapshot CacheCore::Snapshot(const Caller& caller, uint32_t ns_offset, uint32_t ns_limit) {
  SweepNamespaces();
  CoreSnapshot snap;
  snap.store = store_->Stats();
  snap.uptime_seconds = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start_)
          .count());
  std::map<uint32_t, uint32_t> pools_per_ns;
  std::map<std::pair<uint32_t, std::string>, int> clients;
  // Who uses the node is not a stranger's business: an admin sees every pool and namespace, an
  // authenticated caller the pools of its uid (under namespace_scope = pod: of its uid and pod)
  // and the namespaces of its scope or with such a pool, an anonymous caller (no session, e.g.
  // TCP) the totals only.
  const bool by_pod = options_.namespace_scope == NamespaceScope::kPod;
  const auto mine = [&caller, by_pod](const Pool& pool) {
    return caller.admin ||
           (caller.authenticated() && pool.owner.authenticated() && pool.owner.uid == caller.uid &&
            (!by_pod || pool.owner.pod == caller.pod));
  };
  std::set<uint32_t> namespaces_of_mine;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, pool] : pools_) {
      pools_per_ns[pool->ns->id] += 1;
      if (pool->binding != nullptr) snap.faulted_bytes += pool->binding->FaultedBytes();
      clients[{pool->client_pid, pool->client_pid == 0 ? pool->peer : std::string()}] = 1;
      if (!mine(*pool)) continue;
      namespaces_of_mine.insert(pool->ns->id);
      PoolSnapshot p;
      p.owned = Owns(*pool, caller);
      // Another caller's pool id is what would let this caller use it: not shown.
      p.pool_id = p.owned || caller.admin ? id : 0;
      p.namespace_id = pool->ns->hex_id;
      p.model = pool->ns->desc.model;
      p.tenant = pool->ns->desc.tenant;
      p.cuda = pool->cuda;
      p.client_pid = pool->client_pid;
      p.uid = pool->owner.uid;
      p.peer = pool->peer;
      p.backups = pool->backups.load();
      p.restores = pool->restores.load();
      p.faulted_bytes = pool->binding != nullptr ? pool->binding->FaultedBytes() : 0;
      snap.pools.push_back(std::move(p));
    }
  }
  snap.clients = clients.size();
  snap.staging_device_bytes = cuda_ != nullptr ? cuda_->StagingDeviceBytes() : 0;
  if (options_.l3 != nullptr) snap.l3 = options_.l3->Stats();
  std::vector<std::shared_ptr<const NamespaceInfo>> all = namespaces_.All();
  if (!caller.admin) {
    const std::string scope = caller.authenticated() ? Scoped({}, caller).scope : std::string();
    std::erase_if(all, [&](const std::shared_ptr<const NamespaceInfo>& ns) {
      if (!caller.authenticated()) return true;
      return !(namespaces_of_mine.count(ns->id) != 0 ||
               (!scope.empty() && ns->desc.scope == scope));
    });
  }
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a->hex_id < b->hex_id; });
  snap.namespaces_total = static_cast<uint32_t>(all.size());
  const size_t first = std::min<size_t>(ns_offset, all.size());
  const size_t end = first + std::min<size_t>(ns_limit, all.size() - first);
  for (size_t i = first; i < end; ++i) {
    const NamespaceInfo& ns = *all[i];
    NamespaceSnapshot n;
    n.namespace_id = ns.hex_id;
    n.model = ns.desc.model;
    n.tenant = ns.desc.tenant;
    n.codec = ns.desc.layout.row.codec;
    n.encoded_bytes_per_token = ns.desc.layout.BytesPerToken();
    n.pools = pools_per_ns[ns.id];
    auto it = snap.store.namespaces.find(ns.id);
    if (it != snap.store.namespaces.end()) n.counters = it->second;
    snap.namespaces.push_back(std::move(n));
  }
  return snap;
}

}  // namespace hiqcache::server
