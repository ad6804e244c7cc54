// Completion through ticket slots on a real GPU (label gpu; skips, with the reason, where no CUDA
// device is usable). docs/design.md "Completion: ticket slots".
//
// As cuda_client_test, the test process starts hiqcached --device cuda and re-executes this
// binary as client processes (gtest filter CudaEventsChild.*, which skip unless
// HIQ_GPU_CHILD_TARGET is set): a process cannot open its own IPC handles. Pools are small
// (4 layers, 2 heads of 128, RAW codec, so restores are checked bit for bit); their slots are
// CudaTicketSlots.
//
//   WaitValueWrittenLate         the engine's stream writes the wait_value (StreamWrite) only
//                                when the test opens a gate kernel: the asynchronous Restore is
//                                answered at once, the daemon writes nothing before the gate
//                                opens (it neither runs early nor holds a worker: another pool's
//                                sync backup completes meanwhile), and the restore is correct
//                                after it.
//   DaemonKilledWhileAStreamWaits  the daemon is killed with SIGKILL while an engine stream waits
//                                (StreamWait) on the done slot of a restore the daemon holds: the
//                                client library releases the slot with the failed bit and the
//                                stream completes within seconds.
//   ClientKilledWithAWaitPending a client releases a pool whose restore waits for a value that
//                                never comes, and another dies with such a wait pending: the
//                                daemon survives, drops the pools, and serves five new clients
//                                one after the other (nothing of its staging stays held).
//   FiveDeadEnginesThenASixth    the daemon's staging is one slab pair: five clients each leave a
//                                restore waiting for a value that never comes, another round-trips
//                                while they wait, the five are SIGKILLed, the daemon drops their
//                                pools, and a sixth client round-trips (nothing of theirs holds
//                                the slabs).
//   TwoClientsWaitingOnEachOther the daemon has ONE transfer worker. Two clients (TP ranks)
//                                each write their wait_value behind a kernel that waits for a
//                                flag the other client sets only once its own request has been
//                                answered, as ranks wait for each other in an all-reduce. A
//                                worker that waited for the device would deadlock both.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "cuda_handles.h"
#include "cuda_runtime_check.h"
#include "gpu_daemon_process.h"
#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/cuda_export.h"
#include "kv_check.h"

namespace hiqcache {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint32_t kLayers = 4, kHeads = 2, kDim = 128, kSlots = 256, kBlockTokens = 16;
constexpr uint32_t kBlocks = 4, kTokens = kBlocks * kBlockTokens;  // 64
constexpr uint32_t kRowElems = kHeads * kDim;
constexpr int32_t kWait = kLayers, kDone = kLayers + 1;
constexpr uint32_t kNumSlots = kLayers + 2;
constexpr uint32_t kSrc = 0, kDst = 128;  // first rows backed up from / restored into

#define HIQ_ASSERT_OK(expr)                                         \
  do {                                                              \
    const ::hiqcache::Status hiq_s_ = (expr);                       \
    ASSERT_TRUE(hiq_s_.ok()) << #expr << ": " << hiq_s_.ToString(); \
  } while (0)
#define HIQ_ASSERT_CUDA(expr)                                                      \
  do {                                                                             \
    const cudaError_t hiq_e_ = (expr);                                             \
    ASSERT_EQ(hiq_e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(hiq_e_); \
  } while (0)

using gpu_test::ChildEnv;
using gpu_test::GetChildEnv;
using gpu_test::Touch;

std::vector<uint32_t> RowsFrom(uint32_t first) {
  std::vector<uint32_t> rows(kTokens);
  for (uint32_t i = 0; i < kTokens; ++i) rows[i] = first + i;
  return rows;
}

// A mapped pinned host word the GPU can spin on (the gate of a late write).
class Gate {
 public:
  void Init() {
    HIQ_ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host_), 4, cudaHostAllocMapped));
    *host_ = 0;
    HIQ_ASSERT_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_), host_, 0));
  }
  ~Gate() {
    if (host_ != nullptr) {
      Open();
      cudaFreeHost(host_);
    }
  }
  const volatile uint32_t* device() const { return dev_; }
  void Open() { *reinterpret_cast<volatile uint32_t*>(host_) = 1; }

 private:
  uint32_t* host_ = nullptr;
  uint32_t* dev_ = nullptr;
};

