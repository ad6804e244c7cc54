// Quotas, pinning, amplification and fairness, and namespace churn against the real daemon,
// through the real client library.
//
//   - Map exhaustion: registrations of 4,096 buffers each (one shm object named 4,096 times, each
//     its own mapping) reached the kernel's map limit in ~16 RPCs; now the client's quota
//     (max_buffers_per_client) answers RESOURCE_EXHAUSTED long before, and the daemon serves on.
//     So does max_pools_per_client for many one-buffer pools.
//   - Pinning: an async Backup whose wait_event never comes reserved its slots on arrival, so a
//     bystander's backups into the full pool were rejected; now nothing is reserved while it waits.
//   - Amplification and fairness: a restore naming one block many times over the same rows is
//     refused; an attacker saturating both workers with huge legitimate restores delays a
//     victim's one-block restore by about one sub-task, not one request: most victim restores
//     end while the attacker requests in flight at their start go on. The test prints the
//     latencies (victim p50/p90 idle and under attack) as information.
//   - Churn: thousands of register/release cycles with unique model names leave the namespace
//     count, GetStats and the daemon's RSS where they were, and registration does not slow down.
//
// HIQ_QF_DAEMON=/path/to/hiqcached runs the same scenarios against another daemon binary (e.g.
// one built before this change, to measure the "before" figure); the bounds are then only
// printed, not asserted.
//
// Callers are whatever the client library makes them: with a session (SO_PEERCRED) they are
// their uid; without one, every anonymous caller counts as one client. The test of a second uid
// (AnotherUidIsNotLimitedByTheFirst) needs sessions.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

namespace hiqcache::rob {
// The daemon binary the tests start: HIQ_QF_DAEMON if set, else this build's.
inline const char* DaemonBinary() {
  const char* other = std::getenv("HIQ_QF_DAEMON");
  return other != nullptr ? other : HIQ_DAEMON_PATH;  // this build's, expanded here
}
}  // namespace hiqcache::rob
#undef HIQ_DAEMON_PATH
#define HIQ_DAEMON_PATH ::hiqcache::rob::DaemonBinary()

#include "daemon_process.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kBt = 16;

// The daemon under test: this build's, or HIQ_QF_DAEMON's.
bool OtherDaemon() { return std::getenv("HIQ_QF_DAEMON") != nullptr; }

// DaemonProcess (of DaemonBinary()) with two transfer workers, as the default configuration.
class Daemon {
 public:
  Daemon(std::string pool_bytes, std::vector<std::string> extra = {})
      : process_(std::move(pool_bytes), Extra(std::move(extra))) {}
  bool Start() { return process_.Start(); }
  DaemonProcess& process() { return process_; }
  std::string target() const { return process_.target(); }
  pid_t pid() const { return process_.pid(); }

 private:
  static std::vector<std::string> Extra(std::vector<std::string> extra) {
    extra.push_back("--transfer-workers");
    extra.push_back("2");
    return extra;
  }
  DaemonProcess process_;
};

uint64_t MapCount(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  uint64_t n = 0;
  while (std::getline(in, line)) ++n;
  return n;
}

// A small pool: one layer, 128 rows.
it::PoolOptions SmallPool(const std::string& model) {
  it::PoolOptions o;
  o.model = model;
  o.geometry = it::Geom(1, 2, 64);
  o.num_rows = 128;
  o.block_tokens = kBt;
  return o;
}

// Backs up one block from rows [0, 16) and restores it into rows [16, 32); true when it came
// back within the bound.
bool RoundTrip(Client& client, it::TestPool& p, uint64_t seed) {
  const auto keys = it::Keys(seed, 1, kBt);
  const auto src = it::RowRange(0, kBt), dst = it::RowRange(kBt, kBt);
  it::FillRows(p.kv, seed, src, kBt);
  auto b = client.Backup(p.handle, keys, src);
  if (!b.status.ok()) return false;
  auto r = client.Restore(p.handle, keys, dst);
  if (!r.status.ok() || r.restored_blocks != 1) return false;
  return it::CheckRows(p.kv, seed, dst, kBt, /*exact=*/false).ok();
}

