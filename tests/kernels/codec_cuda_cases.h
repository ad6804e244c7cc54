// The cases and byte comparisons shared by the two tests of codec_cuda.cu's kernels: on a GPU
// (tests/gpu/codec_cuda_test.cc) and on the CPU emulator (codec_cuda_emulation_test.cc), so both
// run the same geometries and report a difference in the same words. Header-only and CUDA-free;
// every helper is deterministic.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "codec_test_util.h"
#include "rope_turn.h"

namespace hiqcache::kernels::testutil {

inline BlockLayout MakeLayout(DType dtype, CodecKind codec, uint32_t heads, uint32_t dim,
                              uint32_t layers, uint32_t planes, uint32_t block_tokens) {
  BlockLayout lay;
  lay.row.num_heads = heads;
  lay.row.head_dim = dim;
  lay.row.dtype = dtype;
  lay.row.codec = codec;
  lay.num_layers = layers;
  lay.kv_planes = planes;
  lay.block_tokens = block_tokens;
  return lay;
}

// The RoPE table a job of `lay` carries (EncodeJob::rope): empty for codecs without one.
inline std::vector<float> JobRope(const BlockLayout& lay) {
  return RopeTableFloats(lay) > 0 ? RopeTable(lay.row, lay.block_tokens) : std::vector<float>{};
}

// One parameterized case: a geometry, its codec and view, and how many blocks to move.
struct CudaCase {
  const char* name;
  DType dtype;
  CodecKind codec;
  uint32_t heads, dim, layers, planes, block_tokens, num_blocks;
  ViewKind kind;
  bool odd_bytes = false;   // views at odd byte addresses instead of `kind`'s shape
  double rope_theta = 0.0;  // the allot codecs' key turn
  bool rope_interleaved = false;

