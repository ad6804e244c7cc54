// CacheCore with the HOST backend over real POSIX shared memory: the client's KV buffers and
// event slots are shm objects this test creates, as an engine would. Covers the backup / lookup /
// restore round trip (INT8 within the docs/design.md bound, RAW bit-exact), block statuses, atomic
// rejection, status codes, HOST event slots, pool release, and lookups over a TP group of
// namespaces named by their parts (also after a warm restart, before any pool registers again).
#include "core/cache_core.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "backends/host_backend.h"
#include "codec_cpu.h"
#include "core/cache_core_internal.h"
#include "pool/block_store.h"
#include "pool/pool_format.h"
#include "register_spec_util.h"
#include "server_test_util.h"
#include "time_margin.h"

namespace hiqcache::server {
namespace {

using namespace std::chrono_literals;
using testing::AnonBuffer;
using testing::KeyString;

constexpr int kMha = 1, kMla = 2, kInt8 = 0, kRaw = 1, kCuda = 2;
constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 64, kBlockTokens = 4, kRows = 32;
constexpr uint64_t kRowBytes = uint64_t{kHeads} * kDim * 2;              // 256
constexpr uint64_t kPlaneBytes = uint64_t{kLayers} * kRows * kRowBytes;  // one buffer: K or V
constexpr uint32_t kEventSlots = 16;

// ---------------------------------------------------------------------------------------------
// bf16 by hand (independent of codec_math.h).

float Bf16ToFloat(uint16_t b) {
  uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBf16(float f) {  // round to nearest even; finite inputs only
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// A POSIX shm object created by the test (the engine's side), unlinked on destruction.
class ShmObject {
 public:
  ShmObject(const std::string& name, size_t bytes) : name_(name), bytes_(bytes) {
    ::shm_unlink(name_.c_str());
    int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return;
    if (::ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) data_ = static_cast<uint8_t*>(p);
    }
    ::close(fd);
  }
  ~ShmObject() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    ::shm_unlink(name_.c_str());
  }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;
  uint8_t* data() const { return data_; }
  const std::string& name() const { return name_; }
  size_t size() const { return bytes_; }

 private:
  std::string name_;
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

std::string UniqueShmName(const std::string& what) {
  static std::atomic<int> counter{0};
  return "/hiq-core-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         what;
}

template <typename T>
StatusOr<T> Await(std::future<StatusOr<T>>& f) {
  if (f.wait_for(10s) != std::future_status::ready) return DeadlineExceeded("test: no reply");
  return f.get();
}

class CacheCoreTest : public ::testing::Test {
 protected:
  void SetUp() override { Build(2000ms); }

  void Build(std::chrono::milliseconds wait_timeout, size_t pool_bytes = 1 << 20) {
    core_.reset();
    k_ = std::make_unique<ShmObject>(UniqueShmName("k"), kPlaneBytes);
    v_ = std::make_unique<ShmObject>(UniqueShmName("v"), kPlaneBytes);
    events_ = std::make_unique<ShmObject>(UniqueShmName("ev"), 64 * kEventSlots);
    ASSERT_NE(k_->data(), nullptr);
    ASSERT_NE(v_->data(), nullptr);
    ASSERT_NE(events_->data(), nullptr);
    codec_ = std::make_unique<kernels::CpuCodec>(2);
    pool_mem_ = std::make_unique<AnonBuffer>(pool_bytes);
    store_ = std::make_unique<BlockStore>(pool_mem_->data(), pool_mem_->size());
    host_ = std::make_unique<HostBackend>(codec_.get(), wait_timeout);
    core_ = std::make_unique<CacheCore>(options_, store_.get(), host_.get(), nullptr);
    FillInputs();
  }

  void TearDown() override {
    core_.reset();  // drains queued work before the buffers go
  }

  RegisterSpec Spec(int codec = kInt8) const {
    RegisterSpec s = testing::BaseSpec("test/model", kLayers, kHeads, kDim, kBlockTokens);
    s.tenant = "t";
    s.codec = codec;
    for (const ShmObject* b : {k_.get(), v_.get()}) {
      BufferSpec bs;
      bs.has_host_shm_name = true;
      bs.host_shm_name = b->name().substr(1);  // the leading '/' is optional
      bs.size_bytes = b->size();
      s.buffers.push_back(bs);
    }
    testing::AddLayerMajorLayers(&s, kRows, kRowBytes);
    s.events.host_shm_name = events_->name();
    s.events.count = kEventSlots;
    s.client_pid = 4242;
    return s;
  }

  uint64_t Register(int codec = kInt8) {
    auto r = core_->RegisterPool(Spec(codec));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->pool_id : 0;
  }

  uint16_t* Elem(uint32_t plane, uint32_t layer, uint32_t row, uint32_t head, uint32_t d) const {
    uint8_t* base = (plane == 0 ? k_ : v_)->data();
    return reinterpret_cast<uint16_t*>(base + uint64_t{layer} * kRows * kRowBytes +
                                       row * kRowBytes + head * kDim * 2 + d * 2);
  }

  // Deterministic values; each (plane, layer, row, head) gets its own magnitude.
  void FillInputs() {
    uint64_t state = 12345;
    auto next = [&] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<double>(state >> 11) * 0x1.0p-53;  // [0, 1)
    };
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t l = 0; l < kLayers; ++l)
        for (uint32_t r = 0; r < kRows; ++r)
          for (uint32_t h = 0; h < kHeads; ++h) {
            const double mag = std::ldexp(1.0, static_cast<int>(next() * 12) - 6);
            for (uint32_t d = 0; d < kDim; ++d) {
              *Elem(p, l, r, h, d) = FloatToBf16(static_cast<float>((2 * next() - 1) * mag));
            }
          }
  }

  std::vector<uint8_t> ClientBytes() const {
    std::vector<uint8_t> out(2 * kPlaneBytes);
    std::memcpy(out.data(), k_->data(), kPlaneBytes);
    std::memcpy(out.data() + kPlaneBytes, v_->data(), kPlaneBytes);
    return out;
  }

  std::atomic_ref<uint64_t> Slot(uint32_t i) const {
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(events_->data() + 64 * i));
  }

  static BlockSpec Block(uint64_t key, uint32_t first_row) {
    BlockSpec b;
    b.key = KeyString(key);
    for (uint32_t i = 0; i < kBlockTokens; ++i) b.rows.push_back(first_row + i);
    return b;
  }

  StatusOr<BackupResult> Backup(TransferSpec spec) {
    std::promise<StatusOr<BackupResult>> p;
    auto f = p.get_future();
    int calls = 0;
    core_->Backup(std::move(spec), [&](StatusOr<BackupResult> r) {
      ++calls;
      p.set_value(std::move(r));
    });
    auto r = Await(f);
    // Async work finishes later; a rejected request queued nothing (and draining tests keep a
    // blocked task queued on purpose).
    if (r.ok()) core_->WaitIdle();
    EXPECT_EQ(calls, 1);
    return r;
  }
  StatusOr<RestoreResult> Restore(TransferSpec spec) {
    std::promise<StatusOr<RestoreResult>> p;
    auto f = p.get_future();
    int calls = 0;
    core_->Restore(std::move(spec), [&](StatusOr<RestoreResult> r) {
      ++calls;
      p.set_value(std::move(r));
    });
    auto r = Await(f);
    // Async work finishes later; a rejected request queued nothing (and draining tests keep a
    // blocked task queued on purpose).
    if (r.ok()) core_->WaitIdle();
    EXPECT_EQ(calls, 1);
    return r;
  }
  static TransferSpec Transfer(uint64_t pool, std::vector<BlockSpec> blocks, bool sync = true) {
    TransferSpec t;
    t.pool_id = pool;
    t.blocks = std::move(blocks);
    t.sync = sync;
    return t;
  }
  uint32_t Lookup(uint64_t pool, std::vector<std::string> keys) {
    auto r = core_->Lookup(pool, keys);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : 0;
  }

  // Every element of rows [dst, dst + n) matches rows [src, src + n) of the inputs within the
  // INT8 bound |x^ - x| <= (0.5 + 2^-8) s + 2^-8 |x^|, s = bf16(amax / 127) per head.
  void ExpectInt8Restored(const std::vector<uint8_t>& original, uint32_t src, uint32_t dst,
                          uint32_t n) {
    auto orig = [&](uint32_t p, uint32_t l, uint32_t r, uint32_t h, uint32_t d) {
      uint16_t b;
      std::memcpy(&b,
                  original.data() + p * kPlaneBytes + uint64_t{l} * kRows * kRowBytes +
                      r * kRowBytes + h * kDim * 2 + d * 2,
                  2);
      return Bf16ToFloat(b);
    };
    int bad = 0;
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t l = 0; l < kLayers; ++l)
        for (uint32_t i = 0; i < n; ++i)
          for (uint32_t h = 0; h < kHeads; ++h) {
            float amax = 0;
            for (uint32_t d = 0; d < kDim; ++d)
              amax = std::max(amax, std::fabs(orig(p, l, src + i, h, d)));
            const double s = Bf16ToFloat(FloatToBf16(std::max(amax, 0x1p-112f) / 127.0f));
            for (uint32_t d = 0; d < kDim; ++d) {
              const double x = orig(p, l, src + i, h, d);
              const double xh = Bf16ToFloat(*Elem(p, l, dst + i, h, d));
              const double bound = (0.5 + 0x1p-8) * s + 0x1p-8 * std::fabs(xh);
              if (!(std::fabs(xh - x) <= bound) && ++bad <= 5) {
                ADD_FAILURE() << "plane " << p << " layer " << l << " row " << dst + i << " head "
                              << h << " d " << d << ": x " << x << " restored " << xh << " bound "
                              << bound;
              }
            }
          }
    EXPECT_EQ(bad, 0);
  }

  void ExpectRowsUnchanged(const std::vector<uint8_t>& before, uint32_t first, uint32_t n) {
    std::vector<uint8_t> now = ClientBytes();
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t l = 0; l < kLayers; ++l) {
        const uint64_t off = p * kPlaneBytes + uint64_t{l} * kRows * kRowBytes + first * kRowBytes;
        EXPECT_EQ(std::memcmp(before.data() + off, now.data() + off, n * kRowBytes), 0)
            << "plane " << p << " layer " << l << " rows " << first << ".." << first + n - 1;
      }
  }

  std::unique_ptr<ShmObject> k_, v_, events_;
  CoreOptions options_;  // of the core Build makes
  std::unique_ptr<kernels::CpuCodec> codec_;
  std::unique_ptr<AnonBuffer> pool_mem_;
  std::unique_ptr<BlockStore> store_;
  std::unique_ptr<HostBackend> host_;
  std::unique_ptr<CacheCore> core_;
};

TEST_F(CacheCoreTest, RegisterReportsLayout) {
  auto r = core_->RegisterPool(Spec());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_NE(r->pool_id, 0u);
  EXPECT_EQ(r->namespace_id.size(), 32u);
  EXPECT_EQ(r->encoded_bytes_per_token, kLayers * 2u * (kHeads * kDim + 2u * kHeads));  // 528
  EXPECT_EQ(r->block_bytes, 528u * kBlockTokens);
  EXPECT_EQ(r->capacity_tokens, store_->CapacityBlocks(r->block_bytes) * kBlockTokens);
  EXPECT_GT(r->capacity_tokens, 0u);
  auto raw = core_->RegisterPool(Spec(kRaw));
  ASSERT_TRUE(raw.ok());
  EXPECT_NE(raw->pool_id, r->pool_id);
  EXPECT_NE(raw->namespace_id, r->namespace_id);
  EXPECT_EQ(raw->encoded_bytes_per_token, kLayers * 2u * kRowBytes);
  CoreSnapshot snap = core_->Snapshot();
  EXPECT_EQ(snap.pools.size(), 2u);
  EXPECT_EQ(snap.namespaces.size(), 2u);
  EXPECT_EQ(snap.clients, 1u);
  EXPECT_EQ(core_->ClientPids(), std::vector<uint32_t>{4242});
}

