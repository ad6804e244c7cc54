// The stored form of KV: row and block layout of every codec (docs/design.md "Record format").
//
// A row is one (token, layer, K|V) slice of H heads x D dims. A block holds block_tokens tokens
// laid out [layer][K|V][token][row], so one layer of one block is one contiguous range: restore
// can signal per layer. Value types; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec_math.h"
#include "hiqcache/codec_names.h"

namespace hiqcache::kernels {

enum class CodecKind : uint8_t {
  kInt8PerHead = 0,     // H*D int8 codes (head-major) | H bf16 scales
  kRaw = 1,             // the input dtype's bytes as-is (bit-exact control)
  kFp8E4m3PerHead = 2,  // H*D E4M3FN codes (head-major) | H bf16 scales: INT8's row size
  // H*D/2 bytes of two's-complement nibbles (head-major, group-major inside a head; element 2i
  // in the low nibble) | H*D/32 bf16 scales, one per group of 32 elements. D % 32 == 0.
  kInt4G32PerHead = 3,
  // KIVI-style INT4, stored per plane of a block (see BlockLayout): plane 0 (K, or MLA's one
  // latent plane) holds block_tokens rows of H*D/2 bytes of unsigned nibbles (element 2i low),
  // then H*D zero points (the input dtype's bits) and H*D bf16 scales, one pair per channel
  // (head, dim) over the block's tokens; plane 1 (V) holds block_tokens kInt4G32PerHead rows.
  // D % 32 == 0.
  kInt4Kivi = 4,
  // INT4 in a Hadamard-rotated basis, stored per plane of a block (codec_math.h "INT4
  // Hadamard"): row 0 of every plane (each block's first token) is a kInt8PerHead row of the
  // unrotated input; rows 1..block_tokens-1 hold the rotated elements as unsigned nibbles
  // (element 2i low): plane 0 (K, or MLA's latent plane) H*D/2 bytes of codes per row, then H*D
  // bf16 zero points and H*D bf16 scales, one pair per channel over those rows (absent when
  // block_tokens == 1); plane 1 (V) rows of H*D/2 bytes of codes, then H*D/32 bf16 zero points
  // and H*D/32 bf16 scales, one pair per group of 32 rotated elements. D % 32 == 0.
  kInt4Hadamard = 5,
  // Keys turned back by RoPE and stored at bits allotted per channel, values rotated at 5 bits,
  // stored per plane of a block (codec_math.h "INT4, INT5 and INT6 allot"): row 0 of every plane
  // (each block's first token) is a kInt8PerHead row of the input; plane 0 (K)
  // rows 1..block_tokens-1 hold the turned keys' codes, channel c's at the sum of the earlier
  // channels' widths (2-8 bits each, derived from the channel parameters: AllotKeyRowBits, 21/4
  // bits per element, in all), then H bf16 steps and H*D int8 lower and H*D int8 upper channel
  // bounds in steps (absent when block_tokens == 1); plane 1 (V) rows hold H*D 5-bit codes of the
  // rotated elements, then H bf16 zero points and H bf16 scales, one pair per head. D % 32 == 0; K
  // and V planes only.
  kInt5Allot = 6,
  // kInt5Allot's format with values at 6 bits (kInt6AllotBits): its K plane, V rows of H*D
  // 6-bit codes, then H bf16 zero points and H bf16 scales.
  kInt6Allot = 7,
  // kInt5Allot's format with keys at 4.4375 bits per element on average (AllotKeyRowBits: 71/16,
  // down to whole bytes) and values at 4 bits (kInt4AllotBits).
  kInt4Allot = 8,
};

// CodecKind is numbered as the wire's Codec; its names are hiqcache/codec_names.h's.
static_assert(static_cast<uint32_t>(CodecKind::kInt4Allot) + 1 == kCodecCount,
              "a new CodecKind needs its row in kCodecNames (hiqcache/codec_names.h)");
// Its names ("CODEC_UNKNOWN" / "unknown" for a value past the table: never read out of it).
inline const char* CodecContractName(CodecKind c) {
  const auto i = static_cast<uint32_t>(c);
  return i < kCodecCount ? kCodecNames[i].contract : "CODEC_UNKNOWN";
}
inline const char* CodecTextName(CodecKind c) {
  const auto i = static_cast<uint32_t>(c);
  return i < kCodecCount ? kCodecNames[i].text : "unknown";
}
// The codec of a wire value (the proto's Codec number); false for a value that names none.
inline bool CodecKindFromWire(int64_t value, CodecKind* out) {
  if (value < 0 || value >= int64_t{kCodecCount}) return false;
  *out = static_cast<CodecKind>(value);
  return true;
}
// The allot codecs' widths (INT4, INT5 and INT6 allot: one format, keys turned back by RoPE);
// zero for every other codec.
HIQ_HD AllotBits AllotBitsOf(CodecKind c) {
  return c == CodecKind::kInt5Allot   ? kInt5AllotBits
         : c == CodecKind::kInt6Allot ? kInt6AllotBits
         : c == CodecKind::kInt4Allot ? kInt4AllotBits
                                      : AllotBits{};
}
// Codecs whose rows group 32 elements of a head (INT4 G32, KIVI, Hadamard, the allot codecs):
// they take head_dim only in multiples of kInt4GroupElems.
inline bool CodecNeedsGroupedHeads(CodecKind c) {
  return c == CodecKind::kInt4G32PerHead || c == CodecKind::kInt4Kivi ||
         c == CodecKind::kInt4Hadamard || AllotBitsOf(c).value != 0;
}

struct RowFormat {
  uint32_t num_heads = 0;
  uint32_t head_dim = 0;
  DType dtype = DType::kBF16;
  CodecKind codec = CodecKind::kInt8PerHead;
  // RoPE of the keys, for codecs that turn them back (IsAllot()): the base (0 = no turn) and the
  // pairing (false: dims (i, i + D/2); true: (2i, 2i + 1)). 0 and false for every other codec.
  double rope_theta = 0.0;
  bool rope_interleaved = false;

