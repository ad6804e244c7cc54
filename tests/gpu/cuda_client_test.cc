// The CUDA backend end to end, with real processes (label gpu; skips, with the reason, where no
// CUDA device is usable).
//
// The test process starts the real hiqcached with --device cuda and re-executes this binary as
// client processes (gtest filter CudaClientChild.*, which skip unless HIQ_GPU_CHILD_TARGET is
// set). A client cudaMallocs a Qwen3-8B-shaped KV pool (36 layers, 8 KV heads, head_dim 128,
// BF16, 4,096 slots), fills it with a deterministic pattern, registers it through CUDA IPC
// (hiqcache/cuda_export.h) with CudaTicketSlots, backs up 64 blocks of 16 tokens, overwrites the
// pool, and restores into other rows with per-layer ticket slots; its own stream waits on each
// layer's slot (StreamWait) before a kernel compares that layer bit for bit with the CPU
// executor's decode of the same records (kernels::CpuCodec encode, DecodeBlocksReference
// decode). It then gathers every restored element and checks it on the host against the
// docs/design.md bound and against the CPU decode, and checks that rows outside the restore kept
// their sentinel.
//
//   RoundTrip          one client: sync restore + stream waits, then an asynchronous restore
//                      whose layer slots a stream waits on while the daemon writes.
//   Int4KiviRoundTrip  the same with CODEC_INT4_KIVI (its K-plane and V-row kernels): bit-equal
//                      to the CPU executor's records decoded by the reference (its bound is
//                      codec_cpu_kivi_test's).
//   Int4HadamardRoundTrip  the same with CODEC_INT4_HADAMARD (its rotated-row and INT8 first-row
//                      kernels; its bound is codec_cpu_hadamard_test's).
//   SharedBetweenTwo   one client backs up and exits; another (its pool carved out of one
//                      allocation) restores the blocks and checks them.
//   ClientKilled       a client is SIGKILLed while restores run: the daemon survives, drops the
//                      pool within 1 s, and still serves a new CUDA client.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
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
#include "codec_cpu.h"
#include "codec_reference.h"
#include "cuda_handles.h"
#include "cuda_runtime_check.h"
#include "gpu_daemon_process.h"
#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/cuda_export.h"
#include "kernels/codec_test_util.h"
#include "kv_check.h"

namespace hiqcache {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint32_t kLayers = 36, kHeads = 8, kDim = 128;
constexpr uint32_t kSlots = 4096, kBlockTokens = 16, kBlocks = 64;
constexpr uint32_t kTokens = kBlocks * kBlockTokens;  // 1,024
constexpr uint32_t kRowElems = kHeads * kDim;
constexpr uint32_t kDoneSlot = kLayers, kNumSlots = kLayers + 2;
constexpr const char* kModel = "Qwen/Qwen3-8B@hiq-gpu-client-test";

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

Geometry Qwen3() {
  Geometry g;
  g.num_layers = kLayers;
  g.num_kv_heads = kHeads;
  g.head_dim = kDim;
  return g;
}

// Token i of the backed-up prefix lives in SrcRow(i) and is restored into DstRow(i) (both
// permutations of the slots: the kernels must follow the row lists).
uint32_t SrcRow(uint32_t i) { return (i * 1237u + 11u) % kSlots; }
uint32_t DstRow(uint32_t i) { return (i * 2011u + 5u) % kSlots; }

std::vector<uint32_t> Rows(uint32_t (*f)(uint32_t)) {
  std::vector<uint32_t> rows(kTokens);
  for (uint32_t i = 0; i < kTokens; ++i) rows[i] = f(i);
  return rows;
}

std::vector<BlockKey> Keys(uint64_t seed) {
  std::vector<uint32_t> tokens(kTokens);
  for (uint32_t i = 0; i < kTokens; ++i) tokens[i] = i * 31 + 7;
  return ComputeBlockKeys(tokens, kBlockTokens, "seed-" + std::to_string(seed));
}

// Tensor index of (layer, plane) in a pool made by CudaKvPool::Allocate (K, then V, per layer)
// and element index of (row, head, d) in it: PatternBf16's coordinates.
uint32_t TensorOf(uint32_t l, uint32_t p) { return l * 2 + p; }
uint64_t ElementOf(uint32_t row, uint32_t h, uint32_t d) {
  return (uint64_t{row} * kHeads + h) * kDim + d;
}

kernels::BlockLayout Layout(kernels::CodecKind codec = kernels::CodecKind::kInt8PerHead) {
  kernels::BlockLayout lay;
  lay.row.num_heads = kHeads;
  lay.row.head_dim = kDim;
  lay.row.dtype = kernels::DType::kBF16;
  lay.row.codec = codec;
  lay.num_layers = kLayers;
  lay.kv_planes = 2;
  lay.block_tokens = kBlockTokens;
  return lay;
}

// What a correct restore of data set `seed` writes, computed on the CPU alone: the pattern's
// inputs for the backed-up tokens, their CPU encode (CpuCodec), and the reference decode of
// those records. Arrays are [layer][plane][token][head][dim].
struct Reference {
  explicit Reference(kernels::CodecKind c = kernels::CodecKind::kInt8PerHead)
      : codec(c), payloads(Layout(c), kBlocks) {}

