// ResidencyProbe::RowsNotResident against a page-by-page count: for the host layouts engines use
// (layers inside a slot as in SGLang's page_first, layer-major as in layer_first, heads apart as
// in page_head), rows in order, in reverse and shuffled, K and V apart or aliased, over a memfd
// whose pages are partly written (resident) and partly holes. Also the mappings whose faults are
// not one page per missing page: hugetlbfs (never counted) and shmem that transparent huge pages
// may back (a wholly missing 2 MiB extent counted whole).
// in page_head, tiles of split heads as in vLLM's CPU attention), rows in order, in reverse and
// shuffled, K and V apart or aliased, over a memfd whose pages are partly written (resident) and
// partly holes.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backends/residency.h"

namespace hiqcache::server {
namespace {

constexpr uint32_t kLayers = 4, kHeads = 2, kDim = 64, kSlots = 256;
constexpr uint64_t kHeadBytes = uint64_t{kDim} * 2;
constexpr uint64_t kRowBytes = kHeads * kHeadBytes;
constexpr uint64_t kPlaneBytes = uint64_t{kSlots} * kLayers * kRowBytes;

// A memfd of `bytes` holes, mapped shared here; with `every_third_page`, every third page
// written (resident), the others left holes. data() is null when it could not be made.
class TestMemfd {
 public:
  TestMemfd(const char* name, uint64_t bytes, bool every_third_page) : bytes_(bytes) {
    fd_ = ::memfd_create(name, MFD_CLOEXEC);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) return;
    data_ = static_cast<uint8_t*>(p);
    const uint64_t page = ResidencyProbe::PageBytes();
    for (uint64_t at = 0; every_third_page && at < bytes; at += 3 * page) {
      std::memset(data_ + at, 1, page);
    }
  }
  ~TestMemfd() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    if (fd_ >= 0) ::close(fd_);
  }
  TestMemfd(const TestMemfd&) = delete;
  TestMemfd& operator=(const TestMemfd&) = delete;
  uint8_t* data() const { return data_; }
  int fd() const { return fd_; }

 private:
  uint64_t bytes_;
  int fd_ = -1;
  uint8_t* data_ = nullptr;
};

class ResidencyProbeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    page_ = ResidencyProbe::PageBytes();
    bytes_ = 2 * kPlaneBytes;
    memfd_ = std::make_unique<TestMemfd>("hiq-residency-probe-test", bytes_, true);
    ASSERT_NE(memfd_->data(), nullptr);
    fd_ = memfd_->fd();
    data_ = memfd_->data();
    layout_.row.num_heads = kHeads;
    layout_.row.head_dim = kDim;
    layout_.num_layers = kLayers;
    layout_.kv_planes = 2;
    layout_.block_tokens = 4;
  }

  // Bytes in the distinct pages the rows' heads touch that mincore reports not resident, page by
  // page.
  uint64_t Expected(const std::vector<kernels::LayerViews>& views,
                    const std::vector<uint32_t>& rows) const {
    std::set<uintptr_t> pages;
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        for (uint32_t r : rows) {
          for (uint32_t h = 0; h < kHeads; ++h) {
            const kernels::StridedView& v = views[l].planes[p];
            const uintptr_t a = reinterpret_cast<uintptr_t>(v.Head(r, h));
            const uint64_t span = v.HeadSpan(kDim);
            for (uintptr_t x = a & ~(page_ - 1); x < a + span; x += page_) pages.insert(x);
          }
        }
      }
    }
    uint64_t missing = 0;
    for (uintptr_t x : pages) {
      unsigned char v = 0;
      EXPECT_EQ(::mincore(reinterpret_cast<void*>(x), page_, &v), 0);
      if ((v & 1) == 0) missing += page_;
    }
    return missing;
  }

  // page_first: [plane][slot][layer][head][dim], in data_; or in `data` with `gap` bytes after
  // each layer's row (padding).
  std::vector<kernels::LayerViews> PageFirst(bool alias_v = false, uint8_t* data = nullptr,
                                             uint64_t gap = 0) const {
    const uint64_t step = kRowBytes + gap;  // from one layer's row to the next one's
    const uint64_t plane = PageFirstPlaneBytes(gap);
    std::vector<kernels::LayerViews> v(kLayers);
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        kernels::StridedView& s = v[l].planes[p];
        s.base = (data != nullptr ? data : data_) + (alias_v ? 0 : p * plane) + l * step;
        s.row_stride = kLayers * step;
        s.head_stride = kHeadBytes;
        s.num_rows = kSlots;
      }
    }
    return v;
  }
  static uint64_t PageFirstPlaneBytes(uint64_t gap) {
    return uint64_t{kSlots} * kLayers * (kRowBytes + gap);
  }
  // layer_first: [plane][layer][slot][head][dim].
  std::vector<kernels::LayerViews> LayerFirst() const {
    std::vector<kernels::LayerViews> v(kLayers);
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        kernels::StridedView& s = v[l].planes[p];
        s.base = data_ + p * kPlaneBytes + l * kSlots * kRowBytes;
        s.row_stride = kRowBytes;
        s.head_stride = kHeadBytes;
        s.num_rows = kSlots;
      }
    }
    return v;
  }
  // page_head: [plane][page][head][page row][layer][dim], 16-row pages.
  std::vector<kernels::LayerViews> PageHead() const {
    constexpr uint64_t kPageRows = 16;
    std::vector<kernels::LayerViews> v(kLayers);
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        kernels::StridedView& s = v[l].planes[p];
        s.base = data_ + p * kPlaneBytes + l * kHeadBytes;
        s.row_stride = kLayers * kHeadBytes;
        s.head_stride = kPageRows * kLayers * kHeadBytes;
        s.page_rows = kPageRows;
        s.page_stride = kHeads * kPageRows * kLayers * kHeadBytes;
        s.num_rows = kSlots;
      }
    }
    return v;
  }

  // vLLM's CPU tiles: [plane][layer][page][head][dim][page row], 16-row pages, each head's
  // elements a run of one (dim_run 1) 16 elements apart.
  std::vector<kernels::LayerViews> SplitTiles() const {
    constexpr uint64_t kPageRows = 16;
    constexpr uint64_t kTileBytes = kPageRows * kHeadBytes;
    std::vector<kernels::LayerViews> v(kLayers);
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        kernels::StridedView& s = v[l].planes[p];
        s.base = data_ + p * kPlaneBytes + l * kSlots * kRowBytes;
        s.row_stride = 2;
        s.head_stride = kTileBytes;
        s.page_rows = kPageRows;
        s.page_stride = kHeads * kTileBytes;
        s.num_rows = kSlots;
        s.dim_run = 1;
        s.dim_run_stride = kPageRows * 2;
      }
    }
    return v;
  }

  void Check(const std::string& what, const std::vector<kernels::LayerViews>& views) {
    std::vector<std::vector<uint32_t>> row_sets;
    std::vector<uint32_t> rows(64);
    std::iota(rows.begin(), rows.end(), 40);  // in order
    row_sets.push_back(rows);
    std::reverse(rows.begin(), rows.end());
    row_sets.push_back(rows);
    std::vector<uint32_t> all(kSlots);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), std::mt19937(7));
    row_sets.emplace_back(all.begin(), all.begin() + 48);  // shuffled, with gaps
    row_sets.push_back({200, 201, 202, 203, 8, 9, 10, 11, 120, 121, 122, 123});  // blocks
    row_sets.push_back({kSlots - 1});
    for (size_t i = 0; i < row_sets.size(); ++i) {
      const uint64_t want = Expected(views, row_sets[i]);
      EXPECT_EQ(
          probe_.RowsNotResident(layout_, views.data(), row_sets[i].data(), row_sets[i].size()),
          want)
          << what << ", row set " << i;
    }
  }

  size_t page_ = 0;
  uint64_t bytes_ = 0;
  std::unique_ptr<TestMemfd> memfd_;
  int fd_ = -1;
  uint8_t* data_ = nullptr;
  kernels::BlockLayout layout_;
  ResidencyProbe probe_;
};

TEST_F(ResidencyProbeTest, PageFirstCountsEachMissingPageOnce) { Check("page_first", PageFirst()); }

TEST_F(ResidencyProbeTest, LayerFirstCountsEachMissingPageOnce) {
  Check("layer_first", LayerFirst());
}

TEST_F(ResidencyProbeTest, HeadsApartCountEachMissingPageOnce) { Check("page_head", PageHead()); }

TEST_F(ResidencyProbeTest, SplitTilesCountEachMissingPageOnce) {
  Check("split tiles", SplitTiles());
}

TEST_F(ResidencyProbeTest, AliasedPlanesCountEachMissingPageOnce) {
  Check("page_first, V aliasing K", PageFirst(/*alias_v=*/true));
}

// Layers within a slot with gaps between them (page_first with padding): shorter than a page, a
// row's layers count as one range (the fast path); a page or longer, each layer apart (a page
// inside a gap is not touched and must not count). Both against the page-by-page count.
TEST_F(ResidencyProbeTest, PageFirstWithGapsBetweenLayersCountsOnlyTouchedPages) {
  for (const uint64_t gap : {uint64_t{64}, uint64_t{page_ - 2}, uint64_t{page_}, 2 * page_}) {
    const TestMemfd memfd("hiq-residency-probe-gaps", 2 * PageFirstPlaneBytes(gap), true);
    ASSERT_NE(memfd.data(), nullptr);
    Check("page_first, gap " + std::to_string(gap), PageFirst(false, memfd.data(), gap));
  }
}

// The expectation is not vacuous: the rows span both written pages and holes.
TEST_F(ResidencyProbeTest, RowsSpanHolesAndWrittenPages) {
  std::vector<uint32_t> rows(64);
  std::iota(rows.begin(), rows.end(), 40);
  const auto views = PageFirst();
  const uint64_t missing = probe_.RowsNotResident(layout_, views.data(), rows.data(), rows.size());
  EXPECT_GT(missing, 0u);
  EXPECT_LT(missing, 2 * rows.size() * kLayers * kRowBytes);
}