TEST_F(CacheCoreTest, Int8RoundTripWithinBound) {
  const uint64_t pool = Register();
  const std::vector<uint8_t> original = ClientBytes();
  auto b = Backup(Transfer(pool, {Block(1, 0), Block(2, 4)}));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->results, (std::vector<BlockResult>{BlockResult::kStored, BlockResult::kStored}));
  EXPECT_EQ(b->ticket, 1u);
  EXPECT_EQ(ClientBytes(), original);  // backup only reads the client's buffers
  EXPECT_EQ(Lookup(pool, {KeyString(1), KeyString(2), KeyString(3)}), 2u);
  EXPECT_EQ(Lookup(pool, {KeyString(2)}), 1u);
  EXPECT_EQ(Lookup(pool, {KeyString(3), KeyString(1)}), 0u);

  auto r = Restore(Transfer(pool, {Block(1, 16), Block(2, 20)}));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->restored_blocks, 2u);
  EXPECT_EQ(r->ticket, 2u);
  ExpectInt8Restored(original, 0, 16, 8);
  ExpectRowsUnchanged(original, 0, 16);
  ExpectRowsUnchanged(original, 24, 8);

  CoreSnapshot snap = core_->Snapshot();
  ASSERT_EQ(snap.pools.size(), 1u);
  EXPECT_EQ(snap.pools[0].backups, 2u);
  EXPECT_EQ(snap.pools[0].restores, 2u);
  ASSERT_EQ(snap.namespaces.size(), 1u);
  EXPECT_EQ(snap.namespaces[0].counters.blocks, 2u);
  EXPECT_EQ(snap.namespaces[0].counters.backups, 2u);
  EXPECT_EQ(snap.namespaces[0].counters.restores, 2u);
  EXPECT_EQ(snap.store.blocks, 2u);
}

TEST_F(CacheCoreTest, AllZeroAndExtremeHeadsRestoreWithinBound) {
  const uint64_t pool = Register();
  for (uint32_t d = 0; d < kDim; ++d) {
    *Elem(0, 0, 0, 0, d) = 0;                                         // all-zero head
    *Elem(1, 1, 1, 1, d) = FloatToBf16(d % 2 ? 3.0e38f : -1.0e-30f);  // near bf16 max
  }
  const std::vector<uint8_t> original = ClientBytes();
  auto b = Backup(Transfer(pool, {Block(1, 0)}));
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->results[0], BlockResult::kStored);
  auto r = Restore(Transfer(pool, {Block(1, 8)}));
  ASSERT_TRUE(r.ok());
  ExpectInt8Restored(original, 0, 8, 4);
  for (uint32_t d = 0; d < kDim; ++d) EXPECT_EQ(*Elem(0, 0, 8, 0, d), 0u) << d;
}

TEST_F(CacheCoreTest, RawCodecIsBitExact) {
  const uint64_t pool = Register(kRaw);
  auto b = Backup(Transfer(pool, {Block(1, 0), Block(2, 4)}));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->results, (std::vector<BlockResult>{BlockResult::kStored, BlockResult::kStored}));
  // Restore block 2 first, then block 1: into rows 24.. in swapped order.
  auto r = Restore(Transfer(pool, {Block(2, 24), Block(1, 28)}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_blocks, 2u);
  for (uint32_t p = 0; p < 2; ++p)
    for (uint32_t l = 0; l < kLayers; ++l) {
      EXPECT_EQ(std::memcmp(Elem(p, l, 24, 0, 0), Elem(p, l, 4, 0, 0), 4 * kRowBytes), 0);
      EXPECT_EQ(std::memcmp(Elem(p, l, 28, 0, 0), Elem(p, l, 0, 0, 0), 4 * kRowBytes), 0);
    }
}

TEST_F(CacheCoreTest, NonContiguousRowsRoundTrip) {
  const uint64_t pool = Register(kRaw);
  BlockSpec src;
  src.key = KeyString(9);
  src.rows = {31, 3, 17, 3};  // any rows, repeats allowed on backup
  auto b = Backup(Transfer(pool, {src}));
  ASSERT_TRUE(b.ok());
  BlockSpec dst = src;
  dst.rows = {8, 9, 10, 11};
  const std::vector<uint8_t> before = ClientBytes();
  auto r = Restore(Transfer(pool, {dst}));
  ASSERT_TRUE(r.ok());
  for (uint32_t p = 0; p < 2; ++p)
    for (uint32_t l = 0; l < kLayers; ++l)
      for (uint32_t i = 0; i < 4; ++i) {
        EXPECT_EQ(
            std::memcmp(Elem(p, l, dst.rows[i], 0, 0), Elem(p, l, src.rows[i], 0, 0), kRowBytes),
            0);
      }
  ExpectRowsUnchanged(before, 12, 5);
}

TEST_F(CacheCoreTest, SecondBackupIsAlreadyPresent) {
  const uint64_t pool = Register();
  auto b = Backup(Transfer(pool, {Block(1, 0)}));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->results[0], BlockResult::kStored);
  b = Backup(Transfer(pool, {Block(1, 8), Block(2, 4), Block(2, 4)}));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->results,
            (std::vector<BlockResult>{BlockResult::kAlreadyPresent, BlockResult::kStored,
                                      BlockResult::kAlreadyPresent}));
  EXPECT_EQ(b->ticket, 2u);
  EXPECT_EQ(core_->Snapshot().store.blocks, 2u);
}

TEST_F(CacheCoreTest, NonFiniteBlockIsRejectedAndInvisible) {
  const uint64_t pool = Register();
  *Elem(1, 1, 5, 1, 7) = 0x7FC0;   // NaN in V of layer 1, block 1 (rows 4..7)
  *Elem(0, 0, 10, 0, 0) = 0xFF80;  // -Inf in K of layer 0, block 2 (rows 8..11)
  auto b = Backup(Transfer(pool, {Block(1, 0), Block(2, 4), Block(3, 8), Block(4, 12)}));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->results, (std::vector<BlockResult>{BlockResult::kStored, BlockResult::kRejected,
                                                  BlockResult::kRejected, BlockResult::kStored}));
  EXPECT_EQ(Lookup(pool, {KeyString(1), KeyString(2)}), 1u);
  EXPECT_EQ(Lookup(pool, {KeyString(2)}), 0u);
  EXPECT_EQ(Lookup(pool, {KeyString(3)}), 0u);
  EXPECT_EQ(Lookup(pool, {KeyString(4)}), 1u);
  CoreSnapshot snap = core_->Snapshot();
  EXPECT_EQ(snap.store.blocks, 2u);
  EXPECT_EQ(snap.namespaces[0].counters.rejected, 2u);
  EXPECT_EQ(snap.namespaces[0].counters.backups, 2u);
  // A restore of the rejected key restores nothing and writes nothing.
  const std::vector<uint8_t> before = ClientBytes();
  auto r = Restore(Transfer(pool, {Block(2, 16)}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_blocks, 0u);
  EXPECT_EQ(ClientBytes(), before);
  // Fixed, the block can be backed up.
  *Elem(1, 1, 5, 1, 7) = FloatToBf16(1.0f);
  b = Backup(Transfer(pool, {Block(2, 4)}));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->results[0], BlockResult::kStored);
}

TEST_F(CacheCoreTest, RejectedRequestChangesNothing) {
  const uint64_t pool = Register();
  ASSERT_TRUE(Backup(Transfer(pool, {Block(1, 0)})).ok());  // ticket 1
  const std::vector<uint8_t> bytes = ClientBytes();
  const CoreSnapshot before = core_->Snapshot();
  std::vector<uint64_t> slots_before;
  for (uint32_t i = 0; i < kEventSlots; ++i) slots_before.push_back(Slot(i).load());

  auto expect_invalid = [](const Status& st, const std::string& field) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
  };
  {
    // A valid first block, a bad row in the second: nothing is stored, not even the first.
    TransferSpec t = Transfer(pool, {Block(5, 0), Block(6, 4)});
    t.blocks[1].rows[3] = kRows;
    t.done_event = 1;
    expect_invalid(Backup(t).status(), "blocks[1].rows[3]");
    t.sync = false;
    expect_invalid(Backup(t).status(), "blocks[1].rows[3]");
  }
  {
    TransferSpec t = Transfer(pool, {Block(1, 16), Block(1, 20)});
    t.blocks[1].rows[0] = kRows + 100;
    t.layer_event_base = 0;
    t.done_event = 3;
    expect_invalid(Restore(t).status(), "blocks[1].rows[0]");
  }
  {
    TransferSpec t = Transfer(pool, {Block(1, 16)});
    t.layer_event_base = kEventSlots - 1;  // 2 layers do not fit
    expect_invalid(Restore(t).status(), "layer_event_base");
    t.layer_event_base = -1;
    t.done_event = kEventSlots;
    expect_invalid(Restore(t).status(), "done_event");
    t.done_event = -1;
    t.wait_event = kEventSlots;
    expect_invalid(Backup(t).status(), "wait_event");
  }
  {
    TransferSpec t = Transfer(pool, {Block(7, 0)});
    t.blocks[0].key.resize(15);
    expect_invalid(Backup(t).status(), "blocks[0].key");
    t.blocks[0].rows.pop_back();
    t.blocks[0].key = KeyString(7);
    expect_invalid(Backup(t).status(), "blocks[0].rows");
  }
  expect_invalid(core_->Lookup(pool, {KeyString(1), "short"}).status(), "keys[1]");
  expect_invalid(core_->Evict(pool, {KeyString(1), std::string(17, 'x')}).status(), "keys[1]");

  EXPECT_EQ(ClientBytes(), bytes);
  for (uint32_t i = 0; i < kEventSlots; ++i) EXPECT_EQ(Slot(i).load(), slots_before[i]) << i;
  const CoreSnapshot after = core_->Snapshot();
  EXPECT_EQ(after.store.used_bytes, before.store.used_bytes);
  EXPECT_EQ(after.store.blocks, before.store.blocks);
  ASSERT_EQ(after.namespaces.size(), before.namespaces.size());
  for (size_t i = 0; i < after.namespaces.size(); ++i) {
    const NamespaceCounters& a = after.namespaces[i].counters;
    const NamespaceCounters& b = before.namespaces[i].counters;
    EXPECT_EQ(a.blocks, b.blocks);
    EXPECT_EQ(a.bytes, b.bytes);
    EXPECT_EQ(a.hits, b.hits);
    EXPECT_EQ(a.misses, b.misses);
    EXPECT_EQ(a.backups, b.backups);
    EXPECT_EQ(a.restores, b.restores);
    EXPECT_EQ(a.evictions, b.evictions);
    EXPECT_EQ(a.rejected, b.rejected);
  }
  ASSERT_EQ(after.pools.size(), 1u);
  EXPECT_EQ(after.pools[0].backups, before.pools[0].backups);
  EXPECT_EQ(after.pools[0].restores, before.pools[0].restores);
  EXPECT_EQ(Lookup(pool, {KeyString(5)}), 0u);
  // No ticket was used up by the rejected requests.
  auto b = Backup(Transfer(pool, {Block(5, 0)}));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ticket, 2u);
}