  kernels::CodecKind codec;
  std::vector<uint16_t> input;
  std::vector<uint16_t> decoded;
  kernels::testutil::BlockSet payloads;

  size_t Offset(uint32_t l, uint32_t p, uint32_t token) const {
    return ((size_t{l} * 2 + p) * kTokens + token) * kRowElems;
  }
};

std::vector<kernels::LayerViews> CompactViews(std::vector<uint16_t>& data) {
  std::vector<kernels::LayerViews> views(kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t p = 0; p < 2; ++p) {
      kernels::StridedView& v = views[l].planes[p];
      v.base = reinterpret_cast<uint8_t*>(data.data() + (size_t{l} * 2 + p) * kTokens * kRowElems);
      v.row_stride = kRowElems * 2;
      v.head_stride = kDim * 2;
      v.num_rows = kTokens;
    }
  }
  return views;
}

void MakeReference(uint64_t seed, Reference* ref) {
  const size_t n = size_t{kLayers} * 2 * kTokens * kRowElems;
  ref->input.resize(n);
  ref->decoded.assign(n, 0xFFFF);
  for (uint32_t l = 0; l < kLayers; ++l)
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t t = 0; t < kTokens; ++t)
        for (uint32_t h = 0; h < kHeads; ++h)
          for (uint32_t d = 0; d < kDim; ++d) {
            ref->input[ref->Offset(l, p, t) + h * kDim + d] =
                gputest::PatternBf16(seed, TensorOf(l, p), ElementOf(SrcRow(t), h, d));
          }
  std::vector<uint32_t> rows(kTokens);
  for (uint32_t t = 0; t < kTokens; ++t) rows[t] = t;
  std::vector<kernels::LayerViews> in_views = CompactViews(ref->input);
  std::vector<uint8_t> nonfinite(kBlocks, 0);
  kernels::EncodeJob enc;
  enc.layout = Layout(ref->codec);
  enc.layers = in_views.data();
  enc.rows = rows.data();
  enc.blocks = ref->payloads.ptrs();
  enc.num_blocks = kBlocks;
  enc.nonfinite = nonfinite.data();
  kernels::CpuCodec codec(0);
  codec.Encode(enc);
  for (uint8_t f : nonfinite) ASSERT_EQ(f, 0);
  std::vector<kernels::LayerViews> out_views = CompactViews(ref->decoded);
  std::vector<const uint8_t*> blocks(ref->payloads.ptrs(), ref->payloads.ptrs() + kBlocks);
  kernels::DecodeJob dec;
  dec.layout = Layout(ref->codec);
  dec.layers = out_views.data();
  dec.rows = rows.data();
  dec.blocks = blocks.data();
  dec.num_blocks = kBlocks;
  kernels::DecodeBlocksReference(dec);
}

