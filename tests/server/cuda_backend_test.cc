// The CUDA backend's scheduling against a fake device (fake_device.h), through CacheCore as the
// daemon runs it: no GPU needed. The fake's streams run only what CUDA would let run (stream
// order, event waits capturing the most recent record) and report races on staging, use of
// closed mappings and pageable copies. Engines are played by the test: their "GPU" KV buffers
// are host memory, their ticket slots a memfd the test maps too; a wait "recorded late" is a
// wait_value the test stores only later, as an engine's stream that has not reached its
// cuStreamWriteValue64 yet.
//
// Covers docs/design.md "Completion: ticket slots": no transfer worker and no staging waits on
// an engine (TP ranks whose wait values come only after every request was answered; five
// engines that never write, then a sixth on the same GPU), slots receive their ticket only after
// the work they signal, HOST pools keep working while CUDA pools wait, per-pool order, an
// enqueue failure releases every slot with the failed bit once the device work stopped, sticky
// errors fail the device, a caller's expired deadline touches nothing, release waits for device
// work and never touches a cancelled pool's mappings, staging runs in chunks through a fixed
// budget with slabs never reused while queued work reads them, no allocation on the request
// path, registration leaves nothing queued on the device, IPC events refused, device/UUID
// mismatch and VMM hints, registration chunks; completion observed by a blocking wait on the
// device's signal, never polled; a restore enqueued on high-priority streams above a running
// backup of its pool (order per direction; a conflicting restore waits).
#include "backends/cuda_backend.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backends/host_backend.h"
#include "backends/ticket_slots.h"
#include "codec_cpu.h"
#include "codec_reference.h"
#include "core/cache_core.h"
#include "fake_device.h"
#include "hiqcache/mutex.h"
#include "hiqcache/thread_annotations.h"
#include "pool/block_store.h"
#include "register_spec_util.h"
#include "server_test_util.h"
#include "time_margin.h"

namespace hiqcache::server {
namespace {

using namespace std::chrono_literals;
using testing::AnonBuffer;
using testing::FakeDevice;
using testing::KeyString;
using Call = FakeDevice::Call;

constexpr int kInt8 = 0, kRaw = 1, kKivi = 4, kAllot = 6, kAllot6 = 7, kAllot4 = 8, kCuda = 2;
constexpr uint32_t kLayers = 3, kHeads = 2, kDim = 64, kBlockTokens = 4, kRows = 64;
constexpr uint64_t kRowBytes = uint64_t{kHeads} * kDim * 2;              // 256
constexpr uint64_t kPlaneBytes = uint64_t{kLayers} * kRows * kRowBytes;  // one buffer: K or V
constexpr uint32_t kEvents = 8;  // 0 wait, 1 done, 2.. layer events
constexpr int32_t kWait = 0, kDone = 1, kLayerBase = 2;
// Stored bytes of one layer of one block: 2 planes x 4 tokens x (128 codes + 4 scale bytes).
constexpr uint64_t kLayerBytes = 2ull * kBlockTokens * (kHeads * kDim + 2 * kHeads);  // 1,056
constexpr uint64_t kBlockBytes = kLayers * kLayerBytes;                               // 3,168

float Bf16ToFloat(uint16_t b) {
  uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
StatusOr<T> Await(std::future<StatusOr<T>>& f, std::chrono::milliseconds timeout = 10s) {
  if (f.wait_for(timeout) != std::future_status::ready) return DeadlineExceeded("test: no reply");
  return f.get();
}

template <typename Pred>
bool WaitUntil(Pred pred, std::chrono::milliseconds timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return pred();
    std::this_thread::sleep_for(200us);
  }
  return true;
}

// One engine process (a TP rank): K and V "device" buffers on `device`, and its ticket slots (a
// sealed memfd of kEvents slots, mapped here as the engine maps it; the daemon maps the fd).
struct Engine {
  int device = 0;
  std::vector<uint8_t> k, v;
  std::string k_handle, v_handle;
  int slot_fd = -1;
  uint64_t* slots = nullptr;

  ~Engine() {
    if (slots != nullptr) ::munmap(slots, kEvents * 64);
    if (slot_fd >= 0) ::close(slot_fd);
  }
  uint64_t Slot(int32_t i) const {
    return std::atomic_ref<uint64_t>(slots[8 * i]).load(std::memory_order_acquire);
  }
  void Store(int32_t i, uint64_t v) const {
    std::atomic_ref<uint64_t>(slots[8 * i]).store(v, std::memory_order_release);
  }

  Engine(FakeDevice* fake, int dev, uint64_t seed) : device(dev), k(kPlaneBytes), v(kPlaneBytes) {
    uint64_t state = seed * 7919 + 12345;
    auto next = [&] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<double>(state >> 11) * 0x1.0p-53;
    };
    for (auto* plane : {&k, &v}) {
      auto* e = reinterpret_cast<uint16_t*>(plane->data());
      for (size_t i = 0; i < plane->size() / 2; ++i) {
        e[i] = FloatToBf16(
            static_cast<float>((2 * next() - 1) * std::ldexp(1.0, int(next() * 8) - 4)));
      }
    }
    k_handle = fake->ExportBuffer(k.data(), k.size(), dev);
    v_handle = fake->ExportBuffer(v.data(), v.size(), dev);
    slot_fd = ::memfd_create("hiq-test-slots", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (slot_fd < 0 || ::ftruncate(slot_fd, kEvents * 64) != 0 ||
        ::fcntl(slot_fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
      ADD_FAILURE() << "memfd for the slots: " << std::strerror(errno);
      return;
    }
    void* m = ::mmap(nullptr, kEvents * 64, PROT_READ | PROT_WRITE, MAP_SHARED, slot_fd, 0);
    if (m == MAP_FAILED) {
      ADD_FAILURE() << "mmap of the slots: " << std::strerror(errno);
      return;
    }
    slots = static_cast<uint64_t*>(m);
  }

  std::vector<uint8_t> Bytes() const {
    std::vector<uint8_t> out(k);
    out.insert(out.end(), v.begin(), v.end());
    return out;
  }
};

std::string UuidOf(FakeDevice& fake, int device) { return "GPU-" + (*fake.DeviceUuids())[device]; }

struct Options {
  int devices = 5;
  uint64_t staging_bytes = 1 << 20;
  unsigned workers = 2;
  uint64_t register_chunk = 0;  // 0 = one registration
  std::chrono::milliseconds release_timeout{5000};
  std::chrono::milliseconds wait_timeout{2000};  // CudaBackendOptions::wait_timeout
  bool auto_run = true;
  uint32_t max_blocks = 64;  // per request
};

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(); }
  void TearDown() override {
    if (core_) {
      fake_->SetAutoRun(true);
      for (auto& [id, e] : pending_records_) e->Store(kWait, 1);
      core_->WaitIdle();
    }
    core_.reset();
    cuda_.reset();
    if (fake_) {
      EXPECT_TRUE(fake_->Violations().empty()) << Joined(fake_->Violations());
    }
  }

  static std::string Joined(const std::vector<std::string>& v) {
    std::string out;
    for (size_t i = 0; i < v.size() && i < 10; ++i) out += v[i] + "\n";
    return out;
  }

  void Build() { Build(Options()); }
  void Build(Options o) {
    core_.reset();
    cuda_.reset();
    engines_.clear();
    fake_ = std::make_unique<FakeDevice>(o.devices);
    fake_->SetAutoRun(o.auto_run);
    const size_t pool_bytes = size_t{512} << 20;
    pool_mem_ = std::make_unique<AnonBuffer>(pool_bytes);
    store_ = std::make_unique<BlockStore>(
        pool_mem_->data(), pool_mem_->size(), false, 1, nullptr,
        o.register_chunk != 0 ? o.register_chunk : kPoolRegisterChunkBytes);
    codec_ = std::make_unique<kernels::CpuCodec>(1);
    host_ = std::make_unique<HostBackend>(codec_.get(), 2000ms);
    CudaBackendOptions co;
    co.staging_bytes = o.staging_bytes;
    co.max_blocks_per_request = o.max_blocks;
    co.wait_timeout = o.wait_timeout;
    if (o.register_chunk != 0) co.register_chunk_bytes = o.register_chunk;
    co.on_device_failed = [this](int device, const Status& st) {
      MutexLock lock(&mu_);
      failed_devices_.push_back(device);
      failure_ = st;
    };
    auto created = CudaBackend::Create(fake_.get(), pool_mem_->data(), pool_bytes, co);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    cuda_ = std::move(created).value();
    CoreOptions opts;
    opts.transfer_workers = o.workers;
    opts.release_timeout = o.release_timeout;
    opts.limits.max_blocks_per_request = o.max_blocks;
    core_ = std::make_unique<CacheCore>(opts, store_.get(), host_.get(), cuda_.get());
  }

