// ExtentAllocator: granule splitting, first-fit with a largest-fit fallback, taking the front of
// a range, and coalescing on free that never crosses a granule.
#include "pool/extent_allocator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>

namespace hiqcache::server {
namespace {

using Ranges = std::map<uint64_t, uint64_t>;

TEST(ExtentAllocatorTest, AddSplitsAtGranuleBoundaries) {
  ExtentAllocator a(100);
  a.Add(30, 250);  // [30, 280): 70 + 100 + 80
  EXPECT_EQ(a.ranges(), (Ranges{{30, 70}, {100, 100}, {200, 80}}));
  a.Clear();
  EXPECT_TRUE(a.ranges().empty());
}

TEST(ExtentAllocatorTest, FindIsFirstFitElseLargestAboveTheMinimum) {
  ExtentAllocator a(1000);
  a.Add(0, 40);
  a.Add(1000, 90);
  a.Add(2000, 60);
  a.Add(3000, 90);
  auto fit = a.Find(/*want=*/50, /*min_bytes=*/10);
  ASSERT_TRUE(fit.has_value());
  EXPECT_EQ(fit->offset, 1000u);  // the first of at least 50, not the smallest
  EXPECT_EQ(fit->bytes, 90u);
  auto largest = a.Find(/*want=*/200, /*min_bytes=*/10);
  ASSERT_TRUE(largest.has_value());
  EXPECT_EQ(largest->offset, 1000u);  // the largest (first of the equal ones)
  EXPECT_FALSE(a.Find(/*want=*/200, /*min_bytes=*/100).has_value());
}

TEST(ExtentAllocatorTest, TakeLeavesTheRestFree) {
  ExtentAllocator a(1000);
  a.Add(0, 500);
  auto r = a.Find(100, 100);
  ASSERT_TRUE(r.has_value());
  a.Take(*r, 120);
  EXPECT_EQ(a.ranges(), (Ranges{{120, 380}}));
  r = a.Find(380, 380);
  ASSERT_TRUE(r.has_value());
  a.Take(*r, 380);
  EXPECT_TRUE(a.ranges().empty());
}

TEST(ExtentAllocatorTest, FreeCoalescesInsideAGranuleOnly) {
  ExtentAllocator a(100);
  a.Add(0, 300);                    // [0,100) [100,200) [200,300)
  a.Take(FreeRange{100, 100}, 40);  // extent [100, 140), free [140, 200)
  a.Take(FreeRange{0, 100}, 100);   // extent [0, 100)
  a.Free(100, 40);                  // meets [140, 200) inside the granule; [0, 100) is not free
  EXPECT_EQ(a.ranges(), (Ranges{{100, 100}, {200, 100}}));
  a.Free(0, 100);  // ends at a granule boundary: stays apart from [100, 200)
  EXPECT_EQ(a.ranges(), (Ranges{{0, 100}, {100, 100}, {200, 100}}));
  a.Take(FreeRange{100, 100}, 100);
  a.Free(100, 100);  // starts at a granule boundary: stays apart from [0, 100)
  EXPECT_EQ(a.ranges(), (Ranges{{0, 100}, {100, 100}, {200, 100}}));
}

TEST(ExtentAllocatorTest, FreeJoinsBothNeighboursInAGranule) {
  ExtentAllocator a(1000);
  a.Add(0, 1000);
  a.Take(FreeRange{0, 1000}, 100);   // [0, 100) taken, [100, 1000) free
  a.Take(FreeRange{100, 900}, 200);  // [100, 300) taken, [300, 1000) free
  a.Free(0, 100);                    // nothing free before it
  EXPECT_EQ(a.ranges(), (Ranges{{0, 100}, {300, 700}}));
  a.Free(100, 200);  // joins [0, 100) and [300, 1000)
  EXPECT_EQ(a.ranges(), (Ranges{{0, 1000}}));
}

}  // namespace
}  // namespace hiqcache::server
