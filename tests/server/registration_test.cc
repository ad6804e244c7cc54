// Request validation (registration.h): every malformed registration or transfer is rejected with
// INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for size limits) and a message naming the field; the
// engine layouts docs/design.md lists are accepted and give the right BlockLayout.
#include "core/registration.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "pool/pool_format.h"
#include "register_spec_util.h"
#include "server_test_util.h"

namespace hiqcache::server {
namespace {

// Proto enum values other than BaseSpec's (BF16, MHA, INT8, HOST).
constexpr int kFp16 = 2;
constexpr int kMla = 2;
constexpr int kRaw = 1;
constexpr int kCuda = 2;
constexpr uint64_t kBigPool = 64ull << 30;

using testing::RowView;

RegisterSpec Base(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t block_tokens) {
  return testing::BaseSpec("Qwen/Qwen3-8B@main", layers, heads, dim, block_tokens);
}

BufferSpec HostBuffer(const std::string& name, uint64_t size) {
  BufferSpec b;
  b.has_host_shm_name = true;
  b.host_shm_name = name;
  b.size_bytes = size;
  return b;
}

// SGLang: per-layer K and V buffers [slots, heads, dim].
RegisterSpec SglangSpec(uint32_t layers = 36, uint32_t heads = 8, uint32_t dim = 128,
                        uint32_t slots = 1024, uint32_t block_tokens = 64) {
  RegisterSpec s = Base(layers, heads, dim, block_tokens);
  const uint64_t row = uint64_t{heads} * dim * 2;
  for (uint32_t l = 0; l < layers; ++l) {
    s.buffers.push_back(HostBuffer("/sgl-k" + std::to_string(l), row * slots));
    s.buffers.push_back(HostBuffer("/sgl-v" + std::to_string(l), row * slots));
    s.layers.push_back({RowView(2 * l, 0, row, slots), RowView(2 * l + 1, 0, row, slots)});
  }
  return s;
}

// vLLM (flash-attn layout): one buffer per layer, [2, blocks, block_size, heads, dim].
RegisterSpec VllmPagedSpec(uint32_t layers = 36, uint32_t heads = 8, uint32_t dim = 128,
                           uint32_t blocks = 32, uint32_t block_size = 16,
                           uint32_t block_tokens = 64) {
  RegisterSpec s = Base(layers, heads, dim, block_tokens);
  const uint64_t row = uint64_t{heads} * dim * 2;
  const uint64_t page = row * block_size;
  for (uint32_t l = 0; l < layers; ++l) {
    s.buffers.push_back(HostBuffer("vllm-" + std::to_string(l), 2 * page * blocks));
    ViewSpec k = RowView(l, 0, row, blocks * block_size);
    k.page_rows = block_size;
    k.page_stride_bytes = page;
    ViewSpec v = k;
    v.offset_bytes = page * blocks;
    s.layers.push_back({k, v});
  }
  return s;
}

// vLLM packed: one buffer per layer, [blocks, heads, block_size, 2*dim], V dim elements after K.
RegisterSpec VllmPackedSpec(uint32_t layers = 36, uint32_t heads = 8, uint32_t dim = 128,
                            uint32_t blocks = 32, uint32_t block_size = 16,
                            uint32_t block_tokens = 64) {
  RegisterSpec s = Base(layers, heads, dim, block_tokens);
  const uint64_t row = uint64_t{dim} * 2 * 2;
  const uint64_t head = row * block_size;
  const uint64_t page = head * heads;
  for (uint32_t l = 0; l < layers; ++l) {
    s.buffers.push_back(HostBuffer("/packed-" + std::to_string(l), page * blocks));
    ViewSpec k = RowView(l, 0, row, blocks * block_size);
    k.head_stride_bytes = head;
    k.page_rows = block_size;
    k.page_stride_bytes = page;
    ViewSpec v = k;
    v.offset_bytes = uint64_t{dim} * 2;
    s.layers.push_back({k, v});
  }
  return s;
}

// MLA (DeepSeek-style): one latent row of 576 per token, one buffer per layer, V unset.
RegisterSpec MlaSpec(uint32_t layers = 61, uint32_t slots = 512) {
  RegisterSpec s = Base(layers, 1, 576, 64);
  s.attention = kMla;
  s.tp_rank = 3;
  s.tp_size = 8;
  for (uint32_t l = 0; l < layers; ++l) {
    s.buffers.push_back(HostBuffer("/mla-" + std::to_string(l), 576 * 2 * slots));
    ViewSpec k = RowView(l, 0, 576 * 2, slots);
    s.layers.push_back({k, ViewSpec{}});
  }
  return s;
}

// Expects INVALID_ARGUMENT whose message contains `field`.
void ExpectInvalid(const RegisterSpec& s, const std::string& field, uint64_t pool = kBigPool) {
  auto r = ValidateRegistration(s, Limits{}, pool);
  ASSERT_FALSE(r.ok()) << "accepted, expected an error naming " << field;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find(field), std::string::npos)
      << "message '" << r.status().message() << "' does not name " << field;
}

void ExpectValid(const RegisterSpec& s, uint64_t pool = kBigPool) {
  auto r = ValidateRegistration(s, Limits{}, pool);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
}

// ---------------------------------------------------------------------------------------------
// Valid registrations and their layouts.

TEST(ValidateRegistrationTest, SglangQwen3_8B) {
  RegisterSpec s = SglangSpec();
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->cuda);
  EXPECT_EQ(r->layout.BytesPerToken(), 74880u);
  EXPECT_EQ(r->layout.BlockBytes(), 4792320u);
  EXPECT_EQ(r->layout.kv_planes, 2u);
  EXPECT_EQ(r->layout.num_layers, 36u);
  EXPECT_EQ(r->layout.block_tokens, 64u);
  EXPECT_EQ(r->layout.row.num_heads, 8u);
  EXPECT_EQ(r->layout.row.head_dim, 128u);
  EXPECT_EQ(r->layout.row.dtype, kernels::DType::kBF16);
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kInt8PerHead);
  EXPECT_EQ(r->ns.model, s.model);
  EXPECT_FALSE(r->ns.mla);
  EXPECT_EQ(MinRows(s), 1024u);
}

TEST(ValidateRegistrationTest, RawCodecAndFp16) {
  RegisterSpec s = SglangSpec();
  s.codec = kRaw;
  s.dtype = kFp16;
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layout.BytesPerToken(), 147456u);
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kRaw);
  EXPECT_EQ(r->layout.row.dtype, kernels::DType::kFP16);
}

TEST(ValidateRegistrationTest, Fp8CodecHasInt8Size) {
  RegisterSpec s = SglangSpec();
  s.codec = 2;  // CODEC_FP8_E4M3_PER_HEAD
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kFp8E4m3PerHead);
  EXPECT_EQ(r->layout.BytesPerToken(), 74880u);
  EXPECT_EQ(r->layout.BlockBytes(), 4792320u);
}

TEST(ValidateRegistrationTest, Int4CodecRowsOfGroupsOf32) {
  RegisterSpec s = SglangSpec();
  s.codec = 3;  // CODEC_INT4_G32_PER_HEAD
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kInt4G32PerHead);
  EXPECT_EQ(r->layout.row.RowBytes(), 576u);
  EXPECT_EQ(r->layout.BytesPerToken(), 41472u);
  EXPECT_EQ(r->layout.BlockBytes(), 41472u * s.block_tokens);
  for (uint32_t dim : {32u, 64u, 576u}) {
    RegisterSpec t = SglangSpec(36, 8, dim);
    t.codec = 3;
    EXPECT_TRUE(ValidateRegistration(t, Limits{}, kBigPool).ok()) << dim;
  }
}

TEST(ValidateRegistrationTest, Int4RejectsHeadDimNotMultipleOf32) {
  for (uint32_t dim : {1u, 16u, 48u, 100u, 127u}) {
    RegisterSpec s = SglangSpec(36, 8, dim);
    s.codec = 3;
    ExpectInvalid(s, "geometry.head_dim");
    s.codec = 0;  // INT8 takes any head_dim
    EXPECT_TRUE(ValidateRegistration(s, Limits{}, kBigPool).ok()) << dim;
  }
}

