#include <cuda_runtime.h>

#include <string>

#include "kv_check.h"

namespace hiqcache::gputest {
namespace {

Status LaunchStatus(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                  cudaGetErrorString(err) + ")");
}

__global__ void FillPatternKernel(uint16_t* dst, uint64_t elements, uint64_t seed,
                                  uint32_t tensor) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < elements;
       i += uint64_t{gridDim.x} * blockDim.x) {
    dst[i] = PatternBf16(seed, tensor, i);
  }
}

__global__ void CompareRowsKernel(kernels::StridedView view, const uint32_t* rows,
                                  uint32_t num_rows, uint32_t num_heads, uint32_t head_dim,
                                  const uint16_t* expected, unsigned long long* mismatches) {
  const uint64_t per_row = uint64_t{num_heads} * head_dim;
  const uint64_t total = per_row * num_rows;
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t r = static_cast<uint32_t>(i / per_row);
    const uint32_t h = static_cast<uint32_t>(i % per_row / head_dim);
    const uint32_t d = static_cast<uint32_t>(i % head_dim);
    const uint16_t got = reinterpret_cast<const uint16_t*>(view.Head(rows[r], h))[d];
    bad += got != expected[i];
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

__global__ void GatherRowsKernel(kernels::StridedView view, const uint32_t* rows, uint32_t num_rows,
                                 uint32_t num_heads, uint32_t head_dim, uint16_t* out) {
  const uint64_t per_row = uint64_t{num_heads} * head_dim;
  const uint64_t total = per_row * num_rows;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t r = static_cast<uint32_t>(i / per_row);
    const uint32_t h = static_cast<uint32_t>(i % per_row / head_dim);
    const uint32_t d = static_cast<uint32_t>(i % head_dim);
    out[i] = reinterpret_cast<const uint16_t*>(view.Head(rows[r], h))[d];
  }
}

__device__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinUntilKernel(const volatile uint32_t* flag, uint64_t timeout_ns) {
  const uint64_t start = GlobalTimerNs();
  while (*flag == 0) {
    if (GlobalTimerNs() - start > timeout_ns) break;
    __nanosleep(1000);
  }
}

__global__ void BusyKernel(float* sink, uint32_t iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 1e-4f;
  for (uint32_t i = 0; i < iters; ++i) {
    a = fmaf(a, b, c);
    b = fmaf(b, 0.99999f, 1e-6f);
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = a + b;
}

uint32_t GridFor(uint64_t work) {
  const uint64_t blocks = (work + 255) / 256;
  return static_cast<uint32_t>(blocks < 4096 ? (blocks == 0 ? 1 : blocks) : 4096);
}

}  // namespace

Status LaunchFillPattern(uint16_t* dst, uint64_t elements, uint64_t seed, uint32_t tensor,
                         CUstream_st* stream) {
  FillPatternKernel<<<GridFor(elements), 256, 0, stream>>>(dst, elements, seed, tensor);
  return LaunchStatus("FillPatternKernel");
}

Status LaunchCompareRows(const kernels::StridedView& view, const uint32_t* rows, uint32_t num_rows,
                         uint32_t num_heads, uint32_t head_dim, const uint16_t* expected,
                         unsigned long long* mismatches, CUstream_st* stream) {
  const uint64_t work = uint64_t{num_rows} * num_heads * head_dim;
  CompareRowsKernel<<<GridFor(work), 256, 0, stream>>>(view, rows, num_rows, num_heads, head_dim,
                                                       expected, mismatches);
  return LaunchStatus("CompareRowsKernel");
}

Status LaunchGatherRows(const kernels::StridedView& view, const uint32_t* rows, uint32_t num_rows,
                        uint32_t num_heads, uint32_t head_dim, uint16_t* out, CUstream_st* stream) {
  const uint64_t work = uint64_t{num_rows} * num_heads * head_dim;
  GatherRowsKernel<<<GridFor(work), 256, 0, stream>>>(view, rows, num_rows, num_heads, head_dim,
                                                      out);
  return LaunchStatus("GatherRowsKernel");
}

Status LaunchSpinUntil(const volatile uint32_t* flag, uint64_t timeout_ns, CUstream_st* stream) {
  SpinUntilKernel<<<1, 32, 0, stream>>>(flag, timeout_ns);
  return LaunchStatus("SpinUntilKernel");
}

Status LaunchBusyKernel(float* sink, uint32_t blocks, uint32_t iters, CUstream_st* stream) {
  BusyKernel<<<blocks, 256, 0, stream>>>(sink, iters);
  return LaunchStatus("BusyKernel");
}

}  // namespace hiqcache::gputest