// Checks restored plane (l, p) of the backed-up tokens ([token][head][dim] in `got`) against
// the reference: rows differing from the CPU decode are counted in *differ, elements against
// the docs/design.md bound (with the scales of the CPU-encoded records; INT8 only) in *bound.
void CheckRestoredPlane(const Reference& ref, uint32_t l, uint32_t p, const uint16_t* got,
                        kernels::testutil::BoundStats* bound, uint64_t* differ) {
  const kernels::BlockLayout lay = Layout(ref.codec);
  for (uint32_t t = 0; t < kTokens; ++t) {
    const uint16_t* in = ref.input.data() + ref.Offset(l, p, t);
    const uint16_t* want = ref.decoded.data() + ref.Offset(l, p, t);
    const uint16_t* out = got + size_t{t} * kRowElems;
    *differ += std::memcmp(want, out, kRowElems * 2) != 0;
    if (ref.codec != kernels::CodecKind::kInt8PerHead) continue;
    const uint8_t* in_heads[kHeads];
    const uint8_t* out_heads[kHeads];
    for (uint32_t h = 0; h < kHeads; ++h) {
      in_heads[h] = reinterpret_cast<const uint8_t*>(in + h * kDim);
      out_heads[h] = reinterpret_cast<const uint8_t*>(out + h * kDim);
    }
    const uint32_t b = t / kBlockTokens;
    kernels::testutil::CheckRowBound(lay.row, in_heads, out_heads,
                                     ref.payloads[b].data() + lay.RowOffset(l, p, t % kBlockTokens),
                                     bound);
  }
}

// The reference itself, without a GPU: the pattern is finite, the CPU decode meets the bound,
// and the check is not vacuous (some elements use most of their error budget).
TEST(CudaClientHost, ReferenceMeetsTheBound) {
  Reference ref;
  ASSERT_NO_FATAL_FAILURE(MakeReference(5, &ref));
  kernels::testutil::BoundStats bound;
  uint64_t differ = 0;
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t p = 0; p < 2; ++p) {
      CheckRestoredPlane(ref, l, p, ref.decoded.data() + ref.Offset(l, p, 0), &bound, &differ);
    }
  }
  EXPECT_EQ(differ, 0u);
  EXPECT_EQ(bound.elements, uint64_t{kLayers} * 2 * kTokens * kRowElems);
  EXPECT_EQ(bound.violations, 0u) << bound.first_violation;
  EXPECT_GT(bound.max_err_over_s, 0.4);
  // Zero heads restore as exact zeros; other heads vary in magnitude.
  uint64_t zeros = 0;
  for (uint16_t v : ref.decoded) zeros += v == 0;
  EXPECT_GT(zeros, 0u);
  // Source and destination rows are permutations (distinct slots).
  std::vector<bool> src(kSlots), dst(kSlots);
  for (uint32_t i = 0; i < kTokens; ++i) {
    ASSERT_FALSE(src[SrcRow(i)]);
    ASSERT_FALSE(dst[DstRow(i)]);
    src[SrcRow(i)] = dst[DstRow(i)] = true;
  }
}

kernels::StridedView DeviceView(const CudaKvPool& kv, uint32_t l, uint32_t p) {
  kernels::StridedView v;
  v.base = reinterpret_cast<uint8_t*>(kv.Head(l, p, 0, 0));
  v.row_stride = kRowElems * 2;
  v.head_stride = kDim * 2;
  v.num_rows = kSlots;
  return v;
}

// ---------------------------------------------------------------------------------------------
// The client process.

using gpu_test::ChildEnv;
using gpu_test::GetChildEnv;
using gpu_test::Touch;

// Everything a client process holds.
class GpuClient {
 public:
  // `one_allocation`: carve every K and V tensor out of one cudaMalloc (as a caching allocator
  // does; the registration then names one buffer) instead of one allocation per tensor.
  void Init(const ChildEnv& env, bool one_allocation, Codec codec = Codec::kInt8PerHead) {
    env_ = env;
    std::string why;
    ASSERT_TRUE(CudaClientAvailable(&why)) << why;
    HIQ_ASSERT_CUDA(cudaSetDevice(0));
    const Geometry g = Qwen3();
    if (one_allocation) {
      const uint64_t t = SlotMajorBytes(g, kSlots);
      HIQ_ASSERT_CUDA(cudaMalloc(&slab_, t * 2 * kLayers + 4096));
      std::vector<void*> k, v;
      for (uint32_t l = 0; l < kLayers; ++l) {
        // Interleaved and offset by 4 KiB, so offsets from the base are not the tensor order.
        k.push_back(static_cast<uint8_t*>(slab_) + 4096 + (2 * l + 1) * t);
        v.push_back(static_cast<uint8_t*>(slab_) + 4096 + (2 * l) * t);
      }
      auto pool = CudaKvPool::Sglang(g, kSlots, k, v);
      HIQ_ASSERT_OK(pool.status());
      kv_ = std::move(pool).value();
      ASSERT_EQ(kv_.buffers().size(), 1u) << "tensors of one allocation must share a buffer";
    } else {
      auto pool = CudaKvPool::Allocate(0, g, KvLayout::kSglang, kSlots);
      HIQ_ASSERT_OK(pool.status());
      kv_ = std::move(pool).value();
      ASSERT_EQ(kv_.buffers().size(), size_t{2} * kLayers);
    }
    ASSERT_EQ(kv_.device_uuid().rfind("GPU-", 0), 0u) << kv_.device_uuid();
    auto slots = CudaTicketSlots::Create(0, kNumSlots);
    HIQ_ASSERT_OK(slots.status());
    slots_ = std::move(slots).value();
    auto stream = kernels::CudaStream::Create(0);
    HIQ_ASSERT_OK(stream.status());
    stream_ = std::move(stream).value();

    ClientOptions options;
    options.target = env.target;
    options.call_timeout = milliseconds(20000);
    auto client = Client::Connect(options);
    HIQ_ASSERT_OK(client.status());
    client_ = std::move(client).value();
    auto handle =
        client_->RegisterPool(MakeCudaPoolSpec(kModel, kv_, kBlockTokens, &slots_, codec));
    HIQ_ASSERT_OK(handle.status());
    pool_ = *handle;
    keys_ = Keys(env.seed);
    src_rows_ = Rows(SrcRow);
    dst_rows_ = Rows(DstRow);
  }

