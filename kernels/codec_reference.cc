#include "codec_reference.h"

#include <cstring>
#include <vector>

#include "rope_turn.h"

namespace hiqcache::kernels {
namespace {

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }

// CODEC_INT4_G32_PER_HEAD: per group of 32 elements, its amax, scale and nibbles.
bool EncodeRowInt4(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst) {
  const uint32_t d = fmt.head_dim;
  const uint32_t groups = d / kInt4GroupElems;
  uint8_t* scales = dst + fmt.CodeBytes();
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    const uint8_t* src = view.Head(row, h);
    for (uint32_t g = 0; g < groups; ++g) {
      const uint8_t* gs = src + 2 * g * kInt4GroupElems;
      uint16_t amax_bits = 0;
      for (uint32_t i = 0; i < kInt4GroupElems; ++i) {
        uint16_t a = LoadU16(gs + 2 * i) & 0x7FFFu;
        if (a > amax_bits) amax_bits = a;
      }
      if (amax_bits >= InfBits(fmt.dtype)) return false;
      const uint16_t s_bits = Int4ScaleBf16FromAmaxBits(amax_bits, fmt.dtype);
      const float s = Bf16ToFloat(s_bits);
      // Element e of the row is nibble e: byte e / 2, the low nibble when e is even (d is even).
      uint8_t* codes = dst + (static_cast<size_t>(h) * d + g * kInt4GroupElems) / 2;
      for (uint32_t i = 0; i < kInt4GroupElems; i += 2) {
        const uint32_t lo = QuantizeInt4Element(HalfToFloat(LoadU16(gs + 2 * i), fmt.dtype), s);
        const uint32_t hi = QuantizeInt4Element(HalfToFloat(LoadU16(gs + 2 * i + 2), fmt.dtype), s);
        codes[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
      StoreU16(scales + 2 * (static_cast<size_t>(h) * groups + g), s_bits);
    }
  }
  return true;
}

void DecodeRowInt4(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                   uint32_t row) {
  const uint32_t d = fmt.head_dim;
  const uint32_t groups = d / kInt4GroupElems;
  const uint8_t* scales = src + fmt.CodeBytes();
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    uint8_t* out = view.Head(row, h);
    for (uint32_t g = 0; g < groups; ++g) {
      const float s = Bf16ToFloat(LoadU16(scales + 2 * (static_cast<size_t>(h) * groups + g)));
      const uint8_t* codes = src + (static_cast<size_t>(h) * d + g * kInt4GroupElems) / 2;
      uint8_t* go = out + 2 * g * kInt4GroupElems;
      for (uint32_t i = 0; i < kInt4GroupElems; i += 2) {
        const uint8_t c = codes[i / 2];
        StoreU16(go + 2 * i, DequantizeInt4Element(c & 0xFu, s, fmt.dtype));
        StoreU16(go + 2 * i + 2, DequantizeInt4Element(c >> 4, s, fmt.dtype));
      }
    }
  }
}

// One row of a view with split heads, as a contiguous copy (GatherHeads): row 0 of the answer.
StridedView RowCopy(const RowFormat& fmt, std::vector<uint8_t>* bytes, uint32_t n = 1) {
  const size_t row_bytes = size_t{fmt.num_heads} * fmt.head_dim * 2;
  bytes->resize(row_bytes * n);
  StridedView v;
  v.base = bytes->data();
  v.row_stride = row_bytes;
  v.head_stride = uint64_t{fmt.head_dim} * 2;
  v.num_rows = n;
  return v;
}

std::vector<uint32_t> Iota(uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

// A plane whose token 0 is an INT8 row of the input (INT4 Hadamard, the allot codecs): heads split
// into runs are encoded from a contiguous copy; row 0 as INT8's row, then `rest(view, rows)`
// encodes tokens 1..num_rows-1 of whole heads.
template <class Rest>
bool EncodeAfterInt8Row(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                        uint32_t num_rows, uint8_t* dst, const Rest& rest) {
  if (view.dim_run != 0) {
    std::vector<uint8_t> bytes;
    const StridedView copy = RowCopy(fmt, &bytes, num_rows);
    GatherHeads(view, fmt.num_heads, fmt.head_dim, rows, num_rows, copy.base);
    return EncodeAfterInt8Row(fmt, copy, Iota(num_rows).data(), num_rows, dst, rest);
  }
  if (!EncodeRowReference(fmt.FirstRowFormat(), view, rows[0], dst)) return false;
  return num_rows <= 1 || rest(view, rows);
}

// Decodes `count` rows through `decode(view, rows)` on whole heads: into a contiguous copy,
// then scattered, where the view splits heads into runs.
template <class Decode>
void DecodeWholeHeads(const RowFormat& fmt, uint32_t count, const StridedView& view,
                      const uint32_t* rows, const Decode& decode) {
  if (view.dim_run == 0) return decode(view, rows);
  std::vector<uint8_t> bytes;
  const StridedView copy = RowCopy(fmt, &bytes, count);
  decode(copy, Iota(count).data());
  ScatterHeads(copy.base, fmt.num_heads, fmt.head_dim, view, rows, count);
}

}  // namespace

bool EncodeKiviKPlaneReference(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                               uint32_t num_rows, uint8_t* dst) {
  if (view.dim_run != 0) {  // split heads: from a contiguous copy of the rows
    std::vector<uint8_t> bytes;
    const StridedView copy = RowCopy(fmt, &bytes, num_rows);
    GatherHeads(view, fmt.num_heads, fmt.head_dim, rows, num_rows, copy.base);
    return EncodeKiviKPlaneReference(fmt, copy, Iota(num_rows).data(), num_rows, dst);
  }
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const size_t code_bytes = channels / 2;
  uint8_t* zeros = dst + static_cast<size_t>(num_rows) * code_bytes;
  uint8_t* scales = zeros + 2 * channels;
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    for (uint32_t i = 0; i < d; ++i) {
      const size_t c = static_cast<size_t>(h) * d + i;
      uint16_t amax_bits = 0;
      float lo = 0.0f;
      float hi = 0.0f;
      for (uint32_t t = 0; t < num_rows; ++t) {
        const uint16_t bits = LoadU16(view.Head(rows[t], h) + 2 * i);
        if ((bits & 0x7FFFu) > amax_bits) amax_bits = bits & 0x7FFFu;
        const float x = HalfToFloat(bits, fmt.dtype);
        if (t == 0 || x < lo) lo = x;
        if (t == 0 || x > hi) hi = x;
      }
      if (amax_bits >= InfBits(fmt.dtype)) return false;
      const uint16_t z_bits = KiviKZeroBits(lo, fmt.dtype);
      const uint16_t s_bits = KiviKScaleBf16(lo, hi);
      const float z = HalfToFloat(z_bits, fmt.dtype);
      const float s = Bf16ToFloat(s_bits);
      for (uint32_t t = 0; t < num_rows; ++t) {
        const float x = HalfToFloat(LoadU16(view.Head(rows[t], h) + 2 * i), fmt.dtype);
        uint8_t& byte = dst[t * code_bytes + c / 2];
        const uint32_t q = QuantizeKiviKElement(x, z, s);
        byte = (c % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0u) | q)
                            : static_cast<uint8_t>((byte & 0x0Fu) | (q << 4));
      }
      StoreU16(zeros + 2 * c, z_bits);
      StoreU16(scales + 2 * c, s_bits);
    }
  }
  return true;
}

