// GaussianQwen3Kv: the engine KV the end-to-end benchmarks (e2e_bench, l3_bench) back up: a HOST
// pool in Qwen3-8B's geometry (36 layers x 8 KV heads x 128, BF16, SGLang layout) whose first
// `filled` rows hold N(0, 1) values rounded to BF16 (seed 7), the rest zero, written as an engine
// writes all of its KV (so that no restore pays for faulting in pages the client never touched).
// `name` and `huge_pages` as HostKvPool::Create takes them (empty: a named shm object).
// Header-only.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string_view>

#include "hiqcache/host_shm.h"

namespace hiqcache::bench {

inline StatusOr<HostKvPool> GaussianQwen3Kv(uint32_t rows, uint32_t filled,
                                            std::string_view name = {},
                                            HugePages huge_pages = HugePages::kAuto) {
  Geometry g;
  g.num_layers = 36;
  g.num_kv_heads = 8;
  g.head_dim = 128;
  auto kv = HostKvPool::Create(g, KvLayout::kSglang, rows, 16, name, huge_pages);
  if (!kv.ok()) return kv.status();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  const auto bf16 = [](float f) {  // round to nearest even
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
  };
  for (uint32_t l = 0; l < g.num_layers; ++l)
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t r = 0; r < filled; ++r)
        for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
          uint16_t* head = kv->Head(l, p, r, h);
          for (uint32_t d = 0; d < g.head_dim; ++d) head[d] = bf16(normal(rng));
        }
  auto* bytes = static_cast<volatile uint8_t*>(kv->shm().data());
  for (size_t i = 0; i < kv->shm().size(); i += 4096) bytes[i] = bytes[i];
  return kv;
}

}  // namespace hiqcache::bench
