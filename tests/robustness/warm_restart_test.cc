// "Nothing lost, nothing corrupted" across a daemon crash (docs/design.md "Faults").
//
// KillNineMidStream: hiqcached is killed with SIGKILL while one thread streams sync backups and
// another streams sync restores; restarted with the same --shm-name, --pool-bytes and socket, it
// reattaches to the pool. Every block whose Backup returned STORED/ALREADY_PRESENT before the kill
// is found by Lookup and restores within the INT8 bound; the client re-registers by itself.
//
// CorruptPayloadIsDropped: with the daemon stopped, one payload byte of one committed block is
// flipped directly in /dev/shm; the restarted daemon drops exactly that block and keeps the rest.
//
// GroupLookupAnswersBeforeAnyPoolRegistersAgain: after kill -9, and again after SIGTERM, a
// scheduler that holds no pool asks LookupGroup what a TP group holds before any worker has
// registered again: the restarted daemon answers from the blocks it found in the pool, and the
// workers' re-registrations join the same namespaces.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include "daemon_process.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kBt = 16;
constexpr uint32_t kBatch = 4;        // blocks per Backup call
constexpr uint32_t kRingBatches = 4;  // backup source rows are reused round-robin
constexpr uint64_t kSeed = 4242;

it::PoolOptions Options(uint32_t rows) {
  it::PoolOptions o;
  o.model = "rob-restart";
  o.geometry = it::Geom(4, 4, 64);
  o.block_tokens = kBt;
  o.num_rows = rows;
  return o;
}

// Restores blocks [first, first + n) of kSeed into `dst` and checks them. Returns the number of
// blocks found by Lookup / restored, and adds bad heads to *corrupt.
struct Verified {
  uint32_t looked_up = 0;
  uint32_t restored = 0;
  uint64_t bad_heads = 0;
  std::string first_bad;
  Status status;
};
Verified VerifyBlocks(Client& client, const it::TestPool& pool, uint64_t first, uint32_t n,
                      std::span<const uint32_t> dst) {
  Verified v;
  const auto keys = IndependentKeys(kSeed, first, n);
  LookupResult l = client.Lookup(pool.handle, keys);
  v.looked_up = l.prefix_blocks;
  if (!l.status.ok()) v.status = l.status;
  it::SentinelRows(pool.kv, dst.first(n * kBt));
  RestoreResult r = client.Restore(pool.handle, keys, dst.first(n * kBt));
  v.restored = r.restored_blocks;
  if (!r.status.ok()) v.status = r.status;
  if (r.restored_blocks > 0) {
    it::CheckResult c = it::CheckRows(pool.kv, kSeed, dst.first(r.restored_blocks * kBt), kBt,
                                      false, static_cast<uint32_t>(first));
    v.bad_heads = c.bad_heads;
    v.first_bad = c.first;
  }
  return v;
}

