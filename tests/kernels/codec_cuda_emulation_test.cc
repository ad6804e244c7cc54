// The CUDA kernels of kernels/cuda/codec_cuda.cu, run on the CPU emulator
// (hiq_kernels_cuda_emulated, cuda_emulation.h), against the scalar reference byte for byte: the
// geometries of the codec tests (tests/gpu/codec_cuda_test.cc, codec_test_util.h's TestGeometries),
// BF16 and FP16, INT8, FP8 E4M3, INT4 (groups of 32), INT4 KIVI (K planes per channel, V as INT4
// rows), INT4 Hadamard (INT8 first rows, rotated runs split over lanes by shuffles), INT5 and INT6
// allot (keys turned back and allotted per (block, layer) by a warp, values rotated) and RAW,
// contiguous, strided (bases not 16-byte aligned), paged, packed-K/V and odd-byte views, misaligned
// staging, NaN/Inf blocks, whole, per-layer and partial decodes, several launch shapes (one warp
// walking everything through the grid-stride loop up to the default grid). The same launchers a GPU
// runs (StageEncodeJob, LaunchEncode, LaunchDecodeLayers) are called; only the execution underneath
// is emulated. A broken kernel shows: with the emulator's wrong-lane shuffle fault the comparison
// must fail.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "codec_cuda.h"
#include "codec_cuda_cases.h"
#include "codec_reference.h"
#include "codec_test_util.h"
#include "cuda_emulation.h"

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

constexpr CodecKind kInt8 = CodecKind::kInt8PerHead;
constexpr CodecKind kFp8 = CodecKind::kFp8E4m3PerHead;
constexpr CodecKind kInt4 = CodecKind::kInt4G32PerHead;
constexpr CodecKind kRaw = CodecKind::kRaw;
constexpr CodecKind kKivi = CodecKind::kInt4Kivi;
constexpr CodecKind kHadamard = CodecKind::kInt4Hadamard;
constexpr CodecKind kAllot = CodecKind::kInt5Allot;
constexpr CodecKind kAllot6 = CodecKind::kInt6Allot;
constexpr CodecKind kAllot4 = CodecKind::kInt4Allot;
constexpr uint8_t kSentinel = 0xA5;
constexpr uint8_t kStagingFill = 0xCD;
constexpr size_t kGapBytes = 64;  // sentinel gap after each block's slot in the staging buffer

// 16-byte aligned host memory (the emulated device memory).
struct AlignedBuffer {
  explicit AlignedBuffer(size_t n)
      : bytes(n), ptr(static_cast<uint8_t*>(std::aligned_alloc(16, (n + 15) / 16 * 16))) {}
  ~AlignedBuffer() { std::free(ptr); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  size_t bytes;
  uint8_t* ptr;
};

// Block b lives in slot num_blocks-1-b of one staging buffer (so the kernels must follow the
// pointer array), `misalign` bytes past a 16-byte boundary, each slot followed by a sentinel gap.
struct Staging {
  Staging(const BlockLayout& lay, uint32_t num_blocks, size_t misalign)
      : slot(lay.BlockBytes() + kGapBytes), mem(misalign + slot * num_blocks) {
    std::memset(mem.ptr, kStagingFill, mem.bytes);
    for (uint32_t b = 0; b < num_blocks; ++b) {
      ptrs.push_back(mem.ptr + misalign + (num_blocks - 1 - b) * slot);
    }
  }
  bool GapsIntact(const BlockLayout& lay) const {
    for (uint8_t* p : ptrs) {
      for (size_t i = 0; i < kGapBytes; ++i) {
        if (p[lay.BlockBytes() + i] != kStagingFill) return false;
      }
    }
    return true;
  }
  size_t slot;
  AlignedBuffer mem;
  std::vector<uint8_t*> ptrs;
};

struct EncodeResult {
  EncodeResult(const BlockLayout& lay, uint32_t n) : blocks(lay, n), flags(n, 0) {}
  BlockSet blocks;
  std::vector<uint8_t> flags;
  bool gaps_intact = true;
};

// Encodes `rows` of `pool` as the daemon does on a GPU: the job arrays through StageEncodeJob,
// then LaunchEncode into a staging buffer, the nonfinite flags pre-filled with garbage.
Status EmulatedEncode(const KvPool& pool, const std::vector<uint32_t>& rows, uint32_t num_blocks,
                      const CudaLaunchConfig& cfg, size_t misalign, EncodeResult* out) {
  const BlockLayout& lay = pool.layout();
  Staging staging(lay, num_blocks, misalign);
  AlignedBuffer flags(num_blocks);
  std::memset(flags.ptr, 0x77, num_blocks);  // the launcher must clear it
  const size_t scratch_bytes = JobArraysBytes(lay, num_blocks);
  AlignedBuffer host_scratch(scratch_bytes), device_scratch(scratch_bytes);
  const std::vector<float> rope = testutil::JobRope(lay);
  EncodeJob host_job;
  host_job.rope = rope.empty() ? nullptr : rope.data();
  host_job.layout = lay;
  host_job.layers = pool.views();
  host_job.rows = rows.data();
  host_job.blocks = staging.ptrs.data();
  host_job.num_blocks = num_blocks;
  host_job.nonfinite = flags.ptr;
  EncodeJob job;
  HIQ_RETURN_IF_ERROR(
      StageEncodeJob(host_job, host_scratch.ptr, device_scratch.ptr, scratch_bytes, nullptr, &job));
  std::memset(host_scratch.ptr, 0xEE, scratch_bytes);  // the kernels read the "device" copy
  HIQ_RETURN_IF_ERROR(LaunchEncode(job, nullptr, cfg));
  for (uint32_t b = 0; b < num_blocks; ++b) {
    std::memcpy(out->blocks[b].data(), staging.ptrs[b], lay.BlockBytes());
    out->flags[b] = flags.ptr[b];
  }
  out->gaps_intact = staging.GapsIntact(lay);
  return Status::Ok();
}

enum class DecodeMode { kWhole, kPerLayerReversed, kLastLayers };

// Decodes `payloads` into `dest` (layers as `mode` says) through StageDecodeJob and
// LaunchDecodeLayers; returns the first layer decoded.
Status EmulatedDecode(KvPool* dest, const std::vector<uint32_t>& rows, const BlockSet& payloads,
                      DecodeMode mode, const CudaLaunchConfig& cfg, size_t misalign,
                      uint32_t* first_layer) {
  const BlockLayout& lay = dest->layout();
  const uint32_t n = payloads.size();
  Staging staging(lay, n, misalign);
  for (uint32_t b = 0; b < n; ++b)
    std::memcpy(staging.ptrs[b], payloads[b].data(), lay.BlockBytes());
  std::vector<const uint8_t*> ptrs(staging.ptrs.begin(), staging.ptrs.end());
  const size_t scratch_bytes = JobArraysBytes(lay, n);
  AlignedBuffer host_scratch(scratch_bytes), device_scratch(scratch_bytes);
  const std::vector<float> rope = testutil::JobRope(lay);
  DecodeJob host_job;
  host_job.rope = rope.empty() ? nullptr : rope.data();
  host_job.layout = lay;
  host_job.layers = dest->views();
  host_job.rows = rows.data();
  host_job.blocks = ptrs.data();
  host_job.num_blocks = n;
  DecodeJob job;
  HIQ_RETURN_IF_ERROR(
      StageDecodeJob(host_job, host_scratch.ptr, device_scratch.ptr, scratch_bytes, nullptr, &job));
  *first_layer = 0;
  switch (mode) {
    case DecodeMode::kWhole:
      return LaunchDecode(job, nullptr, cfg);
    case DecodeMode::kPerLayerReversed:
      for (uint32_t l = lay.num_layers; l-- > 0;) {
        HIQ_RETURN_IF_ERROR(LaunchDecodeLayer(job, l, nullptr, cfg));
      }
      return Status::Ok();
    case DecodeMode::kLastLayers:
      *first_layer = lay.num_layers > 1 ? 1 : 0;
      return LaunchDecodeLayers(job, *first_layer, lay.num_layers - *first_layer, nullptr, cfg);
  }
  return Status::Ok();
}

CudaLaunchConfig Config(uint32_t threads, uint32_t max_ctas) {
  CudaLaunchConfig c;
  c.threads_per_cta = threads;
  c.max_ctas = max_ctas;
  return c;
}

// Launch shapes: one warp in one CTA walking every unit, a few small CTAs, one CTA of the most
// threads the kernels take, and the default (256 threads, 4 CTAs per emulated SM; the emulator
// reports 2 SMs).
std::vector<std::pair<std::string, CudaLaunchConfig>> LaunchShapes() {
  return {{"1x32", Config(32, 1)},
          {"3x96", Config(96, 3)},
          {"1x512", Config(512, 1)},
          {"default", CudaLaunchConfig{}}};
}

// One case: a source pool, its rows, reference payloads and decode.
using Case = testutil::CudaCase;

// Views whose heads start at odd byte addresses: every 16-bit access is unaligned.
KvPool::Shape OddByteShape(const BlockLayout& lay, uint32_t num_rows) {
  KvPool::Shape sh;
  sh.base_offset = 1;
  sh.head_stride = uint64_t{lay.row.head_dim} * 2 + 3;
  sh.row_stride = lay.row.num_heads * sh.head_stride + 5;
  sh.plane_offset = sh.row_stride * num_rows + 7;
  return sh;
}

class CodecCudaEmulationTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    layout_ = c.layout();
    num_rows_ = c.num_rows();
    rows_ = c.rows();
  }
  KvPool MakePool() const {
    const Case& c = GetParam();
    if (c.odd_bytes) return KvPool(layout_, num_rows_, OddByteShape(layout_, num_rows_));
    return KvPool(layout_, num_rows_, c.kind, /*seed=*/5);
  }
  KvPool MakeSource() const {
    KvPool pool = MakePool();
    if (!GetParam().odd_bytes) {
      pool.Fill(InputClass::kRowMix, /*seed=*/9);
      testutil::KeepRotationsFinite(&pool);
      return pool;
    }
    // KvPool::Fill writes through uint16_t*: fill an aligned twin and copy the bytes over.
    KvPool twin(layout_, num_rows_, ViewKind::kContiguous);
    twin.Fill(InputClass::kRowMix, /*seed=*/9);
    testutil::KeepRotationsFinite(&twin);
    const size_t head_bytes = size_t{layout_.row.head_dim} * 2;
    twin.ForEachHead([&](uint32_t l, uint32_t p, uint32_t r, uint32_t h, uint16_t*) {
      std::memcpy(pool.HeadAddr(l, p, r, h), twin.HeadAddr(l, p, r, h), head_bytes);
    });
    return pool;
  }
  KvPool MakeSentinelDest() const {
    KvPool pool = MakePool();
    pool.FillBytes(kSentinel);
    return pool;
  }
  BlockSet ReferencePayloads(const KvPool& src, std::vector<uint8_t>* flags) const {
    BlockSet ref(layout_, GetParam().num_blocks);
    flags->assign(GetParam().num_blocks, 0xEE);
    EncodeBlocksReference(testutil::MakeEncodeJob(src, rows_, ref, flags->data()));
    return ref;
  }

  BlockLayout layout_;
  uint32_t num_rows_ = 0;
  std::vector<uint32_t> rows_;
};