  Engine& NewEngine(int device = 0) {
    engines_.push_back(std::make_unique<Engine>(fake_.get(), device, engines_.size() + 1));
    return *engines_.back();
  }

  RegisterSpec Spec(const Engine& e, int codec = kInt8, uint32_t tp_rank = 0,
                    uint32_t tp_size = 1) {
    RegisterSpec s = testing::BaseSpec("test/model", kLayers, kHeads, kDim, kBlockTokens);
    s.tp_rank = tp_rank;
    s.tp_size = tp_size;
    s.codec = codec;
    s.device_kind = kCuda;
    s.cuda_device_uuid = UuidOf(*fake_, e.device);
    for (const std::string* h : {&e.k_handle, &e.v_handle}) {
      BufferSpec b;
      b.has_cuda_ipc_handle = true;
      b.cuda_ipc_handle = *h;
      b.size_bytes = kPlaneBytes;
      s.buffers.push_back(b);
    }
    testing::AddLayerMajorLayers(&s, kRows, kRowBytes);
    s.events.count = kEvents;
    s.events.host_fd_id = 1;
    s.events.fd = e.slot_fd;
    return s;
  }

  uint64_t Register(const Engine& e, int codec = kInt8, uint32_t tp_rank = 0,
                    uint32_t tp_size = 1) {
    auto r = core_->RegisterPool(Spec(e, codec, tp_rank, tp_size));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->pool_id : 0;
  }

  static BlockSpec Block(uint64_t key, uint32_t first_row) {
    BlockSpec b;
    b.key = KeyString(key);
    for (uint32_t i = 0; i < kBlockTokens; ++i) b.rows.push_back(first_row + i);
    return b;
  }
  // Blocks key0.., rows first_row.. (kBlockTokens each).
  static std::vector<BlockSpec> Blocks(uint64_t key0, uint32_t n, uint32_t first_row) {
    std::vector<BlockSpec> out;
    for (uint32_t i = 0; i < n; ++i) out.push_back(Block(key0 + i, first_row + i * kBlockTokens));
    return out;
  }
  static TransferSpec Transfer(uint64_t pool, std::vector<BlockSpec> blocks, bool sync = true) {
    TransferSpec t;
    t.pool_id = pool;
    t.blocks = std::move(blocks);
    t.sync = sync;
    return t;
  }

  std::future<StatusOr<BackupResult>> BackupAsync(TransferSpec t) {
    auto p = std::make_shared<std::promise<StatusOr<BackupResult>>>();
    auto f = p->get_future();
    core_->Backup(std::move(t), [p](StatusOr<BackupResult> r) { p->set_value(std::move(r)); });
    return f;
  }
  std::future<StatusOr<RestoreResult>> RestoreAsync(TransferSpec t) {
    auto p = std::make_shared<std::promise<StatusOr<RestoreResult>>>();
    auto f = p->get_future();
    core_->Restore(std::move(t), [p](StatusOr<RestoreResult> r) { p->set_value(std::move(r)); });
    return f;
  }
  StatusOr<BackupResult> Backup(TransferSpec t) {
    auto f = BackupAsync(std::move(t));
    auto r = Await(f);
    core_->WaitIdle();
    return r;
  }
  StatusOr<RestoreResult> Restore(TransferSpec t) {
    auto f = RestoreAsync(std::move(t));
    auto r = Await(f);
    core_->WaitIdle();
    return r;
  }
  uint32_t Lookup(uint64_t pool, uint64_t key0, uint32_t n) {
    std::vector<std::string> keys;
    for (uint32_t i = 0; i < n; ++i) keys.push_back(KeyString(key0 + i));
    auto r = core_->Lookup(pool, keys);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : 0;
  }

  // The engine's stream has not reached the store of its wait value (1, into slot kWait) yet:
  // requests naming wait_event kWait (wait_value 0 means 1) wait until Complete.
  uint64_t RecordLate(const Engine& e) {
    EXPECT_EQ(e.Slot(kWait), 0u);
    const uint64_t id = ++next_record_;
    pending_records_[id] = &e;
    return id;
  }
  void Complete(uint64_t record) {
    const Engine* e = pending_records_.at(record);
    pending_records_.erase(record);
    e->Store(kWait, 1);
  }

  // Rows [dst, dst + n) of `e` hold what the reference codec makes of rows [src, src + n) of
  // `original` in blocks of kBlockTokens (bit-exact: the fake runs the reference kernels).
  // REQUIRES: n % kBlockTokens == 0.
  void ExpectRestored(const Engine& e, const std::vector<uint8_t>& original, uint32_t src,
                      uint32_t dst, uint32_t n, int codec) {
    std::vector<uint8_t> scratch(original);
    kernels::BlockLayout lay;
    lay.row.num_heads = kHeads;
    lay.row.head_dim = kDim;
    lay.row.codec = static_cast<kernels::CodecKind>(codec);  // numbered as the wire codec
    lay.num_layers = kLayers;
    lay.kv_planes = 2;
    lay.block_tokens = kBlockTokens;
    std::vector<kernels::LayerViews> views(kLayers);
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        kernels::StridedView& v = views[l].planes[p];
        v.base = scratch.data() + p * kPlaneBytes + uint64_t{l} * kRows * kRowBytes;
        v.row_stride = kRowBytes;
        v.head_stride = kDim * 2;
        v.num_rows = kRows;
      }
    }
    const uint32_t nb = n / kBlockTokens;
    std::vector<uint8_t> payload(size_t{nb} * lay.BlockBytes());
    std::vector<uint32_t> src_rows, dst_rows;
    for (uint32_t i = 0; i < n; ++i) {
      src_rows.push_back(src + i);
      dst_rows.push_back(dst + i);
    }
    std::vector<uint8_t*> blocks;
    for (uint32_t b = 0; b < nb; ++b) blocks.push_back(payload.data() + b * lay.BlockBytes());
    kernels::EncodeJob enc{lay, views.data(), src_rows.data(), blocks.data(), nb, nullptr};
    kernels::EncodeBlocksReference(enc);
    const std::vector<const uint8_t*> cblocks(blocks.begin(), blocks.end());
    kernels::DecodeJob dec{lay, views.data(), dst_rows.data(), cblocks.data(), nb};
    kernels::DecodeBlocksReference(dec);
    const std::vector<uint8_t> now = e.Bytes();
    int bad = 0;
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t l = 0; l < kLayers; ++l) {
        const uint64_t off = p * kPlaneBytes + uint64_t{l} * kRows * kRowBytes + dst * kRowBytes;
        if (std::memcmp(scratch.data() + off, now.data() + off, n * kRowBytes) != 0 && ++bad < 4) {
          ADD_FAILURE() << "plane " << p << " layer " << l << " rows " << dst << ".." << dst + n - 1
                        << " differ from the reference decode";
        }
      }
    if (codec == kRaw) {
      for (uint32_t p = 0; p < 2; ++p)
        for (uint32_t l = 0; l < kLayers; ++l) {
          const uint64_t base = p * kPlaneBytes + uint64_t{l} * kRows * kRowBytes;
          EXPECT_EQ(std::memcmp(original.data() + base + src * kRowBytes,
                                now.data() + base + dst * kRowBytes, n * kRowBytes),
                    0);
        }
    }
  }

  Mutex mu_;
  std::vector<int> failed_devices_ GUARDED_BY(mu_);
  Status failure_ GUARDED_BY(mu_);
  std::map<uint64_t, const Engine*> pending_records_;
  uint64_t next_record_ = 0;
  std::unique_ptr<FakeDevice> fake_;
  std::unique_ptr<AnonBuffer> pool_mem_;
  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<kernels::CpuCodec> codec_;
  std::unique_ptr<HostBackend> host_;
  std::unique_ptr<CudaBackend> cuda_;
  std::unique_ptr<CacheCore> core_;
  std::vector<std::unique_ptr<Engine>> engines_;
};

