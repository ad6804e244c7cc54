// No client memory access can kill the daemon, and memory comes with proof of access, against
// the real hiqcached:
//  - a client truncates its KV object after registering, before a Backup or a Restore, or while
//    a large Backup runs; or its event object before the daemon signals an asynchronous request.
//    Without the SIGBUS guard each of these killed the daemon. Now the request fails (or the
//    pool is failed: later requests answer FAILED_PRECONDITION naming the buffer), the daemon
//    lives, and a second client's round trip in the same daemon works;
//  - release followed by truncate: an engine frees (truncates) its KV buffer right after
//    ReleasePool. With the default release timeout ReleasePool returns after the pool's work
//    ran (every queued backup is committed by then); with a release timeout too short for the
//    work, queued work then meets a truncated buffer: the daemon must survive that too;
//  - the same with a sparse buffer larger than RAM + swap (the guard replaces the range without
//    committing memory for it);
//  - a sparse 64 MiB event object is not faulted into the daemon at registration;
//  - the daemon's own pool object (its name is in GetStats) is refused as a client buffer;
//  - memory a client lends but never wrote is faulted in by the daemon's accesses (on the
//    daemon's memory cgroup): those bytes are charged to the client, up to
//    max_faulted_bytes_per_client, and beyond it the work is refused with nothing touched.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "daemon_process.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;

constexpr uint32_t kBt = 16;

// Whether process `pid` exists and is not a zombie (a daemon killed by SIGBUS is a zombie until
// DaemonProcess reaps it).
bool Alive(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

// Truncates the shm object `name` to `bytes`, as a client freeing or shrinking its memory does.
// The caller must not touch its own mapping of the object past `bytes` afterwards.
bool Truncate(const std::string& name, off_t bytes = 0) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return false;
  const bool ok = ::ftruncate(fd, bytes) == 0;
  ::close(fd);
  return ok;
}

bool Has(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string::npos;
}

class MemoryIsolationTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> extra = {}) {
    extra.insert(extra.end(), {"--prefault", "false"});
    daemon_ = std::make_unique<DaemonProcess>("256MiB", extra);
    ASSERT_TRUE(daemon_->Start());
    victim_ = it::Connect(daemon_->target(), 20s);
    bystander_ = it::Connect(daemon_->target(), 20s);
    ASSERT_NE(victim_, nullptr);
    ASSERT_NE(bystander_, nullptr);
  }
  void TearDown() override {
    if (daemon_ != nullptr && daemon_->running() && Alive(daemon_->pid())) {
      EXPECT_EQ(daemon_->Stop(), 0);
    }
  }

  static it::PoolOptions Options(uint32_t layers = 2, uint32_t rows = 16 * kBt,
                                 uint32_t event_slots = 0) {
    it::PoolOptions o;
    o.model = "rob-memory";
    o.geometry = it::Geom(layers, 2, 64);
    o.block_tokens = kBt;
    o.num_rows = rows;
    o.event_slots = event_slots;
    return o;
  }
  it::TestPool Pool(Client& c, const it::PoolOptions& o) {
    auto p = it::MakePool(c, o);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return std::move(p).value();
  }

  // A backup and a restore of 4 blocks through a fresh pool of the bystander, checked.
  void ExpectBystanderRoundTrip(uint64_t seed) {
    SCOPED_TRACE("bystander round trip");
    ASSERT_TRUE(Alive(daemon_->pid())) << "hiqcached died";
    it::TestPool p = Pool(*bystander_, Options());
    const auto keys = IndependentKeys(seed, 0, 4);
    const auto src = it::RowRange(0, 4 * kBt), dst = it::RowRange(4 * kBt, 4 * kBt);
    it::FillRows(p.kv, seed, src, kBt);
    BackupResult b = bystander_->Backup(p.handle, keys, src);
    ASSERT_TRUE(b.status.ok()) << b.status.ToString();
    ASSERT_EQ(b.held(), 4u);
    RestoreResult r = bystander_->Restore(p.handle, keys, dst);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_EQ(r.restored_blocks, 4u);
    it::CheckResult c = it::CheckRows(p.kv, seed, dst, kBt, false);
    EXPECT_TRUE(c.ok()) << c.first;
    EXPECT_TRUE(bystander_->ReleasePool(p.handle).ok());
  }

  // The pool's next sync backup fails: its buffer or event object is gone.
  void ExpectPoolFailed(it::TestPool& p, const std::string& field) {
    const auto keys = IndependentKeys(999, 0, 1);
    const auto rows = it::RowRange(0, kBt);
    BackupResult b = victim_->Backup(p.handle, keys, rows);
    EXPECT_EQ(b.status.code(), StatusCode::kFailedPrecondition) << b.status.ToString();
    EXPECT_TRUE(Has(b.status, field + ": the client's shared memory shrank under the daemon"))
        << b.status.ToString();
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> victim_, bystander_;
};