TEST_P(CodecCudaEmulationTest, EncodeMatchesReference) {
  const Case& c = GetParam();
  const KvPool src = MakeSource();
  std::vector<uint8_t> ref_flags;
  const BlockSet ref = ReferencePayloads(src, &ref_flags);
  ASSERT_EQ(ref_flags, std::vector<uint8_t>(c.num_blocks, 0));
  size_t misalign = 0;
  for (const auto& [shape, cfg] : LaunchShapes()) {
    SCOPED_TRACE("launch " + shape + ", staging misaligned by " + std::to_string(misalign));
    EncodeResult got(layout_, c.num_blocks);
    HIQ_ASSERT_OK(EmulatedEncode(src, rows_, c.num_blocks, cfg, misalign, &got));
    EXPECT_EQ(FirstPayloadDiff(layout_, ref, got.blocks), "");
    EXPECT_EQ(got.flags, ref_flags) << "the launcher must zero the flags of finite blocks";
    EXPECT_TRUE(got.gaps_intact) << "encode wrote past a block payload";
    misalign = misalign == 0 ? 2 : misalign == 2 ? 4 : 1;  // 0, 2, 4, 1: every store width
  }
}

TEST_P(CodecCudaEmulationTest, DecodeMatchesReferenceAndWritesNothingElse) {
  const KvPool src = MakeSource();
  std::vector<uint8_t> flags;
  const BlockSet payloads = ReferencePayloads(src, &flags);
  const std::vector<std::pair<std::string, CudaLaunchConfig>> shapes = LaunchShapes();
  size_t i = 0;
  for (DecodeMode mode :
       {DecodeMode::kWhole, DecodeMode::kPerLayerReversed, DecodeMode::kLastLayers}) {
    const auto& [shape, cfg] = shapes[i % shapes.size()];
    const size_t misalign = i == 1 ? 1 : 0;  // payloads at odd addresses once
    ++i;
    SCOPED_TRACE("mode " + std::to_string(static_cast<int>(mode)) + " launch " + shape);
    KvPool got = MakeSentinelDest();
    uint32_t first = 0;
    HIQ_ASSERT_OK(EmulatedDecode(&got, rows_, payloads, mode, cfg, misalign, &first));
    KvPool want = MakeSentinelDest();
    const DecodeJob ref_job = testutil::MakeDecodeJob(want, rows_, payloads);
    for (uint32_t l = first; l < layout_.num_layers; ++l) DecodeLayerReference(ref_job, l);
    EXPECT_EQ(FirstBufferDiff(want, got), "");
  }
}

