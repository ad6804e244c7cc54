// CPU emulation of CUDA kernel execution, for running kernels/cuda/codec_cuda.cu where there is no
// GPU (CI). This header is the control side, free of CUDA names: how a launch runs, what the
// tests can observe and inject. cuda_runtime_emulation.h is the CUDA-named side (threadIdx,
// __shfl_xor_sync, uint4, cudaMemcpyAsync, ...) that codec_cuda.cu compiles against when
// HIQ_CUDA_EMULATION is defined (kernels/cuda/codec_cuda_emulated.cc).
//
// Execution model. A launch runs synchronously on the calling thread, CTA by CTA in blockIdx
// order, and inside a CTA warp by warp. The 32 lanes of a warp are fibers (ucontext) on the
// calling thread. Lanes run one after another until each has either exited or reached a warp
// shuffle; then every shuffle whose mask names only lanes waiting at a shuffle with that same
// mask completes at once (all source values were posted before any result is read, as on a GPU)
// and those lanes run on. So the lanes of a warp are in lock-step exactly at the shuffles.
// Defined as errors, as the CUDA programming guide leaves them undefined: a shuffle whose mask
// names an exited lane, a lane outside the mask or a lane waiting with a different mask (a
// divergent shuffle), a mask not naming the calling lane, and reading a lane outside the mask.
// A launch with an error stops at that warp and reports it through cudaGetLastError (the
// launcher's Status then carries the text).
//
// Not emulated (the codec kernels use none of it; a kernel using it fails to compile here):
// shared memory, __syncthreads and other CTA-wide barriers, atomics, dynamic parallelism.
// __syncwarp is a warp barrier with a shuffle's rules (a shuffle that moves nothing).
// Not observable: timing and occupancy, register limits (__launch_bounds__ is
// accepted and ignored), memory ordering and races (lanes and warps run one at a time, so two
// lanes writing one byte, or a warp reading what another writes, cannot show), the caching
// hints of __ldcs, and streams (every call is synchronous; the stream argument is ignored).
// The `#if defined(__CUDA_ARCH__)` branches of codec_math.h (__umulhi, rintf, __uint_as_float)
// are not compiled here: the host twins next to them run instead.
//
// Thread-safety: launches from different threads are independent (per-thread state); the
// fault switch and the statistics are process-wide.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace hiqcache::cuda_emulation {

// Grid and CTA dimensions (the CUDA runtime's dim3).
struct Dim {
  uint32_t x = 1, y = 1, z = 1;
};

// Runs body() once per thread of a grid x block launch, each as a lane of a warp (see above).
// Before each call the emulated threadIdx/blockIdx/blockDim/gridDim are set. Returns false and
// sets *error when the launch configuration is invalid or a lane broke a shuffle rule.
bool RunGrid(Dim grid, Dim block, const std::function<void()>& body, std::string* error);

// The lane calling this waits until its warp's shuffle completes (see above) and returns the
// 64-bit value of the source lane (or its own value where CUDA defines that).
enum class ShuffleKind : uint8_t { kIdx, kUp, kDown, kXor };
uint64_t Shuffle(ShuffleKind kind, uint32_t mask, uint64_t value, int arg, int width);
// Lane index of the calling lane (0..31). REQUIRES: called from inside RunGrid's body.
uint32_t CurrentLane();
// Records an error of the running lane (e.g. a misaligned vector load); the launch reports the
// first one. The lane keeps running.
void ReportLaneError(const std::string& what);

// Fault injection, to prove the tests that compare emulated kernels with the reference catch a
// broken kernel: kShuffleWrongLane makes every shuffle read lane (src + 1) % 32 instead of src.
enum class Fault : uint8_t { kNone, kShuffleWrongLane };
void SetFault(Fault fault);

// The SM count cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount) reports (default 2, so
// default launch configurations stay small).
void SetSmCount(uint32_t sms);
uint32_t SmCount();

// Totals since the last ResetStats (all threads).
struct Stats {
  uint64_t launches = 0;
  uint64_t ctas = 0;
  uint64_t max_grid = 0;  // largest grid of one launch, in CTAs
  uint64_t lanes = 0;
  uint64_t shuffles = 0;  // completed warp-wide shuffle exchanges
};
Stats GetStats();
void ResetStats();

}  // namespace hiqcache::cuda_emulation
