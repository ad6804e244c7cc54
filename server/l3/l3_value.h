// The L3 value format: what hiqcached stores in Redis Cluster for one block (docs/design.md "Beyond
// one node (L3)"), and the key it is stored under.
//
// key   = prefix + 32 hex digits of the namespace hash + ":" + 32 hex digits of the block key
// value = L3ValueHeader (64 bytes, little endian) + the block's compressed payload, as the pool
//         holds it ([layer][K|V][token][row], docs/design.md "Record format"); with a MAC key
//         (version 2) followed by a 32-byte HMAC-SHA-256 tag of header and payload.
//
// XXH3 finds corruption, not forgery: anyone who can write under the key prefix could plant KV
// with valid checksums. A fleet that shares an L3 therefore shares a secret key (L3MacKeys): a
// daemon that holds one writes version 2 and restores only values whose tag verifies under its
// current or previous key (rotation: give every daemon the new key as current and the old as
// previous, then drop the previous once every value written with it has expired or been
// rewritten). A daemon without a key writes version 1 and refuses version 2 values.
//
// The store is shared by a fleet and written by other daemons (other versions, other
// namespaces), so a fetched value is trusted only after DecodeL3Value checked all of it: magic,
// version, header size, its own header checksum, the namespace and key it was written for, the
// payload length, and the payload checksum. Pure functions; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "hiqcache/block_id.h"
#include "hiqcache/status.h"

namespace hiqcache::server::l3 {

constexpr uint32_t kL3ValueMagic = 0x334C5148u;  // "HQL3"
constexpr uint16_t kL3ValueVersion = 1;          // no MAC
constexpr uint16_t kL3ValueVersionMac = 2;       // header + payload + HMAC-SHA-256 tag
constexpr size_t kL3ValueHeaderBytes = 64;
constexpr size_t kL3MacBytes = 32;
constexpr size_t kL3MacMinKeyBytes = 32;

// The fleet's MAC keys (raw bytes, at least kL3MacMinKeyBytes each); none when `current` is
// empty. `previous` is accepted on reads only.
struct L3MacKeys {
  std::string current;
  std::string previous;
  bool enabled() const { return !current.empty(); }
};

// Bytes after the payload: kL3MacBytes with a key, else 0.
inline size_t L3TrailerBytes(const L3MacKeys* mac) {
  return mac != nullptr && mac->enabled() ? kL3MacBytes : 0;
}

// Every field is little endian on the wire (the layout of this struct on x86-64 and aarch64).
struct L3ValueHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t header_bytes;  // kL3ValueHeaderBytes: room to grow without a new magic
  uint8_t namespace_hash[16];
  uint8_t key[16];
  uint64_t payload_bytes;
  // XXH3-64 of the payload: the same function and value as BlockHeader::checksum (pool_format.h),
  // so a block read from the pool is checked the same way wherever it travels.
  uint64_t payload_checksum;
  // XXH3-64 of the 56 bytes above: a corrupt length or key is reported as a corrupt header, not
  // as a foreign value.
  uint64_t header_checksum;
};
static_assert(sizeof(L3ValueHeader) == kL3ValueHeaderBytes);

// XXH3-64 of `bytes` (BlockHeader::checksum's function).
uint64_t L3Checksum(std::span<const uint8_t> bytes);

// The Redis key of block `key` of namespace `ns`. `prefix` separates fleets that share a cluster
// (e.g. "hiq:"); it carries no hash tag, so blocks spread over every slot.
std::string L3Key(std::string_view prefix, const NamespaceHash& ns, const BlockKey& key);

// Header + payload. `payload_checksum` is XXH3-64 of `payload` when the caller already has it
// (the pool's block header); otherwise use the overload that computes it.
std::string EncodeL3Value(const NamespaceHash& ns, const BlockKey& key,
                          std::span<const uint8_t> payload, uint64_t payload_checksum);
std::string EncodeL3Value(const NamespaceHash& ns, const BlockKey& key,
                          std::span<const uint8_t> payload);
// The same into `*out` (resized; a buffer reused at the same size is not cleared first, so no
// page is touched twice). May throw std::bad_alloc.
// With `mac` enabled: version 2, the tag under mac->current appended.
void EncodeL3ValueInto(const NamespaceHash& ns, const BlockKey& key,
                       std::span<const uint8_t> payload, uint64_t payload_checksum,
                       std::string* out, const L3MacKeys* mac = nullptr);

// Checks `value` completely and returns its payload (a view into `value`). Errors (DATA_LOSS
// unless noted) name what failed: too short for a header, bad magic, unsupported version
// (FAILED_PRECONDITION: a newer writer), bad header checksum, foreign namespace, foreign key,
// payload length differs from the header or from `expected_payload_bytes` (when nonzero: the
// namespace's block size), bad payload checksum. PERMISSION_DENIED for a value not authenticated
// as `mac` requires: version 1 while a key is held, version 2 without one, or a tag that
// verifies under neither key (checked in constant time before the payload is trusted).
StatusOr<std::span<const uint8_t>> DecodeL3Value(std::string_view value, const NamespaceHash& ns,
                                                 const BlockKey& key,
                                                 uint64_t expected_payload_bytes = 0,
                                                 const L3MacKeys* mac = nullptr);

}  // namespace hiqcache::server::l3