// tests/gpu/codec_cuda_test.cc's cases, the remaining TestGeometries() head_dims (scalar tails
// for 16, 8 and 4 lanes; no vector part at all), and every 16-bit access unaligned.
std::vector<Case> EmulationCases() {
  std::vector<Case> cases = testutil::CudaGeometryCases();
  cases.insert(
      cases.end(),
      {Case{"bf16_32x128_paged", DType::kBF16, kInt8, 32, 128, 2, 2, 8, 2, ViewKind::kPaged},
       Case{"fp16_3x72_packed_kv", DType::kFP16, kInt8, 3, 72, 2, 2, 8, 3, ViewKind::kPackedKV},
       Case{"bf16_2x100_strided", DType::kBF16, kInt8, 2, 100, 2, 2, 8, 3, ViewKind::kStrided},
       Case{"fp16_5x40_paged", DType::kFP16, kInt8, 5, 40, 2, 2, 8, 3, ViewKind::kPaged},
       Case{"bf16_1x7_mla_strided", DType::kBF16, kInt8, 1, 7, 2, 1, 8, 3, ViewKind::kStrided},
       Case{"fp16_8x128_odd_bytes", DType::kFP16, kInt8, 8, 128, 2, 2, 8, 3, ViewKind::kContiguous,
            true},
       Case{"bf16_3x72_odd_bytes", DType::kBF16, kInt8, 3, 72, 2, 2, 8, 3, ViewKind::kContiguous,
            true},
       Case{"raw_bf16_1x7_odd_bytes", DType::kBF16, kRaw, 1, 7, 2, 1, 8, 3, ViewKind::kContiguous,
            true},
       Case{"raw_fp16_3x72_odd_bytes", DType::kFP16, kRaw, 3, 72, 2, 2, 8, 3, ViewKind::kContiguous,
            true},
       Case{"fp8_fp16_3x72_packed_kv", DType::kFP16, kFp8, 3, 72, 2, 2, 8, 3, ViewKind::kPackedKV},
       Case{"fp8_bf16_2x100_strided", DType::kBF16, kFp8, 2, 100, 2, 2, 8, 3, ViewKind::kStrided},
       Case{"fp8_bf16_1x7_mla_strided", DType::kBF16, kFp8, 1, 7, 2, 1, 8, 3, ViewKind::kStrided},
       Case{"fp8_fp16_8x128_odd_bytes", DType::kFP16, kFp8, 8, 128, 2, 2, 8, 3,
            ViewKind::kContiguous, true},
       Case{"fp8_bf16_3x72_odd_bytes", DType::kBF16, kFp8, 3, 72, 2, 2, 8, 3, ViewKind::kContiguous,
            true},
       Case{"int4_fp16_8x128_odd_bytes", DType::kFP16, kInt4, 8, 128, 2, 2, 8, 3,
            ViewKind::kContiguous, true},
       Case{"int4_bf16_3x96_odd_bytes", DType::kBF16, kInt4, 3, 96, 2, 2, 8, 3,
            ViewKind::kContiguous, true},
       Case{"int4_bf16_32x128_paged", DType::kBF16, kInt4, 32, 128, 2, 2, 8, 2, ViewKind::kPaged},
       Case{"kivi_fp16_8x128_odd_bytes", DType::kFP16, kKivi, 8, 128, 2, 2, 8, 3,
            ViewKind::kContiguous, true},
       Case{"kivi_bf16_3x96_odd_bytes", DType::kBF16, kKivi, 3, 96, 2, 2, 5, 3,
            ViewKind::kContiguous, true},
       Case{"kivi_bf16_1x64_mla_odd_bytes", DType::kBF16, kKivi, 1, 64, 2, 1, 6, 3,
            ViewKind::kContiguous, true},
       Case{"hadamard_fp16_8x128_odd_bytes", DType::kFP16, kHadamard, 8, 128, 2, 2, 8, 3,
            ViewKind::kContiguous, true},
       Case{"hadamard_bf16_3x96_odd_bytes", DType::kBF16, kHadamard, 3, 96, 2, 2, 5, 3,
            ViewKind::kContiguous, true},
       Case{"hadamard_bf16_1x64_mla_odd_bytes", DType::kBF16, kHadamard, 1, 64, 2, 1, 6, 3,
            ViewKind::kContiguous, true},
       Case{"hadamard_fp16_1x512_mla_odd_bytes", DType::kFP16, kHadamard, 1, 512, 2, 1, 3, 2,
            ViewKind::kContiguous, true},
       Case{"allot_fp16_8x128_odd_bytes", DType::kFP16, kAllot, 8, 128, 2, 2, 9, 2,
            ViewKind::kContiguous, true, 1e6},
       Case{"allot_bf16_3x96_odd_bytes", DType::kBF16, kAllot, 3, 96, 2, 2, 5, 3,
            ViewKind::kContiguous, true, 1e4, true},
       Case{"allot6_fp16_4x64_odd_bytes", DType::kFP16, kAllot6, 4, 64, 2, 2, 9, 2,
            ViewKind::kContiguous, true, 1e6},
       Case{"allot4_bf16_3x64_odd_bytes", DType::kBF16, kAllot4, 3, 64, 2, 2, 9, 2,
            ViewKind::kContiguous, true, 1e6}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Geometries, CodecCudaEmulationTest, ::testing::ValuesIn(EmulationCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

// ---------------------------------------------------------------------------------------------
// Every input class (zeros, subnormals, near-max, exact ties, ...) of every TestGeometries()
// geometry in both dtypes, INT8, FP8 and INT4 (its own geometries: head_dim % 32 == 0), through
// testutil::RunCase: the emulated kernels against
// the float64 model of docs/design.md (which the reference matches: codec_reference_test), so a bug
// shared by the kernels and codec_math.h shows too, plus the elementwise error bound.
TEST(CodecCudaEmulation, EveryInputClassMatchesTheModel) {
  testutil::Executor emulated{"cuda_emulated",
                              [](const EncodeJob& j) {
                                const Status s = LaunchEncode(j, nullptr, Config(64, 2));
                                ASSERT_TRUE(s.ok()) << s.ToString();
                              },
                              [](const DecodeJob& j) {
                                const Status s = LaunchDecode(j, nullptr, Config(64, 2));
                                ASSERT_TRUE(s.ok()) << s.ToString();
                              }};
  for (CodecKind codec : {kInt8, kFp8, kInt4}) {
    SCOPED_TRACE(testutil::CodecName(codec));
    testutil::BoundStats bound;
    std::vector<std::string> errors;
    uint64_t seed = 3000;
    size_t vk = 0;
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      for (const testutil::Geometry& g :
           codec == kInt4 ? testutil::Int4TestGeometries() : testutil::TestGeometries()) {
        for (InputClass cls : codec == kFp8    ? testutil::Fp8InputClasses()
                              : codec == kInt4 ? testutil::Int4InputClasses()
                                               : testutil::AllInputClasses()) {
          testutil::CaseSpec spec;
          spec.layout = testutil::MakeLayout(g, dtype, codec, /*layers=*/1, /*block_tokens=*/4);
          spec.input = cls;
          spec.view = testutil::AllViewKinds()[vk++ % testutil::AllViewKinds().size()];
          spec.seed = seed++;
          spec.pool_rows = 24;
          spec.num_blocks = 2;
          for (auto& e : testutil::RunCase(spec, {emulated}, &bound)) errors.push_back(e);
        }
      }
    }
    for (size_t i = 0; i < errors.size() && i < 10; ++i) ADD_FAILURE() << errors[i];
    EXPECT_TRUE(errors.empty()) << errors.size() << " failures";
    EXPECT_EQ(bound.violations, 0u);
    if (codec != kFp8) EXPECT_GT(bound.max_err_over_s, 0.4);
    EXPECT_GT(bound.max_err_over_bound, 0.9);
  }
}

// ---------------------------------------------------------------------------------------------
// NaN / Inf: exactly the blocks holding one are flagged (in a lane's full chunk, its scalar tail,
// a high chunk of a multi-chunk lane, the last head of the last token), the others encoded as
// the reference encodes them; non-finite values in rows no block references change nothing.

struct NonfiniteCase {
  const char* name;
  DType dtype;
  uint32_t heads, dim, planes;
  ViewKind kind;
};

TEST(CodecCudaEmulation, NonfiniteBlocksAreFlaggedLikeTheReference) {
  const std::vector<NonfiniteCase> cases = {
      {"8x128_paged", DType::kBF16, 8, 128, 2, ViewKind::kPaged},
      {"8x128_paged", DType::kFP16, 8, 128, 2, ViewKind::kPaged},
      {"2x100_strided", DType::kBF16, 2, 100, 2, ViewKind::kStrided},
      {"1x576_mla", DType::kFP16, 1, 576, 1, ViewKind::kContiguous},
      {"3x72_packed", DType::kBF16, 3, 72, 2, ViewKind::kPackedKV},
      {"1x7_mla", DType::kFP16, 1, 7, 1, ViewKind::kStrided},
      {"2x512_paged", DType::kBF16, 2, 512, 2, ViewKind::kPaged},
      {"1x1100_mla", DType::kFP16, 1, 1100, 1, ViewKind::kContiguous},
  };
  for (const CodecKind codec : {kInt8, kFp8, kInt4, kKivi, kHadamard, kAllot, kAllot6, kAllot4}) {
    const bool allot = codec == kAllot || codec == kAllot6 || codec == kAllot4;
    for (const NonfiniteCase& c : cases) {
      if ((codec == kInt4 || codec == kKivi || codec == kHadamard || allot) && c.dim % 32 != 0) {
        continue;  // groups of 32
      }
      if (allot && (c.dim > 256 || c.planes != 2)) continue;  // its CUDA kernels'
      SCOPED_TRACE(std::string(c.name) + " " + testutil::DTypeName(c.dtype) + " " +
                   std::string(testutil::CodecName(codec)));
      const bool bf16 = c.dtype == DType::kBF16;
      const uint32_t tokens = 4, layers = 2, num_blocks = 6, pool_rows = 40;
      const BlockLayout lay = MakeLayout(c.dtype, codec, c.heads, c.dim, layers, c.planes, tokens);
      KvPool src(lay, pool_rows, c.kind, 2);
      src.Fill(InputClass::kGaussian, 4);
      Rng rng(5);
      const std::vector<uint32_t> all = testutil::RandomRows(pool_rows, pool_rows, rng);
      const std::vector<uint32_t> rows(all.begin(), all.begin() + num_blocks * tokens);
      const uint32_t last_plane = c.planes - 1, last_head = c.heads - 1, d = c.dim;
      const uint16_t nan = bf16 ? 0x7FC1 : 0x7E01, inf = bf16 ? 0x7F80 : 0x7C00;
      const uint16_t ninf = bf16 ? 0xFF80 : 0xFC00;
      // Block 1: NaN in the last element (a lane's tail when d % 8 != 0) of the last plane.
      src.Head(1, last_plane, rows[1 * tokens + 2], last_head)[d - 1] = nan;
      // Block 3: +Inf in element 0 of layer 0.
      src.Head(0, 0, rows[3 * tokens + 0], 0)[0] = inf;
      // Block 4: -Inf in the middle (a high chunk for multi-chunk lanes) and a negative NaN.
      src.Head(1, 0, rows[4 * tokens + tokens - 1], last_head)[d / 2] = ninf;
      src.Head(1, 0, rows[4 * tokens + tokens - 1], last_head)[d - 1 - d / 3] = 0xFFFF;
      // A row no block references: must not flag anything.
      src.Head(0, 0, all[pool_rows - 1], 0)[0] = nan;

      BlockSet ref(lay, num_blocks);
      std::vector<uint8_t> ref_flags(num_blocks, 0xEE);
      EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
      ASSERT_EQ(ref_flags, (std::vector<uint8_t>{0, 1, 0, 1, 1, 0}));
      for (const auto& [shape, cfg] : LaunchShapes()) {
        SCOPED_TRACE("launch " + shape);
        EncodeResult got(lay, num_blocks);
        HIQ_ASSERT_OK(EmulatedEncode(src, rows, num_blocks, cfg, 0, &got));
        EXPECT_EQ(got.flags, ref_flags);
        EXPECT_EQ(FirstPayloadDiff(lay, ref, got.blocks, &ref_flags), "");
        EXPECT_TRUE(got.gaps_intact);
      }
    }
  }
}

// RAW never flags (it stores NaN/Inf bit-exactly) but still clears the flags it is given.
TEST(CodecCudaEmulation, RawStoresNonfiniteBitExactAndClearsFlags) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const BlockLayout lay = MakeLayout(dtype, kRaw, 8, 128, 2, 2, 4);
    KvPool src(lay, 20, ViewKind::kPaged, 3);
    src.Fill(InputClass::kGaussian, 1);
    Rng rng(2);
    const std::vector<uint32_t> rows = testutil::RandomRows(20, 8, rng);
    src.Head(1, 1, rows[5], 7)[127] = 0x7FFF;
    BlockSet ref(lay, 2);
    EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, nullptr));
    EncodeResult got(lay, 2);
    HIQ_ASSERT_OK(EmulatedEncode(src, rows, 2, Config(64, 1), 0, &got));
    EXPECT_EQ(FirstPayloadDiff(lay, ref, got.blocks), "");
    EXPECT_EQ(got.flags, (std::vector<uint8_t>{0, 0}));
  }
}

