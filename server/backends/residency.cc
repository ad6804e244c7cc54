#include "backends/residency.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <utility>

namespace hiqcache::server {

namespace {

// The most pages one mincore call is asked about (its answer vector: 64 KiB).
constexpr size_t kPagesPerCall = size_t{1} << 16;

}  // namespace

size_t ResidencyProbe::PageBytes() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

bool ResidencyProbe::Resident(const void* p) {
  const uintptr_t page = PageBytes();
  unsigned char v = 0;
  void* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1));
  // An address the daemon has not mapped cannot be faulted in either: treat it as resident.
  if (::mincore(start, page, &v) != 0) return true;
  return (v & 1) != 0;
}

void ResidencyProbe::SetMappings(std::vector<Mapping> mappings) {
  std::sort(mappings.begin(), mappings.end(),
            [](const Mapping& a, const Mapping& b) { return a.begin < b.begin; });
  mappings_ = std::move(mappings);
}

uint64_t ResidencyProbe::MapResident(void* p, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  constexpr size_t kPagesPerPart = 128;
  const uintptr_t page = PageBytes();
  uintptr_t at = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  unsigned char v[kPagesPerPart];
  uint64_t mapped = 0;
  for (; at < end;) {
    const size_t n = std::min<size_t>((end - at) / page, kPagesPerPart);
    if (::mincore(reinterpret_cast<void*>(at), n * page, v) != 0) return mapped;
    for (size_t i = 0; i < n;) {
      if ((v[i] & 1) == 0) {
        ++i;
        continue;
      }
      size_t j = i + 1;
      while (j < n && (v[j] & 1) != 0) ++j;
      if (::madvise(reinterpret_cast<void*>(at + i * page), (j - i) * page, MADV_POPULATE_WRITE) !=
          0) {
        return mapped;  // EINVAL: not supported; EFAULT: the object shrank
      }
      mapped += (j - i) * page;
      i = j;
    }
    at += n * page;
  }
  return mapped;
#else
  (void)p;
  (void)bytes;
  return 0;
#endif
}

void ResidencyProbe::Add(uintptr_t begin, uintptr_t end) {
  const uintptr_t page = PageBytes();
  begin &= ~(page - 1);
  end = (end + page - 1) & ~(page - 1);
  if (!runs_.empty()) {
    auto& last = runs_.back();
    if (begin >= last.first && begin <= last.second) {
      last.second = std::max(last.second, end);
      return;
    }
  }
  runs_.emplace_back(begin, end);
}

void ResidencyProbe::AddToSlot(size_t slot, uintptr_t begin, uintptr_t end) {
  const uintptr_t page = PageBytes();
  begin &= ~(page - 1);
  end = (end + page - 1) & ~(page - 1);
  auto& open = open_[slot];
  if (open.second != 0 && begin >= open.first && begin <= open.second) {
    open.second = std::max(open.second, end);
    return;
  }
  if (open.second != 0) runs_.push_back(open);
  open = {begin, end};
}

void ResidencyProbe::CloseSlots() {
  for (auto& open : open_) {
    if (open.second != 0) runs_.push_back(open);
    open = {0, 0};
  }
}

uint64_t ResidencyProbe::RangeNotResident(const void* p, size_t bytes) {
  runs_.clear();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  if (bytes > 0) Add(begin, begin + bytes);
  return CountNotResident();
}

uint64_t ResidencyProbe::LayersAsOneExtent(const kernels::BlockLayout& layout,
                                           const kernels::LayerViews* layers, uint32_t plane) {
  const uint32_t n = layout.num_layers;
  const kernels::StridedView& v0 = layers[0].planes[plane];
  const uint64_t row_bytes = uint64_t{layout.row.num_heads} * layout.row.head_dim * 2;
  if (n < 2 || v0.head_stride != uint64_t{layout.row.head_dim} * 2 || v0.dim_run != 0) return 0;
  const kernels::StridedView& v1 = layers[1].planes[plane];
  if (v1.base <= v0.base) return 0;
  const uint64_t delta = static_cast<uint64_t>(v1.base - v0.base);
  if (delta < row_bytes || delta - row_bytes >= PageBytes()) return 0;
  for (uint32_t l = 1; l < n; ++l) {
    const kernels::StridedView& v = layers[l].planes[plane];
    if (v.base != v0.base + l * delta || v.row_stride != v0.row_stride ||
        v.head_stride != v0.head_stride || v.page_rows != v0.page_rows ||
        v.page_stride != v0.page_stride || v.row_group != v0.row_group ||
        v.row_group_stride != v0.row_group_stride || v.dim_run != 0) {
      return 0;
    }
  }
  return (n - 1) * delta + row_bytes;
}