TEST(ValidateRegistrationTest, Int4KiviPlanesOfTheirOwnSizes) {
  RegisterSpec s = SglangSpec();  // Qwen3-8B geometry, 64-token blocks
  s.codec = 4;                    // CODEC_INT4_KIVI
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kInt4Kivi);
  // K: 64 rows of 512 bytes + 4,096 bytes of channel parameters; V: 64 INT4 rows of 576.
  EXPECT_EQ(r->layout.PlaneBytes(0), 64u * 512u + 4096u);
  EXPECT_EQ(r->layout.PlaneBytes(1), 64u * 576u);
  EXPECT_EQ(r->layout.BytesPerToken(), 41472u);
  EXPECT_EQ(r->layout.BlockBytes(), 41472u * 64u);
  RegisterSpec v = VllmPagedSpec(36, 8, 128, 32, 16, 16);  // 16-token blocks
  v.codec = 4;
  auto r16 = ValidateRegistration(v, Limits{}, kBigPool);
  ASSERT_TRUE(r16.ok()) << r16.status().ToString();
  EXPECT_EQ(r16->layout.BytesPerToken(), 48384u);
  // Its own namespace: the same pool under INT4 hashes differently.
  RegisterSpec i4 = s;
  i4.codec = 3;
  EXPECT_NE(r->ns.CanonicalText(),
            ValidateRegistration(i4, Limits{}, kBigPool)->ns.CanonicalText());
  for (uint32_t dim : {1u, 48u, 100u}) {
    RegisterSpec t = SglangSpec(36, 8, dim);
    t.codec = 4;
    ExpectInvalid(t, "geometry.head_dim");
  }
}

// A CUDA pool's buffers and slots in place of `s`'s HOST ones.
RegisterSpec OnCuda(RegisterSpec s) {
  s.device_kind = kCuda;
  for (auto& b : s.buffers) {
    b.has_host_shm_name = false;
    b.host_shm_name.clear();
    b.has_cuda_ipc_handle = true;
    b.cuda_ipc_handle = std::string(64, '\x01');
  }
  s.events.host_fd_id = 1;
  s.events.count = 8;
  return s;
}

// CUDA pools take CODEC_INT4_KIVI with HOST's geometry rules: the same layout, and a head_dim
// that is not a multiple of 32 refused naming geometry.head_dim.
TEST(ValidateRegistrationTest, Int4KiviOnCuda) {
  RegisterSpec s = OnCuda(SglangSpec(2, 8, 128, 64, 16));
  s.codec = 4;
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->cuda);
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kInt4Kivi);
  // K: 16 rows of 512 bytes + 4,096 bytes of channel parameters; V: 16 INT4 rows of 576.
  EXPECT_EQ(r->layout.PlaneBytes(0), 16u * 512u + 4096u);
  EXPECT_EQ(r->layout.PlaneBytes(1), 16u * 576u);
  RegisterSpec host = SglangSpec(2, 8, 128, 64, 16);
  host.codec = 4;
  auto host_r = ValidateRegistration(host, Limits{}, kBigPool);
  ASSERT_TRUE(host_r.ok()) << host_r.status().ToString();
  EXPECT_EQ(r->ns.CanonicalText(), host_r->ns.CanonicalText())
      << "a CUDA pool and a HOST pool of one model share the namespace";
  RegisterSpec bad = s;
  bad.head_dim = 48;
  ExpectInvalid(bad, "geometry.head_dim");
}

// CODEC_INT4_HADAMARD: each plane's first row INT8 (H*D + 2H), the other rows' nibbles, K's
// channel parameters (none in a one-token block), V's per-row group parameters; HOST and CUDA.
TEST(ValidateRegistrationTest, Int4HadamardPlanesOfTheirOwnSizes) {
  RegisterSpec s = SglangSpec();  // Qwen3-8B geometry, 64-token blocks
  s.codec = 5;                    // CODEC_INT4_HADAMARD
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kInt4Hadamard);
  // K: an INT8 row of 1,040, 63 rows of 512, 4,096 bytes of channel parameters; V: an INT8 row,
  // 63 rows of 512 bytes of codes + 128 of zero points and scales.
  EXPECT_EQ(r->layout.PlaneBytes(0), 1040u + 63u * 512u + 4096u);
  EXPECT_EQ(r->layout.PlaneBytes(1), 1040u + 63u * 640u);
  EXPECT_EQ(r->layout.BytesPerToken(), 44298u);
  RegisterSpec v = VllmPagedSpec(36, 8, 128, 32, 16, 16);  // 16-token blocks
  v.codec = 5;
  auto r16 = ValidateRegistration(v, Limits{}, kBigPool);
  ASSERT_TRUE(r16.ok()) << r16.status().ToString();
  EXPECT_EQ(r16->layout.BytesPerToken(), 52776u);
  RegisterSpec one = SglangSpec(36, 8, 128, 1024, 1);  // one-token blocks: INT8 rows only
  one.codec = 5;
  auto r1 = ValidateRegistration(one, Limits{}, kBigPool);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->layout.PlaneBytes(0), 1040u);
  EXPECT_EQ(r1->layout.BytesPerToken(), 74880u);
  RegisterSpec mla = MlaSpec();  // one latent plane of 576 (runs of 64), 64-token blocks
  mla.codec = 5;
  auto rm = ValidateRegistration(mla, Limits{}, kBigPool);
  ASSERT_TRUE(rm.ok()) << rm.status().ToString();
  EXPECT_EQ(rm->layout.PlaneBytes(0), 578u + 63u * 288u + 2304u);
  EXPECT_EQ(rm->layout.BytesPerToken(), 20041u);
  // Its own namespace: the same pool under KIVI hashes differently.
  RegisterSpec kivi = s;
  kivi.codec = 4;
  EXPECT_NE(r->ns.CanonicalText(),
            ValidateRegistration(kivi, Limits{}, kBigPool)->ns.CanonicalText());
  EXPECT_NE(r->ns.CanonicalText().find(";codec=int4_hadamard"), std::string::npos);
  for (uint32_t dim : {1u, 16u, 48u, 100u}) {
    RegisterSpec t = SglangSpec(36, 8, dim);
    t.codec = 5;
    ExpectInvalid(t, "geometry.head_dim: CODEC_INT4_HADAMARD needs a multiple of 32, got " +
                         std::to_string(dim));
  }
  RegisterSpec cuda = SglangSpec(2, 8, 128, 64, 16);
  cuda.device_kind = kCuda;
  for (auto& b : cuda.buffers) {
    b.has_host_shm_name = false;
    b.host_shm_name.clear();
    b.has_cuda_ipc_handle = true;
    b.cuda_ipc_handle = std::string(64, '\x01');
  }
  cuda.events.host_fd_id = 1;
  cuda.events.count = 8;
  cuda.codec = 5;
  auto rc = ValidateRegistration(cuda, Limits{}, kBigPool);
  ASSERT_TRUE(rc.ok()) << rc.status().ToString();
  EXPECT_TRUE(rc->cuda);
  EXPECT_EQ(rc->layout.row.codec, kernels::CodecKind::kInt4Hadamard);
  cuda.head_dim = 48;
  ExpectInvalid(cuda, "geometry.head_dim");
}

// geometry.rope.theta: finite, and 0 (no rotary embedding) or in [1, 1e12], for every codec.
TEST(ValidateRegistrationTest, RopeThetaZeroOrAModelsBase) {
  for (int codec : {0, 6}) {
    for (double theta :
         {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
          -std::numeric_limits<double>::infinity(), -1e6, 0.5, 2e12}) {
      RegisterSpec s = SglangSpec(2, 8, 128, 64, 16);
      s.codec = codec;
      s.rope_theta = theta;
      ExpectInvalid(s, "geometry.rope.theta: must be 0");
    }
    for (double theta : {0.0, 1.0, 1e4, 1e6, 1e12}) {
      RegisterSpec s = SglangSpec(2, 8, 128, 64, 16);
      s.codec = codec;
      s.rope_theta = theta;
      s.rope_interleaved = true;
      ExpectValid(s);
    }
  }
  RegisterSpec s = SglangSpec(2, 8, 128, 64, 16);
  s.rope_theta = 0.5;
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "geometry.rope.theta: must be 0 (no rotary embedding) or in [1, 1e12], got 0.5");
}

