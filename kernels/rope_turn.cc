#include "rope_turn.h"

#include <cmath>
#include <utility>

namespace hiqcache::kernels {

RopeTurn MakeRopeTurn(const RowFormat& fmt, uint32_t block_tokens) {
  RopeTurn turn;
  turn.pairs = fmt.head_dim / 2;
  turn.cos.assign(size_t{block_tokens} * turn.pairs, 1.0f);
  turn.sin.assign(size_t{block_tokens} * turn.pairs, 0.0f);
  if (fmt.rope_theta == 0.0) return turn;
  for (uint32_t j = 0; j < turn.pairs; ++j) {
    const double freq = std::pow(fmt.rope_theta, -2.0 * j / fmt.head_dim);
    for (uint32_t t = 0; t < block_tokens; ++t) {
      const double angle = t * freq;
      turn.cos[size_t{t} * turn.pairs + j] = static_cast<float>(std::cos(angle));
      turn.sin[size_t{t} * turn.pairs + j] = static_cast<float>(std::sin(angle));
    }
  }
  return turn;
}

std::vector<float> RopeTable(const RowFormat& fmt, uint32_t block_tokens) {
  RopeTurn turn = MakeRopeTurn(fmt, block_tokens);
  std::vector<float> table = std::move(turn.cos);
  table.insert(table.end(), turn.sin.begin(), turn.sin.end());
  return table;
}

const RopeTurn& RopeTurnFor(const RowFormat& fmt, uint32_t block_tokens) {
  struct Cached {
    double theta = -1.0;
    uint32_t head_dim = 0;
    uint32_t block_tokens = 0;
    RopeTurn turn;
  };
  thread_local Cached cached;
  if (cached.theta != fmt.rope_theta || cached.head_dim != fmt.head_dim ||
      cached.block_tokens != block_tokens) {
    cached.turn = MakeRopeTurn(fmt, block_tokens);
    cached.theta = fmt.rope_theta;
    cached.head_dim = fmt.head_dim;
    cached.block_tokens = block_tokens;
  }
  return cached.turn;
}

}  // namespace hiqcache::kernels
