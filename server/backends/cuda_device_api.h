// CudaDeviceApi: DeviceApi over the real CUDA runtime (and the codec launchers of
// kernels/cuda/codec_cuda.h). Built only with CUDA (HIQ_HAVE_CUDA); this header includes no CUDA
// header, so hiqcached_main.cc stays CUDA-free.
//
// Create() switches every visible device to cudaDeviceScheduleBlockingSync, so that anything in
// the process that synchronizes sleeps instead of spinning a core (the daemon synchronizes only
// on its completion events, created with cudaEventBlockingSync, from its completion threads:
// device_completion.h). Errors are classified: sticky errors
// (illegal address, launch failure, uncorrectable ECC, ...; the context is lost) are returned as
// kDataLoss, allocation failures as kResourceExhausted, the rest as kInternal or
// kInvalidArgument. Thread-safe.
#pragma once

#include <memory>

#include "backends/device_api.h"

namespace hiqcache::server {

// REQUIRES: kernels::CudaDeviceAvailable() said yes.
StatusOr<std::unique_ptr<DeviceApi>> CreateCudaDeviceApi();

}  // namespace hiqcache::server