// ---------------------------------------------------------------------------------------------
// Data path and staging

// (The allot codecs' jobs carry their RoPE table in the binding's arena: the fake checks it.)
TEST_F(CudaBackendTest, RoundTripIsTheReferenceCodecsBytes) {
  for (int codec : {kInt8, kRaw, kKivi, kAllot, kAllot6, kAllot4}) {
    Engine& e = NewEngine();
    const uint64_t pool = Register(e, codec);
    const std::vector<uint8_t> original = e.Bytes();
    auto b = Backup(Transfer(pool, Blocks(100, 4, 0)));
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    for (BlockResult r : b->results) EXPECT_EQ(r, BlockResult::kStored);
    EXPECT_EQ(Lookup(pool, 100, 4), 4u);
    auto r = Restore(Transfer(pool, Blocks(100, 4, 32)));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->restored_blocks, 4u);
    ExpectRestored(e, original, 0, 32, 16, codec);
  }
}

// A request larger than the staging budget runs in chunks through the slab pair; slabs are
// never written while a queued copy or kernel still reads them (the fake checks every pair of
// overlapping accesses for an order, and runs the most recently enqueued work first).
TEST_F(CudaBackendTest, RequestsLargerThanTheBudgetRunInChunksAndNeverReuseBusySlabs) {
  struct Case {
    uint64_t staging;
    uint32_t encodes_per_block;  // backup chunks per block
    const char* what;
  };
  // Slabs of 4,096 bytes hold one block (3,168): one block per backup chunk, three blocks per
  // restore unit. Slabs of 2,304 hold two layers: each block is backed up in two chunks.
  for (const Case& c : {Case{2 * 4096, 1, "whole blocks"}, Case{2 * 2304, 2, "layer chunks"}}) {
    SCOPED_TRACE(c.what);
    Options o;
    o.staging_bytes = c.staging;
    o.auto_run = false;
    Build(o);
    Engine& e = NewEngine();
    const uint64_t pool = Register(e);
    const std::vector<uint8_t> original = e.Bytes();
    const uint64_t allocs = fake_->AllocCalls();
    constexpr uint32_t kN = 9;
    auto bf = BackupAsync(Transfer(pool, Blocks(1, kN, 0), /*sync=*/false));
    // Adversarial order: whatever is runnable and enqueued last runs first.
    while (bf.wait_for(1ms) != std::future_status::ready) fake_->RunReady();
    ASSERT_TRUE(Await(bf).ok());
    while (core_->PendingTasks() > 0) {
      fake_->RunReady();
      std::this_thread::sleep_for(100us);
    }
    EXPECT_EQ(fake_->Executed(Call::kEncode), kN * c.encodes_per_block);
    EXPECT_EQ(Lookup(pool, 1, kN), kN);
    auto rf = RestoreAsync(Transfer(pool, Blocks(1, kN, 28), /*sync=*/true));
    while (rf.wait_for(1ms) != std::future_status::ready) fake_->RunReady();
    auto r = Await(rf);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->restored_blocks, kN);
    const uint32_t per_unit = c.staging / 2 / kLayerBytes;  // blocks per restore unit
    EXPECT_EQ(fake_->Executed(Call::kDecode), kLayers * ((kN + per_unit - 1) / per_unit));
    ExpectRestored(e, original, 0, 28, kN * kBlockTokens, kInt8);
    EXPECT_EQ(fake_->AllocCalls(), allocs)
        << "device or pinned memory allocated on the request path";
    EXPECT_TRUE(fake_->Violations().empty()) << Joined(fake_->Violations());
  }
}

// A 2,048-token restore in 16-token blocks (128 blocks of 36 layers) took one H2D copy per
// (block, layer): 4,608. It now goes in units of every block x as many layers as fit a slab,
// block-major in the slab, so each block's layers of a unit (contiguous in the pool) are one
// copy. The restored rows are the originals within INT8 error.
TEST_F(CudaBackendTest, RestoreCopiesEachBlocksLayersOfAUnitInOneDma) {
  Options o;
  o.staging_bytes = 64ull << 20;  // two pairs of 16 MiB slabs
  o.max_blocks = 128;
  Build(o);
  constexpr uint32_t kTokens = 2048, kBt = 16, kL = 36, kN = kTokens / kBt;
  const uint64_t plane = uint64_t{kL} * kTokens * kRowBytes;
  std::vector<uint8_t> k(plane), v(plane);
  uint64_t state = 99;
  for (auto* buf : {&k, &v}) {
    auto* e = reinterpret_cast<uint16_t*>(buf->data());
    for (size_t i = 0; i < buf->size() / 2; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      e[i] = FloatToBf16(static_cast<float>(static_cast<double>(state >> 11) * 0x1.0p-53 - 0.5));
    }
  }
  const std::vector<uint8_t> k0 = k, v0 = v;
  RegisterSpec s = testing::BaseSpec("test/long", kL, kHeads, kDim, kBt);
  s.device_kind = kCuda;
  s.cuda_device_uuid = UuidOf(*fake_, 0);
  for (auto* buf : {&k, &v}) {
    BufferSpec b;
    b.has_cuda_ipc_handle = true;
    b.cuda_ipc_handle = fake_->ExportBuffer(buf->data(), plane, 0);
    b.size_bytes = plane;
    s.buffers.push_back(b);
  }
  testing::AddLayerMajorLayers(&s, kTokens, kRowBytes);
  auto reg = core_->RegisterPool(s);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  std::vector<BlockSpec> blocks(kN);
  for (uint32_t i = 0; i < kN; ++i) {
    blocks[i].key = KeyString(5000 + i);
    for (uint32_t t = 0; t < kBt; ++t) blocks[i].rows.push_back(i * kBt + t);
  }
  ASSERT_TRUE(Backup(Transfer(reg->pool_id, blocks)).ok());
  std::fill(k.begin(), k.end(), 0);
  std::fill(v.begin(), v.end(), 0);
  const uint64_t before = fake_->EnqueuedCopies();
  auto r = Restore(Transfer(reg->pool_id, blocks));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->restored_blocks, kN);
  const uint64_t copies = fake_->EnqueuedCopies() - before;
  // Layers per unit: a 16 MiB slab holds 3,971 block-layers of 4,224 bytes, 31 per block.
  const uint64_t layer_bytes = 2ull * kBt * (kHeads * kDim + 2 * kHeads);
  const uint64_t group = std::min<uint64_t>(kL, ((16ull << 20) / layer_bytes) / kN);
  EXPECT_EQ(group, 31u);
  // One copy per block and unit, plus the job arrays (rows, block pointers, views).
  EXPECT_EQ(copies, kN * ((kL + group - 1) / group) + 3) << "(block, layer) copies: " << kN * kL;
  EXPECT_EQ(fake_->Executed(Call::kDecode), kL) << "one decode per layer";
  // Every element within INT8 error of its head's range (max |x| / 127 per step).
  int bad = 0;
  for (int p = 0; p < 2; ++p) {
    const auto* want = reinterpret_cast<const uint16_t*>((p == 0 ? k0 : v0).data());
    const auto* got = reinterpret_cast<const uint16_t*>((p == 0 ? k : v).data());
    for (size_t i = 0; i < plane / 2 && bad < 4; ++i) {
      if (std::fabs(Bf16ToFloat(got[i]) - Bf16ToFloat(want[i])) > 0.5f / 127 + 0.01f) {
        ADD_FAILURE() << "plane " << p << " element " << i << ": " << Bf16ToFloat(got[i]) << " for "
                      << Bf16ToFloat(want[i]);
        ++bad;
      }
    }
  }
}