// One engine process's KV pool in GPU memory, its ticket slots and its stream.
class EventsClient {
 public:
  void Init(const ChildEnv& env, const std::string& model, uint32_t tp_rank = 0,
            uint32_t tp_size = 1) {
    std::string why;
    ASSERT_TRUE(CudaClientAvailable(&why)) << why;
    HIQ_ASSERT_CUDA(cudaSetDevice(0));
    Geometry g;
    g.num_layers = kLayers;
    g.num_kv_heads = kHeads;
    g.head_dim = kDim;
    g.tp_rank = tp_rank;
    g.tp_size = tp_size;
    auto kv = CudaKvPool::Allocate(0, g, KvLayout::kSglang, kSlots);
    HIQ_ASSERT_OK(kv.status());
    kv_ = std::move(kv).value();
    auto slots = CudaTicketSlots::Create(0, kNumSlots);
    HIQ_ASSERT_OK(slots.status());
    slots_ = std::move(slots).value();
    auto stream = kernels::CudaStream::Create(0);
    HIQ_ASSERT_OK(stream.status());
    stream_ = std::move(stream).value();
    ClientOptions options;
    options.target = env.target;
    options.call_timeout = milliseconds(30000);
    auto client = Client::Connect(options);
    HIQ_ASSERT_OK(client.status());
    client_ = std::move(client).value();
    auto handle =
        client_->RegisterPool(MakeCudaPoolSpec(model, kv_, kBlockTokens, &slots_, Codec::kRaw));
    HIQ_ASSERT_OK(handle.status());
    pool_ = *handle;
    std::vector<uint32_t> tokens(kTokens);
    for (uint32_t i = 0; i < kTokens; ++i) tokens[i] = i * 17 + 3;
    keys_ = ComputeBlockKeys(tokens, kBlockTokens, model + "-" + std::to_string(env.seed));
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        HIQ_ASSERT_OK(gputest::LaunchFillPattern(kv_.Head(l, p, 0, 0), uint64_t{kSlots} * kRowElems,
                                                 env.seed, l * 2 + p, stream_.get()));
      }
    }
    HIQ_ASSERT_OK(stream_.Synchronize());
  }

  void BackupSync() {
    BackupOptions o;
    o.sync = true;
    BackupResult r = client_->Backup(pool_, keys_, RowsFrom(kSrc), o);
    HIQ_ASSERT_OK(r.status);
    for (BlockStatus s : r.blocks) ASSERT_EQ(s, BlockStatus::kStored);
  }

  // Rows [kDst, kDst + kTokens) of every layer and plane = 0xFFFF.
  void ClearDestination() {
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        HIQ_ASSERT_CUDA(cudaMemset(kv_.Head(l, p, kDst, 0), 0xFF, size_t{kTokens} * kRowElems * 2));
      }
    }
  }

  // How many rows of the destination differ from the source rows (RAW: bit-exact) and how many
  // still hold the 0xFFFF sentinel.
  void Compare(uint64_t* differ, uint64_t* sentinel) {
    std::vector<uint16_t> src(size_t{kTokens} * kRowElems), dst(src.size());
    *differ = *sentinel = 0;
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        HIQ_ASSERT_CUDA(cudaMemcpy(src.data(), kv_.Head(l, p, kSrc, 0), src.size() * 2,
                                   cudaMemcpyDeviceToHost));
        HIQ_ASSERT_CUDA(cudaMemcpy(dst.data(), kv_.Head(l, p, kDst, 0), dst.size() * 2,
                                   cudaMemcpyDeviceToHost));
        for (uint32_t t = 0; t < kTokens; ++t) {
          const size_t off = size_t{t} * kRowElems;
          *differ += std::memcmp(src.data() + off, dst.data() + off, kRowElems * 2) != 0;
          bool all_ff = true;
          for (uint32_t i = 0; i < kRowElems; ++i) all_ff &= dst[off + i] == 0xFFFF;
          *sentinel += all_ff;
        }
      }
    }
  }

  // A fresh wait value for the wait slot: one past its ticket part.
  uint64_t NextWaitValue() const { return (slots_.Read(kWait) & ~kEventFailedBit) + 1; }
  // Enqueues, on the engine's stream, a gate kernel (open when `flag` is set, or after
  // `timeout_ns`) and behind it the store of `value` into the wait slot: a wait_value that the
  // engine's stream writes late.
  void WriteWaitValueBehind(const volatile uint32_t* flag, uint64_t timeout_ns, uint64_t value) {
    HIQ_ASSERT_OK(gputest::LaunchSpinUntil(flag, timeout_ns, stream()));
    HIQ_ASSERT_OK(slots_.StreamWrite(stream(), kWait, value));
  }

  Client& client() { return *client_; }
  PoolHandle pool() const { return pool_; }
  const std::vector<BlockKey>& keys() const { return keys_; }
  const CudaTicketSlots& slots() const { return slots_; }
  CUstream_st* stream() const { return stream_.get(); }
  Status SyncStream() const { return stream_.Synchronize(); }
  void Release() {
    if (client_ && pool_.valid()) HIQ_ASSERT_OK(client_->ReleasePool(pool_));
    pool_ = {};
  }

 private:
  CudaKvPool kv_;
  CudaTicketSlots slots_;
  kernels::CudaStream stream_;
  std::unique_ptr<Client> client_;
  PoolHandle pool_;
  std::vector<BlockKey> keys_;
};