TEST_F(CacheCoreTest, UnknownPoolIsNotFound) {
  const uint64_t pool = Register();
  const uint64_t bogus = pool + 12345;
  EXPECT_EQ(Backup(Transfer(bogus, {Block(1, 0)})).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Restore(Transfer(bogus, {Block(1, 0)})).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(core_->Lookup(bogus, {KeyString(1)}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(core_->Evict(bogus, {KeyString(1)}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(core_->ReleasePool(bogus).code(), StatusCode::kNotFound);
  // Pool id 0 names no pool: a lookup then needs namespaces (LookupSpec).
  const Status zero = core_->Lookup(0, {}).status();
  EXPECT_EQ(zero.code(), StatusCode::kInvalidArgument) << zero.ToString();
  EXPECT_NE(zero.message().find("pool_id"), std::string::npos) << zero.message();
}

TEST_F(CacheCoreTest, ReleasedPoolIsNotFoundButBlocksStayInTheNamespace) {
  const uint64_t a = Register();
  const uint64_t b = Register();  // same descriptor: same namespace, shared blocks
  ASSERT_NE(a, b);
  const std::vector<uint8_t> original = ClientBytes();
  ASSERT_TRUE(Backup(Transfer(a, {Block(1, 0)})).ok());
  EXPECT_EQ(Lookup(b, {KeyString(1)}), 1u);
  HIQ_EXPECT_OK(core_->ReleasePool(a));
  EXPECT_EQ(core_->ReleasePool(a).code(), StatusCode::kNotFound);
  EXPECT_EQ(Backup(Transfer(a, {Block(2, 4)})).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Restore(Transfer(a, {Block(1, 8)})).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(core_->Lookup(a, {KeyString(1)}).status().code(), StatusCode::kNotFound);
  auto r = Restore(Transfer(b, {Block(1, 8)}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_blocks, 1u);
  ExpectInt8Restored(original, 0, 8, 4);
  EXPECT_EQ(core_->Snapshot().pools.size(), 1u);
}

TEST_F(CacheCoreTest, EvictRemovesBlocks) {
  const uint64_t pool = Register();
  ASSERT_TRUE(Backup(Transfer(pool, {Block(1, 0), Block(2, 4)})).ok());
  auto n = core_->Evict(pool, {KeyString(1), KeyString(3)});
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1u);
  EXPECT_EQ(Lookup(pool, {KeyString(1)}), 0u);
  EXPECT_EQ(Lookup(pool, {KeyString(2)}), 1u);
  // Restore stops at the first missing block.
  const std::vector<uint8_t> before = ClientBytes();
  auto r = Restore(Transfer(pool, {Block(1, 16), Block(2, 20)}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_blocks, 0u);
  EXPECT_EQ(ClientBytes(), before);
}

TEST_F(CacheCoreTest, RestoreStopsAtFirstMissingBlock) {
  const uint64_t pool = Register(kRaw);
  ASSERT_TRUE(Backup(Transfer(pool, {Block(1, 0), Block(3, 8)})).ok());
  const std::vector<uint8_t> before = ClientBytes();
  auto r = Restore(Transfer(pool, {Block(1, 16), Block(2, 20), Block(3, 24)}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_blocks, 1u);
  EXPECT_EQ(std::memcmp(Elem(0, 1, 16, 0, 0), Elem(0, 1, 0, 0, 0), 4 * kRowBytes), 0);
  ExpectRowsUnchanged(before, 20, 12);
}

TEST_F(CacheCoreTest, CudaWithoutBackendIsFailedPrecondition) {
  RegisterSpec s = Spec();
  s.device_kind = kCuda;
  for (auto& b : s.buffers) {
    b.has_host_shm_name = false;
    b.has_cuda_ipc_handle = true;
    b.cuda_ipc_handle = std::string(64, '\0');
  }
  s.events = EventsSpec{};
  auto r = core_->RegisterPool(s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("device.kind"), std::string::npos);
  EXPECT_TRUE(core_->Snapshot().pools.empty());
}

TEST_F(CacheCoreTest, MissingOrSmallShmIsInvalidArgument) {
  {
    RegisterSpec s = Spec();
    s.buffers[1].host_shm_name = UniqueShmName("does-not-exist");
    auto r = core_->RegisterPool(s);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("buffers[1].host_shm_name"), std::string::npos)
        << r.status().message();
  }
  {
    RegisterSpec s = Spec();
    s.buffers[0].size_bytes = kPlaneBytes + 2;  // the object holds kPlaneBytes
    s.layers[1].k.offset_bytes += 2;            // so the view needs the extra bytes
    auto r = core_->RegisterPool(s);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("buffers[0]"), std::string::npos) << r.status().message();
  }
  {
    RegisterSpec s = Spec();
    s.events.count = kEventSlots + 1;  // 64 bytes more than the event object holds
    auto r = core_->RegisterPool(s);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("events.host_shm_name"), std::string::npos)
        << r.status().message();
  }
  {
    RegisterSpec s = Spec();
    s.events.host_shm_name = UniqueShmName("no-events");
    auto r = core_->RegisterPool(s);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(core_->Snapshot().pools.empty());
  EXPECT_TRUE(core_->Snapshot().namespaces.empty());
}

TEST_F(CacheCoreTest, DrainingIsUnavailable) {
  const uint64_t pool = Register();
  // Queued work still completes after draining starts.
  TransferSpec t = Transfer(pool, {Block(1, 0)}, /*sync=*/false);
  t.wait_event = 0;
  t.wait_value = 1;
  t.done_event = 1;
  std::atomic<int> calls{0};
  core_->Backup(t, [&](StatusOr<BackupResult> r) {
    EXPECT_TRUE(r.ok());
    ++calls;
  });
  EXPECT_EQ(calls.load(), 1);  // async: answered once queued
  core_->StartDraining();
  EXPECT_TRUE(core_->draining());
  EXPECT_EQ(core_->RegisterPool(Spec()).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(Backup(Transfer(pool, {Block(2, 4)})).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(Restore(Transfer(pool, {Block(1, 8)})).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(core_->Lookup(pool, {KeyString(1)}).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(core_->Evict(pool, {KeyString(1)}).status().code(), StatusCode::kUnavailable);
  Slot(0).store(1, std::memory_order_release);
  core_->WaitIdle();
  EXPECT_EQ(Slot(1).load(), 1u);
  EXPECT_EQ(store_->Stats().blocks, 1u);
}

// The layer-major sub-tasks of a restore of `blocks` x `layers`: each within the chunk bounds
// (or one block's layer), each one run of the layer-major order starting where the previous one
// ended, together covering every block of every layer once, and the pieces that end a layer (the
// ones that signal it) once per layer.
void ExpectLayerMajorPieces(size_t blocks, uint32_t layers, uint64_t unit, uint64_t chunk,
                            size_t chunk_blocks) {
  SCOPED_TRACE(std::to_string(blocks) + " blocks, " + std::to_string(layers) + " layers, unit " +
               std::to_string(unit) + ", chunk " + std::to_string(chunk) + "/" +
               std::to_string(chunk_blocks));
  const auto pieces = LayerMajorPieces(blocks, layers, unit, chunk, chunk_blocks);
  ASSERT_FALSE(pieces.empty());
  std::vector<int> seen(blocks * layers, 0), ends(layers, 0);
  uint64_t next_cell = 0;  // cell (l, b) is l * blocks + b
  for (const RestorePiece& p : pieces) {
    ASSERT_LE(p.begin, p.end);
    ASSERT_LE(p.end, blocks);
    ASSERT_LT(p.first_layer, p.end_layer);
    ASSERT_LE(p.end_layer, layers);
    const uint64_t cells = uint64_t{p.end - p.begin} * (p.end_layer - p.first_layer);
    if (cells > 1) {
      EXPECT_LE(cells * unit, chunk);
      EXPECT_LE(cells, uint64_t{chunk_blocks} * layers);
    }
    for (size_t b = p.begin; b < p.end; ++b) {
      for (uint32_t l = p.first_layer; l < p.end_layer; ++l) ++seen[b * layers + l];
    }
    if (blocks == 0) continue;
    if (p.end == blocks) {
      for (uint32_t l = p.first_layer; l < p.end_layer; ++l) ++ends[l];
    }
    EXPECT_TRUE(p.end_layer == p.first_layer + 1 || (p.begin == 0 && p.end == blocks));
    EXPECT_EQ(uint64_t{p.first_layer} * blocks + p.begin, next_cell);
    next_cell = uint64_t{p.end_layer - 1} * blocks + p.end;
  }
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << "cell " << i;
  for (uint32_t l = 0; blocks > 0 && l < layers; ++l) EXPECT_EQ(ends[l], 1) << "layer " << l;
}

TEST(LayerMajorPiecesTest, CoverEachBlockLayerOnceInOrderWithinTheBounds) {
  for (size_t blocks : {size_t{0}, size_t{1}, size_t{3}, size_t{32}, size_t{100}}) {
    for (uint32_t layers : {1u, 2u, 36u}) {
      for (uint64_t unit : {uint64_t{2048}, uint64_t{262144}}) {
        for (uint64_t chunk : {uint64_t{1}, uint64_t{4096}, uint64_t{16} << 20}) {
          for (size_t chunk_blocks : {size_t{1}, size_t{64}}) {
            ExpectLayerMajorPieces(blocks, layers, unit, chunk, chunk_blocks);
          }
        }
      }
    }
  }
}

// A restore that the engine waits for layer by layer goes layer-major across its sub-tasks: each
// layer's event goes out once every block of that layer is written, before later layers are.
// Here every sub-task is one block of one layer, and the second layer's K buffer is truncated
// under the daemon: the first layer was written whole and its event says so (a block-major split
// would have failed both layers in its first sub-task); the second and done_event carry the
// failure bit.
TEST_F(CacheCoreTest, LayerEventsGoOutLayerByLayerAcrossSubTasks) {
  options_.transfer_chunk_bytes = 2 * kBlockTokens * kRowBytes;  // one block's K and V of a layer
  Build(2000ms);
  const uint64_t pool = Register(kRaw);
  ASSERT_TRUE(Backup(Transfer(pool, {Block(1, 0), Block(2, 4), Block(3, 8)})).ok());
  const std::vector<uint8_t> original = ClientBytes();

  TransferSpec r = Transfer(pool, {Block(1, 16), Block(2, 20), Block(3, 24)});
  r.layer_event_base = 4;  // slots 4 and 5
  r.done_event = 6;
  auto ok = Restore(r);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->restored_blocks, 3u);
  EXPECT_EQ(Slot(4).load(), ok->ticket);
  EXPECT_EQ(Slot(5).load(), ok->ticket);
  EXPECT_EQ(Slot(6).load(), ok->ticket);
  const std::vector<uint8_t> now = ClientBytes();
  for (uint32_t p = 0; p < 2; ++p) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      const size_t layer = p * kPlaneBytes + uint64_t{l} * kRows * kRowBytes;
      EXPECT_EQ(
          std::memcmp(now.data() + layer + 16 * kRowBytes, original.data() + layer, 12 * kRowBytes),
          0)
          << "plane " << p << " layer " << l << ": RAW rows 16-27 are rows 0-11";
    }
  }

  // Layer 1 of K is the second half of its buffer.
  const int fd = ::shm_open(k_->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(kPlaneBytes / 2)), 0);
  ::close(fd);
  TransferSpec cut = Transfer(pool, {Block(1, 16), Block(2, 20)}, /*sync=*/false);
  cut.layer_event_base = 8;  // slots 8 and 9
  cut.done_event = 10;
  auto failed = Restore(cut);  // answered on arrival, then waited for
  ASSERT_TRUE(failed.ok()) << failed.status().ToString();
  EXPECT_EQ(Slot(8).load(), failed->ticket) << "layer 0 was written whole";
  EXPECT_EQ(Slot(9).load(), failed->ticket | kHostEventFailedBit);
  EXPECT_EQ(Slot(10).load(), failed->ticket | kHostEventFailedBit);
}

TEST_F(CacheCoreTest, HostEventSlotsReceiveTickets) {
  const uint64_t pool = Register();
  TransferSpec t = Transfer(pool, {Block(1, 0), Block(2, 4)});
  t.done_event = 2;
  auto b = Backup(t);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ticket, 1u);
  EXPECT_EQ(Slot(2).load(), 1u);
  EXPECT_EQ(Slot(3).load(), 0u);

  TransferSpec r = Transfer(pool, {Block(1, 16), Block(2, 20)});
  r.layer_event_base = 4;  // slots 4 and 5
  r.done_event = 6;
  auto rr = Restore(r);
  ASSERT_TRUE(rr.ok());
  EXPECT_EQ(rr->ticket, 2u);
  EXPECT_EQ(Slot(4).load(), 2u);
  EXPECT_EQ(Slot(5).load(), 2u);
  EXPECT_EQ(Slot(6).load(), 2u);
  EXPECT_EQ(Slot(7).load(), 0u);
  EXPECT_EQ(Slot(2).load(), 1u);

  // Slot i lives at byte 64*i: nothing in between is written.
  for (uint32_t i = 0; i < kEventSlots; ++i) {
    for (uint32_t byte = 8; byte < 64; ++byte) {
      ASSERT_EQ(events_->data()[64 * i + byte], 0) << "slot " << i << " byte " << byte;
    }
  }
  // Async restore of a missing block: restored_blocks 0, layer events still released.
  TransferSpec miss = Transfer(pool, {Block(9, 16)}, /*sync=*/false);
  miss.layer_event_base = 8;
  miss.done_event = 10;
  auto m = Restore(miss);  // waits for idle
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->restored_blocks, 0u);
  EXPECT_EQ(m->ticket, 3u);
  EXPECT_EQ(Slot(8).load(), 3u);
  EXPECT_EQ(Slot(9).load(), 3u);
  EXPECT_EQ(Slot(10).load(), 3u);
}

TEST_F(CacheCoreTest, AsyncBackupWaitsForWaitEvent) {
  const uint64_t pool = Register();
  TransferSpec t = Transfer(pool, {Block(1, 0)}, /*sync=*/false);
  t.wait_event = 3;
  t.wait_value = 5;
  t.done_event = 4;
  std::promise<StatusOr<BackupResult>> p;
  auto f = p.get_future();
  core_->Backup(t, [&](StatusOr<BackupResult> r) { p.set_value(std::move(r)); });
  auto r = Await(f);  // the reply comes once queued
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->results[0], BlockResult::kStored);
  const uint64_t ticket = r->ticket;
  Slot(3).store(4, std::memory_order_release);  // not yet: needs >= 5
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(Lookup(pool, {KeyString(1)}), 0u);
  EXPECT_EQ(Slot(4).load(), 0u);
  Slot(3).store(5, std::memory_order_release);
  core_->WaitIdle();
  EXPECT_EQ(Lookup(pool, {KeyString(1)}), 1u);
  EXPECT_EQ(Slot(4).load(), ticket);
}

TEST_F(CacheCoreTest, WaitEventTimeoutStoresNothing) {
  Build(100ms);
  const uint64_t pool = Register();
  TransferSpec t = Transfer(pool, {Block(1, 0)});
  t.wait_event = 0;
  t.done_event = 1;
  auto b = Backup(t);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kDeadlineExceeded) << b.status().ToString();
  EXPECT_EQ(Lookup(pool, {KeyString(1)}), 0u);
  EXPECT_EQ(store_->Stats().blocks, 0u);
  // Waiters are released anyway, with the failure bit: nothing was written.
  EXPECT_EQ(Slot(1).load(), 1u | kHostEventFailedBit);
  // The slot is free again: a later backup of the key succeeds.
  auto ok = Backup(Transfer(pool, {Block(1, 0)}));
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->results[0], BlockResult::kStored);
}

TEST_F(CacheCoreTest, StalledAsyncBackupReservesNothing) {
  // An async backup whose wait_event never comes must not hold slots for the wait timeout
  // (other clients' blocks would be rejected or evicted): reservations are taken when the task
  // starts, so while it waits it holds nothing.
  // A pool of exactly 3 blocks.
  const uint64_t slot = SlotBytesFor(528 * kBlockTokens);
  Build(300ms, PoolMetaBytes(1 << 20) + kExtentHeaderBytes + 3 * slot + slot / 2);
  const uint64_t pool = Register();
  ASSERT_EQ(store_->CapacityBlocks(528 * kBlockTokens), 3u);
  // Blocked on slot 0, which never comes.
  TransferSpec t = Transfer(pool, {Block(1, 0), Block(2, 4), Block(3, 8)}, /*sync=*/false);
  t.wait_event = 0;
  t.done_event = 1;
  std::atomic<int> calls{0};
  core_->Backup(t, [&](StatusOr<BackupResult> r) {
    ASSERT_TRUE(r.ok());
    // Accepted (cache_core.h: what BLOCK_STORED means for an asynchronous HOST backup).
    EXPECT_EQ(r->results, (std::vector<BlockResult>(3, BlockResult::kStored)));
    ++calls;
  });
  ASSERT_EQ(calls.load(), 1);
  EXPECT_EQ(store_->Stats().blocks, 0u);  // nothing reserved while it waits
  // Another pool fills the cache meanwhile: every block is stored, none rejected.
  const uint64_t other = Register();
  std::promise<StatusOr<BackupResult>> p;
  auto f = p.get_future();
  core_->Backup(Transfer(other, {Block(4, 12), Block(5, 16), Block(6, 20)}),
                [&](StatusOr<BackupResult> r) { p.set_value(std::move(r)); });
  auto r = Await(f);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->results, (std::vector<BlockResult>(3, BlockResult::kStored)));
  EXPECT_EQ(core_->Snapshot().namespaces[0].counters.rejected, 0u);
  // The stalled backup times out: it stored nothing, evicted nothing, and released done_event
  // with the failure bit.
  core_->WaitIdle();
  EXPECT_EQ(Slot(1).load(), 1u | kHostEventFailedBit);
  EXPECT_EQ(Lookup(other, {KeyString(4), KeyString(5), KeyString(6)}), 3u);
  EXPECT_EQ(Lookup(other, {KeyString(1)}), 0u);
  EXPECT_EQ(core_->Snapshot().namespaces[0].counters.evictions, 0u);
  EXPECT_EQ(store_->Stats().blocks, 3u);
}

