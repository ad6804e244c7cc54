#include "l3/redis_l3_tier.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <list>
#include <thread>
#include <unordered_map>

#include "hiqcache/log.h"
#include "hiqcache/mutex.h"
#include "l3/l3_value.h"
#include "l3/redis_cluster.h"

namespace hiqcache::server {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> KeysOf(const std::string& prefix, const NamespaceHash& ns,
                                std::span<const BlockKey> keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const BlockKey& k : keys) out.push_back(l3::L3Key(prefix, ns, k));
  return out;
}

// The Redis Cluster tier. Readers: a pool of RedisCluster connections for Probe and Fetch, one
// call per connection at a time, opened by the background opener thread only (so that no gRPC
// thread waits for a connect). Writers: `writer_threads` threads, each with its own connection,
// draining one bounded queue.
class RedisL3Tier final : public L3Tier {
 public:
  RedisL3Tier(const L3Options& o, BlockStore* store)
      : o_(o), mac_{o.mac_key, o.mac_previous_key}, store_(store) {
    cluster_options_.seeds = o.seeds;
    cluster_options_.user = o.user;
    cluster_options_.password = o.password;
    cluster_options_.connect_timeout = o.connect_timeout;
    cluster_options_.command_timeout = o.command_timeout;
    cluster_options_.default_deadline = o.command_timeout;
    opener_ = std::thread([this] { OpenerLoop(); });
    for (uint32_t i = 0; i < std::max<uint32_t>(1, o.writer_threads); ++i) {
      writers_.emplace_back([this] { WriterLoop(); });
    }
    if (o_.policy == L3WritePolicy::kOnEvict) {
      store_->SetEvictionSink([this](const BlockStore::EvictedBlock& b) { Evicted(b); });
    }
  }

  ~RedisL3Tier() override {
    // No eviction reaches the queue once this returns (it waits for a call in progress).
    if (o_.policy == L3WritePolicy::kOnEvict) store_->SetEvictionSink({});
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    open_cv_.NotifyAll();
    queue_cv_.NotifyAll();
    stop_cv_.NotifyAll();
    opener_.join();
    for (auto& t : writers_) t.join();
  }

  uint32_t Probe(std::span<const NamespaceHash> ns, std::span<const BlockKey> keys) override {
    if (ns.empty() || keys.empty()) return 0;
    const auto deadline = Clock::now() + o_.lookup_deadline;
    std::vector<std::string> all;
    all.reserve(ns.size() * keys.size());
    for (const NamespaceHash& h : ns) {
      for (auto& k : KeysOf(o_.key_prefix, h, keys)) all.push_back(std::move(k));
    }
    auto conn = lookup_suspension_.Suspended() ? nullptr : TakeReader();
    if (conn == nullptr) {
      Add(&lookup_errors_, 1);
      Add(&lookup_misses_, keys.size());
      return 0;
    }
    std::vector<l3::KeyResult> res = conn->MultiExists(all, deadline);
    GiveReader(std::move(conn));
    Judge(res, &lookup_suspension_);
    size_t run = keys.size();
    bool error = false;
    for (size_t n = 0; n < ns.size(); ++n) {
      size_t i = 0;
      while (i < run && res[n * keys.size() + i].status.ok() && res[n * keys.size() + i].found) {
        ++i;
      }
      if (i < run && !res[n * keys.size() + i].status.ok()) error = true;
      run = i;
    }
    if (error) Add(&lookup_errors_, 1);
    Add(&lookup_hits_, run);
    Add(&lookup_misses_, keys.size() - run);
    return static_cast<uint32_t>(run);
  }

