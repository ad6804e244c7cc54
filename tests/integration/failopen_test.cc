// Fail-open against the real daemon: stopped, killed or hung, every client call misses within its
// deadline and nothing throws; restarted on the same socket, the client re-registers by itself
// and backup/restore work again. SIGTERM: in-flight work completes, later calls are refused,
// exit status 0.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <memory>
#include <thread>

#include "daemon_process.h"
#include "hiqcache/v1/cache.grpc.pb.h"
#include "it_util.h"
#include "time_margin.h"

namespace hiqcache::it {
namespace {

using testing::DaemonProcess;
namespace v1 = ::hiqcache::v1;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kBt = 16;
// Beyond a call's deadline: scheduling on a loaded 2-core machine. The registration timeout is
// far longer (a loaded daemon may take seconds to answer a new connection), so a call that
// waited for a registration is still caught.
const auto kSlack = test_time::Margin(1000ms);
const auto kRegisterTimeout = test_time::Margin(10000ms);

// True once every thread of `pid` is stopped (state 'T' in /proc): SIGSTOP is asynchronous.
bool AllThreadsStopped(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  std::error_code ec;
  int threads = 0;
  for (const auto& t : std::filesystem::directory_iterator(dir, ec)) {
    std::ifstream in(t.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
    const char state = stat[paren + 2];
    if (state != 'T' && state != 't') return false;
    ++threads;
  }
  return !ec && threads > 0;
}

class FailOpenTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.Start()) << "hiqcached did not start"; }

  void Connect(std::chrono::milliseconds call_timeout) {
    call_timeout_ = call_timeout;
    ClientOptions o;
    o.target = daemon_.target();
    o.call_timeout = call_timeout;
    o.register_timeout = kRegisterTimeout;
    o.reregister_interval = 100ms;
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
    PoolOptions po;
    po.model = "fo-model";
    po.geometry = Geom(4, 4, 64);
    po.block_tokens = kBt;
    po.num_rows = 128;
    po.event_slots = 4;
    auto p = MakePool(*client_, po);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    pool_ = std::make_unique<TestPool>(std::move(p).value());
  }