TEST_F(CacheCoreTest, ReleasePoolCancelsTasksWaitingForEvents) {
  // Cancelled tasks stop within the margin; a wait_timeout far above it tells them apart from
  // tasks that ran out of time.
  const auto margin = hiqcache::test_time::Margin(500ms);
  Build(4 * margin);
  const uint64_t pool = Register();
  ASSERT_TRUE(Backup(Transfer(pool, {Block(1, 0)})).ok());  // ticket 1
  // A backup (ticket 2) and a restore (ticket 3) wait for events that never come.
  TransferSpec b = Transfer(pool, {Block(2, 4)}, /*sync=*/false);
  b.wait_event = 0;
  b.done_event = 1;
  core_->Backup(b, [](StatusOr<BackupResult> r) { EXPECT_TRUE(r.ok()); });
  TransferSpec r = Transfer(pool, {Block(1, 16)}, /*sync=*/false);
  r.wait_event = 0;
  r.layer_event_base = 4;
  r.done_event = 2;
  core_->Restore(r, [](StatusOr<RestoreResult> res) { EXPECT_TRUE(res.ok()); });
  const std::vector<uint8_t> before = ClientBytes();
  // Block 1 only: the waiting backup reserves its slot when it starts, not while queued.
  EXPECT_EQ(store_->Stats().blocks, 1u);

  HIQ_EXPECT_OK(core_->ReleasePool(pool));
  // Both tasks stop at once (not after wait_timeout_ms) and report failure on their events.
  const auto start = std::chrono::steady_clock::now();
  while (Slot(2).load() == 0 && std::chrono::steady_clock::now() - start < margin) {
    std::this_thread::sleep_for(1ms);
  }
  const bool cancelled = Slot(2).load() != 0;
  Slot(0).store(1000, std::memory_order_release);  // unblock them if they were not cancelled
  core_->WaitIdle();
  if (!cancelled) {
    FAIL() << "regression: HostBinding has no Cancel() override (host_backend.cc; dropped in "
              "6c4c724), so ReleasePool does not stop a HOST task waiting for its "
              "wait_event: it keeps its pins and a transfer worker until wait_timeout_ms";
  }
  EXPECT_EQ(Slot(1).load(), 2u | kHostEventFailedBit);
  EXPECT_EQ(Slot(2).load(), 3u | kHostEventFailedBit);
  EXPECT_EQ(Slot(4).load(), 3u | kHostEventFailedBit);
  EXPECT_EQ(Slot(5).load(), 3u | kHostEventFailedBit);
  EXPECT_EQ(ClientBytes(), before);  // the restore wrote nothing
  // The cancelled backup stored nothing and gave its slot back; the restore dropped its pin.
  const uint64_t again = Register();
  EXPECT_EQ(Lookup(again, {KeyString(2)}), 0u);
  EXPECT_EQ(store_->Stats().blocks, 1u);
  EXPECT_EQ(*core_->Evict(again, {KeyString(1)}), 1u);
  EXPECT_EQ(store_->Stats().blocks, 0u);  // unpinned: the slot is freed at once
}

TEST_F(CacheCoreTest, TicketsStartAboveExistingEventSlotValues) {
  // Slots left by an earlier daemon's tickets: new tickets must not look complete already.
  Slot(3).store(41);
  Slot(7).store(50 | kHostEventFailedBit);
  const uint64_t pool = Register();
  TransferSpec t = Transfer(pool, {Block(1, 0)});
  t.done_event = 3;
  auto b = Backup(t);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ticket, 51u);
  EXPECT_EQ(Slot(3).load(), 51u);
}

// Records what the core reports to its observer.
class RecordingObserver : public CoreObserver {
 public:
  struct Sample {
    bool restore;
    std::string namespace_id, model;
    uint64_t blocks, input_bytes, stored_bytes;
    bool ok;
  };
  void OnTransfer(const TransferSample& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    samples_.push_back({s.restore, std::string(s.namespace_id), std::string(s.model), s.blocks,
                        s.input_bytes, s.stored_bytes, s.ok});
  }
  void OnRequestRejected(std::string_view, StatusCode) override {}
  void OnNamespaceRemoved(std::string_view namespace_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    removed_.emplace_back(namespace_id);
  }
  std::vector<Sample> samples() {
    std::lock_guard<std::mutex> lock(mu_);
    return samples_;
  }
  std::vector<std::string> removed() {
    std::lock_guard<std::mutex> lock(mu_);
    return removed_;
  }

 private:
  std::mutex mu_;
  std::vector<Sample> samples_;
  std::vector<std::string> removed_;
};

TEST_F(CacheCoreTest, ObserverSeesTransfersThatMoveBlocks) {
  RecordingObserver obs;
  CoreOptions opts;
  opts.observer = &obs;
  CacheCore core(opts, store_.get(), host_.get(), nullptr);
  EXPECT_EQ(core.observer(), &obs);
  auto reg = core.RegisterPool(Spec());
  ASSERT_TRUE(reg.ok());
  auto run_backup = [&](TransferSpec t) {
    std::promise<StatusOr<BackupResult>> p;
    auto f = p.get_future();
    core.Backup(std::move(t), [&](StatusOr<BackupResult> r) { p.set_value(std::move(r)); });
    auto r = Await(f);
    core.WaitIdle();
    return r;
  };
  ASSERT_TRUE(run_backup(Transfer(reg->pool_id, {Block(1, 0), Block(2, 4)})).ok());
  ASSERT_TRUE(run_backup(Transfer(reg->pool_id, {Block(1, 0)})).ok());  // present: no sample
  std::promise<StatusOr<RestoreResult>> p;
  auto f = p.get_future();
  core.Restore(Transfer(reg->pool_id, {Block(2, 16)}),
               [&](StatusOr<RestoreResult> r) { p.set_value(std::move(r)); });
  ASSERT_TRUE(Await(f).ok());
  core.WaitIdle();
  auto samples = obs.samples();
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_FALSE(samples[0].restore);
  EXPECT_EQ(samples[0].blocks, 2u);
  EXPECT_EQ(samples[0].input_bytes, 2u * kLayers * 2 * kBlockTokens * kRowBytes);
  EXPECT_EQ(samples[0].stored_bytes, 2u * reg->block_bytes);
  EXPECT_EQ(samples[0].namespace_id, reg->namespace_id);
  EXPECT_EQ(samples[0].model, "test/model");
  EXPECT_TRUE(samples[0].ok);
  EXPECT_TRUE(samples[1].restore);
  EXPECT_EQ(samples[1].blocks, 1u);
  EXPECT_EQ(samples[1].stored_bytes, reg->block_bytes);
}

TEST_F(CacheCoreTest, PoolsWaitingOnEventsDoNotStallOtherPools) {
  // Pools a and b each queue a backup that waits for its wait_event; with the default two
  // transfer workers, pool c's request must still run ("different strands run concurrently"),
  // within the margin, far below the wait_timeout that would free a stalled worker.
  const auto margin = hiqcache::test_time::Margin(1000ms);
  Build(4 * margin);
  const uint64_t a = Register();
  const uint64_t b = Register();
  const uint64_t c = Register(kRaw);
  int32_t ev = 0;
  for (uint64_t pool : {a, b}) {
    TransferSpec t = Transfer(pool, {Block(10 + ev, 0)}, /*sync=*/false);
    t.wait_event = ev++;
    core_->Backup(t, [](StatusOr<BackupResult> r) { EXPECT_TRUE(r.ok()); });
  }
  std::promise<StatusOr<BackupResult>> p;
  auto f = p.get_future();
  core_->Backup(Transfer(c, {Block(1, 0)}),
                [&](StatusOr<BackupResult> r) { p.set_value(std::move(r)); });
  const bool finished_while_others_wait = f.wait_for(margin) == std::future_status::ready;
  Slot(0).store(1, std::memory_order_release);
  Slot(1).store(1, std::memory_order_release);
  auto r = Await(f);
  core_->WaitIdle();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Lookup(a, {KeyString(10), KeyString(11)}), 2u);
  if (!finished_while_others_wait) {
    FAIL() << "regression: HostBinding::WaitFor (host_backend.cc) blocks a TransferEngine worker "
              "while it polls the wait_event slot, so two pools waiting on their events "
              "stall every other pool's work until the events fire or wait_timeout_ms "
              "passes";
  }
}

