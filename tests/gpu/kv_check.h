// Device helpers of the gpu client tests and the GPU benchmark: a deterministic KV fill (the same
// value on host and device, so a second process can know what the first one backed up), and
// kernels that compare or gather the rows a restore wrote. Launchers enqueue on `stream` and do
// not synchronize. Includes no CUDA header (cudaStream_t == CUstream_st*). Thread-safe.
#pragma once

#include <cstdint>

#include "codec_math.h"
#include "hiqcache/status.h"
#include "tensor_view.h"

struct CUstream_st;

namespace hiqcache::gputest {

// BF16 bits of element `index` of tensor `tensor` of data set `seed`: roughly Gaussian, with a
// per-head magnitude from 2^-6 to 2^6 (heads of 128 elements), an outlier now and then, and
// every 61st head all zero (the codec's exact-zero path).
HIQ_HD uint16_t PatternBf16(uint64_t seed, uint32_t tensor, uint64_t index) {
  const uint64_t head = index >> 7;
  if (head % 61 == 60) return 0;
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + (uint64_t{tensor} << 40) + index;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  // Sum of four 16-bit uniforms: mean 2 * 65535, roughly normal.
  const float u = static_cast<float>((z & 0xFFFF) + ((z >> 16) & 0xFFFF) + ((z >> 32) & 0xFFFF) +
                                     ((z >> 48) & 0xFFFF)) *
                      (1.0f / 65536.0f) -
                  2.0f;
  uint64_t h = head * 0x9E3779B97F4A7C15ull + seed;
  h ^= h >> 29;
  const int exp = static_cast<int>(h % 13) - 6;  // per-head magnitude 2^-6 .. 2^6
  float v = u * kernels::BitsToFloat(static_cast<uint32_t>(127 + exp) << 23);
  if ((z >> 56) == 0xA5) v *= 40.0f;  // rare outlier: the head's scale is set by it
  return kernels::FloatToBf16Sat(v);
}

// Fills `elements` BF16 values at `dst` with PatternBf16(seed, tensor, 0 .. elements-1).
Status LaunchFillPattern(uint16_t* dst, uint64_t elements, uint64_t seed, uint32_t tensor,
                         CUstream_st* stream);

// Compares head_dim x num_heads elements of each of `rows[0, num_rows)` in `view` with
// `expected` ([num_rows][num_heads][head_dim], contiguous) bit for bit; adds the number of
// differing elements to *mismatches (device memory).
Status LaunchCompareRows(const kernels::StridedView& view, const uint32_t* rows, uint32_t num_rows,
                         uint32_t num_heads, uint32_t head_dim, const uint16_t* expected,
                         unsigned long long* mismatches, CUstream_st* stream);

// Copies rows[0, num_rows) of `view` into `out` ([num_rows][num_heads][head_dim]).
Status LaunchGatherRows(const kernels::StridedView& view, const uint32_t* rows, uint32_t num_rows,
                        uint32_t num_heads, uint32_t head_dim, uint16_t* out, CUstream_st* stream);

// One 32-thread block that spins until *flag != 0 (a mapped pinned host word) or `timeout_ns`
// passed on the GPU's global timer. Events recorded after it on `stream` stay pending until then.
Status LaunchSpinUntil(const volatile uint32_t* flag, uint64_t timeout_ns, CUstream_st* stream);

// A compute-bound kernel standing in for a forward pass: `blocks` x 256 threads, each running
// `iters` dependent FMAs; writes one float per thread into `sink` (blocks * 256 floats).
Status LaunchBusyKernel(float* sink, uint32_t blocks, uint32_t iters, CUstream_st* stream);

}  // namespace hiqcache::gputest
