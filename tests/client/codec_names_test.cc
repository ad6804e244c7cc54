// The codecs' numbers and names, held together: the wire's Codec (hiqcache/v1/cache.proto), the
// name table (hiqcache/codec_names.h) through the daemon's CodecKind (kernels/record_format.h) and
// the client library's Codec, and hiq_codec (C ABI). Each is numbered as the wire; a codec added to
// one and not the others fails here (or at a static_assert) instead of being sent, stored or named
// as another codec.
#include <gtest/gtest.h>

#include <cctype>
#include <string>

#include "hiqcache/hiqcache_c.h"
#include "hiqcache/pool_spec.h"
#include "hiqcache/v1/cache.pb.h"
#include "record_format.h"

namespace hiqcache {
namespace {

namespace v1 = ::hiqcache::v1;

// "CODEC_INT8_PER_HEAD" -> "int8_per_head"
std::string ShortName(const std::string& contract) {
  std::string s = contract.substr(std::string("CODEC_").size());
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

TEST(CodecNamesTest, EveryWireValueHasOneName) {
  ASSERT_EQ(static_cast<uint32_t>(v1::Codec_ARRAYSIZE), kCodecCount);
  ASSERT_EQ(static_cast<uint32_t>(HIQ_CODEC_INT4_ALLOT) + 1, kCodecCount);
  for (int v = 0; v < v1::Codec_ARRAYSIZE; ++v) {
    SCOPED_TRACE("wire value " + std::to_string(v));
    ASSERT_TRUE(v1::Codec_IsValid(v));  // the proto's values run 0..N-1 without a gap
    const std::string contract = v1::Codec_Name(static_cast<v1::Codec>(v));
    kernels::CodecKind kind;
    ASSERT_TRUE(kernels::CodecKindFromWire(v, &kind));
    EXPECT_EQ(static_cast<int>(kind), v);
    EXPECT_EQ(kernels::CodecContractName(kind), contract);
    EXPECT_EQ(kernels::CodecTextName(kind), ShortName(contract));
    EXPECT_EQ(CodecContractName(static_cast<Codec>(v)), contract);
    EXPECT_EQ(CodecName(static_cast<Codec>(v)), ShortName(contract));
  }
}

TEST(CodecNamesTest, ValuesBeyondTheTableNameNoCodec) {
  kernels::CodecKind kind = kernels::CodecKind::kRaw;
  for (int64_t v : {int64_t{-1}, int64_t{kCodecCount}, int64_t{255}, int64_t{1} << 40}) {
    EXPECT_FALSE(kernels::CodecKindFromWire(v, &kind)) << v;
    EXPECT_EQ(kind, kernels::CodecKind::kRaw) << "left unchanged";
  }
  EXPECT_STREQ(kernels::CodecContractName(static_cast<kernels::CodecKind>(kCodecCount)),
               "CODEC_UNKNOWN");
  EXPECT_STREQ(kernels::CodecTextName(static_cast<kernels::CodecKind>(0xFF)), "unknown");
  EXPECT_STREQ(CodecName(static_cast<Codec>(kCodecCount)), "unknown");
  EXPECT_STREQ(CodecContractName(static_cast<Codec>(0xFF)), "CODEC_UNKNOWN");
}

TEST(CodecNamesTest, AllotAndGroupedCodecs) {
  using kernels::CodecKind;
  for (uint32_t v = 0; v < kCodecCount; ++v) {
    const auto kind = static_cast<CodecKind>(v);
    const std::string name = kernels::CodecTextName(kind);
    const bool allot = name.find("_allot") != std::string::npos;
    EXPECT_EQ(kernels::AllotBitsOf(kind).value != 0, allot) << name;
    // Every codec with 4-6 bit codes groups a head's elements by 32; INT8, FP8 and RAW do not.
    const bool grouped = name.rfind("int4", 0) == 0 || allot;
    EXPECT_EQ(kernels::CodecNeedsGroupedHeads(kind), grouped) << name;
  }
}

}  // namespace
}  // namespace hiqcache