// ---------------------------------------------------------------------------------------------
// Launch shapes and the negative control.

TEST(CodecCudaEmulation, GridsStayWithinTheConfiguredBound) {
  const BlockLayout lay = MakeLayout(DType::kBF16, kInt8, 8, 128, 2, 2, 16);
  KvPool src(lay, 64, ViewKind::kContiguous, 1);
  src.Fill(InputClass::kGaussian, 1);
  Rng rng(1);
  const std::vector<uint32_t> rows = testutil::RandomRows(64, 48, rng);
  // 3 blocks x 2 layers x 2 planes x 16 tokens x 8 heads = 1,536 units; a 256-thread CTA holds
  // 8 warps x 2 groups x 2 units = 32, so 48 CTAs would be "needed".
  struct Shape {
    CudaLaunchConfig cfg;
    uint64_t max_grid;
  };
  CudaLaunchConfig per_sm;
  per_sm.ctas_per_sm = 3;
  for (const Shape& s : {Shape{Config(256, 1), 1}, Shape{Config(32, 5), 5},
                         Shape{CudaLaunchConfig{}, 4u * cuda_emulation::SmCount()},
                         Shape{per_sm, 3u * cuda_emulation::SmCount()}}) {
    cuda_emulation::ResetStats();
    EncodeResult got(lay, 3);
    HIQ_ASSERT_OK(EmulatedEncode(src, rows, 3, s.cfg, 0, &got));
    const cuda_emulation::Stats st = cuda_emulation::GetStats();
    EXPECT_EQ(st.launches, 1u);
    EXPECT_EQ(st.max_grid, s.max_grid);
    EXPECT_GT(st.shuffles, 0u);
  }
}