uint64_t ResidencyProbe::RowsNotResident(const kernels::BlockLayout& layout,
                                         const kernels::LayerViews* layers, const uint32_t* rows,
                                         size_t num_rows) {
  runs_.clear();
  if (num_rows == 0 || layout.num_layers == 0) return 0;
  const uint64_t head_bytes = uint64_t{layout.row.head_dim} * 2;
  const uint32_t heads = layout.row.num_heads;
  // Heads that lie apart (a tile per head) go to a run per layer and head: the rows of a page
  // then make one run per head instead of one per row and head, which would need sorting.
  open_.assign(size_t{layout.num_layers} * heads, {0, 0});
  auto add_row = [&](const kernels::StridedView& v, uint32_t layer, uint32_t row) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(v.Head(row, 0));
    if (v.head_stride == head_bytes && v.dim_run == 0) {
      Add(start, start + heads * head_bytes);
      return;
    }
    const uint64_t head_span = v.HeadSpan(layout.row.head_dim);  // a split head's whole extent
    for (uint32_t h = 0; h < heads; ++h) {
      const uintptr_t head = start + uint64_t{h} * v.head_stride;
      AddToSlot(size_t{layer} * heads + h, head, head + head_span);
    }
  };
  for (uint32_t p = 0; p < layout.kv_planes; ++p) {
    // Visit the rows in address order where the layout allows, so that Add merges neighbours
    // into few runs and CountNotResident need not sort thousands: a row's layers one after
    // another where layers interleave within a row (page_first: a slot holds every layer),
    // else each layer's rows in turn (layer_first).
    const kernels::StridedView& first = layers[0].planes[p];
    // Where a row's layers lie back to back (page_first: the same view shifted by `delta` per
    // layer, gaps between them shorter than a page), the pages a row touches are those of one
    // range from its first layer's first byte to its last layer's last: one Add per row
    // instead of one per row and layer (a gap shorter than a page holds no page of its own).
    if (const uint64_t extent = LayersAsOneExtent(layout, layers, p); extent != 0) {
      for (size_t i = 0; i < num_rows; ++i) {
        const uintptr_t start = reinterpret_cast<uintptr_t>(first.Head(rows[i], 0));
        Add(start, start + extent);
      }
      continue;
    }
    bool layers_inner = false;
    if (layout.num_layers > 1) {
      const uintptr_t a = reinterpret_cast<uintptr_t>(first.Head(rows[0], 0));
      const uintptr_t b = reinterpret_cast<uintptr_t>(layers[1].planes[p].Head(rows[0], 0));
      layers_inner = b > a && b - a < first.row_stride;
    }
    if (layers_inner) {
      for (size_t i = 0; i < num_rows; ++i) {
        for (uint32_t l = 0; l < layout.num_layers; ++l) add_row(layers[l].planes[p], l, rows[i]);
      }
    } else {
      for (uint32_t l = 0; l < layout.num_layers; ++l) {
        for (size_t i = 0; i < num_rows; ++i) add_row(layers[l].planes[p], l, rows[i]);
      }
    }
    CloseSlots();
  }
  return CountNotResident();
}

uint64_t ResidencyProbe::CountNotResident() {
  if (runs_.empty()) return 0;
  // Runs of different views may overlap (aliased layers, K and V in one tensor): merge them all,
  // so that a page is asked about and counted once. Runs added in address order (the usual
  // case, see RowsNotResident) need no sort.
  if (!std::is_sorted(runs_.begin(), runs_.end())) std::sort(runs_.begin(), runs_.end());
  size_t out = 0;
  for (size_t i = 1; i < runs_.size(); ++i) {
    if (runs_[i].first <= runs_[out].second) {
      runs_[out].second = std::max(runs_[out].second, runs_[i].second);
    } else {
      runs_[++out] = runs_[i];
    }
  }
  runs_.resize(out + 1);
  uint64_t missing = 0;
  ExtentSeen seen;
  for (const auto& [begin, end] : runs_) {
    // The run's parts outside the special mappings, and inside each.
    uintptr_t at = begin;
    auto m = std::upper_bound(mappings_.begin(), mappings_.end(), at,
                              [](uintptr_t a, const Mapping& x) { return a < x.begin; });
    if (m != mappings_.begin() && std::prev(m)->end > at) --m;
    while (at < end) {
      if (m == mappings_.end() || end <= m->begin) {
        missing += AskMincore(at, end);
        break;
      }
      if (at < m->begin) {
        missing += AskMincore(at, m->begin);
        at = m->begin;
      }
      const uintptr_t stop = std::min(end, m->end);
      if (m->faults == Faults::kHugeExtent) {
        missing += AskHugeExtents(*m, at, stop, &seen);
      }
      at = stop;
      ++m;
    }
  }
  return missing;
}

uint64_t ResidencyProbe::AskHugeExtents(const Mapping& m, uintptr_t begin, uintptr_t end,
                                        ExtentSeen* seen) {
  uint64_t missing = 0;
  for (uintptr_t at = begin; at < end;) {
    // The object's 2 MiB extent holding `at` (offsets from the mapping's start), inside it.
    const uintptr_t extent = m.begin + (at - m.begin) / kHugeExtentBytes * kHugeExtentBytes;
    const uintptr_t extent_end = std::min(m.end, extent + kHugeExtentBytes);
    const uintptr_t stop = std::min(end, extent_end);
    const bool fresh = seen->extent != extent;
    if (fresh) {
      seen->extent = extent;
      seen->absent = AskMincore(extent, extent_end);
    }
    if (seen->absent == extent_end - extent) {
      if (fresh) missing += seen->absent;  // wholly missing: a fault allocates all of it, once
    } else if (seen->absent > 0) {
      missing += AskMincore(at, stop);
    }
    at = stop;
  }
  return missing;
}

uint64_t ResidencyProbe::AskMincore(uintptr_t begin, uintptr_t end) {
  const uintptr_t page = PageBytes();
  uint64_t missing = 0;
  for (uintptr_t at = begin; at < end;) {
    const size_t n = std::min<size_t>((end - at) / page, kPagesPerCall);
    pages_.resize(n);
    if (::mincore(reinterpret_cast<void*>(at), n * page, pages_.data()) != 0) {
      // Not all of it is mapped (cannot happen for validated views): count none of it, as
      // an access there would fault the daemon's own SIGBUS guard, not allocate.
      at += n * page;
      continue;
    }
    for (size_t i = 0; i < n; ++i) missing += (pages_[i] & 1) ? 0 : page;
    at += n * page;
  }
  return missing;
}

}  // namespace hiqcache::server