TEST(QuotaTest, BufferMapsPerClientAreBounded) {
  Daemon d("64MiB");
  ASSERT_TRUE(d.Start());
  auto client = it::Connect(d.target());
  ASSERT_NE(client, nullptr);
  auto base = it::MakePool(*client, SmallPool("qf/bystander"));
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  const uint64_t maps_before = MapCount(d.pid());
  // 4,094 more names of the same object: 4,096 buffers, each mapped on its own.
  PoolSpec many = base->spec;
  many.model = "qf/many-buffers";
  while (many.buffers.size() < 4096) many.buffers.push_back(base->spec.buffers[0]);
  int registered = 0;
  Status refused;
  std::vector<PoolHandle> handles;
  for (int i = 0; i < 16; ++i) {
    auto h = client->RegisterPool(many);
    if (!h.ok()) {
      refused = h.status();
      break;
    }
    handles.push_back(*h);
    ++registered;
  }
  const uint64_t maps_after = MapCount(d.pid());
  std::printf(
      "[ maps     ] %d registrations of 4096 buffers accepted, then: %s; daemon maps %lu "
      "-> %lu\n",
      registered, refused.ToString().c_str(), static_cast<unsigned long>(maps_before),
      static_cast<unsigned long>(maps_after));
  ASSERT_TRUE(d.process().running());
  if (!OtherDaemon()) {
    EXPECT_LE(registered, 2) << "no per-client bound on mapped buffers (max_buffers_per_client)";
    EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
    EXPECT_NE(refused.message().find("max_buffers_per_client"), std::string::npos)
        << refused.ToString();
    EXPECT_LT(maps_after, 20000u);
  }
  // The daemon serves on: the bystander round-trips, and released buffers are given back.
  EXPECT_TRUE(RoundTrip(*client, *base, 11));
  for (PoolHandle h : handles) EXPECT_TRUE(client->ReleasePool(h).ok());
  auto again = client->RegisterPool(many);
  EXPECT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(RoundTrip(*client, *base, 12));
}

TEST(QuotaTest, PoolsPerClientAreBounded) {
  Daemon d("64MiB");
  ASSERT_TRUE(d.Start());
  auto client = it::Connect(d.target());
  ASSERT_NE(client, nullptr);
  auto first = it::MakePool(*client, SmallPool("qf/pools"));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  std::vector<PoolHandle> handles;
  Status refused;
  for (int i = 1; i < 400; ++i) {
    auto h = client->RegisterPool(first->spec);
    if (!h.ok()) {
      refused = h.status();
      break;
    }
    handles.push_back(*h);
  }
  std::printf("[ pools    ] %zu pools registered, then: %s\n", handles.size() + 1,
              refused.ToString().c_str());
  if (!OtherDaemon()) {
    EXPECT_EQ(handles.size() + 1, 256u);  // the default max_pools_per_client
    EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
    EXPECT_NE(refused.message().find("max_pools_per_client"), std::string::npos)
        << refused.ToString();
  }
  EXPECT_TRUE(RoundTrip(*client, *first, 21));
  ASSERT_FALSE(handles.empty());
  EXPECT_TRUE(client->ReleasePool(handles.back()).ok());
  handles.pop_back();
  EXPECT_TRUE(client->RegisterPool(first->spec).ok());
}