// CODEC_INT5_ALLOT: HOST pools with K and V planes and head_dim % 32 == 0; the layout carries
// the rope (and only this codec's does), which is part of its namespace.
TEST(ValidateRegistrationTest, Int5AllotHostPoolsWithTheirRope) {
  RegisterSpec s = SglangSpec(36, 8, 128, 1024, 32);  // Qwen3-8B, 32-token blocks
  s.codec = 6;                                        // CODEC_INT5_ALLOT
  s.rope_theta = 1e6;
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->cuda);
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kInt5Allot);
  EXPECT_EQ(r->layout.row.rope_theta, 1e6);
  EXPECT_FALSE(r->layout.row.rope_interleaved);
  EXPECT_EQ(r->ns.layout.row.rope_theta, 1e6);
  // Per layer, K: an INT8 row (1,040), 31 rows of 21*1024/32 = 672 bytes, 2H + 2*H*D = 2,064 of
  // channel parameters; V: an INT8 row and 31 rows of 5*1024/8 + 4*8 = 672.
  EXPECT_EQ(r->layout.BytesPerToken(), 51534u);
  EXPECT_NE(r->ns.CanonicalText().find(";codec=int5_allot;rope=1000000"), std::string::npos)
      << r->ns.CanonicalText();
  s.rope_interleaved = true;
  auto ri = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(ri.ok()) << ri.status().ToString();
  EXPECT_TRUE(ri->layout.row.rope_interleaved);
  EXPECT_NE(ri->ns.CanonicalText(), r->ns.CanonicalText());
  // No rotary embedding turns nothing, whatever its pairing: one namespace, "rope=none".
  RegisterSpec none = s;
  none.rope_theta = 0;
  auto rn = ValidateRegistration(none, Limits{}, kBigPool);
  ASSERT_TRUE(rn.ok()) << rn.status().ToString();
  EXPECT_FALSE(rn->layout.row.rope_interleaved);
  none.rope_interleaved = false;
  EXPECT_EQ(rn->ns.CanonicalText(),
            ValidateRegistration(none, Limits{}, kBigPool)->ns.CanonicalText());
  EXPECT_NE(rn->ns.CanonicalText().find(";codec=int5_allot;rope=none"), std::string::npos);

  // Another codec leaves the layout's rope unset, whatever the request says.
  RegisterSpec i8 = s;
  i8.codec = 0;
  auto r8 = ValidateRegistration(i8, Limits{}, kBigPool);
  ASSERT_TRUE(r8.ok()) << r8.status().ToString();
  EXPECT_EQ(r8->layout.row.rope_theta, 0.0);
  EXPECT_FALSE(r8->layout.row.rope_interleaved);

  for (uint32_t dim : {16u, 48u, 100u}) {
    RegisterSpec t = SglangSpec(2, 8, dim, 64, 16);
    t.codec = 6;
    ExpectInvalid(t, "geometry.head_dim: CODEC_INT5_ALLOT needs a multiple of 32, got " +
                         std::to_string(dim));
  }
  RegisterSpec mla = MlaSpec();
  mla.codec = 6;
  ExpectInvalid(mla, "geometry.attention: CODEC_INT5_ALLOT needs K and V planes");

  // CUDA pools: head_dim up to 256 (its kernels' limit), a larger one refused naming it.
  RegisterSpec cuda = OnCuda(SglangSpec(2, 8, 128, 64, 16));
  cuda.codec = 6;
  cuda.rope_theta = 1e6;
  auto rc = ValidateRegistration(cuda, Limits{}, kBigPool);
  ASSERT_TRUE(rc.ok()) << rc.status().ToString();
  EXPECT_EQ(rc->layout.row.codec, kernels::CodecKind::kInt5Allot);
  RegisterSpec wide = OnCuda(SglangSpec(2, 2, 512, 64, 16));
  wide.codec = 6;
  ExpectInvalid(wide,
                "geometry.head_dim: CODEC_INT5_ALLOT on a CUDA pool takes up to 256, got 512; "
                "use a HOST pool or another codec");
  RegisterSpec host = SglangSpec(2, 2, 512, 64, 16);  // the same geometry on the host registers
  host.codec = 6;
  ExpectValid(host);
}

// INT5 allot's rules for an allot codec at other widths, each refusal naming `name`: head_dim a
// multiple of 32, K and V planes, CUDA pools up to head_dim 256 (a larger one on the host).
void ExpectInt5AllotsRules(int codec, const std::string& name) {
  SCOPED_TRACE(name);
  RegisterSpec odd = SglangSpec(2, 8, 48, 64, 16);
  odd.codec = codec;
  ExpectInvalid(odd, "geometry.head_dim: " + name + " needs a multiple of 32, got 48");
  RegisterSpec mla = MlaSpec();
  mla.codec = codec;
  ExpectInvalid(mla, "geometry.attention: " + name + " needs K and V planes");
  RegisterSpec cuda = OnCuda(SglangSpec(2, 8, 256, 64, 16));
  cuda.codec = codec;
  ExpectValid(cuda);
  RegisterSpec wide = OnCuda(SglangSpec(2, 2, 512, 64, 16));
  wide.codec = codec;
  ExpectInvalid(wide,
                "geometry.head_dim: " + name +
                    " on a CUDA pool takes up to 256, got 512; use a HOST pool or another codec");
  RegisterSpec host = SglangSpec(2, 2, 512, 64, 16);
  host.codec = codec;
  ExpectValid(host);
}

// CODEC_INT6_ALLOT: INT5 allot's format and rules at other widths, each refusal naming it; its
// own namespace beside INT5 allot's.
TEST(ValidateRegistrationTest, Int6AllotTakesInt5AllotsRulesAtItsWidths) {
  RegisterSpec s = SglangSpec(36, 8, 128, 1024, 32);  // Qwen3-8B, 32-token blocks
  s.codec = 7;                                        // CODEC_INT6_ALLOT
  s.rope_theta = 1e6;
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kInt6Allot);
  EXPECT_EQ(r->layout.row.rope_theta, 1e6);
  // Per layer, K as INT5 allot's (1,040 + 31 * 672 + 2,064); V: an INT8 row and 31 rows of
  // 6*1024/8 + 4*8 = 800.
  EXPECT_EQ(r->layout.BytesPerToken(), 55998u);
  EXPECT_NE(r->ns.CanonicalText().find(";codec=int6_allot;rope=1000000"), std::string::npos)
      << r->ns.CanonicalText();
  RegisterSpec five = s;
  five.codec = 6;
  EXPECT_NE(ValidateRegistration(five, Limits{}, kBigPool)->ns.CanonicalText(),
            r->ns.CanonicalText());

  ExpectInt5AllotsRules(7, "CODEC_INT6_ALLOT");
}

// CODEC_INT4_ALLOT likewise; its keys at 4.4375 bits (568 bytes a row at 8 x 128).
TEST(ValidateRegistrationTest, Int4AllotTakesInt5AllotsRulesAtItsWidths) {
  RegisterSpec s = SglangSpec(36, 8, 128, 1024, 64);  // Qwen3-8B, 64-token blocks
  s.codec = 8;                                        // CODEC_INT4_ALLOT
  s.rope_theta = 1e6;
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layout.row.codec, kernels::CodecKind::kInt4Allot);
  // Per layer, K 1,040 + 63 * 568 + 2,064 and V 1,040 + 63 * (512 + 32): 74,200 per 64 tokens.
  EXPECT_EQ(r->layout.BytesPerToken(), 41738u);
  EXPECT_NE(r->ns.CanonicalText().find(";codec=int4_allot;rope=1000000"), std::string::npos)
      << r->ns.CanonicalText();
  ExpectInt5AllotsRules(8, "CODEC_INT4_ALLOT");
}