  void Fill() {
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        HIQ_ASSERT_OK(gputest::LaunchFillPattern(kv_.Head(l, p, 0, 0), uint64_t{kSlots} * kRowElems,
                                                 env_.seed, TensorOf(l, p), stream_.get()));
      }
    }
    HIQ_ASSERT_OK(stream_.Synchronize());
  }

  // Every KV element = 0xFFFF (a NaN the codec never writes).
  void Overwrite() {
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        HIQ_ASSERT_CUDA(cudaMemsetAsync(kv_.Head(l, p, 0, 0), 0xFF, size_t{kSlots} * kRowElems * 2,
                                        stream_.get()));
      }
    }
    HIQ_ASSERT_OK(stream_.Synchronize());
  }

  void Backup() {
    BackupOptions o;
    o.sync = true;
    BackupResult r = client_->Backup(pool_, keys_, src_rows_, o);
    HIQ_ASSERT_OK(r.status);
    for (uint32_t b = 0; b < kBlocks; ++b) {
      ASSERT_EQ(r.blocks[b], BlockStatus::kStored) << "block " << b;
    }
  }

  // Uploads the reference decode and the destination rows for the compare kernel.
  void UploadExpected(const Reference& ref) {
    auto expected = kernels::DeviceBuffer::Create(0, ref.decoded.size() * 2);
    HIQ_ASSERT_OK(expected.status());
    expected_ = std::move(expected).value();
    HIQ_ASSERT_CUDA(cudaMemcpy(expected_.data(), ref.decoded.data(), ref.decoded.size() * 2,
                               cudaMemcpyHostToDevice));
    auto rows = kernels::DeviceBuffer::Create(0, kTokens * 4);
    HIQ_ASSERT_OK(rows.status());
    dev_rows_ = std::move(rows).value();
    HIQ_ASSERT_CUDA(
        cudaMemcpy(dev_rows_.data(), dst_rows_.data(), kTokens * 4, cudaMemcpyHostToDevice));
    auto counters = kernels::DeviceBuffer::Create(0, kLayers * 2 * 8);
    HIQ_ASSERT_OK(counters.status());
    mismatches_ = std::move(counters).value();
  }

  // Enqueues the compare kernel of both planes of layer `l` on `stream`.
  void EnqueueCompare(const Reference& ref, uint32_t l, CUstream_st* stream) {
    for (uint32_t p = 0; p < 2; ++p) {
      HIQ_ASSERT_OK(gputest::LaunchCompareRows(
          DeviceView(kv_, l, p), reinterpret_cast<const uint32_t*>(dev_rows_.data()), kTokens,
          kHeads, kDim, reinterpret_cast<const uint16_t*>(expected_.data()) + ref.Offset(l, p, 0),
          reinterpret_cast<unsigned long long*>(mismatches_.data()) + l * 2 + p, stream));
    }
  }

  void ExpectNoMismatches(const char* what) {
    std::vector<unsigned long long> counts(kLayers * 2);
    HIQ_ASSERT_CUDA(
        cudaMemcpy(counts.data(), mismatches_.data(), counts.size() * 8, cudaMemcpyDeviceToHost));
    for (uint32_t i = 0; i < counts.size(); ++i) {
      EXPECT_EQ(counts[i], 0u) << what << ": layer " << i / 2 << " plane " << i % 2 << ": "
                               << counts[i] << " elements differ from the CPU decode";
    }
    HIQ_ASSERT_CUDA(cudaMemset(mismatches_.data(), 0, mismatches_.size()));
  }

  // Restore with sync = true and layer slots: every slot holds the ticket on the reply; the
  // stream still waits on each layer's slot, then the layer is compared on the device.
  void RestoreSyncAndCompare(const Reference& ref) {
    RestoreOptions o;
    o.layer_event_base = 0;
    o.done_event = kDoneSlot;
    o.sync = true;
    RestoreResult r = client_->Restore(pool_, keys_, dst_rows_, o);
    HIQ_ASSERT_OK(r.status);
    ASSERT_EQ(r.restored_blocks, kBlocks);
    for (uint32_t l = 0; l < kLayers; ++l) {
      EXPECT_EQ(slots_.Read(l), r.ticket) << "layer " << l << " slot after a sync reply";
      HIQ_ASSERT_OK(slots_.StreamWait(stream_.get(), l, r.ticket));
      EnqueueCompare(ref, l, stream_.get());
    }
    EXPECT_EQ(slots_.Read(kDoneSlot), r.ticket);
    HIQ_ASSERT_OK(slots_.StreamWait(stream_.get(), kDoneSlot, r.ticket));
    HIQ_ASSERT_OK(stream_.Synchronize());
    ExpectNoMismatches("sync restore");
  }

  // Restore with sync = false. Right after the reply (ticket T) a checking stream waits on each
  // layer's slot for T (StreamWait) and compares the layer behind that wait, while the daemon is
  // still writing later layers; the host watches the slots in layer order to time each layer.
  // Before the reply every slot holds an earlier ticket, so no wait is satisfied early.
  void RestoreAsyncAndCompare(const Reference& ref, std::vector<double>* layer_ms) {
    RestoreOptions o;
    o.layer_event_base = 0;
    o.done_event = kDoneSlot;
    o.sync = false;
    const auto start = Clock::now();
    RestoreResult r = client_->Restore(pool_, keys_, dst_rows_, o);
    HIQ_ASSERT_OK(r.status);
    ASSERT_EQ(r.restored_blocks, kBlocks);
    auto check_stream = kernels::CudaStream::Create(0);
    HIQ_ASSERT_OK(check_stream.status());
    for (uint32_t l = 0; l < kLayers; ++l) {
      HIQ_ASSERT_OK(slots_.StreamWait(check_stream->get(), l, r.ticket));
      EnqueueCompare(ref, l, check_stream->get());  // runs once layer l is complete
    }
    for (uint32_t l = 0; l < kLayers; ++l) {
      const Status s = slots_.Wait(l, r.ticket, std::chrono::seconds(20));
      ASSERT_TRUE(s.ok()) << "layer " << l << " slot: " << s.ToString();
      if (layer_ms != nullptr) {
        layer_ms->push_back(
            std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      }
    }
    HIQ_ASSERT_OK(slots_.Wait(kDoneSlot, r.ticket, std::chrono::seconds(20)));
    HIQ_ASSERT_OK(check_stream->Synchronize());
    ExpectNoMismatches("async restore");
  }

  // Gathers every restored element and checks it on the host: bit-equal to the CPU decode and
  // within the bound of the original; rows outside the restore keep the 0xFFFF sentinel.
  void CheckOnHost(const Reference& ref) {
    auto gathered = kernels::DeviceBuffer::Create(0, size_t{kTokens} * kRowElems * 2);
    HIQ_ASSERT_OK(gathered.status());
    std::vector<uint16_t> got(size_t{kTokens} * kRowElems);
    kernels::testutil::BoundStats bound;
    uint64_t differ = 0;
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        HIQ_ASSERT_OK(gputest::LaunchGatherRows(
            DeviceView(kv_, l, p), reinterpret_cast<const uint32_t*>(dev_rows_.data()), kTokens,
            kHeads, kDim, reinterpret_cast<uint16_t*>(gathered->data()), stream_.get()));
        HIQ_ASSERT_OK(stream_.Synchronize());
        HIQ_ASSERT_CUDA(
            cudaMemcpy(got.data(), gathered->data(), got.size() * 2, cudaMemcpyDeviceToHost));
        CheckRestoredPlane(ref, l, p, got.data(), &bound, &differ);
      }
    }
    EXPECT_EQ(differ, 0u) << "restored rows differing from the CPU executor's decode";
    if (ref.codec == kernels::CodecKind::kInt8PerHead) {
      EXPECT_EQ(bound.elements, uint64_t{kLayers} * 2 * kTokens * kRowElems);
      EXPECT_EQ(bound.violations, 0u) << bound.first_violation;
      EXPECT_GT(bound.max_err_over_s, 0.4);  // the check is not vacuous
    }
    // Rows not restored: the first and last layers, every element still 0xFFFF.
    std::vector<bool> restored(kSlots, false);
    for (uint32_t r : dst_rows_) restored[r] = true;
    std::vector<uint16_t> plane(size_t{kSlots} * kRowElems);
    for (uint32_t l : {0u, kLayers - 1}) {
      for (uint32_t p = 0; p < 2; ++p) {
        HIQ_ASSERT_CUDA(cudaMemcpy(plane.data(), kv_.Head(l, p, 0, 0), plane.size() * 2,
                                   cudaMemcpyDeviceToHost));
        uint64_t touched = 0;
        for (uint32_t r = 0; r < kSlots; ++r) {
          if (restored[r]) continue;
          for (uint32_t i = 0; i < kRowElems; ++i)
            touched += plane[size_t{r} * kRowElems + i] != 0xFFFF;
        }
        EXPECT_EQ(touched, 0u) << "layer " << l << " plane " << p
                               << ": elements outside the restored rows were written";
      }
    }
  }

  Client& client() { return *client_; }
  PoolHandle pool() const { return pool_; }
  const std::vector<BlockKey>& keys() const { return keys_; }
  const std::vector<uint32_t>& dst_rows() const { return dst_rows_; }

  void Release() {
    if (client_ && pool_.valid()) HIQ_ASSERT_OK(client_->ReleasePool(pool_));
    pool_ = {};
  }
  ~GpuClient() {
    if (slab_ != nullptr) cudaFree(slab_);
  }

 private:
  ChildEnv env_;
  void* slab_ = nullptr;
  CudaKvPool kv_;
  CudaTicketSlots slots_;
  kernels::CudaStream stream_;
  std::unique_ptr<Client> client_;
  PoolHandle pool_;
  std::vector<BlockKey> keys_;
  std::vector<uint32_t> src_rows_, dst_rows_;
  kernels::DeviceBuffer expected_, dev_rows_, mismatches_;
};