// Malformed launch shapes are refused before anything runs.
TEST(CodecCudaEmulation, LaunchersRejectBadConfigsBeforeLaunching) {
  const BlockLayout lay = MakeLayout(DType::kFP16, kInt8, 2, 96, 1, 2, 4);
  KvPool src(lay, 8, ViewKind::kContiguous, 1);
  const std::vector<uint32_t> rows = {0, 1, 2, 3};
  BlockSet blocks(lay, 1);
  const EncodeJob job = testutil::MakeEncodeJob(src, rows, blocks, nullptr);
  cuda_emulation::ResetStats();
  for (uint32_t threads : {0u, 48u, 544u, 1024u}) {
    EXPECT_EQ(LaunchEncode(job, nullptr, Config(threads, 1)).code(), StatusCode::kInvalidArgument)
        << threads;
  }
  EXPECT_EQ(cuda_emulation::GetStats().launches, 0u);
  HIQ_ASSERT_OK(LaunchEncode(job, nullptr, Config(512, 1)));
  EXPECT_EQ(cuda_emulation::GetStats().launches, 1u);
}

// CODEC_INT4_G32_PER_HEAD, CODEC_INT4_KIVI and CODEC_INT4_HADAMARD need whole groups of 32:
// other head_dims are refused up front, naming the codec.
TEST(CodecCudaEmulation, Int4RejectsHeadDimsNotMultipleOf32) {
  for (const auto& [codec, dim] :
       {std::pair{kInt4, 7u}, std::pair{kInt4, 48u}, std::pair{kInt4, 100u}, std::pair{kKivi, 7u},
        std::pair{kKivi, 48u}, std::pair{kKivi, 100u}, std::pair{kHadamard, 7u},
        std::pair{kHadamard, 48u}, std::pair{kHadamard, 100u}}) {
    const BlockLayout lay = MakeLayout(DType::kBF16, codec, 2, dim, 1, 2, 4);
    KvPool src(lay, 8, ViewKind::kContiguous, 1);
    const std::vector<uint32_t> rows = {0, 1, 2, 3};
    BlockSet blocks(lay, 1);
    cuda_emulation::ResetStats();
    const Status enc = LaunchEncode(testutil::MakeEncodeJob(src, rows, blocks, nullptr), nullptr);
    EXPECT_EQ(enc.code(), StatusCode::kInvalidArgument) << dim;
    EXPECT_NE(enc.message().find("head_dim"), std::string::npos) << enc.ToString();
    EXPECT_NE(enc.message().find(codec == kKivi       ? "CODEC_INT4_KIVI"
                                 : codec == kHadamard ? "CODEC_INT4_HADAMARD"
                                                      : "CODEC_INT4_G32_PER_HEAD"),
              std::string::npos)
        << enc.ToString();
    const Status dec = LaunchDecode(testutil::MakeDecodeJob(src, rows, blocks), nullptr);
    EXPECT_EQ(dec.code(), StatusCode::kInvalidArgument) << dim;
    EXPECT_EQ(cuda_emulation::GetStats().launches, 0u);
  }
}

