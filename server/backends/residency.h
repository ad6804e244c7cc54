// ResidencyProbe: how many bytes of a client's shared memory a task would fault in, asked of the
// kernel (mincore) before the task touches it (see core/fault_budget.h for why that matters).
//
// For the rows of a task it collects the pages their heads span in every layer and plane,
// merged into runs (rows that follow each other in memory make one run, so a vLLM page of 16
// rows costs one entry; a view whose heads lie apart, or are split, merges each head of a layer
// with the same head of the rows before it, so a tile of a page costs one entry per head), and
// asks mincore about each run. A page counts as not resident when it
// is not in the object's page cache: never written, hole-punched or swapped out. The answer is a
// snapshot: a page the client punches after the probe is faulted without a charge, one page per
// race the client wins.
//
// Not thread-safe: one probe per binding (its tasks are serialized); it keeps its scratch
// vectors between calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::server {

class ResidencyProbe {
 public:
  // Bytes in pages that rows[0, num_rows) touch in layout.num_layers layers of `layers` (each of
  // its layout.kv_planes planes) and that are not resident now.
  uint64_t RowsNotResident(const kernels::BlockLayout& layout, const kernels::LayerViews* layers,
                           const uint32_t* rows, size_t num_rows);
  // Bytes in pages of [p, p + bytes) that are not resident now.
  uint64_t RangeNotResident(const void* p, size_t bytes);
  // Whether the page holding `p` (in a mapping of the daemon's) is resident now.
  static bool Resident(const void* p);
  // What the daemon's access to a missing page of a mapping allocates.
  enum class Faults : uint8_t {
    kNone,        // nothing: a hugetlbfs object, mapped only while every page of it is
                  // allocated (ShmMapping::CheckHugetlbPages) and never swapped out (mincore
                  // reports only this process's page tables there, so a page the client wrote
                  // but the daemon never touched reads as missing); never asked, never counted
    kHugeExtent,  // shmem that transparent huge pages may back (the daemon's mapping is advised
                  // MADV_HUGEPAGE and shmem_enabled honours it): a fault in a wholly missing
                  // 2 MiB extent of the object allocates all of it, so such an extent counts
                  // whole; a missing page in a partly resident one counts one page
  };
  struct Mapping {
    uintptr_t begin = 0;  // page-aligned, at object offset 0
    uintptr_t end = 0;
    Faults faults = Faults::kNone;
  };
  // Mappings whose faults are not one page per missing page (Faults); elsewhere each missing page
  // counts one page. Replaces the earlier set.
  void SetMappings(std::vector<Mapping> mappings);
  static constexpr uintptr_t kHugeExtentBytes = uintptr_t{2} << 20;
  // Maps the pages of [p, p + bytes) (a shared mapping of the daemon's) that are resident into
  // the daemon's page tables now (MADV_POPULATE_WRITE), so that a task's first write to them
  // takes no page fault. Pages that are not resident are left alone: mapping them would
  // allocate them on the daemon's account. It asks mincore about 512 KiB at a time and maps that
  // part's resident runs right after, so a page the client punches in between is faulted without
  // a charge, at most 512 KiB per race the client wins. Returns the bytes mapped (0 where the
  // kernel lacks MADV_POPULATE_WRITE).
  static uint64_t MapResident(void* p, size_t bytes);

  static size_t PageBytes();

 private:
  // The bytes from a row's first layer's first byte to its last layer's last, where the layers
  // of `plane` are one view (contiguous heads) shifted by the same step per layer with gaps
  // shorter than a page between them, so that the pages a row touches in all of them are those
  // of that one range (page_first); 0 otherwise.
  static uint64_t LayersAsOneExtent(const kernels::BlockLayout& layout,
                                    const kernels::LayerViews* layers, uint32_t plane);
  // Adds [begin, end) to the runs, extending the last run when it overlaps or touches it.
  void Add(uintptr_t begin, uintptr_t end);
  // Adds [begin, end) to the open run of `slot` (one per layer and head), extending it when it
  // overlaps or touches it, else moving it to runs_ and opening a new one.
  void AddToSlot(size_t slot, uintptr_t begin, uintptr_t end);
  // Moves every open run to runs_.
  void CloseSlots();
  uint64_t CountNotResident();
  // Bytes of the pages of page-aligned [begin, end) that mincore reports not resident.
  uint64_t AskMincore(uintptr_t begin, uintptr_t end);
  // The extent a count asked mincore about last, and how many of its bytes were absent (runs
  // arrive in address order, so each extent is asked about once per count).
  struct ExtentSeen {
    uintptr_t extent = UINTPTR_MAX;
    uint64_t absent = 0;
  };
  // The same for [begin, end) inside `m` (kHugeExtent): a wholly missing extent counts whole,
  // once; in a partly resident one each missing page counts.
  uint64_t AskHugeExtents(const Mapping& m, uintptr_t begin, uintptr_t end, ExtentSeen* seen);

  std::vector<std::pair<uintptr_t, uintptr_t>> runs_;  // page-aligned [begin, end)
  std::vector<std::pair<uintptr_t, uintptr_t>> open_;  // per slot; {0, 0} = none
  std::vector<unsigned char> pages_;                   // mincore's answer for one run
  std::vector<Mapping> mappings_;                      // sorted by begin, disjoint
};

}  // namespace hiqcache::server
