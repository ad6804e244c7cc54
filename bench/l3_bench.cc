// l3_bench: restores from L3 (a real 3-master, 3-replica Redis Cluster on loopback) through a real
// hiqcached, against restores of the same blocks from the pool (L2) and against reading the same
// values from Redis directly, in one run; and Lookup latency for keys that miss L2 with L3 on
// (held by L3, or by nobody) and off (a second daemon without L3).
//
// Qwen3-8B geometry (36x8x128 BF16), 64-token blocks, INT8 per head. Each rep evicts the prefix
// from the pool (Evict RPC), so that the next Restore fetches every block from L3, verifies it,
// promotes it into the pool and restores it (the L3 path); the Restore after it is served by the
// pool (the L2 path). Then the same values are read from Redis: pipelined per node with
// RedisCluster::MultiGet (what the daemon's fetch does) and with one plain hiredis GET per key
// (redisCommand, sequential). Rates are GB/s of BF16-equivalent bytes (what the engine's KV
// occupies), as in e2e_bench; the wire figure counts the value bytes Redis sent.
//
// Then: backups into a full pool (every backup evicts as much as it stores) on three daemons
// with the same small pool, L3 off / write_through / on_evict, against each other in the same
// run; and a master killed while restores from L3 run back to back (time until restores are
// whole again, the short restores meanwhile).
//
// Usage: l3_bench [--tokens N] [--reps N] [--pool-bytes SIZE] [--lookups N]
//                 [--fetch-deadline-ms N] [--lookup-deadline-ms N] [--evict-pool-blocks N]
// Without --fetch-deadline-ms the daemon runs with its default fetch deadline and command
// timeout, so a run also checks that a 2,048-token restore from L3 fits them; with it, both are
// set to N.
#include <hiredis/hiredis.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon_process.h"
#include "gaussian_kv.h"
#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "l3/l3_value.h"
#include "l3/redis_cluster.h"
#include "redis_test_cluster.h"

namespace {

namespace l3 = ::hiqcache::server::l3;
using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  size_t i = static_cast<size_t>(std::ceil(p * v.size()));
  i = i == 0 ? 0 : i - 1;
  return v[std::min(i, v.size() - 1)];
}
double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

int Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "l3_bench: %s: %s\n", what, detail.c_str());
  return 1;
}

// One plain hiredis connection per master port.
struct PlainConnections {
  std::map<int, redisContext*> by_port;
  ~PlainConnections() {
    for (auto& [port, c] : by_port) redisFree(c);
  }
  redisContext* At(int port) {
    auto it = by_port.find(port);
    if (it != by_port.end()) return it->second;
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port, timeval{2, 0});
    if (c == nullptr || c->err != 0) return nullptr;
    redisSetTimeout(c, timeval{10, 0});
    by_port[port] = c;
    return c;
  }
};