// A caller is its uid (the kernel's, through the session): a client process of another uid
// (hiq_rob_worker's load mode, which verifies every block it restores) works while this uid is
// at its pool quota.
TEST(QuotaTest, AnotherUidIsNotLimitedByTheFirst) {
  Daemon d("64MiB", {"--socket-mode", "0666"});
  ASSERT_TRUE(d.Start());
  ::chmod(d.process().socket_path().substr(0, d.process().socket_path().rfind('/')).c_str(), 0755);
  auto client = it::Connect(d.target());
  ASSERT_NE(client, nullptr);
  auto first = it::MakePool(*client, SmallPool("qf/uid0"));
  ASSERT_TRUE(first.ok());
  for (int i = 1; i < 256; ++i) ASSERT_TRUE(client->RegisterPool(first->spec).ok()) << i;
  ASSERT_FALSE(client->RegisterPool(first->spec).ok());
  const std::string out = "/tmp/hiq-qf-uid-" + std::to_string(::getpid());
  it::SpawnResult r = it::Spawn(
      it::AsUid(61001, {HIQ_ROB_WORKER_PATH, "--target", d.target(), "--mode", "load", "--threads",
                        "2", "--seconds", "1", "--universe", "64", "--out", out}),
      std::chrono::seconds(60));
  ::unlink(out.c_str());
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find(" errors=0 corrupt=0 "), std::string::npos) << r.out;
  // Still at quota for uid 0.
  EXPECT_FALSE(client->RegisterPool(first->spec).ok());
}

TEST(PinningTest, AStalledAsyncBackupDoesNotRejectOthersBlocks) {
  // A 16 MiB pool; blocks of 8 layers x 8 heads x 128 dims x 16 tokens (260 KiB each): the
  // attacker's 64 blocks alone are more than the pool holds.
  Daemon d("16MiB", {"--wait-timeout-ms", "3000"});
  ASSERT_TRUE(d.Start());
  auto client = it::Connect(d.target());
  ASSERT_NE(client, nullptr);
  it::PoolOptions ao;
  ao.model = "qf/attacker";
  ao.geometry = it::Geom(8, 8, 128);
  ao.num_rows = 1024;
  ao.block_tokens = kBt;
  ao.event_slots = 4;
  auto attacker = it::MakePool(*client, ao);
  ASSERT_TRUE(attacker.ok()) << attacker.status().ToString();
  it::PoolOptions vo = ao;
  vo.model = "qf/victim";
  vo.num_rows = 512;
  auto victim = it::MakePool(*client, vo);
  ASSERT_TRUE(victim.ok()) << victim.status().ToString();
  const uint64_t capacity = victim->info.capacity_tokens / kBt;
  ASSERT_GT(capacity, 8u);

  const auto akeys = it::Keys(101, 64, kBt);
  const auto arows = it::RowRange(0, 64 * kBt);
  it::FillRows(attacker->kv, 101, arows, kBt);
  BackupOptions stalled;
  stalled.sync = false;
  stalled.wait_event = 0;  // never set
  stalled.wait_value = 1;
  stalled.done_event = 1;
  auto a = client->Backup(attacker->handle, akeys, arows, stalled);
  ASSERT_TRUE(a.status.ok()) << a.status.ToString();

  // The victim stores half of what the pool holds, while the attacker's backup waits.
  const uint32_t n = static_cast<uint32_t>(capacity / 2);
  const auto vkeys = it::Keys(202, n, kBt);
  const auto vrows = it::RowRange(0, n * kBt);
  it::FillRows(victim->kv, 202, vrows, kBt);
  auto v = client->Backup(victim->handle, vkeys, vrows);
  ASSERT_TRUE(v.status.ok()) << v.status.ToString();
  uint32_t rejected = 0;
  for (BlockStatus s : v.blocks) rejected += s == BlockStatus::kRejected;
  const uint32_t held = client->Lookup(victim->handle, vkeys).prefix_blocks;
  std::printf(
      "[ pinning  ] victim stored %u blocks while a stalled backup of 64 waited: %u "
      "rejected, %u held (pool: %lu blocks)\n",
      n, rejected, held, static_cast<unsigned long>(capacity));
  if (!OtherDaemon()) {
    EXPECT_EQ(rejected, 0u) << "the stalled backup's reservations kept the victim out";
    EXPECT_EQ(held, n);
  }
  // Released, the stalled backup goes without storing anything.
  EXPECT_TRUE(client->ReleasePool(attacker->handle).ok());
  EXPECT_EQ(client->Lookup(victim->handle, vkeys).prefix_blocks, held);
  EXPECT_TRUE(RoundTrip(*client, *victim, 303));
}

