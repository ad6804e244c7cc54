#include "hiqcache/block_keys.h"

#include <xxhash.h>

#include <bit>
#include <cstring>

namespace hiqcache {
namespace {

BlockKey Canonical(XXH128_hash_t h) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  BlockKey key;
  static_assert(sizeof(c.digest) == sizeof(BlockKey));
  std::memcpy(key.data(), c.digest, key.size());
  return key;
}

// Hashes previous || little-endian tokens, with `scratch` as the reused input buffer.
BlockKey Chain(const BlockKey& previous, const uint32_t* tokens, size_t n,
               std::vector<uint8_t>* scratch) {
  scratch->resize(previous.size() + n * 4);
  uint8_t* out = scratch->data();
  std::memcpy(out, previous.data(), previous.size());
  out += previous.size();
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(out, tokens, n * 4);
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t t = tokens[i];
      out[4 * i + 0] = static_cast<uint8_t>(t);
      out[4 * i + 1] = static_cast<uint8_t>(t >> 8);
      out[4 * i + 2] = static_cast<uint8_t>(t >> 16);
      out[4 * i + 3] = static_cast<uint8_t>(t >> 24);
    }
  }
  return Canonical(XXH3_128bits(scratch->data(), scratch->size()));
}

}  // namespace

BlockKey RootBlockKey(std::string_view salt) {
  return Canonical(XXH3_128bits(salt.data(), salt.size()));
}

BlockKey ChainBlockKey(const BlockKey& previous, std::span<const uint32_t> block_tokens) {
  std::vector<uint8_t> scratch;
  return Chain(previous, block_tokens.data(), block_tokens.size(), &scratch);
}

std::vector<BlockKey> ComputeBlockKeys(std::span<const uint32_t> tokens, uint32_t block_tokens,
                                       std::string_view salt) {
  std::vector<BlockKey> keys;
  if (block_tokens == 0) return keys;
  const size_t n = tokens.size() / block_tokens;
  keys.reserve(n);
  std::vector<uint8_t> scratch;
  BlockKey key = RootBlockKey(salt);
  for (size_t i = 0; i < n; ++i) {
    key = Chain(key, tokens.data() + i * block_tokens, block_tokens, &scratch);
    keys.push_back(key);
  }
  return keys;
}

std::vector<BlockKey> ComputeBlockKeys(std::span<const int32_t> tokens, uint32_t block_tokens,
                                       std::string_view salt) {
  return ComputeBlockKeys(
      std::span<const uint32_t>(reinterpret_cast<const uint32_t*>(tokens.data()), tokens.size()),
      block_tokens, salt);
}

std::string BlockKeyToHex(const BlockKey& key) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex(32, '0');
  for (size_t i = 0; i < key.size(); ++i) {
    hex[2 * i] = kDigits[key[i] >> 4];
    hex[2 * i + 1] = kDigits[key[i] & 0xF];
  }
  return hex;
}

bool BlockKeyFromHex(std::string_view hex, BlockKey* key) {
  if (hex.size() != 32) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  BlockKey out;
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = nibble(hex[2 * i]);
    const int lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  *key = out;
  return true;
}

}  // namespace hiqcache