TEST_F(CacheCoreTest, ReleasePoolsOfClient) {
  RegisterSpec s = Spec();
  s.client_pid = 1000;
  auto a1 = core_->RegisterPool(s);
  auto a2 = core_->RegisterPool(s);
  s.client_pid = 2000;
  auto b1 = core_->RegisterPool(s);
  ASSERT_TRUE(a1.ok() && a2.ok() && b1.ok());
  EXPECT_EQ(core_->ClientPids(), (std::vector<uint32_t>{1000, 2000}));
  ASSERT_TRUE(Backup(Transfer(a1->pool_id, {Block(1, 0)})).ok());
  EXPECT_EQ(core_->ReleasePoolsOfClient(1000), 2u);
  EXPECT_EQ(core_->ReleasePoolsOfClient(1000), 0u);
  EXPECT_EQ(core_->ReleasePoolsOfClient(3000), 0u);
  EXPECT_EQ(core_->Lookup(a1->pool_id, {KeyString(1)}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(core_->Lookup(a2->pool_id, {KeyString(1)}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Lookup(b1->pool_id, {KeyString(1)}), 1u);  // blocks belong to the namespace
  EXPECT_EQ(core_->ClientPids(), std::vector<uint32_t>{2000});
  EXPECT_EQ(core_->Snapshot().pools.size(), 1u);
}

TEST_F(CacheCoreTest, TicketsIncreasePerPool) {
  const uint64_t a = Register();
  const uint64_t b = Register(kRaw);
  EXPECT_EQ(Backup(Transfer(a, {Block(1, 0)}))->ticket, 1u);
  EXPECT_EQ(Backup(Transfer(a, {Block(1, 0)}))->ticket, 2u);
  EXPECT_EQ(Backup(Transfer(b, {Block(1, 0)}))->ticket, 1u);
  EXPECT_EQ(Restore(Transfer(a, {Block(1, 8)}))->ticket, 3u);
  EXPECT_EQ(Restore(Transfer(b, {Block(1, 8)}))->ticket, 2u);
}

// ---------------------------------------------------------------------------------------------
// Lookup over a TP group of namespaces named by their parts (LookupSpec::namespaces).

class GroupLookupTest : public CacheCoreTest {
 protected:
  // Room for one 64 MiB extent per namespace: the ranks' blocks do not evict each other.
  void SetUp() override { Build(2000ms, size_t{256} << 20); }

  // Spec() as rank `rank` of `size`; MLA pools have no V views.
  RegisterSpec TpSpec(uint32_t rank, uint32_t size, int attention = kMha) const {
    RegisterSpec s = Spec();
    s.tp_rank = rank;
    s.tp_size = size;
    s.attention = attention;
    if (attention == kMla) {
      for (LayerSpec& l : s.layers) l.v = ViewSpec{};
    }
    return s;
  }
  RegisterResult Reg(const RegisterSpec& s) {
    auto r = core_->RegisterPool(s);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : RegisterResult{};
  }
  static NamespaceSpec Ref(const RegisterSpec& s) { return s; }  // the namespace's parts only
  static std::vector<std::string> Keys(std::initializer_list<uint64_t> ids) {
    std::vector<std::string> out;
    for (uint64_t i : ids) out.push_back(KeyString(i));
    return out;
  }
  StatusOr<uint32_t> Group(std::vector<NamespaceSpec> refs, std::vector<std::string> keys,
                           uint64_t pool_id = 0) {
    LookupSpec spec;
    spec.pool_id = pool_id;
    spec.keys = std::move(keys);
    spec.namespaces = std::move(refs);
    return core_->Lookup(spec);
  }
  uint32_t GroupOk(std::vector<NamespaceSpec> refs, std::vector<std::string> keys,
                   uint64_t pool_id = 0) {
    auto r = Group(std::move(refs), std::move(keys), pool_id);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : 9999;
  }
  NamespaceCounters Counters(const std::string& namespace_id) const {
    for (const auto& n : core_->Snapshot().namespaces) {
      if (n.namespace_id == namespace_id) return n.counters;
    }
    ADD_FAILURE() << "no namespace " << namespace_id;
    return {};
  }
  // Backs up blocks `keys` (rows 4*i.. of the shared buffers) into `pool`.
  void Store(uint64_t pool, std::initializer_list<uint64_t> keys) {
    std::vector<BlockSpec> blocks;
    uint32_t row = 0;
    for (uint64_t k : keys) {
      blocks.push_back(Block(k, row));
      row += kBlockTokens;
    }
    auto r = Backup(Transfer(pool, blocks));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    for (BlockResult b : r->results) ASSERT_EQ(b, BlockResult::kStored);
  }
  // A warm restart, as hiqcached after kill -9: a new store reattaches to the same pool memory
  // (the index is rebuilt from the block headers) and a new core starts with no pool and no
  // namespace registered. The engine's shm buffers stay as they are.
  void Restart() {
    core_.reset();
    store_.reset();
    RebuildReport report;
    store_ = std::make_unique<BlockStore>(pool_mem_->data(), pool_mem_->size(), /*reattach=*/true,
                                          1, &report);
    ASSERT_TRUE(report.reattached) << report.reason;
    core_ = std::make_unique<CacheCore>(CoreOptions{}, store_.get(), host_.get(), nullptr);
  }
  std::vector<std::string> NamespaceIds() const {
    std::vector<std::string> ids;
    for (const auto& n : core_->Snapshot().namespaces) ids.push_back(n.namespace_id);
    std::sort(ids.begin(), ids.end());
    return ids;
  }
};

TEST_F(GroupLookupTest, AnswerIsTheShortestRunOverTheGroup) {
  const RegisterSpec r0 = TpSpec(0, 2), r1 = TpSpec(1, 2);
  const RegisterResult p0 = Reg(r0), p1 = Reg(r1);
  ASSERT_NE(p0.namespace_id, p1.namespace_id);  // MHA: one namespace per rank
  Store(p0.pool_id, {1, 2, 3, 4});
  Store(p1.pool_id, {1, 2, 4});  // rank 1 lacks block 3
  const std::vector<std::string> k = Keys({1, 2, 3, 4});

  EXPECT_EQ(GroupOk({Ref(r0), Ref(r1)}, k), 2u);
  EXPECT_EQ(GroupOk({Ref(r1), Ref(r0)}, k), 2u);
  EXPECT_EQ(GroupOk({Ref(r0)}, k), 4u);  // a ref and a pool with the same parts agree
  EXPECT_EQ(Lookup(p0.pool_id, k), 4u);
  EXPECT_EQ(GroupOk({Ref(r1)}, k), 2u);
  EXPECT_EQ(GroupOk({Ref(r0)}, Keys({4, 1})), 2u);
  EXPECT_EQ(GroupOk({Ref(r0), Ref(r1)}, Keys({4, 1})), 2u);
  EXPECT_EQ(GroupOk({Ref(r0), Ref(r1)}, Keys({3, 4})), 0u);
  EXPECT_EQ(GroupOk({Ref(r0), Ref(r1)}, {}), 0u);
  // pool_id joins the group.
  EXPECT_EQ(GroupOk({Ref(r0)}, k, p1.pool_id), 2u);
  EXPECT_EQ(GroupOk({Ref(r0)}, k, p0.pool_id), 4u);
  EXPECT_EQ(Group({Ref(r0)}, k, p0.pool_id + 777).status().code(), StatusCode::kNotFound);
}

TEST_F(GroupLookupTest, CountsTheAnswerInEachNamespaceOnce) {
  const RegisterSpec r0 = TpSpec(0, 2), r1 = TpSpec(1, 2);
  const RegisterResult p0 = Reg(r0), p1 = Reg(r1);
  Store(p0.pool_id, {1, 2, 3, 4});
  Store(p1.pool_id, {1, 2});
  const NamespaceCounters a0 = Counters(p0.namespace_id), b0 = Counters(p1.namespace_id);
  // As a pool lookup: the answer (2) counts as hits, the other keys (3) as misses, in each
  // namespace; a namespace listed twice, or also named by pool_id, counts once.
  EXPECT_EQ(GroupOk({Ref(r0), Ref(r1), Ref(r0)}, Keys({1, 2, 3, 4, 5}), p1.pool_id), 2u);
  const NamespaceCounters a1 = Counters(p0.namespace_id), b1 = Counters(p1.namespace_id);
  EXPECT_EQ(a1.hits - a0.hits, 2u);
  EXPECT_EQ(a1.misses - a0.misses, 3u);
  EXPECT_EQ(b1.hits - b0.hits, 2u);
  EXPECT_EQ(b1.misses - b0.misses, 3u);
  // With a member no pool registered, the answer is 0: every key is a miss in the others.
  RegisterSpec other = r0;
  other.model = "never/registered";
  EXPECT_EQ(GroupOk({Ref(r0), Ref(other)}, Keys({1, 2})), 0u);
  const NamespaceCounters a2 = Counters(p0.namespace_id);
  EXPECT_EQ(a2.hits, a1.hits);
  EXPECT_EQ(a2.misses - a1.misses, 2u);
}

TEST_F(GroupLookupTest, UnknownOrEmptyNamespaceAnswersZeroAndIsNotCreated) {
  const RegisterSpec r0 = TpSpec(0, 2);
  const RegisterResult p0 = Reg(r0);
  Store(p0.pool_id, {1, 2});
  const RegisterSpec empty = TpSpec(1, 2);
  (void)Reg(empty);  // registered, holds nothing
  const size_t namespaces = core_->Snapshot().namespaces.size();
  const size_t store_namespaces = store_->Stats().namespaces.size();
  ASSERT_EQ(namespaces, 2u);

  RegisterSpec model = r0, tenant = r0, tp = r0, codec = r0, block = r0, dtype = r0;
  model.model = "another/model";
  tenant.tenant = "another-tenant";
  tp.tp_size = 4;  // rank 0 of 4 is another namespace than rank 0 of 2
  codec.codec = kRaw;
  block.block_tokens = 8;
  dtype.dtype = 2;  // FP16
  for (const RegisterSpec* s : {&model, &tenant, &tp, &codec, &block, &dtype}) {
    EXPECT_EQ(GroupOk({Ref(*s)}, Keys({1, 2})), 0u) << s->model << "/" << s->tenant;
    EXPECT_EQ(GroupOk({Ref(r0), Ref(*s)}, Keys({1, 2})), 0u);
  }
  EXPECT_EQ(GroupOk({Ref(empty)}, Keys({1, 2})), 0u);
  EXPECT_EQ(GroupOk({Ref(r0), Ref(empty)}, Keys({1, 2})), 0u);
  EXPECT_EQ(GroupOk({Ref(r0)}, Keys({1, 2})), 2u);
  // Lookups of unknown namespaces created nothing, in the table or in the store.
  EXPECT_EQ(core_->Snapshot().namespaces.size(), namespaces);
  EXPECT_EQ(store_->Stats().namespaces.size(), store_namespaces);
  for (int i = 0; i < 200; ++i) {
    RegisterSpec s = r0;
    s.model = "unknown/" + std::to_string(i);
    (void)GroupOk({Ref(s)}, Keys({1}));
  }
  EXPECT_EQ(core_->Snapshot().namespaces.size(), namespaces);
  EXPECT_EQ(store_->Stats().namespaces.size(), store_namespaces);
}

TEST_F(GroupLookupTest, MlaNamespaceIgnoresTpRankAndSize) {
  const RegisterSpec m = TpSpec(1, 4, kMla);
  const RegisterResult p = Reg(m);
  EXPECT_EQ(Reg(TpSpec(3, 8, kMla)).namespace_id, p.namespace_id);  // as for registration
  Store(p.pool_id, {1, 2, 3});
  const std::vector<std::string> k = Keys({1, 2, 3});
  EXPECT_EQ(GroupOk({Ref(TpSpec(0, 1, kMla))}, k), 3u);
  EXPECT_EQ(GroupOk({Ref(TpSpec(0, 4, kMla)), Ref(TpSpec(1, 4, kMla)), Ref(TpSpec(2, 4, kMla)),
                     Ref(TpSpec(3, 4, kMla))},
                    k),
            3u);
  EXPECT_EQ(GroupOk({Ref(TpSpec(5, 8, kMla))}, k, p.pool_id), 3u);
  // The four refs are one namespace: counted once.
  const NamespaceCounters before = Counters(p.namespace_id);
  EXPECT_EQ(GroupOk({Ref(TpSpec(0, 2, kMla)), Ref(TpSpec(1, 2, kMla))}, k), 3u);
  EXPECT_EQ(Counters(p.namespace_id).hits - before.hits, 3u);
  // Still validated as a registration: tp_rank < tp_size.
  EXPECT_EQ(Group({Ref(TpSpec(0, 1, kMla))}, k).status().code(), StatusCode::kOk);
  NamespaceSpec bad = Ref(TpSpec(0, 1, kMla));
  bad.tp_rank = 1;
  EXPECT_EQ(Group({bad}, k).status().code(), StatusCode::kInvalidArgument);
  // MHA keeps one namespace per rank.
  EXPECT_EQ(GroupOk({Ref(TpSpec(1, 4, kMha))}, k), 0u);
}

TEST_F(GroupLookupTest, InvalidRefsNameTheFieldAndChangeNothing) {
  const RegisterSpec r0 = TpSpec(0, 2), r1 = TpSpec(1, 2);
  const RegisterResult p0 = Reg(r0), p1 = Reg(r1);
  Store(p0.pool_id, {1, 2});
  Store(p1.pool_id, {1, 2});
  const CoreSnapshot before = core_->Snapshot();
  const std::vector<std::string> k = Keys({1, 2});

  auto expect = [&](std::vector<NamespaceSpec> refs, std::vector<std::string> keys,
                    uint64_t pool_id, StatusCode code, const std::string& field) {
    const Status st = Group(std::move(refs), std::move(keys), pool_id).status();
    EXPECT_EQ(st.code(), code) << field << ": " << st.ToString();
    EXPECT_NE(st.message().find(field), std::string::npos) << st.message();
  };
  auto mutated = [&](auto mutate) {
    NamespaceSpec s = Ref(r1);
    mutate(s);
    return std::vector<NamespaceSpec>{Ref(r0), s};
  };
  const StatusCode kInvalid = StatusCode::kInvalidArgument;
  expect({}, k, 0, kInvalid, "pool_id");
  expect(mutated([](NamespaceSpec& s) { s.model.clear(); }), k, 0, kInvalid, "namespaces[1].model");
  expect(mutated([](NamespaceSpec& s) { s.model.assign(10000, 'm'); }), k, 0, kInvalid,
         "namespaces[1].model");
  expect(mutated([](NamespaceSpec& s) { s.tenant.assign(10000, 't'); }), k, 0, kInvalid,
         "namespaces[1].tenant");
  expect(mutated([](NamespaceSpec& s) { s.num_layers = 0; }), k, 0, kInvalid,
         "namespaces[1].geometry.num_layers");
  expect(mutated([](NamespaceSpec& s) { s.num_kv_heads = 0; }), k, 0, kInvalid,
         "namespaces[1].geometry.num_kv_heads");
  expect(mutated([](NamespaceSpec& s) { s.head_dim = 1u << 20; }), k, 0, kInvalid,
         "namespaces[1].geometry.head_dim");
  expect(mutated([](NamespaceSpec& s) { s.dtype = 0; }), k, 0, kInvalid,
         "namespaces[1].geometry.dtype");
  expect(mutated([](NamespaceSpec& s) { s.attention = 9; }), k, 0, kInvalid,
         "namespaces[1].geometry.attention");
  expect(mutated([](NamespaceSpec& s) { s.tp_size = 0; }), k, 0, kInvalid,
         "namespaces[1].geometry.tp_size");
  expect(mutated([](NamespaceSpec& s) { s.tp_rank = 2; }), k, 0, kInvalid,
         "namespaces[1].geometry.tp_rank");
  expect(mutated([](NamespaceSpec& s) { s.block_tokens = 0; }), k, 0, kInvalid,
         "namespaces[1].block_tokens");
  expect(mutated([](NamespaceSpec& s) {
           s.num_layers = 4096;
           s.block_tokens = 4096;
         }),
         k, 0, kInvalid, "namespaces[1].block_tokens");  // does not fit twice in the pool
  expect(mutated([](NamespaceSpec& s) { s.codec = 9; }), k, 0, kInvalid, "namespaces[1].codec");
  expect({Ref(r0), Ref(r1)}, {KeyString(1), "short"}, 0, kInvalid, "keys[1]");
  expect({Ref(r0)}, k, p0.pool_id ^ 0x5A5A, StatusCode::kNotFound, "pool_id");
  // The same text as RegisterPool's own check, with the entry in front.
  {
    RegisterSpec reg = r1;
    reg.num_kv_heads = 0;
    const Status r = core_->RegisterPool(reg).status();
    const Status g = Group({Ref(r0), Ref(reg)}, k).status();
    EXPECT_EQ(g.message(), "namespaces[1]." + r.message());
  }
  // More than kMaxLookupNamespaces entries.
  std::vector<NamespaceSpec> many(kMaxLookupNamespaces + 1, Ref(r0));
  expect(many, k, 0, StatusCode::kResourceExhausted, "namespaces");
  many.pop_back();
  EXPECT_EQ(GroupOk(many, k), 2u);  // exactly the limit is fine

  // Nothing changed but that one successful lookup's own counts.
  const CoreSnapshot after = core_->Snapshot();
  ASSERT_EQ(after.namespaces.size(), before.namespaces.size());
  for (size_t i = 0; i < after.namespaces.size(); ++i) {
    const NamespaceCounters& a = after.namespaces[i].counters;
    const NamespaceCounters& b = before.namespaces[i].counters;
    const bool r0_ns = after.namespaces[i].namespace_id == p0.namespace_id;
    EXPECT_EQ(a.hits, b.hits + (r0_ns ? 2 : 0)) << after.namespaces[i].namespace_id;
    EXPECT_EQ(a.misses, b.misses);
    EXPECT_EQ(a.blocks, b.blocks);
  }
  EXPECT_EQ(after.store.blocks, before.store.blocks);
}

// After a warm restart the blocks of every namespace sit under namespaces no pool registered: a
// scheduler's group lookup must answer from them before any worker registers again (workers
// register when the scheduler gives them a load), and the worker that registers later joins the
// namespace the lookup adopted.
TEST_F(GroupLookupTest, AnswersFromRebuiltBlocksBeforeAnyRegistration) {
  const RegisterSpec r0 = TpSpec(0, 2), r1 = TpSpec(1, 2);
  const RegisterResult p0 = Reg(r0), p1 = Reg(r1);
  Store(p0.pool_id, {1, 2, 3, 4});
  Store(p1.pool_id, {1, 2, 3});
  const std::vector<uint8_t> original = ClientBytes();
  const std::vector<std::string> k = Keys({1, 2, 3, 4});
  ASSERT_EQ(GroupOk({Ref(r0), Ref(r1)}, k), 3u);

  ASSERT_NO_FATAL_FAILURE(Restart());
  ASSERT_TRUE(NamespaceIds().empty());
  ASSERT_EQ(store_->Stats().namespaces.size(), 2u);  // the rebuilt (not yet adopted) ones
  ASSERT_EQ(store_->Stats().blocks, 7u);

  // Refs that match no rebuilt blocks create nothing, in the table or in the store; nor does a
  // rejected request that also names a rebuilt namespace.
  RegisterSpec raw = r0, other_tp = r0;
  raw.codec = kRaw;      // same geometry, another namespace
  other_tp.tp_size = 4;  // rank 0 of 4
  EXPECT_EQ(GroupOk({Ref(raw)}, k), 0u);
  EXPECT_EQ(GroupOk({Ref(other_tp)}, k), 0u);
  for (int i = 0; i < 100; ++i) {
    RegisterSpec s = r0;
    s.model = "unknown/" + std::to_string(i);
    EXPECT_EQ(GroupOk({Ref(s)}, k), 0u);
  }
  NamespaceSpec bad = Ref(r1);
  bad.num_kv_heads = 0;
  EXPECT_EQ(Group({Ref(r0), bad}, k).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Group({Ref(r0)}, {KeyString(1), "short"}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Group({Ref(r0)}, k, /*pool_id=*/12345).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(NamespaceIds().empty());
  EXPECT_EQ(store_->Stats().namespaces.size(), 2u);

  // The group lookup answers from the rebuilt blocks, with no pool registered.
  EXPECT_EQ(GroupOk({Ref(r0), Ref(r1)}, k), 3u);
  EXPECT_EQ(GroupOk({Ref(r0)}, k), 4u);
  EXPECT_EQ(GroupOk({Ref(r1)}, k), 3u);
  EXPECT_EQ(GroupOk({Ref(r0), Ref(raw)}, k), 0u);
  // It adopted them: the namespaces exist under their old ids, holding their blocks, and the
  // store has no extra namespace (the rebuilt ones became these).
  std::vector<std::string> expected = {p0.namespace_id, p1.namespace_id};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(NamespaceIds(), expected);
  EXPECT_EQ(store_->Stats().namespaces.size(), 2u);
  EXPECT_EQ(Counters(p0.namespace_id).blocks, 4u);
  EXPECT_EQ(Counters(p1.namespace_id).blocks, 3u);
  // Counted from the adoption on: r0 {r0,r1} h3 m1, {r0} h4, {r0,raw} m4; r1 h3 m1 twice.
  EXPECT_EQ(Counters(p0.namespace_id).hits, 7u);
  EXPECT_EQ(Counters(p0.namespace_id).misses, 5u);
  EXPECT_EQ(Counters(p1.namespace_id).hits, 6u);
  EXPECT_EQ(Counters(p1.namespace_id).misses, 2u);

  // The workers register again and join those namespaces: their pools see the same blocks.
  const RegisterResult q0 = Reg(r0);
  EXPECT_EQ(q0.namespace_id, p0.namespace_id);
  EXPECT_EQ(Lookup(q0.pool_id, k), 4u);
  EXPECT_EQ(GroupOk({Ref(r1)}, k, q0.pool_id), 3u);
  auto restored =
      Restore(Transfer(q0.pool_id, {Block(1, 16), Block(2, 20), Block(3, 24), Block(4, 28)}));
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->restored_blocks, 4u);
  ExpectInt8Restored(original, 0, 16, 16);
  const RegisterResult q1 = Reg(r1);
  EXPECT_EQ(q1.namespace_id, p1.namespace_id);
  EXPECT_EQ(Lookup(q1.pool_id, k), 3u);
  EXPECT_EQ(GroupOk({Ref(r0), Ref(r1)}, k), 3u);
  EXPECT_EQ(NamespaceIds(), expected);
  EXPECT_EQ(store_->Stats().namespaces.size(), 2u);
  EXPECT_EQ(store_->Stats().blocks, 7u);
}

// A rebuilt namespace whose blocks have all been reclaimed since holds nothing: a lookup of it
// answers 0 and creates nothing, as for any namespace nobody registered.
TEST_F(GroupLookupTest, RebuiltNamespaceWithNoBlocksLeftIsNotAdopted) {
  Build(2000ms, size_t{1} << 20);  // one extent fills the pool
  const RegisterSpec r0 = TpSpec(0, 2), r1 = TpSpec(1, 2);
  const RegisterResult p0 = Reg(r0);
  Store(p0.pool_id, {1, 2});
  ASSERT_NO_FATAL_FAILURE(Restart());
  ASSERT_EQ(store_->Stats().blocks, 2u);
  // Rank 1 registers first and needs room: the rebuilt extent of rank 0 yields, whole.
  const RegisterResult p1 = Reg(r1);
  Store(p1.pool_id, {1});
  ASSERT_EQ(store_->Stats().blocks, 1u);
  const size_t store_namespaces = store_->Stats().namespaces.size();
  EXPECT_EQ(GroupOk({Ref(r0)}, Keys({1, 2})), 0u);
  EXPECT_EQ(GroupOk({Ref(r1)}, Keys({1, 2})), 1u);
  EXPECT_EQ(NamespaceIds(), std::vector<std::string>{p1.namespace_id});
  // Nothing was created; the emptied rebuilt namespace may even be gone (SweepNamespaces).
  EXPECT_LE(store_->Stats().namespaces.size(), store_namespaces);
}

TEST_F(GroupLookupTest, DrainingIsUnavailable) {
  const RegisterSpec r0 = TpSpec(0, 2);
  (void)Reg(r0);
  core_->StartDraining();
  EXPECT_EQ(Group({Ref(r0)}, Keys({1})).status().code(), StatusCode::kUnavailable);
}

// ---------------------------------------------------------------------------------------------
// Isolation: ownership, namespace scope, quotas, fair service, namespace lifetime.

Caller Authenticated(uint64_t session, uint32_t pid, uint32_t uid) {
  Caller c;
  c.session = session;
  c.pid = pid;
  c.uid = uid;
  c.gid = uid;
  return c;
}

class IsolationTest : public CacheCoreTest {
 protected:
  void TearDown() override {
    CacheCoreTest::TearDown();
    for (int fd : fds_) ::close(fd);
  }
  // A core with `options` over the fixture's store and backend.
  void Rebuild(const CoreOptions& options) {
    core_.reset();
    core_ = std::make_unique<CacheCore>(options, store_.get(), host_.get(), nullptr);
  }
  // Spec() registered by `caller`, its buffers and events passed by fd (as a session does), so
  // that a caller of another uid may map them (names must belong to the caller's uid).
  RegisterSpec SpecOf(const Caller& caller, int codec = kInt8) {
    RegisterSpec s = Spec(codec);
    s.caller = caller;
    uint64_t id = 1;
    for (BufferSpec& b : s.buffers) {
      const int fd = ::shm_open(("/" + b.host_shm_name).c_str(), O_RDWR, 0);
      EXPECT_GE(fd, 0);
      fds_.push_back(fd);
      b.has_host_shm_name = false;
      b.has_host_fd = true;
      b.host_fd_id = id++;
      b.fd = fd;
    }
    const int ev = ::shm_open(s.events.host_shm_name.c_str(), O_RDWR, 0);
    EXPECT_GE(ev, 0);
    fds_.push_back(ev);
    s.events.host_shm_name.clear();
    s.events.host_fd_id = id;
    s.events.fd = ev;
    return s;
  }
  RegisterResult RegisterAs(const Caller& caller, int codec = kInt8) {
    auto r = core_->RegisterPool(SpecOf(caller, codec));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : RegisterResult{};
  }
  TransferSpec TransferAs(const Caller& caller, uint64_t pool, std::vector<BlockSpec> blocks) {
    TransferSpec t = Transfer(pool, std::move(blocks));
    t.caller = caller;
    return t;
  }
  static bool Has(const Status& st, const std::string& text) {
    return st.message().find(text) != std::string::npos;
  }

  std::vector<int> fds_;
};

TEST_F(IsolationTest, OnlyTheOwnerUsesAPoolOthersSeeNotFound) {
  const Caller a = Authenticated(1, 100, 61001);
  const Caller a_other_process = Authenticated(2, 101, 61001);
  const Caller b = Authenticated(3, 200, 61002);
  const Caller anonymous;
  Caller admin = Authenticated(4, 300, 0);
  admin.admin = true;
  const RegisterResult pa = RegisterAs(a);
  ASSERT_NE(pa.pool_id, 0u);
  ASSERT_TRUE(Backup(TransferAs(a, pa.pool_id, {Block(1, 0)})).ok());
  const std::vector<uint8_t> before = ClientBytes();

  // The error of an unknown pool, word for word: no oracle of which ids exist.
  const uint64_t unknown = pa.pool_id ^ 0x5555;
  const std::string not_found = core_->ReleasePool(unknown, a).message();
  ASSERT_FALSE(not_found.empty());
  for (const Caller& intruder : {a_other_process, b, anonymous, admin}) {
    SCOPED_TRACE("intruder pid " + std::to_string(intruder.pid));
    auto expect_hidden = [&](const Status& st) {
      EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
      std::string text = st.message();
      const std::string id = std::to_string(pa.pool_id);
      text.replace(text.find(id), id.size(), std::to_string(unknown));
      EXPECT_EQ(text, not_found);
    };
    expect_hidden(Restore(TransferAs(intruder, pa.pool_id, {Block(1, 8)})).status());
    expect_hidden(Backup(TransferAs(intruder, pa.pool_id, {Block(2, 4)})).status());
    expect_hidden(core_->Lookup(pa.pool_id, {KeyString(1)}, intruder).status());
    if (!intruder.admin) {
      expect_hidden(core_->Evict(pa.pool_id, {KeyString(1)}, intruder).status());
      expect_hidden(core_->ReleasePool(pa.pool_id, intruder));
    }
  }
  // An admin may evict a tenant's blocks through its pool (hiqctl evict); a key it was never
  // given evicts nothing.
  auto evicted = core_->Evict(pa.pool_id, {KeyString(77)}, admin);
  ASSERT_TRUE(evicted.ok()) << evicted.status().ToString();
  EXPECT_EQ(*evicted, 0u);
  EXPECT_EQ(ClientBytes(), before);  // no restore reached the owner's rows
  // The owner still has everything.
  auto n = core_->Lookup(pa.pool_id, {KeyString(1), KeyString(2)}, a);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 1u);

  // Snapshots show the pool and its namespace to its uid and admins only, its id only to its
  // owner and admins; another uid and an anonymous caller see neither (the totals only).
  auto pool_of = [&](const Caller& c) {
    CoreSnapshot snap = core_->Snapshot(c);
    EXPECT_EQ(snap.pools.size(), 1u);
    EXPECT_EQ(snap.namespaces.size(), 1u);
    return snap.pools.empty() ? PoolSnapshot{} : snap.pools[0];
  };
  EXPECT_EQ(pool_of(a).pool_id, pa.pool_id);
  EXPECT_TRUE(pool_of(a).owned);
  EXPECT_EQ(pool_of(a).uid, 61001u);
  EXPECT_EQ(pool_of(a).client_pid, 100u);  // the kernel's pid, not the reported one (4242)
  EXPECT_EQ(pool_of(a_other_process).pool_id, 0u);
  EXPECT_FALSE(pool_of(a_other_process).owned);
  EXPECT_EQ(pool_of(admin).pool_id, pa.pool_id);
  EXPECT_FALSE(pool_of(admin).owned);
  for (const Caller& stranger : {b, anonymous}) {
    CoreSnapshot snap = core_->Snapshot(stranger);
    EXPECT_TRUE(snap.pools.empty()) << "pid " << stranger.pid;
    EXPECT_TRUE(snap.namespaces.empty()) << "pid " << stranger.pid;
    EXPECT_EQ(snap.namespaces_total, 0u);
    EXPECT_EQ(snap.store.blocks, core_->Snapshot().store.blocks);  // the totals are the node's
  }

  // An admin may release any pool.
  HIQ_EXPECT_OK(core_->ReleasePool(pa.pool_id, admin));
  EXPECT_EQ(core_->Lookup(pa.pool_id, {KeyString(1)}, a).status().code(), StatusCode::kNotFound);
}

TEST_F(IsolationTest, AnonymousPoolsServeAnonymousCallersOnly) {
  const uint64_t pool = Register();  // anonymous, as every caller before sessions
  const Caller a = Authenticated(1, 100, 0);
  EXPECT_EQ(core_->Lookup(pool, {KeyString(1)}, a).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(core_->ReleasePool(pool, a).code(), StatusCode::kNotFound);
  EXPECT_EQ(Backup(TransferAs(a, pool, {Block(1, 0)})).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Backup(Transfer(pool, {Block(1, 0)})).ok());
  EXPECT_EQ(Lookup(pool, {KeyString(1)}), 1u);
  EXPECT_EQ(core_->Snapshot().pools[0].pool_id, pool);  // the operator's view
  // Neither an authenticated caller nor an anonymous one is shown who else uses the node.
  EXPECT_TRUE(core_->Snapshot(a).pools.empty());
  EXPECT_TRUE(core_->Snapshot(Caller{}).pools.empty());
}

TEST_F(IsolationTest, ClientDeathBySessionOrKernelPid) {
  const Caller a1 = Authenticated(7, 100, 61001), a2 = Authenticated(8, 100, 61001);
  const Caller b = Authenticated(9, 200, 61002);
  RegisterSpec sa1 = SpecOf(a1);
  sa1.client_pid = 999;  // what the client claims: ignored for an authenticated caller
  ASSERT_TRUE(core_->RegisterPool(sa1).ok());
  const RegisterResult pa2 = RegisterAs(a2);
  const RegisterResult pb = RegisterAs(b);
  EXPECT_EQ(core_->ReleasePoolsOfSession(0), 0u);
  EXPECT_EQ(core_->ReleasePoolsOfClient(999), 0u);
  EXPECT_EQ(core_->ReleasePoolsOfSession(7), 1u);
  EXPECT_EQ(core_->Snapshot().pools.size(), 2u);
  EXPECT_EQ(core_->ReleasePoolsOfClient(100), 1u);
  EXPECT_EQ(core_->Lookup(pa2.pool_id, {KeyString(1)}, a2).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(core_->Lookup(pb.pool_id, {KeyString(1)}, b).ok());
}

TEST_F(IsolationTest, NamespacesNeverSpanUids) {
  const Caller a = Authenticated(1, 100, 61001), a2 = Authenticated(2, 101, 61001);
  const Caller b = Authenticated(3, 200, 61002);
  const RegisterResult pa = RegisterAs(a), pa2 = RegisterAs(a2), pb = RegisterAs(b);
  const RegisterResult anon = *core_->RegisterPool(Spec());
  EXPECT_EQ(pa.namespace_id, pa2.namespace_id);  // one user's processes share
  EXPECT_NE(pa.namespace_id, pb.namespace_id);
  EXPECT_NE(pa.namespace_id, anon.namespace_id);
  ASSERT_TRUE(Backup(TransferAs(a, pa.pool_id, {Block(1, 0)})).ok());
  EXPECT_EQ(*core_->Lookup(pa2.pool_id, {KeyString(1)}, a2), 1u);
  EXPECT_EQ(*core_->Lookup(pb.pool_id, {KeyString(1)}, b), 0u);
  EXPECT_EQ(Lookup(anon.pool_id, {KeyString(1)}), 0u);
  auto r = Restore(TransferAs(b, pb.pool_id, {Block(1, 8)}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_blocks, 0u);
  // A lookup by the namespace's parts answers in the caller's scope only.
  LookupSpec ref;
  ref.keys = {KeyString(1)};
  ref.namespaces = {static_cast<NamespaceSpec>(Spec())};
  ref.caller = b;
  EXPECT_EQ(*core_->Lookup(ref), 0u);
  ref.caller = a2;
  EXPECT_EQ(*core_->Lookup(ref), 1u);
  ref.caller = Caller{};
  EXPECT_EQ(*core_->Lookup(ref), 0u);
}

TEST_F(IsolationTest, NodeScopeSharesAcrossUidsWithTheLegacyNamespaceId) {
  CoreOptions options;
  options.namespace_scope = NamespaceScope::kNode;
  Rebuild(options);
  const Caller a = Authenticated(1, 100, 61001), b = Authenticated(3, 200, 61002);
  const RegisterResult pa = RegisterAs(a), pb = RegisterAs(b);
  EXPECT_EQ(pa.namespace_id, pb.namespace_id);
  // The id of daemons before scopes: the unscoped descriptor's hash.
  auto reg = ValidateRegistration(Spec(), Limits{}, store_->CapacityBytes());
  ASSERT_TRUE(reg.ok());
  ASSERT_TRUE(reg->ns.scope.empty());
  NamespaceTable legacy_table;
  EXPECT_EQ(pa.namespace_id, legacy_table.Intern(reg->ns).hex_id);
  ASSERT_TRUE(Backup(TransferAs(a, pa.pool_id, {Block(1, 0)})).ok());
  EXPECT_EQ(*core_->Lookup(pb.pool_id, {KeyString(1)}, b), 1u);
}

TEST_F(IsolationTest, PoolBufferAndMappingQuotasPerUid) {
  CoreOptions options;
  options.quotas.max_pools_per_client = 2;
  options.quotas.max_buffers_per_client = 5;  // two-buffer pools: the third would need 6
  Rebuild(options);
  const Caller a1 = Authenticated(1, 100, 61001), a2 = Authenticated(2, 101, 61001);
  const Caller b = Authenticated(3, 200, 61002);
  const RegisterResult p1 = RegisterAs(a1);
  ASSERT_NE(p1.pool_id, 0u);
  ASSERT_NE(RegisterAs(a2).pool_id, 0u);  // another process of the same uid: same client
  auto over = core_->RegisterPool(SpecOf(a1));
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Has(over.status(), "max_pools_per_client")) << over.status().ToString();
  EXPECT_TRUE(Has(over.status(), "uid 61001")) << over.status().ToString();
  EXPECT_EQ(core_->Snapshot().pools.size(), 2u);
  // Another uid is not affected, and round-trips.
  const RegisterResult pb = RegisterAs(b);
  ASSERT_NE(pb.pool_id, 0u);
  ASSERT_TRUE(Backup(TransferAs(b, pb.pool_id, {Block(1, 0)})).ok());
  auto r = Restore(TransferAs(b, pb.pool_id, {Block(1, 8)}));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->restored_blocks, 1u);
  // Released pools give their quota back.
  HIQ_EXPECT_OK(core_->ReleasePool(p1.pool_id, a1));
  EXPECT_NE(RegisterAs(a1).pool_id, 0u);

  CoreOptions buffers;
  buffers.quotas.max_buffers_per_client = 3;
  Rebuild(buffers);
  ASSERT_NE(RegisterAs(a1).pool_id, 0u);
  over = core_->RegisterPool(SpecOf(a1));
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Has(over.status(), "max_buffers_per_client")) << over.status().ToString();

  CoreOptions mapped;
  mapped.quotas.max_mapped_bytes_per_client = 3 * kPlaneBytes;  // one pool: 2 planes + events
  Rebuild(mapped);
  ASSERT_NE(RegisterAs(a1).pool_id, 0u);
  over = core_->RegisterPool(SpecOf(a2));
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Has(over.status(), "max_mapped_bytes_per_client")) << over.status().ToString();
  EXPECT_NE(RegisterAs(b).pool_id, 0u);
}

TEST_F(IsolationTest, PendingWorkQuota) {
  CoreOptions options;
  // One block of this geometry moves 2 planes x 2 layers x 4 tokens x 256 bytes = 4 KiB.
  options.quotas.max_pending_bytes_per_client = 3 * 4096;
  Rebuild(options);
  const Caller a = Authenticated(1, 100, 61001), b = Authenticated(3, 200, 61002);
  const RegisterResult pa = RegisterAs(a), pb = RegisterAs(b);
  // Two blocks wait for an event: 8 KiB pending.
  TransferSpec waiting = TransferAs(a, pa.pool_id, {Block(1, 0), Block(2, 4)});
  waiting.sync = false;
  waiting.wait_event = 0;
  std::atomic<int> calls{0};
  core_->Backup(waiting, [&](StatusOr<BackupResult> r) {
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    ++calls;
  });
  ASSERT_EQ(calls.load(), 1);
  auto over = Restore(TransferAs(a, pa.pool_id, {Block(1, 8), Block(2, 12)}));
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(Has(over.status(), "max_pending_bytes_per_client")) << over.status().ToString();
  // Another uid's work is not affected (and runs while A's backup waits).
  std::promise<StatusOr<BackupResult>> p;
  auto f = p.get_future();
  core_->Backup(TransferAs(b, pb.pool_id, {Block(3, 16), Block(4, 20)}),
                [&](StatusOr<BackupResult> r) { p.set_value(std::move(r)); });
  auto other = Await(f);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  Slot(0).store(1, std::memory_order_release);
  core_->WaitIdle();
  // Done: the quota is free again.
  auto again = Backup(TransferAs(a, pa.pool_id, {Block(5, 16), Block(6, 20), Block(7, 24)}));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*core_->Lookup(pa.pool_id, {KeyString(1), KeyString(2), KeyString(5)}, a), 3u);
  // A request larger than the whole quota can never run.
  auto huge =
      Backup(TransferAs(a, pa.pool_id, {Block(8, 0), Block(9, 4), Block(10, 8), Block(11, 12)}));
  EXPECT_EQ(huge.status().code(), StatusCode::kResourceExhausted);
}

TEST_F(IsolationTest, ReservedSlotsQuota) {
  CoreOptions options;
  options.quotas.max_reserved_slots_per_client = 2;
  Rebuild(options);
  const uint64_t pool = Register();
  auto over = Backup(Transfer(pool, {Block(1, 0), Block(2, 4), Block(3, 8)}));
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().ToString();
  EXPECT_TRUE(Has(over.status(), "max_reserved_slots_per_client")) << over.status().ToString();
  EXPECT_EQ(store_->Stats().blocks, 0u);
  // Sub-tasks of at most 2 blocks keep a client within the quota: the same request runs.
  options.transfer_chunk_blocks = 2;
  Rebuild(options);
  const uint64_t chunked = Register();
  auto ok = Backup(Transfer(chunked, {Block(1, 0), Block(2, 4), Block(3, 8)}));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->results, std::vector<BlockResult>(3, BlockResult::kStored));
}

