// The pool image fuzzer's input format (pool_image_fuzzer.cc), shared with its seed generator
// (pool_image_seeds.cc): a compact encoding of a small pool (pool_format.h), so that inputs stay
// small although every pool has a 64 KiB extent directory. Header-only; no state.
//
//   byte 0        flags: bit 0 = use the input's pool header bytes as they are (else a valid
//                 header for kPoolBytes is written, so most inputs reach the extents); bits 1-2
//                 = the registration granule: kGranules[(flags >> 1) & 3]
//   bytes 1..40   PoolHeader
//   byte 41       n: directory entries that follow (at most kMaxDirEntries)
//   n x 18 bytes  little-endian uint16 directory slot (taken modulo the directory's size), then
//                 the ExtentDirEntry (offset, bytes) stored there
//   the rest      the pool's bytes from its first extent (PoolMetaBytes) on, as far as they go;
//                 bytes past the input's end are zero
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/namespace_table.h"
#include "pool/block_store.h"
#include "pool/pool_format.h"

namespace hiqcache::fuzz {

inline constexpr uint64_t kPoolBytes = 256ull << 10;
inline constexpr uint64_t kGranules[4] = {16ull << 10, 64ull << 10, server::kPoolRegisterChunkBytes,
                                          server::kPoolRegisterChunkBytes};
inline constexpr size_t kMaxDirEntries = 64;
inline constexpr size_t kImageHeaderBytes = 1 + sizeof(server::PoolHeader) + 1;
inline constexpr size_t kDirRecordBytes = 2 + sizeof(server::ExtentDirEntry);

// The namespaces the seeds' blocks belong to (ids 1..3), which the fuzzer registers after the
// rebuild so that it adopts their blocks: "a" and "b" share a 72-byte payload, "c" has 144.
inline std::vector<server::NamespaceInfo> KnownNamespaces() {
  std::vector<server::NamespaceInfo> out;
  const char* models[3] = {"a", "b", "c"};
  for (uint32_t i = 0; i < 3; ++i) {
    server::NamespaceInfo info;
    info.id = i + 1;
    info.desc.model = models[i];
    kernels::BlockLayout& l = info.desc.layout;
    l.row.num_heads = 1;
    l.row.head_dim = 16;
    l.row.dtype = kernels::DType::kBF16;
    l.row.codec = kernels::CodecKind::kInt8PerHead;
    l.num_layers = i == 2 ? 2 : 1;
    l.kv_planes = 2;
    l.block_tokens = 2;
    info.hash = info.desc.Hash();
    out.push_back(info);
  }
  return out;
}

// Key i of the seeds' blocks.
inline hiqcache::BlockKey SeedKey(uint64_t i) {
  hiqcache::BlockKey k{};
  for (int b = 0; b < 16; ++b) k[b] = static_cast<uint8_t>(i * 37 + b * 11 + 1);
  return k;
}

// Writes the image `data` describes into `pool` (kPoolBytes, zeroed by the caller) and returns
// the granule it names.
inline uint64_t DecodePoolImage(const uint8_t* data, size_t size, uint8_t* pool) {
  using server::PoolHeader;
  const uint64_t meta = server::PoolMetaBytes(kPoolBytes);
  const uint64_t dir_entries = server::DirectoryEntriesFor(kPoolBytes);
  uint8_t flags = size > 0 ? data[0] : 0;
  PoolHeader ph{};
  if (size >= 1 + sizeof(PoolHeader)) std::memcpy(&ph, data + 1, sizeof(PoolHeader));
  if ((flags & 1) == 0) {
    ph.magic = server::kPoolMagic;
    ph.version = server::kPoolFormatVersion;
    ph.directory_entries = static_cast<uint32_t>(dir_entries);
    ph.pool_bytes = kPoolBytes;
  }
  std::memcpy(pool, &ph, sizeof(ph));
  size_t pos = 1 + sizeof(PoolHeader);
  size_t n = pos < size ? data[pos] : 0;
  if (n > kMaxDirEntries) n = kMaxDirEntries;
  pos += 1;
  auto* dir = reinterpret_cast<server::ExtentDirEntry*>(pool + server::kPoolHeaderBytes);
  for (size_t i = 0; i < n && pos + kDirRecordBytes <= size; ++i, pos += kDirRecordBytes) {
    const uint16_t slot = static_cast<uint16_t>(data[pos] | (data[pos + 1] << 8));
    std::memcpy(&dir[slot % dir_entries], data + pos + 2, sizeof(server::ExtentDirEntry));
  }
  if (pos < size) {
    const size_t rest = size - pos < kPoolBytes - meta ? size - pos : kPoolBytes - meta;
    std::memcpy(pool + meta, data + pos, rest);
  }
  return kGranules[(flags >> 1) & 3];
}

// The input that DecodePoolImage turns back into `pool` (kPoolBytes, a real store's image), for
// granule code `granule_code` (index into kGranules).
inline std::string EncodePoolImage(const uint8_t* pool, unsigned granule_code) {
  const uint64_t meta = server::PoolMetaBytes(kPoolBytes);
  const uint64_t dir_entries = server::DirectoryEntriesFor(kPoolBytes);
  std::string out;
  out.push_back(static_cast<char>((granule_code & 3) << 1));
  out.append(reinterpret_cast<const char*>(pool), sizeof(server::PoolHeader));
  const auto* dir =
      reinterpret_cast<const server::ExtentDirEntry*>(pool + server::kPoolHeaderBytes);
  std::string records;
  size_t n = 0;
  for (uint64_t i = 0; i < dir_entries && n < kMaxDirEntries; ++i) {
    if (dir[i].bytes == 0) continue;
    records.push_back(static_cast<char>(i & 0xFF));
    records.push_back(static_cast<char>(i >> 8));
    records.append(reinterpret_cast<const char*>(&dir[i]), sizeof(server::ExtentDirEntry));
    ++n;
  }
  out.push_back(static_cast<char>(n));
  out += records;
  uint64_t end = kPoolBytes;
  while (end > meta && pool[end - 1] == 0) --end;
  out.append(reinterpret_cast<const char*>(pool + meta), end - meta);
  return out;
}

}  // namespace hiqcache::fuzz