  std::vector<L3Block> Fetch(const NamespaceHash& ns, uint64_t payload_bytes,
                             std::span<const BlockKey> keys) override {
    std::vector<L3Block> out;
    if (keys.empty()) return out;
    const auto t0 = Clock::now();
    const auto deadline = t0 + o_.fetch_deadline;
    Add(&fetches_, 1);
    auto conn = fetch_suspension_.Suspended() ? nullptr : TakeReader();
    if (conn == nullptr) {
      Add(&fetch_errors_, 1);
      Finished(Clock::now() - t0, false);
      return out;
    }
    std::vector<std::string> names = KeysOf(o_.key_prefix, ns, keys);
    // A value is exactly header + payload: anything longer is refused before it is received.
    std::vector<l3::KeyResult> res = conn->MultiGet(
        names, deadline, l3::kL3ValueHeaderBytes + payload_bytes + l3::L3TrailerBytes(&mac_));
    GiveReader(std::move(conn));
    Judge(res, &fetch_suspension_);
    bool ok = true;
    uint64_t in = 0;
    for (size_t i = 0; i < res.size(); ++i) {
      if (res[i].status.code() == StatusCode::kResourceExhausted) {
        // Longer than any value of this namespace: a foreign or corrupt value, not received.
        Add(&corrupt_values_, 1);
        HIQ_LOG(WARN) << "event=l3_value_dropped key=\"" << LogSafe(names[i]) << "\" error=\""
                      << LogSafe(res[i].status.message()) << "\"";
        break;
      }
      if (!res[i].status.ok()) {
        ok = false;
        Add(&fetch_errors_, 1);
        break;
      }
      if (!res[i].found) break;
      in += res[i].value.size();
      auto payload = l3::DecodeL3Value(res[i].value, ns, keys[i], payload_bytes, &mac_);
      if (!payload.ok()) {
        // A newer writer's format is a miss, not corruption (the L3 contract); a value that
        // fails its checksums or its MAC is counted as corrupt and never restored.
        if (payload.status().code() != StatusCode::kFailedPrecondition) {
          Add(&corrupt_values_, 1);
        }
        HIQ_LOG(WARN) << "event=l3_value_dropped key=\"" << LogSafe(names[i]) << "\" error=\""
                      << LogSafe(payload.status().message()) << "\"";
        break;
      }
      l3::L3ValueHeader h;
      std::memcpy(&h, res[i].value.data(), sizeof(h));
      L3Block b;
      b.payload_offset = l3::kL3ValueHeaderBytes;
      b.payload_checksum = h.payload_checksum;
      b.value = std::move(res[i].value);
      out.push_back(std::move(b));
    }
    Add(&bytes_in_, in);
    Add(&fetched_blocks_, out.size());
    Finished(Clock::now() - t0, ok);
    return out;
  }

  void CountPromoted(uint64_t blocks) override { Add(&promotions_, blocks); }

  void Published(uint32_t ns_id, const NamespaceHash& ns, uint64_t payload_bytes,
                 const BlockKey& key) override {
    if (o_.policy != L3WritePolicy::kWriteThrough) return;
    {
      MutexLock lock(&mu_);
      if (!RoomLocked(payload_bytes)) {
        ++dropped_writes_;
        return;
      }
      queue_.push_back(WriteItem{ns_id, ns, payload_bytes, key, {}});
      queue_bytes_ += payload_bytes;
    }
    queue_cv_.NotifyOne();
  }

  // The store's eviction sink (on_evict), called with the store's lock held: the block is encoded
  // into the queue now (one copy of its payload), or dropped when the queue has no room. The
  // room is taken under the tier's lock first, the copy made outside it.
  void Evicted(const BlockStore::EvictedBlock& b) {
    const uint64_t bytes = b.payload.size();
    {
      MutexLock lock(&mu_);
      if (stop_ || !RoomLocked(bytes)) {
        ++dropped_writes_;
        return;
      }
      queue_bytes_ += bytes;
      ++copying_;
    }
    WriteItem item{0, b.ns_hash, bytes, b.key, TakeBuffer()};
    bool ok = true;
    try {
      l3::EncodeL3ValueInto(b.ns_hash, b.key, b.payload, b.checksum, &item.value, &mac_);
    } catch (const std::bad_alloc&) {
      ok = false;
    }
    {
      MutexLock lock(&mu_);
      --copying_;
      if (ok) {
        queue_.push_back(std::move(item));
        ++spilled_blocks_;
      } else {
        queue_bytes_ -= std::min(queue_bytes_, bytes);
        ++dropped_writes_;
      }
    }
    if (ok) queue_cv_.NotifyOne();
  }