  // Backs up `seed`'s 2 blocks from rows [0, 32), restores them into rows [64, 96) asynchronously
  // (gated by wait slot 1, done event 0) and checks the data. Before the gate opens the done slot
  // must be below the new ticket: a slot left over from an earlier registration or daemon must
  // never let a waiter through early. Returns false (with failures) when anything misses.
  bool RoundTrip(uint64_t seed) {
    const std::vector<BlockKey> keys = Keys(seed, 2, kBt);
    const std::vector<uint32_t> src = RowRange(0, 2 * kBt), dst = RowRange(64, 2 * kBt);
    FillRows(pool_->kv, seed, src, kBt);
    SentinelRows(pool_->kv, dst);
    BackupResult b = client_->Backup(pool_->handle, keys, src);
    EXPECT_TRUE(b.status.ok()) << b.status.ToString();
    EXPECT_EQ(b.held(), 2u);
    RestoreOptions ro;
    ro.wait_event = 1;
    ro.wait_value = pool_->events.Read(1) + 1;
    ro.done_event = 0;
    ro.sync = false;
    RestoreResult r = client_->Restore(pool_->handle, keys, dst, ro);
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.restored_blocks, 2u);
    EXPECT_LT(pool_->events.Read(0), r.ticket) << "done slot already past a new ticket";
    EXPECT_EQ(SentinelElements(pool_->kv, dst, 0), uint64_t{2} * kBt * 2 * 4 * 64);
    pool_->events.Store(1, ro.wait_value);
    Status w = pool_->events.Wait(0, r.ticket, 5s);
    EXPECT_TRUE(w.ok()) << w.ToString();
    CheckResult c = CheckRows(pool_->kv, seed, dst, kBt, false);
    EXPECT_TRUE(c.ok()) << c.first;
    return b.held() == 2 && r.restored_blocks == 2 && w.ok() && c.ok();
  }

  // Every data call misses, within call_timeout + slack, without throwing; the KV buffer is
  // untouched.
  void ExpectAllCallsMiss(const std::string& why, int rounds = 2) {
    SCOPED_TRACE(why);
    const auto* kv = static_cast<const uint8_t*>(pool_->kv.shm().data());
    const std::vector<uint8_t> before(kv, kv + pool_->kv.shm().size());
    const std::vector<BlockKey> keys = Keys(1, 2, kBt);
    const std::vector<uint32_t> rows = RowRange(0, 2 * kBt);
    const auto limit = call_timeout_ + kSlack;
    for (int round = 0; round < rounds; ++round) {  // a second round hits the rate limit
      SCOPED_TRACE("round " + std::to_string(round));
      auto t0 = Clock::now();
      LookupResult l;
      EXPECT_NO_THROW(l = client_->Lookup(pool_->handle, keys));
      EXPECT_LT(Clock::now() - t0, limit) << "Lookup";
      EXPECT_EQ(l.prefix_blocks, 0u);
      EXPECT_FALSE(l.status.ok()) << "Lookup answered while the daemon cannot";

      t0 = Clock::now();
      BackupResult b;
      EXPECT_NO_THROW(b = client_->Backup(pool_->handle, keys, rows));
      EXPECT_LT(Clock::now() - t0, limit) << "Backup";
      ASSERT_EQ(b.blocks.size(), 2u);
      for (BlockStatus s : b.blocks) EXPECT_EQ(s, BlockStatus::kNotStored);
      EXPECT_FALSE(b.status.ok());

      t0 = Clock::now();
      RestoreResult r;
      EXPECT_NO_THROW(r = client_->Restore(pool_->handle, keys, RowRange(64, 2 * kBt)));
      EXPECT_LT(Clock::now() - t0, limit) << "Restore";
      EXPECT_EQ(r.restored_blocks, 0u);
      EXPECT_FALSE(r.status.ok());

      t0 = Clock::now();
      StatusOr<uint32_t> e = Status();
      EXPECT_NO_THROW(e = client_->Evict(pool_->handle, keys));
      EXPECT_LT(Clock::now() - t0, limit) << "Evict";
      EXPECT_FALSE(e.ok());

      t0 = Clock::now();
      StatusOr<DaemonStats> s = Status();
      EXPECT_NO_THROW(s = client_->GetStats());
      EXPECT_LT(Clock::now() - t0, limit) << "GetStats";
      EXPECT_FALSE(s.ok());
    }
    EXPECT_TRUE(std::equal(before.begin(), before.end(), kv)) << "the KV buffer changed";
  }

  // Calls Lookup until it answers OK (the client reconnects and re-registers by itself).
  bool Recovers(std::chrono::milliseconds timeout = 5000ms) {
    const std::vector<BlockKey> keys = Keys(2, 1, kBt);
    return Eventually([&] { return client_->Lookup(pool_->handle, keys).status.ok(); }, timeout);
  }

  DaemonProcess daemon_{"32MiB"};
  std::chrono::milliseconds call_timeout_{0};
  std::unique_ptr<Client> client_;
  std::unique_ptr<TestPool> pool_;
};