TEST(ValidateRegistrationTest, VllmPagedAndPacked) {
  for (const RegisterSpec& s : {VllmPagedSpec(), VllmPackedSpec()}) {
    auto r = ValidateRegistration(s, Limits{}, kBigPool);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->layout.BytesPerToken(), 74880u);
    EXPECT_EQ(MinRows(s), 32u * 16u);
  }
}

TEST(ValidateRegistrationTest, MlaOneLatentPlane) {
  RegisterSpec s = MlaSpec();
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->layout.kv_planes, 1u);
  EXPECT_EQ(r->layout.row.num_heads, 1u);
  EXPECT_EQ(r->layout.row.head_dim, 576u);
  EXPECT_EQ(r->layout.row.RowBytes(), 578u);
  EXPECT_EQ(r->layout.BytesPerToken(), 61u * 578u);
  EXPECT_TRUE(r->ns.mla);
  // MLA rows are the same on every rank: the namespace ignores tp_rank/tp_size.
  RegisterSpec other = s;
  other.tp_rank = 0;
  other.tp_size = 2;
  auto r2 = ValidateRegistration(other, Limits{}, kBigPool);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r->ns.CanonicalText(), r2->ns.CanonicalText());
  // MHA keeps them apart.
  RegisterSpec m0 = SglangSpec(2, 2, 64, 16, 4), m1 = m0;
  m1.tp_size = 2;
  m1.tp_rank = 1;
  auto a = ValidateRegistration(m0, Limits{}, kBigPool);
  auto b = ValidateRegistration(m1, Limits{}, kBigPool);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->ns.CanonicalText(), b->ns.CanonicalText());
}

TEST(ValidateRegistrationTest, CudaWith64ByteHandles) {
  RegisterSpec s = SglangSpec(2, 8, 128, 64, 16);
  s.device_kind = kCuda;
  for (auto& b : s.buffers) {
    b.has_host_shm_name = false;
    b.host_shm_name.clear();
    b.has_cuda_ipc_handle = true;
    b.cuda_ipc_handle = std::string(64, '\x01');
  }
  s.events.host_fd_id = 1;
  s.events.count = 8;
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->cuda);
  s.buffers[3].cuda_ipc_handle.resize(63);
  ExpectInvalid(s, "buffers[3].cuda_ipc_handle");
  s.buffers[3].cuda_ipc_handle.resize(65);
  ExpectInvalid(s, "buffers[3].cuda_ipc_handle");
  s.buffers[3].cuda_ipc_handle.resize(64);
  s.buffers[3].has_cuda_ipc_handle = false;
  ExpectInvalid(s, "buffers[3].cuda_ipc_handle");
  s.buffers[3].has_cuda_ipc_handle = true;
  // Completion through CUDA IPC events is refused: ticket slots only.
  s.events.cuda_ipc_event_handles = {std::string(64, 'e')};
  auto refused = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("events.cuda_ipc_event_handles"), std::string::npos)
      << refused.status().message();
}

// ---------------------------------------------------------------------------------------------
// Geometry and enums.

TEST(ValidateRegistrationTest, RejectsBadGeometry) {
  RegisterSpec s = SglangSpec(2, 2, 64, 16, 4);
  ExpectValid(s);
  {
    RegisterSpec t = s;
    t.model.clear();
    ExpectInvalid(t, "model");
  }
  {
    RegisterSpec t = s;
    t.model = std::string(600, 'm');
    ExpectInvalid(t, "model");
  }
  {
    RegisterSpec t = s;
    t.tenant = std::string(600, 't');
    ExpectInvalid(t, "tenant");
  }
  {
    RegisterSpec t = s;
    t.num_layers = 0;
    ExpectInvalid(t, "geometry.num_layers");
  }
  {
    RegisterSpec t = s;
    t.num_layers = 100000;
    ExpectInvalid(t, "geometry.num_layers");
  }
  {
    RegisterSpec t = s;
    t.num_kv_heads = 0;
    ExpectInvalid(t, "geometry.num_kv_heads");
  }
  {
    RegisterSpec t = s;
    t.num_kv_heads = 1u << 20;
    ExpectInvalid(t, "geometry.num_kv_heads");
  }
  {
    RegisterSpec t = s;
    t.head_dim = 0;
    ExpectInvalid(t, "geometry.head_dim");
  }
  {
    RegisterSpec t = s;
    t.head_dim = 1u << 20;
    ExpectInvalid(t, "geometry.head_dim");
  }
  {
    RegisterSpec t = s;
    t.block_tokens = 0;
    ExpectInvalid(t, "block_tokens");
  }
  {
    RegisterSpec t = s;
    t.block_tokens = 1u << 20;
    ExpectInvalid(t, "block_tokens");
  }
  {
    RegisterSpec t = s;
    t.tp_size = 0;
    t.tp_rank = 0;
    ExpectInvalid(t, "geometry.tp_size");
  }
  {
    RegisterSpec t = s;
    t.tp_size = 2;
    t.tp_rank = 2;
    ExpectInvalid(t, "geometry.tp_rank");
  }
  {
    RegisterSpec t = s;
    t.tp_size = 2;
    t.tp_rank = 1;
    ExpectValid(t);
  }
}

TEST(ValidateRegistrationTest, RejectsUnknownEnumValues) {
  RegisterSpec s = SglangSpec(2, 2, 64, 16, 4);
  {
    RegisterSpec t = s;
    t.dtype = 7;
    ExpectInvalid(t, "geometry.dtype");
  }
  {
    RegisterSpec t = s;
    t.dtype = 0;
    ExpectInvalid(t, "geometry.dtype");
  }
  {
    RegisterSpec t = s;
    t.dtype = -1;
    ExpectInvalid(t, "geometry.dtype");
  }
  {
    RegisterSpec t = s;
    t.attention = 7;
    ExpectInvalid(t, "geometry.attention");
  }
  {
    RegisterSpec t = s;
    t.attention = 0;
    ExpectInvalid(t, "geometry.attention");
  }
  {
    RegisterSpec t = s;
    t.codec = 100;
    ExpectInvalid(t, "codec");
  }
  {
    RegisterSpec t = s;
    t.codec = 9;  // the first value past CODEC_INT4_ALLOT
    ExpectInvalid(t, "codec");
  }
  {
    RegisterSpec t = s;
    t.codec = -1;
    ExpectInvalid(t, "codec");
  }
  {
    RegisterSpec t = s;
    t.device_kind = 7;
    ExpectInvalid(t, "device.kind");
  }
  {
    RegisterSpec t = s;
    t.device_kind = 0;
    ExpectInvalid(t, "device.kind");
  }
}

TEST(ValidateRegistrationTest, BlockMustFitTwiceInThePool) {
  RegisterSpec s = SglangSpec();
  // Each block needs its slot (64-byte header + payload) in an extent (256-byte header).
  const uint64_t per_block = 4792320 + kBlockHeaderBytes + kExtentHeaderBytes;
  ExpectValid(s, 2 * per_block);
  ExpectInvalid(s, "block_tokens", 2 * per_block - 1);
  ExpectInvalid(s, "block_tokens", 0);
}

// A block's engine-side bytes are bounded (max_block_bytes, the unit of work): the default
// 64 MiB admits Qwen3-8B's 64-token block (9 MiB) and refuses 1,024 layers of it (256 MiB), the
// bound naming the setting; a raised bound admits it.
TEST(ValidateRegistrationTest, BlockBytesAreBounded) {
  ExpectValid(SglangSpec());
  RegisterSpec huge = SglangSpec(1024);
  auto r = ValidateRegistration(huge, Limits{}, kBigPool);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("max_block_bytes"), std::string::npos)
      << r.status().message();
  Limits raised;
  raised.max_block_bytes = 2ull << 30;
  EXPECT_TRUE(ValidateRegistration(huge, raised, kBigPool).ok());
}