// Victim restore latencies (ms) of one block, `n` times.
std::vector<double> VictimLatencies(Client& client, it::TestPool& victim,
                                    const std::vector<BlockKey>& keys, int n) {
  std::vector<double> out;
  const auto rows = it::RowRange(kBt, kBt);
  for (int i = 0; i < n; ++i) {
    const auto t0 = Clock::now();
    auto r = client.Restore(victim.handle, keys, rows);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    EXPECT_TRUE(r.status.ok() && r.restored_blocks == 1) << r.status.ToString();
    out.push_back(ms);
    std::this_thread::sleep_for(20ms);
  }
  return out;
}

// Blocks the daemon restored into the pools of `model`, counted when each request ends (the
// daemon adds a request's blocks to its pool's count as the request finishes).
uint64_t RestoredBlocksOf(Client& client, const std::string& model) {
  auto s = client.GetStats();
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  uint64_t n = 0;
  if (s.ok()) {
    for (const PoolStats& p : s->pools) n += p.model == model ? p.restores : 0;
  }
  return n;
}

TEST(FairnessTest, AVictimsRestoreIsNotStarvedByHugeRestores) {
  // Two attacker pools (one per transfer worker) restore 128 blocks of 2 MiB each (32 layers x
  // 8 heads x 128 dims x 16 tokens, BF16) per request, back to back; the victim restores one
  // small block. The daemon runs a request as sub-tasks of 8 such blocks (16 MiB), so the
  // victim waits for a sub-task, not for a whole attacker request (16 sub-tasks).
  //
  // The outcome asserted does not depend on the machine's speed: per victim restore, whether an
  // attacker request ended between the daemon's request counts read just before and just after
  // it. Were whole requests served in turn, the victim's restore could start only once an
  // attacker request ended (both workers are busy with them), and nearly every sample would see
  // one end; with sub-tasks most samples see none. The latencies are printed as information
  // (latency bounds belong to benchmarks).
  const std::string kAttackerModel = "qf/fair-attacker";
  Daemon d("384MiB", {"--wait-timeout-ms", "3000"});
  ASSERT_TRUE(d.Start());
  ClientOptions co;
  co.target = d.target();
  co.call_timeout = 600s;  // only a hang ends a call: the test measures order, not time
  auto cc = Client::Connect(co);
  ASSERT_TRUE(cc.ok());
  Client& client = **cc;

  it::PoolOptions vo = SmallPool("qf/fair-victim");
  auto victim = it::MakePool(client, vo);
  ASSERT_TRUE(victim.ok()) << victim.status().ToString();
  const auto vkeys = it::Keys(7, 1, kBt);
  it::FillRows(victim->kv, 7, it::RowRange(0, kBt), kBt);
  ASSERT_TRUE(client.Backup(victim->handle, vkeys, it::RowRange(0, kBt)).status.ok());

  constexpr uint32_t kBlocks = 128;
  it::PoolOptions ao;
  ao.geometry = it::Geom(32, 8, 128);
  ao.num_rows = kBlocks * kBt;
  ao.block_tokens = kBt;
  std::vector<it::TestPool> attackers;
  for (int i = 0; i < 2; ++i) {
    ao.model = kAttackerModel;  // both pools in one namespace: one backup serves both
    auto p = it::MakePool(client, ao);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    attackers.push_back(std::move(p).value());
  }
  const auto akeys = it::Keys(9, kBlocks, kBt);
  const auto arows = it::RowRange(0, kBlocks * kBt);
  it::FillRows(attackers[0].kv, 9, arows, kBt);
  auto stored = client.Backup(attackers[0].handle, akeys, arows);
  ASSERT_TRUE(stored.status.ok()) << stored.status.ToString();
  ASSERT_EQ(client.Lookup(attackers[1].handle, akeys).prefix_blocks, kBlocks);  // one namespace

  // Amplification: one block restored many times over the same rows.
  {
    std::vector<BlockKey> same(kBlocks, akeys[0]);
    std::vector<uint32_t> rows;
    for (uint32_t i = 0; i < kBlocks; ++i) {
      for (uint32_t t = 0; t < kBt; ++t) rows.push_back(t);
    }
    const auto t0 = Clock::now();
    auto r = client.Restore(attackers[0].handle, same, rows);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    std::printf(
        "[ amplify  ] %u x the same 2 MiB block into the same rows: %s, %u restored, "
        "%.1f ms\n",
        kBlocks, r.status.ToString().c_str(), r.restored_blocks, ms);
    if (!OtherDaemon()) {
      EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument) << r.status.ToString();
    }
  }

  // 30 samples under a sanitizer too: where 80% of samples overtake, fewer than half of 30 do
  // less than once in 10,000 runs (of 10, once in 150).
  const int kSamples = 30;
  std::vector<double> idle = VictimLatencies(client, *victim, vkeys, kSamples);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> attack_requests{0}, amplified_requests{0};
  // Each attacker first tries the amplification (4,096 x one 2 MiB block into the same 16 rows:
  // 8 GiB of decode from a 256 KiB request); refused, it falls back to legitimate restores of
  // its 128 distinct blocks, back to back.
  constexpr uint32_t kAmplified = 4096;
  const std::vector<BlockKey> amp_keys(kAmplified, akeys[0]);
  std::vector<uint32_t> amp_rows;
  for (uint32_t i = 0; i < kAmplified; ++i) {
    for (uint32_t t = 0; t < kBt; ++t) amp_rows.push_back(t);
  }
  std::vector<std::thread> threads;
  for (auto& p : attackers) {
    threads.emplace_back([&, pool = p.handle] {
      bool amplify = true;
      while (!stop.load()) {
        if (amplify) {
          auto r = client.Restore(pool, amp_keys, amp_rows);
          if (r.status.ok()) {
            amplified_requests.fetch_add(1);
            continue;
          }
          amplify = false;
        }
        auto r = client.Restore(pool, akeys, arows);
        if (r.status.ok() && r.restored_blocks == kBlocks) attack_requests.fetch_add(1);
      }
    });
  }
  // Both workers busy: two attacker requests have ended (and the next ones are sent). Only a
  // hang makes this wait end by its deadline.
  const uint64_t attacked_from = RestoredBlocksOf(client, kAttackerModel);
  const auto busy_by = Clock::now() + 300s;
  while (RestoredBlocksOf(client, kAttackerModel) < attacked_from + 2 * kBlocks &&
         Clock::now() < busy_by) {
    std::this_thread::sleep_for(10ms);
  }
  if (Clock::now() >= busy_by) {
    stop.store(true);
    for (auto& t : threads) t.join();
    FAIL() << "no two attacker requests ended within 300 s";
  }
  const auto t0 = Clock::now();
  std::vector<double> attacked;
  int overtook = 0;  // victim restores during which no attacker request ended
  for (int i = 0; i < kSamples; ++i) {
    const uint64_t before = RestoredBlocksOf(client, kAttackerModel);
    const auto s0 = Clock::now();
    auto r = client.Restore(victim->handle, vkeys, it::RowRange(kBt, kBt));
    attacked.push_back(std::chrono::duration<double, std::milli>(Clock::now() - s0).count());
    overtook += RestoredBlocksOf(client, kAttackerModel) == before;
    EXPECT_TRUE(r.status.ok() && r.restored_blocks == 1) << r.status.ToString();
    std::this_thread::sleep_for(20ms);
  }
  const double attack_s = std::chrono::duration<double>(Clock::now() - t0).count();
  stop.store(true);
  for (auto& t : threads) t.join();
  const double idle_p50 = Percentile(idle, 50), idle_p90 = Percentile(idle, 90);
  const double att_p50 = Percentile(attacked, 50), att_p90 = Percentile(attacked, 90);
  const uint64_t done = attack_requests.load();
  const double attacker_ms = done > 0 ? 1000.0 * attack_s * static_cast<double>(attackers.size()) /
                                            static_cast<double>(done)
                                      : 0;
  std::printf(
      "[ fairness ] victim 1-block restore, %d samples: idle p50 %.2f ms p90 %.2f ms; "
      "under attack p50 %.2f ms p90 %.2f ms; one attacker request %.1f ms (attackers: %.2f "
      "amplified requests/s of %u x one 2 MiB block, %.1f requests/s of %u distinct 2 MiB "
      "blocks; %u cores)\n",
      kSamples, idle_p50, idle_p90, att_p50, att_p90, attacker_ms,
      static_cast<double>(amplified_requests.load()) / attack_s, kAmplified,
      static_cast<double>(done) / attack_s, kBlocks, std::thread::hardware_concurrency());
  std::printf(
      "[ fairness ] %d of %d victim restores ended before any attacker request in flight at "
      "their start\n",
      overtook, kSamples);
  EXPECT_GT(done + amplified_requests.load(), 0u);
  if (!OtherDaemon()) {
    EXPECT_EQ(amplified_requests.load(), 0u);
    // Sub-tasks: a sample sees an attacker request end about 2 x 1/16 of the time (more with
    // the RPCs around it); whole requests in turn: nearly always. Half is the margin.
    EXPECT_GE(2 * overtook, kSamples)
        << "the victim waited for whole attacker requests: " << overtook << " of " << kSamples
        << " restores ended with no attacker request ending meanwhile (p50 " << att_p50
        << " ms, idle p50 " << idle_p50 << " ms, one attacker request " << attacker_ms << " ms)";
  }
}