void DecodeKiviKRowsReference(const RowFormat& fmt, const uint8_t* plane, uint32_t block_tokens,
                              uint32_t begin, uint32_t end, const StridedView& view,
                              const uint32_t* rows) {
  if (view.dim_run != 0) {  // split heads: into a contiguous copy, then scattered
    std::vector<uint8_t> bytes;
    const StridedView copy = RowCopy(fmt, &bytes, end - begin);
    DecodeKiviKRowsReference(fmt, plane, block_tokens, begin, end, copy, Iota(end - begin).data());
    ScatterHeads(copy.base, fmt.num_heads, fmt.head_dim, view, rows, end - begin);
    return;
  }
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const size_t code_bytes = channels / 2;
  const uint8_t* zeros = plane + static_cast<size_t>(block_tokens) * code_bytes;
  const uint8_t* scales = zeros + 2 * channels;
  for (uint32_t t = begin; t < end; ++t) {
    const uint8_t* codes = plane + t * code_bytes;
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      uint8_t* out = view.Head(rows[t - begin], h);
      for (uint32_t i = 0; i < d; ++i) {
        const size_t c = static_cast<size_t>(h) * d + i;
        const uint32_t q = (c % 2 == 0) ? (codes[c / 2] & 0xFu) : (codes[c / 2] >> 4);
        StoreU16(out + 2 * i,
                 DequantizeKiviKElement(q, HalfToFloat(LoadU16(zeros + 2 * c), fmt.dtype),
                                        Bf16ToFloat(LoadU16(scales + 2 * c)), fmt.dtype));
      }
    }
  }
}

