// The angles of the allot codecs' key turn (codec_math.h "INT4, INT5 and INT6 allot"): a block's
// token at offset t is turned back by t times each RoPE pair's frequency before its keys are
// quantized, and forward after they are restored, so a channel's values stay alike over the block.
//
// The table is computed once per layout on the host, in double (std::pow, std::cos, std::sin of
// the C library) and rounded to fp32; every executor reads the same table. Value type;
// thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "record_format.h"

namespace hiqcache::kernels {

struct RopeTurn {
  uint32_t pairs = 0;      // head_dim / 2
  std::vector<float> cos;  // [offset t][pair j], block_tokens * pairs
  std::vector<float> sin;

  float Cos(uint32_t t, uint32_t j) const { return cos[size_t{t} * pairs + j]; }
  float Sin(uint32_t t, uint32_t j) const { return sin[size_t{t} * pairs + j]; }
};

// Angle of pair j at offset t: t * theta^(-2j / head_dim); theta == 0 (no RoPE): every angle 0
// (cosine 1, sine 0: the turn is the identity). REQUIRES: head_dim even.
RopeTurn MakeRopeTurn(const RowFormat& fmt, uint32_t block_tokens);

// MakeRopeTurn's table as one array, the cosines then the sines ([t][j] each): what a CUDA job
// carries (EncodeJob::rope), RopeTableFloats of a layout with this row and block_tokens.
std::vector<float> RopeTable(const RowFormat& fmt, uint32_t block_tokens);

// MakeRopeTurn's table, kept per thread for the last (theta, head_dim, block_tokens) asked: the
// executors' calls for one pool reuse it. Valid until this thread's next call.
const RopeTurn& RopeTurnFor(const RowFormat& fmt, uint32_t block_tokens);

}  // namespace hiqcache::kernels
