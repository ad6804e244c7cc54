// A dead daemon releases the engine (docs/design.md "Completion: ticket slots"), against the real
// hiqcached killed with SIGKILL: once the session connection ends without the client closing it,
// the client stores H | failed (H = the highest ticket the daemon answered for the pool) into the
// pool's daemon slots below H, so a waiter returns at once with ABORTED; slots past H, slots the
// engine writes and slots no request named are left alone; a second pass a second later repairs a
// slot lowered after the first. A pool released with ReleasePool, or a client closed normally,
// writes nothing.
//
// HOST pools with memfd KV buffers and memfd slots (both passed by fd over the session).
#include <gtest/gtest.h>

#include <functional>
#include <future>
#include <iostream>
#include <memory>

#include "daemon_process.h"
#include "it_util.h"
#include "time_margin.h"

namespace hiqcache::it {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kLayers = 4;
constexpr uint32_t kBt = 16;
constexpr uint32_t kRows = 128;
constexpr uint32_t kSlots = 16;
// Slots 0..kLayers-1: a restore's layer slots.
constexpr int32_t kDone = 8;      // the async backup's done slot
constexpr int32_t kWait = 9;      // its wait slot, never stored by the test
constexpr int32_t kPast = 10;     // a daemon slot the test moves past every ticket
constexpr int32_t kOldDone = 11;  // an earlier backup's done slot
constexpr int32_t kSpare = 12;    // named by no request

struct EnginePool {
  HostKvPool kv;
  HostEventPool events;
  PoolHandle handle;
};

StatusOr<std::unique_ptr<EnginePool>> MakeEnginePool(Client& client, const std::string& model) {
  auto pool = std::make_unique<EnginePool>();
  HIQ_ASSIGN_OR_RETURN(pool->kv, HostKvPool::Create(Geom(kLayers, 2, 64), KvLayout::kSglang, kRows,
                                                    16, "memfd:kv-" + model));
  HIQ_ASSIGN_OR_RETURN(pool->events, HostEventPool::Create(kSlots, "memfd:ev-" + model));
  const PoolSpec spec = MakeHostPoolSpec(model, pool->kv, kBt, &pool->events);
  HIQ_ASSIGN_OR_RETURN(pool->handle, client.RegisterPool(spec));
  return pool;
}

// A sync backup of `blocks` blocks of data set `seed` from rows [first_row, ...), its done slot
// `done`; returns its ticket (0 on failure).
uint64_t SyncBackup(Client& client, EnginePool& pool, uint64_t seed, uint32_t blocks,
                    uint32_t first_row, int32_t done) {
  const std::vector<uint32_t> rows = RowRange(first_row, blocks * kBt);
  FillRows(pool.kv, seed, rows, kBt);
  BackupOptions o;
  o.done_event = done;
  BackupResult r = client.Backup(pool.handle, Keys(seed, blocks, kBt), rows, o);
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.held(), blocks);
  return r.status.ok() ? r.ticket : 0;
}