namespace {

// Rotates one head (head_dim elements of the input dtype at `src`) into y[0..head_dim): bf16
// values as fp32. False when a run's transform leaves HadamardLimitBits (NaN or Inf included).
bool RotateHeadReference(const RowFormat& fmt, const uint8_t* src, float* y) {
  const uint32_t d = fmt.head_dim;
  const uint32_t r = HadamardRun(d);
  const float e = HadamardEncodeFactor(r);
  const uint32_t limit = HadamardLimitBits(r);
  for (uint32_t i = 0; i < d; ++i) y[i] = HalfToFloat(LoadU16(src + 2 * i), fmt.dtype);
  for (uint32_t j = 0; j < d; j += r) HadamardTransform(y + j, r);
  for (uint32_t i = 0; i < d; ++i) {
    if (!HadamardInRange(y[i], limit)) return false;
    y[i] = Bf16ToFloat(FloatToBf16Sat(y[i] * e));
  }
  return true;
}

// The nibble pair of rotated elements y[0], y[1] with parameters (z0, s0), (z1, s1).
uint8_t KiviNibblePair(const float* y, float z0, float s0, float z1, float s1) {
  return static_cast<uint8_t>(QuantizeKiviKElement(y[0], z0, s0) |
                              (QuantizeKiviKElement(y[1], z1, s1) << 4));
}

// INT4 Hadamard's tokens 1..num_rows-1 of a plane (whole heads).
bool EncodeHadamardRotatedReference(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                                    const uint32_t* rows, uint32_t num_rows, uint8_t* dst) {
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const uint32_t n = num_rows - 1;  // the rotated tokens 1..num_rows-1
  std::vector<float> y(n * channels);
  for (uint32_t t = 0; t < n; ++t) {
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      if (!RotateHeadReference(fmt, view.Head(rows[t + 1], h), &y[t * channels + h * d])) {
        return false;
      }
    }
  }
  if (plane == 0) {  // per channel over the tokens
    uint8_t* zeros = dst + fmt.PlaneRowOffset(0, num_rows);
    uint8_t* scales = zeros + 2 * channels;
    std::vector<float> z(channels);
    std::vector<float> s(channels);
    for (size_t c = 0; c < channels; ++c) {
      float lo = y[c];
      float hi = y[c];
      for (uint32_t t = 1; t < n; ++t) {
        lo = y[t * channels + c] < lo ? y[t * channels + c] : lo;
        hi = y[t * channels + c] > hi ? y[t * channels + c] : hi;
      }
      const uint16_t z_bits = KiviKZeroBits(lo, DType::kBF16);
      const uint16_t s_bits = KiviKScaleBf16(lo, hi);
      StoreU16(zeros + 2 * c, z_bits);
      StoreU16(scales + 2 * c, s_bits);
      z[c] = Bf16ToFloat(z_bits);
      s[c] = Bf16ToFloat(s_bits);
    }
    for (uint32_t t = 0; t < n; ++t) {
      uint8_t* codes = dst + fmt.PlaneRowOffset(0, t + 1);
      for (size_t c = 0; c < channels; c += 2) {
        codes[c / 2] = KiviNibblePair(&y[t * channels + c], z[c], s[c], z[c + 1], s[c + 1]);
      }
    }
    return true;
  }
  const size_t groups = channels / kInt4GroupElems;  // per group of 32 of one token
  for (uint32_t t = 0; t < n; ++t) {
    uint8_t* codes = dst + fmt.PlaneRowOffset(1, t + 1);
    uint8_t* zeros = codes + channels / 2;
    uint8_t* scales = zeros + 2 * groups;
    for (size_t g = 0; g < groups; ++g) {
      const float* yg = &y[t * channels + g * kInt4GroupElems];
      float lo = yg[0];
      float hi = yg[0];
      for (uint32_t i = 1; i < kInt4GroupElems; ++i) {
        lo = yg[i] < lo ? yg[i] : lo;
        hi = yg[i] > hi ? yg[i] : hi;
      }
      const uint16_t z_bits = KiviKZeroBits(lo, DType::kBF16);
      const uint16_t s_bits = KiviKScaleBf16(lo, hi);
      StoreU16(zeros + 2 * g, z_bits);
      StoreU16(scales + 2 * g, s_bits);
      const float z = Bf16ToFloat(z_bits);
      const float sc = Bf16ToFloat(s_bits);
      for (uint32_t i = 0; i < kInt4GroupElems; i += 2) {
        codes[(g * kInt4GroupElems + i) / 2] = KiviNibblePair(yg + i, z, sc, z, sc);
      }
    }
  }
  return true;
}