// A completed backup's payloads are hashed by the backend, on its hash threads, before
// on_written (BackupTask::checksums): the core then publishes them without hashing each block on
// the finishing worker alone.
TEST_F(CudaBackendTest, BackupChecksumsAreComputedByTheBackend) {
  Engine& e = NewEngine();
  kernels::BlockLayout lay;
  lay.row.num_heads = kHeads;
  lay.row.head_dim = kDim;
  lay.num_layers = kLayers;
  lay.kv_planes = 2;
  lay.block_tokens = kBlockTokens;
  auto bound = cuda_->Bind(Spec(e), lay, nullptr);
  ASSERT_TRUE(bound.ok()) << bound.status().ToString();
  std::unique_ptr<PoolBinding> binding = std::move(bound).value();
  constexpr uint32_t kN = 3;
  auto task = std::make_shared<BackupTask>();
  BackupTask* raw = task.get();
  task->ticket = 1;
  for (uint32_t b = 0; b < kN; ++b) {
    task->payloads.push_back(pool_mem_->data() + b * kBlockBytes);  // registered pool memory
    for (uint32_t t = 0; t < kBlockTokens; ++t) task->rows.push_back(b * kBlockTokens + t);
  }
  std::promise<std::function<void()>> deferred;
  task->defer = [&](std::function<void()> work) { deferred.set_value(std::move(work)); };
  std::vector<uint64_t> sums;
  Status written = Internal("not called");
  task->on_written = [&](const std::vector<uint8_t>& nonfinite, const Status& st) {
    written = st;
    EXPECT_EQ(nonfinite, std::vector<uint8_t>(kN, 0));
    sums = raw->checksums;
  };
  task->on_complete = [](const Status&) {};
  ASSERT_EQ(binding->StartBackup(task), StartResult::kPending);
  auto work = deferred.get_future();
  ASSERT_EQ(work.wait_for(10s), std::future_status::ready);
  work.get()();
  HIQ_EXPECT_OK(written);
  ASSERT_EQ(sums.size(), kN) << "the backend left the checksums to the core";
  for (uint32_t b = 0; b < kN; ++b) {
    EXPECT_EQ(sums[b], XXH3_64bits(task->payloads[b], kBlockBytes)) << "block " << b;
  }
  binding->Cancel();
  binding->Close();
}

TEST_F(CudaBackendTest, StagingIsAllocatedAtBindAndShownInStats) {
  EXPECT_EQ(core_->Snapshot().staging_device_bytes, 0u);
  Engine& e = NewEngine();
  Register(e);
  const uint64_t after_one = core_->Snapshot().staging_device_bytes;
  EXPECT_GE(after_one, 1u << 20);  // the budget, plus the pool's job arrays
  EXPECT_LT(after_one, (1u << 20) + (1u << 20));
  Engine& e2 = NewEngine(1);
  Register(e2);
  EXPECT_GT(core_->Snapshot().staging_device_bytes, 2 * (1u << 20));  // one budget per device
}

// Registration leaves nothing queued on the device: a pool released (or a backend torn down)
// before its first task would otherwise return or free its job arrays under a queued upload,
// and the next bind would reuse them. The views reach the device with the first task, be it a
// restore into an arena another pool used before.
TEST_F(CudaBackendTest, BindingEnqueuesNoDeviceWork) {
  Options o;
  o.auto_run = false;
  Build(o);
  Engine& e = NewEngine();
  const std::vector<uint8_t> original = e.Bytes();
  const uint64_t pool = Register(e);
  EXPECT_EQ(fake_->PendingOps(), 0u) << "registration enqueued device work";
  fake_->SetAutoRun(true);
  ASSERT_TRUE(Backup(Transfer(pool, Blocks(1, 2, 0))).ok());
  HIQ_EXPECT_OK(core_->ReleasePool(pool));
  fake_->SetAutoRun(false);
  Engine& e2 = NewEngine();
  const uint64_t p2 = Register(e2);  // takes the released pool's job arrays
  EXPECT_EQ(fake_->PendingOps(), 0u) << "registration enqueued device work";
  fake_->SetAutoRun(true);
  auto r = Restore(Transfer(p2, Blocks(1, 2, 32)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->restored_blocks, 2u);
  ExpectRestored(e2, original, 0, 32, 2 * kBlockTokens, kInt8);
}

TEST_F(CudaBackendTest, LayerLargerThanASlabIsRefusedAtRegistration) {
  Options o;
  o.staging_bytes = 2 * 512;  // slabs of 512 bytes: a layer of a block is 1,056
  Build(o);
  Engine& e = NewEngine();
  auto r = core_->RegisterPool(Spec(e));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("cuda_staging_bytes"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(fake_->OpenIpcBuffers(), 0u);
}

// ---------------------------------------------------------------------------------------------
// No worker waits on device work

// TP=4 ranks on four GPUs, two transfer workers. Each rank records its wait_event on its stream
// and sends an asynchronous Backup and an asynchronous Restore; its stream reaches the record
// only after every rank's requests were answered (ranks wait for each other in an all-reduce).
// A daemon whose workers wait for the device deadlocks here: two workers held by two ranks,
// the other two never answered.
TEST_F(CudaBackendTest, TpRanksWhoseWaitEventsCompleteAfterAllRepliesDoNotDeadlock) {
  constexpr uint32_t kTp = 4;
  std::vector<uint64_t> pools;
  for (uint32_t r = 0; r < kTp; ++r) pools.push_back(Register(NewEngine(r), kInt8, r, kTp));
  // Blocks to restore later, backed up while nothing waits.
  for (uint32_t r = 0; r < kTp; ++r) ASSERT_TRUE(Backup(Transfer(pools[r], Blocks(50, 2, 0))).ok());
  const uint64_t encodes = fake_->Executed(Call::kEncode);
  const uint64_t decodes = fake_->Executed(Call::kDecode);
  std::vector<uint64_t> records, tickets;
  std::vector<std::future<StatusOr<BackupResult>>> backups;
  for (uint32_t r = 0; r < kTp; ++r) {
    records.push_back(RecordLate(*engines_[r]));
    TransferSpec t = Transfer(pools[r], Blocks(10, 2, 16), /*sync=*/false);
    t.wait_event = kWait;
    t.done_event = kDone;
    backups.push_back(BackupAsync(std::move(t)));
  }
  for (uint32_t r = 0; r < kTp; ++r) {
    auto b = Await(backups[r], 3s);
    ASSERT_TRUE(b.ok()) << "rank " << r << ": " << b.status().ToString()
                        << " (a transfer worker waits for the rank's device)";
    for (BlockResult res : b->results) EXPECT_EQ(res, BlockResult::kStored);
    tickets.push_back(b->ticket);
  }
  // Answered, and the daemon did not run early: nothing is enqueued before the wait value.
  EXPECT_EQ(fake_->Enqueued(Call::kEncode), encodes);
  for (uint32_t r = 0; r < kTp; ++r) {
    EXPECT_EQ(engines_[r]->Slot(kDone), 0u);
    EXPECT_EQ(Lookup(pools[r], 10, 2), 0u) << "published before the device wrote it";
  }
  // A restore per rank, queued behind its backup: no worker is held meanwhile either.
  std::vector<std::future<StatusOr<RestoreResult>>> restores;
  for (uint32_t r = 0; r < kTp; ++r) {
    TransferSpec t = Transfer(pools[r], Blocks(50, 2, 40), /*sync=*/true);
    restores.push_back(RestoreAsync(std::move(t)));
  }
  // The workers are free: a CUDA pool on a fifth GPU runs meanwhile. (On a GPU whose staging
  // pairs are all held by waiting tasks it would wait for a pair, without holding a worker.)
  Engine& free_rank = NewEngine(4);
  const uint64_t other = Register(free_rank, kRaw);
  auto b = BackupAsync(Transfer(other, Blocks(70, 1, 0)));
  ASSERT_TRUE(Await(b, 3s).ok()) << "a pool with no wait was stalled by pools that wait";
  for (uint64_t rec : records) Complete(rec);
  for (uint32_t r = 0; r < kTp; ++r) {
    auto res = Await(restores[r]);
    ASSERT_TRUE(res.ok()) << res.status().ToString();
    EXPECT_EQ(res->restored_blocks, 2u);
  }
  core_->WaitIdle();
  for (uint32_t r = 0; r < kTp; ++r) {
    EXPECT_EQ(Lookup(pools[r], 10, 2), 2u);
    EXPECT_EQ(engines_[r]->Slot(kDone), tickets[r]);
  }
  EXPECT_GT(fake_->Executed(Call::kEncode), encodes);
  EXPECT_GT(fake_->Executed(Call::kDecode), decodes);
}

// HOST pools share the transfer workers with CUDA pools: CUDA pools whose devices wait (several
// queued requests each) must not stall them.
TEST_F(CudaBackendTest, HostPoolsKeepWorkingWhileCudaPoolsWait) {
  std::vector<uint64_t> records;
  std::vector<std::future<StatusOr<BackupResult>>> queued;
  for (int d = 0; d < 3; ++d) {
    Engine& e = NewEngine(d);
    const uint64_t pool = Register(e);
    records.push_back(RecordLate(e));
    for (uint32_t i = 0; i < 3; ++i) {
      TransferSpec t = Transfer(pool, Blocks(100 * (d + 1) + i, 1, 4 * i), /*sync=*/i == 2);
      t.wait_event = kWait;
      queued.push_back(BackupAsync(std::move(t)));
    }
  }
  // A HOST pool over POSIX shm, as an engine on the CPU registers it.
  const std::string name = "/hiq-cuda-test-" + std::to_string(::getpid());
  ::shm_unlink(name.c_str());
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 2 * kPlaneBytes), 0);
  ::close(fd);
  RegisterSpec hs = Spec(*engines_[0]);
  hs.device_kind = 1;
  hs.cuda_device_uuid.clear();
  hs.events = EventsSpec{};
  for (uint32_t p = 0; p < 2; ++p) {
    hs.buffers[p] = BufferSpec{};
    hs.buffers[p].has_host_shm_name = true;
    hs.buffers[p].host_shm_name = name;
    hs.buffers[p].size_bytes = 2 * kPlaneBytes;
  }
  for (uint32_t l = 0; l < kLayers; ++l) {
    hs.layers[l].k.buffer = 0;
    hs.layers[l].v.buffer = 1;
    hs.layers[l].v.offset_bytes += 0;
  }
  auto host_pool = core_->RegisterPool(hs);
  ::shm_unlink(name.c_str());
  ASSERT_TRUE(host_pool.ok()) << host_pool.status().ToString();
  auto hb = BackupAsync(Transfer(host_pool->pool_id, Blocks(900, 2, 0)));
  auto hbr = Await(hb, 3s);
  ASSERT_TRUE(hbr.ok()) << hbr.status().ToString() << " (HOST work stalled by waiting CUDA pools)";
  auto hr = RestoreAsync(Transfer(host_pool->pool_id, Blocks(900, 2, 32)));
  auto hrr = Await(hr, 3s);
  ASSERT_TRUE(hrr.ok()) << hrr.status().ToString();
  EXPECT_EQ(hrr->restored_blocks, 2u);
  for (uint64_t rec : records) Complete(rec);
  for (auto& f : queued) EXPECT_TRUE(Await(f).ok());
}