TEST_F(MemoryIsolationTest, KvTruncatedBeforeBackup) {
  Start();
  it::TestPool p = Pool(*victim_, Options());
  const auto keys = IndependentKeys(1, 0, 4);
  const auto rows = it::RowRange(0, 4 * kBt);
  it::FillRows(p.kv, 1, rows, kBt);
  ASSERT_TRUE(Truncate(p.kv.shm().name()));
  BackupResult b = victim_->Backup(p.handle, keys, rows);
  ASSERT_TRUE(Alive(daemon_->pid())) << "hiqcached died of the truncated KV object (SIGBUS)";
  EXPECT_EQ(b.status.code(), StatusCode::kFailedPrecondition) << b.status.ToString();
  EXPECT_TRUE(Has(b.status, "buffers[0]: the client's shared memory shrank under the daemon"))
      << b.status.ToString();
  // Nothing was committed: the zeros read from the lost pages are no KV.
  it::TestPool other = Pool(*bystander_, Options());
  EXPECT_EQ(bystander_->Lookup(other.handle, keys).prefix_blocks, 0u);
  ExpectPoolFailed(p, "buffers[0]");
  ExpectBystanderRoundTrip(2);
}

// MemTotal + SwapTotal of this machine, in bytes (0 when /proc/meminfo cannot be read).
uint64_t RamAndSwapBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kib = 0, total = 0;
  while (in >> key >> kib >> unit) {
    if (key == "MemTotal:" || key == "SwapTotal:") total += kib << 10;
  }
  return total;
}

// A sparse, unsealed buffer larger than RAM + swap (64 GiB here at least), backed up from near
// its end, then truncated to 0: the guard must replace the whole range without a commit of that
// size (the daemon died of SIGBUS when it could not).
TEST_F(MemoryIsolationTest, KvLargerThanRamAndSwapTruncatedBeforeBackup) {
  const uint64_t row_bytes = 2 * 2 * 2 * 64 * 2;  // layers x K|V x heads x dim x bf16
  const uint64_t bytes = std::max<uint64_t>(64ull << 30, 2 * RamAndSwapBytes());
  const uint32_t rows = static_cast<uint32_t>(bytes / row_bytes / (16 * kBt) * (16 * kBt));
  Start();
  it::TestPool p = Pool(*victim_, Options(2, rows));
  ASSERT_GE(uint64_t{rows} * row_bytes, bytes - (16 * kBt) * row_bytes);
  const auto keys = IndependentKeys(11, 0, 4);
  const auto rows_at_end = it::RowRange(rows - 4 * kBt, 4 * kBt);
  it::FillRows(p.kv, 11, rows_at_end, kBt);
  BackupResult first = victim_->Backup(p.handle, keys, rows_at_end);
  ASSERT_TRUE(first.status.ok()) << first.status.ToString();
  ASSERT_EQ(first.held(), 4u);
  ASSERT_TRUE(Truncate(p.kv.shm().name()));
  const auto more = IndependentKeys(12, 0, 4);
  BackupResult b = victim_->Backup(p.handle, more, rows_at_end);
  ASSERT_TRUE(Alive(daemon_->pid()))
      << "hiqcached died of the truncated " << (bytes >> 30) << " GiB KV object (SIGBUS)";
  EXPECT_EQ(b.status.code(), StatusCode::kFailedPrecondition) << b.status.ToString();
  EXPECT_TRUE(Has(b.status, "buffers[0]: the client's shared memory shrank under the daemon"))
      << b.status.ToString();
  ExpectBystanderRoundTrip(13);
}

// RssShmem of process `pid` in bytes (0 when unreadable).
uint64_t RssShmemBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("RssShmem:", 0) == 0) return std::stoull(line.substr(9)) << 10;
  }
  return 0;
}