#define HIQ_CHILD_PRELUDE(env)        \
  const ChildEnv env = GetChildEnv(); \
  if (!env.ok) GTEST_SKIP() << "runs only as a client process of CudaEventsGpu.*";

TEST(CudaEventsChild, WaitValueWrittenLate) {
  HIQ_CHILD_PRELUDE(env);
  EventsClient a, b;
  ASSERT_NO_FATAL_FAILURE(a.Init(env, "gpu-events/late-a"));
  ASSERT_NO_FATAL_FAILURE(b.Init(env, "gpu-events/late-b"));
  ASSERT_NO_FATAL_FAILURE(a.BackupSync());
  ASSERT_NO_FATAL_FAILURE(a.ClearDestination());
  Gate gate;
  ASSERT_NO_FATAL_FAILURE(gate.Init());
  // The engine's stream is behind: it writes the wait value only when the gate opens.
  const uint64_t wait_value = a.NextWaitValue();
  ASSERT_NO_FATAL_FAILURE(a.WriteWaitValueBehind(gate.device(), 60'000'000'000ull, wait_value));
  RestoreOptions o;
  o.wait_event = kWait;
  o.wait_value = wait_value;
  o.layer_event_base = 0;
  o.done_event = kDone;
  o.sync = false;
  const auto t0 = Clock::now();
  RestoreResult r = a.client().Restore(a.pool(), a.keys(), RowsFrom(kDst), o);
  const double reply_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  HIQ_ASSERT_OK(r.status);
  ASSERT_EQ(r.restored_blocks, kBlocks);
  EXPECT_LT(reply_ms, 2000.0) << "the asynchronous restore was answered only after " << reply_ms
                              << " ms: a daemon thread waited for the engine's stream";
  // The engine's stream waits for the layers and the done slot right after the reply.
  auto reader = kernels::CudaStream::Create(0);
  HIQ_ASSERT_OK(reader.status());
  for (uint32_t l = 0; l < kLayers; ++l) {
    HIQ_ASSERT_OK(a.slots().StreamWait(reader->get(), l, r.ticket));
  }
  HIQ_ASSERT_OK(a.slots().StreamWait(reader->get(), kDone, r.ticket));
  // No worker is held: another pool's synchronous backup completes while the gate is shut.
  const auto t1 = Clock::now();
  ASSERT_NO_FATAL_FAILURE(b.BackupSync());
  EXPECT_LT(Clock::now() - t1, std::chrono::seconds(5));
  // The daemon has not run early: nothing written, no slot reached, the reader still waiting.
  std::this_thread::sleep_for(milliseconds(300));
  uint64_t differ = 0, sentinel = 0;
  ASSERT_NO_FATAL_FAILURE(a.Compare(&differ, &sentinel));
  EXPECT_EQ(sentinel, uint64_t{kLayers} * 2 * kTokens)
      << "rows written before the wait value was stored";
  EXPECT_LT(a.slots().Read(kDone) & ~kEventFailedBit, r.ticket) << "done before the wait value";
  EXPECT_LT(a.slots().Read(0) & ~kEventFailedBit, r.ticket) << "layer 0 done before the wait value";
  EXPECT_EQ(cudaStreamQuery(reader->get()), cudaErrorNotReady)
      << "a stream waiting on the layer slots went on before the wait value was stored";
  (void)cudaGetLastError();
  gate.Open();
  HIQ_ASSERT_OK(a.slots().Wait(kDone, r.ticket, std::chrono::seconds(20)));
  HIQ_ASSERT_OK(reader->Synchronize());
  for (uint32_t l = 0; l < kLayers; ++l) EXPECT_EQ(a.slots().Read(l), r.ticket) << "layer " << l;
  ASSERT_NO_FATAL_FAILURE(a.Compare(&differ, &sentinel));
  EXPECT_EQ(differ, 0u) << "restored rows differ from the backed-up rows";
  std::printf("late wait value: async restore answered in %.2f ms with the gate shut\n", reply_ms);
  a.Release();
  b.Release();
  if (!::testing::Test::HasFailure()) Touch(env.dir + "/ok-late");
}

// An asynchronous restore the daemon holds (its wait value never comes) and an engine stream
// waiting on its done slot; says "ready", and once the test has killed the daemon ("killed"),
// expects the stream to complete within 5 s, released with the failed bit.
TEST(CudaEventsChild, StreamWaitsWhenDaemonDies) {
  HIQ_CHILD_PRELUDE(env);
  EventsClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, "gpu-events/daemon-dies"));
  ASSERT_NO_FATAL_FAILURE(c.BackupSync());
  Gate gate;
  ASSERT_NO_FATAL_FAILURE(gate.Init());
  const uint64_t wait_value = c.NextWaitValue();
  ASSERT_NO_FATAL_FAILURE(c.WriteWaitValueBehind(gate.device(), 600'000'000'000ull, wait_value));
  RestoreOptions o;
  o.wait_event = kWait;
  o.wait_value = wait_value;
  o.layer_event_base = 0;
  o.done_event = kDone;
  o.sync = false;
  RestoreResult r = c.client().Restore(c.pool(), c.keys(), RowsFrom(kDst), o);
  HIQ_ASSERT_OK(r.status);
  auto waiter = kernels::CudaStream::Create(0);
  HIQ_ASSERT_OK(waiter.status());
  HIQ_ASSERT_OK(c.slots().StreamWait(waiter->get(), kDone, r.ticket));
  std::this_thread::sleep_for(milliseconds(200));
  ASSERT_EQ(cudaStreamQuery(waiter->get()), cudaErrorNotReady) << "the wait completed early";
  (void)cudaGetLastError();
  Touch(env.dir + "/ready");
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (!std::filesystem::exists(env.dir + "/killed") && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  ASSERT_TRUE(std::filesystem::exists(env.dir + "/killed")) << "the daemon was not killed";
  const auto killed = Clock::now();
  cudaError_t q = cudaErrorNotReady;
  while (q == cudaErrorNotReady && Clock::now() - killed < std::chrono::seconds(5)) {
    q = cudaStreamQuery(waiter->get());
    if (q == cudaErrorNotReady) std::this_thread::sleep_for(milliseconds(1));
  }
  const double released_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - killed).count();
  EXPECT_EQ(q, cudaSuccess) << "the engine stream waiting on the done slot still waits 5 s after "
                               "the daemon died (slot "
                            << c.slots().Read(kDone) << ")";
  (void)cudaGetLastError();
  EXPECT_EQ(c.slots().Read(kDone), r.ticket | kEventFailedBit);
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_EQ(c.slots().Read(l), r.ticket | kEventFailedBit) << "layer " << l;
  }
  EXPECT_EQ(c.slots().Wait(kDone, r.ticket, milliseconds(0)).code(), StatusCode::kAborted);
  std::printf(
      "stream waiting on the done slot released %.1f ms after the daemon's death was "
      "noticed\n",
      released_ms);
  gate.Open();
  HIQ_ASSERT_OK(waiter->Synchronize());
  HIQ_ASSERT_OK(c.SyncStream());
  if (!::testing::Test::HasFailure()) Touch(env.dir + "/ok-daemon-dies");
}

// A restore whose wait value never comes, then ReleasePool: the release returns, the request is
// cancelled without touching the rows, and its slots get the failed bit.
TEST(CudaEventsChild, ReleaseWithAWaitPending) {
  HIQ_CHILD_PRELUDE(env);
  EventsClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, "gpu-events/release-pending"));
  ASSERT_NO_FATAL_FAILURE(c.BackupSync());
  ASSERT_NO_FATAL_FAILURE(c.ClearDestination());
  Gate gate;
  ASSERT_NO_FATAL_FAILURE(gate.Init());
  const uint64_t wait_value = c.NextWaitValue();
  ASSERT_NO_FATAL_FAILURE(c.WriteWaitValueBehind(gate.device(), 600'000'000'000ull, wait_value));
  RestoreOptions o;
  o.wait_event = kWait;
  o.wait_value = wait_value;
  o.layer_event_base = 0;
  o.done_event = kDone;
  o.sync = false;
  RestoreResult r = c.client().Restore(c.pool(), c.keys(), RowsFrom(kDst), o);
  HIQ_ASSERT_OK(r.status);
  const auto t0 = Clock::now();
  ASSERT_NO_FATAL_FAILURE(c.Release());
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10)) << "ReleasePool waited for the engine";
  EXPECT_EQ(c.slots().Wait(kDone, r.ticket, std::chrono::seconds(5)).code(), StatusCode::kAborted)
      << "slot " << c.slots().Read(kDone);
  uint64_t differ = 0, sentinel = 0;
  ASSERT_NO_FATAL_FAILURE(c.Compare(&differ, &sentinel));
  EXPECT_EQ(sentinel, uint64_t{kLayers} * 2 * kTokens) << "a cancelled restore wrote rows";
  gate.Open();
  HIQ_ASSERT_OK(c.SyncStream());
  if (!::testing::Test::HasFailure()) Touch(env.dir + "/ok-release-pending");
}