TEST(WarmRestartTest, KillNineMidStreamKeepsEveryCompletedBlock) {
  DaemonProcess daemon("64MiB");
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not start";
  auto client = RestartingClient(daemon.target());
  ASSERT_NE(client, nullptr);
  // Rows: [0, 256) backup ring, [256, 320) restore stream, [320, 384) verification.
  auto p = it::MakePool(*client, Options(384));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  it::TestPool pool = std::move(p).value();

  std::mutex mu;
  std::vector<uint64_t> completed;  // first logical block of each completed batch
  std::atomic<bool> stop{false};
  std::atomic<bool> killed{false};
  std::atomic<uint64_t> stream_errors_before_kill{0}, restores_before_kill{0};
  std::atomic<uint64_t> corrupt_before_kill{0};

  std::thread backups([&] {
    for (uint64_t batch = 0; !stop.load(); ++batch) {
      const uint64_t first = batch * kBatch;
      // Stay well below the pool's capacity (~1,980 blocks): nothing completed may be evicted.
      while (first >= 1200 && !killed.load() && !stop.load()) std::this_thread::sleep_for(1ms);
      const auto rows = it::RowRange((batch % kRingBatches) * kBatch * kBt, kBatch * kBt);
      it::FillRows(pool.kv, kSeed, rows, kBt, static_cast<uint32_t>(first));
      const bool before = !killed.load();
      BackupResult b = client->Backup(pool.handle, IndependentKeys(kSeed, first, kBatch), rows);
      if (b.held() == kBatch) {
        std::lock_guard<std::mutex> lock(mu);
        completed.push_back(first);
      } else if (before && !killed.load()) {
        stream_errors_before_kill++;
      }
      if (killed.load()) break;  // the stream ends with the daemon
    }
  });
  std::thread restores([&] {
    std::mt19937_64 rng(1);
    const auto dst = it::RowRange(256, kBatch * kBt);
    while (!stop.load() && !killed.load()) {
      uint64_t first;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (completed.empty()) {
          first = UINT64_MAX;
        } else {
          first = completed[rng() % completed.size()];
        }
      }
      if (first == UINT64_MAX) {
        std::this_thread::sleep_for(1ms);
        continue;
      }
      Verified v = VerifyBlocks(*client, pool, first, kBatch, dst);
      if (killed.load()) break;
      if (v.restored == kBatch) restores_before_kill++;
      corrupt_before_kill += v.bad_heads;
    }
  });

  // Kill once a few hundred blocks are in, with both streams running.
  ASSERT_TRUE(it::Eventually(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        return completed.size() * kBatch >= 200;
      },
      60s))
      << "the backup stream did not get going";
  ASSERT_TRUE(it::Eventually([&] { return restores_before_kill.load() >= 5; }, 30s));
  const pid_t old_pid = daemon.pid();
  ::kill(old_pid, SIGKILL);
  killed.store(true);
  daemon.Kill();  // reaps it
  backups.join();
  stop.store(true);
  restores.join();
  EXPECT_EQ(stream_errors_before_kill.load(), 0u);
  EXPECT_EQ(corrupt_before_kill.load(), 0u);

  std::vector<uint64_t> done;
  {
    std::lock_guard<std::mutex> lock(mu);
    done = completed;
  }
  const uint64_t completed_blocks = done.size() * kBatch;

  // Same configuration: same shm name, pool size and socket (DaemonProcess reuses them).
  const auto t0 = Clock::now();
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not restart";
  const double restart_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();

  // The client re-registers by itself: the first call after the restart may need the
  // re-registration interval to pass.
  ASSERT_TRUE(it::Eventually(
      [&] { return client->Lookup(pool.handle, IndependentKeys(kSeed, 0, 1)).status.ok(); }, 10s))
      << "the client did not re-register";
  auto stats = client->GetStats();
  ASSERT_TRUE(stats.ok());

  uint64_t found = 0, restored = 0, bad_heads = 0, calls = 0;
  std::string first_problem;
  const auto dst = it::RowRange(320, kBatch * kBt);
  for (uint64_t first : done) {
    Verified v = VerifyBlocks(*client, pool, first, kBatch, dst);
    ++calls;
    found += v.looked_up;
    restored += v.restored;
    bad_heads += v.bad_heads;
    if (first_problem.empty() && (v.looked_up != kBatch || v.restored != kBatch || v.bad_heads)) {
      first_problem = "blocks " + std::to_string(first) + "+" + std::to_string(kBatch) +
                      ": found " + std::to_string(v.looked_up) + ", restored " +
                      std::to_string(v.restored) + " " + v.status.ToString() + " " + v.first_bad;
    }
  }
  std::printf(
      "[warm restart] completed before kill: %llu blocks; daemon restarted in %.0f ms holding %llu "
      "blocks; after restart found %llu, restored %llu, corrupt heads %llu\n",
      static_cast<unsigned long long>(completed_blocks), restart_ms,
      static_cast<unsigned long long>(stats->blocks), static_cast<unsigned long long>(found),
      static_cast<unsigned long long>(restored), static_cast<unsigned long long>(bad_heads));
  EXPECT_GE(stats->blocks, completed_blocks);
  EXPECT_EQ(found, completed_blocks) << first_problem;
  EXPECT_EQ(restored, completed_blocks) << first_problem;
  EXPECT_EQ(bad_heads, 0u) << first_problem;
  EXPECT_EQ(daemon.Stop(), 0);
}