#define HIQ_CHILD_PRELUDE(env)        \
  const ChildEnv env = GetChildEnv(); \
  if (!env.ok) GTEST_SKIP() << "runs only as a client process of CudaClientGpu.*";

// Backup, Lookup, then a sync and an asynchronous (per-layer ticket) restore of `codec`, each
// compared with the reference on the device and on the host; touches `ok_file` when all held.
// `layer_ms`, when given, gets each layer's ready time of the asynchronous restore.
void RoundTripAs(const ChildEnv& env, Codec codec, std::vector<double>* layer_ms,
                 const std::string& ok_file) {
  Reference ref(static_cast<kernels::CodecKind>(codec));  // numbered as the wire codec
  ASSERT_NO_FATAL_FAILURE(MakeReference(env.seed, &ref));
  GpuClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, /*one_allocation=*/false, codec));
  ASSERT_NO_FATAL_FAILURE(c.Fill());
  ASSERT_NO_FATAL_FAILURE(c.Backup());
  LookupResult lookup = c.client().Lookup(c.pool(), c.keys());
  HIQ_ASSERT_OK(lookup.status);
  EXPECT_EQ(lookup.prefix_blocks, kBlocks);
  ASSERT_NO_FATAL_FAILURE(c.UploadExpected(ref));
  ASSERT_NO_FATAL_FAILURE(c.Overwrite());
  ASSERT_NO_FATAL_FAILURE(c.RestoreSyncAndCompare(ref));
  ASSERT_NO_FATAL_FAILURE(c.CheckOnHost(ref));
  ASSERT_NO_FATAL_FAILURE(c.Overwrite());
  ASSERT_NO_FATAL_FAILURE(c.RestoreAsyncAndCompare(ref, layer_ms));
  ASSERT_NO_FATAL_FAILURE(c.CheckOnHost(ref));
  c.Release();
  if (!::testing::Test::HasFailure()) Touch(env.dir + "/" + ok_file);
}