// INT4 Hadamard's rows [begin, end) of a plane into whole heads.
void DecodeHadamardWholeHeads(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                              uint32_t block_tokens, uint32_t begin, uint32_t end,
                              const StridedView& view, const uint32_t* rows) {
  const uint32_t d = fmt.head_dim;
  const uint32_t r = HadamardRun(d);
  const float c_d = HadamardDecodeFactor(r);
  const size_t channels = fmt.ElementsPerRow();
  std::vector<float> w(d);
  for (uint32_t t = begin; t < end; ++t) {
    const uint32_t row = rows[t - begin];
    if (t == 0) {
      DecodeRowReference(fmt.FirstRowFormat(), src, view, row);
      continue;
    }
    const uint8_t* codes = src + fmt.PlaneRowOffset(plane, t);
    // Plane 0: a pair per channel after the plane's rows; plane 1: a pair per group in the row.
    const uint8_t* zeros =
        plane == 0 ? src + fmt.PlaneRowOffset(0, block_tokens) : codes + channels / 2;
    const uint8_t* scales = zeros + 2 * (plane == 0 ? channels : channels / kInt4GroupElems);
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      for (uint32_t i = 0; i < d; ++i) {
        const size_t c = static_cast<size_t>(h) * d + i;
        const size_t k = plane == 0 ? c : c / kInt4GroupElems;
        const uint32_t q = (c % 2 == 0) ? (codes[c / 2] & 0xFu) : (codes[c / 2] >> 4);
        w[i] =
            Bf16ToFloat(DequantizeKiviKElement(q, Bf16ToFloat(LoadU16(zeros + 2 * k)),
                                               Bf16ToFloat(LoadU16(scales + 2 * k)), DType::kBF16));
      }
      for (uint32_t j = 0; j < d; j += r) HadamardTransform(w.data() + j, r);
      uint8_t* out = view.Head(row, h);
      for (uint32_t i = 0; i < d; ++i) StoreU16(out + 2 * i, FloatToHalfSat(w[i] * c_d, fmt.dtype));
    }
  }
}

}  // namespace

bool EncodeHadamardPlaneReference(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                                  const uint32_t* rows, uint32_t num_rows, uint8_t* dst) {
  return EncodeAfterInt8Row(
      fmt, view, rows, num_rows, dst, [&](const StridedView& whole, const uint32_t* whole_rows) {
        return EncodeHadamardRotatedReference(fmt, plane, whole, whole_rows, num_rows, dst);
      });
}

void DecodeHadamardRowsReference(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                                 uint32_t block_tokens, uint32_t begin, uint32_t end,
                                 const StridedView& view, const uint32_t* rows) {
  DecodeWholeHeads(fmt, end - begin, view, rows, [&](const StridedView& v, const uint32_t* r) {
    DecodeHadamardWholeHeads(fmt, plane, src, block_tokens, begin, end, v, r);
  });
}

