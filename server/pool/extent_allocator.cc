#include "pool/extent_allocator.h"

#include <algorithm>
#include <iterator>

namespace hiqcache::server {

void ExtentAllocator::Add(uint64_t offset, uint64_t length) {
  while (length > 0) {
    const uint64_t piece = std::min(length, (offset / granule_ + 1) * granule_ - offset);
    free_[offset] = piece;
    offset += piece;
    length -= piece;
  }
}

std::optional<FreeRange> ExtentAllocator::Find(uint64_t want, uint64_t min_bytes) const {
  auto pick = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= want) {
      pick = it;
      break;
    }
    if (it->second >= min_bytes && (pick == free_.end() || it->second > pick->second)) {
      pick = it;
    }
  }
  if (pick == free_.end()) return std::nullopt;
  return FreeRange{pick->first, pick->second};
}

void ExtentAllocator::Take(const FreeRange& range, uint64_t bytes) {
  free_.erase(range.offset);
  if (range.bytes > bytes) free_[range.offset + bytes] = range.bytes - bytes;
}

void ExtentAllocator::Free(uint64_t offset, uint64_t length) {
  uint64_t off = offset;
  uint64_t len = length;
  // Coalesces with its neighbours, but never across a granule boundary.
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + len == next->first && next->first % granule_ != 0) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off && off % granule_ != 0) {
      off = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_[off] = len;
}

}  // namespace hiqcache::server