TEST(ValidateRegistrationTest, LayersMustMatchGeometry) {
  RegisterSpec s = SglangSpec(2, 2, 64, 16, 4);
  {
    RegisterSpec t = s;
    t.layers.pop_back();
    ExpectInvalid(t, "layers");
  }
  {
    RegisterSpec t = s;
    t.layers.push_back(t.layers[0]);
    ExpectInvalid(t, "layers");
  }
  {
    RegisterSpec t = s;
    t.layers[1].v.present = false;
    ExpectInvalid(t, "layers[1].v");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.present = false;
    ExpectInvalid(t, "layers[0].k");
  }
  RegisterSpec m = MlaSpec(2, 16);
  ExpectValid(m);
  m.layers[1].v = m.layers[1].k;
  ExpectInvalid(m, "layers[1].v");
}

// ---------------------------------------------------------------------------------------------
// Buffers and views.

TEST(ValidateRegistrationTest, RejectsBadBuffers) {
  RegisterSpec s = SglangSpec(2, 2, 64, 16, 4);
  {
    RegisterSpec t = s;
    t.buffers.clear();
    ExpectInvalid(t, "buffers");
  }
  {
    RegisterSpec t = s;
    t.buffers[2].has_host_shm_name = false;
    ExpectInvalid(t, "buffers[2].host_shm_name");
  }
  for (const char* bad : {"", "/", "a/b", "/a/b"}) {
    RegisterSpec t = s;
    t.buffers[1].host_shm_name = bad;
    SCOPED_TRACE(std::string("name '") + bad + "'");
    ExpectInvalid(t, "buffers[1].host_shm_name");
  }
  {
    RegisterSpec t = s;
    t.buffers[1].host_shm_name = std::string("a\0b", 3);
    ExpectInvalid(t, "buffers[1].host_shm_name");
  }
  for (const char* good : {"name", "/name", "hiq.kv-0_1"}) {
    RegisterSpec t = s;
    t.buffers[1].host_shm_name = good;
    SCOPED_TRACE(good);
    ExpectValid(t);
  }
  {
    RegisterSpec t = s;
    t.buffers[0].size_bytes = 0;
    ExpectInvalid(t, "buffers[0].size_bytes");
  }
  {
    RegisterSpec t = s;
    t.layers[1].v.buffer = static_cast<uint32_t>(t.buffers.size());
    ExpectInvalid(t, "layers[1].v.buffer");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.buffer = 1000000;
    ExpectInvalid(t, "layers[0].k.buffer");
  }
}

TEST(ValidateRegistrationTest, PlainViewExactFitAndOneByteShort) {
  RegisterSpec s = SglangSpec(2, 2, 64, 16, 4);
  ExpectValid(s);  // every buffer exactly rows * row bytes
  RegisterSpec t = s;
  t.buffers[3].size_bytes -= 1;  // layers[1].v
  ExpectInvalid(t, "layers[1].v");
  // An offset moves the end: exact fit again with a larger buffer.
  t = s;
  t.layers[0].k.offset_bytes = 2;
  ExpectInvalid(t, "layers[0].k");
  t.buffers[0].size_bytes += 2;
  ExpectValid(t);
  // A larger row stride (padding between rows) counts every row but the last fully.
  t = s;
  t.layers[0].v.row_stride_bytes = 2 * 64 * 2 + 64;  // 320
  t.buffers[1].size_bytes = 15 * 320 + 256;
  ExpectValid(t);
  t.buffers[1].size_bytes -= 1;
  ExpectInvalid(t, "layers[0].v");
}

TEST(ValidateRegistrationTest, PagedViewExactFitIncludingPartialLastPage) {
  // 40 rows in pages of 16: the last page holds 8 rows.
  RegisterSpec s = VllmPagedSpec(1, 8, 128, 3, 16, 16);
  const uint64_t row = 2048, page = 16 * row;
  for (ViewSpec* v : {&s.layers[0].k, &s.layers[0].v}) v->num_rows = 40;
  s.layers[0].v.offset_bytes = 3 * page;
  // V's farthest byte: offset + 2 pages + 8 rows.
  s.buffers[0].size_bytes = 3 * page + 2 * page + 8 * row;
  ExpectValid(s);
  s.buffers[0].size_bytes -= 1;
  ExpectInvalid(s, "layers[0].v");
  // page_stride must be set when rows span pages.
  RegisterSpec t = VllmPagedSpec(1, 8, 128, 3, 16, 16);
  t.layers[0].k.page_stride_bytes = 0;
  ExpectInvalid(t, "layers[0].k.page_stride_bytes");
}

TEST(ValidateRegistrationTest, PackedKvHeadStrideExactFit) {
  // [blocks=2, heads=8, block_size=16, 2*128]: V starts 256 bytes after K.
  RegisterSpec s = VllmPackedSpec(1, 8, 128, 2, 16, 16);
  const uint64_t total = 2ull * 8 * 16 * 512;
  EXPECT_EQ(s.buffers[0].size_bytes, total);
  ExpectValid(s);
  s.buffers[0].size_bytes = total - 1;
  ExpectInvalid(s, "layers[0].v");
  // K alone would still fit: only V reaches the last byte.
  s.layers[0].v = s.layers[0].k;
  ExpectValid(s);
  // A head stride smaller than one head is refused.
  s = VllmPackedSpec(1, 8, 128, 2, 16, 16);
  s.layers[0].k.head_stride_bytes = 254;
  ExpectInvalid(s, "layers[0].k.head_stride_bytes");
}

TEST(ValidateRegistrationTest, RejectsOddOffsetsAndStrides) {
  RegisterSpec s = VllmPagedSpec(1, 2, 64, 4, 16, 16);
  s.buffers[0].size_bytes += 1024;  // room, so only the parity is wrong
  ExpectValid(s);
  {
    RegisterSpec t = s;
    t.layers[0].k.offset_bytes = 1;
    ExpectInvalid(t, "layers[0].k");
  }
  {
    RegisterSpec t = s;
    t.layers[0].v.row_stride_bytes += 1;
    ExpectInvalid(t, "layers[0].v");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.page_stride_bytes += 1;
    ExpectInvalid(t, "layers[0].k");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.head_stride_bytes = 257;
    ExpectInvalid(t, "layers[0].k");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.num_rows = 0;
    ExpectInvalid(t, "layers[0].k.num_rows");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.row_stride_bytes = 0;
    ExpectInvalid(t, "layers[0].k.row_stride_bytes");
  }
}

TEST(ValidateRegistrationTest, RejectsOverflowingViews) {
  RegisterSpec s = SglangSpec(1, 2, 64, 16, 4);
  s.buffers[0].size_bytes = std::numeric_limits<uint64_t>::max();
  ExpectValid(s);
  constexpr uint64_t kHuge = 1ull << 63;
  {
    RegisterSpec t = s;
    t.layers[0].k.row_stride_bytes = kHuge;
    ExpectInvalid(t, "layers[0].k");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.offset_bytes = ~1ull;
    ExpectInvalid(t, "layers[0].k");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.head_stride_bytes = ~1ull;
    ExpectInvalid(t, "layers[0].k");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.page_rows = 2;
    t.layers[0].k.page_stride_bytes = kHuge;
    ExpectInvalid(t, "layers[0].k");
  }
  {
    RegisterSpec t = s;  // a single page: the huge page stride is never used
    t.layers[0].k.page_rows = 16;
    t.layers[0].k.page_stride_bytes = kHuge;
    ExpectValid(t);
  }
}

TEST(ValidateRegistrationTest, EventsNeedAShmName) {
  RegisterSpec s = SglangSpec(2, 2, 64, 16, 4);
  s.events.count = 8;
  ExpectInvalid(s, "events.host_shm_name");
  s.events.host_shm_name = "/";
  ExpectInvalid(s, "events.host_shm_name");
  s.events.host_shm_name = "/hiq-events";
  ExpectValid(s);
  s.events.count = (1u << 20) + 1;
  ExpectInvalid(s, "events.count");
  s.events.count = 0;
  s.events.host_shm_name.clear();
  ExpectValid(s);
}

