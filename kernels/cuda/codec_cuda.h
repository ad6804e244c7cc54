// The CUDA executor of the codecs: gather+encode (backup) and decode+scatter (restore) kernels
// and their host launchers.
//
// Same jobs as the CPU executors (codec_job.h), same bytes (the per-element arithmetic is
// codec_math.h, compiled for the device), but every pointer a kernel follows must be
// device-accessible (device memory, or mapped pinned host memory under UVA):
//   - job.layers  : the LayerViews array itself, and every view's `base`;
//   - job.rows    : the slot array;
//   - job.blocks  : the block-pointer array and the payloads it points to. Payloads may be block
//                   payloads anywhere in device memory or slices of one contiguous device staging
//                   buffer laid out block by block ([block][layer][K|V][token][row]): the kernel
//                   only follows the pointers;
//   - job.nonfinite (encode; may be null).
// StageEncodeJob / StageDecodeJob pack a job whose three arrays are in host memory into one
// device scratch buffer with a single copy, so a request costs one H2D copy plus the launch.
//
// Launchers only enqueue work on `stream` (a cudaStream_t; nullptr = the legacy default stream)
// and return without synchronizing. They validate the job's shape (not its pointers: the views
// were bounds-checked at registration, the arrays are the caller's) and return INVALID_ARGUMENT
// for a malformed shape or INTERNAL for a launch error. Rows of a decode job must be distinct,
// as for the CPU executors (two blocks writing one slot race).
//
// Thread-safety: launchers are thread-safe (no shared mutable state besides a per-device SM
// count cache). This header includes no CUDA header: cudaStream_t is `CUstream_st*`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec_job.h"
#include "codec_math.h"
#include "hiqcache/status.h"

struct CUstream_st;  // cudaStream_t == CUstream_st*

namespace hiqcache::kernels {

// Bounds the grid so the daemon leaves the GPU to the engine: the kernels use grid-stride loops
// over at most max_ctas CTAs (0 = ctas_per_sm x the device's SM count).
struct CudaLaunchConfig {
  uint32_t threads_per_cta = 256;  // a multiple of 32, at most 512 (the kernels' launch bound)
  uint32_t ctas_per_sm = 4;
  uint32_t max_ctas = 0;
};

// Gathers job.rows from job.layers and encodes every (block, layer, plane, token) row into
// job.blocks[b] + layout.RowOffset(l, p, t). When job.nonfinite is set, first zeroes
// nonfinite[0, num_blocks) on `stream`, then sets nonfinite[b] = 1 for each block with a NaN/Inf
// in an INT8, FP8 or INT4 row, an INT4 KIVI K plane or an INT4 Hadamard plane, or with an INT4
// Hadamard rotation at its range limit (HadamardLimitBits; that block's payload is then
// unspecified).
// INT4 KIVI enqueues two kernels: its K planes', then its V rows'. INT4 Hadamard enqueues its
// rotated rows' kernels (plane 0's, plane 1's; none for one-token blocks), then its first rows'
// (INT8); its decode, one rotated-rows kernel for both planes, then the first rows'. INT5 allot
// (head_dim a multiple of 32 up to 256, K and V planes) enqueues its K planes' kernel (a warp per
// block and layer; decode, per 8 tokens of one), its V rows', then its first rows' (INT8); it
// needs job.rope (INVALID_ARGUMENT without it) and flags a block with a key of magnitude >= 2^120
// (NaN, Inf) or a rotated value at its range limit.
Status LaunchEncode(const EncodeJob& job, CUstream_st* stream, const CudaLaunchConfig& config = {});

// Decodes layers [first_layer, first_layer + num_layers) of every block and scatters them into
// job.rows of those layers' views. Writes nothing else.
Status LaunchDecodeLayers(const DecodeJob& job, uint32_t first_layer, uint32_t num_layers,
                          CUstream_st* stream, const CudaLaunchConfig& config = {});
// One layer: restore enqueues this, then records that layer's event on the same stream.
inline Status LaunchDecodeLayer(const DecodeJob& job, uint32_t layer, CUstream_st* stream,
                                const CudaLaunchConfig& config = {}) {
  return LaunchDecodeLayers(job, layer, 1, stream, config);
}
// Every layer, one launch.
inline Status LaunchDecode(const DecodeJob& job, CUstream_st* stream,
                           const CudaLaunchConfig& config = {}) {
  return LaunchDecodeLayers(job, 0, job.layout.num_layers, stream, config);
}

// Bytes of scratch StageEncodeJob/StageDecodeJob need for `num_blocks` blocks of `layout`: the
// LayerViews array, the block-pointer array, the rows array and the RoPE table (RopeTableFloats),
// each 16-byte aligned.
size_t JobArraysBytes(const BlockLayout& layout, uint32_t num_blocks);

// Copies host_job's layers[num_layers], blocks[num_blocks], rows[num_blocks*block_tokens] and,
// where the codec has one, rope[RopeTableFloats] (host arrays; the first two holding device
// pointers) into `host_scratch`, enqueues one copy of it to `device_scratch` on `stream`, and sets
// *device_job to host_job with those arrays pointing into device_scratch (nonfinite is passed
// through and must be device memory).
// REQUIRES: both scratch buffers hold scratch_bytes >= JobArraysBytes(...) bytes and are
// 16-byte aligned; host_scratch is left untouched and device_scratch is not reused until the
// work on `stream` has passed the copy (pinned host_scratch: the copy is asynchronous; pageable
// host_scratch: the copy has read it when this returns).
Status StageEncodeJob(const EncodeJob& host_job, void* host_scratch, void* device_scratch,
                      size_t scratch_bytes, CUstream_st* stream, EncodeJob* device_job);
Status StageDecodeJob(const DecodeJob& host_job, void* host_scratch, void* device_scratch,
                      size_t scratch_bytes, CUstream_st* stream, DecodeJob* device_job);

// ---------------------------------------------------------------------------------------------
// Internals shared by the kernels and their host-side tests. Not part of the API.
namespace cuda_detail {

// Division by a runtime-invariant divisor as a multiply-high and a shift (Granlund-Montgomery
// round-up method, as CUTLASS's FastDivmod). Exact for every dividend n < 2^31.
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;