namespace {

// An allot codec's K plane's channel parameters, as the decoder reads them back: each channel's
// width, zero point (its lower bound), scale and bit offset in a row.
struct AllotKeyChannels {
  std::vector<uint8_t> width;
  std::vector<float> zero;
  std::vector<float> scale;
  std::vector<uint32_t> offset;
};

// From the parameters at `params` (H bf16 steps, H*D int8 lower, H*D int8 upper bounds).
AllotKeyChannels ReadAllotKeyChannels(const RowFormat& fmt, const uint8_t* params) {
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const auto* lower = reinterpret_cast<const int8_t*>(params + 2 * fmt.num_heads);
  const int8_t* upper = lower + channels;
  AllotKeyChannels ch;
  ch.width.resize(channels);
  ch.zero.resize(channels);
  ch.scale.resize(channels);
  ch.offset.resize(channels);
  std::vector<uint32_t> range(channels);
  for (size_t c = 0; c < channels; ++c) {
    const float step = Bf16ToFloat(LoadU16(params + 2 * (c / d)));
    range[c] = AllotRangeBits(lower[c], upper[c], step);
  }
  AllotKeyWidths(range.data(), static_cast<uint32_t>(channels), fmt.Allot(), ch.width.data());
  uint32_t bit = 0;
  for (size_t c = 0; c < channels; ++c) {
    const float step = Bf16ToFloat(LoadU16(params + 2 * (c / d)));
    const float lo = static_cast<float>(lower[c]) * step;
    const float hi = static_cast<float>(upper[c]) * step;
    ch.zero[c] = lo;
    ch.scale[c] = Bf16ToFloat(AsymScaleBf16(lo, hi, (1u << ch.width[c]) - 1u));
    ch.offset[c] = bit;
    bit += ch.width[c];
  }
  return ch;
}

// An allot codec's K plane, tokens 1..num_rows-1 (whole heads): turned back, bounded, allotted,
// coded. False when a key is NaN, Inf or of magnitude >= 2^120.
bool EncodeAllotKeysReference(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                              uint32_t num_rows, uint8_t* dst) {
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const uint32_t n = num_rows - 1;
  const RopeTurn turn = MakeRopeTurn(fmt, num_rows);
  std::vector<float> y(n * channels);
  std::vector<float> x(d);
  for (uint32_t t = 1; t < num_rows; ++t) {
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      const uint8_t* src = view.Head(rows[t], h);
      for (uint32_t i = 0; i < d; ++i) {
        x[i] = HalfToFloat(LoadU16(src + 2 * i), fmt.dtype);
        if ((FloatToBits(x[i]) & 0x7FFFFFFFu) >= kAllotKeyLimitBits) return false;
      }
      float* yt = &y[(t - 1) * channels + size_t{h} * d];
      for (uint32_t i = 0; i < d; ++i) {
        const uint32_t j = RopePairIndex(i, d, fmt.rope_interleaved);
        yt[i] = TurnBack(x[i], x[RopePartner(i, d, fmt.rope_interleaved)], turn.Cos(t, j),
                         turn.Sin(t, j), RopeIsFirst(i, d, fmt.rope_interleaved));
      }
    }
  }
  uint8_t* params = dst + fmt.PlaneRowOffset(0, num_rows);
  auto* lower = reinterpret_cast<int8_t*>(params + 2 * fmt.num_heads);
  int8_t* upper = lower + channels;
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    float m = 0.0f;
    for (uint32_t t = 0; t < n; ++t) {
      for (uint32_t i = 0; i < d; ++i) {
        const float a = y[t * channels + size_t{h} * d + i];
        m = (a < 0.0f ? -a : a) > m ? (a < 0.0f ? -a : a) : m;
      }
    }
    const uint16_t step_bits = AllotStepBf16(m);
    StoreU16(params + 2 * h, step_bits);
    const float step = Bf16ToFloat(step_bits);
    for (uint32_t i = 0; i < d; ++i) {
      const size_t c = size_t{h} * d + i;
      float lo = y[c];
      float hi = y[c];
      for (uint32_t t = 1; t < n; ++t) {
        lo = y[t * channels + c] < lo ? y[t * channels + c] : lo;
        hi = y[t * channels + c] > hi ? y[t * channels + c] : hi;
      }
      lower[c] = AllotLowerSteps(lo, step);
      upper[c] = AllotUpperSteps(hi, step);
    }
  }
  const AllotKeyChannels ch = ReadAllotKeyChannels(fmt, params);
  const size_t row_bytes = AllotKeyRowBytes(channels, fmt.Allot());
  for (uint32_t t = 0; t < n; ++t) {
    uint8_t* codes = dst + fmt.PlaneRowOffset(0, t + 1);
    std::memset(codes, 0, row_bytes);
    for (size_t c = 0; c < channels; ++c) {
      const uint32_t top = (1u << ch.width[c]) - 1u;
      PutBits(codes, ch.offset[c],
              QuantizeAsymElement(y[t * channels + c], ch.zero[c], ch.scale[c], top), ch.width[c]);
    }
  }
  return true;
}