// A sparse event object of 2^20 slots (64 MiB, the most a pool may name) costs the daemon
// nothing at registration: it reads only the parts the client wrote (each faulted page of a
// hole would be a page allocated on the daemon's account: +64 MiB per registration before).
TEST_F(MemoryIsolationTest, SparseEventSlotsAreNotFaultedIn) {
  Start();
  const uint64_t before = RssShmemBytes(daemon_->pid());
  std::vector<it::TestPool> pools;
  for (int i = 0; i < 4; ++i) pools.push_back(Pool(*victim_, Options(2, 16 * kBt, 1u << 20)));
  const uint64_t after = RssShmemBytes(daemon_->pid());
  EXPECT_LT(after, before + (16ull << 20))
      << "4 registrations of 64 MiB sparse event objects grew the daemon's shared RSS by "
      << ((after - before) >> 20) << " MiB";
  // The slots still work: a synchronous backup signals its done slot, far into the object.
  const auto keys = IndependentKeys(21, 0, 1);
  const auto rows = it::RowRange(0, kBt);
  it::FillRows(pools[0].kv, 21, rows, kBt);
  BackupOptions o;
  o.done_event = (1 << 20) - 1;
  BackupResult b = victim_->Backup(pools[0].handle, keys, rows, o);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_GE(pools[0].events.Read(static_cast<uint32_t>(o.done_event)), b.ticket);
  ExpectBystanderRoundTrip(22);
}

// Bytes the shm object `name` has allocated (what faults put into it).
uint64_t AllocatedBytes(const std::string& name) {
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return ~uint64_t{0};
  struct stat st;
  const int rc = ::fstat(fd, &st);
  ::close(fd);
  return rc == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : ~uint64_t{0};
}

TEST_F(MemoryIsolationTest, MemoryFaultedForAClientIsChargedToIt) {
  Start({"--max-faulted-bytes-per-client", "512KiB"});
  it::TestPool p = Pool(*victim_, Options(2, 128 * kBt));  // 2,048 rows, never written
  const std::string name = p.kv.shm().name();
  ASSERT_EQ(AllocatedBytes(name), 0u);
  // 8 blocks of rows the client never wrote (128 KiB of KV): within the quota, backed up (zeros
  // are KV too), and their pages are now allocated, by the daemon's reads.
  const auto first = it::RowRange(0, 8 * kBt);
  BackupResult b = victim_->Backup(p.handle, IndependentKeys(31, 0, 8), first);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_EQ(b.held(), 8u);
  const uint64_t faulted = AllocatedBytes(name);
  EXPECT_GE(faulted, 128u << 10);
  // 64 more (1 MiB): beyond the quota. Refused, naming it, and none of their pages is touched.
  const auto more = it::RowRange(8 * kBt, 64 * kBt);
  b = victim_->Backup(p.handle, IndependentKeys(32, 0, 64), more);
  EXPECT_FALSE(b.status.ok() && b.held() > 0) << "backed up " << b.held() << " blocks";
  EXPECT_TRUE(Has(b.status, "max_faulted_bytes_per_client")) << b.status.ToString();
  EXPECT_EQ(AllocatedBytes(name), faulted) << "the refused backup faulted pages in";
  // The client's own written memory costs nothing: the same rows, written, are backed up.
  it::FillRows(p.kv, 33, more, kBt);
  b = victim_->Backup(p.handle, IndependentKeys(33, 0, 64), more);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_EQ(b.held(), 64u);
  // A restore into untouched rows is charged too: 8 blocks fit, then nothing more does.
  RestoreResult r =
      victim_->Restore(p.handle, IndependentKeys(33, 0, 8), it::RowRange(72 * kBt, 8 * kBt));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 8u);
  const uint64_t after_restore = AllocatedBytes(name);
  r = victim_->Restore(p.handle, IndependentKeys(33, 0, 32), it::RowRange(80 * kBt, 32 * kBt));
  EXPECT_EQ(r.restored_blocks, 0u) << r.status.ToString();
  EXPECT_EQ(AllocatedBytes(name), after_restore);
  // Released, the pool gives its charges back: the same client is served in full again.
  ASSERT_TRUE(victim_->ReleasePool(p.handle).ok());
  it::TestPool q = Pool(*victim_, Options(2, 64 * kBt));
  b = victim_->Backup(q.handle, IndependentKeys(34, 0, 16), it::RowRange(0, 16 * kBt));
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_EQ(b.held(), 16u);
  ASSERT_TRUE(victim_->ReleasePool(q.handle).ok());
  ExpectBystanderRoundTrip(35);
}