// A pool's backups complete in request order, and so do its restores. A restore does not wait
// behind earlier backups (they run on their own strands and streams), unless it writes rows an
// earlier backup reads (or signals a slot it signals): then it waits for that backup.
TEST_F(CudaBackendTest, EachPoolsWorkCompletesInRequestOrderPerDirection) {
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  Engine& e2 = NewEngine(1);
  const uint64_t pool2 = Register(e2);
  const uint64_t first = RecordLate(e);
  Mutex mu;
  // Per pool, per direction (0 backup, 1 restore): the tickets in reply order.
  std::vector<uint64_t> order[2][2];
  std::atomic<int> replies{0};
  constexpr int kTasks = 12;
  for (int i = 0; i < kTasks; ++i) {
    for (uint64_t p : {pool, pool2}) {
      // Rows 4 * (i % 8): restore 8 (ticket 9) writes the rows of backup 0 (ticket 1), restore 11
      // those of backup 3; restores 2 and 5 conflict with no earlier backup.
      TransferSpec t = Transfer(p, Blocks(1000 + i, 1, 4 * (i % 8)), /*sync=*/true);
      if (i == 0 && p == pool) t.wait_event = kWait;
      auto* out = order[p == pool ? 0 : 1];
      if (i % 3 == 2) {
        core_->Restore(t, [&, out](StatusOr<RestoreResult> r) {
          ASSERT_TRUE(r.ok()) << r.status().ToString();
          MutexLock lock(&mu);
          out[1].push_back(r->ticket);
          ++replies;
        });
      } else {
        core_->Backup(t, [&, out](StatusOr<BackupResult> r) {
          ASSERT_TRUE(r.ok()) << r.status().ToString();
          MutexLock lock(&mu);
          out[0].push_back(r->ticket);
          ++replies;
        });
      }
    }
  }
  // pool2 proceeds while pool waits for its first task's wait_event; so do pool's restores that
  // conflict with no waiting backup.
  ASSERT_TRUE(WaitUntil([&] {
    MutexLock lock(&mu);
    return order[1][0].size() + order[1][1].size() == kTasks && order[0][1].size() == 2;
  }));
  std::this_thread::sleep_for(50ms);
  {
    MutexLock lock(&mu);
    EXPECT_TRUE(order[0][0].empty());
    EXPECT_EQ(order[0][1], (std::vector<uint64_t>{3, 6}));
  }
  Complete(first);
  ASSERT_TRUE(WaitUntil([&] { return replies.load() == 2 * kTasks; }));
  MutexLock lock(&mu);
  const std::vector<uint64_t> backups = {1, 2, 4, 5, 7, 8, 10, 11}, restores = {3, 6, 9, 12};
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(order[p][0], backups);
    EXPECT_EQ(order[p][1], restores);
  }
}

// A restore requested while a backup of the same pool is still on the device (its work not run)
// is enqueued at once, on the pool's high-priority streams, and completes while the backup is
// still pending: the device runs only the high-priority streams here.
TEST_F(CudaBackendTest, RestoreIsEnqueuedAboveARunningBackupOfItsPool) {
  Options o;
  o.staging_bytes = 64ull << 20;  // two slab pairs: one for each task
  Build(o);
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  const std::vector<uint8_t> original = e.Bytes();
  ASSERT_TRUE(Backup(Transfer(pool, Blocks(1, 2, 0))).ok());
  fake_->SetAutoRun(false);
  const uint64_t encodes = fake_->Executed(Call::kEncode);
  TransferSpec bt = Transfer(pool, Blocks(10, 2, 8), /*sync=*/true);
  bt.done_event = kDone;
  auto b = BackupAsync(bt);
  ASSERT_TRUE(WaitUntil([&] { return fake_->BlockedSyncs() == 1; }));  // on the device
  EXPECT_EQ(fake_->EnqueuedAt(Call::kEncode, DeviceApi::Priority::kHigh), 0u);
  TransferSpec rt = Transfer(pool, Blocks(1, 2, 32), /*sync=*/true);
  rt.layer_event_base = kLayerBase;
  rt.done_event = kLayerBase + kLayers;  // a slot of its own
  auto r = RestoreAsync(rt);
  ASSERT_TRUE(WaitUntil(
      [&] { return fake_->EnqueuedAt(Call::kDecode, DeviceApi::Priority::kHigh) == kLayers; }, 2s))
      << "the restore was not enqueued while the backup was on the device";
  EXPECT_EQ(fake_->EnqueuedAt(Call::kDecode, DeviceApi::Priority::kLow), 0u);
  ASSERT_TRUE(WaitUntil([&] { return fake_->BlockedSyncs() == 2; }));
  fake_->RunReadyAt(DeviceApi::Priority::kHigh);
  auto rr = Await(r, 5s);
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->restored_blocks, 2u);
  ExpectRestored(e, original, 0, 32, 2 * kBlockTokens, kInt8);
  EXPECT_EQ(e.Slot(kLayerBase + kLayers), rr->ticket);
  for (uint32_t l = 0; l < kLayers; ++l) EXPECT_EQ(e.Slot(kLayerBase + l), rr->ticket);
  // The backup has not run at all: no encode, its done slot untouched, no reply.
  EXPECT_EQ(fake_->Executed(Call::kEncode), encodes);
  EXPECT_EQ(e.Slot(kDone), 0u);
  EXPECT_EQ(b.wait_for(0ms), std::future_status::timeout);
  fake_->SetAutoRun(true);
  auto br = Await(b);
  ASSERT_TRUE(br.ok()) << br.status().ToString();
  EXPECT_LT(br->ticket, rr->ticket);
  EXPECT_EQ(e.Slot(kDone), br->ticket);
  core_->WaitIdle();
  EXPECT_EQ(Lookup(pool, 10, 2), 2u);
}

