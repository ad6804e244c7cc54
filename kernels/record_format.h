// The stored form of KV: row and block layout of every codec (docs/design.md "Record format").
//
// A row is one (token, layer, K|V) slice of H heads x D dims. A block holds block_tokens tokens
// laid out [layer][K|V][token][row], so one layer of one block is one contiguous range: restore
// can signal per layer. Value types; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec_math.h"

namespace hiqcache::kernels {

enum class CodecKind : uint8_t {
  kInt8PerHead = 0,     // H*D int8 codes (head-major) | H bf16 scales
  kRaw = 1,             // the input dtype's bytes as-is (bit-exact control)
  kFp8E4m3PerHead = 2,  // H*D E4M3FN codes (head-major) | H bf16 scales: INT8's row size
  // H*D/2 bytes of two's-complement nibbles (head-major, group-major inside a head; element 2i
  // in the low nibble) | H*D/32 bf16 scales, one per group of 32 elements. D % 32 == 0.
  kInt4G32PerHead = 3,
};

struct RowFormat {
  uint32_t num_heads = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kBF16;
  CodecKind codec = CodecKind::kInt8PerHead;

  HIQ_HD size_t ElementsPerRow() const { return static_cast<size_t>(num_heads) * head_dim; }
  // Bytes of one row as the engine holds it (BF16/FP16).
  HIQ_HD size_t InputRowBytes() const { return ElementsPerRow() * 2; }
  // Bytes of one stored row: H*D + 2H for INT8 and FP8 (1,040 for 8x128), 2*H*D for RAW,
  // H*D/2 + 2*H*D/32 for INT4 (576 for 8x128).
  HIQ_HD size_t RowBytes() const {
    if (codec == CodecKind::kRaw) return ElementsPerRow() * 2;
    if (codec == CodecKind::kInt4G32PerHead) return CodeBytes() + 2u * ScaleCount();
    return ElementsPerRow() + 2u * num_heads;
  }
  // Bytes of the codes at the start of a stored row (the scales follow). Not for RAW.
  HIQ_HD size_t CodeBytes() const {
    return codec == CodecKind::kInt4G32PerHead ? ElementsPerRow() / 2 : ElementsPerRow();
  }
  // bf16 scales of a stored row: one per head, or per group of 32 elements for INT4.
  HIQ_HD size_t ScaleCount() const {
    return codec == CodecKind::kInt4G32PerHead ? ElementsPerRow() / kInt4GroupElems : num_heads;
  }
};

struct BlockLayout {
  RowFormat row;
  uint32_t num_layers = 0;
  uint32_t kv_planes = 2;  // 2 = K and V (MHA), 1 = one latent row (MLA)
  uint32_t block_tokens = 0;

  HIQ_HD size_t PlaneBytes() const { return static_cast<size_t>(block_tokens) * row.RowBytes(); }
  HIQ_HD size_t LayerBytes() const { return PlaneBytes() * kv_planes; }
  HIQ_HD size_t BlockBytes() const { return LayerBytes() * num_layers; }
  // Stored bytes per token across all layers (74,880 for Qwen3-8B INT8).
  HIQ_HD size_t BytesPerToken() const {
    return static_cast<size_t>(num_layers) * kv_planes * row.RowBytes();
  }
  // Offset of (layer, plane, token)'s row inside a block payload.
  HIQ_HD size_t RowOffset(uint32_t layer, uint32_t plane, uint32_t token) const {
    return static_cast<size_t>(layer) * LayerBytes() + static_cast<size_t>(plane) * PlaneBytes() +
           static_cast<size_t>(token) * row.RowBytes();
  }
};

}  // namespace hiqcache::kernels