  HIQ_HD size_t ElementsPerRow() const { return static_cast<size_t>(num_heads) * head_dim; }
  // Bytes of one row as the engine holds it (BF16/FP16).
  HIQ_HD size_t InputRowBytes() const { return ElementsPerRow() * 2; }
  // Bytes of one stored row: H*D + 2H for INT8 and FP8 (1,040 for 8x128), 2*H*D for RAW,
  // H*D/2 + 2*H*D/32 for INT4 and KIVI's V rows (576 for 8x128).
  HIQ_HD size_t RowBytes() const {
    if (codec == CodecKind::kRaw) return ElementsPerRow() * 2;
    if (IsInt4Rows()) return CodeBytes() + 2u * ScaleCount();
    return ElementsPerRow() + 2u * num_heads;
  }
  // Bytes of one stored row of `plane` after its first: RowBytes(), except KIVI's K rows and
  // Hadamard's plane-0 rows (codes only, H*D/2), Hadamard's plane-1 rows (H*D/2 + H*D/8), INT5
  // allot's K rows (codes only, 21*H*D/32) and V rows (5*H*D/8 + 4H), INT6 allot's the same K
  // rows and V rows of 6*H*D/8 + 4H, INT4 allot's K rows of floor(71*H*D/128) and V rows of
  // 4*H*D/8 + 4H.
  HIQ_HD size_t PlaneRowBytes(uint32_t plane) const {
    if (IsAllot()) {
      return plane == 0 ? AllotKeyRowBytes(ElementsPerRow(), Allot())
                        : AllotValueCodeBytes(ElementsPerRow(), Allot()) + 4u * num_heads;
    }
    if (codec == CodecKind::kInt4Hadamard) {
      return plane == 0 ? ElementsPerRow() / 2
                        : ElementsPerRow() / 2 + 4 * (ElementsPerRow() / kInt4GroupElems);
    }
    return codec == CodecKind::kInt4Kivi && plane == 0 ? ElementsPerRow() / 2 : RowBytes();
  }
  // Bytes of a plane's first stored row (token 0 of the block): an INT8 row (H*D + 2H) where
  // FirstRowIsInt8(), else PlaneRowBytes(plane).
  HIQ_HD size_t FirstRowBytes(uint32_t plane) const {
    return FirstRowIsInt8() ? FirstRowFormat().RowBytes() : PlaneRowBytes(plane);
  }
  // Offset of token t's row inside a plane (t == block_tokens: its parameters, where it has any).
  HIQ_HD size_t PlaneRowOffset(uint32_t plane, uint32_t t) const {
    return t == 0 ? 0 : FirstRowBytes(plane) + static_cast<size_t>(t - 1) * PlaneRowBytes(plane);
  }
  // Bytes after the rows of a plane: the K channel parameters of KIVI and Hadamard (H*D zero
  // points and H*D bf16 scales, 4*H*D), else 0. Hadamard's are absent from a one-token block.
  // The allot codecs' K plane: H bf16 steps, H*D int8 lower and H*D int8 upper bounds
  // (2H + 2*H*D).
  HIQ_HD size_t PlaneParamBytes(uint32_t plane) const {
    if (IsAllot()) return plane == 0 ? 2u * num_heads + 2 * ElementsPerRow() : 0;
    return (codec == CodecKind::kInt4Kivi || codec == CodecKind::kInt4Hadamard) && plane == 0
               ? ElementsPerRow() * 4
               : 0;
  }
  // Bytes of the codes at the start of a stored row (the scales follow). Not for RAW.
  HIQ_HD size_t CodeBytes() const { return IsInt4Rows() ? ElementsPerRow() / 2 : ElementsPerRow(); }
  // bf16 scales of a stored row: one per head, or per group of 32 elements for INT4.
  HIQ_HD size_t ScaleCount() const {
    return IsInt4Rows() ? ElementsPerRow() / kInt4GroupElems : num_heads;
  }
  // Whether a plane's first row (token 0 of a block) is an INT8 row: Hadamard's and the allot
  // codecs'.
  HIQ_HD bool FirstRowIsInt8() const { return codec == CodecKind::kInt4Hadamard || IsAllot(); }
  // The allot codecs (INT4, INT5 and INT6 allot: one format, keys turned back by RoPE), and
  // their widths (zero for every other codec).
  HIQ_HD bool IsAllot() const { return Allot().value != 0; }
  HIQ_HD AllotBits Allot() const { return AllotBitsOf(codec); }
  // The format of a plane's first row: INT8's where FirstRowIsInt8(), else this one.
  HIQ_HD RowFormat FirstRowFormat() const {
    RowFormat f = *this;
    if (FirstRowIsInt8()) {
      f.codec = CodecKind::kInt8PerHead;
      f.rope_theta = 0.0;
      f.rope_interleaved = false;
    }
    return f;
  }
  // Rows in kInt4G32PerHead's format: INT4's, and KIVI's V rows.
  HIQ_HD bool IsInt4Rows() const {
    return codec == CodecKind::kInt4G32PerHead || codec == CodecKind::kInt4Kivi;
  }
};

struct BlockLayout {
  RowFormat row;
  uint32_t num_layers = 0;
  uint32_t kv_planes = 2;  // 2 = K and V (MHA), 1 = one latent row (MLA)
  uint32_t block_tokens = 0;

