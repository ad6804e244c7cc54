// Whether this process can use a CUDA device: the one question asked before anything touches
// the CUDA backend (the daemon's `--device auto`, the gpu tests' GTEST_SKIP).
//
// Host-only; safe to call on a machine without a GPU or without the NVIDIA driver (the CUDA
// runtime then reports an error, which is returned as text, never raised). Thread-safe.
#pragma once

#include <string>

namespace hiqcache::kernels {

// Returns true when at least one CUDA device is visible and a context can be created on the
// current device (this initializes the CUDA runtime, once per process). Otherwise returns false
// and, when `why` is set, stores a one-line reason, e.g. "no CUDA driver:
// cudaErrorInsufficientDriver (...)" or "no CUDA device visible (CUDA_VISIBLE_DEVICES='')".
bool CudaDeviceAvailable(std::string* why);

}  // namespace hiqcache::kernels
