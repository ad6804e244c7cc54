// PoolRegion (server/pool_region.h): a pool the shm filesystem cannot hold is refused up front
// with a message naming pool_bytes and the free space, and nothing is created (a sparse object
// would map and then SIGBUS on pre-fault, as in a 64 MB Docker /dev/shm); the pages an existing
// object holds count toward its room; a small pool opens, pre-faults and reopens.
#include "pool_region.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace hiqcache::server {
namespace {

struct FsSpace {
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
};

FsSpace SpaceOf(const std::string& dir) {
  struct statvfs fs {};
  EXPECT_EQ(::statvfs(dir.c_str(), &fs), 0) << dir;
  return {static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize,
          static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize};
}

std::string UniqueName(const std::string& tag) {
  return "hiq-pool-region-test-" + tag + "-" + std::to_string(::getpid());
}

bool ShmExists(const std::string& bare) {
  struct stat st {};
  return ::stat(("/dev/shm/" + bare).c_str(), &st) == 0;
}

TEST(PoolRegionTest, RefusesAPoolTheShmFilesystemCannotHold) {
  const std::string bare = UniqueName("huge");
  ::shm_unlink(("/" + bare).c_str());
  // Larger than the whole filesystem: no concurrent activity can make it fit.
  const uint64_t bytes = SpaceOf("/dev/shm").total_bytes + (uint64_t{1} << 30);
  auto region = PoolRegion::Open("/" + bare, bytes);
  const bool created = ShmExists(bare);
  ::shm_unlink(("/" + bare).c_str());
  ASSERT_FALSE(region.ok()) << "a pool of " << bytes << " bytes was mapped over /dev/shm";
  EXPECT_EQ(region.status().code(), StatusCode::kFailedPrecondition);
  const std::string msg = region.status().message();
  EXPECT_NE(msg.find("pool_bytes " + std::to_string(bytes)), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not fit in /dev/shm"), std::string::npos) << msg;
  EXPECT_NE(msg.find("free of"), std::string::npos) << msg;
  EXPECT_FALSE(created) << "the refused pool's shm object was created";
}

// The room check on an ordinary directory: a file's allocated blocks count as held by it.
TEST(PoolRegionTest, CheckShmRoomCountsWhatTheObjectAlreadyHolds) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / UniqueName("room");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  constexpr uint64_t kHeld = 16u << 20;
  {
    std::ofstream out(dir / "pool", std::ios::binary);
    std::vector<char> chunk(1 << 20, 'x');
    for (uint64_t i = 0; i < kHeld; i += chunk.size()) out.write(chunk.data(), chunk.size());
  }
  ::sync();
  const uint64_t free_now = SpaceOf(dir.string()).free_bytes;
  // Needs free + 8 MiB in all: the existing 16 MiB cover it; a new object of that size does not.
  const uint64_t bytes = free_now + (kHeld / 2);
  EXPECT_TRUE(CheckShmRoom(dir.string(), "pool", bytes).ok());
  const Status fresh = CheckShmRoom(dir.string(), "other", bytes);
  EXPECT_EQ(fresh.code(), StatusCode::kFailedPrecondition) << fresh.ToString();
  const Status grown = CheckShmRoom(dir.string(), "pool", free_now + kHeld + (uint64_t{1} << 30));
  EXPECT_EQ(grown.code(), StatusCode::kFailedPrecondition) << grown.ToString();
  EXPECT_NE(grown.message().find("the existing object holds"), std::string::npos)
      << grown.message();
  EXPECT_TRUE(CheckShmRoom(dir.string(), "other", 4096).ok());
  EXPECT_EQ(CheckShmRoom((dir / "missing").string(), "pool", 1).code(),
            StatusCode::kFailedPrecondition);
  std::filesystem::remove_all(dir);
}

TEST(PoolRegionTest, SmallPoolOpensPrefaultsAndReopens) {
  const std::string bare = UniqueName("small");
  ::shm_unlink(("/" + bare).c_str());
  constexpr uint64_t kBytes = 8u << 20;
  {
    auto region = PoolRegion::Open("/" + bare, kBytes);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    EXPECT_EQ((*region)->size(), kBytes);
    (*region)->Prefault(2);
    (*region)->data()[kBytes - 1] = 0x5A;
  }
  {
    // Reattach: the object holds its pages already, so its room is there even if /dev/shm is
    // now nearly full.
    auto region = PoolRegion::Open(bare, kBytes);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    EXPECT_EQ((*region)->data()[kBytes - 1], 0x5A);
    EXPECT_EQ((*region)->name(), "/" + bare);
  }
  ::shm_unlink(("/" + bare).c_str());
}

}  // namespace
}  // namespace hiqcache::server
