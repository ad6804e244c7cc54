// ExtentAllocator: the pool's free byte ranges, from which BlockStore carves its extents.
//
// Ranges are kept by offset. No free range crosses a registration granule (an extent must be
// one DMA copy): added space is split at granule boundaries, and a freed range coalesces with
// its free neighbours only where they meet inside a granule. An extent is taken first-fit: the
// first range (lowest offset) big enough for what is wanted, else the largest that holds the
// least acceptable size. Not thread-safe: BlockStore holds it under its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace hiqcache::server {

struct FreeRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

class ExtentAllocator {
 public:
  // `granule`: the registration granule (> 0).
  explicit ExtentAllocator(uint64_t granule) : granule_(granule) {}

  void Clear() { free_.clear(); }
  // Adds [offset, offset + length) as free, split at granule boundaries. REQUIRES: it overlaps
  // no free range.
  void Add(uint64_t offset, uint64_t length);
  // The first free range of at least `want` bytes; else the largest of at least `min_bytes`;
  // else none.
  std::optional<FreeRange> Find(uint64_t want, uint64_t min_bytes) const;
  // Takes the first `bytes` of `range` (an answer of Find, nothing changed since); the rest of it
  // stays free. REQUIRES: bytes <= range.bytes.
  void Take(const FreeRange& range, uint64_t bytes);
  // Gives [offset, offset + length) back (an extent taken before), coalesced with its free
  // neighbours inside a granule.
  void Free(uint64_t offset, uint64_t length);

  // Free ranges now, offset -> length (tests, stats).
  const std::map<uint64_t, uint64_t>& ranges() const { return free_; }

 private:
  const uint64_t granule_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length
};

}  // namespace hiqcache::server