// The allot codecs' kernels take head_dims that are multiples of 32 up to 256, K and V planes,
// and need the job's RoPE table: anything else is refused up front, naming the codec, and
// nothing is launched.
TEST(CodecCudaEmulation, AllotRefusesWhatItsKernelsDoNotTake) {
  struct Bad {
    uint32_t dim, planes;
    bool rope;
    CodecKind codec;
  };
  for (const Bad& b :
       {Bad{48, 2, true, kAllot}, Bad{100, 2, true, kAllot}, Bad{288, 2, true, kAllot},
        Bad{512, 2, true, kAllot}, Bad{64, 1, true, kAllot}, Bad{64, 2, false, kAllot},
        Bad{288, 2, true, kAllot6}, Bad{64, 1, true, kAllot6}, Bad{64, 2, false, kAllot6},
        Bad{288, 2, true, kAllot4}, Bad{64, 1, true, kAllot4}, Bad{64, 2, false, kAllot4}}) {
    const std::string name = b.codec == kAllot6   ? "CODEC_INT6_ALLOT"
                             : b.codec == kAllot4 ? "CODEC_INT4_ALLOT"
                                                  : "CODEC_INT5_ALLOT";
    SCOPED_TRACE(name + " dim " + std::to_string(b.dim) + " planes " + std::to_string(b.planes) +
                 (b.rope ? "" : " without a table"));
    const BlockLayout lay = MakeLayout(DType::kBF16, b.codec, 2, b.dim, 1, b.planes, 4);
    KvPool src(lay, 8, ViewKind::kContiguous, 1);
    const std::vector<uint32_t> rows = {0, 1, 2, 3};
    BlockSet blocks(lay, 1);
    const std::vector<float> rope = testutil::JobRope(lay);
    EncodeJob enc_job = testutil::MakeEncodeJob(src, rows, blocks, nullptr);
    DecodeJob dec_job = testutil::MakeDecodeJob(src, rows, blocks);
    enc_job.rope = dec_job.rope = b.rope ? rope.data() : nullptr;
    cuda_emulation::ResetStats();
    const Status enc = LaunchEncode(enc_job, nullptr);
    EXPECT_EQ(enc.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(enc.message().find(name), std::string::npos) << enc.ToString();
    const Status dec = LaunchDecode(dec_job, nullptr);
    EXPECT_EQ(dec.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(dec.message().find(name), std::string::npos) << dec.ToString();
    EXPECT_EQ(cuda_emulation::GetStats().launches, 0u);
  }
}

// CODEC_INT5_ALLOT runs as three launches per call: the K planes' kernel (a warp per block and
// layer; decode, per 8 tokens of one), the V rows', then the first rows' (INT8), each within the
// configured grid; a key of 2^120 or more (finite in BF16) flags its block as NaN does.
TEST(CodecCudaEmulation, Int5AllotLaunchesKThenVThenFirstRowsAndFlagsHugeKeys) {
  BlockLayout lay = MakeLayout(DType::kBF16, kAllot, 4, 64, 3, 2, 20);
  lay.row.rope_theta = 1e4;
  KvPool src(lay, 60, ViewKind::kContiguous, 1);
  src.Fill(InputClass::kGaussian, 1);
  Rng rng(1);
  const std::vector<uint32_t> rows = testutil::RandomRows(60, 60, rng);
  src.Head(2, 0, rows[2 * 20 + 13], 3)[17] = 0x7C00;  // 2^121 in a key of block 2, token 13
  BlockSet ref(lay, 3);
  std::vector<uint8_t> ref_flags(3, 0xEE);
  EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
  ASSERT_EQ(ref_flags, (std::vector<uint8_t>{0, 0, 1}));
  cuda_emulation::ResetStats();
  EncodeResult got(lay, 3);
  HIQ_ASSERT_OK(EmulatedEncode(src, rows, 3, Config(64, 3), 0, &got));
  cuda_emulation::Stats st = cuda_emulation::GetStats();
  EXPECT_EQ(st.launches, 3u);
  EXPECT_EQ(st.max_grid, 3u);  // K: 9 warps at 2 per CTA; V: 684 heads at 4 per CTA, capped
  EXPECT_EQ(got.flags, ref_flags);
  EXPECT_EQ(FirstPayloadDiff(lay, ref, got.blocks, &ref_flags), "");

  ref_flags.assign(3, 0);
  KvPool want(lay, 60, ViewKind::kContiguous, 1);
  want.FillBytes(kSentinel);
  DecodeLayerReference(testutil::MakeDecodeJob(want, rows, ref), 1);
  KvPool dest(lay, 60, ViewKind::kContiguous, 1);
  dest.FillBytes(kSentinel);
  const std::vector<float> rope = testutil::JobRope(lay);
  DecodeJob job = testutil::MakeDecodeJob(dest, rows, ref);
  job.rope = rope.data();
  cuda_emulation::ResetStats();
  HIQ_ASSERT_OK(LaunchDecodeLayer(job, 1, nullptr, Config(32, 2)));
  st = cuda_emulation::GetStats();
  EXPECT_EQ(st.launches, 3u);
  EXPECT_EQ(st.max_grid, 2u);  // K: 3 blocks x 3 units of up to 8 tokens, one warp per CTA
  EXPECT_EQ(FirstBufferDiff(want, dest), "");
}

// Zero keys leave a block's channels' ranges 0: every widening step gains 0 and the
// allotment's threshold is 0, so the steps go to the channels of range 0 in channel order: all of
// them where every range is 0; where the last head's keys vary, the bits left after its steps,
// which moves that head's fields (and leaves the row's last bytes zero).
TEST(CodecCudaEmulation, Int5AllotZeroRangesTakeTheirStepsInChannelOrder) {
  for (const uint32_t heads : {4u, 8u}) {
    for (const bool some_vary : {false, true}) {
      SCOPED_TRACE(std::to_string(heads) + " heads" + (some_vary ? ", the last varying" : ""));
      const BlockLayout lay = MakeLayout(DType::kBF16, kAllot, heads, 64, 2, 2, 8);
      KvPool src(lay, 32, ViewKind::kContiguous, 1);
      src.Fill(InputClass::kGaussian, 3);
      const std::vector<uint32_t> rows = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      for (uint32_t l = 0; l < lay.num_layers; ++l) {
        for (uint32_t t = 1; t < 8; ++t) {  // block 0: zero keys in tokens 1..7
          for (uint32_t h = 0; h < (some_vary ? heads - 1 : heads); ++h) {
            std::memset(src.Head(l, 0, rows[t], h), 0, 64 * 2);
          }
        }
      }
      BlockSet ref(lay, 2);
      std::vector<uint8_t> ref_flags(2, 0xEE);
      EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
      ASSERT_EQ(ref_flags, (std::vector<uint8_t>{0, 0}));
      EncodeResult got(lay, 2);
      HIQ_ASSERT_OK(EmulatedEncode(src, rows, 2, Config(96, 2), 3, &got));
      EXPECT_EQ(FirstPayloadDiff(lay, ref, got.blocks), "");
      EXPECT_TRUE(got.gaps_intact);
      KvPool want(lay, 32, ViewKind::kContiguous, 1);
      want.FillBytes(kSentinel);
      const DecodeJob ref_job = testutil::MakeDecodeJob(want, rows, ref);
      for (uint32_t l = 0; l < lay.num_layers; ++l) DecodeLayerReference(ref_job, l);
      KvPool dest(lay, 32, ViewKind::kContiguous, 1);
      dest.FillBytes(kSentinel);
      uint32_t first = 0;
      HIQ_ASSERT_OK(EmulatedDecode(&dest, rows, ref, DecodeMode::kWhole, Config(64, 1), 0, &first));
      EXPECT_EQ(FirstBufferDiff(want, dest), "");
    }
  }
}

// CODEC_INT4_KIVI runs as two launches per call, the K planes' kernel then the V rows' (one for
// MLA, K planes only), each within the configured grid, with the reference's bytes.
TEST(CodecCudaEmulation, Int4KiviLaunchesItsKPlaneAndVRowKernels) {
  for (const uint32_t planes : {2u, 1u}) {
    SCOPED_TRACE("planes " + std::to_string(planes));
    const BlockLayout lay = MakeLayout(DType::kBF16, kKivi, 4, 64, 3, planes, 6);
    KvPool src(lay, 20, ViewKind::kContiguous, 1);
    src.Fill(InputClass::kGaussian, 1);
    Rng rng(1);
    const std::vector<uint32_t> rows = testutil::RandomRows(20, 12, rng);
    BlockSet ref(lay, 2);
    std::vector<uint8_t> ref_flags(2, 0xEE);
    EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
    cuda_emulation::ResetStats();
    EncodeResult got(lay, 2);
    HIQ_ASSERT_OK(EmulatedEncode(src, rows, 2, Config(64, 3), 0, &got));
    cuda_emulation::Stats st = cuda_emulation::GetStats();
    EXPECT_EQ(st.launches, planes);
    EXPECT_EQ(st.max_grid, 3u);  // K: 192 units at 64 per CTA; V: 144 heads, 9 CTAs capped
    EXPECT_EQ(FirstPayloadDiff(lay, ref, got.blocks), "");
    EXPECT_EQ(got.flags, ref_flags);

    KvPool want(lay, 20, ViewKind::kContiguous, 1);
    want.FillBytes(kSentinel);
    DecodeLayerReference(testutil::MakeDecodeJob(want, rows, ref), 1);
    KvPool dest(lay, 20, ViewKind::kContiguous, 1);
    dest.FillBytes(kSentinel);
    cuda_emulation::ResetStats();
    HIQ_ASSERT_OK(
        LaunchDecodeLayer(testutil::MakeDecodeJob(dest, rows, ref), 1, nullptr, Config(32, 2)));
    st = cuda_emulation::GetStats();
    EXPECT_EQ(st.launches, planes);
    EXPECT_EQ(st.max_grid, 2u);  // K: 64 units at 32 per CTA
    EXPECT_EQ(FirstBufferDiff(want, dest), "");
  }
}

// Every input class (zeros, subnormals, near-max ranges, the INT4 grid, ...) of the INT4
// geometries in both dtypes, every view kind in turn, block_tokens 1, 4 and 7: the emulated
// KIVI kernels against the scalar reference (which codec_cpu_kivi_test checks against the
// float64 model and the bound), payload and decoded pool byte for byte.
TEST(CodecCudaEmulation, Int4KiviEveryInputClassMatchesTheReference) {
  std::vector<std::string> errors;
  uint64_t seed = 7000;
  size_t vk = 0;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const testutil::Geometry& g : testutil::Int4TestGeometries()) {
      for (InputClass cls : testutil::Int4InputClasses()) {
        constexpr uint32_t kTokens[] = {1, 4, 7};
        const uint32_t tokens = kTokens[seed % 3];
        const BlockLayout lay = testutil::MakeLayout(g, dtype, kKivi, /*layers=*/1, tokens);
        const ViewKind kind = testutil::AllViewKinds()[vk++ % testutil::AllViewKinds().size()];
        const uint32_t num_rows = 2 * tokens + 3;
        const std::string name = std::string(testutil::DTypeName(dtype)) + " " +
                                 testutil::GeometryName(g) + " " + testutil::InputClassName(cls) +
                                 " " + testutil::ViewKindName(kind) + " bt" +
                                 std::to_string(tokens);
        KvPool src(lay, num_rows, kind, seed);
        src.Fill(cls, seed * 7919 + 1);
        Rng rng(seed++);
        const std::vector<uint32_t> rows = testutil::RandomRows(num_rows, 2 * tokens, rng);
        BlockSet ref(lay, 2);
        std::vector<uint8_t> ref_flags(2, 0xEE);
        EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
        EncodeResult got(lay, 2);
        HIQ_ASSERT_OK(EmulatedEncode(src, rows, 2, Config(64, 2), 0, &got));
        const std::string diff = FirstPayloadDiff(lay, ref, got.blocks);
        if (!diff.empty()) errors.push_back(name + ": " + diff);
        if (got.flags != ref_flags) errors.push_back(name + ": nonfinite flags differ");

        KvPool want(lay, num_rows, kind, seed);
        want.FillBytes(kSentinel);
        DecodeBlocksReference(testutil::MakeDecodeJob(want, rows, ref));
        KvPool dest(lay, num_rows, kind, seed);
        dest.FillBytes(kSentinel);
        HIQ_ASSERT_OK(
            LaunchDecode(testutil::MakeDecodeJob(dest, rows, ref), nullptr, Config(64, 2)));
        const std::string dec = FirstBufferDiff(want, dest);
        if (!dec.empty()) errors.push_back(name + ": decode: " + dec);
      }
    }
  }
  for (size_t i = 0; i < errors.size() && i < 10; ++i) ADD_FAILURE() << errors[i];
  EXPECT_TRUE(errors.empty()) << errors.size() << " failures";
}

