// The CUDA kernels and launchers of codec_cuda.cu, compiled by the host C++ compiler against the
// CPU emulation of the CUDA subset they use (cuda_runtime_emulation.h, cuda_emulation.h), so the
// kernels run, byte for byte as on a GPU barring what cuda_emulation.h lists, where there is no
// GPU. The kernel source is included, not copied. Defines the same symbols as hiq_kernels_cuda
// (LaunchEncode, ...): a binary links one or the other (hiq_kernels_cuda_emulated: tests only).
#define HIQ_CUDA_EMULATION 1
#include "codec_cuda.cu"