  // Bytes of one plane of one layer: its rows, then its parameters (K planes of KIVI and
  // Hadamard only).
  HIQ_HD size_t PlaneBytes(uint32_t plane) const {
    if (block_tokens == 0) return 0;
    const bool params = !(row.FirstRowIsInt8() && block_tokens == 1);
    return row.FirstRowBytes(plane) +
           static_cast<size_t>(block_tokens - 1) * row.PlaneRowBytes(plane) +
           (params ? row.PlaneParamBytes(plane) : 0);
  }
  HIQ_HD size_t LayerBytes() const {
    size_t bytes = 0;
    for (uint32_t p = 0; p < kv_planes; ++p) bytes += PlaneBytes(p);
    return bytes;
  }
  HIQ_HD size_t BlockBytes() const { return LayerBytes() * num_layers; }
  // Stored bytes per token across all layers (74,880 for Qwen3-8B INT8): BlockBytes() /
  // block_tokens, rounded up where KIVI's per-block K parameters do not divide evenly.
  HIQ_HD size_t BytesPerToken() const {
    if (block_tokens == 0) return 0;
    return (BlockBytes() + block_tokens - 1) / block_tokens;
  }
  // Offset of plane `plane` of `layer` inside a block payload.
  HIQ_HD size_t PlaneOffset(uint32_t layer, uint32_t plane) const {
    return static_cast<size_t>(layer) * LayerBytes() + (plane == 0 ? 0 : PlaneBytes(0));
  }
  // Offset of (layer, plane, token)'s row inside a block payload (token == block_tokens: the
  // plane's parameters, where it has any).
  HIQ_HD size_t RowOffset(uint32_t layer, uint32_t plane, uint32_t token) const {
    return PlaneOffset(layer, plane) + row.PlaneRowOffset(plane, token);
  }
};

}  // namespace hiqcache::kernels