TEST_F(IsolationTest, RestoreCostIsBoundedByWhatItWrites) {
  const uint64_t pool = Register(kRaw);
  ASSERT_TRUE(Backup(Transfer(pool, {Block(1, 0), Block(2, 4)})).ok());
  const std::vector<uint8_t> before = ClientBytes();
  // The same rows written twice: refused, nothing written, naming the repeat.
  TransferSpec twice = Transfer(pool, {Block(1, 16), Block(2, 16)});
  twice.done_event = 2;
  auto r = Restore(twice);
  ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), "blocks[1].rows[0]")) << r.status().ToString();
  EXPECT_EQ(ClientBytes(), before);
  EXPECT_EQ(Slot(2).load(), 0u);
  // A key named twice is restored once: the run ends before its second occurrence.
  r = Restore(Transfer(pool, {Block(1, 16), Block(2, 20), Block(1, 24), Block(2, 28)}));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->restored_blocks, 2u);
  ExpectRowsUnchanged(before, 24, 8);
  EXPECT_EQ(std::memcmp(Elem(0, 1, 20, 0, 0), Elem(0, 1, 4, 0, 0), 4 * kRowBytes), 0);
}

TEST_F(IsolationTest, RepeatedRowsInABackupAreBounded) {
  CoreOptions options;
  options.limits.max_repeated_rows_per_request = 4;
  Rebuild(options);
  const uint64_t pool = Register();
  // 4 repeated rows: allowed (blocks 2 repeats block 1's rows).
  auto ok = Backup(Transfer(pool, {Block(1, 0), Block(2, 0)}));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  auto over = Backup(Transfer(pool, {Block(3, 8), Block(4, 8), Block(5, 9)}));
  ASSERT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().ToString();
  EXPECT_TRUE(Has(over.status(), "max_repeated_rows_per_request")) << over.status().ToString();
  EXPECT_EQ(Lookup(pool, {KeyString(3)}), 0u);
}

