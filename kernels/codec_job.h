// What an executor is asked to do: gather rows from an engine's KV views and encode them into
// block payloads, or decode block payloads and scatter them into the views.
//
// The same job descriptions drive the scalar reference, the SIMD CPU executor and (with device
// pointers) the CUDA kernels. Plain structs; the caller owns every pointed-to array and keeps it
// alive for the duration of the call.
#pragma once

#include <cstddef>
#include <cstdint>

#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::kernels {

struct EncodeJob {
  BlockLayout layout;
  const LayerViews* layers = nullptr;  // layout.num_layers entries
  const uint32_t* rows = nullptr;      // num_blocks * block_tokens source slots, block-major
  uint8_t* const* blocks = nullptr;    // num_blocks payload pointers (BlockBytes() each)
  uint32_t num_blocks = 0;
  // Out: num_blocks flags, set to 1 where a row of that block held NaN or Inf (INT8, FP8, INT4);
  // the payload of such a block is unspecified and must not be published. May be null for RAW.
  uint8_t* nonfinite = nullptr;
  // Optional (CPU executor): called once per (block, layer) as soon as that layer of that block
  // is encoded (all its planes and tokens), before Encode returns, on the codec thread that
  // encoded it, so from several threads at once. Lets the caller consume a block's payload
  // layer by layer while the rest is still being encoded (a HOST backup hashes it).
  void (*layer_encoded)(void* context, uint32_t block, uint32_t layer) = nullptr;
  void* layer_encoded_context = nullptr;
  // The allot codecs (CODEC_INT4/5/6_ALLOT) on the CUDA executor: its key turn's
  // angles, RopeTableFloats(layout) floats (RopeTable, rope_turn.h), device-accessible. The CPU
  // executors compute their own and ignore it.
  const float* rope = nullptr;
};

struct DecodeJob {
  BlockLayout layout;
  const LayerViews* layers = nullptr;
  const uint32_t* rows = nullptr;  // num_blocks * block_tokens destination slots
  const uint8_t* const* blocks = nullptr;
  uint32_t num_blocks = 0;
  const float* rope = nullptr;  // as EncodeJob::rope
};

// Floats of a job's RoPE table: block_tokens x head_dim / 2 cosines, then as many sines, for
// the allot codecs; 0 for every other codec.
inline size_t RopeTableFloats(const BlockLayout& layout) {
  return layout.row.IsAllot() ? size_t{layout.block_tokens} * layout.row.head_dim : 0;
}

}  // namespace hiqcache::kernels