bool Eventually(const std::function<bool()>& f, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!f()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

TEST(DaemonDeathTest, KilledDaemonReleasesWaitersWithTheFailedBit) {
  DaemonProcess daemon("64MiB", {"--wait-timeout-ms", "60000"});
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not start";
  auto client = Connect(daemon.target());
  ASSERT_NE(client, nullptr);
  auto p = MakeEnginePool(*client, "death-kill");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EnginePool& pool = **p;
  const HostEventPool& ev = pool.events;

  const uint64_t t_old = SyncBackup(*client, pool, 1, 2, 0, kOldDone);
  ASSERT_GT(t_old, 0u);
  ASSERT_EQ(ev.Read(kOldDone), t_old);
  // A sync restore signals the layer slots and kPast; the test then moves kPast past every
  // ticket this daemon will answer.
  RestoreOptions ro;
  ro.layer_event_base = 0;
  ro.done_event = kPast;
  RestoreResult restored = client->Restore(pool.handle, Keys(1, 2, kBt), RowRange(64, 2 * kBt), ro);
  ASSERT_TRUE(restored.status.ok()) << restored.status.ToString();
  ASSERT_EQ(restored.restored_blocks, 2u);
  for (uint32_t l = 0; l < kLayers; ++l) ASSERT_EQ(ev.Read(l), restored.ticket) << "layer " << l;
  const uint64_t past = restored.ticket + 1000;
  ev.Store(kPast, past);

  // An asynchronous backup whose wait value the engine never stores: the daemon answers T and
  // waits (for longer than this test).
  const std::vector<uint32_t> rows = RowRange(32, 2 * kBt);
  FillRows(pool.kv, 2, rows, kBt);
  BackupOptions bo;
  bo.wait_event = kWait;
  bo.wait_value = 1;
  bo.done_event = kDone;
  bo.sync = false;
  BackupResult pending = client->Backup(pool.handle, Keys(2, 2, kBt), rows, bo);
  ASSERT_TRUE(pending.status.ok()) << pending.status.ToString();
  const uint64_t t = pending.ticket;
  ASSERT_GT(t, restored.ticket);
  const uint64_t failed = t | kEventFailedBit;

  // A waiter the daemon's death does not wake waits out 4 times the margin.
  const auto margin = test_time::Margin(3s);
  auto waiter = std::async(std::launch::async, [&] { return ev.Wait(kDone, t, 4 * margin); });
  ASSERT_EQ(waiter.wait_for(300ms), std::future_status::timeout)
      << "the backup completed without its wait value: " << waiter.get().ToString();

  const auto killed_at = Clock::now();
  daemon.Kill();
  ASSERT_EQ(waiter.wait_for(margin), std::future_status::ready)
      << "a waiter on the done slot is still blocked " << margin.count()
      << " ms after the daemon died (slot " << ev.Read(kDone) << ")";
  const Status done = waiter.get();
  EXPECT_EQ(done.code(), StatusCode::kAborted) << done.ToString();
  EXPECT_LT(Clock::now() - killed_at, margin);
  EXPECT_EQ(ev.Read(kDone), failed);

  // Every daemon slot below T holds T | failed; the rest are untouched.
  ASSERT_TRUE(Eventually([&] { return ev.Read(kOldDone) == failed; }, test_time::Margin(10s)))
      << ev.Read(kOldDone);
  for (uint32_t l = 0; l < kLayers; ++l) EXPECT_EQ(ev.Read(l), failed) << "layer slot " << l;
  EXPECT_EQ(ev.Read(kPast), past) << "a slot past T was lowered";
  EXPECT_EQ(ev.Read(kWait), 0u) << "the engine's wait slot was written";
  EXPECT_EQ(ev.Read(kSpare), 0u) << "a slot no request named was written";
  for (uint32_t s = kLayers; s < static_cast<uint32_t>(kDone); ++s) EXPECT_EQ(ev.Read(s), 0u) << s;

  // A late store of the dead daemon that lands after the first pass: the second pass, about a
  // second after the death, stores T | failed again.
  ev.Store(kOldDone, t_old);
  const auto lowered_at = Clock::now();
  if (lowered_at - killed_at < 800ms) {
    EXPECT_TRUE(Eventually([&] { return ev.Read(kOldDone) == failed; }, test_time::Margin(10s)))
        << "no second pass: the slot lowered after the first still holds " << ev.Read(kOldDone);
  } else {
    std::cout
        << "[ note ] second pass not checked: the first pass was observed "
        << std::chrono::duration_cast<std::chrono::milliseconds>(lowered_at - killed_at).count()
        << " ms after the kill\n";
  }
  EXPECT_EQ(ev.Read(kPast), past);
  EXPECT_EQ(ev.Read(kWait), 0u);

  // The client stays fail-open: the pool's calls miss.
  EXPECT_EQ(client->Lookup(pool.handle, Keys(1, 2, kBt)).prefix_blocks, 0u);
}

TEST(DaemonDeathTest, ReleasedPoolAndClosedClientWriteNothing) {
  DaemonProcess daemon("64MiB");
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not start";
  auto client = Connect(daemon.target());
  ASSERT_NE(client, nullptr);
  // Pools a (released) and b (kept): each has a done slot below its highest ticket, which a
  // release would raise.
  auto a = MakeEnginePool(*client, "death-released");
  auto b = MakeEnginePool(*client, "death-kept");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const uint64_t a1 = SyncBackup(*client, **a, 10, 1, 0, kOldDone);
  const uint64_t a2 = SyncBackup(*client, **a, 11, 1, 16, kDone);
  const uint64_t b1 = SyncBackup(*client, **b, 12, 1, 0, kOldDone);
  const uint64_t b2 = SyncBackup(*client, **b, 13, 1, 16, kDone);
  ASSERT_LT(a1, a2);
  ASSERT_LT(b1, b2);
  ASSERT_TRUE(client->ReleasePool((*a)->handle).ok());

  daemon.Kill();
  // b shows that this client does release after a death.
  EXPECT_TRUE(Eventually([&] { return (*b)->events.Read(kOldDone) == (b2 | kEventFailedBit); },
                         test_time::Margin(10s)))
      << (*b)->events.Read(kOldDone);
  std::this_thread::sleep_for(1500ms);  // past the second pass
  EXPECT_EQ((*a)->events.Read(kOldDone), a1) << "a released pool's slot was written";
  EXPECT_EQ((*a)->events.Read(kDone), a2);
  EXPECT_EQ((*b)->events.Read(kDone), b2);

  // A client closed normally, then the daemon killed: nothing is written.
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not restart";
  auto second = Connect(daemon.target());
  ASSERT_NE(second, nullptr);
  auto c = MakeEnginePool(*second, "death-closed");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const uint64_t c1 = SyncBackup(*second, **c, 14, 1, 0, kOldDone);
  const uint64_t c2 = SyncBackup(*second, **c, 15, 1, 16, kDone);
  ASSERT_LT(c1, c2);
  second.reset();
  daemon.Kill();
  std::this_thread::sleep_for(1500ms);
  EXPECT_EQ((*c)->events.Read(kOldDone), c1) << "a closed client's slot was written";
  EXPECT_EQ((*c)->events.Read(kDone), c2);
}

}  // namespace
}  // namespace hiqcache::it
