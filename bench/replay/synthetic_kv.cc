#include "synthetic_kv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "codec_math.h"

namespace hiqcache::replay {
namespace {

namespace kn = ::hiqcache::kernels;

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Runs f(i) for i in [0, n) on up to two threads (the replay shares the machine with the daemon).
template <typename F>
void ParallelFor(uint32_t n, bool parallel, F&& f) {
  if (!parallel || n < 2) {
    for (uint32_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::thread other([&] {
    for (uint32_t i = 1; i < n; i += 2) f(i);
  });
  for (uint32_t i = 0; i < n; i += 2) f(i);
  other.join();
}

}  // namespace

void VerifyResult::Add(const VerifyResult& o) {
  elements += o.elements;
  violations += o.violations;
  max_error_ratio = std::max(max_error_ratio, o.max_error_ratio);
}

SyntheticKv::SyntheticKv(const Geometry& g, uint64_t seed, uint32_t table_rows)
    : geometry_(g),
      table_rows_(table_rows),
      row_elements_(uint64_t{g.num_kv_heads} * g.head_dim),
      table_(table_rows * row_elements_),
      scales_(uint64_t{table_rows} * g.num_kv_heads),
      fp8_scales_(scales_.size()),
      int4_scales_(table_rows * row_elements_ / kn::kInt4GroupElems) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (uint32_t r = 0; r < table_rows_; ++r) {
    for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
      uint16_t* out = &table_[r * row_elements_ + uint64_t{h} * g.head_dim];
      const uint64_t bits = rng();
      uint16_t amax = 0;
      if ((bits & 0x3F) != 0) {  // 1 head in 64 stays all zero
        const float amp = std::ldexp(1.0f, static_cast<int>((bits >> 8) % 16) - 10);
        const uint32_t outlier = static_cast<uint32_t>(bits >> 20) % g.head_dim;
        for (uint32_t d = 0; d < g.head_dim; ++d) {
          out[d] = kn::FloatToBf16Sat((d == outlier ? 4.0f : 1.0f) * amp * u(rng));
          amax = std::max<uint16_t>(amax, out[d] & 0x7FFF);
        }
      }
      scales_[uint64_t{r} * g.num_kv_heads + h] =
          kn::Bf16ToFloat(kn::ScaleBf16FromAmaxBits(amax, kn::DType::kBF16));
      fp8_scales_[uint64_t{r} * g.num_kv_heads + h] =
          kn::Bf16ToFloat(kn::Fp8ScaleBf16FromAmaxBits(amax, kn::DType::kBF16));
    }
    // INT4 groups run along the row: head_dim % 32 == 0, so no group straddles two heads.
    const uint16_t* row = &table_[r * row_elements_];
    for (uint64_t gi = 0; gi < row_elements_ / kn::kInt4GroupElems; ++gi) {
      uint16_t amax = 0;
      for (uint32_t i = 0; i < kn::kInt4GroupElems; ++i) {
        amax = std::max<uint16_t>(amax, row[gi * kn::kInt4GroupElems + i] & 0x7FFF);
      }
      int4_scales_[r * row_elements_ / kn::kInt4GroupElems + gi] =
          kn::Bf16ToFloat(kn::Int4ScaleBf16FromAmaxBits(amax, kn::DType::kBF16));
    }
  }
}

double SyntheticKv::ErrorBound(Codec codec, uint64_t head, uint32_t d, uint32_t head_dim,
                               double xh) const {
  const double ax = std::fabs(xh);
  switch (codec) {
    case Codec::kFp8E4m3PerHead: {
      const double a = ax <= 0x1.0p-126 ? 0x1.0p-134 : 0.0;  // bf16 subnormal x^
      return 0x1.0p-4 * ax + 0x1.0p-10 * fp8_scales_[head] + (1 + 0x1.0p-4) * (0x1.0p-8 * ax + a);
    }
    case Codec::kInt4G32PerHead: {
      const double s = int4_scales_[(head * head_dim + d) / kn::kInt4GroupElems];
      return (0.5 + 0x1.0p-8) * s + 0x1.0p-8 * ax;
    }
    default:
      return (0.5 + 0x1.0p-8) * scales_[head] + 0x1.0p-8 * ax;
  }
}

uint32_t SyntheticKv::RowIndex(const BlockKey& key, uint32_t token, uint32_t layer,
                               uint32_t plane) const {
  uint64_t k0, k1;
  std::memcpy(&k0, key.data(), 8);
  std::memcpy(&k1, key.data() + 8, 8);
  const uint64_t h =
      SplitMix(k0 ^ SplitMix(k1 ^ (uint64_t{token} << 32 | uint64_t{layer} << 8 | plane)));
  return static_cast<uint32_t>(h % table_rows_);
}

void SyntheticKv::Fill(const HostKvPool& kv, std::span<const BlockKey> keys,
                       std::span<const uint32_t> rows, uint32_t block_tokens) const {
  const Geometry& g = geometry_;
  const uint64_t head_bytes = g.HeadBytes();
  const bool big = keys.size() * block_tokens * g.BytesPerToken() >= (8u << 20);
  ParallelFor(static_cast<uint32_t>(keys.size()), big, [&](uint32_t b) {
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      for (uint32_t p = 0; p < g.Planes(); ++p) {
        for (uint32_t t = 0; t < block_tokens; ++t) {
          const uint32_t row = rows[size_t{b} * block_tokens + t];
          const uint16_t* src = &table_[RowIndex(keys[b], t, l, p) * row_elements_];
          for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
            std::memcpy(kv.Head(l, p, row, h), src + uint64_t{h} * g.head_dim, head_bytes);
          }
        }
      }
    }
  });
}

VerifyResult SyntheticKv::Verify(const HostKvPool& kv, std::span<const BlockKey> keys,
                                 std::span<const uint32_t> rows, uint32_t block_tokens,
                                 Codec codec) const {
  const Geometry& g = geometry_;
  const bool exact = codec == Codec::kRaw;
  std::vector<VerifyResult> per_block(keys.size());
  const bool big = keys.size() * block_tokens * g.BytesPerToken() >= (8u << 20);
  ParallelFor(static_cast<uint32_t>(keys.size()), big, [&](uint32_t b) {
    VerifyResult& v = per_block[b];
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      for (uint32_t p = 0; p < g.Planes(); ++p) {
        for (uint32_t t = 0; t < block_tokens; ++t) {
          const uint32_t row = rows[size_t{b} * block_tokens + t];
          const uint32_t idx = RowIndex(keys[b], t, l, p);
          for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
            const uint16_t* want = &table_[idx * row_elements_ + uint64_t{h} * g.head_dim];
            const uint16_t* got = kv.Head(l, p, row, h);
            v.elements += g.head_dim;
            if (exact) {
              if (std::memcmp(want, got, g.HeadBytes()) != 0) {
                ++v.violations;
                v.max_error_ratio = 1;
              }
              continue;
            }
            const uint64_t head = uint64_t{idx} * g.num_kv_heads + h;
            for (uint32_t d = 0; d < g.head_dim; ++d) {
              const double x = kn::Bf16ToFloat(want[d]);
              const double xh = kn::Bf16ToFloat(got[d]);
              const double err = std::fabs(xh - x);
              const double bound = ErrorBound(codec, head, d, g.head_dim, xh);
              if (!(err <= bound)) ++v.violations;  // NaN counts as a violation
              if (bound > 0) v.max_error_ratio = std::max(v.max_error_ratio, err / bound);
            }
          }
        }
      }
    }
  });
  VerifyResult total;
  for (const auto& v : per_block) total.Add(v);
  return total;
}

}  // namespace hiqcache::replay