  L3Stats Stats() const override {
    L3Stats s;
    s.enabled = true;
    s.lookup_hits = Get(lookup_hits_);
    s.lookup_misses = Get(lookup_misses_);
    s.lookup_errors = Get(lookup_errors_);
    s.fetches = Get(fetches_);
    s.fetched_blocks = Get(fetched_blocks_);
    s.fetch_errors = Get(fetch_errors_);
    s.corrupt_values = Get(corrupt_values_);
    s.promotions = Get(promotions_);
    s.writes = Get(writes_);
    s.write_errors = Get(write_errors_);
    s.skipped_writes = Get(skipped_writes_);
    s.bytes_in = Get(bytes_in_);
    s.bytes_out = Get(bytes_out_);
    MutexLock lock(&mu_);
    s.dropped_writes = dropped_writes_;
    s.spilled_blocks = spilled_blocks_;
    s.write_queue_bytes = queue_bytes_;
    s.write_queue_blocks = queue_.size() + copying_;
    s.on_evict = o_.policy == L3WritePolicy::kOnEvict;
    s.budget_bytes = o_.budget_bytes;
    s.budget_deletes = Get(budget_deletes_);
    {
      MutexLock ledger_lock(&ledger_mu_);
      s.budget_used_bytes = ledger_bytes_;
    }
    std::vector<uint32_t> us = fetch_us_;  // at most kL3FetchLatencySamples: sorted here
    std::sort(us.begin(), us.end());
    s.fetch_latency_samples = us.size();
    if (!us.empty()) {
      auto at = [&us](double p) {
        const size_t i = static_cast<size_t>(p * static_cast<double>(us.size()));
        return us[std::min(i, us.size() - 1)];
      };
      s.fetch_p50_us = at(0.50);
      s.fetch_p99_us = at(0.99);
    }
    return s;
  }

 private:
  struct WriteItem {
    uint32_t ns_id;  // write_through: the block is copied out of the pool by the writer
    NamespaceHash ns;
    uint64_t payload_bytes;
    BlockKey key;
    std::string value;  // on_evict: the value, encoded at eviction
  };

  // Whether the queue has room for one more block of `bytes`.
  bool RoomLocked(uint64_t bytes) const REQUIRES(mu_) {
    return queue_.size() + copying_ + 1 <= o_.write_queue_blocks &&
           queue_bytes_ + bytes <= o_.write_queue_bytes;
  }

  // The budget's ledger: every block this tier wrote, oldest write first, with its value size
  // and expiry (TTL). Identity = namespace hash + block key (32 bytes, not the Redis key, to keep
  // the ledger small).
  using LedgerKey = std::array<uint8_t, 32>;
  struct LedgerKeyHash {
    size_t operator()(const LedgerKey& k) const {
      uint64_t a, b;
      std::memcpy(&a, k.data() + 16, 8);
      std::memcpy(&b, k.data() + 24, 8);
      return static_cast<size_t>(a ^ (b * 0x9E3779B97F4A7C15ull));
    }
  };
  struct LedgerEntry {
    LedgerKey key;
    uint64_t bytes;
    Clock::time_point expires;  // max() without a TTL
  };
  static LedgerKey LedgerKeyOf(const NamespaceHash& ns, const BlockKey& key) {
    LedgerKey k;
    std::memcpy(k.data(), ns.data(), 16);
    std::memcpy(k.data() + 16, key.data(), 16);
    return k;
  }