// An allot codec's V plane, tokens 1..num_rows-1 (whole heads): rotated, codes of
// fmt.Allot().value bits per head.
bool EncodeAllotValuesReference(const RowFormat& fmt, const StridedView& view, const uint32_t* rows,
                                uint32_t num_rows, uint8_t* dst) {
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  const AllotBits bits = fmt.Allot();
  const uint32_t top = AllotValueTop(bits);
  std::vector<float> y(d);
  for (uint32_t t = 1; t < num_rows; ++t) {
    uint8_t* codes = dst + fmt.PlaneRowOffset(1, t);
    uint8_t* zeros = codes + AllotValueCodeBytes(channels, bits);
    uint8_t* scales = zeros + 2 * fmt.num_heads;
    std::memset(codes, 0, AllotValueCodeBytes(channels, bits));
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      if (!RotateHeadReference(fmt, view.Head(rows[t], h), y.data())) return false;
      float lo = y[0];
      float hi = y[0];
      for (uint32_t i = 1; i < d; ++i) {
        lo = y[i] < lo ? y[i] : lo;
        hi = y[i] > hi ? y[i] : hi;
      }
      const uint16_t z_bits = KiviKZeroBits(lo, DType::kBF16);
      const uint16_t s_bits = AsymScaleBf16(lo, hi, top);
      StoreU16(zeros + 2 * h, z_bits);
      StoreU16(scales + 2 * h, s_bits);
      const float z = Bf16ToFloat(z_bits);
      const float sc = Bf16ToFloat(s_bits);
      for (uint32_t i = 0; i < d; ++i) {
        PutBits(codes, (size_t{h} * d + i) * bits.value, QuantizeAsymElement(y[i], z, sc, top),
                bits.value);
      }
    }
  }
  return true;
}

}  // namespace

bool EncodeAllotPlaneReference(const RowFormat& fmt, uint32_t plane, const StridedView& view,
                               const uint32_t* rows, uint32_t num_rows, uint8_t* dst) {
  return EncodeAfterInt8Row(
      fmt, view, rows, num_rows, dst, [&](const StridedView& whole, const uint32_t* whole_rows) {
        return plane == 0 ? EncodeAllotKeysReference(fmt, whole, whole_rows, num_rows, dst)
                          : EncodeAllotValuesReference(fmt, whole, whole_rows, num_rows, dst);
      });
}

namespace {

// An allot codec's rows [begin, end) of a plane into whole heads.
void DecodeAllotWholeHeads(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                           uint32_t block_tokens, uint32_t begin, uint32_t end,
                           const StridedView& view, const uint32_t* rows) {
  const uint32_t d = fmt.head_dim;
  const size_t channels = fmt.ElementsPerRow();
  if (begin == 0) DecodeRowReference(fmt.FirstRowFormat(), src, view, rows[0]);
  const uint32_t first = begin == 0 ? 1 : begin;
  if (first >= end) return;
  std::vector<float> y(channels);
  if (plane == 0) {
    const RopeTurn turn = MakeRopeTurn(fmt, block_tokens);
    const AllotKeyChannels ch =
        ReadAllotKeyChannels(fmt, src + fmt.PlaneRowOffset(0, block_tokens));
    for (uint32_t t = first; t < end; ++t) {
      const uint8_t* codes = src + fmt.PlaneRowOffset(0, t);
      for (size_t c = 0; c < channels; ++c) {
        y[c] =
            DequantizeAsymFloat(GetBits(codes, ch.offset[c], ch.width[c]), ch.zero[c], ch.scale[c]);
      }
      for (uint32_t h = 0; h < fmt.num_heads; ++h) {
        const float* yh = &y[size_t{h} * d];
        uint8_t* out = view.Head(rows[t - begin], h);
        for (uint32_t i = 0; i < d; ++i) {
          const uint32_t j = RopePairIndex(i, d, fmt.rope_interleaved);
          const float v =
              TurnForward(yh[i], yh[RopePartner(i, d, fmt.rope_interleaved)], turn.Cos(t, j),
                          turn.Sin(t, j), RopeIsFirst(i, d, fmt.rope_interleaved));
          StoreU16(out + 2 * i, FloatToHalfSat(v, fmt.dtype));
        }
      }
    }
    return;
  }
  const uint32_t r = HadamardRun(d);
  const float c_d = HadamardDecodeFactor(r);
  const AllotBits bits = fmt.Allot();
  for (uint32_t t = first; t < end; ++t) {
    const uint8_t* codes = src + fmt.PlaneRowOffset(1, t);
    const uint8_t* zeros = codes + AllotValueCodeBytes(channels, bits);
    const uint8_t* scales = zeros + 2 * fmt.num_heads;
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      const float z = Bf16ToFloat(LoadU16(zeros + 2 * h));
      const float sc = Bf16ToFloat(LoadU16(scales + 2 * h));
      for (uint32_t i = 0; i < d; ++i) {
        const uint32_t q = GetBits(codes, (size_t{h} * d + i) * bits.value, bits.value);
        y[i] = Bf16ToFloat(FloatToBf16Sat(DequantizeAsymFloat(q, z, sc)));
      }
      for (uint32_t j = 0; j < d; j += r) HadamardTransform(y.data() + j, r);
      uint8_t* out = view.Head(rows[t - begin], h);
      for (uint32_t i = 0; i < d; ++i) StoreU16(out + 2 * i, FloatToHalfSat(y[i] * c_d, fmt.dtype));
    }
  }
}

}  // namespace