// CODEC_INT4_HADAMARD runs its rotated rows' kernels, then the INT8 rows of every plane's first
// token: encode 3 launches (plane 0's, plane 1's, INT8 rows), 2 for MLA, 1 for one-token blocks
// (INT8 rows only); decode 2 (both planes' rotated rows, INT8 rows), 1 for one-token blocks; each
// within the configured grid, with the reference's bytes.
TEST(CodecCudaEmulation, Int4HadamardLaunchesItsRotatedAndInt8RowKernels) {
  struct Shape {
    uint32_t planes, tokens, encode_launches, decode_launches;
  };
  for (const Shape& sh : {Shape{2, 6, 3, 2}, Shape{1, 6, 2, 2}, Shape{2, 1, 1, 1}}) {
    SCOPED_TRACE("planes " + std::to_string(sh.planes) + " tokens " + std::to_string(sh.tokens));
    const BlockLayout lay = MakeLayout(DType::kBF16, kHadamard, 4, 64, 3, sh.planes, sh.tokens);
    KvPool src(lay, 20, ViewKind::kContiguous, 1);
    src.Fill(InputClass::kGaussian, 1);
    Rng rng(1);
    const std::vector<uint32_t> rows = testutil::RandomRows(20, 2 * sh.tokens, rng);
    BlockSet ref(lay, 2);
    std::vector<uint8_t> ref_flags(2, 0xEE);
    EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
    ASSERT_EQ(ref_flags, (std::vector<uint8_t>{0, 0}));
    cuda_emulation::ResetStats();
    EncodeResult got(lay, 2);
    HIQ_ASSERT_OK(EmulatedEncode(src, rows, 2, Config(64, 3), 0, &got));
    cuda_emulation::Stats st = cuda_emulation::GetStats();
    EXPECT_EQ(st.launches, sh.encode_launches);
    EXPECT_LE(st.max_grid, 3u);
    EXPECT_EQ(FirstPayloadDiff(lay, ref, got.blocks), "");
    EXPECT_EQ(got.flags, ref_flags);
    EXPECT_TRUE(got.gaps_intact);

    KvPool want(lay, 20, ViewKind::kContiguous, 1);
    want.FillBytes(kSentinel);
    DecodeLayerReference(testutil::MakeDecodeJob(want, rows, ref), 1);
    KvPool dest(lay, 20, ViewKind::kContiguous, 1);
    dest.FillBytes(kSentinel);
    cuda_emulation::ResetStats();
    HIQ_ASSERT_OK(
        LaunchDecodeLayer(testutil::MakeDecodeJob(dest, rows, ref), 1, nullptr, Config(32, 2)));
    st = cuda_emulation::GetStats();
    EXPECT_EQ(st.launches, sh.decode_launches);
    EXPECT_LE(st.max_grid, 2u);
    EXPECT_EQ(FirstBufferDiff(want, dest), "");
  }
}

// Every input class (zeros, subnormals, near-max values, the INT4 grid, ...) of geometries with
// every rotation run (32 to 2048, MLA included) in both dtypes, every view kind in turn, block
// tokens 1, 3 and 16, several launch shapes: the emulated kernels against the scalar reference
// (which codec_cpu_hadamard_test checks against its model and the bound), flags, the payloads
// of the blocks not flagged, and every block's decode, byte for byte. BF16 near-max heads leave
// fp32's range under the rotation: those blocks must be flagged, as the reference flags them.
TEST(CodecCudaEmulation, Int4HadamardEveryInputClassMatchesTheReference) {
  const std::vector<testutil::Geometry> geometries = {
      {4, 128, 2}, {3, 64, 2},  {2, 32, 2},  {1, 576, 1},  {2, 96, 2},
      {5, 160, 2}, {1, 256, 2}, {1, 512, 2}, {1, 1024, 1}, {1, 2048, 2}};
  const std::vector<std::pair<std::string, CudaLaunchConfig>> shapes = LaunchShapes();
  std::vector<std::string> errors;
  uint64_t seed = 9000;
  size_t vk = 0;
  uint32_t flagged = 0, encoded = 0;
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const testutil::Geometry& g : geometries) {
      for (InputClass cls : testutil::Int4InputClasses()) {
        constexpr uint32_t kTokens[] = {1, 3, 16};
        const uint32_t tokens = g.dim >= 1024 ? 3 : kTokens[seed % 3];
        const BlockLayout lay = testutil::MakeLayout(g, dtype, kHadamard, /*layers=*/1, tokens);
        const ViewKind kind = testutil::AllViewKinds()[vk++ % testutil::AllViewKinds().size()];
        const auto& [shape, cfg] = shapes[seed % shapes.size()];
        const uint32_t num_blocks = 2;
        const uint32_t num_rows = num_blocks * tokens + 3;
        const std::string name = std::string(testutil::DTypeName(dtype)) + " " +
                                 testutil::GeometryName(g) + " " + testutil::InputClassName(cls) +
                                 " " + testutil::ViewKindName(kind) + " bt" +
                                 std::to_string(tokens) + " launch " + shape;
        KvPool src(lay, num_rows, kind, seed);
        src.Fill(cls, seed * 7919 + 1);
        Rng rng(seed++);
        const std::vector<uint32_t> rows = testutil::RandomRows(num_rows, num_blocks * tokens, rng);
        BlockSet ref(lay, num_blocks);
        std::vector<uint8_t> ref_flags(num_blocks, 0xEE);
        EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
        for (uint8_t f : ref_flags) (f != 0 ? flagged : encoded) += 1;
        EncodeResult got(lay, num_blocks);
        HIQ_ASSERT_OK(EmulatedEncode(src, rows, num_blocks, cfg, 0, &got));
        const std::string diff = FirstPayloadDiff(lay, ref, got.blocks, &ref_flags);
        if (!diff.empty()) errors.push_back(name + ": " + diff);
        if (got.flags != ref_flags) errors.push_back(name + ": nonfinite flags differ");
        if (!got.gaps_intact) errors.push_back(name + ": wrote past a block payload");

        KvPool want(lay, num_rows, kind, seed);
        want.FillBytes(kSentinel);
        DecodeBlocksReference(testutil::MakeDecodeJob(want, rows, ref));
        KvPool dest(lay, num_rows, kind, seed);
        dest.FillBytes(kSentinel);
        HIQ_ASSERT_OK(LaunchDecode(testutil::MakeDecodeJob(dest, rows, ref), nullptr, cfg));
        const std::string dec = FirstBufferDiff(want, dest);
        if (!dec.empty()) errors.push_back(name + ": decode: " + dec);
      }
    }
  }
  for (size_t i = 0; i < errors.size() && i < 10; ++i) ADD_FAILURE() << errors[i];
  EXPECT_TRUE(errors.empty()) << errors.size() << " failures";
  // Both outcomes occur: BF16 near-max rotated tokens flag their blocks, the rest encode.
  EXPECT_GT(flagged, 0u);
  EXPECT_GT(encoded, 2 * flagged);
  std::printf("  %u blocks encoded, %u flagged (as the reference)\n", encoded, flagged);
}