TEST(ValidateRegistrationTest, OverflowErrorsNameTheFieldThatOverflows) {
  // An offset that overflows is reported as the offset, not as row_stride_bytes.
  RegisterSpec s = SglangSpec(1, 2, 64, 16, 4);
  s.buffers[0].size_bytes = std::numeric_limits<uint64_t>::max();
  {
    RegisterSpec t = s;
    t.layers[0].k.offset_bytes = std::numeric_limits<uint64_t>::max() - 1;
    ExpectInvalid(t, "layers[0].k.offset_bytes");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.row_stride_bytes = 1ull << 63;
    ExpectInvalid(t, "layers[0].k.row_stride_bytes");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.head_stride_bytes = ~1ull;
    ExpectInvalid(t, "layers[0].k.head_stride_bytes");
  }
  {
    RegisterSpec t = s;
    t.layers[0].k.page_rows = 2;
    t.layers[0].k.page_stride_bytes = 1ull << 63;
    ExpectInvalid(t, "layers[0].k.page_stride_bytes");
  }
}

TEST(ValidateRegistrationTest, HostBuffersAndEventsMayComeAsFds) {
  RegisterSpec s = SglangSpec(2, 2, 64, 16, 4);
  for (BufferSpec& b : s.buffers) {
    b.has_host_shm_name = false;
    b.host_shm_name.clear();
    b.has_host_fd = true;
    b.host_fd_id = 5;
    b.fd = -1;  // checked by the binding (the transport resolved no fd)
  }
  s.events.count = 8;
  s.events.host_fd_id = 6;
  ExpectValid(s);
  s.buffers[1].host_fd_id = 0;
  ExpectInvalid(s, "buffers[1].host_fd_id");
}

// ---------------------------------------------------------------------------------------------
// ViewEnd, by hand.

TEST(ViewEndTest, HandComputedEnds) {
  const std::string f = "v";
  // Plain [10 rows, 8 heads, 128]: 10 rows of 2,048 bytes.
  ViewSpec plain = RowView(0, 0, 2048, 10);
  EXPECT_EQ(ViewEnd(plain, 8, 128, f).value(), 20480u);
  plain.offset_bytes = 100;
  EXPECT_EQ(ViewEnd(plain, 8, 128, f).value(), 20580u);
  // One row, no stride needed.
  ViewSpec one = RowView(0, 6, 0, 1);
  EXPECT_EQ(ViewEnd(one, 2, 64, f).value(), 6u + 256u);
  // Paged, 40 rows in pages of 16 rows, pages back to back: 2 full pages + 8 rows.
  ViewSpec paged = RowView(0, 0, 2048, 40);
  paged.page_rows = 16;
  paged.page_stride_bytes = 16 * 2048;
  EXPECT_EQ(ViewEnd(paged, 8, 128, f).value(), 81920u);
  // Pages with padding: 2 * 40,000 + 7 * 2,048 + 2,048.
  paged.page_stride_bytes = 40000;
  EXPECT_EQ(ViewEnd(paged, 8, 128, f).value(), 96384u);
  // Page stride smaller than a page: the farthest row is the last slot of the page before.
  ViewSpec overlap = RowView(0, 0, 2048, 17);
  overlap.page_rows = 16;
  overlap.page_stride_bytes = 2048;
  EXPECT_EQ(ViewEnd(overlap, 8, 128, f).value(), 15u * 2048u + 2048u);
  // Packed K/V: [2 blocks, 8 heads, 16, 2*128].
  ViewSpec packed = RowView(0, 0, 512, 32);
  packed.head_stride_bytes = 8192;
  packed.page_rows = 16;
  packed.page_stride_bytes = 65536;
  EXPECT_EQ(ViewEnd(packed, 8, 128, f).value(), 65536u + 15u * 512u + 7u * 8192u + 256u);
  packed.offset_bytes = 256;
  EXPECT_EQ(ViewEnd(packed, 8, 128, f).value(), 131072u);
  // Errors name the field passed in.
  ViewSpec bad = RowView(0, 0, 1ull << 63, 3);
  auto r = ViewEnd(bad, 8, 128, "layers[7].k");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("layers[7].k"), std::string::npos);
}

TEST(ResolveViewsTest, BasesOffsetsAndDefaultHeadStride) {
  RegisterSpec s = VllmPackedSpec(2, 4, 64, 2, 16, 16);
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::vector<uint8_t> b0(s.buffers[0].size_bytes), b1(s.buffers[1].size_bytes);
  auto views = ResolveViews(s, r->layout, {b0.data(), b1.data()});
  ASSERT_EQ(views.size(), 2u);
  EXPECT_EQ(views[1].planes[0].base, b1.data());
  EXPECT_EQ(views[1].planes[1].base, b1.data() + 128);
  EXPECT_EQ(views[0].planes[1].head_stride, 16u * 256u);
  EXPECT_EQ(views[0].planes[1].page_rows, 16u);
  EXPECT_EQ(views[0].planes[1].page_stride, 4u * 16u * 256u);
  EXPECT_EQ(views[0].planes[0].num_rows, 32u);
  // The last addressable element of V is the last 128 bytes of the buffer.
  EXPECT_EQ(views[1].planes[1].Head(31, 3) + 128, b1.data() + b1.size());

  RegisterSpec g = SglangSpec(1, 2, 64, 8, 4);
  auto rg = ValidateRegistration(g, Limits{}, kBigPool);
  ASSERT_TRUE(rg.ok());
  std::vector<uint8_t> k(g.buffers[0].size_bytes), v(g.buffers[1].size_bytes);
  auto gv = ResolveViews(g, rg->layout, {k.data(), v.data()});
  EXPECT_EQ(gv[0].planes[0].head_stride, 128u);  // 0 = heads contiguous
  EXPECT_EQ(gv[0].planes[1].Head(7, 1) + 128, v.data() + v.size());
}

// vLLM CPU attention ("vec"): one buffer, per layer [blocks, heads, block_size, 2 * dim] where
// a (block, head) tile holds K as [dim][token] (dim runs of one element, tokens adjacent), then
// V as [token][dim].
RegisterSpec VllmCpuTileSpec(uint32_t layers = 2, uint32_t heads = 3, uint32_t dim = 64,
                             uint32_t blocks = 4, uint32_t bs = 32) {
  RegisterSpec s = Base(layers, heads, dim, bs);
  const uint64_t tile = uint64_t{bs} * dim * 2 * 2;
  const uint64_t page = tile * heads;
  s.buffers.push_back(HostBuffer("/cpu-tiles", page * blocks * layers));
  for (uint32_t l = 0; l < layers; ++l) {
    ViewSpec k = RowView(0, l * page * blocks, 2, blocks * bs);
    k.head_stride_bytes = tile;
    k.page_rows = bs;
    k.page_stride_bytes = page;
    k.dim_run = 1;
    k.dim_run_stride_bytes = uint64_t{bs} * 2;
    ViewSpec v =
        RowView(0, l * page * blocks + uint64_t{bs} * dim * 2, uint64_t{dim} * 2, blocks * bs);
    v.head_stride_bytes = tile;
    v.page_rows = bs;
    v.page_stride_bytes = page;
    s.layers.push_back({k, v});
  }
  return s;
}

