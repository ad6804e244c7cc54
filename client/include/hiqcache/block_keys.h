// Block keys: the 16-byte ids under which hiqcached stores KV blocks (docs/design.md "Keys").
//
// ComputeBlockKeys chains XXH3-128 over full blocks of tokens:
//   key_{-1} = XXH3_128(salt)
//   key_i    = XXH3_128(key_{i-1} || tokens of block i as little-endian uint32)
// each key stored canonically (big-endian, XXH128_canonicalFromHash). A key therefore names the
// whole prefix up to and including its block. Only full blocks get keys. The salt separates
// key spaces that must not share blocks (e.g. LoRA adapter, multimodal inputs); the namespace
// (model, geometry, codec, ...) is separated by the daemon already. Pure functions; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hiqcache/block_id.h"

namespace hiqcache {

// Keys of the floor(tokens.size() / block_tokens) full blocks. Empty when block_tokens is 0.
std::vector<BlockKey> ComputeBlockKeys(std::span<const uint32_t> tokens, uint32_t block_tokens,
                                       std::string_view salt = {});
// Same, for engines that hold token ids as int32 (the bit pattern is hashed).
std::vector<BlockKey> ComputeBlockKeys(std::span<const int32_t> tokens, uint32_t block_tokens,
                                       std::string_view salt = {});

// The chain's pieces, for callers that extend a sequence one block at a time.
BlockKey RootBlockKey(std::string_view salt);
BlockKey ChainBlockKey(const BlockKey& previous, std::span<const uint32_t> block_tokens);

// 32 lowercase hex digits.
std::string BlockKeyToHex(const BlockKey& key);
// Parses 32 hex digits (either case); false on anything else.
bool BlockKeyFromHex(std::string_view hex, BlockKey* key);

}  // namespace hiqcache
