// Stand-in for <cuda_runtime.h> in the host build of kernels/cuda/codec_cuda.cu
// (HIQ_CUDA_EMULATION, see cuda_emulation.h for the execution model): the CUDA subset that file
// uses (and the other three warp shuffles), with CUDA's semantics, compiled by the host C++
// compiler.
//
//   device side: __global__/__device__/__forceinline__/__launch_bounds__, threadIdx, blockIdx,
//                blockDim, gridDim, warpSize, uint2/uint4 (8/16-byte aligned) and make_*,
//                __ldcs (alignment-checked), __vmaxu2, __shfl_{sync,up,down,xor}_sync,
//                __syncwarp (a barrier of the lanes in its mask, as a shuffle is), min/max on
//                integers;
//   host side:   cudaError_t and its texts, cudaGetLastError, cudaGetDevice,
//                cudaDeviceGetAttribute(MultiProcessorCount), cudaMemcpyAsync and
//                cudaMemsetAsync (host memory is device memory; synchronous), and
//                hiqcache::cuda_emulation::Launch, which codec_cuda.cu's HIQ_LAUNCH maps
//                `kernel<<<grid, block, 0, stream>>>(args)` to.
// Anything else (shared memory, __syncthreads, atomics, other intrinsics) is deliberately absent
// so a kernel that starts using it fails to build here instead of being emulated wrongly.
//
// Include only from the emulated kernel build and the emulator's own tests: it defines
// global names (threadIdx, min, uint4, ...) that the real CUDA headers also define.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "cuda_emulation.h"

#if defined(__CUDACC__)
#error "cuda_runtime_emulation.h is for host compilers; nvcc has the real CUDA runtime"
#endif

// ---------------------------------------------------------------------------------------------
// Function and launch qualifiers.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)

// ---------------------------------------------------------------------------------------------
// Vector types (CUDA's vector_types.h: the same sizes and alignments).
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
};
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}

// ---------------------------------------------------------------------------------------------
// Built-in variables: set by the emulator before it resumes a lane (all lanes of a host thread
// share the thread_local; it always holds the running lane's values).
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Integer min/max as CUDA's device overloads (same-type operands only: a mixed call does not
// compile here, where CUDA would pick an overload by its own promotion rules).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Intrinsics.

// Per 16-bit half: unsigned max.
inline unsigned int __vmaxu2(unsigned int a, unsigned int b) {
  const unsigned int lo = (a & 0xFFFFu) > (b & 0xFFFFu) ? (a & 0xFFFFu) : (b & 0xFFFFu);
  const unsigned int hi = (a >> 16) > (b >> 16) ? (a >> 16) : (b >> 16);
  return (hi << 16) | lo;
}

// Load with the evict-first hint: a plain load. A vector load from an address not aligned to
// its size faults on a GPU (cudaErrorMisalignedAddress); here it is reported as a launch error.
template <typename T>
inline T __ldcs(const T* p) {
  if ((reinterpret_cast<uintptr_t>(p) & (alignof(T) - 1)) != 0) {
    ::hiqcache::cuda_emulation::ReportLaneError("__ldcs: misaligned " + std::to_string(sizeof(T)) +
                                                "-byte load");
  }
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

namespace hiqcache::cuda_emulation {
template <typename T>
inline T ShuffleAs(ShuffleKind kind, unsigned int mask, T var, int arg, int width) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles move 32- or 64-bit values");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = Shuffle(kind, mask, bits, arg, width);
  std::memcpy(&var, &bits, sizeof(T));
  return var;
}
}  // namespace hiqcache::cuda_emulation

template <typename T>
inline T __shfl_sync(unsigned int mask, T var, int src_lane, int width = warpSize) {
  return ::hiqcache::cuda_emulation::ShuffleAs(::hiqcache::cuda_emulation::ShuffleKind::kIdx, mask,
                                               var, src_lane, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
  return ::hiqcache::cuda_emulation::ShuffleAs(::hiqcache::cuda_emulation::ShuffleKind::kUp, mask,
                                               var, static_cast<int>(delta), width);
}
template <typename T>
inline T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = warpSize) {
  return ::hiqcache::cuda_emulation::ShuffleAs(::hiqcache::cuda_emulation::ShuffleKind::kDown, mask,
                                               var, static_cast<int>(delta), width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = warpSize) {
  return ::hiqcache::cuda_emulation::ShuffleAs(::hiqcache::cuda_emulation::ShuffleKind::kXor, mask,
                                               var, lane_mask, width);
}

// The lanes of `mask` wait for each other; what each wrote before is visible to the others after
// (CUDA's memory ordering among the participating lanes). Lanes run one at a time here, so the
// ordering holds by itself; the barrier is a shuffle of nothing, with a shuffle's rules.
inline void __syncwarp(unsigned int mask = 0xFFFFFFFFu) {
  ::hiqcache::cuda_emulation::Shuffle(::hiqcache::cuda_emulation::ShuffleKind::kIdx, mask, 0,
                                      static_cast<int>(::hiqcache::cuda_emulation::CurrentLane()),
                                      warpSize);
}

// ---------------------------------------------------------------------------------------------
// Host runtime API (the codes are the CUDA runtime's numbers).
enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
};
enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr : int { cudaDevAttrMultiProcessorCount = 16 };

struct CUstream_st;
using cudaStream_t = CUstream_st*;

// Returns and clears the calling thread's last error (a failed launch sets it).
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t err);
// For a launch failure: the emulator's description of what went wrong (per thread, valid until
// the next failing launch of that thread).
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemsetAsync(void* dst, int value, size_t count, cudaStream_t stream = nullptr);

namespace hiqcache::cuda_emulation {

// Sets the calling thread's last error (what a failed launch leaves for cudaGetLastError).
void SetLastLaunchError(cudaError_t err, const std::string& detail);

template <typename Params>
struct Launcher {
  void (*kernel)(Params);
  Dim grid, block;
  void operator()(const Params& params) const {
    std::string error;
    // Each thread gets its own copy of the parameters, as kernel arguments are on a GPU.
    if (!RunGrid(
            grid, block, [&] { kernel(params); }, &error)) {
      SetLastLaunchError(cudaErrorLaunchFailure, error);
    }
  }
};

// kernel<<<grid, block, 0, stream>>>(params) == Launch(kernel, grid, block, stream)(params).
template <typename Params>
Launcher<Params> Launch(void (*kernel)(Params), dim3 grid, dim3 block, cudaStream_t stream) {
  (void)stream;  // synchronous: every launch completes before Launch returns
  return Launcher<Params>{kernel, Dim{grid.x, grid.y, grid.z}, Dim{block.x, block.y, block.z}};
}

}  // namespace hiqcache::cuda_emulation