TEST_F(MemoryIsolationTest, KvTruncatedBeforeRestore) {
  Start();
  it::TestPool p = Pool(*victim_, Options());
  const auto keys = IndependentKeys(3, 0, 4);
  const auto rows = it::RowRange(0, 4 * kBt);
  it::FillRows(p.kv, 3, rows, kBt);
  ASSERT_EQ(victim_->Backup(p.handle, keys, rows).held(), 4u);
  ASSERT_TRUE(Truncate(p.kv.shm().name()));
  RestoreResult r = victim_->Restore(p.handle, keys, rows);
  ASSERT_TRUE(Alive(daemon_->pid())) << "hiqcached died of the truncated KV object (SIGBUS)";
  EXPECT_EQ(r.status.code(), StatusCode::kFailedPrecondition) << r.status.ToString();
  EXPECT_TRUE(Has(r.status, "buffers[0]: the client's shared memory shrank"))
      << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 0u);
  // The cached blocks are intact: another engine of the namespace restores them.
  it::TestPool other = Pool(*bystander_, Options());
  RestoreResult again = bystander_->Restore(other.handle, keys, rows);
  ASSERT_EQ(again.restored_blocks, 4u) << again.status.ToString();
  EXPECT_TRUE(it::CheckRows(other.kv, 3, rows, kBt, false).ok());
  ExpectPoolFailed(p, "buffers[0]");
  ExpectBystanderRoundTrip(4);
}

TEST_F(MemoryIsolationTest, EventObjectTruncatedBeforeAsyncSignals) {
  Start();
  it::TestPool p = Pool(*victim_, Options(2, 16 * kBt, /*event_slots=*/8));
  const auto keys = IndependentKeys(5, 0, 4);
  const auto rows = it::RowRange(0, 4 * kBt);
  it::FillRows(p.kv, 5, rows, kBt);
  ASSERT_TRUE(Truncate(p.events.name()));
  // Answered once queued; the daemon signals slot 0 (and then 1..3, 4) when the work is done.
  BackupOptions bo;
  bo.done_event = 0;
  bo.sync = false;
  BackupResult b = victim_->Backup(p.handle, keys, rows, bo);
  EXPECT_TRUE(b.status.ok()) << b.status.ToString();
  RestoreOptions ro;
  ro.layer_event_base = 1;
  ro.done_event = 4;
  ro.sync = false;
  (void)victim_->Restore(p.handle, keys, it::RowRange(4 * kBt, 4 * kBt), ro);
  // The pool's next request runs after both (one strand per pool) and finds the pool failed.
  ExpectPoolFailed(p, "events");
  ASSERT_TRUE(Alive(daemon_->pid())) << "hiqcached died of the truncated event object (SIGBUS)";
  ExpectBystanderRoundTrip(6);
}

TEST_F(MemoryIsolationTest, KvTruncatedUnderARunningBackup) {
  Start();
  // 1,024 rows of 4 layers x 8 heads x 128: 16 MiB of KV, 64 blocks (~8 MiB encoded).
  it::PoolOptions o = Options(4, 64 * kBt);
  o.geometry = it::Geom(4, 8, 128);
  it::TestPool p = Pool(*victim_, o);
  const auto rows = it::RowRange(0, 64 * kBt);
  it::FillRows(p.kv, 7, rows, kBt);
  for (int round = 0; round < 3 && Alive(daemon_->pid()); ++round) {
    BackupOptions bo;
    bo.sync = false;
    // Three requests queued back to back; the truncation lands in one of them.
    for (int i = 0; i < 3; ++i) {
      (void)victim_->Backup(p.handle, IndependentKeys(100 + round * 3 + i, 0, 64), rows, bo);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2 + 5 * round));
    if (round == 0) ASSERT_TRUE(Truncate(p.kv.shm().name()));
  }
  ExpectPoolFailed(p, "buffers[0]");
  ASSERT_TRUE(Alive(daemon_->pid())) << "hiqcached died of the truncated KV object (SIGBUS)";
  ExpectBystanderRoundTrip(8);
}

