// Tests of the CUDA executor (kernels/cuda/codec_cuda.h) and the CUDA handle owners
// (kernels/cuda/cuda_handles.h).
//
// The kernels must produce exactly the bytes of the scalar reference and the SIMD CPU executor
// on the same input, write nothing but the requested rows (decode) or block payloads (encode),
// and flag non-finite blocks. Tests that need a GPU skip, with the reason, where none is visible;
// the CodecCudaHost tests (index arithmetic, launcher validation, the runtime check) run anywhere.
#include "codec_cuda.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "child_process.h"
#include "codec_cpu.h"
#include "codec_reference.h"
#include "cuda_handles.h"
#include "cuda_runtime_check.h"
#include "kernels/codec_cuda_cases.h"
#include "kernels/codec_test_util.h"

namespace hiqcache::kernels {
namespace {

using testutil::BlockSet;
using testutil::FirstBufferDiff;
using testutil::FirstPayloadDiff;
using testutil::InputClass;
using testutil::KvPool;
using testutil::MakeLayout;
using testutil::Rng;
using testutil::ViewKind;

#define HIQ_ASSERT_OK(expr)                                         \
  do {                                                              \
    const ::hiqcache::Status hiq_s_ = (expr);                       \
    ASSERT_TRUE(hiq_s_.ok()) << #expr << ": " << hiq_s_.ToString(); \
  } while (0)

#define HIQ_RETURN_IF_CUDA(expr)                                                           \
  do {                                                                                     \
    const cudaError_t hiq_e_ = (expr);                                                     \
    if (hiq_e_ != cudaSuccess) {                                                           \
      return ::hiqcache::Internal(std::string(#expr) + ": " + cudaGetErrorString(hiq_e_)); \
    }                                                                                      \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Host-only tests: run without a GPU.

TEST(CodecCudaHost, FastDivmodIsExact) {
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 1100; ++d) divisors.push_back(d);
  for (uint32_t k = 11; k < 31; ++k) {
    divisors.push_back((1u << k) - 1);
    divisors.push_back(1u << k);
    divisors.push_back((1u << k) + 1);
  }
  divisors.push_back(0x7FFFFFFFu);
  Rng rng(7);
  for (int i = 0; i < 200; ++i) divisors.push_back(1 + (static_cast<uint32_t>(rng.Next()) >> 1));
  for (uint32_t d : divisors) {
    const cuda_detail::FastDivmod f = cuda_detail::FastDivmod::Make(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 0x7FFFFFFFu, 0x7FFFFFFEu};
    for (uint32_t k : {2u, 3u, 7u, 1000u}) {
      const uint64_t m = uint64_t{k} * d;
      if (m < 0x80000000ull) {
        ns.push_back(static_cast<uint32_t>(m - 1));
        ns.push_back(static_cast<uint32_t>(m));
      }
    }
    for (int i = 0; i < 64; ++i) ns.push_back(static_cast<uint32_t>(rng.Next()) >> 1);
    for (uint32_t n : ns) {
      if (n > 0x7FFFFFFFu) continue;
      uint32_t r = 0;
      const uint32_t q = f.DivMod(n, &r);
      ASSERT_EQ(q, n / d) << "n=" << n << " d=" << d;
      ASSERT_EQ(r, n % d) << "n=" << n << " d=" << d;
    }
  }
}

TEST(CodecCudaHost, UnitShapeDecomposesInPayloadOrder) {
  const uint32_t H = 8, T = 16, P = 2, L = 36;
  const auto shape = cuda_detail::UnitShape::Make(H, T, P, L);
  Rng rng(3);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t b = rng.Below(5000), l = rng.Below(L), p = rng.Below(P), t = rng.Below(T),
                   h = rng.Below(H);
    const uint32_t u = (((b * L + l) * P + p) * T + t) * H + h;
    uint32_t b2, l2, p2, t2, h2;
    shape.Decompose(u, &b2, &l2, &p2, &t2, &h2);
    ASSERT_EQ(b, b2);
    ASSERT_EQ(l, l2);
    ASSERT_EQ(p, p2);
    ASSERT_EQ(t, t2);
    ASSERT_EQ(h, h2);
  }
}

TEST(CodecCudaHost, PlanGroupsCoversEveryElement) {
  using cuda_detail::PlanGroups;
  EXPECT_EQ(PlanGroups(128).group_lanes, 16u);
  EXPECT_EQ(PlanGroups(128).chunks_per_lane, 1u);
  EXPECT_EQ(PlanGroups(64).group_lanes, 8u);
  EXPECT_EQ(PlanGroups(576).group_lanes, 32u);
  EXPECT_EQ(PlanGroups(576).chunks_per_lane, 4u);
  EXPECT_EQ(PlanGroups(0).group_lanes, 0u);
  EXPECT_EQ(PlanGroups(cuda_detail::kMaxHeadDim + 1).group_lanes, 0u);
  for (uint32_t d = 1; d <= cuda_detail::kMaxHeadDim; ++d) {
    const auto plan = PlanGroups(d);
    ASSERT_GE(plan.group_lanes, 1u);
    ASSERT_LE(plan.group_lanes, 32u);
    ASSERT_EQ(plan.group_lanes & (plan.group_lanes - 1), 0u);
    ASSERT_TRUE(plan.chunks_per_lane == 1 || plan.chunks_per_lane == 2 ||
                plan.chunks_per_lane == 4 || plan.chunks_per_lane == 8)
        << d;
    ASSERT_GE(plan.group_lanes * plan.chunks_per_lane * cuda_detail::kChunkElems, d) << d;
  }
}

// Shape validation happens before any CUDA call, so it is checked without a device.
TEST(CodecCudaHost, LaunchersRejectMalformedShapes) {
  EncodeJob enc;
  enc.layout = MakeLayout(DType::kBF16, CodecKind::kInt8PerHead, 8, 128, 4, 2, 16);
  enc.num_blocks = 0;
  EXPECT_TRUE(LaunchEncode(enc, nullptr).ok());  // nothing to do

  EncodeJob bad = enc;
  bad.layout.row.head_dim = 0;
  EXPECT_EQ(LaunchEncode(bad, nullptr).code(), StatusCode::kInvalidArgument);
  bad = enc;
  bad.layout.row.head_dim = cuda_detail::kMaxHeadDim + 1;
  EXPECT_EQ(LaunchEncode(bad, nullptr).code(), StatusCode::kInvalidArgument);
  bad = enc;
  bad.layout.kv_planes = 3;
  EXPECT_EQ(LaunchEncode(bad, nullptr).code(), StatusCode::kInvalidArgument);
  bad = enc;
  bad.layout.block_tokens = 0;
  EXPECT_EQ(LaunchEncode(bad, nullptr).code(), StatusCode::kInvalidArgument);
  bad = enc;
  bad.num_blocks = 2;  // arrays missing
  EXPECT_EQ(LaunchEncode(bad, nullptr).code(), StatusCode::kInvalidArgument);
  CudaLaunchConfig cfg;
  cfg.threads_per_cta = 48;
  EXPECT_EQ(LaunchEncode(enc, nullptr, cfg).code(), StatusCode::kInvalidArgument);

  DecodeJob dec;
  dec.layout = enc.layout;
  EXPECT_TRUE(LaunchDecodeLayer(dec, 3, nullptr).ok());
  EXPECT_EQ(LaunchDecodeLayer(dec, 4, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchDecodeLayers(dec, 2, 3, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchDecodeLayers(dec, 0, 0, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(LaunchDecode(dec, nullptr).ok());

  // CODEC_INT4_KIVI takes INT4's geometry rules.
  bad = enc;
  bad.layout.row.codec = CodecKind::kInt4Kivi;
  EXPECT_TRUE(LaunchEncode(bad, nullptr).ok());
  bad.layout.row.head_dim = 48;
  EXPECT_EQ(LaunchEncode(bad, nullptr).code(), StatusCode::kInvalidArgument);
  // So does CODEC_INT4_HADAMARD.
  bad = enc;
  bad.layout.row.codec = CodecKind::kInt4Hadamard;
  EXPECT_TRUE(LaunchEncode(bad, nullptr).ok());
  bad.layout.row.head_dim = 48;
  EXPECT_EQ(LaunchEncode(bad, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST(CodecCudaHost, JobArraysBytes) {
  // 3 LayerViews, 5 block pointers, 5*16 rows; each array 16-byte aligned. INT5 allot adds its
  // RoPE table: 16 tokens x 128 / 2 pairs, cosines and sines.
  const size_t views = (3 * sizeof(LayerViews) + 15) / 16 * 16;
  BlockLayout lay = testutil::MakeLayout(DType::kBF16, CodecKind::kInt8PerHead, 8, 128, 3, 2, 16);
  EXPECT_EQ(JobArraysBytes(lay, 5), views + 48 + 320);
  lay.row.codec = CodecKind::kInt5Allot;
  EXPECT_EQ(JobArraysBytes(lay, 5), views + 48 + 320 + 16 * 128 * 4);
}

TEST(CodecCudaHost, RuntimeCheckAnswersWithoutCrashing) {
  std::string why1, why2;
  const bool a = CudaDeviceAvailable(&why1);
  const bool b = CudaDeviceAvailable(&why2);
  EXPECT_EQ(a, b);
  EXPECT_TRUE(CudaDeviceAvailable(nullptr) == a);
  if (!a) {
    EXPECT_FALSE(why1.empty());
    std::printf("CUDA unavailable here: %s\n", why1.c_str());
  }
}

// ---------------------------------------------------------------------------------------------
// Device helpers.

// A device copy of a KvPool: one device buffer per layer, views at the same offsets.
struct DevicePool {
  std::vector<DeviceBuffer> buffers;
  std::vector<LayerViews> views;  // host array of device views
};

Status MirrorPool(const KvPool& pool, DevicePool* out) {
  const BlockLayout& lay = pool.layout();
  out->buffers.clear();
  out->views.assign(lay.num_layers, LayerViews{});
  for (uint32_t l = 0; l < lay.num_layers; ++l) {
    const std::vector<uint8_t>& host = pool.buffer(l);
    HIQ_ASSIGN_OR_RETURN(DeviceBuffer buf, DeviceBuffer::Create(0, host.size()));
    HIQ_RETURN_IF_CUDA(cudaMemcpy(buf.data(), host.data(), host.size(), cudaMemcpyHostToDevice));
    for (uint32_t p = 0; p < lay.kv_planes; ++p) {
      StridedView v = pool.view(l, p);
      v.base = buf.data() + (v.base - host.data());
      out->views[l].planes[p] = v;
    }
    out->buffers.push_back(std::move(buf));
  }
  return Status::Ok();
}

Status DownloadPool(const DevicePool& dev, std::vector<std::vector<uint8_t>>* out) {
  out->clear();
  for (const DeviceBuffer& buf : dev.buffers) {
    std::vector<uint8_t> host(buf.size());
    HIQ_RETURN_IF_CUDA(cudaMemcpy(host.data(), buf.data(), buf.size(), cudaMemcpyDeviceToHost));
    out->push_back(std::move(host));
  }
  return Status::Ok();
}

constexpr size_t kGapBytes = 64;  // sentinel gap after each block in the staging buffer
constexpr uint8_t kStagingFill = 0xCD;

// Block b lives at slot num_blocks-1-b of a contiguous device staging buffer (so the kernel must
// follow the pointer array), each slot followed by a sentinel gap.
struct DeviceBlocks {
  DeviceBuffer staging;
  std::vector<uint8_t*> ptrs;  // device pointers, by block
  size_t slot_bytes = 0;
};

Status MakeDeviceBlocks(const BlockLayout& lay, uint32_t num_blocks, const BlockSet* init,
                        DeviceBlocks* out) {
  out->slot_bytes = lay.BlockBytes() + kGapBytes;
  HIQ_ASSIGN_OR_RETURN(out->staging, DeviceBuffer::Create(0, out->slot_bytes * num_blocks));
  HIQ_RETURN_IF_CUDA(cudaMemset(out->staging.data(), kStagingFill, out->staging.size()));
  out->ptrs.resize(num_blocks);
  for (uint32_t b = 0; b < num_blocks; ++b) {
    out->ptrs[b] = out->staging.data() + (num_blocks - 1 - b) * out->slot_bytes;
    if (init != nullptr) {
      HIQ_RETURN_IF_CUDA(
          cudaMemcpy(out->ptrs[b], (*init)[b].data(), lay.BlockBytes(), cudaMemcpyHostToDevice));
    }
  }
  return Status::Ok();
}

// Job arrays go through StageEncodeJob/StageDecodeJob with pinned host scratch, as the daemon
// does.
struct Scratch {
  PinnedHostBuffer host;
  DeviceBuffer device;
};

Status MakeScratch(const BlockLayout& lay, uint32_t num_blocks, Scratch* out) {
  const size_t bytes = JobArraysBytes(lay, num_blocks);
  HIQ_ASSIGN_OR_RETURN(out->host, PinnedHostBuffer::Create(bytes));
  HIQ_ASSIGN_OR_RETURN(out->device, DeviceBuffer::Create(0, bytes));
  return Status::Ok();
}

struct GpuEncodeResult {
  BlockSet blocks;
  std::vector<uint8_t> flags;
  bool gaps_intact = true;
  explicit GpuEncodeResult(const BlockLayout& lay, uint32_t n) : blocks(lay, n) {}
};

Status RunGpuEncode(const KvPool& pool, const std::vector<uint32_t>& rows, uint32_t num_blocks,
                    CUstream_st* stream, const CudaLaunchConfig& cfg, GpuEncodeResult* out) {
  const BlockLayout& lay = pool.layout();
  DevicePool dev;
  HIQ_RETURN_IF_ERROR(MirrorPool(pool, &dev));
  DeviceBlocks blocks;
  HIQ_RETURN_IF_ERROR(MakeDeviceBlocks(lay, num_blocks, nullptr, &blocks));
  HIQ_ASSIGN_OR_RETURN(DeviceBuffer flags, DeviceBuffer::Create(0, num_blocks));
  HIQ_RETURN_IF_CUDA(cudaMemset(flags.data(), 0x77, num_blocks));  // the launcher must clear it
  Scratch scratch;
  HIQ_RETURN_IF_ERROR(MakeScratch(lay, num_blocks, &scratch));

  EncodeJob host_job;
  host_job.layout = lay;
  host_job.layers = dev.views.data();
  host_job.rows = rows.data();
  host_job.blocks = blocks.ptrs.data();
  host_job.num_blocks = num_blocks;
  host_job.nonfinite = flags.data();
  const std::vector<float> rope = testutil::JobRope(lay);
  host_job.rope = rope.empty() ? nullptr : rope.data();
  EncodeJob job;
  HIQ_RETURN_IF_ERROR(StageEncodeJob(host_job, scratch.host.data(), scratch.device.data(),
                                     scratch.host.size(), stream, &job));
  HIQ_RETURN_IF_ERROR(LaunchEncode(job, stream, cfg));
  HIQ_RETURN_IF_CUDA(cudaStreamSynchronize(stream));

  std::vector<uint8_t> staging(blocks.staging.size());
  HIQ_RETURN_IF_CUDA(
      cudaMemcpy(staging.data(), blocks.staging.data(), staging.size(), cudaMemcpyDeviceToHost));
  for (uint32_t b = 0; b < num_blocks; ++b) {
    const size_t off = static_cast<size_t>(blocks.ptrs[b] - blocks.staging.data());
    std::memcpy(out->blocks[b].data(), staging.data() + off, lay.BlockBytes());
    for (size_t i = 0; i < kGapBytes; ++i) {
      out->gaps_intact &= staging[off + lay.BlockBytes() + i] == kStagingFill;
    }
  }
  out->flags.resize(num_blocks);
  HIQ_RETURN_IF_CUDA(
      cudaMemcpy(out->flags.data(), flags.data(), num_blocks, cudaMemcpyDeviceToHost));
  return Status::Ok();
}

// Decodes `payloads` into a device copy of `dest` (layers [first, first + count), or all of
// them one LaunchDecodeLayer at a time when per_layer) and returns the device buffers.
Status RunGpuDecode(const KvPool& dest, const std::vector<uint32_t>& rows, const BlockSet& payloads,
                    uint32_t first, uint32_t count, bool per_layer, CUstream_st* stream,
                    const CudaLaunchConfig& cfg, std::vector<std::vector<uint8_t>>* out) {
  const BlockLayout& lay = dest.layout();
  DevicePool dev;
  HIQ_RETURN_IF_ERROR(MirrorPool(dest, &dev));
  DeviceBlocks blocks;
  HIQ_RETURN_IF_ERROR(MakeDeviceBlocks(lay, payloads.size(), &payloads, &blocks));
  Scratch scratch;
  HIQ_RETURN_IF_ERROR(MakeScratch(lay, payloads.size(), &scratch));
  std::vector<const uint8_t*> ptrs(blocks.ptrs.begin(), blocks.ptrs.end());

  DecodeJob host_job;
  host_job.layout = lay;
  host_job.layers = dev.views.data();
  host_job.rows = rows.data();
  host_job.blocks = ptrs.data();
  host_job.num_blocks = payloads.size();
  const std::vector<float> rope = testutil::JobRope(lay);
  host_job.rope = rope.empty() ? nullptr : rope.data();
  DecodeJob job;
  HIQ_RETURN_IF_ERROR(StageDecodeJob(host_job, scratch.host.data(), scratch.device.data(),
                                     scratch.host.size(), stream, &job));
  if (per_layer) {
    for (uint32_t l = first; l < first + count; ++l) {
      HIQ_RETURN_IF_ERROR(LaunchDecodeLayer(job, l, stream, cfg));
    }
  } else {
    HIQ_RETURN_IF_ERROR(LaunchDecodeLayers(job, first, count, stream, cfg));
  }
  HIQ_RETURN_IF_CUDA(cudaStreamSynchronize(stream));
  return DownloadPool(dev, out);
}

class CudaFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaDeviceAvailable(&why)) GTEST_SKIP() << "no usable CUDA device: " << why;
    auto stream = CudaStream::Create(0);
    ASSERT_TRUE(stream.ok()) << stream.status().ToString();
    stream_ = std::move(stream).value();
  }
  CUstream_st* stream() const { return stream_.get(); }

  CudaStream stream_;
};

// ---------------------------------------------------------------------------------------------
// Byte equality with the CPU executors, per geometry and view kind.

using Case = testutil::CudaCase;

class CodecCudaTest : public CudaFixture, public ::testing::WithParamInterface<Case> {
 protected:
  void SetUp() override {
    CudaFixture::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    const Case& c = GetParam();
    layout_ = c.layout();
    num_rows_ = c.num_rows();
    rows_ = c.rows();
  }

  KvPool MakeSource() const {
    KvPool pool(layout_, num_rows_, GetParam().kind, /*seed=*/5);
    pool.Fill(InputClass::kRowMix, /*seed=*/9);
    testutil::KeepRotationsFinite(&pool);  // CODEC_INT4_HADAMARD: no block refused
    return pool;
  }
  KvPool MakeSentinelDest() const {
    KvPool pool(layout_, num_rows_, GetParam().kind, /*seed=*/5);
    pool.FillBytes(0xA5);
    return pool;
  }
  // Reference payloads of rows_ encoded from a fresh source pool.
  BlockSet ReferencePayloads() const {
    KvPool src = MakeSource();
    BlockSet ref(layout_, GetParam().num_blocks);
    std::vector<uint8_t> flags(GetParam().num_blocks, 0xEE);
    EncodeBlocksReference(testutil::MakeEncodeJob(src, rows_, ref, flags.data()));
    return ref;
  }

  BlockLayout layout_;
  uint32_t num_rows_ = 0;
  std::vector<uint32_t> rows_;
};

TEST_P(CodecCudaTest, EncodeMatchesCpuExecutors) {
  const Case& c = GetParam();
  KvPool src = MakeSource();
  BlockSet ref(layout_, c.num_blocks);
  std::vector<uint8_t> ref_flags(c.num_blocks, 0xEE);
  EncodeBlocksReference(testutil::MakeEncodeJob(src, rows_, ref, ref_flags.data()));
  BlockSet simd(layout_, c.num_blocks);
  std::vector<uint8_t> simd_flags(c.num_blocks, 0xEE);
  CpuCodec cpu(2);
  cpu.Encode(testutil::MakeEncodeJob(src, rows_, simd, simd_flags.data()));
  ASSERT_EQ(FirstPayloadDiff(layout_, ref, simd), "") << "CpuCodec disagrees with the reference";
  ASSERT_EQ(ref_flags, std::vector<uint8_t>(c.num_blocks, 0));

  GpuEncodeResult gpu(layout_, c.num_blocks);
  HIQ_ASSERT_OK(RunGpuEncode(src, rows_, c.num_blocks, stream(), {}, &gpu));
  EXPECT_EQ(FirstPayloadDiff(layout_, ref, gpu.blocks), "");
  EXPECT_EQ(gpu.flags, ref_flags);
  EXPECT_TRUE(gpu.gaps_intact) << "encode wrote past a block payload";
}

// One CTA of one warp walks every unit through the grid-stride loop: same bytes.
TEST_P(CodecCudaTest, EncodeWithOneSmallCtaMatches) {
  const Case& c = GetParam();
  KvPool src = MakeSource();
  BlockSet ref = ReferencePayloads();
  CudaLaunchConfig cfg;
  cfg.threads_per_cta = 32;
  cfg.max_ctas = 1;
  GpuEncodeResult gpu(layout_, c.num_blocks);
  HIQ_ASSERT_OK(RunGpuEncode(src, rows_, c.num_blocks, stream(), cfg, &gpu));
  EXPECT_EQ(FirstPayloadDiff(layout_, ref, gpu.blocks), "");
}

// Decode+scatter into a sentinel-filled pool writes exactly the reference's bytes: the requested
// rows, every layer, and nothing else.
TEST_P(CodecCudaTest, DecodeWritesExactlyTheRequestedRows) {
  BlockSet payloads = ReferencePayloads();
  KvPool want = MakeSentinelDest();
  DecodeBlocksReference(testutil::MakeDecodeJob(want, rows_, payloads));
  KvPool simd = MakeSentinelDest();
  CpuCodec cpu(2);
  cpu.Decode(testutil::MakeDecodeJob(simd, rows_, payloads));
  std::vector<std::vector<uint8_t>> simd_bufs;
  for (uint32_t l = 0; l < layout_.num_layers; ++l) simd_bufs.push_back(simd.buffer(l));
  ASSERT_EQ(FirstBufferDiff(want, simd_bufs), "") << "CpuCodec disagrees with the reference";

  KvPool dest = MakeSentinelDest();
  std::vector<std::vector<uint8_t>> got;
  HIQ_ASSERT_OK(
      RunGpuDecode(dest, rows_, payloads, 0, layout_.num_layers, false, stream(), {}, &got));
  EXPECT_EQ(FirstBufferDiff(want, got), "");
  // And independently of the reference: bytes outside the addressed heads keep the sentinel.
  for (uint32_t l = 0; l < layout_.num_layers; ++l) {
    const std::vector<uint8_t> mask = want.AddressedMask(l, rows_);
    size_t outside_changed = 0;
    for (size_t i = 0; i < mask.size(); ++i) outside_changed += !mask[i] && got[l][i] != 0xA5;
    EXPECT_EQ(outside_changed, 0u) << "layer " << l;
  }
}

TEST_P(CodecCudaTest, DecodeLayerWritesOnlyThatLayer) {
  BlockSet payloads = ReferencePayloads();
  const uint32_t layer = layout_.num_layers - 1;
  KvPool want = MakeSentinelDest();
  DecodeLayerReference(testutil::MakeDecodeJob(want, rows_, payloads), layer);
  KvPool dest = MakeSentinelDest();
  std::vector<std::vector<uint8_t>> got;
  HIQ_ASSERT_OK(RunGpuDecode(dest, rows_, payloads, layer, 1, true, stream(), {}, &got));
  EXPECT_EQ(FirstBufferDiff(want, got), "");
  for (uint32_t l = 0; l < layout_.num_layers; ++l) {
    if (l == layer) continue;
    EXPECT_EQ(got[l], std::vector<uint8_t>(got[l].size(), 0xA5)) << "layer " << l << " written";
  }
}

// Restore's shape: one LaunchDecodeLayer per layer, small grid.
TEST_P(CodecCudaTest, PerLayerDecodeMatchesWholeDecode) {
  BlockSet payloads = ReferencePayloads();
  KvPool want = MakeSentinelDest();
  DecodeBlocksReference(testutil::MakeDecodeJob(want, rows_, payloads));
  KvPool dest = MakeSentinelDest();
  CudaLaunchConfig cfg;
  cfg.threads_per_cta = 64;
  cfg.max_ctas = 3;
  std::vector<std::vector<uint8_t>> got;
  HIQ_ASSERT_OK(
      RunGpuDecode(dest, rows_, payloads, 0, layout_.num_layers, true, stream(), cfg, &got));
  EXPECT_EQ(FirstBufferDiff(want, got), "");
}

constexpr CodecKind kInt8 = CodecKind::kInt8PerHead;
constexpr CodecKind kKivi = CodecKind::kInt4Kivi;
constexpr CodecKind kHadamard = CodecKind::kInt4Hadamard;

INSTANTIATE_TEST_SUITE_P(Geometries, CodecCudaTest,
                         ::testing::ValuesIn(testutil::CudaGeometryCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

// ---------------------------------------------------------------------------------------------
// Every input class (zeros, subnormals, near-max, exact ties, ...) in both dtypes. INT4
// Hadamard flags the blocks whose rotation leaves fp32's range (BF16 near-max heads), as the
// reference does; the payloads of the others must match.

TEST_F(CudaFixture, EncodeMatchesReferenceForEveryInputClass) {
  for (const CodecKind codec : {kInt8, kKivi, kHadamard}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      for (InputClass cls :
           codec != kInt8 ? testutil::Int4InputClasses() : testutil::AllInputClasses()) {
        SCOPED_TRACE(std::string(testutil::CodecName(codec)) + " " + testutil::DTypeName(dtype) +
                     " " + testutil::InputClassName(cls));
        const BlockLayout lay = MakeLayout(dtype, codec, 8, 128, 2, 2, 16);
        const uint32_t num_blocks = 4;
        KvPool src(lay, 200, ViewKind::kContiguous, 1);
        src.Fill(cls, 100 + static_cast<int>(cls));
        Rng rng(static_cast<uint64_t>(cls) + 1);
        std::vector<uint32_t> rows = testutil::RandomRows(200, num_blocks * 16, rng);
        BlockSet ref(lay, num_blocks);
        std::vector<uint8_t> ref_flags(num_blocks, 0xEE);
        EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
        GpuEncodeResult gpu(lay, num_blocks);
        HIQ_ASSERT_OK(RunGpuEncode(src, rows, num_blocks, stream(), {}, &gpu));
        EXPECT_EQ(FirstPayloadDiff(lay, ref, gpu.blocks, &ref_flags), "");
        EXPECT_EQ(gpu.flags, ref_flags);

        KvPool want(lay, 200, ViewKind::kContiguous, 1);
        want.FillBytes(0xA5);
        DecodeBlocksReference(testutil::MakeDecodeJob(want, rows, ref));
        KvPool dest(lay, 200, ViewKind::kContiguous, 1);
        dest.FillBytes(0xA5);
        std::vector<std::vector<uint8_t>> got;
        HIQ_ASSERT_OK(RunGpuDecode(dest, rows, ref, 0, lay.num_layers, false, stream(), {}, &got));
        EXPECT_EQ(FirstBufferDiff(want, got), "");
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// NaN / Inf: the block is flagged, the others are encoded as the reference encodes them.

TEST_F(CudaFixture, NonfiniteBlocksAreFlagged) {
  for (const CodecKind codec : {kInt8, kKivi, kHadamard}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      SCOPED_TRACE(std::string(testutil::CodecName(codec)) + " " + testutil::DTypeName(dtype));
      const bool bf16 = dtype == DType::kBF16;
      const BlockLayout lay = MakeLayout(dtype, codec, 8, 128, 3, 2, 16);
      const uint32_t num_blocks = 6;
      KvPool src(lay, 300, ViewKind::kPaged, 2);
      src.Fill(InputClass::kGaussian, 4);
      Rng rng(5);
      std::vector<uint32_t> rows = testutil::RandomRows(300, num_blocks * 16, rng);
      // Block 1: a NaN in the last layer's V; block 3: +Inf in layer 0's K; block 4: -Inf and a
      // NaN in the last head of the last token.
      src.Head(2, 1, rows[1 * 16 + 3], 5)[17] = bf16 ? 0x7FC1 : 0x7E01;
      src.Head(0, 0, rows[3 * 16 + 0], 0)[0] = bf16 ? 0x7F80 : 0x7C00;
      src.Head(1, 1, rows[4 * 16 + 15], 7)[127] = bf16 ? 0xFF80 : 0xFC00;
      src.Head(1, 1, rows[4 * 16 + 15], 7)[3] = 0xFFFF;  // a negative NaN in either dtype

      BlockSet ref(lay, num_blocks);
      std::vector<uint8_t> ref_flags(num_blocks, 0xEE);
      EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
      ASSERT_EQ(ref_flags, (std::vector<uint8_t>{0, 1, 0, 1, 1, 0}));

      GpuEncodeResult gpu(lay, num_blocks);
      HIQ_ASSERT_OK(RunGpuEncode(src, rows, num_blocks, stream(), {}, &gpu));
      EXPECT_EQ(gpu.flags, ref_flags);
      EXPECT_EQ(FirstPayloadDiff(lay, ref, gpu.blocks, &ref_flags), "");
      EXPECT_TRUE(gpu.gaps_intact);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Handle owners.

TEST_F(CudaFixture, StreamEventAndBuffersWork) {
  auto buf = DeviceBuffer::Create(0, 1 << 20);
  ASSERT_TRUE(buf.ok()) << buf.status().ToString();
  ASSERT_EQ(cudaMemsetAsync(buf->data(), 0x3C, buf->size(), stream()), cudaSuccess);
  auto event = CudaEvent::Create(0, /*interprocess=*/false);
  ASSERT_TRUE(event.ok()) << event.status().ToString();
  HIQ_ASSERT_OK(event->Record(stream()));
  HIQ_ASSERT_OK(event->Synchronize());
  auto done = event->Query();
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);

  auto pinned = PinnedHostBuffer::Create(buf->size());
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  auto other = CudaStream::Create(0, true, 0);
  ASSERT_TRUE(other.ok());
  HIQ_ASSERT_OK(event->EnqueueWait(other->get()));
  ASSERT_EQ(cudaMemcpyAsync(pinned->data(), buf->data(), buf->size(), cudaMemcpyDeviceToHost,
                            other->get()),
            cudaSuccess);
  HIQ_ASSERT_OK(other->Synchronize());
  EXPECT_EQ(pinned->data()[0], 0x3C);
  EXPECT_EQ(pinned->data()[buf->size() - 1], 0x3C);

  // Move leaves the source empty; destroying empties is a no-op.
  DeviceBuffer moved = std::move(*buf);
  EXPECT_FALSE(static_cast<bool>(*buf));
  EXPECT_TRUE(static_cast<bool>(moved));
  moved = DeviceBuffer();
  EXPECT_FALSE(static_cast<bool>(moved));
  CudaStream s = std::move(*other);
  EXPECT_EQ(other->get(), nullptr);
  s.Reset();
  s.Reset();
}

TEST_F(CudaFixture, DeviceGuardRestoresTheCurrentDevice) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  const int start = count > 1 ? 1 : 0;
  ASSERT_EQ(cudaSetDevice(start), cudaSuccess);
  {
    DeviceGuard guard(0);
    HIQ_ASSERT_OK(guard.status());
    int now = -1;
    ASSERT_EQ(cudaGetDevice(&now), cudaSuccess);
    EXPECT_EQ(now, 0);
  }
  {
    DeviceGuard bad(count + 5);
    EXPECT_FALSE(bad.status().ok());
  }
  int now = -1;
  ASSERT_EQ(cudaGetDevice(&now), cudaSuccess);
  EXPECT_EQ(now, start);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

TEST_F(CudaFixture, IpcHandlesAre64Bytes) {
  auto event = CudaEvent::Create(0, /*interprocess=*/true);
  ASSERT_TRUE(event.ok()) << event.status().ToString();
  auto eh = event->ExportIpcHandle();
  ASSERT_TRUE(eh.ok()) << eh.status().ToString();
  EXPECT_EQ(eh->size(), kCudaIpcHandleBytes);
  auto buf = DeviceBuffer::Create(0, 4096);
  ASSERT_TRUE(buf.ok());
  auto mh = buf->ExportIpcHandle();
  ASSERT_TRUE(mh.ok()) << mh.status().ToString();
  EXPECT_EQ(mh->size(), kCudaIpcHandleBytes);
  EXPECT_EQ(CudaIpcMapping::Open(0, mh->substr(1), 4096).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaEvent::OpenIpc(0, std::string(63, '\0')).status().code(),
            StatusCode::kInvalidArgument);
}

std::string ToHex(const std::string& bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

std::string FromHex(const char* hex) {
  std::string out;
  for (size_t i = 0; hex[i] != '\0' && hex[i + 1] != '\0'; i += 2) {
    out.push_back(static_cast<char>(std::stoi(std::string(hex + i, 2), nullptr, 16)));
  }
  return out;
}

constexpr size_t kIpcBytes = 1 << 16;

// A process cannot open its own IPC handles: the child half runs in a second process (this
// binary, re-executed with a filter) and is skipped when run directly.
TEST_F(CudaFixture, IpcMappingAndEventInChildProcess) {
  auto buf = DeviceBuffer::Create(0, kIpcBytes);
  ASSERT_TRUE(buf.ok());
  ASSERT_EQ(cudaMemset(buf->data(), 0x5A, kIpcBytes), cudaSuccess);
  auto event = CudaEvent::Create(0, /*interprocess=*/true);
  ASSERT_TRUE(event.ok());
  HIQ_ASSERT_OK(event->Record(stream()));
  HIQ_ASSERT_OK(event->Synchronize());
  auto mh = buf->ExportIpcHandle();
  auto eh = event->ExportIpcHandle();
  ASSERT_TRUE(mh.ok() && eh.ok());

  const pid_t pid =
      gpu_test::SpawnSelf("CudaIpcChild.OpensTheParentsHandles",
                          {"HIQ_TEST_IPC_MEM=" + ToHex(*mh), "HIQ_TEST_IPC_EVENT=" + ToHex(*eh)});
  ASSERT_GT(pid, 0);
  EXPECT_EQ(gpu_test::WaitChild(pid, std::chrono::seconds(120)), 0)
      << "the child's checks failed (see its output above)";

  std::vector<uint8_t> host(kIpcBytes);
  ASSERT_EQ(cudaMemcpy(host.data(), buf->data(), kIpcBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < kIpcBytes; ++i) {
    ASSERT_EQ(host[i], i < 16 ? 0x77 : 0x5A) << "byte " << i;
  }
}

TEST(CudaIpcChild, OpensTheParentsHandles) {
  const char* mem_hex = std::getenv("HIQ_TEST_IPC_MEM");
  const char* event_hex = std::getenv("HIQ_TEST_IPC_EVENT");
  if (mem_hex == nullptr || event_hex == nullptr) {
    GTEST_SKIP() << "runs only as the child of CudaFixture.IpcMappingAndEventInChildProcess";
  }
  const std::string mem = FromHex(mem_hex);
  const std::string ev = FromHex(event_hex);
  // Larger than the exported allocation: refused after opening (and closed again).
  auto too_big = CudaIpcMapping::Open(0, mem, uint64_t{1} << 40);
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument) << too_big.status().ToString();
  auto mapping = CudaIpcMapping::Open(0, mem, kIpcBytes);
  ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
  std::vector<uint8_t> host(kIpcBytes);
  ASSERT_EQ(cudaMemcpy(host.data(), mapping->data(), kIpcBytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(host, std::vector<uint8_t>(kIpcBytes, 0x5A));
  ASSERT_EQ(cudaMemset(mapping->data(), 0x77, 16), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto event = CudaEvent::OpenIpc(0, ev);
  ASSERT_TRUE(event.ok()) << event.status().ToString();
  HIQ_ASSERT_OK(event->Synchronize());
}

}  // namespace
}  // namespace hiqcache::kernels