// Writes its wait value behind a gate that never opens, sends an asynchronous restore that waits
// for it, says "ready-<seed>" and waits to be killed.
TEST(CudaEventsChild, WaitPendingUntilKilled) {
  HIQ_CHILD_PRELUDE(env);
  EventsClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, "gpu-events/killed"));
  ASSERT_NO_FATAL_FAILURE(c.BackupSync());
  Gate gate;
  ASSERT_NO_FATAL_FAILURE(gate.Init());
  const uint64_t wait_value = c.NextWaitValue();
  ASSERT_NO_FATAL_FAILURE(c.WriteWaitValueBehind(gate.device(), 600'000'000'000ull, wait_value));
  RestoreOptions o;
  o.wait_event = kWait;
  o.wait_value = wait_value;
  o.layer_event_base = 0;
  o.done_event = kDone;
  o.sync = false;
  RestoreResult r = c.client().Restore(c.pool(), c.keys(), RowsFrom(kDst), o);
  HIQ_ASSERT_OK(r.status);
  Touch(env.dir + "/ready-" + std::to_string(env.seed));
  std::this_thread::sleep_for(std::chrono::seconds(600));
  FAIL() << "was not killed";
}

// A plain round trip, to show the daemon still serves CUDA clients.
TEST(CudaEventsChild, RoundTrip) {
  HIQ_CHILD_PRELUDE(env);
  EventsClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, "gpu-events/roundtrip"));
  ASSERT_NO_FATAL_FAILURE(c.BackupSync());
  ASSERT_NO_FATAL_FAILURE(c.ClearDestination());
  RestoreOptions o;
  o.sync = true;
  RestoreResult r = c.client().Restore(c.pool(), c.keys(), RowsFrom(kDst), o);
  HIQ_ASSERT_OK(r.status);
  ASSERT_EQ(r.restored_blocks, kBlocks);
  uint64_t differ = 0, sentinel = 0;
  ASSERT_NO_FATAL_FAILURE(c.Compare(&differ, &sentinel));
  EXPECT_EQ(differ, 0u);
  c.Release();
  if (!::testing::Test::HasFailure()) Touch(env.dir + "/ok-roundtrip-" + std::to_string(env.seed));
}