TEST(WarmRestartTest, CorruptPayloadByteDropsExactlyThatBlock) {
  constexpr uint32_t kBlocks = 48;
  DaemonProcess daemon("32MiB");
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not start";
  auto client = RestartingClient(daemon.target());
  ASSERT_NE(client, nullptr);
  auto p = it::MakePool(*client, Options(2 * kBatch * kBt));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  it::TestPool pool = std::move(p).value();
  const auto src = it::RowRange(0, kBatch * kBt), dst = it::RowRange(kBatch * kBt, kBatch * kBt);
  for (uint32_t first = 0; first < kBlocks; first += kBatch) {
    it::FillRows(pool.kv, kSeed, src, kBt, first);
    ASSERT_EQ(client->Backup(pool.handle, IndependentKeys(kSeed, first, kBatch), src).held(),
              kBatch);
  }
  ASSERT_EQ(daemon.Stop(), 0);

  // Flip one payload byte of one committed block in the pool object itself.
  BlockKey victim{};
  {
    auto file = PoolFile::Open(daemon.shm_name());
    ASSERT_TRUE(file.has_value()) << "cannot open " << daemon.shm_name();
    auto blocks = file->CommittedBlocks();
    ASSERT_EQ(blocks.size(), kBlocks);
    const PoolFile::Block& b = blocks[blocks.size() / 3];
    victim = b.key;
    file->data()[b.payload_offset + b.payload_bytes / 2] ^= 0x40;
  }
  uint64_t victim_index = UINT64_MAX;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    if (IndependentKey(kSeed, i) == victim) victim_index = i;
  }
  ASSERT_NE(victim_index, UINT64_MAX);

  ASSERT_TRUE(daemon.Start()) << "hiqcached did not restart";
  ASSERT_TRUE(it::Eventually(
      [&] { return client->Lookup(pool.handle, IndependentKeys(kSeed, 0, 1)).status.ok(); }, 10s));
  auto stats = client->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->blocks, kBlocks - 1) << it::StatsText(*stats);
  uint64_t missing = 0, bad = 0;
  for (uint64_t i = 0; i < kBlocks; ++i) {
    Verified v = VerifyBlocks(*client, pool, i, 1, dst);
    if (i == victim_index) {
      EXPECT_EQ(v.looked_up, 0u) << "the corrupted block is still served";
      EXPECT_EQ(v.restored, 0u);
    } else {
      missing += v.looked_up != 1 || v.restored != 1;
      bad += v.bad_heads;
    }
  }
  std::printf(
      "[corrupt] flipped one byte of block %llu of %u: restarted daemon holds %llu blocks, "
      "%llu others missing, %llu bad heads\n",
      static_cast<unsigned long long>(victim_index), kBlocks,
      static_cast<unsigned long long>(stats->blocks), static_cast<unsigned long long>(missing),
      static_cast<unsigned long long>(bad));
  EXPECT_EQ(missing, 0u);
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(daemon.Stop(), 0);
}