TEST_F(FailOpenTest, StoppedDaemonMissesThenRestartedDaemonServesAgain) {
  ASSERT_NO_FATAL_FAILURE(Connect(1000ms));
  ASSERT_TRUE(RoundTrip(10));
  ASSERT_TRUE(RoundTrip(11));
  const uint64_t old_id = pool_->info.pool_id;

  EXPECT_EQ(daemon_.Stop(), 0);
  ExpectAllCallsMiss("daemon stopped");
  // A pool registered while the daemon is down is kept pending.
  auto pending = client_->RegisterPool(pool_->spec, /*pending_if_unavailable=*/true);
  ASSERT_TRUE(pending.ok()) << pending.status().ToString();
  EXPECT_EQ(client_->PoolInfo(*pending).status().code(), hiqcache::StatusCode::kUnavailable);

  ASSERT_TRUE(daemon_.Start()) << "hiqcached did not restart on the same socket";
  ASSERT_TRUE(Recovers()) << "the client did not re-register with the restarted daemon";
  auto info = client_->PoolInfo(pool_->handle);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_NE(info->pool_id, old_id);
  EXPECT_EQ(info->namespace_id, pool_->info.namespace_id);
  // client.h: after a re-registration the client zeroes the pool's HOST event slots.
  EXPECT_EQ(pool_->events.Read(0), 0u);
  EXPECT_TRUE(RoundTrip(12));

  LookupResult l = client_->Lookup(*pending, Keys(12, 2, kBt));
  EXPECT_TRUE(l.status.ok()) << l.status.ToString();
  EXPECT_EQ(l.prefix_blocks, 2u);  // same namespace as pool_
  EXPECT_TRUE(client_->PoolInfo(*pending).ok());
}

TEST_F(FailOpenTest, KilledDaemonRestartsOnStaleSocket) {
  ASSERT_NO_FATAL_FAILURE(Connect(1000ms));
  ASSERT_TRUE(RoundTrip(20));
  daemon_.Kill();  // SIGKILL: the socket file stays behind
  ASSERT_TRUE(std::filesystem::exists(daemon_.socket_path()));
  ExpectAllCallsMiss("daemon killed");
  ASSERT_TRUE(daemon_.Start()) << "hiqcached did not restart over the stale socket";
  ASSERT_TRUE(Recovers());
  EXPECT_TRUE(RoundTrip(21));
}

TEST_F(FailOpenTest, HungDaemonCallsReturnWithinDeadline) {
  ASSERT_NO_FATAL_FAILURE(Connect(300ms));
  ASSERT_TRUE(RoundTrip(30));
  ASSERT_EQ(::kill(daemon_.pid(), SIGSTOP), 0);
  ASSERT_TRUE(Eventually([&] { return AllThreadsStopped(daemon_.pid()); }));
  ExpectAllCallsMiss("daemon stopped with SIGSTOP", 1);
  ASSERT_EQ(::kill(daemon_.pid(), SIGCONT), 0);
  ASSERT_TRUE(Recovers());
  EXPECT_TRUE(RoundTrip(31));
}

TEST_F(FailOpenTest, SigtermFinishesInFlightWorkThenRefuses) {
  ASSERT_NO_FATAL_FAILURE(Connect(3000ms));
  const std::vector<BlockKey> keys = Keys(40, 2, kBt);
  const std::vector<uint32_t> rows = RowRange(0, 2 * kBt);
  FillRows(pool_->kv, 40, rows, kBt);
  // A backup that cannot finish before the test stores its wait value. Asynchronous: its reply
  // says the daemon has queued it (blocks are reserved only once the task starts, so GetStats
  // cannot tell).
  BackupOptions bo;
  bo.wait_event = 1;
  bo.wait_value = pool_->events.Read(1) + 1;
  bo.done_event = 2;
  bo.sync = false;
  BackupResult in_flight = client_->Backup(pool_->handle, keys, rows, bo);
  ASSERT_TRUE(in_flight.status.ok()) << in_flight.status.ToString();
  ASSERT_GT(in_flight.ticket, 0u);
  EXPECT_LT(pool_->events.Read(2), in_flight.ticket) << "done before its wait value";
  // Before SIGTERM: a draining daemon may take no new sessions.
  auto session = SessionContext::Open(daemon_.target());
  if (!session.ok()) pool_->events.Store(1, bo.wait_value);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  ASSERT_EQ(::kill(daemon_.pid(), SIGTERM), 0);
  std::this_thread::sleep_for(200ms);

  // Draining: new work is refused with UNAVAILABLE.
  auto stub =
      v1::Cache::NewStub(grpc::CreateChannel(daemon_.target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 2s);
  session->Attach(&ctx);
  v1::LookupRequest lr;
  lr.set_pool_id(pool_->info.pool_id);
  lr.add_keys(std::string(reinterpret_cast<const char*>(keys[0].data()), 16));
  v1::LookupResponse lresp;
  grpc::Status st = stub->Lookup(&ctx, lr, &lresp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  auto t0 = Clock::now();
  LookupResult l = client_->Lookup(pool_->handle, keys);
  EXPECT_LT(Clock::now() - t0, call_timeout_ + kSlack);
  EXPECT_EQ(l.prefix_blocks, 0u);
  EXPECT_EQ(l.status.code(), hiqcache::StatusCode::kUnavailable) << l.status.ToString();

  // The queued backup still runs to completion, and succeeds.
  pool_->events.Store(1, bo.wait_value);
  Status done = pool_->events.Wait(2, in_flight.ticket, 10s);
  EXPECT_TRUE(done.ok()) << "in-flight backup: " << done.ToString();
  EXPECT_EQ(daemon_.Stop(), 0) << "hiqcached did not exit 0 after SIGTERM";
  ExpectAllCallsMiss("daemon exited after SIGTERM");
  // It was stored for real: the restarted daemon rebuilt both blocks from its pool.
  ASSERT_TRUE(daemon_.Start());
  EXPECT_TRUE(
      Eventually([&] { return client_->Lookup(pool_->handle, keys).prefix_blocks == 2; }, 5s))
      << "the backup finished during the drain is gone after a restart";
}

}  // namespace
}  // namespace hiqcache::it

