// A client process killed with SIGKILL in the middle of its work (docs/design.md "Faults": client
// death releases its mappings within 1 s).
//
// The worker (hiq_rob_worker --mode hold) leaves a Restore pinning many blocks and a Backup
// holding reserved blocks, both waiting for events that will never come, and is killed while it
// streams sync backups and restores through a second pool. The test measures how long the daemon
// takes to drop the dead pid's pools (GetStats polled), then fills the small pool with new
// blocks: none may be rejected, so every block the dead client pinned became evictable. A
// bystander client keeps working throughout, without an error.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "daemon_process.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kBt = 16;

bool HasPoolOf(Client& client, uint32_t pid) {
  auto s = client.GetStats();
  if (!s.ok()) return true;
  for (const auto& p : s->pools) {
    if (p.client_pid == pid) return true;
  }
  return false;
}

TEST(ClientDeathTest, KilledClientIsReleasedAndItsPinsDropped) {
  // 16 MiB holds ~490 blocks of this geometry; the worker pins 160 and reserves 4.
  constexpr uint32_t kPinBlocks = 160;
  DaemonProcess daemon("16MiB");
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not start";
  auto client = it::Connect(daemon.target());
  ASSERT_NE(client, nullptr);

  // The bystander: another client of the same namespace (so that it competes for the same
  // slots: in a 16 MiB pool one extent spans the pool), round trips of 2 blocks all along.
  it::PoolOptions bo;
  bo.model = "rob-death";
  bo.geometry = it::Geom(4, 4, 64);
  bo.block_tokens = kBt;
  bo.num_rows = 4 * kBt;
  auto bp = it::MakePool(*client, bo);
  ASSERT_TRUE(bp.ok()) << bp.status().ToString();
  it::TestPool bystander = std::move(bp).value();
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> bystander_rounds{0}, bystander_errors{0};
  std::string bystander_problem;
  std::thread bystander_thread([&] {
    const auto src = it::RowRange(0, 2 * kBt), dst = it::RowRange(2 * kBt, 2 * kBt);
    for (uint64_t round = 0; !stop.load(); ++round) {
      const auto keys = IndependentKeys(77, round * 2, 2);
      it::FillRows(bystander.kv, 77, src, kBt, static_cast<uint32_t>(round * 2));
      BackupResult b = client->Backup(bystander.handle, keys, src);
      RestoreResult r = client->Restore(bystander.handle, keys, dst);
      it::CheckResult c;
      if (r.restored_blocks > 0) {
        c = it::CheckRows(bystander.kv, 77, std::span(dst).first(r.restored_blocks * kBt), kBt,
                          false, static_cast<uint32_t>(round * 2));
      }
      // A restore may miss only if the block was evicted between the two calls.
      const bool ok =
          b.status.ok() && r.status.ok() && b.held() == 2 && (r.restored_blocks == 0 || c.ok());
      if (!ok && bystander_errors++ == 0) {
        bystander_problem = b.status.ToString() + " / " + r.status.ToString() + " / " + c.first;
      }
      bystander_rounds++;
    }
  });

  Child worker({HIQ_ROB_WORKER_PATH, "--target", daemon.target(), "--mode", "hold", "--pin-blocks",
                std::to_string(kPinBlocks)});
  ASSERT_GT(worker.pid(), 0);
  ASSERT_TRUE(worker.WaitLine("holding", 60s)) << "the worker did not set up its pins";
  ASSERT_TRUE(worker.WaitLine("streaming", 30s)) << "the worker did not start streaming";
  std::this_thread::sleep_for(50ms);  // well into the stream
  const uint32_t pid = static_cast<uint32_t>(worker.pid());
  ASSERT_TRUE(HasPoolOf(*client, pid));
  auto before = client->GetStats();
  ASSERT_TRUE(before.ok());

  const auto t_kill = Clock::now();
  worker.Kill();
  bool released = false;
  const auto hang = test_time::Margin(10s);
  while (Clock::now() - t_kill < hang) {
    if (!HasPoolOf(*client, pid)) {
      released = true;
      break;
    }
    std::this_thread::sleep_for(2ms);
  }
  const double release_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - t_kill).count();
  std::printf("[client death] pools of killed pid %u released after %.1f ms\n", pid, release_ms);
  ASSERT_TRUE(released) << "the dead client's pools were not released within " << hang.count()
                        << " ms";
  // The contract's 1 s, asserted with the margin of a loaded machine.
  EXPECT_LE(release_ms, static_cast<double>(test_time::Margin(3s).count()))
      << "docs/design.md: client death releases its mappings within 1 s";

  stop.store(true);
  bystander_thread.join();
  EXPECT_EQ(bystander_errors.load(), 0u) << bystander_problem;
  EXPECT_GT(bystander_rounds.load(), 0u);

  // Fill the whole pool with new blocks of the dead client's namespace: every slot must be
  // available, i.e. nothing is still pinned by the dead client's waiting tasks.
  it::PoolOptions fo = bo;
  fo.num_rows = 8 * kBt;
  auto fp = it::MakePool(*client, fo);
  ASSERT_TRUE(fp.ok()) << fp.status().ToString();
  auto stats = client->GetStats();
  ASSERT_TRUE(stats.ok());
  const it::TestPool& fill = *fp;
  const NamespaceStats* ns = it::FindNamespace(*stats, fill.info.namespace_id);
  ASSERT_NE(ns, nullptr);
  const uint64_t capacity = ns->capacity_blocks;
  ASSERT_GT(capacity, kPinBlocks + 4);
  const auto src = it::RowRange(0, 8 * kBt);
  it::FillRows(fill.kv, 55, src, kBt);
  uint64_t rejected = 0, held = 0;
  const auto t_fill = Clock::now();
  for (uint64_t first = 0; first < capacity; first += 8) {
    const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(8, capacity - first));
    BackupResult b =
        client->Backup(fill.handle, IndependentKeys(55, first, n), std::span(src).first(n * kBt));
    ASSERT_TRUE(b.status.ok()) << b.status.ToString();
    held += b.held();
    for (BlockStatus s : b.blocks) rejected += s == BlockStatus::kRejected;
  }
  const double fill_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_fill).count();
  std::printf(
      "[client death] then filled the pool: %llu of %llu blocks stored, %llu rejected "
      "(%.0f ms)\n",
      static_cast<unsigned long long>(held), static_cast<unsigned long long>(capacity),
      static_cast<unsigned long long>(rejected), fill_ms);
  EXPECT_EQ(rejected, 0u) << "blocks pinned by the dead client were not released";
  EXPECT_EQ(held, capacity);
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace
}  // namespace hiqcache::rob
