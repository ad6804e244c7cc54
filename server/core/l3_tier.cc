#include "l3_tier.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "hiqcache/log.h"

#ifdef HIQ_HAVE_L3
#include "l3_value.h"
#include "redis_cluster.h"
#endif

namespace hiqcache::server {

#ifdef HIQ_HAVE_L3
const uint8_t* L3Block::payload() const {
  return reinterpret_cast<const uint8_t*>(value.data()) + l3::kL3ValueHeaderBytes;
}

bool L3Available() { return true; }

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
  RedisL3Tier(const L3Options& o, BlockStore* store) : o_(o), store_(store) {
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
  }

  ~RedisL3Tier() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    open_cv_.notify_all();
    queue_cv_.notify_all();
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
    auto conn = TakeReader();
    if (conn == nullptr) {
      Add(&lookup_errors_, 1);
      Add(&lookup_misses_, keys.size());
      return 0;
    }
    std::vector<l3::KeyResult> res = conn->MultiExists(all, deadline);
    GiveReader(std::move(conn));
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
    auto conn = TakeReader();
    if (conn == nullptr) {
      Add(&fetch_errors_, 1);
      Finished(Clock::now() - t0, false);
      return out;
    }
    std::vector<std::string> names = KeysOf(o_.key_prefix, ns, keys);
    std::vector<l3::KeyResult> res = conn->MultiGet(names, deadline);
    GiveReader(std::move(conn));
    bool ok = true;
    uint64_t in = 0;
    for (size_t i = 0; i < res.size(); ++i) {
      if (!res[i].status.ok()) {
        ok = false;
        Add(&fetch_errors_, 1);
        break;
      }
      if (!res[i].found) break;
      in += res[i].value.size();
      auto payload = l3::DecodeL3Value(res[i].value, ns, keys[i], payload_bytes);
      if (!payload.ok()) {
        Add(&corrupt_values_, 1);
        HIQ_LOG(WARN) << "event=l3_value_dropped key=\"" << LogSafe(names[i]) << "\" error=\""
                      << LogSafe(payload.status().message()) << "\"";
        break;
      }
      l3::L3ValueHeader h;
      std::memcpy(&h, res[i].value.data(), sizeof(h));
      L3Block b;
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
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.size() + 1 > o_.write_queue_blocks ||
          queue_bytes_ + payload_bytes > o_.write_queue_bytes) {
        ++dropped_writes_;
        return;
      }
      queue_.push_back(WriteItem{ns_id, ns, payload_bytes, key});
      queue_bytes_ += payload_bytes;
    }
    queue_cv_.notify_one();
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
    std::lock_guard<std::mutex> lock(mu_);
    s.dropped_writes = dropped_writes_;
    s.write_queue_bytes = queue_bytes_;
    s.write_queue_blocks = queue_.size();
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
    uint32_t ns_id;
    NamespaceHash ns;
    uint64_t payload_bytes;
    BlockKey key;
  };

  // A fetch ended: its duration goes to the metrics' callback and to the latency window.
  void Finished(Clock::duration d, bool ok) {
    if (o_.on_fetch) o_.on_fetch(d, ok);
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(d).count();
    const uint32_t v = static_cast<uint32_t>(std::clamp<int64_t>(us, 0, UINT32_MAX));
    std::lock_guard<std::mutex> lock(mu_);
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
  static uint64_t Get(const std::atomic<uint64_t>& c) {
    return c.load(std::memory_order_relaxed);
  }

  // An idle reader, or null (none open yet, or all busy: the opener is asked for one more).
  std::unique_ptr<l3::RedisCluster> TakeReader() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) {
      auto c = std::move(idle_.back());
      idle_.pop_back();
      return c;
    }
    if (readers_ + want_ < o_.max_readers) {
      ++want_;
      open_cv_.notify_one();
    }
    return nullptr;
  }
  void GiveReader(std::unique_ptr<l3::RedisCluster> c) {
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(std::move(c));
  }

  // Keeps min_readers connections open (more on demand), retrying every second while the
  // cluster is unreachable.
  void OpenerLoop() {
    bool logged = false;
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      const bool need = readers_ < std::max<uint32_t>(1, o_.min_readers) || want_ > 0;
      if (!need) {
        open_cv_.wait(lock);
        continue;
      }
      lock.unlock();
      auto opened = l3::RedisCluster::Open(cluster_options_);
      lock.lock();
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
          HIQ_LOG(WARN) << "event=l3_unreachable error=\""
                        << LogSafe(opened.status().message())
                        << "\" (lookups and restores answer from L2 only; retrying)";
          logged = true;
        }
        want_ = 0;
        open_cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stop_; });
      }
    }
  }

  void WriterLoop() {
    std::unique_ptr<l3::RedisCluster> conn;
    Clock::time_point retry_at{};
    for (;;) {
      WriteItem item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        queue_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        item = queue_.front();
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
        continue;
      }
      uint64_t tag;
      std::memcpy(&tag, item.ns.data(), sizeof(tag));
      BlockStore::ReadPin pin;
      uint64_t checksum = 0;
      if (!store_->PinCommitted(item.ns_id, item.key, tag, &pin, &checksum)) {
        Add(&skipped_writes_, 1);
        continue;
      }
      std::string value;
      try {
        value = l3::EncodeL3Value(item.ns, item.key,
                                  std::span<const uint8_t>(pin.payload, item.payload_bytes),
                                  checksum);
      } catch (const std::bad_alloc&) {
        store_->Unpin(pin.handle);
        Add(&write_errors_, 1);
        continue;
      }
      store_->Unpin(pin.handle);
      const std::string name = l3::L3Key(o_.key_prefix, item.ns, item.key);
      Status st = conn->Set(name, value, o_.ttl, Clock::now() + o_.command_timeout * 2);
      if (st.ok()) {
        Add(&writes_, 1);
        Add(&bytes_out_, value.size());
      } else {
        Add(&write_errors_, 1);
        HIQ_LOG(DEBUG) << "event=l3_write_failed error=\"" << LogSafe(st.message()) << "\"";
      }
    }
  }

  const L3Options o_;
  BlockStore* const store_;
  l3::RedisClusterOptions cluster_options_;

  std::atomic<uint64_t> lookup_hits_{0}, lookup_misses_{0}, lookup_errors_{0};
  std::atomic<uint64_t> fetches_{0}, fetched_blocks_{0}, fetch_errors_{0}, corrupt_values_{0};
  std::atomic<uint64_t> promotions_{0}, writes_{0}, write_errors_{0}, skipped_writes_{0};
  std::atomic<uint64_t> bytes_in_{0}, bytes_out_{0};

  mutable std::mutex mu_;
  bool stop_ = false;                                    // GUARDED_BY(mu_)
  std::vector<std::unique_ptr<l3::RedisCluster>> idle_;  // GUARDED_BY(mu_)
  uint32_t readers_ = 0;                                 // GUARDED_BY(mu_): opened
  uint32_t want_ = 0;                                    // GUARDED_BY(mu_): asked for
  std::condition_variable open_cv_;
  std::deque<WriteItem> queue_;  // GUARDED_BY(mu_)
  uint64_t queue_bytes_ = 0;     // GUARDED_BY(mu_)
  uint64_t dropped_writes_ = 0;  // GUARDED_BY(mu_)
  std::vector<uint32_t> fetch_us_;  // GUARDED_BY(mu_): the last fetches' durations, a ring
  size_t fetch_next_ = 0;           // GUARDED_BY(mu_): the ring's next slot
  std::condition_variable queue_cv_;

  std::thread opener_;
  std::vector<std::thread> writers_;
};

}  // namespace

StatusOr<std::unique_ptr<L3Tier>> CreateRedisL3Tier(const L3Options& options, BlockStore* store) {
  if (options.seeds.empty()) return InvalidArgument("l3_seeds: no seed given");
  return std::unique_ptr<L3Tier>(new RedisL3Tier(options, store));
}

#else  // !HIQ_HAVE_L3

const uint8_t* L3Block::payload() const {
  return reinterpret_cast<const uint8_t*>(value.data()) + 64;
}

bool L3Available() { return false; }

StatusOr<std::unique_ptr<L3Tier>> CreateRedisL3Tier(const L3Options&, BlockStore*) {
  return FailedPrecondition(
      "l3_seeds: this hiqcached was built without the L3 store (hiredis, libhiredis-dev, was "
      "not found at build time): unset l3_seeds or rebuild with hiredis");
}

#endif  // HIQ_HAVE_L3

}  // namespace hiqcache::server