TEST(CudaClientChild, RoundTrip) {
  HIQ_CHILD_PRELUDE(env);
  std::vector<double> layer_ms;
  ASSERT_NO_FATAL_FAILURE(RoundTripAs(env, Codec::kInt8PerHead, &layer_ms, "ok-roundtrip"));
  std::printf("async restore of %u tokens: layer 0 ready after %.2f ms, layer %u after %.2f ms\n",
              kTokens, layer_ms.front(), kLayers - 1, layer_ms.back());
}

TEST(CudaClientChild, Int4KiviRoundTrip) {
  HIQ_CHILD_PRELUDE(env);
  RoundTripAs(env, Codec::kInt4Kivi, nullptr, "ok-kivi");
}

TEST(CudaClientChild, Int4HadamardRoundTrip) {
  HIQ_CHILD_PRELUDE(env);
  RoundTripAs(env, Codec::kInt4Hadamard, nullptr, "ok-hadamard");
}

TEST(CudaClientChild, BackupOnly) {
  HIQ_CHILD_PRELUDE(env);
  GpuClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, /*one_allocation=*/false));
  ASSERT_NO_FATAL_FAILURE(c.Fill());
  ASSERT_NO_FATAL_FAILURE(c.Backup());
  c.Release();
  if (!::testing::Test::HasFailure()) Touch(env.dir + "/ok-backup-" + std::to_string(env.seed));
}