TEST_F(IsolationTest, SplitRequestsSignalOnceWithTheirTicketAndStayExact) {
  CoreOptions options;
  options.transfer_chunk_blocks = 1;
  Rebuild(options);
  const uint64_t pool = Register(kRaw);
  TransferSpec b = Transfer(pool, {Block(1, 0), Block(2, 4), Block(3, 8), Block(1, 12)});
  b.done_event = 1;
  auto backed = Backup(b);
  ASSERT_TRUE(backed.ok()) << backed.status().ToString();
  EXPECT_EQ(backed->results,
            (std::vector<BlockResult>{BlockResult::kStored, BlockResult::kStored,
                                      BlockResult::kStored, BlockResult::kAlreadyPresent}));
  EXPECT_EQ(Slot(1).load(), backed->ticket);
  TransferSpec r = Transfer(pool, {Block(1, 16), Block(2, 20), Block(3, 24)});
  r.layer_event_base = 4;
  r.done_event = 6;
  auto restored = Restore(r);
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->restored_blocks, 3u);
  for (uint32_t e : {4u, 5u, 6u}) EXPECT_EQ(Slot(e).load(), restored->ticket) << e;
  for (uint32_t p = 0; p < 2; ++p)
    for (uint32_t l = 0; l < kLayers; ++l) {
      EXPECT_EQ(std::memcmp(Elem(p, l, 16, 0, 0), Elem(p, l, 0, 0, 0), 12 * kRowBytes), 0);
    }
  EXPECT_EQ(core_->Snapshot().pools[0].restores, 3u);
}