  // Makes room in the budget for a write of `bytes` to `key`: forgets expired entries and `key`'s
  // own earlier write, takes the bytes in flight, and returns the blocks to DEL first (oldest
  // first). False when `bytes` alone exceeds the budget (the write is dropped).
  bool ReserveBudget(const LedgerKey& key, uint64_t bytes, std::vector<LedgerKey>* victims) {
    MutexLock lock(&ledger_mu_);
    if (bytes > o_.budget_bytes) return false;
    const auto now = Clock::now();
    while (!ledger_.empty() && ledger_.front().expires <= now) ForgetLocked(ledger_.begin());
    if (auto it = ledger_index_.find(key); it != ledger_index_.end()) ForgetLocked(it->second);
    while (!ledger_.empty() && ledger_bytes_ + inflight_bytes_ + bytes > o_.budget_bytes) {
      victims->push_back(ledger_.front().key);
      ForgetLocked(ledger_.begin());
    }
    inflight_bytes_ += bytes;
    return true;
  }
  // The write of ReserveBudget ended; a written block enters the ledger.
  void EndBudget(const LedgerKey& key, uint64_t bytes, bool written) {
    MutexLock lock(&ledger_mu_);
    inflight_bytes_ -= std::min(inflight_bytes_, bytes);
    if (!written) return;
    if (auto it = ledger_index_.find(key); it != ledger_index_.end()) ForgetLocked(it->second);
    const auto expires = o_.ttl.count() > 0 ? Clock::now() + o_.ttl : Clock::time_point::max();
    ledger_.push_back(LedgerEntry{key, bytes, expires});
    ledger_index_[key] = std::prev(ledger_.end());
    ledger_bytes_ += bytes;
  }
  void ForgetLocked(std::list<LedgerEntry>::iterator it) REQUIRES(ledger_mu_) {
    ledger_bytes_ -= std::min(ledger_bytes_, it->bytes);
    ledger_index_.erase(it->key);
    ledger_.erase(it);
  }

  // A hung or unreachable cluster must not cost every call its deadline, and a slow one must
  // not be taken for dead. Lookups and fetches are judged apart (their deadlines differ: a
  // lookup's few milliseconds may pass where a fetch's seconds would not):
  //  - a call some key of which was answered ends every suspension;
  //  - a call no key of which was answered because the cluster was unreachable (a key
  //    UNAVAILABLE: refused, reset, no node for the slot) suspends lookups and fetches for a
  //    backoff of 100 ms doubling to 1 s;
  //  - a call whose every key missed its deadline counts as late: kLateCallsToSuspend late calls
  //    in a row suspend calls of that kind only (a hung cluster answers nothing at all), for a
  //    backoff of late_backoff_ms_ (at least 1 s, and twice a lookup's and a fetch's deadlines
  //    together, so that a caller alternating them pays each deadline once per backoff) doubling
  //    to 8 times that.
  // Meanwhile calls of a suspended kind answer "not held" at once (counted as errors), and the
  // first call after the backoff tries again.
  static constexpr uint32_t kLateCallsToSuspend = 2;
  struct Suspension {
    const char* what;
    std::atomic<int64_t> until{0};       // steady_clock ticks: suspended until then
    std::atomic<int64_t> backoff_ms{0};  // the current suspension's backoff; 0 = none
    std::atomic<uint32_t> late{0};       // late calls in a row

    bool Suspended() const {
      return Clock::now().time_since_epoch().count() < until.load(std::memory_order_relaxed);
    }
    void Resume() {
      late.store(0, std::memory_order_relaxed);
      if (backoff_ms.exchange(0, std::memory_order_relaxed) != 0) {
        HIQ_LOG(INFO) << "event=l3_resumed calls=" << what;
      }
    }
    void Suspend(const Status& why, int64_t min_ms, int64_t max_ms) {
      int64_t prev = backoff_ms.load(std::memory_order_relaxed);
      const int64_t next = std::clamp<int64_t>(prev * 2, min_ms, max_ms);
      if (!backoff_ms.compare_exchange_strong(prev, next, std::memory_order_relaxed)) return;
      until.store((Clock::now() + std::chrono::milliseconds(next)).time_since_epoch().count(),
                  std::memory_order_relaxed);
      if (prev == 0) {
        HIQ_LOG(WARN) << "event=l3_suspended calls=" << what << " error=\""
                      << LogSafe(why.message())
                      << "\" (no L3 node answered: these calls answer from L2 alone, retrying "
                         "with backoff)";
      }
    }
  };
  void Judge(const std::vector<l3::KeyResult>& res, Suspension* own) {
    bool answered = res.empty(), unreachable = false, late = !res.empty();
    for (const auto& r : res) {
      if (r.status.ok()) {
        answered = true;
        break;
      }
      unreachable = unreachable || r.status.code() == StatusCode::kUnavailable;
      late = late && r.status.code() == StatusCode::kDeadlineExceeded;
    }
    if (answered) {
      lookup_suspension_.Resume();
      fetch_suspension_.Resume();
      return;
    }
    if (unreachable) {
      lookup_suspension_.Suspend(res.front().status, 100, 1000);
      fetch_suspension_.Suspend(res.front().status, 100, 1000);
    } else if (late &&
               own->late.fetch_add(1, std::memory_order_relaxed) + 1 >= kLateCallsToSuspend) {
      own->Suspend(res.front().status, late_backoff_ms_, 8 * late_backoff_ms_);
    }
  }