// TP rank `role` of 2. Flags: a shared memory object of two words, word r set by the OTHER rank
// once its request was answered; this rank's wait value is written behind a kernel spinning on
// word `role`.
TEST(CudaEventsChild, PeerRank) {
  HIQ_CHILD_PRELUDE(env);
  ASSERT_FALSE(env.shm.empty());
  const int fd = ::shm_open(env.shm.c_str(), O_RDWR, 0600);
  ASSERT_GE(fd, 0) << env.shm;
  void* mem = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(mem, MAP_FAILED);
  auto* words = static_cast<volatile uint32_t*>(mem);
  HIQ_ASSERT_CUDA(cudaHostRegister(mem, 4096, cudaHostRegisterMapped | cudaHostRegisterPortable));
  uint32_t* dev_words = nullptr;
  HIQ_ASSERT_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_words), mem, 0));
  EventsClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, "gpu-events/tp", env.role, 2));
  const uint64_t wait_value = c.NextWaitValue();
  ASSERT_NO_FATAL_FAILURE(
      c.WriteWaitValueBehind(dev_words + env.role, 60'000'000'000ull, wait_value));
  BackupOptions o;
  o.wait_event = kWait;
  o.wait_value = wait_value;
  o.done_event = kDone;
  o.sync = false;
  const auto t0 = Clock::now();
  BackupResult r = c.client().Backup(c.pool(), c.keys(), RowsFrom(kSrc), o);
  HIQ_ASSERT_OK(r.status);
  const double reply_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  words[1 - env.role] = 1;  // answered: the peer's all-reduce may proceed
  const Status done = c.slots().Wait(kDone, r.ticket, std::chrono::seconds(30));
  ASSERT_TRUE(done.ok()) << "rank " << env.role
                         << ": the done slot was not reached (deadlock between the ranks?): "
                         << done.ToString();
  // Published once the device work completed: poll Lookup briefly.
  uint32_t found = 0;
  for (int i = 0; i < 200 && found != kBlocks; ++i) {
    LookupResult l = c.client().Lookup(c.pool(), c.keys());
    HIQ_ASSERT_OK(l.status);
    found = l.prefix_blocks;
    if (found != kBlocks) std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(found, kBlocks);
  std::printf("rank %u: async backup answered in %.2f ms while its wait value was pending\n",
              env.role, reply_ms);
  c.Release();
  HIQ_ASSERT_CUDA(cudaHostUnregister(mem));
  ::munmap(mem, 4096);
  if (!::testing::Test::HasFailure()) Touch(env.dir + "/ok-peer-" + std::to_string(env.role));
}

// ---------------------------------------------------------------------------------------------
// The test process.

class CudaEventsGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!kernels::CudaDeviceAvailable(&why)) GTEST_SKIP() << "no usable CUDA device: " << why;
  }
  // Call as ASSERT_NO_FATAL_FAILURE(StartDaemon(...)): the test cannot go on without it.
  void StartDaemon(std::vector<std::string> flags) {
    const char* pool_bytes = std::getenv("HIQ_GPU_POOL_BYTES");
    flags.insert(flags.begin(), {"--device", "cuda"});
    daemon_ = std::make_unique<testing::DaemonProcess>(
        pool_bytes != nullptr && pool_bytes[0] != '\0' ? pool_bytes : "256MiB", flags);
    ASSERT_TRUE(daemon_->Start(std::chrono::seconds(60)))
        << "hiqcached --device cuda did not start";
    dir_ = "/tmp/hiq-gpu-events-" + std::to_string(::getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::create_directories(dir_);
    auto client = Client::Connect(daemon_->target());
    HIQ_ASSERT_OK(client.status());
    client_ = std::move(client).value();
  }
  void TearDown() override {
    client_.reset();
    if (daemon_) daemon_->Stop();
    if (!shm_.empty()) ::shm_unlink(shm_.c_str());
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  pid_t Spawn(const std::string& test, uint64_t seed, uint32_t role = 0) {
    gpu_test::ChildEnv env{daemon_->target(), dir_, shm_, seed, role};
    return gpu_test::SpawnSelf("CudaEventsChild." + test, env.Vars());
  }

  static int Wait(pid_t pid, std::chrono::seconds timeout) {
    return gpu_test::WaitChild(pid, timeout);
  }

  bool DaemonAlive() const { return gpu_test::ChildAlive(daemon_->pid()); }

  // Waits until child `pid` has created its marker `name` in the test's directory.
  void AwaitReady(pid_t pid, const std::string& name = "ready") {
    const std::string marker = dir_ + "/" + name;
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    while (!std::filesystem::exists(marker) && Clock::now() < deadline) {
      int status;
      ASSERT_NE(::waitpid(pid, &status, WNOHANG), pid)
          << "the client exited before it was ready (" << name << ")";
      std::this_thread::sleep_for(milliseconds(10));
    }
    ASSERT_TRUE(std::filesystem::exists(marker)) << name;
  }

  // Polls GetStats until no pool of a client in `pids` is registered, for at most `timeout`.
  // True when they are all gone.
  bool AwaitPoolsDropped(const std::vector<pid_t>& pids, std::chrono::seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (true) {
      auto stats = client_->GetStats();
      EXPECT_TRUE(stats.ok()) << "the daemon stopped answering: " << stats.status().ToString();
      if (!stats.ok()) return false;
      bool gone = true;
      for (const PoolStats& p : stats->pools) {
        for (pid_t pid : pids) gone &= p.client_pid != static_cast<uint32_t>(pid);
      }
      if (gone) return true;
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  std::string dir_, shm_;
};

TEST_F(CudaEventsGpu, WaitValueWrittenLate) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({}));
  const pid_t pid = Spawn("WaitValueWrittenLate", 1);
  ASSERT_GT(pid, 0);
  EXPECT_EQ(Wait(pid, std::chrono::seconds(120)), 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ok-late"));
}

TEST_F(CudaEventsGpu, DaemonKilledWhileAStreamWaits) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--wait-timeout-ms", "600000"}));
  const pid_t pid = Spawn("StreamWaitsWhenDaemonDies", 5);
  ASSERT_GT(pid, 0);
  ASSERT_NO_FATAL_FAILURE(AwaitReady(pid));
  client_.reset();
  daemon_->Kill();
  gpu_test::Touch(dir_ + "/killed");
  EXPECT_EQ(Wait(pid, std::chrono::seconds(60)), 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ok-daemon-dies"))
      << "the engine stream was not released after the daemon died";
}

TEST_F(CudaEventsGpu, ClientKilledWithAWaitPending) {
  ASSERT_NO_FATAL_FAILURE(
      StartDaemon({"--release-timeout-ms", "2000", "--wait-timeout-ms", "600000"}));
  const pid_t released = Spawn("ReleaseWithAWaitPending", 2);
  ASSERT_GT(released, 0);
  EXPECT_EQ(Wait(released, std::chrono::seconds(120)), 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ok-release-pending"))
      << "ReleasePool with a wait pending did not complete";
  const pid_t pid = Spawn("WaitPendingUntilKilled", 2);
  ASSERT_GT(pid, 0);
  ASSERT_NO_FATAL_FAILURE(AwaitReady(pid, "ready-2"));
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  int status;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const auto killed = Clock::now();
  EXPECT_TRUE(AwaitPoolsDropped({pid}, std::chrono::seconds(10)))
      << "the dead client's pool is still registered";
  std::printf("pool of the client killed with a wait pending dropped after %.0f ms\n",
              std::chrono::duration<double, std::milli>(Clock::now() - killed).count());
  EXPECT_TRUE(DaemonAlive());
  // Five engines in turn: nothing of the two abandoned requests still holds the daemon.
  for (uint64_t seed = 10; seed < 15; ++seed) {
    const pid_t next = Spawn("RoundTrip", seed);
    ASSERT_GT(next, 0);
    EXPECT_EQ(Wait(next, std::chrono::seconds(60)), 0) << "engine " << seed - 9;
    EXPECT_TRUE(std::filesystem::exists(dir_ + "/ok-roundtrip-" + std::to_string(seed)))
        << "engine " << seed - 9 << " could not use the daemon after the death";
  }
  EXPECT_TRUE(DaemonAlive());
}

TEST_F(CudaEventsGpu, FiveDeadEnginesThenASixth) {
  // 4 MiB of staging is one pair of 2 MiB slabs (StagingPlan): a waiting request that held a
  // slab would stop every other request of the GPU.
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--cuda-staging-bytes", "4MiB", "--release-timeout-ms",
                                       "2000", "--wait-timeout-ms", "600000"}));
  std::vector<pid_t> dead;
  // Children still running when the test stops early are killed and reaped, not left behind.
  struct KillLeftOver {
    std::vector<pid_t>* pids;
    ~KillLeftOver() {
      for (pid_t pid : *pids) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  } kill_left_over{&dead};
  for (uint64_t seed = 20; seed < 25; ++seed) {
    const pid_t pid = Spawn("WaitPendingUntilKilled", seed);
    ASSERT_GT(pid, 0);
    dead.push_back(pid);
  }
  for (size_t i = 0; i < dead.size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(AwaitReady(dead[i], "ready-" + std::to_string(20 + i)));
  }
  // While the five wait: their requests hold no slab.
  const pid_t during = Spawn("RoundTrip", 30);
  ASSERT_GT(during, 0);
  EXPECT_EQ(Wait(during, std::chrono::seconds(60)), 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ok-roundtrip-30"))
      << "a client could not round-trip while five others had a wait pending";
  const std::vector<pid_t> killed_pids = dead;
  for (pid_t pid : killed_pids) EXPECT_EQ(::kill(pid, SIGKILL), 0);
  dead.clear();
  for (pid_t pid : killed_pids) {
    int status;
    EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  }
  const auto killed = Clock::now();
  EXPECT_TRUE(AwaitPoolsDropped(killed_pids, std::chrono::seconds(10)))
      << "pools of the five killed clients are still registered";
  const double dropped_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - killed).count();
  EXPECT_TRUE(DaemonAlive());
  const auto t0 = Clock::now();
  const pid_t sixth = Spawn("RoundTrip", 31);
  ASSERT_GT(sixth, 0);
  EXPECT_EQ(Wait(sixth, std::chrono::seconds(60)), 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ok-roundtrip-31"))
      << "the sixth client could not use the daemon after five died with waits pending";
  std::printf(
      "five killed clients with waits pending: pools dropped after %.0f ms; the sixth "
      "round-tripped in %.0f ms (process start included)\n",
      dropped_ms, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  EXPECT_TRUE(DaemonAlive());
}

TEST_F(CudaEventsGpu, TwoClientsWaitingOnEachOther) {
  ASSERT_NO_FATAL_FAILURE(StartDaemon({"--transfer-workers", "1"}));
  shm_ = "/hiq-gpu-events-flags-" + std::to_string(::getpid());
  ::shm_unlink(shm_.c_str());
  const int fd = ::shm_open(shm_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  ::close(fd);
  const pid_t r0 = Spawn("PeerRank", 4, 0);
  const pid_t r1 = Spawn("PeerRank", 4, 1);
  ASSERT_GT(r0, 0);
  ASSERT_GT(r1, 0);
  EXPECT_EQ(Wait(r0, std::chrono::seconds(120)), 0) << "rank 0";
  EXPECT_EQ(Wait(r1, std::chrono::seconds(120)), 0) << "rank 1";
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ok-peer-0"));
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/ok-peer-1"));
  EXPECT_TRUE(DaemonAlive());
}

}  // namespace
}  // namespace hiqcache
