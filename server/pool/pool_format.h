// The persistent layout of the shared-memory pool: pool, extent and block headers.
//
// Everything a restarted daemon needs to rebuild its index lives in these headers; no allocator
// state has to survive a crash (docs/design.md "Pool and durability"). The daemon is the only
// writer. Layout: [PoolHeader, 4 KiB][extent directory][extent]...; an extent is
// [ExtentHeader, 256 B][slot]...; a slot is [BlockHeader, 64 B][payload, rounded up to 64 B]. The
// directory lists where the live extents are, so a restarted daemon finds them without scanning
// the pool.
#pragma once

#include <cstddef>
#include <cstdint>

namespace hiqcache::server {

constexpr uint64_t kPoolMagic = 0x314C4F4F50514948ull;    // "HIQPOOL1"
constexpr uint64_t kExtentMagic = 0x3154584550514948ull;  // "HIQPEXT1"
constexpr uint32_t kBlockMagic = 0x4B4C4248u;             // "HBLK"
constexpr uint32_t kPoolFormatVersion = 1;

constexpr size_t kPoolHeaderBytes = 4096;
constexpr size_t kExtentHeaderBytes = 256;
constexpr size_t kBlockHeaderBytes = 64;
constexpr size_t kSlotAlign = 64;

// The pool is page-locked for DMA (cudaHostRegister) in chunks of this many bytes from its base,
// and no extent crosses a multiple of it, so that no block straddles two registered ranges (a
// copy spanning two registrations is not one DMA transfer). A block's extent must fit in one.
constexpr uint64_t kPoolRegisterChunkBytes = 64ull << 30;

enum class BlockState : uint32_t {
  kFree = 0,
  kWriting = 1,    // reserved, payload being written: never served, dropped on rebuild
  kCommitted = 2,  // payload complete and checksummed
};

struct PoolHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t directory_entries;  // ExtentDirEntry slots after the header
  uint64_t pool_bytes;
  uint64_t created_unix;
  uint64_t boot_count;
};
static_assert(sizeof(PoolHeader) <= kPoolHeaderBytes);

// One directory slot: an extent's place in the pool (bytes == 0: unused).
struct ExtentDirEntry {
  uint64_t offset;
  uint64_t bytes;
};

// Directory slots for a pool: one per 16 MiB (extents are ~64 MiB or one block), at least 4,096.
inline constexpr uint64_t DirectoryEntriesFor(uint64_t pool_bytes) {
  return pool_bytes / (16ull << 20) > 4096 ? pool_bytes / (16ull << 20) : 4096;
}

// Namespace descriptor text is stored (truncated to fit) for diagnostics and rebuild.
struct ExtentHeader {
  uint64_t magic;
  uint64_t extent_bytes;
  uint64_t slot_bytes;
  uint64_t payload_bytes;
  uint32_t num_slots;
  uint32_t reserved0;
  uint8_t namespace_hash[16];
  char namespace_text[kExtentHeaderBytes - 56];
};
static_assert(sizeof(ExtentHeader) == kExtentHeaderBytes);

struct BlockHeader {
  uint32_t magic;
  uint32_t state;  // BlockState, written last with release order on commit
  uint8_t key[16];
  uint64_t namespace_tag;  // low 64 bits of the namespace hash
  uint64_t checksum;       // XXH3-64 of the payload
  uint64_t payload_bytes;
  uint64_t commit_seq;  // recency order for the LRU after a rebuild
  uint64_t reserved0;
};
static_assert(sizeof(BlockHeader) == kBlockHeaderBytes);

inline constexpr size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Bytes before the first extent: the header and the directory, page aligned.
inline constexpr uint64_t PoolMetaBytes(uint64_t pool_bytes) {
  return AlignUp(kPoolHeaderBytes + DirectoryEntriesFor(pool_bytes) * sizeof(ExtentDirEntry), 4096);
}

inline constexpr size_t SlotBytesFor(size_t payload_bytes) {
  return kBlockHeaderBytes + AlignUp(payload_bytes, kSlotAlign);
}

}  // namespace hiqcache::server
