// SyntheticKv: a deterministic stand-in for a model's KV, cheap enough to "prefill" hundreds of
// thousands of Qwen3-8B tokens on a CPU, and the check that restored KV is what was backed up.
//
// A table of random BF16 rows (all heads of one token, layer and K|V) with per-head magnitudes
// from 2^-10 to 2^5, one outlier per head and a few all-zero heads. The row written for
// (block key, token in block, layer, K|V) is a hash of those into the table, so KV depends on
// the whole prefix (as real KV does) and a restore into the wrong rows or from the wrong block
// is caught. Const methods are thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "hiqcache/block_keys.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/pool_spec.h"

namespace hiqcache::replay {

struct VerifyResult {
  uint64_t elements = 0;
  uint64_t violations = 0;
  double max_error_ratio = 0;  // max |x^ - x| / bound (lossy codecs) or 0/1 mismatches (RAW)

  void Add(const VerifyResult& o);
};

class SyntheticKv {
 public:
  SyntheticKv(const Geometry& geometry, uint64_t seed, uint32_t table_rows = 1024);

  // Writes the KV of blocks keys[i] into rows[i*block_tokens, (i+1)*block_tokens) of `kv`.
  // REQUIRES: rows.size() == keys.size() * block_tokens; kv has this geometry.
  void Fill(const HostKvPool& kv, std::span<const BlockKey> keys, std::span<const uint32_t> rows,
            uint32_t block_tokens) const;

  // Compares those rows with what Fill wrote, with `codec`'s elementwise bound (codec_math.h):
  //   CODEC_RAW          bit-exact
  //   INT8 per head      |x^ - x| <= (0.5 + 2^-8) s + 2^-8 |x^|, s = bf16(max(amax, 2^-112) / 127)
  //   FP8 E4M3 per head  |x^ - x| <= 2^-4 |x^| + 2^-10 s + (1 + 2^-4)(2^-8 |x^| + a),
  //                      s = bf16(max(amax, 2^-112) / 448), a = 2^-134 where |x^| <= 2^-126
  //   INT4 g32 per head  INT8's bound with s = bf16(max(amax, 2^-112) / 7) of the 32-element group
  // (amax of the original head or group; docs/design.md "Record format").
  VerifyResult Verify(const HostKvPool& kv, std::span<const BlockKey> keys,
                      std::span<const uint32_t> rows, uint32_t block_tokens, Codec codec) const;

 private:
  uint32_t RowIndex(const BlockKey& key, uint32_t token, uint32_t layer, uint32_t plane) const;
  // `codec`'s bound for element d of table head `head` ([row][head] index) restored as xh.
  double ErrorBound(Codec codec, uint64_t head, uint32_t d, uint32_t head_dim, double xh) const;

  Geometry geometry_;
  uint32_t table_rows_;
  uint64_t row_elements_;
  std::vector<uint16_t> table_;     // [table_rows][heads][head_dim], BF16 bits
  std::vector<float> scales_;       // [table_rows][heads]: INT8 s of each head
  std::vector<float> fp8_scales_;   // [table_rows][heads]: FP8 s of each head
  std::vector<float> int4_scales_;  // [table_rows][heads * head_dim / 32]: INT4 s of each group
};

}  // namespace hiqcache::replay