TEST_F(MemoryIsolationTest, ReleaseWaitsForQueuedWorkThenTruncateIsHarmless) {
  Start();
  it::PoolOptions o = Options(4, 32 * kBt);
  o.geometry = it::Geom(4, 8, 128);
  it::TestPool p = Pool(*victim_, o);
  const auto rows = it::RowRange(0, 32 * kBt);
  it::FillRows(p.kv, 9, rows, kBt);
  BackupOptions bo;
  bo.sync = false;
  std::vector<std::vector<BlockKey>> keys;
  for (int i = 0; i < 6; ++i) {
    keys.push_back(IndependentKeys(200 + i, 0, 32));
    BackupResult b = victim_->Backup(p.handle, keys.back(), rows, bo);
    ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  }
  const PoolSpec spec = p.spec;
  ASSERT_TRUE(victim_->ReleasePool(p.handle).ok());
  // The engine may free its buffer now (docs/design.md): the work it queued is done, and none runs.
  ASSERT_TRUE(Truncate(p.kv.shm().name()));
  it::TestPool other = Pool(*bystander_, o);
  for (const auto& k : keys) {
    EXPECT_EQ(bystander_->Lookup(other.handle, k).prefix_blocks, 32u)
        << "a backup queued before ReleasePool was not committed when it returned";
  }
  std::this_thread::sleep_for(100ms);
  ASSERT_TRUE(Alive(daemon_->pid())) << "hiqcached died: work ran after ReleasePool returned";
  ExpectBystanderRoundTrip(10);
}

TEST_F(MemoryIsolationTest, TruncateAfterAReleaseThatTimedOutIsSurvived) {
  // A release timeout far below the queued work: ReleasePool answers DEADLINE_EXCEEDED (the
  // buffers stay in use), and a buggy engine frees its buffer anyway.
  Start({"--release-timeout-ms", "1"});
  it::PoolOptions o = Options(4, 64 * kBt);
  o.geometry = it::Geom(4, 8, 128);
  it::TestPool p = Pool(*victim_, o);
  const auto rows = it::RowRange(0, 64 * kBt);
  it::FillRows(p.kv, 11, rows, kBt);
  BackupOptions bo;
  bo.sync = false;
  for (int i = 0; i < 8; ++i) {
    (void)victim_->Backup(p.handle, IndependentKeys(300 + i, 0, 64), rows, bo);
  }
  (void)victim_->ReleasePool(p.handle);
  ASSERT_TRUE(Truncate(p.kv.shm().name()));
  // Let the queued work meet the truncated buffer.
  std::this_thread::sleep_for(kSanitized ? 3s : 1s);
  ASSERT_TRUE(Alive(daemon_->pid())) << "hiqcached died of the truncated KV object (SIGBUS)";
  ExpectBystanderRoundTrip(12);
}

// hiqcached tells the HOST backend its pool object at start (HostBackend::SetPoolObject): a
// client naming the pool as its buffer would read and write every tenant's cached payloads.
TEST_F(MemoryIsolationTest, DaemonsOwnPoolIsRefused) {
  Start();
  auto stats = bystander_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  ASSERT_EQ(stats->shm_name, daemon_->shm_name());
  // An ordinary HOST spec whose buffer names the daemon's pool: with 64-byte CODEC_RAW rows that
  // was arbitrary read and write of every cached block.
  auto kv = HostKvPool::Create(it::Geom(1, 1, 32), KvLayout::kSglang, 64);
  ASSERT_TRUE(kv.ok());
  PoolSpec spec = MakeHostPoolSpec("rob-memory-own-pool", *kv, kBt, nullptr, Codec::kRaw);
  ASSERT_EQ(spec.buffers.size(), 1u);
  spec.buffers[0].host_shm_name = stats->shm_name;
  auto reg = victim_->RegisterPool(spec);
  ASSERT_FALSE(reg.ok()) << "a client registered hiqcached's own pool as its KV buffer";
  EXPECT_EQ(reg.status().code(), StatusCode::kPermissionDenied) << reg.status().ToString();
  EXPECT_TRUE(Has(reg.status(), "buffers[0]")) << reg.status().ToString();
  EXPECT_TRUE(Has(reg.status(), "own pool")) << reg.status().ToString();
  ExpectBystanderRoundTrip(14);
}

}  // namespace
}  // namespace hiqcache::rob