// Completion is observed when the device signals it: the pool's completion thread blocks in
// SynchronizeEvent on the task's completion event (cudaEventBlockingSync in the real runtime)
// while the work is on the device, makes no query, and the reply comes once the fake ran it.
TEST_F(CudaBackendTest, CompletionIsObservedWhenTheDeviceSignalsItWithoutPolling) {
  Options o;
  o.auto_run = false;
  Build(o);
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  const std::vector<uint8_t> original = e.Bytes();
  auto b = BackupAsync(Transfer(pool, Blocks(1, 2, 0), /*sync=*/true));
  ASSERT_TRUE(WaitUntil([&] { return fake_->BlockedSyncs() == 1; }))
      << "no completion thread waits for the device";
  std::this_thread::sleep_for(20ms);  // any poll with a backoff would have queried by now
  EXPECT_EQ(b.wait_for(0ms), std::future_status::timeout);
  EXPECT_EQ(fake_->Called(Call::kQuery), 0u);
  fake_->RunReady();  // the device completes the backup: the waiter wakes
  auto br = Await(b);
  ASSERT_TRUE(br.ok()) << br.status().ToString();
  core_->WaitIdle();
  EXPECT_EQ(Lookup(pool, 1, 2), 2u);
  auto r = RestoreAsync(Transfer(pool, Blocks(1, 2, 32), /*sync=*/true));
  ASSERT_TRUE(WaitUntil([&] { return fake_->BlockedSyncs() == 1; }));
  fake_->RunReady();
  auto rr = Await(r);
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  ExpectRestored(e, original, 0, 32, 2 * kBlockTokens, kInt8);
  EXPECT_EQ(fake_->Called(Call::kQuery), 0u) << "completion was polled";
  EXPECT_GE(fake_->Called(Call::kSynchronize), 2u);
}

// ---------------------------------------------------------------------------------------------
// Errors

// A failed enqueue (here a copy the runtime refuses, as with a device out of memory) never
// answers restored_blocks = n or STORED: a sync request gets the error, an asynchronous one
// (answered when queued) sees it as the failed bit. Every slot the request names receives the
// ticket with the failed bit, so that the engine's stream never hangs; the next request works.
TEST_F(CudaBackendTest, FailedEnqueueReleasesEverySlotWithTheFailedBit) {
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  ASSERT_TRUE(Backup(Transfer(pool, Blocks(1, 4, 0))).ok());
  const std::vector<uint8_t> before = e.Bytes();
  for (bool sync : {false, true}) {
    SCOPED_TRACE(sync ? "sync" : "async");
    // The second copy of the restore fails (the first uploads its job arrays).
    fake_->FailCall(Call::kCopy, ResourceExhausted("cudaErrorMemoryAllocation (out of memory)"),
                    /*skip=*/1);
    TransferSpec t = Transfer(pool, Blocks(1, 4, 32), sync);
    t.layer_event_base = kLayerBase;
    t.done_event = kDone;
    const uint64_t done_before = e.Slot(kDone) & ~kTicketFailedBit;
    auto f = RestoreAsync(t);
    auto r = Await(f);
    if (sync) {
      ASSERT_FALSE(r.ok()) << "an enqueue failure answered restored_blocks = "
                           << r->restored_blocks;
      EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
    } else {
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
    core_->WaitIdle();
    const uint64_t done = e.Slot(kDone);
    EXPECT_NE(done & kTicketFailedBit, 0u) << "done slot " << done;
    EXPECT_GT(done & ~kTicketFailedBit, done_before);
    if (!sync) EXPECT_EQ(done, r->ticket | kTicketFailedBit);
    for (uint32_t l = 0; l < kLayers; ++l) {
      EXPECT_EQ(e.Slot(kLayerBase + static_cast<int32_t>(l)), done) << "layer " << l;
    }
  }
  // Backup: an encode launch failure; nothing is published, the done slot says failed.
  fake_->FailCall(Call::kEncode, Internal("cudaErrorLaunchOutOfResources"));
  TransferSpec bt = Transfer(pool, Blocks(20, 2, 8), /*sync=*/false);
  bt.done_event = kDone;
  auto bf = BackupAsync(bt);
  auto b = Await(bf);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  core_->WaitIdle();
  EXPECT_EQ(Lookup(pool, 20, 2), 0u);
  EXPECT_EQ(e.Slot(kDone), b->ticket | kTicketFailedBit);
  // A non-sticky error fails one request only.
  auto ok = Restore(Transfer(pool, Blocks(1, 4, 32)));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->restored_blocks, 4u);
  ExpectRestored(e, before, 0, 32, 16, kInt8);
  MutexLock lock(&mu_);
  EXPECT_TRUE(failed_devices_.empty());
}

// Each layer slot receives the ticket only once that layer of every block is written, and the
// done slot only after the last: stepping the device one operation at a time, a slot that holds
// the ticket always finds its layer's rows restored.
TEST_F(CudaBackendTest, SlotsReceiveTheirTicketOnlyAfterTheWorkTheySignal) {
  Engine& e = NewEngine();
  const uint64_t pool = Register(e, kRaw);
  ASSERT_TRUE(Backup(Transfer(pool, Blocks(1, 4, 0))).ok());
  fake_->SetAutoRun(false);
  TransferSpec t = Transfer(pool, Blocks(1, 4, 32), /*sync=*/false);
  t.layer_event_base = kLayerBase;
  t.done_event = kDone;
  auto f = RestoreAsync(t);
  auto r = Await(f);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const uint64_t ticket = r->ticket;
  // Rows 0..15 (source) and 32..47 (destination) of layer l, K and V, compared bytewise.
  auto layer_done = [&](uint32_t l) {
    for (uint32_t p = 0; p < 2; ++p) {
      const auto& plane = p == 0 ? e.k : e.v;
      const uint64_t base = uint64_t{l} * kRows * kRowBytes;
      if (std::memcmp(plane.data() + base, plane.data() + base + 32 * kRowBytes, 16 * kRowBytes) !=
          0) {
        return false;
      }
    }
    return true;
  };
  ASSERT_TRUE(WaitUntil([&] { return fake_->PendingOps() > 0; }));
  for (int step = 0; step < 10000 && e.Slot(kDone) != ticket; ++step) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      if (e.Slot(kLayerBase + static_cast<int32_t>(l)) == ticket) {
        ASSERT_TRUE(layer_done(l)) << "layer " << l << "'s slot holds the ticket before its rows";
      }
    }
    if (fake_->RunReady() == 0) std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(e.Slot(kDone), ticket);
  for (uint32_t l = 0; l < kLayers; ++l) {
    EXPECT_EQ(e.Slot(kLayerBase + static_cast<int32_t>(l)), ticket);
    EXPECT_TRUE(layer_done(l));
  }
  // The stores ran in layer order, the done slot last.
  std::vector<uint64_t*> order;
  for (const auto& [slot, value] : fake_->SlotStores()) order.push_back(slot);
  ASSERT_EQ(order.size(), kLayers + 1);
  // (The daemon's mapping of the slots, at its own address: slot i is 8 words after slot i-1.)
  for (uint32_t l = 0; l < kLayers; ++l) EXPECT_EQ(order[l], order[0] + 8 * l) << "store " << l;
  EXPECT_EQ(order[kLayers], order[0] - 8 * (kLayerBase - kDone)) << "the done slot is not last";
  fake_->SetAutoRun(true);
}

// Engines that never store their wait value (dead, or hostile) hold no staging and no worker:
// five of them on one GPU whose staging is a single slab pair, then a sixth on that GPU works at
// once; each waiting request ends at wait_timeout with its done slot released as failed, having
// touched nothing.
TEST_F(CudaBackendTest, EnginesThatNeverWriteHoldNoStaging) {
  Options o;
  o.staging_bytes = 1 << 20;  // one slab pair
  // The live backup must not wait for the others' wait_timeout: a wait_timeout far above the
  // margin its answer is given.
  const auto margin = hiqcache::test_time::Margin(1500ms);
  o.wait_timeout = 3 * margin;
  Build(o);
  std::vector<std::future<StatusOr<BackupResult>>> waiting;
  std::vector<Engine*> dead;
  for (int i = 0; i < 5; ++i) {
    Engine& e = NewEngine(0);
    const uint64_t pool = Register(e);
    TransferSpec t = Transfer(pool, Blocks(100 + 10 * i, 2, 0), /*sync=*/true);
    t.wait_event = kWait;
    t.done_event = kDone;
    waiting.push_back(BackupAsync(t));
    dead.push_back(&e);
  }
  Engine& live = NewEngine(0);
  const uint64_t pool = Register(live);
  const auto t0 = std::chrono::steady_clock::now();
  auto b = BackupAsync(Transfer(pool, Blocks(500, 2, 0), /*sync=*/true));
  auto br = Await(b, 2 * margin);
  ASSERT_TRUE(br.ok()) << br.status().ToString() << " (staging held by engines that never wrote)";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, margin);
  EXPECT_EQ(Lookup(pool, 500, 2), 2u);
  for (int i = 0; i < 5; ++i) {
    auto r = Await(waiting[i], o.wait_timeout + hiqcache::test_time::Margin(10s));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
    EXPECT_EQ(dead[i]->Slot(kDone) & kTicketFailedBit, kTicketFailedBit);
    EXPECT_EQ(fake_->KernelsTouching(dead[i]->k_handle), 0u);
  }
}