TEST_F(IsolationTest, AFailedSubTaskReachesTheEventsAndLaterSubTasksWriteNothing) {
  CoreOptions options;
  options.transfer_chunk_blocks = 1;
  Build(100ms);
  Rebuild(options);
  const uint64_t pool = Register(kRaw);
  ASSERT_TRUE(Backup(Transfer(pool, {Block(1, 0), Block(2, 4), Block(3, 8)})).ok());
  const std::vector<uint8_t> before = ClientBytes();
  // wait_event never comes: the first sub-task fails; the rest write nothing, and the last
  // releases every layer event and done_event with the failure bit.
  TransferSpec r = Transfer(pool, {Block(1, 16), Block(2, 20), Block(3, 24)});
  r.wait_event = 0;
  r.layer_event_base = 4;
  r.done_event = 6;
  auto restored = Restore(r);
  ASSERT_FALSE(restored.ok());
  EXPECT_EQ(restored.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ClientBytes(), before);
  for (uint32_t e : {4u, 5u, 6u}) {
    EXPECT_EQ(Slot(e).load(), 2u | kHostEventFailedBit) << e;
  }
  // A split backup the same: nothing stored, done_event released with the failure bit.
  TransferSpec bk = Transfer(pool, {Block(7, 0), Block(8, 4), Block(9, 8)});
  bk.wait_event = 0;
  bk.done_event = 7;
  auto backed = Backup(bk);
  EXPECT_EQ(backed.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(Slot(7).load(), 3u | kHostEventFailedBit);
  EXPECT_EQ(Lookup(pool, {KeyString(7)}), 0u);
  EXPECT_EQ(store_->Stats().blocks, 3u);
  // Every pin is gone: the blocks can be evicted.
  EXPECT_EQ(*core_->Evict(pool, {KeyString(1), KeyString(2), KeyString(3)}), 3u);
  EXPECT_EQ(store_->Stats().blocks, 0u);
}

TEST_F(IsolationTest, OneClientsLongRestoreDoesNotStarveAnother) {
  // One worker. Client A restores many blocks, client B one; B's answer must not wait for all
  // of A's work (waiting for whole requests of other clients is what fair service prevents).
  CoreOptions options;
  options.transfer_workers = 1;
  options.transfer_chunk_blocks = 1;
  Rebuild(options);
  const Caller a = Authenticated(1, 100, 0), b = Authenticated(2, 200, 0);
  const RegisterResult pa = RegisterAs(a, kRaw), pb = RegisterAs(b, kRaw);
  ASSERT_TRUE(
      Backup(TransferAs(a, pa.pool_id, {Block(1, 0), Block(2, 4), Block(3, 8), Block(4, 12)}))
          .ok());
  ASSERT_TRUE(Backup(TransferAs(b, pb.pool_id, {Block(9, 28)})).ok());
  // Hold the only worker with a restore of A that waits, so that both requests queue first.
  TransferSpec gate = TransferAs(a, pa.pool_id, {Block(1, 16)});
  gate.sync = false;
  gate.wait_event = 0;
  core_->Restore(gate, [](StatusOr<RestoreResult> r) { EXPECT_TRUE(r.ok()); });
  std::mutex mu;
  std::vector<char> order;
  std::promise<void> both;
  int left = 2;
  auto finished = [&](char who) {
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(who);
    if (--left == 0) both.set_value();
  };
  // Distinct rows per request: rows 16..31 for A (4 blocks), 12..15 for B.
  core_->Restore(
      TransferAs(a, pa.pool_id, {Block(1, 16), Block(2, 20), Block(3, 24), Block(4, 28)}),
      [&](StatusOr<RestoreResult> r) {
        EXPECT_TRUE(r.ok()) << r.status().ToString();
        finished('A');
      });
  core_->Restore(TransferAs(b, pb.pool_id, {Block(9, 12)}), [&](StatusOr<RestoreResult> r) {
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    finished('B');
  });
  Slot(0).store(1, std::memory_order_release);
  ASSERT_EQ(both.get_future().wait_for(10s), std::future_status::ready);
  core_->WaitIdle();
  EXPECT_EQ(order, (std::vector<char>{'B', 'A'}))
      << "B's one-block restore waited for A's four-block restore";
}

TEST_F(IsolationTest, NamespacesOfChurnedPoolsAreFreed) {
  RecordingObserver obs;
  CoreOptions options;
  options.observer = &obs;
  Rebuild(options);
  const uint64_t keep = Register();
  const size_t baseline = core_->Snapshot().namespaces.size();
  ASSERT_EQ(baseline, 1u);
  constexpr int kCycles = 2000;
  std::vector<double> ms(kCycles);
  for (int i = 0; i < kCycles; ++i) {
    RegisterSpec s = Spec();
    s.model = "churn/" + std::to_string(i);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = core_->RegisterPool(s);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    HIQ_ASSERT_OK(core_->ReleasePool(r->pool_id));
    ms[i] =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  EXPECT_EQ(core_->NamespaceCount(), baseline);
  EXPECT_EQ(core_->Snapshot().namespaces.size(), baseline);
  EXPECT_EQ(core_->Snapshot().namespaces_total, baseline);
  EXPECT_EQ(store_->Stats().namespaces.size(), baseline);
  double first = 0, last = 0;
  for (int i = 0; i < 200; ++i) first += ms[i], last += ms[kCycles - 1 - i];
  std::printf("[ churn    ] %d register/release cycles: first 200 %.3f ms, last 200 %.3f ms\n",
              kCycles, first, last);
  EXPECT_LT(last, 3 * first + 50) << "registration slows down as namespaces accumulate";

  // A namespace whose pool went while it holds blocks stays (a new pool reads them), and goes
  // once its blocks do.
  RegisterSpec s = Spec();
  s.model = "kept/while/it/holds/blocks";
  auto r = core_->RegisterPool(s);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(Backup(Transfer(r->pool_id, {Block(1, 0)})).ok());
  HIQ_ASSERT_OK(core_->ReleasePool(r->pool_id));
  EXPECT_EQ(core_->Snapshot().namespaces.size(), baseline + 1);
  auto again = core_->RegisterPool(s);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->namespace_id, r->namespace_id);
  EXPECT_EQ(Lookup(again->pool_id, {KeyString(1)}), 1u);
  EXPECT_EQ(*core_->Evict(again->pool_id, {KeyString(1)}), 1u);
  HIQ_ASSERT_OK(core_->ReleasePool(again->pool_id));
  EXPECT_EQ(core_->Snapshot().namespaces.size(), baseline);
  (void)keep;
}

TEST_F(IsolationTest, NamespaceWhoseBlocksAreEvictedWithoutAPoolIsFreed) {
  const uint64_t slot = SlotBytesFor(528 * kBlockTokens);
  Build(2000ms, PoolMetaBytes(1 << 20) + kExtentHeaderBytes + 3 * slot + slot / 2);
  RecordingObserver obs;
  CoreOptions options;
  options.observer = &obs;
  Rebuild(options);
  RegisterSpec old_spec = Spec();
  old_spec.model = "old";
  auto old_pool = core_->RegisterPool(old_spec);
  ASSERT_TRUE(old_pool.ok());
  ASSERT_TRUE(Backup(Transfer(old_pool->pool_id, {Block(1, 0)})).ok());
  HIQ_ASSERT_OK(core_->ReleasePool(old_pool->pool_id));
  ASSERT_EQ(core_->Snapshot().namespaces.size(), 1u);  // kept: it holds a block
  // Another namespace needs the whole pool: the old extent yields, and the old namespace goes.
  const uint64_t fresh = Register();
  auto b = Backup(Transfer(fresh, {Block(1, 0), Block(2, 4), Block(3, 8)}));
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->results, std::vector<BlockResult>(3, BlockResult::kStored));
  CoreSnapshot snap = core_->Snapshot();
  ASSERT_EQ(snap.namespaces.size(), 1u);
  EXPECT_NE(snap.namespaces[0].namespace_id, old_pool->namespace_id);
  EXPECT_EQ(obs.removed(), std::vector<std::string>{old_pool->namespace_id});
}

}  // namespace
}  // namespace hiqcache::server