TEST(SplitViewTest, VllmCpuTilesExactFitAndResolve) {
  RegisterSpec s = VllmCpuTileSpec();
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  s.buffers[0].size_bytes -= 1;  // the last V element of the last tile is outside
  ExpectInvalid(s, "layers[1].v");
  s = VllmCpuTileSpec();
  s.buffers[0].size_bytes -= s.buffers[0].size_bytes / 2;  // K of the last layer is outside
  ExpectInvalid(s, "layers[1].k: addresses up to byte");

  std::vector<uint8_t> buf(VllmCpuTileSpec().buffers[0].size_bytes);
  auto views = ResolveViews(VllmCpuTileSpec(), r->layout, {buf.data()});
  const kernels::StridedView& k = views[1].planes[0];
  EXPECT_EQ(k.dim_run, 1u);
  EXPECT_EQ(k.dim_run_stride, 64u);
  // K of token 5, head 2, of block 3, layer 1; dim d is 64 * d bytes further.
  const uint64_t tile = 32 * 64 * 2 * 2, page = 3 * tile;
  EXPECT_EQ(k.Head(3 * 32 + 5, 2), buf.data() + 4 * page + 3 * page + 2 * tile + 5 * 2);
  EXPECT_EQ(k.HeadSpan(64), 63u * 64u + 2u);
  // Its last element is the last byte of the layer's last tile's K half.
  EXPECT_EQ(k.Head(4 * 32 - 1, 2) + k.HeadSpan(64), buf.data() + 8 * page - tile / 2);
  // dim_run == head_dim is an unsplit head.
  RegisterSpec one = VllmCpuTileSpec();
  for (auto& l : one.layers) l.v.dim_run = 64;
  auto r1 = ValidateRegistration(one, Limits{}, kBigPool);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(ResolveViews(one, r1->layout, {buf.data()})[0].planes[1].dim_run, 0u);
  // On K, whose tokens are one element apart, one run of 64 elements overlaps the next token.
  for (auto& l : one.layers) l.k.dim_run = 64;
  ExpectInvalid(one, "layers[0].k.row_stride_bytes: 2 bytes steps inside");
}

TEST(SplitViewTest, TokenGroupsAndDimPairs) {
  // AMX-like K tile: tokens in groups of 16, dims in runs of 2: [t / 16][d / 2][t % 16][d % 2].
  RegisterSpec s = VllmCpuTileSpec(1, 2, 64, 2, 32);
  ViewSpec& k = s.layers[0].k;
  k.row_stride_bytes = 4;
  k.row_group = 16;
  k.row_group_stride_bytes = 16 * 64 * 2;
  k.dim_run = 2;
  k.dim_run_stride_bytes = 16 * 2 * 2;
  ExpectValid(s);
  // Runs as far apart as the token groups: elements overlap.
  k.dim_run_stride_bytes = 16 * 64 * 2;
  ExpectInvalid(s, "elements of the view overlap");
  k.dim_run_stride_bytes = 16 * 2 * 2;
  k.row_group_stride_bytes = 64;  // a group starts inside the one before
  ExpectInvalid(s, "elements of the view overlap");
}

TEST(SplitViewTest, TokenPairsInterleavedInRuns) {
  // AMX-like V tile: [d / 16][t / 2][d % 16][t % 2]: a run's 16 elements 4 bytes apart, the
  // token pair's other token between them.
  RegisterSpec s = VllmCpuTileSpec(1, 2, 64, 2, 32);
  ViewSpec& v = s.layers[0].v;
  v.row_stride_bytes = 2;
  v.row_group = 2;
  v.row_group_stride_bytes = 16 * 2 * 2;
  v.dim_run = 16;
  v.dim_run_stride_bytes = 32 * 16 * 2;
  v.dim_stride_bytes = 4;
  auto r = ValidateRegistration(s, Limits{}, kBigPool);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::vector<uint8_t> buf(s.buffers[0].size_bytes);
  const kernels::StridedView sv = ResolveViews(s, r->layout, {buf.data()})[0].planes[1];
  EXPECT_EQ(sv.dim_run, 16u);
  EXPECT_EQ(sv.dim_step, 4u);
  // Its last element (token 31, dim 63 of head 1) is the tile's last byte.
  const uint64_t tile = 32 * 64 * 2 * 2;
  EXPECT_EQ(sv.Head(31, 1) + sv.HeadSpan(64), buf.data() + 2 * tile);
  // Elements 2 bytes apart land on the pair's other token.
  v.dim_stride_bytes = 2;
  ExpectInvalid(s, "elements of the view overlap");
  v.dim_stride_bytes = 3;
  ExpectInvalid(s, "multiples of 2");
  v.dim_stride_bytes = 1ull << 62;
  ExpectInvalid(s, "layers[0].v.dim_stride_bytes: 4611686018427387904 x 15 overflows");
  // A head of 64 spaced elements (dim_run 0) is one run of them: here it overlaps token 1.
  v.dim_stride_bytes = 4;
  v.dim_run = 0;
  ExpectInvalid(s, "layers[0].v.dim_run_stride_bytes: set without dim_run");
  v.dim_run_stride_bytes = 0;
  ExpectInvalid(s, "elements of the view overlap");
  // A group stride without its group is refused too, not ignored.
  v.dim_run = 16;
  v.dim_run_stride_bytes = 32 * 16 * 2;
  v.row_group = 0;
  ExpectInvalid(s, "layers[0].v.row_group_stride_bytes: set without row_group");
  v.row_group = 2;
  ASSERT_TRUE(ValidateRegistration(s, Limits{}, kBigPool).ok());

  // Spaced elements make a split view, HOST-only like the others.
  RegisterSpec cuda = OnCuda(VllmCpuTileSpec());
  for (auto& l : cuda.layers) l.k.dim_run = 0, l.k.dim_run_stride_bytes = 0;
  cuda.layers[0].k.dim_stride_bytes = 2;
  ExpectInvalid(cuda, "layers[0].k.dim_stride_bytes: split views are for HOST pools only");
}

TEST(SplitViewTest, RejectsOverlapOutOfBoundsAndOverflow) {
  auto with = [](auto&& edit) {
    RegisterSpec s = VllmCpuTileSpec();
    edit(s.layers[0].k);
    return s;
  };
  // Dim runs that land on the next token's elements.
  ExpectInvalid(with([](ViewSpec& v) { v.dim_run_stride_bytes = 32; }),
                "layers[0].k.dim_run_stride_bytes: 32 bytes steps inside");
  // Tokens one element apart and runs of two elements: token t's dim 1 is token t+1's dim 0.
  ExpectInvalid(with([](ViewSpec& v) { v.dim_run = 2; }), "elements of the view overlap");
  ExpectInvalid(with([](ViewSpec& v) { v.dim_run_stride_bytes = 0; }),
                "layers[0].k.dim_run_stride_bytes");
  ExpectInvalid(with([](ViewSpec& v) { v.row_stride_bytes = 0; }), "layers[0].k.row_stride_bytes");
  // Heads half a tile apart: head 1's K on head 0's V is no overlap of the view itself, but
  // a quarter tile lands on head 0's K.
  ExpectInvalid(with([](ViewSpec& v) { v.head_stride_bytes = 2048; }),
                "layers[0].k.head_stride_bytes: 2048 bytes steps inside");
  ExpectInvalid(with([](ViewSpec& v) { v.dim_run = 3; }), "layers[0].k.dim_run: must divide");
  ExpectInvalid(with([](ViewSpec& v) { v.dim_run_stride_bytes = 65; }), "multiples of 2");
  ExpectInvalid(with([](ViewSpec& v) { v.dim_run_stride_bytes = 1ull << 62; }),
                "layers[0].k.dim_run_stride_bytes: 4611686018427387904 x 63 overflows");
  ExpectInvalid(with([](ViewSpec& v) {
                  v.row_group_stride_bytes = ~1ull;
                  v.row_group = 8;
                }),
                "layers[0].k.row_group_stride_bytes");
  ExpectInvalid(with([](ViewSpec& v) { v.page_stride_bytes = 1ull << 63; }),
                "layers[0].k.page_stride_bytes");
  ExpectInvalid(with([](ViewSpec& v) { v.offset_bytes = ~1ull; }), "layers[0].k.offset_bytes");
  ExpectInvalid(with([](ViewSpec& v) { v.offset_bytes = 1ull << 20; }),
                "layers[0].k: addresses up to byte");
  // Split views are HOST-only.
  ExpectInvalid(OnCuda(VllmCpuTileSpec()),
                "layers[0].k.dim_run: split views are for HOST pools only");
}

TEST(MinRowsTest, SmallestViewWins) {
  RegisterSpec s = SglangSpec(2, 2, 64, 16, 4);
  s.layers[1].v.num_rows = 9;
  EXPECT_EQ(MinRows(s), 9u);
  EXPECT_EQ(MinRows(RegisterSpec{}), 0u);
}