namespace hiqcache::it {
namespace {

// `hiqctl drain` (the Drain RPC): health turns NOT_SERVING, new work is refused with UNAVAILABLE
// (so clients fail open), queued work is reported, and the daemon still stops cleanly.
TEST(DrainTest, DrainRefusesNewWorkAndTurnsHealthNotServing) {
  DaemonProcess daemon("64MiB");
  ASSERT_TRUE(daemon.Start());
  auto client = Connect(daemon.target());
  ASSERT_NE(client, nullptr);
  PoolOptions o;
  o.geometry = Geom(2, 2, 64);
  auto p = MakePool(*client, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::vector<BlockKey> keys = Keys(5, 1, o.block_tokens);
  const std::vector<uint32_t> rows = PickRows(o.num_rows, o.block_tokens, 5);
  FillRows(p->kv, 5, rows, o.block_tokens);
  ASSERT_EQ(client->Backup(p->handle, keys, rows).held(), 1u);

  auto channel = grpc::CreateChannel(daemon.target(), grpc::InsecureChannelCredentials());
  auto stub = v1::Cache::NewStub(channel);
  // Drain is for admins (we run as root) and, like pool calls, named by a session.
  auto session = SessionContext::Open(daemon.target());
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  // Nothing is queued: the pending count is 0 at once, or within moments (a sync backup's reply
  // may come just before its task is counted done). Drain is idempotent.
  uint64_t pending = ~uint64_t{0};
  EXPECT_TRUE(Eventually(
      [&] {
        grpc::ClientContext ctx;
        session->Attach(&ctx);
        v1::DrainResponse resp;
        const grpc::Status st = stub->Drain(&ctx, v1::DrainRequest(), &resp);
        EXPECT_TRUE(st.ok()) << st.error_message();
        pending = st.ok() ? resp.pending_tasks() : pending;
        return st.ok() && pending == 0;
      },
      2s))
      << "pending_tasks stays " << pending;
  {
    grpc::ClientContext ctx;
    session->Attach(&ctx);
    v1::LookupRequest req;
    req.set_pool_id(p->info.pool_id);
    req.add_keys(std::string(reinterpret_cast<const char*>(keys[0].data()), 16));
    v1::LookupResponse resp;
    grpc::Status st = stub->Lookup(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  }
  LookupResult miss = client->Lookup(p->handle, keys);
  EXPECT_EQ(miss.prefix_blocks, 0u);
  EXPECT_FALSE(miss.status.ok());
  EXPECT_TRUE(client->GetStats().ok()) << "stats stay readable while draining";
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace
}  // namespace hiqcache::it