// A rotated token whose inputs are finite but whose transform leaves fp32's range (BF16's
// largest value in every element of a run, in either plane, any token after the first, any run
// of the head) flags its block only; the INT8 first row of such values does not. Every launch
// shape.
TEST(CodecCudaEmulation, Int4HadamardRotationOverflowFlagsItsBlock) {
  for (const testutil::Geometry& g :
       {testutil::Geometry{2, 96, 2}, testutil::Geometry{2, 128, 2}, testutil::Geometry{1, 512, 2},
        testutil::Geometry{1, 576, 1}}) {
    SCOPED_TRACE(testutil::GeometryName(g));
    const uint32_t tokens = 5, num_blocks = 5, pool_rows = 30;
    const BlockLayout lay = testutil::MakeLayout(g, DType::kBF16, kHadamard, 2, tokens);
    KvPool src(lay, pool_rows, ViewKind::kPaged, 3);
    src.Fill(InputClass::kGaussian, 3);
    Rng rng(4);
    const std::vector<uint32_t> rows = testutil::RandomRows(pool_rows, num_blocks * tokens, rng);
    const uint32_t r = HadamardRun(g.dim), last = g.planes - 1, hl = g.heads - 1;
    auto max_run = [&](uint32_t l, uint32_t p, uint32_t row, uint32_t h, uint32_t j) {
      for (uint32_t i = 0; i < r; ++i) src.Head(l, p, row, h)[j * r + i] = 0x7F7F;
    };
    // Block 0: token 0 (an INT8 row: finite); block 1: the last run of the last head of the last
    // plane's last token; block 3: plane 0, token 1, the first run.
    max_run(0, 0, rows[0 * tokens + 0], 0, 0);
    max_run(1, last, rows[1 * tokens + 4], hl, g.dim / r - 1);
    max_run(0, 0, rows[3 * tokens + 1], 0, 0);
    BlockSet ref(lay, num_blocks);
    std::vector<uint8_t> ref_flags(num_blocks, 0xEE);
    EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, ref_flags.data()));
    ASSERT_EQ(ref_flags, (std::vector<uint8_t>{0, 1, 0, 1, 0}));
    for (const auto& [shape, cfg] : LaunchShapes()) {
      SCOPED_TRACE("launch " + shape);
      EncodeResult got(lay, num_blocks);
      HIQ_ASSERT_OK(EmulatedEncode(src, rows, num_blocks, cfg, 0, &got));
      EXPECT_EQ(got.flags, ref_flags);
      EXPECT_EQ(FirstPayloadDiff(lay, ref, got.blocks, &ref_flags), "");
      EXPECT_TRUE(got.gaps_intact);
    }
  }
}

// Sets an emulator fault for one scope.
class ScopedFault {
 public:
  explicit ScopedFault(cuda_emulation::Fault f) { cuda_emulation::SetFault(f); }
  ~ScopedFault() { cuda_emulation::SetFault(cuda_emulation::Fault::kNone); }
};

// A kernel whose amax reduction reads the wrong lane (the emulator's fault) must be caught by the
// same comparison the tests above make: it is what proves they can fail.
TEST(CodecCudaEmulation, BrokenShuffleIsCaught) {
  // 16-lane and 32-lane groups; KIVI's V rows (its K planes use no shuffle); Hadamard's runs of
  // 128 (16 lanes) and 32 (4 lanes).
  for (const auto& [codec, dim] :
       {std::pair{kInt8, 128u}, std::pair{kInt8, 576u}, std::pair{kInt4, 128u},
        std::pair{kKivi, 128u}, std::pair{kHadamard, 128u}, std::pair{kHadamard, 96u}}) {
    const BlockLayout lay = MakeLayout(DType::kBF16, codec, 1024 / dim + 1, dim, 1, 2, 4);
    KvPool src(lay, 16, ViewKind::kContiguous, 1);
    src.Fill(InputClass::kOutlier, 7);  // one large element per head: a missed lane changes s
    Rng rng(3);
    const std::vector<uint32_t> rows = testutil::RandomRows(16, 8, rng);
    BlockSet ref(lay, 2);
    std::vector<uint8_t> flags(2);
    EncodeBlocksReference(testutil::MakeEncodeJob(src, rows, ref, flags.data()));
    {
      EncodeResult good(lay, 2);
      HIQ_ASSERT_OK(EmulatedEncode(src, rows, 2, Config(64, 1), 0, &good));
      ASSERT_EQ(FirstPayloadDiff(lay, ref, good.blocks), "");
    }
    ScopedFault fault(cuda_emulation::Fault::kShuffleWrongLane);
    EncodeResult bad(lay, 2);
    HIQ_ASSERT_OK(EmulatedEncode(src, rows, 2, Config(64, 1), 0, &bad));
    const std::string diff = FirstPayloadDiff(lay, ref, bad.blocks);
    EXPECT_NE(diff, "") << "a wrong-lane shuffle went unnoticed (" << testutil::CodecName(codec)
                        << " dim " << dim << ")";
    std::printf("  %s dim %u, wrong-lane shuffle: %s\n", testutil::CodecName(codec), dim,
                diff.c_str());
  }
}

}  // namespace
}  // namespace hiqcache::kernels