TEST(ChurnTest, UniqueNamesLeaveNothingBehind) {
  Daemon d("64MiB");
  ASSERT_TRUE(d.Start());
  auto client = it::Connect(d.target());
  ASSERT_NE(client, nullptr);
  auto keep = it::MakePool(*client, SmallPool("qf/churn-keep"));
  ASSERT_TRUE(keep.ok());
  auto before = client->GetStats();
  ASSERT_TRUE(before.ok());
  // namespaces_total where the daemon pages GetStats, else every namespace is listed.
  auto count = [](const DaemonStats& s) {
    return std::max<uint32_t>(s.namespaces_total, static_cast<uint32_t>(s.namespaces.size()));
  };
  const uint32_t baseline = count(*before);
  const uint64_t rss_before = ReadProcMemory(d.pid()).rss_anon;
  const int kCycles = rob::kSanitized ? 1000 : 4000;
  std::vector<double> per_500;
  auto t0 = Clock::now();
  PoolSpec spec = keep->spec;
  for (int i = 0; i < kCycles; ++i) {
    spec.model = "qf/churn/" + std::to_string(i) + "/a-long-model-name-and-revision";
    auto h = client->RegisterPool(spec);
    ASSERT_TRUE(h.ok()) << i << ": " << h.status().ToString();
    ASSERT_TRUE(client->ReleasePool(*h).ok());
    if ((i + 1) % 500 == 0) {
      const auto t1 = Clock::now();
      per_500.push_back(500.0 / std::chrono::duration<double>(t1 - t0).count());
      t0 = t1;
    }
  }
  auto after = client->GetStats();
  ASSERT_TRUE(after.ok());
  const uint64_t rss_after = ReadProcMemory(d.pid()).rss_anon;
  std::printf(
      "[ churn    ] %d cycles: namespaces %u -> %u, GetStats namespaces %zu, RSS anon "
      "%.1f -> %.1f MiB, registrations/s first 500 %.0f, last 500 %.0f\n",
      kCycles, baseline, count(*after), after->namespaces.size(), MiB(rss_before), MiB(rss_after),
      per_500.front(), per_500.back());
  if (!OtherDaemon()) {
    EXPECT_EQ(count(*after), baseline);
    // Under a sanitizer freed memory sits in quarantine (ASan holds up to 256 MiB), so RSS says
    // nothing there; the namespace count above still must return to baseline.
    // The registration rates are printed, not asserted (a loaded machine halves them at
    // random): what would make them fall with churn is state left behind, which the namespace
    // count above and the memory below measure.
    if (!kSanitized) EXPECT_LT(rss_after, rss_before + (16ull << 20));
  }
  EXPECT_TRUE(RoundTrip(*client, *keep, 41));
}

}  // namespace
}  // namespace hiqcache::rob
