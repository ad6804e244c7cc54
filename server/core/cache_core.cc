#include "core/cache_core.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <unordered_set>

#include "core/cache_core_internal.h"
#include "hiqcache/log.h"

namespace hiqcache::server {

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
  // An anonymous pool (allow_anonymous) belongs to every anonymous caller, to no authenticated one.
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
    pool->restore_strand =
        pool->binding->SignalsOnDevice() ? engine_.NewStrand(pool->client) : pool->strand;
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
