// CUDA runtime errors as Status: one mapping for the daemon's CUDA backend, its handle owners and
// the client library's CUDA export. Include only from code built against the CUDA runtime (this
// header includes <cuda_runtime_api.h>).
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "hiqcache/status.h"

namespace hiqcache {

// "cudaErrorName (description)".
inline std::string CudaErrorText(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

// Errors after which the context is unusable for the rest of the process (CUDA runtime API
// documentation: "the process must be terminated and relaunched").
inline bool IsStickyCudaError(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorUnknown:
    case cudaErrorContextIsDestroyed:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemNotReady:
    case cudaErrorNvlinkUncorrectable:
      return true;
    default:
      return false;
  }
}

// The failed runtime call `what` as a Status, clearing a non-sticky error (a sticky one stays
// whatever is done): sticky -> DATA_LOSS (the process must stop using the device), out of
// memory -> RESOURCE_EXHAUSTED, a bad value, handle or device -> INVALID_ARGUMENT, no device or
// driver -> FAILED_PRECONDITION, anything else -> INTERNAL.
inline Status FromCuda(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();
  const std::string text = std::string(what) + ": " + CudaErrorText(err);
  if (IsStickyCudaError(err)) return DataLoss(text);
  if (err == cudaErrorMemoryAllocation) return ResourceExhausted(text);
  if (err == cudaErrorInvalidValue || err == cudaErrorInvalidResourceHandle ||
      err == cudaErrorInvalidDevice) {
    return InvalidArgument(text);
  }
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    return FailedPrecondition(text);
  }
  return Internal(text);
}

}  // namespace hiqcache