// A kHugeExtent mapping: a range in a wholly missing 2 MiB extent counts the extent, once however
// many runs touch it; in a partly resident extent only the missing pages count; a kNone mapping
// counts nothing; outside both, pages count as before.
TEST(ResidencyProbeMappingsTest, HugeExtentsCountWholeAndHugetlbNotAtAll) {
  const size_t page = ResidencyProbe::PageBytes();
  constexpr size_t kExtent = ResidencyProbe::kHugeExtentBytes;
  const size_t bytes = 3 * kExtent;
  const TestMemfd memfd("hiq-residency-extents", bytes, false);
  uint8_t* data = memfd.data();
  ASSERT_NE(data, nullptr);
  // Extent 0: a hole. Extent 1: its first page written. Extent 2: a hole.
  data[kExtent] = 1;
  const auto base = reinterpret_cast<uintptr_t>(data);
  ResidencyProbe probe;
  EXPECT_EQ(probe.RangeNotResident(data + 10 * page, page), page);  // no mappings set
  probe.SetMappings({{base, base + bytes, ResidencyProbe::Faults::kHugeExtent}});
  EXPECT_EQ(probe.RangeNotResident(data + 10 * page, page), kExtent);
  EXPECT_EQ(probe.RangeNotResident(data + kExtent + 5 * page, 2 * page), 2 * page);
  EXPECT_EQ(probe.RangeNotResident(data + kExtent, page), 0u);
  // Runs in two holes and a partly resident extent, several in one hole: each hole once.
  {
    kernels::BlockLayout layout;
    layout.row.num_heads = 1;
    layout.row.head_dim = 64;
    layout.num_layers = 1;
    layout.kv_planes = 1;
    kernels::LayerViews views;
    views.planes[0].base = data;
    views.planes[0].row_stride = page;
    views.planes[0].head_stride = 128;
    views.planes[0].num_rows = static_cast<uint32_t>(bytes / page);
    const uint32_t per_extent = static_cast<uint32_t>(kExtent / page);
    const std::vector<uint32_t> rows = {1, 7, 200, per_extent + 3, 2 * per_extent + 9};
    EXPECT_EQ(probe.RowsNotResident(layout, &views, rows.data(), rows.size()), 2 * kExtent + page);
  }
  probe.SetMappings({{base, base + bytes, ResidencyProbe::Faults::kNone}});
  EXPECT_EQ(probe.RangeNotResident(data, bytes), 0u);
  // A mapping covering only extent 1: the hole before it counts page by page.
  probe.SetMappings({{base + kExtent, base + 2 * kExtent, ResidencyProbe::Faults::kNone}});
  EXPECT_EQ(probe.RangeNotResident(data + kExtent - page, 3 * page), page);
}

long MinorFaults() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Writes a byte every `stride` bytes of [m, m + bytes); the minor faults that took. Not
// instrumented by ASan or TSan: their checks would fault in shadow pages of the fresh mapping and
// count.
__attribute__((no_sanitize("address", "thread"))) long WriteEveryAndCountFaults(uint8_t* m,
                                                                                uint64_t bytes,
                                                                                uint64_t stride) {
  const long before = MinorFaults();
  for (uint64_t at = 0; at < bytes; at += stride) static_cast<volatile uint8_t*>(m)[at] = 2;
  return MinorFaults() - before;
}

// MapResident maps the written pages of a second mapping of the memfd (a write to them then
// takes no fault, where one to an unmapped mapping takes one per page) and allocates none of the
// holes.
TEST_F(ResidencyProbeTest, MapResidentMapsWrittenPagesAndNoHoles) {
  const uint64_t written = (bytes_ / page_ + 2) / 3 * page_;
  ASSERT_EQ(probe_.RangeNotResident(data_, bytes_), bytes_ - written);
  auto map = [&]() {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    return static_cast<uint8_t*>(p);
  };
  // Writes a byte to every written page; the minor faults that took.
  auto touch = [&](uint8_t* m) { return WriteEveryAndCountFaults(m, bytes_, 3 * page_); };
  uint8_t* cold = map();
  const long cold_faults = touch(cold);
  uint8_t* warm = map();
  const uint64_t mapped = ResidencyProbe::MapResident(warm, bytes_);
  if (mapped == 0) GTEST_SKIP() << "no MADV_POPULATE_WRITE in this kernel";
  EXPECT_EQ(mapped, written);
  EXPECT_EQ(probe_.RangeNotResident(data_, bytes_), bytes_ - written) << "a hole was allocated";
  const long warm_faults = touch(warm);
  EXPECT_GE(cold_faults, static_cast<long>(written / page_) / 2);
  EXPECT_LT(warm_faults, cold_faults / 4) << "cold " << cold_faults;
  ::munmap(cold, bytes_);
  ::munmap(warm, bytes_);
}

}  // namespace
}  // namespace hiqcache::server