  BlockLayout layout() const {
    BlockLayout lay = MakeLayout(dtype, codec, heads, dim, layers, planes, block_tokens);
    lay.row.rope_theta = rope_theta;
    lay.row.rope_interleaved = rope_interleaved;
    return lay;
  }
  // Room for twice the rows moved, and a few more, so the rows are scattered.
  uint32_t num_rows() const { return num_blocks * block_tokens * 2 + 3; }
  // The rows moved, block-major: num_blocks * block_tokens distinct rows below num_rows().
  std::vector<uint32_t> rows() const {
    Rng rng(11);
    return RandomRows(num_rows(), static_cast<size_t>(num_blocks) * block_tokens, rng);
  }
};

inline void PrintTo(const CudaCase& c, std::ostream* os) { *os << c.name; }

// The geometries both kernel tests run: engine shapes (MLA included), head_dims with scalar
// tails, every view kind, INT8, FP8 E4M3, INT4, INT4 KIVI, INT4 Hadamard, INT4, INT5 and INT6
// allot and RAW.
inline std::vector<CudaCase> CudaGeometryCases() {
  constexpr CodecKind kInt8 = CodecKind::kInt8PerHead;
  constexpr CodecKind kFp8 = CodecKind::kFp8E4m3PerHead;
  constexpr CodecKind kInt4 = CodecKind::kInt4G32PerHead;
  constexpr CodecKind kRaw = CodecKind::kRaw;
  constexpr CodecKind kKivi = CodecKind::kInt4Kivi;
  constexpr CodecKind kHadamard = CodecKind::kInt4Hadamard;
  constexpr CodecKind kAllot = CodecKind::kInt5Allot;
  constexpr CodecKind kAllot6 = CodecKind::kInt6Allot;
  constexpr CodecKind kAllot4 = CodecKind::kInt4Allot;
  return {
      {"bf16_8x128_contiguous", DType::kBF16, kInt8, 8, 128, 3, 2, 16, 5, ViewKind::kContiguous},
      {"fp16_8x128_contiguous", DType::kFP16, kInt8, 8, 128, 3, 2, 16, 5, ViewKind::kContiguous},
      {"bf16_8x128_paged", DType::kBF16, kInt8, 8, 128, 3, 2, 16, 5, ViewKind::kPaged},
      {"fp16_8x128_packed_kv", DType::kFP16, kInt8, 8, 128, 2, 2, 16, 4, ViewKind::kPackedKV},
      {"bf16_8x128_strided", DType::kBF16, kInt8, 8, 128, 2, 2, 16, 4, ViewKind::kStrided},
      {"bf16_1x576_mla_contiguous", DType::kBF16, kInt8, 1, 576, 3, 1, 16, 4,
       ViewKind::kContiguous},
      {"fp16_1x576_mla_strided", DType::kFP16, kInt8, 1, 576, 2, 1, 7, 5, ViewKind::kStrided},
      {"bf16_1x576_mla_paged", DType::kBF16, kInt8, 1, 576, 2, 1, 16, 3, ViewKind::kPaged},
      {"bf16_2x96_contiguous", DType::kBF16, kInt8, 2, 96, 3, 2, 16, 5, ViewKind::kContiguous},
      {"fp16_2x96_strided", DType::kFP16, kInt8, 2, 96, 2, 2, 7, 6, ViewKind::kStrided},
      {"bf16_4x64_packed_kv", DType::kBF16, kInt8, 4, 64, 2, 2, 16, 4, ViewKind::kPackedKV},
      {"fp16_3x36_strided", DType::kFP16, kInt8, 3, 36, 2, 2, 5, 5, ViewKind::kStrided},
      {"bf16_2x512_paged", DType::kBF16, kInt8, 2, 512, 2, 2, 8, 3, ViewKind::kPaged},
      {"fp16_1x1100_contiguous", DType::kFP16, kInt8, 1, 1100, 2, 1, 4, 3, ViewKind::kContiguous},
      {"raw_bf16_8x128_paged", DType::kBF16, kRaw, 8, 128, 2, 2, 16, 4, ViewKind::kPaged},
      {"raw_fp16_2x96_strided", DType::kFP16, kRaw, 2, 96, 2, 2, 7, 4, ViewKind::kStrided},
      {"fp8_bf16_8x128_paged", DType::kBF16, kFp8, 8, 128, 3, 2, 16, 5, ViewKind::kPaged},
      {"fp8_fp16_8x128_contiguous", DType::kFP16, kFp8, 8, 128, 2, 2, 16, 4, ViewKind::kContiguous},
      {"fp8_bf16_8x128_packed_kv", DType::kBF16, kFp8, 8, 128, 2, 2, 16, 4, ViewKind::kPackedKV},
      {"fp8_fp16_1x576_mla_strided", DType::kFP16, kFp8, 1, 576, 2, 1, 7, 5, ViewKind::kStrided},
      {"fp8_bf16_2x96_strided", DType::kBF16, kFp8, 2, 96, 2, 2, 7, 6, ViewKind::kStrided},
      {"fp8_fp16_3x36_paged", DType::kFP16, kFp8, 3, 36, 2, 2, 5, 5, ViewKind::kPaged},
      {"fp8_bf16_2x512_paged", DType::kBF16, kFp8, 2, 512, 2, 2, 8, 3, ViewKind::kPaged},
      {"fp8_bf16_1x1100_contiguous", DType::kBF16, kFp8, 1, 1100, 2, 1, 4, 3,
       ViewKind::kContiguous},
      // INT4 (head_dim % 32 == 0): one chunk per lane with 2 units (3x32), 2, 4 and 8 chunks
      // per lane (1x576 -> 32 lanes x 3 chunks rounded to 4; 1x2048 -> 8), odd groups (160).
      {"int4_bf16_8x128_paged", DType::kBF16, kInt4, 8, 128, 3, 2, 16, 5, ViewKind::kPaged},
      {"int4_fp16_8x128_contiguous", DType::kFP16, kInt4, 8, 128, 2, 2, 16, 4,
       ViewKind::kContiguous},
      {"int4_bf16_8x128_packed_kv", DType::kBF16, kInt4, 8, 128, 2, 2, 16, 4, ViewKind::kPackedKV},
      {"int4_fp16_8x128_strided", DType::kFP16, kInt4, 8, 128, 2, 2, 7, 4, ViewKind::kStrided},
      {"int4_bf16_3x64_contiguous", DType::kBF16, kInt4, 3, 64, 3, 2, 16, 5, ViewKind::kContiguous},
      {"int4_fp16_1x576_mla_strided", DType::kFP16, kInt4, 1, 576, 2, 1, 7, 5, ViewKind::kStrided},
      {"int4_bf16_2x96_strided", DType::kBF16, kInt4, 2, 96, 2, 2, 7, 6, ViewKind::kStrided},
      {"int4_fp16_3x32_paged", DType::kFP16, kInt4, 3, 32, 2, 2, 5, 5, ViewKind::kPaged},
      {"int4_bf16_5x160_packed_kv", DType::kBF16, kInt4, 5, 160, 2, 2, 8, 3, ViewKind::kPackedKV},
      {"int4_bf16_2x512_paged", DType::kBF16, kInt4, 2, 512, 2, 2, 8, 3, ViewKind::kPaged},
      {"int4_fp16_1x2048_contiguous", DType::kFP16, kInt4, 1, 2048, 2, 1, 4, 3,
       ViewKind::kContiguous},
      // INT4 KIVI (head_dim % 32 == 0): K planes per (block, layer, head, 8 channels), V as INT4
      // rows; block_tokens 16, 7 and 17 (partial batches of the K kernels' 4 tokens), 1 and 64,
      // MLA (K planes only), the largest head.
      {"kivi_bf16_8x128_paged", DType::kBF16, kKivi, 8, 128, 3, 2, 16, 4, ViewKind::kPaged},
      {"kivi_fp16_8x128_contiguous", DType::kFP16, kKivi, 8, 128, 2, 2, 16, 3,
       ViewKind::kContiguous},
      {"kivi_bf16_8x128_packed_kv", DType::kBF16, kKivi, 8, 128, 2, 2, 16, 3, ViewKind::kPackedKV},
      {"kivi_fp16_2x96_strided", DType::kFP16, kKivi, 2, 96, 2, 2, 7, 4, ViewKind::kStrided},
      {"kivi_bf16_1x576_mla_strided", DType::kBF16, kKivi, 1, 576, 2, 1, 5, 3, ViewKind::kStrided},
      {"kivi_fp16_3x32_paged", DType::kFP16, kKivi, 3, 32, 2, 2, 1, 5, ViewKind::kPaged},
      {"kivi_bf16_5x160_packed_kv", DType::kBF16, kKivi, 5, 160, 2, 2, 17, 3, ViewKind::kPackedKV},
      {"kivi_bf16_2x64_paged", DType::kBF16, kKivi, 2, 64, 2, 2, 64, 2, ViewKind::kPaged},
      {"kivi_fp16_1x2048_contiguous", DType::kFP16, kKivi, 1, 2048, 2, 1, 4, 2,
       ViewKind::kContiguous},
      // INT4 Hadamard (head_dim % 32 == 0): every rotation run r the kernels take, 32 (96, 160)
      // to 2048, i.e. 4 to 32 lanes of 8 elements and 32 lanes of 16, 32 and 64; MLA (plane 0
      // only: 576, run 64); block_tokens 1 (INT8 rows only), 3, 5, 7, 16, 17 and 64.
      {"hadamard_bf16_8x128_paged", DType::kBF16, kHadamard, 8, 128, 2, 2, 16, 3, ViewKind::kPaged},
      {"hadamard_fp16_8x128_contiguous", DType::kFP16, kHadamard, 8, 128, 2, 2, 16, 2,
       ViewKind::kContiguous},
      {"hadamard_bf16_8x128_packed_kv", DType::kBF16, kHadamard, 8, 128, 2, 2, 8, 2,
       ViewKind::kPackedKV},
      {"hadamard_fp16_2x96_strided", DType::kFP16, kHadamard, 2, 96, 2, 2, 7, 4,
       ViewKind::kStrided},
      {"hadamard_bf16_1x576_mla_strided", DType::kBF16, kHadamard, 1, 576, 2, 1, 5, 3,
       ViewKind::kStrided},
      {"hadamard_fp16_1x576_mla_paged", DType::kFP16, kHadamard, 1, 576, 3, 1, 16, 3,
       ViewKind::kPaged},
      {"hadamard_fp16_3x64_paged_bt3", DType::kFP16, kHadamard, 3, 64, 2, 2, 3, 5,
       ViewKind::kPaged},
      {"hadamard_bf16_3x64_contiguous_bt1", DType::kBF16, kHadamard, 3, 64, 2, 2, 1, 5,
       ViewKind::kContiguous},
      {"hadamard_bf16_5x160_packed_kv", DType::kBF16, kHadamard, 5, 160, 2, 2, 17, 3,
       ViewKind::kPackedKV},
      {"hadamard_bf16_2x64_paged_bt64", DType::kBF16, kHadamard, 2, 64, 2, 2, 64, 2,
       ViewKind::kPaged},
      {"hadamard_bf16_2x256_contiguous", DType::kBF16, kHadamard, 2, 256, 2, 2, 16, 2,
       ViewKind::kContiguous},
      {"hadamard_bf16_2x512_paged", DType::kBF16, kHadamard, 2, 512, 2, 2, 8, 3, ViewKind::kPaged},
      {"hadamard_fp16_1x1024_mla_strided", DType::kFP16, kHadamard, 1, 1024, 2, 1, 3, 2,
       ViewKind::kStrided},
      {"hadamard_fp16_1x2048_contiguous", DType::kFP16, kHadamard, 1, 2048, 2, 1, 4, 2,
       ViewKind::kContiguous},
      // INT5 allot (head_dim % 32 == 0, up to 256; K and V planes): heads of 4 to 32 lanes (1 to
      // 8 heads per warp pass, 12 and 20 lanes of 16 and 32 used: 96, 160), one pass or several,
      // rotate-half and interleaved RoPE and none, block_tokens 1 (INT8 rows only), 3, 7, 16, 17,
      // 32 and 64 (K decodes in units of 8 tokens).
      {"allot_bf16_8x128_paged", DType::kBF16, kAllot, 8, 128, 2, 2, 16, 3, ViewKind::kPaged, false,
       1e6},
      {"allot_fp16_8x128_contiguous_bt32", DType::kFP16, kAllot, 8, 128, 2, 2, 32, 2,
       ViewKind::kContiguous, false, 1e4, true},
      {"allot_bf16_8x128_packed_kv", DType::kBF16, kAllot, 8, 128, 2, 2, 8, 2, ViewKind::kPackedKV,
       false, 5e5},
      {"allot_bf16_3x64_paged_bt3", DType::kBF16, kAllot, 3, 64, 2, 2, 3, 4, ViewKind::kPaged,
       false, 1e4},
      {"allot_fp16_2x96_strided", DType::kFP16, kAllot, 2, 96, 2, 2, 7, 4, ViewKind::kStrided,
       false, 1e4, true},
      {"allot_bf16_5x160_packed_kv_bt17", DType::kBF16, kAllot, 5, 160, 2, 2, 17, 2,
       ViewKind::kPackedKV, false, 1e4},
      {"allot_bf16_2x256_contiguous", DType::kBF16, kAllot, 2, 256, 2, 2, 16, 2,
       ViewKind::kContiguous},
      {"allot_bf16_1x32_paged_bt64", DType::kBF16, kAllot, 1, 32, 2, 2, 64, 2, ViewKind::kPaged,
       false, 1e4},
      {"allot_fp16_3x32_strided_bt1", DType::kFP16, kAllot, 3, 32, 2, 2, 1, 4, ViewKind::kStrided,
       false, 1e4},
      // INT6 allot: the same kernels at its widths (6-byte lanes of value codes).
      {"allot6_bf16_8x128_paged", DType::kBF16, kAllot6, 8, 128, 2, 2, 16, 3, ViewKind::kPaged,
       false, 1e6},
      {"allot6_bf16_3x64_paged_bt3", DType::kBF16, kAllot6, 3, 64, 2, 2, 3, 4, ViewKind::kPaged,
       false, 1e4},
      {"allot6_fp16_2x96_strided", DType::kFP16, kAllot6, 2, 96, 2, 2, 7, 4, ViewKind::kStrided,
       false, 1e4, true},
      // INT4 allot: 4-byte lanes of value codes; key rows down to whole bytes where H*D % 128
      // != 0 (3x64: 852 bits to 848; 1x32: 142 to 136).
      {"allot4_bf16_8x128_paged", DType::kBF16, kAllot4, 8, 128, 2, 2, 16, 3, ViewKind::kPaged,
       false, 1e6},
      {"allot4_bf16_3x64_paged_bt3", DType::kBF16, kAllot4, 3, 64, 2, 2, 3, 4, ViewKind::kPaged,
       false, 1e4},
      {"allot4_fp16_2x96_strided", DType::kFP16, kAllot4, 2, 96, 2, 2, 7, 4, ViewKind::kStrided,
       false, 1e4, true},
      {"allot4_bf16_1x32_paged_bt64", DType::kBF16, kAllot4, 1, 32, 2, 2, 64, 2, ViewKind::kPaged,
       false, 1e4},
  };
}

// CODEC_INT4_HADAMARD refuses a block whose rotation reaches its range limit (HadamardLimitBits,
// 2^120 or more; as it refuses NaN), CODEC_INT5_ALLOT that and keys of 2^120 or more: BF16 values
// near the largest finite ones, which kRowMix's kHuge heads hold, do. The geometry cases expect
// every block encoded, so for that codec and dtype they scale elements of magnitude >= 2^100 down
// by 2^-40 (still >= 2^60: the rotation's sums stay far below the limit). The input classes' tests
// keep kHuge as it is and expect those blocks flagged.
inline void KeepRotationsFinite(KvPool* pool) {
  const BlockLayout& lay = pool->layout();
  if ((lay.row.codec != CodecKind::kInt4Hadamard && !lay.row.IsAllot()) ||
      lay.row.dtype != DType::kBF16) {
    return;
  }
  pool->ForEachHead([&](uint32_t, uint32_t, uint32_t, uint32_t, uint16_t* x) {
    for (uint32_t i = 0; i < lay.row.head_dim; ++i) {
      const uint32_t exp = (x[i] >> 7) & 0xFFu;
      if (exp >= 127u + 100u && exp != 0xFFu) {
        x[i] = static_cast<uint16_t>((x[i] & 0x807Fu) | ((exp - 40u) << 7));
      }
    }
  });
}

// Where byte `off` of a CODEC_INT4_HADAMARD block payload lies, for failure messages.
inline std::string DescribeHadamardOffset(const BlockLayout& lay, size_t off) {
  const RowFormat& row = lay.row;
  const size_t channels = row.ElementsPerRow();
  const size_t in_layer = off % lay.LayerBytes();
  const uint32_t plane = in_layer < lay.PlaneBytes(0) ? 0 : 1;
  const size_t in_plane = in_layer - (plane == 0 ? 0 : lay.PlaneBytes(0));
  std::string where =
      "layer " + std::to_string(off / lay.LayerBytes()) + " plane " + std::to_string(plane);
  if (in_plane < row.FirstRowBytes(plane)) {
    return where + " token 0 (INT8 row) " +
           (in_plane < channels ? "head " + std::to_string(in_plane / row.head_dim) + " code " +
                                      std::to_string(in_plane % row.head_dim)
                                : "scale of head " + std::to_string((in_plane - channels) / 2));
  }
  const size_t rows_end = row.PlaneRowOffset(plane, lay.block_tokens);
  if (in_plane >= rows_end) {  // plane 0's channel parameters
    const size_t param = (in_plane - rows_end) / 2;
    const size_t c = param % channels;
    return where + (param < channels ? " zero point" : " scale") + " of head " +
           std::to_string(c / row.head_dim) + " dim " + std::to_string(c % row.head_dim);
  }
  const size_t rel = in_plane - row.FirstRowBytes(plane);
  const size_t t = 1 + rel / row.PlaneRowBytes(plane);
  const size_t in_row = rel % row.PlaneRowBytes(plane);
  where += " token " + std::to_string(t);
  if (in_row < channels / 2) {
    const size_t c = 2 * in_row;
    return where + " head " + std::to_string(c / row.head_dim) + " codes " +
           std::to_string(c % row.head_dim) + "," + std::to_string(c % row.head_dim + 1);
  }
  const size_t groups = channels / kInt4GroupElems;
  const size_t param = (in_row - channels / 2) / 2;
  return where + (param < groups ? " zero point" : " scale") + " of group " +
         std::to_string(param % groups);
}

// "block 2: 3 bytes differ, first at layer 1 plane 0 token 5 ...: want 17 got 18" for the first
// payload byte that differs ("" when equal), skipping blocks flagged in `skip_flags`.
inline std::string FirstPayloadDiff(const BlockLayout& lay, const BlockSet& want,
                                    const BlockSet& got,
                                    const std::vector<uint8_t>* skip_flags = nullptr) {
  for (uint32_t b = 0; b < want.size(); ++b) {
    if (skip_flags != nullptr && (*skip_flags)[b] != 0) continue;
    for (size_t i = 0; i < lay.BlockBytes(); ++i) {
      if (want[b][i] == got[b][i]) continue;
      size_t count = 0;
      for (size_t j = 0; j < lay.BlockBytes(); ++j) count += want[b][j] != got[b][j];
      return "block " + std::to_string(b) + ": " + std::to_string(count) +
             " bytes differ, first at " +
             (lay.row.codec == CodecKind::kInt4Hadamard ? DescribeHadamardOffset(lay, i)
                                                        : DescribePayloadOffset(lay, i)) +
             ": want " + std::to_string(want[b][i]) + " got " + std::to_string(got[b][i]);
    }
  }
  return "";
}

// "layer 1 byte 17: want 165 got 0" for the first byte of the per-layer buffers `got` that
// differs from `want`'s ("" when equal).
inline std::string FirstBufferDiff(const KvPool& want,
                                   const std::vector<std::vector<uint8_t>>& got) {
  for (uint32_t l = 0; l < want.layout().num_layers; ++l) {
    const std::vector<uint8_t>& w = want.buffer(l);
    if (got[l].size() != w.size()) return "layer " + std::to_string(l) + ": size differs";
    for (size_t i = 0; i < w.size(); ++i) {
      if (w[i] != got[l][i]) {
        return "layer " + std::to_string(l) + " byte " + std::to_string(i) + ": want " +
               std::to_string(w[i]) + " got " + std::to_string(got[l][i]);
      }
    }
  }
  return "";
}

inline std::string FirstBufferDiff(const KvPool& want, const KvPool& got) {
  std::vector<std::vector<uint8_t>> buffers;
  for (uint32_t l = 0; l < got.layout().num_layers; ++l) buffers.push_back(got.buffer(l));
  return FirstBufferDiff(want, buffers);
}

}  // namespace hiqcache::kernels::testutil