TEST(CudaClientChild, RestoreOnly) {
  HIQ_CHILD_PRELUDE(env);
  Reference ref;
  ASSERT_NO_FATAL_FAILURE(MakeReference(env.seed, &ref));
  GpuClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, /*one_allocation=*/true));
  LookupResult lookup = c.client().Lookup(c.pool(), c.keys());
  HIQ_ASSERT_OK(lookup.status);
  ASSERT_EQ(lookup.prefix_blocks, kBlocks) << "the other client's blocks are not visible";
  ASSERT_NO_FATAL_FAILURE(c.UploadExpected(ref));
  ASSERT_NO_FATAL_FAILURE(c.Overwrite());
  ASSERT_NO_FATAL_FAILURE(c.RestoreSyncAndCompare(ref));
  ASSERT_NO_FATAL_FAILURE(c.CheckOnHost(ref));
  c.Release();
  if (!::testing::Test::HasFailure()) Touch(env.dir + "/ok-restore");
}

// Backs up, says "ready", then restores (asynchronous and synchronous in turn, so that at most
// two restores are queued) until it is killed.
TEST(CudaClientChild, RestoreUntilKilled) {
  HIQ_CHILD_PRELUDE(env);
  GpuClient c;
  ASSERT_NO_FATAL_FAILURE(c.Init(env, /*one_allocation=*/false));
  ASSERT_NO_FATAL_FAILURE(c.Fill());
  ASSERT_NO_FATAL_FAILURE(c.Backup());
  RestoreOptions o;
  o.layer_event_base = 0;
  o.done_event = kDoneSlot;
  for (int i = 0; i < 100000; ++i) {
    o.sync = (i % 2) == 1;
    RestoreResult r = c.client().Restore(c.pool(), c.keys(), c.dst_rows(), o);
    HIQ_ASSERT_OK(r.status);
    if (i == 1) Touch(env.dir + "/ready");
  }
  FAIL() << "was not killed";
}

// ---------------------------------------------------------------------------------------------
// The test process.

class CudaClientGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!kernels::CudaDeviceAvailable(&why)) GTEST_SKIP() << "no usable CUDA device: " << why;
    // $HIQ_GPU_POOL_BYTES: a smaller pool where /dev/shm is small (run_on_device.sh sets it).
    const char* pool_bytes = std::getenv("HIQ_GPU_POOL_BYTES");
    daemon_ = std::make_unique<testing::DaemonProcess>(
        pool_bytes != nullptr && pool_bytes[0] != '\0' ? pool_bytes : "1GiB",
        std::vector<std::string>{"--device", "cuda"});
    ASSERT_TRUE(daemon_->Start(std::chrono::seconds(60)))
        << "hiqcached --device cuda did not start";
    dir_ = "/tmp/hiq-gpu-client-" + std::to_string(::getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::create_directories(dir_);
    auto client = Client::Connect(daemon_->target());
    HIQ_ASSERT_OK(client.status());
    client_ = std::move(client).value();
    auto stats = client_->GetStats();
    HIQ_ASSERT_OK(stats.status());
    ASSERT_EQ(stats->device, "cuda");
  }
  void TearDown() override {
    client_.reset();
    if (daemon_) daemon_->Stop();
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  pid_t Spawn(const std::string& test, uint64_t seed) {
    gpu_test::ChildEnv env{daemon_->target(), dir_, "", seed};
    return gpu_test::SpawnSelf("CudaClientChild." + test, env.Vars());
  }

  // The child's exit status (-1 on timeout, after killing it).
  static int Wait(pid_t pid, std::chrono::seconds timeout) {
    return gpu_test::WaitChild(pid, timeout);
  }

  void RunChild(const std::string& test, uint64_t seed, const std::string& marker) {
    const pid_t pid = Spawn(test, seed);
    ASSERT_GT(pid, 0);
    EXPECT_EQ(Wait(pid, std::chrono::seconds(120)), 0) << "client process " << test << " failed";
    EXPECT_TRUE(std::filesystem::exists(dir_ + "/" + marker))
        << "client process " << test << " did not complete (skipped?)";
  }

  bool DaemonAlive() const { return gpu_test::ChildAlive(daemon_->pid()); }

  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  std::string dir_;
};

TEST_F(CudaClientGpu, RoundTrip) { RunChild("RoundTrip", 11, "ok-roundtrip"); }

TEST_F(CudaClientGpu, Int4KiviRoundTrip) { RunChild("Int4KiviRoundTrip", 55, "ok-kivi"); }

TEST_F(CudaClientGpu, Int4HadamardRoundTrip) {
  RunChild("Int4HadamardRoundTrip", 66, "ok-hadamard");
}

TEST_F(CudaClientGpu, SharedBetweenTwoClients) {
  RunChild("BackupOnly", 22, "ok-backup-22");
  auto stats = client_->GetStats();
  HIQ_ASSERT_OK(stats.status());
  EXPECT_EQ(stats->blocks, kBlocks);
  EXPECT_TRUE(stats->pools.empty()) << "the first client released its pool";
  RunChild("RestoreOnly", 22, "ok-restore");
}

TEST_F(CudaClientGpu, ClientKilledMidRestore) {
  const pid_t pid = Spawn("RestoreUntilKilled", 33);
  ASSERT_GT(pid, 0);
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (!std::filesystem::exists(dir_ + "/ready") && Clock::now() < deadline) {
    int status;
    ASSERT_NE(::waitpid(pid, &status, WNOHANG), pid) << "client exited before it was killed";
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/ready"));
  std::this_thread::sleep_for(milliseconds(50));
  auto before = client_->GetStats();
  HIQ_ASSERT_OK(before.status());
  bool had_pool = false;
  for (const PoolStats& p : before->pools) had_pool |= p.client_pid == static_cast<uint32_t>(pid);
  EXPECT_TRUE(had_pool);

  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  int status;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const auto killed = Clock::now();
  bool gone = false;
  double elapsed_ms = 0;
  while (!gone && Clock::now() - killed < std::chrono::seconds(5)) {
    auto stats = client_->GetStats();
    ASSERT_TRUE(stats.ok()) << "the daemon stopped answering after the client died: "
                            << stats.status().ToString();
    gone = true;
    for (const PoolStats& p : stats->pools) gone &= p.client_pid != static_cast<uint32_t>(pid);
    elapsed_ms = std::chrono::duration<double, std::milli>(Clock::now() - killed).count();
    if (!gone) std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_TRUE(gone) << "the dead client's pool is still registered after 5 s";
  EXPECT_LE(elapsed_ms, 1000.0) << "the dead client's pool was released after " << elapsed_ms
                                << " ms";
  std::printf("pool of the killed client released %.0f ms after its death\n", elapsed_ms);
  EXPECT_TRUE(DaemonAlive());
  auto after = client_->GetStats();
  HIQ_ASSERT_OK(after.status());
  EXPECT_GE(after->blocks, kBlocks);  // the completed backup survived
  // The daemon's CUDA state is intact: a new client backs up through it.
  RunChild("BackupOnly", 44, "ok-backup-44");
  EXPECT_TRUE(DaemonAlive());
}

}  // namespace
}  // namespace hiqcache
