#include "hiqcache/block_keys.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <numeric>
#include <vector>

namespace hiqcache {
namespace {

std::vector<uint32_t> Tokens(size_t n, uint32_t start = 1000) {
  std::vector<uint32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST(BlockKeysTest, Deterministic) {
  const auto tokens = Tokens(256);
  EXPECT_EQ(ComputeBlockKeys(tokens, 64), ComputeBlockKeys(tokens, 64));
  EXPECT_EQ(ComputeBlockKeys(tokens, 64, "s"), ComputeBlockKeys(tokens, 64, "s"));
}

TEST(BlockKeysTest, OnlyFullBlocksGetKeys) {
  EXPECT_EQ(ComputeBlockKeys(Tokens(255), 64).size(), 3u);
  EXPECT_EQ(ComputeBlockKeys(Tokens(256), 64).size(), 4u);
  EXPECT_EQ(ComputeBlockKeys(Tokens(63), 64).size(), 0u);
  EXPECT_EQ(ComputeBlockKeys(Tokens(10), 0).size(), 0u);
  // A partial last block does not change the keys of the full ones.
  auto a = ComputeBlockKeys(Tokens(256), 64);
  auto b = ComputeBlockKeys(Tokens(300), 64);
  EXPECT_EQ(a, b);
}

TEST(BlockKeysTest, ChangeInBlockZeroChangesAllKeys) {
  auto tokens = Tokens(256);
  const auto base = ComputeBlockKeys(tokens, 64);
  tokens[5] ^= 1;
  const auto changed = ComputeBlockKeys(tokens, 64);
  ASSERT_EQ(base.size(), changed.size());
  for (size_t i = 0; i < base.size(); ++i) EXPECT_NE(base[i], changed[i]) << i;
}

TEST(BlockKeysTest, ChangeInBlockTwoChangesKeysFromTwoOn) {
  auto tokens = Tokens(320);
  const auto base = ComputeBlockKeys(tokens, 64);
  tokens[2 * 64 + 17] += 1;
  const auto changed = ComputeBlockKeys(tokens, 64);
  ASSERT_EQ(base.size(), 5u);
  EXPECT_EQ(base[0], changed[0]);
  EXPECT_EQ(base[1], changed[1]);
  for (size_t i = 2; i < base.size(); ++i) EXPECT_NE(base[i], changed[i]) << i;
}

TEST(BlockKeysTest, SaltChangesAllKeys) {
  const auto tokens = Tokens(192);
  const auto a = ComputeBlockKeys(tokens, 64, "");
  const auto b = ComputeBlockKeys(tokens, 64, "lora:7");
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NE(a[i], b[i]) << i;
}

TEST(BlockKeysTest, MatchesTheSpecifiedChain) {
  // key_{-1} = XXH3_128(salt); key_i = XXH3_128(key_{i-1} || LE uint32 tokens), canonical form.
  const auto tokens = Tokens(128, 7);
  const std::string salt = "salt";
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(salt.data(), salt.size()));
  BlockKey prev;
  std::memcpy(prev.data(), c.digest, 16);
  EXPECT_EQ(RootBlockKey(salt), prev);
  const auto keys = ComputeBlockKeys(tokens, 64, salt);
  ASSERT_EQ(keys.size(), 2u);
  for (size_t b = 0; b < 2; ++b) {
    std::vector<uint8_t> buf(prev.begin(), prev.end());
    for (size_t t = 0; t < 64; ++t) {
      const uint32_t v = tokens[b * 64 + t];
      for (int k = 0; k < 4; ++k) buf.push_back(static_cast<uint8_t>(v >> (8 * k)));
    }
    XXH128_canonicalFromHash(&c, XXH3_128bits(buf.data(), buf.size()));
    std::memcpy(prev.data(), c.digest, 16);
    EXPECT_EQ(keys[b], prev) << b;
  }
  EXPECT_EQ(ChainBlockKey(RootBlockKey(salt), std::span(tokens).first(64)), keys[0]);
}

TEST(BlockKeysTest, Int32OverloadHashesTheBitPattern) {
  std::vector<int32_t> signed_tokens = {1, -1, 5, 7};
  std::vector<uint32_t> unsigned_tokens = {1, 0xFFFFFFFFu, 5, 7};
  EXPECT_EQ(ComputeBlockKeys(std::span<const int32_t>(signed_tokens), 2),
            ComputeBlockKeys(std::span<const uint32_t>(unsigned_tokens), 2));
}

TEST(BlockKeysTest, HexRoundTrip) {
  const auto key = ComputeBlockKeys(Tokens(64), 64)[0];
  const std::string hex = BlockKeyToHex(key);
  EXPECT_EQ(hex.size(), 32u);
  BlockKey parsed{};
  ASSERT_TRUE(BlockKeyFromHex(hex, &parsed));
  EXPECT_EQ(parsed, key);
  std::string upper = hex;
  for (char& ch : upper) ch = static_cast<char>(std::toupper(ch));
  ASSERT_TRUE(BlockKeyFromHex(upper, &parsed));
  EXPECT_EQ(parsed, key);
  EXPECT_FALSE(BlockKeyFromHex(hex.substr(1), &parsed));
  EXPECT_FALSE(BlockKeyFromHex(std::string(31, '0') + "g", &parsed));
}

}  // namespace
}  // namespace hiqcache