// What the value format costs per block, in this process (no cluster): encode and verify of one
// block's value without and with the fleet MAC (HMAC-SHA-256), medians of `reps`, against a
// memcpy of the payload measured in the same run.
void ValueFormatCost(size_t payload_bytes, uint32_t reps) {
  std::vector<uint8_t> payload(payload_bytes);
  for (size_t i = 0; i < payload.size(); ++i)
    payload[i] = static_cast<uint8_t>(i * 2654435761u >> 24);
  hiqcache::NamespaceHash ns{};
  hiqcache::BlockKey key{};
  const l3::L3MacKeys mac{std::string(32, 'k'), ""};
  const uint64_t checksum = l3::L3Checksum(payload);
  std::string value;
  std::vector<uint8_t> copy(payload_bytes);
  std::vector<double> t_copy, t_enc, t_enc_mac, t_dec, t_dec_mac;
  for (uint32_t r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    std::memcpy(copy.data(), payload.data(), payload_bytes);
    t_copy.push_back(Seconds(Clock::now() - t0));
    t0 = Clock::now();
    l3::EncodeL3ValueInto(ns, key, payload, checksum, &value);
    t_enc.push_back(Seconds(Clock::now() - t0));
    t0 = Clock::now();
    const bool ok = l3::DecodeL3Value(value, ns, key, payload_bytes).ok();
    t_dec.push_back(Seconds(Clock::now() - t0));
    t0 = Clock::now();
    l3::EncodeL3ValueInto(ns, key, payload, checksum, &value, &mac);
    t_enc_mac.push_back(Seconds(Clock::now() - t0));
    t0 = Clock::now();
    const bool ok_mac = l3::DecodeL3Value(value, ns, key, payload_bytes, &mac).ok();
    t_dec_mac.push_back(Seconds(Clock::now() - t0));
    if (!ok || !ok_mac) std::fprintf(stderr, "l3_bench: a value did not verify\n");
  }
  const double mb = payload_bytes / 1e6;
  std::printf("value format, one block of %.2f MB (payload), medians of %u:\n", mb, reps);
  auto row = [&](const char* what, const std::vector<double>& t) {
    std::printf("  %-40s %8.1f us  %6.2f GB/s  %5.2fx memcpy\n", what, Median(t) * 1e6,
                mb / 1e3 / Median(t), Median(t_copy) / Median(t));
  };
  row("memcpy of the payload", t_copy);
  row("encode (header + XXH3 given + copy)", t_enc);
  row("encode with HMAC-SHA-256 (l3_mac_key_file)", t_enc_mac);
  row("verify (XXH3 of the payload)", t_dec);
  row("verify with HMAC-SHA-256 + XXH3", t_dec_mac);
  std::printf("  MAC cost per block: encode +%.1f us, verify +%.1f us\n",
              (Median(t_enc_mac) - Median(t_enc)) * 1e6, (Median(t_dec_mac) - Median(t_dec)) * 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t tokens = 2048, reps = 7, lookups = 200, fetch_deadline_ms = 0,  // 0: the default
      lookup_deadline_ms = 5, evict_pool_blocks = 48, format_only = 0, mac = 0;
  std::string pool_bytes = "1GiB";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const uint32_t v = a == "--pool-bytes" ? 0 : static_cast<uint32_t>(std::stoul(argv[i + 1]));
    if (a == "--tokens")
      tokens = v;
    else if (a == "--reps")
      reps = v;
    else if (a == "--lookups")
      lookups = v;
    else if (a == "--fetch-deadline-ms")
      fetch_deadline_ms = v;
    else if (a == "--lookup-deadline-ms")
      lookup_deadline_ms = v;
    else if (a == "--evict-pool-blocks")
      evict_pool_blocks = v;
    else if (a == "--pool-bytes")
      pool_bytes = argv[i + 1];
    else if (a == "--format-only")
      format_only = v;
    else if (a == "--mac")
      mac = v;
  }
  const uint32_t block_tokens = 64;
  tokens = std::max(block_tokens, tokens / block_tokens * block_tokens);
  const uint32_t blocks = tokens / block_tokens;
  // Qwen3-8B int8: 74,880 bytes per token.
  ValueFormatCost(size_t{74880} * block_tokens, std::max(reps, 21u));
  if (format_only != 0) return 0;

  using hiqcache::l3_test::RedisTestCluster;
  if (!RedisTestCluster::Available()) return Fail("redis", "redis-server / redis-cli not found");
  RedisTestCluster cluster;
  if (std::string err = cluster.Start(); !err.empty()) return Fail("cluster", err);
  std::string seeds;
  for (const auto& s : cluster.Seeds()) seeds += (seeds.empty() ? "" : ",") + s;

  // A: L3 on. C: L3 off (Lookup latency of the same misses without L3).
  std::vector<std::string> l3_flags = {"--l3-seeds", seeds, "--l3-lookup-deadline-ms",
                                       std::to_string(lookup_deadline_ms)};
  if (fetch_deadline_ms != 0) {
    for (const char* f : {"--l3-fetch-deadline-ms", "--l3-command-timeout-ms"}) {
      l3_flags.push_back(f);
      l3_flags.push_back(std::to_string(fetch_deadline_ms));
    }
  }
  // --mac 1: the L3 daemon authenticates its values (l3_mac_key_file, a key made here).
  const std::string key_file = "/tmp/hiq-l3-bench-" + std::to_string(::getpid()) + ".mac";
  if (mac != 0) {
    FILE* f = std::fopen(key_file.c_str(), "wb");
    if (f == nullptr) return Fail("mac", "cannot write " + key_file);
    std::fputs("l3-bench-fleet-key-of-at-least-32-bytes", f);
    std::fclose(f);
    ::chmod(key_file.c_str(), 0600);
    l3_flags.push_back("--l3-mac-key-file");
    l3_flags.push_back(key_file);
  }
  hiqcache::testing::DaemonProcess a(pool_bytes, l3_flags);
  hiqcache::testing::DaemonProcess c("256MiB");
  const bool started = a.Start();
  if (mac != 0) ::unlink(key_file.c_str());  // read at start-up
  if (!started) return Fail("hiqcached", "the L3 daemon did not start");
  if (!c.Start()) return Fail("hiqcached", "the daemon without L3 did not start");
  hiqcache::ClientOptions co;
  co.call_timeout = std::chrono::seconds(60);
  co.target = a.target();
  auto ca = hiqcache::Client::Connect(co);
  co.target = c.target();
  auto cc = hiqcache::Client::Connect(co);
  if (!ca.ok() || !cc.ok()) return Fail("connect", "client");

  // Rows [0, tokens) are backed up, rows [tokens, 2*tokens) receive the restores.
  auto kv = hiqcache::bench::GaussianQwen3Kv(2 * tokens, tokens);
  if (!kv.ok()) return Fail("kv", kv.status().ToString());
  const hiqcache::Geometry& g = kv->geometry();
  auto spec = hiqcache::MakeHostPoolSpec("Qwen/Qwen3-8B@l3bench", *kv, block_tokens);
  auto pa = (*ca)->RegisterPool(spec);
  auto pc = (*cc)->RegisterPool(spec);
  if (!pa.ok()) return Fail("register", pa.status().ToString());
  if (!pc.ok()) return Fail("register (no L3)", pc.status().ToString());
  auto info = (*ca)->PoolInfo(*pa);
  if (!info.ok()) return Fail("pool info", info.status().ToString());

  std::vector<uint32_t> src_rows(tokens), dst_rows(tokens);
  for (uint32_t i = 0; i < tokens; ++i) {
    src_rows[i] = i;
    dst_rows[i] = tokens + i;
  }
  std::vector<uint32_t> token_ids(tokens), other_ids(tokens);
  for (uint32_t i = 0; i < tokens; ++i) {
    token_ids[i] = 1000003u + i;
    other_ids[i] = 7000003u + i;
  }
  const auto keys = hiqcache::ComputeBlockKeys(token_ids, block_tokens, "l3");
  const auto absent = hiqcache::ComputeBlockKeys(other_ids, block_tokens, "l3");  // never stored

  // The values' names and their masters, from the namespace id (its first 16 bytes, hex).
  hiqcache::NamespaceHash ns{};
  for (int i = 0; i < 16; ++i) {
    ns[i] = static_cast<uint8_t>(std::stoul(info->namespace_id.substr(2 * i, 2), nullptr, 16));
  }
  std::vector<std::string> names;
  std::vector<int> master_port;
  for (const auto& k : keys) {
    hiqcache::BlockKey lk;
    std::memcpy(lk.data(), k.data(), 16);
    names.push_back(l3::L3Key("hiq:", ns, lk));
    const auto* m = cluster.MasterOfSlot(l3::KeySlot(names.back()));
    if (m == nullptr) return Fail("cluster", "no master for " + names.back());
    master_port.push_back(m->port);
  }
  l3::RedisClusterOptions ro;
  ro.seeds = cluster.Seeds();
  ro.command_timeout = std::chrono::milliseconds(10000);
  ro.default_deadline = std::chrono::milliseconds(30000);
  auto rc = l3::RedisCluster::Open(ro);
  if (!rc.ok()) return Fail("RedisCluster", rc.status().ToString());
  PlainConnections plain;

  // Backup once; wait until every block is in L3 (the write-through queue drains).
  auto br = (*ca)->Backup(*pa, keys, src_rows);
  if (!br.status.ok() || br.held() != blocks) return Fail("backup", br.status.ToString());
  const auto wait_end = Clock::now() + std::chrono::seconds(120);
  for (;;) {
    auto ex = rc->MultiExists(names);
    size_t found = 0;
    for (const auto& r : ex) found += r.status.ok() && r.found;
    if (found == names.size()) break;
    if (Clock::now() > wait_end) return Fail("write-through", "blocks never reached L3");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  const double bf16_bytes = double(tokens) * g.BytesPerToken();
  std::vector<uint8_t> src(static_cast<size_t>(bf16_bytes)), dst(src.size());
  std::memset(src.data(), 1, src.size());
  std::memset(dst.data(), 2, dst.size());
  std::vector<double> t_memcpy, t_l3, t_l2, t_mget, t_get, t_pipe;
  std::vector<double> t1_l3, t1_l2, t1_get;
  uint64_t value_bytes = 0;
  const std::span<const hiqcache::BlockKey> first(keys.data(), 1);
  const std::span<const uint32_t> first_rows(dst_rows.data(), block_tokens);
  for (uint32_t rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), src.size());
    t_memcpy.push_back(Seconds(Clock::now() - t0));

    auto ev = (*ca)->Evict(*pa, keys);
    if (!ev.ok() || *ev != blocks) return Fail("evict", ev.status().ToString());
    t0 = Clock::now();
    auto r3 = (*ca)->Restore(*pa, keys, dst_rows);
    t_l3.push_back(Seconds(Clock::now() - t0));
    if (!r3.status.ok() || r3.restored_blocks != blocks) {
      return Fail("L3 restore", r3.status.ToString() + ", restored " +
                                    std::to_string(r3.restored_blocks) + " of " +
                                    std::to_string(blocks) + " (raise --fetch-deadline-ms?)");
    }
    t0 = Clock::now();
    auto r2 = (*ca)->Restore(*pa, keys, dst_rows);
    t_l2.push_back(Seconds(Clock::now() - t0));
    if (!r2.status.ok() || r2.restored_blocks != blocks) return Fail("L2 restore", "short");

    t0 = Clock::now();
    auto got = rc->MultiGet(names);
    t_mget.push_back(Seconds(Clock::now() - t0));
    value_bytes = 0;
    for (const auto& r : got) {
      if (!r.status.ok() || !r.found) return Fail("MultiGet", r.status.ToString());
      value_bytes += r.value.size();
    }
    got.clear();
    t0 = Clock::now();
    for (size_t i = 0; i < names.size(); ++i) {
      redisContext* ctx = plain.At(master_port[i]);
      if (ctx == nullptr) return Fail("hiredis", "connect");
      auto* reply =
          static_cast<redisReply*>(redisCommand(ctx, "GET %b", names[i].data(), names[i].size()));
      if (reply == nullptr || reply->type != REDIS_REPLY_STRING) return Fail("GET", names[i]);
      freeReplyObject(reply);
    }
    t_get.push_back(Seconds(Clock::now() - t0));
    // The same GETs pipelined per master (every master's batch sent before any reply is read),
    // over plain hiredis: RedisCluster::MultiGet without the cluster client around it.
    t0 = Clock::now();
    std::map<int, size_t> sent;
    for (size_t i = 0; i < names.size(); ++i) {
      redisAppendCommand(plain.At(master_port[i]), "GET %b", names[i].data(), names[i].size());
      ++sent[master_port[i]];
    }
    for (auto& [port, n] : sent) {
      for (size_t j = 0; j < n; ++j) {
        void* raw = nullptr;
        if (redisGetReply(plain.At(port), &raw) != REDIS_OK || raw == nullptr ||
            static_cast<redisReply*>(raw)->type != REDIS_REPLY_STRING) {
          return Fail("pipelined GET", std::to_string(port));
        }
        freeReplyObject(raw);
      }
    }
    t_pipe.push_back(Seconds(Clock::now() - t0));

    // One block: the latency of the smallest restore from each tier.
    for (int i = 0; i < 10; ++i) {
      if (auto e = (*ca)->Evict(*pa, first); !e.ok() || *e != 1) return Fail("evict", "1");
      t0 = Clock::now();
      auto s3 = (*ca)->Restore(*pa, first, first_rows);
      t1_l3.push_back(Seconds(Clock::now() - t0));
      t0 = Clock::now();
      auto s2 = (*ca)->Restore(*pa, first, first_rows);
      t1_l2.push_back(Seconds(Clock::now() - t0));
      if (s3.restored_blocks != 1 || s2.restored_blocks != 1) return Fail("restore", "1 block");
      t0 = Clock::now();
      auto* reply = static_cast<redisReply*>(
          redisCommand(plain.At(master_port[0]), "GET %b", names[0].data(), names[0].size()));
      t1_get.push_back(Seconds(Clock::now() - t0));
      if (reply == nullptr || reply->type != REDIS_REPLY_STRING) return Fail("GET", names[0]);
      freeReplyObject(reply);
    }
  }

  // Lookup of `blocks` keys that miss L2, interleaved so that the kinds share the machine's state.
  if (auto e = (*ca)->Evict(*pa, keys); !e.ok()) return Fail("evict", e.status().ToString());
  std::vector<double> l_l3_held, l_l3_absent, l_off, l_l2;
  uint32_t short_answers = 0;
  for (uint32_t i = 0; i < lookups; ++i) {
    auto t0 = Clock::now();
    auto x = (*ca)->Lookup(*pa, keys);  // L3 holds all of them
    l_l3_held.push_back(Seconds(Clock::now() - t0));
    short_answers += x.prefix_blocks != blocks;
    t0 = Clock::now();
    auto y = (*ca)->Lookup(*pa, absent);  // nobody holds them
    l_l3_absent.push_back(Seconds(Clock::now() - t0));
    t0 = Clock::now();
    auto z = (*cc)->Lookup(*pc, keys);  // no L3
    l_off.push_back(Seconds(Clock::now() - t0));
    if (!x.status.ok() || !y.status.ok() || !z.status.ok() || y.prefix_blocks != 0 ||
        z.prefix_blocks != 0) {
      return Fail("lookup", "unexpected answer");
    }
  }
  auto rr = (*ca)->Restore(*pa, keys, dst_rows);  // back into L2: the L2-hit reference
  if (rr.restored_blocks != blocks) return Fail("restore", "before the L2 lookups");
  for (uint32_t i = 0; i < lookups; ++i) {
    auto t0 = Clock::now();
    auto x = (*ca)->Lookup(*pa, keys);
    l_l2.push_back(Seconds(Clock::now() - t0));
    if (x.prefix_blocks != blocks) return Fail("lookup", "L2 miss");
  }

  const double gb = bf16_bytes / 1e9;
  const double m = Median(t_memcpy);
  auto row = [&](const char* what, const std::vector<double>& t) {
    const double med = Median(t);
    std::printf("  %-36s %8.1f ms  %6.2f GB/s BF16-eq  %6.2f GB/s wire  %5.2fx memcpy\n", what,
                med * 1e3, gb / med, value_bytes / 1e9 / med, m / med);
  };
  auto lat = [](const char* what, const std::vector<double>& t) {
    std::printf("  %-36s p50 %8.1f us  p99 %8.1f us\n", what, Percentile(t, 0.5) * 1e6,
                Percentile(t, 0.99) * 1e6);
  };
  std::printf(
      "l3_bench: %u tokens of Qwen3-8B (36x8x128 BF16), %u blocks of %u tokens, int8 "
      "(%llu B/token stored), %.1f MB BF16, %.1f MB of values; 3+3 Redis Cluster on "
      "loopback; medians of %u reps; fetch deadline %s; values %s\n",
      tokens, blocks, block_tokens, static_cast<unsigned long long>(info->encoded_bytes_per_token),
      bf16_bytes / 1e6, value_bytes / 1e6, reps,
      fetch_deadline_ms == 0 ? "the daemon's default"
                             : (std::to_string(fetch_deadline_ms) + " ms").c_str(),
      mac != 0 ? "authenticated (HMAC-SHA-256)" : "checksummed only");
  std::printf("  memcpy of the BF16 bytes (1 thread)  %8.1f ms  %6.2f GB/s\n", m * 1e3, gb / m);
  row("Restore from L3 (evicted from L2)", t_l3);
  row("Restore from L2 (the same blocks)", t_l2);
  row("RedisCluster::MultiGet (pipelined)", t_mget);
  row("plain hiredis GET, one per key", t_get);
  row("plain hiredis GET, pipelined", t_pipe);
  std::printf("  L3 restore / L2 restore: %.2fx the time; L3 restore / MultiGet: %.2fx\n",
              Median(t_l3) / Median(t_l2), Median(t_l3) / Median(t_mget));
  std::printf("one block (%u tokens), %zu samples:\n", block_tokens, t1_l3.size());
  lat("Restore from L3", t1_l3);
  lat("Restore from L2", t1_l2);
  lat("plain hiredis GET", t1_get);
  std::printf("Lookup of %u keys that miss L2, %u each (L3 lookup deadline %u ms):\n", blocks,
              lookups, lookup_deadline_ms);
  lat("L3 on, all held by L3", l_l3_held);
  lat("L3 on, held by nobody", l_l3_absent);
  lat("L3 off (second daemon)", l_off);
  lat("reference: L2 hit (L3 not asked)", l_l2);
  std::printf("  short answers (L3 deadline or error): %u of %u\n", short_answers, lookups);

  // Backups into a full pool, by write policy: every backup evicts as many blocks as it stores.
  // Three daemons with the same small pool: L3 off, write_through, on_evict (whose evictions
  // copy each evicted block into the write queue under the pool's lock). Fresh keys per rep,
  // the arms interleaved; the first reps fill the pools and are not counted.
  {
    const uint64_t slot_bytes = info->encoded_bytes_per_token * block_tokens + 64;
    const std::string small = std::to_string(evict_pool_blocks * slot_bytes + (8u << 20));
    std::vector<std::string> wt = l3_flags, oe = l3_flags;
    oe.insert(oe.end(), {"--l3-write-policy", "on_evict"});
    // on_evict with nothing listening at its seed: the evicted blocks are copied into the queue
    // as always, and the writers drop them at once. What the copy alone costs the backup, without
    // the SETs and the Redis servers competing for this machine's cores.
    std::vector<std::string> oe_dead = {"--l3-seeds", "127.0.0.1:1", "--l3-write-policy",
                                        "on_evict"};
    hiqcache::testing::DaemonProcess e_off(small), e_wt(small, wt), e_oe(small, oe),
        e_copy(small, oe_dead);
    if (!e_off.Start() || !e_wt.Start() || !e_oe.Start() || !e_copy.Start()) {
      return Fail("hiqcached", "evict arms");
    }
    struct Arm {
      const char* name;
      hiqcache::testing::DaemonProcess* d;
      std::unique_ptr<hiqcache::Client> c;
      hiqcache::PoolHandle p{};
      std::vector<double> t;
    };
    std::vector<Arm> arms;
    arms.push_back({"L3 off", &e_off, nullptr, {}, {}});
    arms.push_back({"write_through", &e_wt, nullptr, {}, {}});
    arms.push_back({"on_evict", &e_oe, nullptr, {}, {}});
    arms.push_back({"on_evict, no L3", &e_copy, nullptr, {}, {}});
    for (Arm& arm : arms) {
      co.target = arm.d->target();
      auto cl = hiqcache::Client::Connect(co);
      if (!cl.ok()) return Fail("connect", arm.name);
      arm.c = std::move(cl).value();
      auto ph = arm.c->RegisterPool(spec);
      if (!ph.ok()) return Fail("register", ph.status().ToString());
      arm.p = *ph;
    }
    const uint32_t fill = (evict_pool_blocks + blocks - 1) / blocks + 1;
    for (uint32_t rep = 0; rep < fill + reps; ++rep) {
      std::vector<uint32_t> ids(tokens);
      for (uint32_t i = 0; i < tokens; ++i) ids[i] = 20000003u + rep * tokens + i;
      const auto fresh = hiqcache::ComputeBlockKeys(ids, block_tokens, "l3-evict");
      for (size_t k = 0; k < arms.size(); ++k) {
        Arm& arm = arms[(rep + k) % arms.size()];
        const auto t0 = Clock::now();
        auto b = arm.c->Backup(arm.p, fresh, src_rows);
        const double dt = Seconds(Clock::now() - t0);
        if (!b.status.ok() || b.held() != blocks) return Fail("backup", arm.name);
        if (rep >= fill) arm.t.push_back(dt);
        // The arm's writers drain before the next arm runs, so that no arm is measured against
        // another's L3 traffic (a backup-heavy engine would not wait: the queue's bound then
        // drops writes, counted).
        const auto drain_end = Clock::now() + std::chrono::seconds(30);
        for (;;) {
          auto st = arm.c->GetStats();
          if (!st.ok() || st->l3.write_queue_blocks == 0 || Clock::now() > drain_end) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the last SETs in flight
      }
    }
    const double off = Median(arms[0].t);
    std::printf(
        "Backup of %u blocks into a full pool (%u blocks), by L3 write policy, medians of "
        "%u:\n",
        blocks, evict_pool_blocks, reps);
    for (Arm& arm : arms) {
      auto st = arm.c->GetStats();
      uint64_t ev = 0;
      if (st.ok()) {
        for (const auto& n : st->namespaces) ev += n.evictions;
      }
      const double med = Median(arm.t);
      std::printf(
          "  %-16s %8.1f ms  %6.2f GB/s BF16-eq  %5.2fx L3 off;  evicted %llu, spilled "
          "%llu, written %llu, dropped %llu\n",
          arm.name, med * 1e3, gb / med, med / off, static_cast<unsigned long long>(ev),
          static_cast<unsigned long long>(st.ok() ? st->l3.spilled_blocks : 0),
          static_cast<unsigned long long>(st.ok() ? st->l3.writes : 0),
          static_cast<unsigned long long>(st.ok() ? st->l3.dropped_writes : 0));
      (void)arm.c->ReleasePool(arm.p);
    }
    e_off.Stop();
    e_wt.Stop();
    e_oe.Stop();
    e_copy.Stop();
  }

  // A master killed while restores from L3 run back to back: per restore, how many blocks came
  // back and how long it took, until restores are whole again after the cluster failed over.
  {
    const auto masters = cluster.Masters();
    std::vector<double> before, during, after;
    uint32_t partial = 0, wrong_rounds = 0, whole_after = 0;
    Clock::time_point killed_at{}, whole_at{};
    bool killed = false;
    const auto give_up = Clock::now() + std::chrono::seconds(60);
    for (uint32_t round = 0; Clock::now() < give_up; ++round) {
      if (!killed && round == 5) {
        cluster.Kill(*masters[0]);
        killed = true;
        killed_at = Clock::now();
      }
      if (auto e = (*ca)->Evict(*pa, keys); !e.ok()) return Fail("evict", "failover");
      const auto t0 = Clock::now();
      auto r = (*ca)->Restore(*pa, keys, dst_rows);
      const double dt = Seconds(Clock::now() - t0);
      if (!r.status.ok()) ++wrong_rounds;  // an error reaching the engine (never expected)
      const bool whole = r.status.ok() && r.restored_blocks == blocks;
      if (!killed) {
        before.push_back(dt);
      } else if (whole_at == Clock::time_point{}) {
        if (whole) {
          whole_at = Clock::now();
          after.push_back(dt);
          ++whole_after;
        } else {
          during.push_back(dt);
          ++partial;
        }
      } else {
        after.push_back(dt);
        whole_after += whole;
        if (after.size() >= 5) break;
      }
    }
    auto st = (*ca)->GetStats();
    std::printf(
        "A master killed during back-to-back %u-block restores from L3 (cluster node "
        "timeout 1 s):\n",
        blocks);
    std::printf("  before: %zu restores, p50 %.1f ms\n", before.size(), Median(before) * 1e3);
    if (whole_at == Clock::time_point{}) {
      std::printf("  restores never whole again within 60 s (%u short)\n", partial);
    } else {
      std::printf(
          "  kill -> first whole restore: %.2f s; %u short restores meanwhile (p50 %.1f "
          "ms, max %.1f ms)\n",
          Seconds(whole_at - killed_at), partial, Median(during) * 1e3,
          during.empty() ? 0.0 : *std::max_element(during.begin(), during.end()) * 1e3);
      std::printf("  after: %zu restores, %u whole, p50 %.1f ms\n", after.size(), whole_after,
                  Median(after) * 1e3);
    }
    std::printf("  errors reaching the client: %u; corrupt values: %llu\n", wrong_rounds,
                static_cast<unsigned long long>(st.ok() ? st->l3.corrupt_values : 0));
  }

  (void)(*ca)->ReleasePool(*pa);
  (void)(*cc)->ReleasePool(*pc);
  a.Stop();
  c.Stop();
  return 0;
}
