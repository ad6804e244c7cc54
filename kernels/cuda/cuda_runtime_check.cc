#include "cuda_runtime_check.h"

#include <cuda_runtime_api.h>

#include <cstdlib>

namespace hiqcache::kernels {
namespace {

std::string ErrorText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

std::string VisibleDevicesNote() {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr) return "";
  return std::string(" (CUDA_VISIBLE_DEVICES='") + visible + "')";
}

}  // namespace

bool CudaDeviceAvailable(std::string* why) {
  std::string reason;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice || (err == cudaSuccess && count == 0)) {
    reason = "no CUDA device visible" + VisibleDevicesNote();
  } else if (err == cudaErrorInsufficientDriver) {
    reason = "no CUDA driver (or one older than the runtime): " + ErrorText(err);
  } else if (err != cudaSuccess) {
    reason = "cudaGetDeviceCount failed: " + ErrorText(err);
  } else {
    // A device is listed; make sure a context can actually be created on it (a device held in
    // exclusive-process mode by another process, or a broken MIG setup, fails here).
    err = cudaFree(nullptr);
    if (err != cudaSuccess) reason = "cannot create a CUDA context: " + ErrorText(err);
  }
  if (reason.empty()) return true;
  cudaGetLastError();  // clear a non-sticky error so later calls do not see it
  if (why != nullptr) *why = reason;
  return false;
}

}  // namespace hiqcache::kernels