// ---------------------------------------------------------------------------------------------
// Transfers.

class ValidateTransferTest : public ::testing::Test {
 protected:
  ValidateTransferTest() {
    layout_.row = {2, 64, kernels::DType::kBF16, kernels::CodecKind::kInt8PerHead};
    layout_.num_layers = 3;
    layout_.block_tokens = 4;
  }
  static BlockSpec Block(uint32_t first_row, uint8_t key_byte = 1) {
    BlockSpec b;
    b.key = std::string(16, static_cast<char>(key_byte));
    for (uint32_t i = 0; i < 4; ++i) b.rows.push_back(first_row + i);
    return b;
  }
  TransferSpec Spec() {
    TransferSpec t;
    t.pool_id = 1;
    t.blocks = {Block(0), Block(4, 2)};
    return t;
  }
  Status Check(const TransferSpec& t, bool restore, const Limits& lim = Limits{}) {
    return ValidateTransfer(t, layout_, kRows, kEvents, restore, lim);
  }
  void ExpectInvalid(const TransferSpec& t, bool restore, const std::string& field) {
    Status st = Check(t, restore);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(field), std::string::npos)
        << "'" << st.message() << "' does not name " << field;
  }
  static constexpr uint32_t kRows = 32;
  static constexpr uint32_t kEvents = 8;
  kernels::BlockLayout layout_;
};

TEST_F(ValidateTransferTest, ValidRequestsPass) {
  TransferSpec t = Spec();
  HIQ_EXPECT_OK(Check(t, false));
  HIQ_EXPECT_OK(Check(t, true));
  t.wait_event = 0;
  t.done_event = kEvents - 1;
  t.layer_event_base = kEvents - 3;  // 3 layers: slots 5, 6, 7
  HIQ_EXPECT_OK(Check(t, true));
  t.blocks[1].rows = {31, 0, 31, 0};  // any rows below num_rows, repeats allowed in a backup
  HIQ_EXPECT_OK(Check(t, false));
  t.blocks.clear();
  HIQ_EXPECT_OK(Check(t, false));
}

TEST_F(ValidateTransferTest, RejectsBadBlocks) {
  {
    TransferSpec t = Spec();
    t.blocks[1].key.resize(15);
    ExpectInvalid(t, false, "blocks[1].key");
  }
  {
    TransferSpec t = Spec();
    t.blocks[0].key.resize(17);
    ExpectInvalid(t, true, "blocks[0].key");
  }
  {
    TransferSpec t = Spec();
    t.blocks[0].key.clear();
    ExpectInvalid(t, false, "blocks[0].key");
  }
  {
    TransferSpec t = Spec();
    t.blocks[1].rows.pop_back();
    ExpectInvalid(t, false, "blocks[1].rows");
  }
  {
    TransferSpec t = Spec();
    t.blocks[1].rows.push_back(0);
    ExpectInvalid(t, true, "blocks[1].rows");
  }
  {
    TransferSpec t = Spec();
    t.blocks[1].rows[2] = kRows;
    ExpectInvalid(t, false, "blocks[1].rows[2]");
  }
  {
    TransferSpec t = Spec();
    t.blocks[0].rows[3] = 0xFFFFFFFFu;
    ExpectInvalid(t, true, "blocks[0].rows[3]");
  }
}

TEST_F(ValidateTransferTest, RejectsBadEvents) {
  {
    TransferSpec t = Spec();
    t.wait_event = kEvents;
    ExpectInvalid(t, false, "wait_event");
  }
  {
    TransferSpec t = Spec();
    t.wait_event = -2;
    ExpectInvalid(t, true, "wait_event");
  }
  {
    TransferSpec t = Spec();
    t.done_event = kEvents;
    ExpectInvalid(t, false, "done_event");
  }
  {
    TransferSpec t = Spec();
    t.done_event = -5;
    ExpectInvalid(t, true, "done_event");
  }
  {
    TransferSpec t = Spec();
    t.layer_event_base = kEvents - 2;
    ExpectInvalid(t, true, "layer_event_base");
  }
  {
    TransferSpec t = Spec();
    t.layer_event_base = -2;
    ExpectInvalid(t, true, "layer_event_base");
  }
  {
    TransferSpec t = Spec();
    t.layer_event_base = std::numeric_limits<int32_t>::max();
    ExpectInvalid(t, true, "layer_event_base");
  }
  {
    // A pool without events accepts only -1.
    TransferSpec t = Spec();
    t.done_event = 0;
    Status st = ValidateTransfer(t, layout_, kRows, 0, false, Limits{});
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    t.done_event = -1;
    HIQ_EXPECT_OK(ValidateTransfer(t, layout_, kRows, 0, true, Limits{}));
  }
}

TEST_F(ValidateTransferTest, TooManyBlocksIsResourceExhausted) {
  TransferSpec t = Spec();
  Limits lim;
  lim.max_blocks_per_request = 2;
  HIQ_EXPECT_OK(Check(t, false, lim));
  t.blocks.push_back(Block(8, 3));
  Status st = Check(t, false, lim);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_NE(st.message().find("blocks"), std::string::npos);
  // Default limit: 4096.
  TransferSpec big;
  big.blocks.resize(4097);
  EXPECT_EQ(Check(big, true).code(), StatusCode::kResourceExhausted);
}

TEST_F(ValidateTransferTest, RestoreWritesEachRowOnce) {
  TransferSpec t = Spec();
  t.blocks[1].rows = {4, 5, 1, 7};  // row 1 is also blocks[0].rows[1]
  ExpectInvalid(t, true, "blocks[1].rows[2]");
  HIQ_EXPECT_OK(Check(t, false));
  t.blocks[1].rows = {4, 5, 5, 7};
  ExpectInvalid(t, true, "blocks[1].rows[2]");
  // The sorted path (rows far apart in a huge view) names the same entry.
  Status st = ValidateTransfer(t, layout_, 1u << 31, kEvents, true, Limits{});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("blocks[1].rows[2]"), std::string::npos) << st.message();
  t.blocks[0].rows = {2000000000, 3, 2000000000, 1};
  t.blocks[1].rows = {4, 5, 6, 7};
  st = ValidateTransfer(t, layout_, 1u << 31, kEvents, true, Limits{});
  EXPECT_NE(st.message().find("blocks[0].rows[2]"), std::string::npos) << st.message();
}

TEST_F(ValidateTransferTest, RepeatedRowsOfABackupAreBounded) {
  Limits lim;
  lim.max_repeated_rows_per_request = 3;
  TransferSpec t = Spec();
  t.blocks[1].rows = t.blocks[0].rows;
  t.blocks[1].rows[3] = 9;  // 3 repeats
  HIQ_EXPECT_OK(Check(t, false, lim));
  t.blocks[1].rows[3] = 3;  // 4 repeats
  Status st = Check(t, false, lim);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_NE(st.message().find("max_repeated_rows_per_request"), std::string::npos);
  st = ValidateTransfer(t, layout_, 1u << 31, kEvents, false, lim);  // sorted path
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
}

TEST(ValidateKeysTest, LengthAndCount) {
  std::vector<std::string> keys = {std::string(16, 'a'), std::string(16, 'b')};
  HIQ_EXPECT_OK(ValidateKeys(keys, 2, "keys"));
  HIQ_EXPECT_OK(ValidateKeys({}, 2, "keys"));
  Status st = ValidateKeys(keys, 1, "keys");
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  keys[1].resize(15);
  st = ValidateKeys(keys, 2, "keys");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("keys[1]"), std::string::npos) << st.message();
  keys[1] = std::string(17, 'b');
  EXPECT_EQ(ValidateKeys(keys, 2, "keys").code(), StatusCode::kInvalidArgument);
}

TEST(ToBlockKeyTest, CopiesSixteenBytes) {
  std::string s;
  for (int i = 0; i < 16; ++i) s.push_back(static_cast<char>(i * 17));
  BlockKey k = ToBlockKey(s);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(k[i], static_cast<uint8_t>(i * 17));
}

}  // namespace
}  // namespace hiqcache::server