void DecodeAllotRowsReference(const RowFormat& fmt, uint32_t plane, const uint8_t* src,
                              uint32_t block_tokens, uint32_t begin, uint32_t end,
                              const StridedView& view, const uint32_t* rows) {
  DecodeWholeHeads(fmt, end - begin, view, rows, [&](const StridedView& v, const uint32_t* r) {
    DecodeAllotWholeHeads(fmt, plane, src, block_tokens, begin, end, v, r);
  });
}

bool EncodeRowReference(const RowFormat& fmt, const StridedView& view, uint32_t row, uint8_t* dst) {
  if (view.dim_run != 0) {
    std::vector<uint8_t> bytes;
    const StridedView copy = RowCopy(fmt, &bytes);
    GatherHeads(view, fmt.num_heads, fmt.head_dim, &row, 1, copy.base);
    return EncodeRowReference(fmt, copy, 0, dst);
  }
  const uint32_t d = fmt.head_dim;
  if (fmt.codec == CodecKind::kRaw) {
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      std::memcpy(dst + static_cast<size_t>(h) * d * 2, view.Head(row, h), d * 2u);
    }
    return true;
  }
  if (fmt.IsInt4Rows()) return EncodeRowInt4(fmt, view, row, dst);
  const bool fp8 = fmt.codec == CodecKind::kFp8E4m3PerHead;
  uint8_t* codes = dst;
  uint8_t* scales = dst + fmt.ElementsPerRow();
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    const uint8_t* src = view.Head(row, h);
    uint16_t amax_bits = 0;
    for (uint32_t i = 0; i < d; ++i) {
      uint16_t a = LoadU16(src + 2 * i) & 0x7FFFu;
      if (a > amax_bits) amax_bits = a;
    }
    if (amax_bits >= InfBits(fmt.dtype)) return false;
    uint16_t s_bits = fp8 ? Fp8ScaleBf16FromAmaxBits(amax_bits, fmt.dtype)
                          : ScaleBf16FromAmaxBits(amax_bits, fmt.dtype);
    float s = Bf16ToFloat(s_bits);
    for (uint32_t i = 0; i < d; ++i) {
      float x = HalfToFloat(LoadU16(src + 2 * i), fmt.dtype);
      codes[static_cast<size_t>(h) * d + i] =
          fp8 ? QuantizeFp8Element(x, s) : static_cast<uint8_t>(QuantizeElement(x, s));
    }
    StoreU16(scales + 2 * h, s_bits);
  }
  return true;
}

