// PoolRegion (server/pool/pool_region.h): a pool the shm filesystem cannot hold is refused up front
// with a message naming pool_bytes and the free space, and nothing is created (a sparse object
// would map and then SIGBUS on pre-fault, as in a 64 MB Docker /dev/shm); the pages an existing
// object holds count toward its room; a small pool opens, pre-faults and reopens.
#include "pool/pool_region.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
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
    (*region)->data()[100] = 0x11;  // a value written before the pre-fault is kept
    std::atomic<uint64_t> done{0};
    ASSERT_TRUE((*region)->Prefault(2, &done).ok());
    EXPECT_EQ(done.load(), kBytes);
    EXPECT_EQ((*region)->data()[100], 0x11);
    // Every page is allocated in the object: no later write faults one in or finds no room.
    struct stat st {};
    ASSERT_EQ(::stat(("/dev/shm/" + bare).c_str(), &st), 0);
    EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, kBytes);
    EXPECT_EQ((*region)->MapPages(), kBytes);
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

TEST(PoolRegionTest, PrefaultStopsBetweenStepsWhenAsked) {
  const std::string bare = UniqueName("stopped");
  ::shm_unlink(("/" + bare).c_str());
  constexpr uint64_t kBytes = 256u << 20;  // four 64 MiB steps
  auto region = PoolRegion::Open("/" + bare, kBytes);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  std::atomic<bool> stop{true};
  std::atomic<uint64_t> done{0};
  const Status st = (*region)->Prefault(2, &done, &stop);
  EXPECT_EQ(st.code(), StatusCode::kCancelled) << st.ToString();
  EXPECT_EQ(done.load(), 0u);
  struct stat sb {};
  ASSERT_EQ(::stat(("/dev/shm/" + bare).c_str(), &sb), 0);
  EXPECT_LT(static_cast<uint64_t>(sb.st_blocks) * 512, kBytes);
  EXPECT_EQ((*region)->MapPages(&stop), 0u);
  region->reset();
  ::shm_unlink(("/" + bare).c_str());
}

}  // namespace
}  // namespace hiqcache::server

namespace hiqcache::server {
namespace {

// The pool cannot be poisoned: an object another user planted under the pool's name in the
// world-writable /dev/shm would give that user a writable mapping of the pool.
TEST(PoolRegionOwnerTest, RefusesAnObjectAnotherUserCreated) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  const std::string bare = UniqueName("foreign");
  ::shm_unlink(("/" + bare).c_str());
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setresgid(61001, 61001, 61001) != 0 || ::setresuid(61001, 61001, 61001) != 0) _exit(2);
    ::umask(0);
    const int fd = ::shm_open(("/" + bare).c_str(), O_RDWR | O_CREAT | O_EXCL, 0666);
    _exit(fd >= 0 && ::ftruncate(fd, 1 << 20) == 0 ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  auto region = PoolRegion::Open("/" + bare, 1 << 20);
  struct stat st {};
  ::stat(("/dev/shm/" + bare).c_str(), &st);
  ::shm_unlink(("/" + bare).c_str());
  ASSERT_FALSE(region.ok()) << "the daemon mapped a pool another user can write";
  EXPECT_EQ(region.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(region.status().message().find("shm_name"), std::string::npos)
      << region.status().message();
  EXPECT_NE(region.status().message().find("uid 61001"), std::string::npos)
      << region.status().message();
  EXPECT_EQ(st.st_uid, 61001u);  // left as it was
}

// Our own object, but open to others: replaced by a fresh 0600 object (nothing reattached).
TEST(PoolRegionOwnerTest, ReplacesOurObjectThatOthersCanOpen) {
  const std::string bare = UniqueName("open");
  ::shm_unlink(("/" + bare).c_str());
  const mode_t old_mask = ::umask(0);
  const int fd = ::shm_open(("/" + bare).c_str(), O_RDWR | O_CREAT | O_EXCL, 0666);
  ::umask(old_mask);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 1 << 20), 0);
  ASSERT_EQ(::pwrite(fd, "poison", 6, 0), 6);
  ::close(fd);
  auto region = PoolRegion::Open("/" + bare, 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm/" + bare).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(std::memcmp((*region)->data(), "\0\0\0\0\0\0", 6), 0) << "the old contents stayed";
  region->reset();
  ::shm_unlink(("/" + bare).c_str());
}

}  // namespace
}  // namespace hiqcache::server
