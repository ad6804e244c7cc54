// hiqcache/cuda_status.h: the one mapping of CUDA runtime errors to Status that the daemon's
// backend, its handle owners and the client library share. Needs the CUDA runtime's error tables
// only, no device: label unit.
#include "hiqcache/cuda_status.h"

#include <gtest/gtest.h>

namespace hiqcache {
namespace {

TEST(CudaStatusTest, EachErrorClassHasItsCode) {
  EXPECT_TRUE(FromCuda(cudaSuccess, "x").ok());
  // Sticky: the context is gone for the rest of the process.
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorECCUncorrectable,
                        cudaErrorMisalignedAddress, cudaErrorAssert, cudaErrorUnknown}) {
    EXPECT_TRUE(IsStickyCudaError(e)) << cudaGetErrorName(e);
    EXPECT_EQ(FromCuda(e, "x").code(), StatusCode::kDataLoss) << cudaGetErrorName(e);
  }
  EXPECT_EQ(FromCuda(cudaErrorMemoryAllocation, "x").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(FromCuda(cudaErrorInvalidValue, "x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(FromCuda(cudaErrorInvalidResourceHandle, "x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(FromCuda(cudaErrorNoDevice, "x").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(FromCuda(cudaErrorInsufficientDriver, "x").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(FromCuda(cudaErrorNotReady, "x").code(), StatusCode::kInternal);
  EXPECT_FALSE(IsStickyCudaError(cudaErrorMemoryAllocation));
}

TEST(CudaStatusTest, TheMessageNamesTheCallAndTheError) {
  const Status st = FromCuda(cudaErrorMemoryAllocation, "cudaMalloc(4096)");
  EXPECT_NE(st.message().find("cudaMalloc(4096)"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("cudaErrorMemoryAllocation"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace hiqcache