  static FastDivmod Make(uint32_t d) {
    FastDivmod f;
    f.divisor = d;
    if (d > 1) {
      uint32_t log2_ceil = 0;
      while ((uint64_t{1} << log2_ceil) < d) ++log2_ceil;
      const uint32_t p = 31 + log2_ceil;
      f.multiplier = static_cast<uint32_t>(((uint64_t{1} << p) + d - 1) / d);
      f.shift = p - 32;
    }
    return f;
  }
  HIQ_HD uint32_t Div(uint32_t n) const {
    if (divisor == 1) return n;
#if defined(__CUDA_ARCH__)
    return __umulhi(n, multiplier) >> shift;
#else
    return static_cast<uint32_t>((static_cast<uint64_t>(n) * multiplier) >> 32) >> shift;
#endif
  }
  // Returns n / divisor and stores n % divisor in *rem.
  HIQ_HD uint32_t DivMod(uint32_t n, uint32_t* rem) const {
    uint32_t q = Div(n);
    *rem = n - q * divisor;
    return q;
  }
};

// Units per launch stay below 2^31 so FastDivmod is exact; launchers split larger jobs by block.
constexpr uint32_t kMaxUnitsPerLaunch = 0x7FFFFFFFu;

// A work unit is one head of one stored row: unit u = ((((b * L + l) * P + p) * T + t) * H + h,
// the order of the payload bytes, so consecutive groups write consecutive bytes. For decode, L
// counts the launched layers only and l is relative to the first of them.
struct UnitShape {
  FastDivmod heads, tokens, planes, layers;

  static UnitShape Make(uint32_t num_heads, uint32_t block_tokens, uint32_t kv_planes,
                        uint32_t num_layers) {
    return {FastDivmod::Make(num_heads), FastDivmod::Make(block_tokens),
            FastDivmod::Make(kv_planes), FastDivmod::Make(num_layers)};
  }
  HIQ_HD void Decompose(uint32_t u, uint32_t* block, uint32_t* layer, uint32_t* plane,
                        uint32_t* token, uint32_t* head) const {
    u = heads.DivMod(u, head);
    u = tokens.DivMod(u, token);
    u = planes.DivMod(u, plane);
    *block = layers.DivMod(u, layer);
  }
};

// Elements one lane moves at a time: 8 x 16-bit = one 16-byte load or store.
constexpr uint32_t kChunkElems = 8;

// How a head of head_dim elements is spread over a group of lanes: group_lanes (a power of two,
// <= 32) lanes per head, each holding up to chunks_per_lane chunks (1, 2, 4 or 8) in registers.
struct GroupPlan {
  uint32_t group_lanes = 0;
  uint32_t chunks_per_lane = 0;
};
// head_dim up to kMaxHeadDim is supported; returns {0, 0} beyond.
constexpr uint32_t kMaxHeadDim = 32 * 8 * kChunkElems;  // 2,048
inline GroupPlan PlanGroups(uint32_t head_dim) {
  if (head_dim == 0 || head_dim > kMaxHeadDim) return {};
  const uint32_t chunks = (head_dim + kChunkElems - 1) / kChunkElems;
  uint32_t lanes = 1;
  while (lanes < chunks && lanes < 32) lanes *= 2;
  const uint32_t per_lane = (chunks + lanes - 1) / lanes;
  uint32_t rounded = 1;
  while (rounded < per_lane) rounded *= 2;
  return {lanes, rounded};
}

}  // namespace cuda_detail
}  // namespace hiqcache::kernels