void DecodeRowReference(const RowFormat& fmt, const uint8_t* src, const StridedView& view,
                        uint32_t row) {
  if (view.dim_run != 0) {
    std::vector<uint8_t> bytes;
    const StridedView copy = RowCopy(fmt, &bytes);
    DecodeRowReference(fmt, src, copy, 0);
    ScatterHeads(copy.base, fmt.num_heads, fmt.head_dim, view, &row, 1);
    return;
  }
  const uint32_t d = fmt.head_dim;
  if (fmt.codec == CodecKind::kRaw) {
    for (uint32_t h = 0; h < fmt.num_heads; ++h) {
      std::memcpy(view.Head(row, h), src + static_cast<size_t>(h) * d * 2, d * 2u);
    }
    return;
  }
  if (fmt.IsInt4Rows()) return DecodeRowInt4(fmt, src, view, row);
  const bool fp8 = fmt.codec == CodecKind::kFp8E4m3PerHead;
  const uint8_t* codes = src;
  const uint8_t* scales = src + fmt.ElementsPerRow();
  for (uint32_t h = 0; h < fmt.num_heads; ++h) {
    float s = Bf16ToFloat(LoadU16(scales + 2 * h));
    uint8_t* dst = view.Head(row, h);
    for (uint32_t i = 0; i < d; ++i) {
      const uint8_t c = codes[static_cast<size_t>(h) * d + i];
      StoreU16(dst + 2 * i, fp8 ? DequantizeFp8Element(c, s, fmt.dtype)
                                : DequantizeElement(static_cast<int8_t>(c), s, fmt.dtype));
    }
  }
}

void EncodeBlocksReference(const EncodeJob& job) {
  const BlockLayout& lay = job.layout;
  for (uint32_t b = 0; b < job.num_blocks; ++b) {
    bool finite = true;
    const uint32_t* rows = job.rows + static_cast<size_t>(b) * lay.block_tokens;
    for (uint32_t l = 0; l < lay.num_layers; ++l) {
      for (uint32_t p = 0; p < lay.kv_planes; ++p) {
        if (lay.row.codec == CodecKind::kInt4Hadamard) {
          finite &=
              EncodeHadamardPlaneReference(lay.row, p, job.layers[l].planes[p], rows,
                                           lay.block_tokens, job.blocks[b] + lay.PlaneOffset(l, p));
          continue;
        }
        if (lay.row.IsAllot()) {
          finite &=
              EncodeAllotPlaneReference(lay.row, p, job.layers[l].planes[p], rows, lay.block_tokens,
                                        job.blocks[b] + lay.PlaneOffset(l, p));
          continue;
        }
        if (lay.row.codec == CodecKind::kInt4Kivi && p == 0) {
          finite &=
              EncodeKiviKPlaneReference(lay.row, job.layers[l].planes[0], rows, lay.block_tokens,
                                        job.blocks[b] + lay.PlaneOffset(l, 0));
          continue;
        }
        for (uint32_t t = 0; t < lay.block_tokens; ++t) {
          finite &= EncodeRowReference(lay.row, job.layers[l].planes[p], rows[t],
                                       job.blocks[b] + lay.RowOffset(l, p, t));
        }
      }
    }
    if (job.nonfinite != nullptr) job.nonfinite[b] = finite ? 0 : 1;
  }
}

void DecodeLayerReference(const DecodeJob& job, uint32_t layer) {
  const BlockLayout& lay = job.layout;
  for (uint32_t b = 0; b < job.num_blocks; ++b) {
    const uint32_t* rows = job.rows + static_cast<size_t>(b) * lay.block_tokens;
    for (uint32_t p = 0; p < lay.kv_planes; ++p) {
      if (lay.row.codec == CodecKind::kInt4Hadamard) {
        DecodeHadamardRowsReference(lay.row, p, job.blocks[b] + lay.PlaneOffset(layer, p),
                                    lay.block_tokens, 0, lay.block_tokens,
                                    job.layers[layer].planes[p], rows);
        continue;
      }
      if (lay.row.IsAllot()) {
        DecodeAllotRowsReference(lay.row, p, job.blocks[b] + lay.PlaneOffset(layer, p),
                                 lay.block_tokens, 0, lay.block_tokens, job.layers[layer].planes[p],
                                 rows);
        continue;
      }
      if (lay.row.codec == CodecKind::kInt4Kivi && p == 0) {
        DecodeKiviKRowsReference(lay.row, job.blocks[b] + lay.PlaneOffset(layer, 0),
                                 lay.block_tokens, 0, lay.block_tokens, job.layers[layer].planes[0],
                                 rows);
        continue;
      }
      for (uint32_t t = 0; t < lay.block_tokens; ++t) {
        DecodeRowReference(lay.row, job.blocks[b] + lay.RowOffset(layer, p, t),
                           job.layers[layer].planes[p], rows[t]);
      }
    }
  }
}

void DecodeBlocksReference(const DecodeJob& job) {
  for (uint32_t l = 0; l < job.layout.num_layers; ++l) DecodeLayerReference(job, l);
}

}  // namespace hiqcache::kernels