// A request whose caller's deadline passed before its work started is dropped without touching
// the engine's memory, its done slot released as failed.
TEST_F(CudaBackendTest, ARequestWhoseCallerGaveUpTouchesNothing) {
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  const uint64_t late = RecordLate(e);
  TransferSpec t = Transfer(pool, Blocks(10, 2, 8), /*sync=*/false);
  t.wait_event = kWait;
  t.done_event = kDone;
  t.deadline = std::chrono::steady_clock::now() + 100ms;
  auto f = BackupAsync(t);
  auto r = Await(f);
  ASSERT_TRUE(r.ok());
  std::this_thread::sleep_for(200ms);
  Complete(late);  // the engine's value comes after its caller gave up
  core_->WaitIdle();
  EXPECT_EQ(e.Slot(kDone), r->ticket | kTicketFailedBit);
  EXPECT_EQ(fake_->KernelsTouching(e.k_handle), 0u);
  EXPECT_EQ(Lookup(pool, 10, 2), 0u);
}

TEST_F(CudaBackendTest, IpcEventsAreRefusedNamingTheField) {
  Engine& e = NewEngine();
  RegisterSpec s = Spec(e);
  s.events = EventsSpec{};
  s.events.cuda_ipc_event_handles.push_back(std::string(64, 'e'));
  auto r = core_->RegisterPool(s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("events.cuda_ipc_event_handles"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(fake_->OpenIpcBuffers(), 0u);
}

// A sticky error (the context is lost) fails the device: its requests fail with UNAVAILABLE and
// a clear message from then on, the daemon is told once (it exits to be restarted), HOST work
// and the block store are unaffected.
TEST_F(CudaBackendTest, StickyErrorOnEnqueueFailsTheDevice) {
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  ASSERT_TRUE(Backup(Transfer(pool, Blocks(1, 2, 0))).ok());
  fake_->FailCall(Call::kEncode, DataLoss("cudaErrorIllegalAddress (an illegal memory access)"));
  auto b = Backup(Transfer(pool, Blocks(10, 2, 8)));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kUnavailable) << b.status().ToString();
  EXPECT_NE(b.status().message().find("restart"), std::string::npos) << b.status().message();
  auto r = Restore(Transfer(pool, Blocks(1, 2, 32)));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(cuda_->DeviceFailure().ok());
  MutexLock lock(&mu_);
  EXPECT_EQ(failed_devices_, std::vector<int>{0});
}

TEST_F(CudaBackendTest, StickyErrorSeenByTheCompletionThreadFailsTheDevice) {
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  fake_->FailExecution(Call::kEncode);  // the kernel faults on the device, after the enqueue
  auto f = BackupAsync(Transfer(pool, Blocks(1, 2, 0), /*sync=*/true));
  auto b = Await(f);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kUnavailable) << b.status().ToString();
  core_->WaitIdle();
  EXPECT_EQ(Lookup(pool, 1, 2), 0u);
  auto again = Backup(Transfer(pool, Blocks(5, 1, 0), /*sync=*/false));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable);
  MutexLock lock(&mu_);
  EXPECT_EQ(failed_devices_.size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// Release

// ReleasePool while the pool's first task is on the device (the device has not run it yet) and
// two more are queued: the queued ones never reach the device (no kernel names the buffers after
// the release began), the release returns only once the device work drained, and then every
// mapping and the slots' registration of the pool are closed.
TEST_F(CudaBackendTest, ReleaseWaitsForDeviceWorkAndCancelsQueuedWork) {
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  ASSERT_TRUE(Backup(Transfer(pool, Blocks(1, 2, 0))).ok());
  const size_t registrations = fake_->Registered().size();
  fake_->SetAutoRun(false);
  TransferSpec t1 = Transfer(pool, Blocks(10, 2, 8), /*sync=*/false);
  auto f1 = BackupAsync(t1);
  ASSERT_TRUE(Await(f1).ok());
  // On the device, all of it enqueued: its completion thread waits on its completion event,
  // recorded after its last kernel.
  ASSERT_TRUE(WaitUntil([&] { return fake_->PendingOps() > 0 && fake_->BlockedSyncs() > 0; }));
  // The restore writes rows the running backup reads: it waits for it (it does not overtake).
  auto f2 = RestoreAsync(Transfer(pool, Blocks(1, 2, 8), /*sync=*/true));
  auto f3 = BackupAsync(Transfer(pool, Blocks(30, 1, 16), /*sync=*/true));
  const uint64_t k_kernels = fake_->KernelsTouching(e.k_handle);
  std::atomic<bool> returned{false};
  Status released;
  std::thread releaser([&] {
    released = core_->ReleasePool(pool);
    returned = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(returned.load()) << "ReleasePool returned while the pool's device work was queued";
  EXPECT_TRUE(fake_->BufferOpen(e.k_handle));
  fake_->SetAutoRun(true);
  releaser.join();
  HIQ_EXPECT_OK(released);
  EXPECT_FALSE(fake_->BufferOpen(e.k_handle));
  EXPECT_FALSE(fake_->BufferOpen(e.v_handle));
  EXPECT_EQ(fake_->Registered().size(), registrations - 1) << "the slots stay page-locked";
  EXPECT_EQ(fake_->LiveStreams(), 0u);
  EXPECT_EQ(fake_->KernelsTouching(e.k_handle), k_kernels)
      << "queued work of a released pool reached the device";
  auto r2 = Await(f2);
  auto r3 = Await(f3);
  EXPECT_EQ(r2.status().code(), StatusCode::kCancelled) << r2.status().ToString();
  EXPECT_EQ(r3.status().code(), StatusCode::kCancelled) << r3.status().ToString();
  // The completed backup was published; the cancelled one left nothing behind.
  Engine& again = NewEngine();
  const uint64_t p2 = Register(again);
  EXPECT_EQ(Lookup(p2, 10, 2), 2u);
  EXPECT_EQ(Lookup(p2, 30, 1), 0u);
  EXPECT_EQ(core_->ReleasePool(pool).code(), StatusCode::kNotFound);
}

// Device work that does not complete in time (a device far behind): the release gives up after
// release_timeout and says so; the mappings stay open until that work completes, then close.
TEST_F(CudaBackendTest, ReleaseIsBoundedAndClosesOnceTheWorkCompletes) {
  Options o;
  o.release_timeout = 150ms;
  o.auto_run = false;
  Build(o);
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  TransferSpec t = Transfer(pool, Blocks(10, 2, 8), /*sync=*/false);
  auto f = BackupAsync(t);
  ASSERT_TRUE(Await(f).ok());
  ASSERT_TRUE(WaitUntil([&] { return fake_->PendingOps() > 0; }));
  const auto t0 = std::chrono::steady_clock::now();
  Status st = core_->ReleasePool(pool);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  EXPECT_TRUE(fake_->BufferOpen(e.k_handle)) << "closed while device work still uses it";
  fake_->SetAutoRun(true);
  EXPECT_TRUE(WaitUntil([&] { return !fake_->BufferOpen(e.k_handle); }));
}

// A pool released while its request waits for the engine's wait value (the engine died) is
// released at once: the waiting work is cancelled on the host, never enqueued, and its done slot
// is released as failed.
TEST_F(CudaBackendTest, ReleaseOfAPoolWaitingForItsEngineIsImmediate) {
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  const uint64_t late = RecordLate(e);
  TransferSpec t = Transfer(pool, Blocks(10, 2, 8), /*sync=*/false);
  t.wait_event = kWait;
  t.done_event = kDone;
  auto f = BackupAsync(t);
  auto r = Await(f);
  ASSERT_TRUE(r.ok());
  const auto t0 = std::chrono::steady_clock::now();
  HIQ_EXPECT_OK(core_->ReleasePool(pool));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_FALSE(fake_->BufferOpen(e.k_handle));
  EXPECT_EQ(e.Slot(kDone), r->ticket | kTicketFailedBit);
  EXPECT_EQ(fake_->KernelsTouching(e.k_handle), 0u);
  pending_records_.erase(late);
}

TEST_F(CudaBackendTest, ReleasePoolsOfClientWaitsTheSameWay) {
  Engine& e = NewEngine();
  RegisterSpec s = Spec(e);
  s.client_pid = 777;
  auto reg = core_->RegisterPool(s);
  ASSERT_TRUE(reg.ok());
  fake_->SetAutoRun(false);
  TransferSpec t = Transfer(reg->pool_id, Blocks(10, 2, 8), /*sync=*/false);
  auto f = BackupAsync(t);
  ASSERT_TRUE(Await(f).ok());
  ASSERT_TRUE(WaitUntil([&] { return fake_->PendingOps() > 0; }));
  std::thread completer([&] {
    std::this_thread::sleep_for(100ms);
    fake_->SetAutoRun(true);
  });
  EXPECT_EQ(core_->ReleasePoolsOfClient(777), 1u);
  EXPECT_FALSE(fake_->BufferOpen(e.k_handle));
  completer.join();
}

// ---------------------------------------------------------------------------------------------
// Registration

TEST_F(CudaBackendTest, BufferOnAnotherGpuThanTheUuidIsRejectedNamingTheField) {
  Engine& e = NewEngine(1);  // its memory is on device 1
  RegisterSpec s = Spec(e);
  s.cuda_device_uuid = UuidOf(*fake_, 0);
  auto r = core_->RegisterPool(s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("device.cuda_device_uuid"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("buffers[0]"), std::string::npos) << r.status().message();
  EXPECT_EQ(fake_->OpenIpcBuffers(), 0u);
}

TEST_F(CudaBackendTest, UnopenableHandleSaysWhatToChange) {
  Engine& e = NewEngine();
  fake_->FailCall(Call::kOpenIpcBuffer, InvalidArgument("cudaErrorInvalidValue"));
  auto r = core_->RegisterPool(Spec(e));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("buffers[0].cuda_ipc_handle"), std::string::npos);
  EXPECT_NE(r.status().message().find("expandable_segments:False"), std::string::npos)
      << r.status().message();
}

// The pool is page-locked in chunks, and no block straddles two of them: every copy between a
// slab and the pool lies inside one registration (the fake reports any other).
TEST_F(CudaBackendTest, PoolRegistrationChunksHoldWholeBlocks) {
  Options o;
  o.register_chunk = 1 << 20;  // 512 chunks of 1 MiB; a block's slot is 3,232 bytes
  Build(o);
  EXPECT_EQ(fake_->Registered().size(), 512u);
  Engine& e = NewEngine();
  const uint64_t pool = Register(e);
  // Enough blocks (5 MiB) to fill extents across several chunk boundaries.
  for (uint32_t round = 0; round < 100; ++round) {
    auto b = Backup(Transfer(pool, Blocks(round * 16, 16, 0)));
    ASSERT_TRUE(b.ok()) << round << ": " << b.status().ToString();
  }
  EXPECT_TRUE(fake_->Violations().empty()) << Joined(fake_->Violations());
  auto r = Restore(Transfer(pool, Blocks(99 * 16, 8, 0)));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_blocks, 8u);
}

// ---------------------------------------------------------------------------------------------
// The fake's own checks have teeth.

TEST(FakeDeviceTest, ReportsASlabReusedWithoutAWait) {
  FakeDevice fake(1);
  auto slab = fake.AllocDevice(0, 256);
  auto host = fake.AllocPinned(256);
  auto compute = fake.CreateStream(0, DeviceApi::Priority::kLow);
  auto copy = fake.CreateStream(0, DeviceApi::Priority::kLow);
  auto filled = fake.CreateEvent(0);
  ASSERT_TRUE(slab.ok() && host.ok() && compute.ok() && copy.ok() && filled.ok());
  // Producer writes the slab on `compute`; the consumer copies it out on `copy` after a wait.
  DeviceApi::Copy fill{*slab, *host, 256}, drain{*host, *slab, 256};
  HIQ_ASSERT_OK(fake.CopyAsync(0, {&fill, 1}, *compute));
  HIQ_ASSERT_OK(fake.RecordEvent(0, *filled, *compute));
  HIQ_ASSERT_OK(fake.StreamWaitEvent(0, *copy, *filled));
  HIQ_ASSERT_OK(fake.CopyAsync(0, {&drain, 1}, *copy));
  fake.RunReady();
  EXPECT_TRUE(fake.Violations().empty());
  // Reusing the slab on `compute` without waiting for the consumer's read is a race.
  HIQ_ASSERT_OK(fake.CopyAsync(0, {&drain, 1}, *copy));
  HIQ_ASSERT_OK(fake.CopyAsync(0, {&fill, 1}, *compute));
  fake.RunReady();
  EXPECT_FALSE(fake.Violations().empty());
}

TEST(FakeDeviceTest, WaitCapturesTheMostRecentRecordAtTheTimeOfTheCall) {
  FakeDevice fake(1);
  auto producer = fake.CreateStream(0, DeviceApi::Priority::kLow);
  auto stream = fake.CreateStream(0, DeviceApi::Priority::kLow);
  auto theirs = fake.CreateEvent(0);
  auto mine = fake.CreateEvent(0);
  ASSERT_TRUE(producer.ok() && stream.ok() && theirs.ok() && mine.ok());
  // Waiting before anything was recorded: no wait at all.
  HIQ_ASSERT_OK(fake.StreamWaitEvent(0, *stream, *theirs));
  HIQ_ASSERT_OK(fake.RecordEvent(0, *mine, *stream));
  fake.RunReady();
  EXPECT_TRUE(*fake.QueryEvent(0, *mine));
  // A record that has not run yet, then a wait: `stream` runs only after it.
  auto slab = fake.AllocDevice(0, 256);
  auto host = fake.AllocPinned(256);
  ASSERT_TRUE(slab.ok() && host.ok());
  DeviceApi::Copy c{*slab, *host, 256};
  HIQ_ASSERT_OK(fake.CopyAsync(0, {&c, 1}, *producer));
  HIQ_ASSERT_OK(fake.RecordEvent(0, *theirs, *producer));
  HIQ_ASSERT_OK(fake.StreamWaitEvent(0, *stream, *theirs));
  HIQ_ASSERT_OK(fake.RecordEvent(0, *mine, *stream));
  // A record made after the wait is not what it waits for.
  HIQ_ASSERT_OK(fake.CopyAsync(0, {&c, 1}, *producer));
  HIQ_ASSERT_OK(fake.RecordEvent(0, *theirs, *producer));
  while (fake.RunReady() > 0) {
  }
  EXPECT_TRUE(*fake.QueryEvent(0, *mine));
  EXPECT_TRUE(fake.Violations().empty());
}

TEST(FakeDeviceTest, ReportsASlotStoreIntoUnregisteredMemory) {
  FakeDevice fake(1);
  auto stream = fake.CreateStream(0, DeviceApi::Priority::kLow);
  ASSERT_TRUE(stream.ok());
  alignas(64) static uint64_t slot[8];
  HIQ_ASSERT_OK(fake.WriteValue64(0, *stream, slot, 7));
  fake.RunReady();
  EXPECT_EQ(slot[0], 7u);
  EXPECT_FALSE(fake.Violations().empty());
}

TEST(StagingPlanTest, CutsTheBudgetIntoSlabPairs) {
  StagingPlan p = StagingPlan::For(128ull << 20);
  EXPECT_EQ(p.pairs, 4u);
  EXPECT_EQ(p.slab_bytes, 16ull << 20);
  p = StagingPlan::For(64ull << 20);
  EXPECT_EQ(p.pairs, 2u);
  EXPECT_EQ(p.slab_bytes, 16ull << 20);
  p = StagingPlan::For(4ull << 30);
  EXPECT_EQ(p.pairs, 8u);
  EXPECT_EQ(p.slab_bytes, 256ull << 20);
  p = StagingPlan::For(8192);
  EXPECT_EQ(p.pairs, 1u);
  EXPECT_EQ(p.slab_bytes, 4096u);
}

}  // namespace
}  // namespace hiqcache::server