TEST(WarmRestartTest, GroupLookupAnswersBeforeAnyPoolRegistersAgain) {
  constexpr uint32_t kBlocks = 8, kRank1Blocks = 6;
  DaemonProcess daemon("192MiB");  // one ~64 MiB extent per rank: neither evicts the other
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not start";
  auto workers = RestartingClient(daemon.target());  // the engine's TP workers, one pool per rank
  auto scheduler = it::Connect(daemon.target(), 3000ms);  // holds no pool
  ASSERT_NE(workers, nullptr);
  ASSERT_NE(scheduler, nullptr);
  it::PoolOptions o0 = Options(2 * kBlocks * kBt);
  o0.geometry.tp_size = 2;
  it::PoolOptions o1 = o0;
  o1.geometry.tp_rank = 1;
  auto r0 = it::MakePool(*workers, o0);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  auto r1 = it::MakePool(*workers, o1);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  const it::TestPool& p0 = *r0;
  const it::TestPool& p1 = *r1;
  ASSERT_NE(p0.info.namespace_id, p1.info.namespace_id);

  const auto src = it::RowRange(0, kBlocks * kBt), dst = it::RowRange(kBlocks * kBt, kBlocks * kBt);
  const auto keys = IndependentKeys(kSeed, 0, kBlocks);
  it::FillRows(p0.kv, kSeed, src, kBt);
  it::FillRows(p1.kv, kSeed, src, kBt);
  ASSERT_EQ(workers->Backup(p0.handle, keys, src).held(), kBlocks);
  ASSERT_EQ(workers
                ->Backup(p1.handle, std::span(keys).first(kRank1Blocks),
                         std::span(src).first(kRank1Blocks * kBt))
                .held(),
            kRank1Blocks);
  const std::vector<NamespaceRef> group = {it::RefOf(p0.spec), it::RefOf(p1.spec)};
  NamespaceRef unknown = group[0];
  unknown.model = "rob-restart-never-registered";
  ASSERT_EQ(scheduler->LookupGroup(group, keys).prefix_blocks, kRank1Blocks);

  for (const bool kill9 : {true, false}) {
    SCOPED_TRACE(kill9 ? "after kill -9" : "after SIGTERM");
    if (kill9) {
      daemon.Kill();
    } else {
      ASSERT_EQ(daemon.Stop(), 0);
    }
    ASSERT_TRUE(daemon.Start()) << "hiqcached did not restart";

    // No worker has called since the restart, so none has registered again. LookupGroup does not
    // retry: its first call may meet the scheduler's channel still reconnecting.
    LookupResult g;
    ASSERT_TRUE(it::Eventually(
        [&] {
          g = scheduler->LookupGroup(group, keys);
          return g.status.ok();
        },
        10s))
        << g.status.ToString();
    EXPECT_EQ(g.prefix_blocks, kRank1Blocks);
    EXPECT_EQ(scheduler->LookupGroup(std::span(group).first(1), keys).prefix_blocks, kBlocks);
    EXPECT_EQ(scheduler->LookupGroup(std::span(group).last(1), keys).prefix_blocks, kRank1Blocks);
    EXPECT_EQ(scheduler->LookupGroup(std::vector<NamespaceRef>{unknown}, keys).prefix_blocks, 0u);
    EXPECT_EQ(
        scheduler->LookupGroup(std::vector<NamespaceRef>{group[0], unknown}, keys).prefix_blocks,
        0u);
    auto stats = scheduler->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_TRUE(stats->pools.empty()) << "a worker registered before the check";
    // The lookups adopted the two rebuilt namespaces and created nothing for `unknown`.
    EXPECT_EQ(stats->namespaces.size(), 2u) << it::StatsText(*stats);
    const NamespaceStats* n0 = it::FindNamespace(*stats, p0.info.namespace_id);
    const NamespaceStats* n1 = it::FindNamespace(*stats, p1.info.namespace_id);
    ASSERT_TRUE(n0 != nullptr && n1 != nullptr) << it::StatsText(*stats);
    EXPECT_EQ(n0->blocks, kBlocks);
    EXPECT_EQ(n1->blocks, kRank1Blocks);

    // The workers' next calls register them again, into those namespaces: the same blocks.
    ASSERT_TRUE(it::Eventually(
        [&] { return workers->Lookup(p1.handle, keys).prefix_blocks == kRank1Blocks; }, 10s));
    Verified v = VerifyBlocks(*workers, p0, 0, kBlocks, dst);
    EXPECT_EQ(v.looked_up, kBlocks) << v.status.ToString();
    EXPECT_EQ(v.restored, kBlocks) << v.status.ToString();
    EXPECT_EQ(v.bad_heads, 0u) << v.first_bad;
    auto info0 = workers->PoolInfo(p0.handle);
    auto info1 = workers->PoolInfo(p1.handle);
    ASSERT_TRUE(info0.ok() && info1.ok());
    EXPECT_EQ(info0->namespace_id, p0.info.namespace_id);
    EXPECT_EQ(info1->namespace_id, p1.info.namespace_id);
    stats = scheduler->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_EQ(stats->pools.size(), 2u);
    EXPECT_EQ(stats->namespaces.size(), 2u) << it::StatsText(*stats);
    EXPECT_EQ(scheduler->LookupGroup(group, keys).prefix_blocks, kRank1Blocks);
  }
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace
}  // namespace hiqcache::rob