  // A fetch ended: its duration goes to the metrics' callback and to the latency window.
  void Finished(Clock::duration d, bool ok) {
    if (o_.on_fetch) o_.on_fetch(d, ok);
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(d).count();
    const uint32_t v = static_cast<uint32_t>(std::clamp<int64_t>(us, 0, UINT32_MAX));
    MutexLock lock(&mu_);
    if (fetch_us_.size() < kL3FetchLatencySamples) {
      fetch_us_.push_back(v);
    } else {
      fetch_us_[fetch_next_] = v;
    }
    fetch_next_ = (fetch_next_ + 1) % kL3FetchLatencySamples;
  }

  static void Add(std::atomic<uint64_t>* c, uint64_t n) {
    c->fetch_add(n, std::memory_order_relaxed);
  }
  static uint64_t Get(const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); }

  // An idle reader, or null (none open yet, or all busy: the opener is asked for one more).
  std::unique_ptr<l3::RedisCluster> TakeReader() {
    MutexLock lock(&mu_);
    if (!idle_.empty()) {
      auto c = std::move(idle_.back());
      idle_.pop_back();
      return c;
    }
    if (readers_ + want_ < o_.max_readers) {
      ++want_;
      open_cv_.NotifyOne();
    }
    return nullptr;
  }
  void GiveReader(std::unique_ptr<l3::RedisCluster> c) {
    MutexLock lock(&mu_);
    idle_.push_back(std::move(c));
  }

  // Keeps min_readers connections open (more on demand), retrying every second while the
  // cluster is unreachable.
  void OpenerLoop() {
    bool logged = false;
    MutexLock lock(&mu_);
    while (!stop_) {
      const bool need = readers_ < std::max<uint32_t>(1, o_.min_readers) || want_ > 0;
      if (!need) {
        open_cv_.Wait(&mu_);
        continue;
      }
      lock.Unlock();
      auto opened = l3::RedisCluster::Open(cluster_options_);
      lock.Lock();
      if (opened.ok()) {
        if (logged || readers_ == 0) {
          HIQ_LOG(INFO) << "event=l3_connected seeds=" << o_.seeds.size();
        }
        logged = false;
        idle_.push_back(std::make_unique<l3::RedisCluster>(std::move(opened).value()));
        ++readers_;
        if (want_ > 0) --want_;
      } else {
        if (!logged) {
          HIQ_LOG(WARN) << "event=l3_unreachable error=\"" << LogSafe(opened.status().message())
                        << "\" (lookups and restores answer from L2 only; retrying)";
          logged = true;
        }
        want_ = 0;
        open_cv_.WaitFor(&mu_, std::chrono::seconds(1), [this]() REQUIRES(mu_) { return stop_; });
      }
    }
  }

  void WriterLoop() {
    // Background work: below the threads that serve engines (nice +10, this thread only). A
    // daemon without the privilege to lower it stays as it is.
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10);
    std::unique_ptr<l3::RedisCluster> conn;
    Clock::time_point retry_at{};
    for (;;) {
      WriteItem item;
      {
        MutexLock lock(&mu_);
        queue_cv_.Wait(&mu_, [this]() REQUIRES(mu_) { return stop_ || !queue_.empty(); });
        if (stop_) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        queue_bytes_ -= std::min(queue_bytes_, item.payload_bytes);
      }
      if (conn == nullptr && Clock::now() >= retry_at) {
        auto opened = l3::RedisCluster::Open(cluster_options_);
        if (opened.ok()) {
          conn = std::make_unique<l3::RedisCluster>(std::move(opened).value());
        } else {
          retry_at = Clock::now() + std::chrono::seconds(1);
        }
      }
      if (conn == nullptr) {
        Add(&write_errors_, 1);
        GiveBuffer(std::move(item.value));
        continue;
      }
      std::string value = std::move(item.value);
      if (value.empty()) {  // write_through: copy the block out of the pool now
        value = TakeBuffer();
        uint64_t tag;
        std::memcpy(&tag, item.ns.data(), sizeof(tag));
        BlockStore::ReadPin pin;
        uint64_t checksum = 0;
        if (!store_->PinCommitted(item.ns_id, item.key, tag, &pin, &checksum)) {
          Add(&skipped_writes_, 1);
          GiveBuffer(std::move(value));
          continue;
        }
        try {
          l3::EncodeL3ValueInto(item.ns, item.key,
                                std::span<const uint8_t>(pin.payload, item.payload_bytes), checksum,
                                &value, &mac_);
        } catch (const std::bad_alloc&) {
          store_->Unpin(pin.handle);
          Add(&write_errors_, 1);
          continue;
        }
        store_->Unpin(pin.handle);
      }
      Write(*conn, item, value);
      GiveBuffer(std::move(value));
    }
  }

  // Value buffers are reused (a spare list bounded by l3_write_queue_bytes), so that a block's
  // copy writes memory already faulted in: a fresh multi-MB buffer costs its page faults, which
  // on_evict would pay inside the pool's lock.
  std::string TakeBuffer() {
    MutexLock lock(&mu_);
    if (spare_.empty()) return {};
    std::string b = std::move(spare_.back());
    spare_.pop_back();
    spare_bytes_ -= std::min(spare_bytes_, uint64_t{b.capacity()});
    return b;
  }
  void GiveBuffer(std::string b) {
    if (b.capacity() == 0) return;
    MutexLock lock(&mu_);
    if (spare_bytes_ + b.capacity() > o_.write_queue_bytes) return;
    spare_bytes_ += b.capacity();
    spare_.push_back(std::move(b));
  }

  static constexpr int kWriteRetries = 3;
  // Sleeps `d` unless the tier is being destroyed; false when it is.
  bool SleepUnlessStopping(std::chrono::milliseconds d) {
    MutexLock lock(&mu_);
    return !stop_cv_.WaitFor(&mu_, d, [this]() REQUIRES(mu_) { return stop_; });
  }

  // SETs one value (within the budget, when there is one).
  void Write(l3::RedisCluster& conn, const WriteItem& item, const std::string& value) {
    const LedgerKey lkey = LedgerKeyOf(item.ns, item.key);
    const bool budgeted = o_.budget_bytes > 0;
    if (budgeted) {
      std::vector<LedgerKey> victims;
      if (!ReserveBudget(lkey, value.size(), &victims)) {
        MutexLock lock(&mu_);
        ++dropped_writes_;
        return;
      }
      for (const LedgerKey& v : victims) {
        NamespaceHash ns;
        BlockKey key;
        std::memcpy(ns.data(), v.data(), 16);
        std::memcpy(key.data(), v.data() + 16, 16);
        // A failed DEL leaves the value to its TTL or the cluster's maxmemory: the ledger has
        // forgotten it either way, so the budget can be passed by what failed to be deleted.
        auto del =
            conn.Del(l3::L3Key(o_.key_prefix, ns, key), Clock::now() + o_.command_timeout * 2);
        Add(del.ok() ? &budget_deletes_ : &write_errors_, 1);
      }
    }
    const std::string name = l3::L3Key(o_.key_prefix, item.ns, item.key);
    // A SET that timed out or found its node unreachable is tried again after 100, 200 and
    // 400 ms (SET is idempotent): under on_evict the value is the block's only copy left.
    Status st;
    for (int attempt = 0;; ++attempt) {
      st = conn.Set(name, value, o_.ttl, Clock::now() + o_.command_timeout * 2);
      const bool transient =
          st.code() == StatusCode::kDeadlineExceeded || st.code() == StatusCode::kUnavailable;
      if (st.ok() || !transient || attempt == kWriteRetries ||
          !SleepUnlessStopping(std::chrono::milliseconds(100 << attempt))) {
        break;
      }
      HIQ_LOG(DEBUG) << "event=l3_write_retry attempt=" << attempt + 1 << " error=\""
                     << LogSafe(st.message()) << "\"";
    }
    if (budgeted) EndBudget(lkey, value.size(), st.ok());
    if (st.ok()) {
      Add(&writes_, 1);
      Add(&bytes_out_, value.size());
    } else {
      Add(&write_errors_, 1);
      HIQ_LOG(DEBUG) << "event=l3_write_failed error=\"" << LogSafe(st.message()) << "\"";
    }
  }

  const L3Options o_;
  const l3::L3MacKeys mac_;
  BlockStore* const store_;
  l3::RedisClusterOptions cluster_options_;

  std::atomic<uint64_t> lookup_hits_{0}, lookup_misses_{0}, lookup_errors_{0};
  std::atomic<uint64_t> fetches_{0}, fetched_blocks_{0}, fetch_errors_{0}, corrupt_values_{0};
  std::atomic<uint64_t> promotions_{0}, writes_{0}, write_errors_{0}, skipped_writes_{0};
  std::atomic<uint64_t> bytes_in_{0}, bytes_out_{0}, budget_deletes_{0};
  const int64_t late_backoff_ms_ =
      std::max<int64_t>(1000, 2 * std::chrono::duration_cast<std::chrono::milliseconds>(
                                      o_.lookup_deadline + o_.fetch_deadline)
                                      .count());
  Suspension lookup_suspension_{"lookups"};
  Suspension fetch_suspension_{"fetches"};

  mutable Mutex mu_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<l3::RedisCluster>> idle_ GUARDED_BY(mu_);
  uint32_t readers_ GUARDED_BY(mu_) = 0;  // opened
  uint32_t want_ GUARDED_BY(mu_) = 0;     // asked for
  CondVar open_cv_;
  std::deque<WriteItem> queue_ GUARDED_BY(mu_);
  uint64_t queue_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t dropped_writes_ GUARDED_BY(mu_) = 0;
  uint64_t spilled_blocks_ GUARDED_BY(mu_) = 0;
  uint32_t copying_ GUARDED_BY(mu_) = 0;            // evicted blocks being encoded, room taken
  std::vector<std::string> spare_ GUARDED_BY(mu_);  // value buffers for reuse
  uint64_t spare_bytes_ GUARDED_BY(mu_) = 0;        // their capacity
  std::vector<uint32_t> fetch_us_ GUARDED_BY(mu_);  // the last fetches' durations, a ring
  size_t fetch_next_ GUARDED_BY(mu_) = 0;           // the ring's next slot
  CondVar queue_cv_;
  // Wakes writers sleeping between retries only when the tier stops: waiting on queue_cv_
  // there would swallow the notify_one meant for an idle writer.
  CondVar stop_cv_;

  mutable Mutex ledger_mu_ ACQUIRED_AFTER(mu_);           // never held while taking mu_
  std::list<LedgerEntry> ledger_ GUARDED_BY(ledger_mu_);  // oldest write first
  std::unordered_map<LedgerKey, std::list<LedgerEntry>::iterator, LedgerKeyHash> ledger_index_
      GUARDED_BY(ledger_mu_);
  uint64_t ledger_bytes_ GUARDED_BY(ledger_mu_) = 0;
  uint64_t inflight_bytes_ GUARDED_BY(ledger_mu_) = 0;  // reserved by writes in progress

  std::thread opener_;
  std::vector<std::thread> writers_;
};

}  // namespace

StatusOr<std::unique_ptr<L3Tier>> CreateRedisL3Tier(const L3Options& options, BlockStore* store) {
  if (options.seeds.empty()) return InvalidArgument("l3_seeds: no seed given");
  return std::unique_ptr<L3Tier>(new RedisL3Tier(options, store));
}

}  // namespace hiqcache::server
