// The two 16-byte identifiers every part of hiqcache passes around: a block's key (chosen by
// the engine: a chained hash of the block's tokens, hiqcache/block_keys.h) and a namespace's hash
// (the daemon's digest of the namespace's canonical text: server/core/namespace_table.h).
#pragma once

#include <array>
#include <cstdint>

namespace hiqcache {

using BlockKey = std::array<uint8_t, 16>;
using NamespaceHash = std::array<uint8_t, 16>;

}  // namespace hiqcache
