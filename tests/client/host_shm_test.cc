#include "hiqcache/host_shm.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "huge_pages.h"
#include "time_margin.h"
namespace hiqcache {
namespace {

using std::chrono::milliseconds;

TEST(HostShmTest, CreateOpenUnlink) {
  const std::string name = HostShm::UniqueName("test");
  {
    auto created = HostShm::Create(name, 8192);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    EXPECT_TRUE(created->owner());
    EXPECT_EQ(created->size(), 8192u);
    EXPECT_EQ(created->name(), name);
    // Zero-filled.
    const auto* bytes = static_cast<const uint8_t*>(created->data());
    for (size_t i = 0; i < 8192; ++i) ASSERT_EQ(bytes[i], 0) << i;
    std::memcpy(created->data(), "hello", 5);

    // A second create of the same name fails.
    auto again = HostShm::Create(name, 8192);
    EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists);

    // Open maps the same memory, the whole size; the leading "/" is optional.
    auto opened = HostShm::Open(name.substr(1), 4096);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    EXPECT_FALSE(opened->owner());
    EXPECT_EQ(opened->size(), 8192u);
    EXPECT_EQ(std::memcmp(opened->data(), "hello", 5), 0);

    auto too_small = HostShm::Open(name, 8193);
    EXPECT_EQ(too_small.status().code(), StatusCode::kFailedPrecondition);

    // Destroying an opener does not unlink.
    opened = HostShm();
    EXPECT_TRUE(HostShm::Open(name).ok());
  }
  // The creator unlinked it.
  EXPECT_EQ(HostShm::Open(name).status().code(), StatusCode::kNotFound);
}

TEST(HostShmTest, MoveTransfersOwnership) {
  const std::string name = HostShm::UniqueName("move");
  auto created = HostShm::Create(name, 4096);
  ASSERT_TRUE(created.ok());
  HostShm a = std::move(created).value();
  HostShm b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): checking the moved-from state
  EXPECT_TRUE(b.valid());
  EXPECT_TRUE(b.owner());
  b = HostShm();
  EXPECT_EQ(HostShm::Open(name).status().code(), StatusCode::kNotFound);
}

// A memfd: zero-filled, close-on-exec, sealed against shrinking (the daemon maps it; a shrink
// would SIGBUS it), its fd owned by the handle, with no shm name to open.
TEST(HostShmTest, MemfdIsSealedAgainstShrinkingAndOwnsItsFd) {
  auto created = HostShm::CreateMemfd("test", 8192);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  HostShm a = std::move(created).value();
  ASSERT_TRUE(a.is_memfd());
  const int fd = a.fd();
  EXPECT_EQ(a.name(), "memfd:test");
  EXPECT_EQ(a.size(), 8192u);
  const auto* bytes = static_cast<const uint8_t*>(a.data());
  for (size_t i = 0; i < 8192; ++i) ASSERT_EQ(bytes[i], 0) << i;
  EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC);
  EXPECT_TRUE(::fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK);
  EXPECT_NE(::ftruncate(fd, 4096), 0) << "a sealed memfd was shrunk";
  EXPECT_EQ(errno, EPERM);
  HostShm b = std::move(a);
  EXPECT_FALSE(a.is_memfd());  // NOLINT(bugprone-use-after-move): checking the moved-from state
  EXPECT_EQ(b.fd(), fd);
  b = HostShm();
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1) << "the handle did not close its memfd";
  EXPECT_EQ(HostShm::CreateMemfd("zero", 0).status().code(), StatusCode::kInvalidArgument);
}

bool OnHugetlbfs(int fd) {
  struct statfs fs;
  return ::fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC;
}

// What a memfd of `size` bytes asking kAuto gets on this machine, judged from the kernel's
// counters rather than the library's.
HugePageBacking ExpectedAutoBacking(size_t size) {
  const uint64_t page = machine::HugePageBytes();
  const uint64_t rounded = page == 0 ? 0 : (size + page - 1) / page * page;
  if (page != 0 && machine::HugetlbAvailableBytes() >= rounded) return HugePageBacking::kHugetlb;
  return machine::ShmemThpHonoursAdvice() ? HugePageBacking::kTransparent : HugePageBacking::kNone;
}

TEST(HostShmTest, HugePagesNamesParse) {
  for (HugePages mode : {HugePages::kOff, HugePages::kAuto, HugePages::kRequire}) {
    auto parsed = ParseHugePages(HugePagesName(mode));
    ASSERT_TRUE(parsed.ok()) << HugePagesName(mode);
    EXPECT_EQ(*parsed, mode);
  }
  auto bad = ParseHugePages("yes", "opts.huge_pages");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("opts.huge_pages"), std::string::npos);
  EXPECT_STREQ(HugePageBackingName(HugePageBacking::kHugetlb), "hugetlb");
}

// kOff: a plain memfd of exactly the size asked, whatever the machine offers.
TEST(HostShmTest, MemfdWithoutHugePagesIsPlain) {
  auto shm = HostShm::CreateMemfd("plain", 3 << 20, false, HugePages::kOff);
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  EXPECT_EQ(shm->huge_page_backing(), HugePageBacking::kNone);
  EXPECT_EQ(shm->size(), size_t{3} << 20);
  EXPECT_FALSE(OnHugetlbfs(shm->fd()));
}

// kAuto takes what the machine offers (CI: neither hugetlb pages nor shmem THP, so a plain
// memfd), and the memfd is what CreateMemfd promises either way: zeroed, writable, sealed.
TEST(HostShmTest, MemfdAskingForHugePagesGetsWhatTheMachineOffers) {
  const size_t size = (size_t{3} << 20) + 100;
  const HugePageBacking expected = ExpectedAutoBacking(size);
  auto shm = HostShm::CreateMemfd("auto", size, false, HugePages::kAuto);
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  EXPECT_EQ(shm->huge_page_backing(), expected)
      << "got " << HugePageBackingName(shm->huge_page_backing()) << ", expected "
      << HugePageBackingName(expected) << " (shmem_enabled " << machine::ShmemThpSetting() << ", "
      << machine::HugetlbAvailableBytes() << " hugetlb bytes available)";
  EXPECT_EQ(OnHugetlbfs(shm->fd()), shm->huge_page_backing() == HugePageBacking::kHugetlb);
  EXPECT_GE(shm->size(), size);
  auto* bytes = static_cast<uint8_t*>(shm->data());
  for (size_t i = 0; i < size; i += 4096) ASSERT_EQ(bytes[i], 0) << i;
  bytes[size - 1] = 7;
  EXPECT_TRUE(::fcntl(shm->fd(), F_GET_SEALS) & F_SEAL_SHRINK);
  EXPECT_NE(::ftruncate(shm->fd(), 0), 0) << "a sealed memfd was shrunk";
}

// Asked for more than the hugetlb pool holds (CI: it holds nothing), kAuto falls back to a plain
// memfd, and kRequire fails, naming both reasons, unless shmem THP is there.
TEST(HostShmTest, MemfdFallsBackWhenTheHugetlbPoolCannotHoldIt) {
  const size_t size =
      machine::HugetlbAvailableBytes() + 2 * std::max<uint64_t>(machine::HugePageBytes(), 4096);
  auto shm = HostShm::CreateMemfd("fallback", size, false, HugePages::kAuto);
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  EXPECT_NE(shm->huge_page_backing(), HugePageBacking::kHugetlb);
  EXPECT_EQ(shm->huge_page_backing(), machine::ShmemThpHonoursAdvice()
                                          ? HugePageBacking::kTransparent
                                          : HugePageBacking::kNone);
  EXPECT_EQ(shm->size(), size);
  EXPECT_FALSE(OnHugetlbfs(shm->fd()));
  static_cast<uint8_t*>(shm->data())[0] = 1;

  auto required = HostShm::CreateMemfd("required", size, false, HugePages::kRequire);
  if (machine::ShmemThpHonoursAdvice()) {
    ASSERT_TRUE(required.ok()) << required.status().ToString();
    EXPECT_EQ(required->huge_page_backing(), HugePageBacking::kTransparent);
  } else {
    EXPECT_EQ(required.status().code(), StatusCode::kFailedPrecondition);
    const std::string& m = required.status().message();
    EXPECT_NE(m.find("huge_pages=require"), std::string::npos) << m;
    EXPECT_NE(m.find("hugetlb: "), std::string::npos) << m;
    EXPECT_NE(m.find("shmem_enabled is '" + machine::ShmemThpSetting() + "'"), std::string::npos)
        << m;
  }
  // A named KV pool cannot promise huge pages: its mount decides.
  Geometry g;
  g.num_layers = 1;
  g.num_kv_heads = 1;
  g.head_dim = 64;
  EXPECT_EQ(
      HostKvPool::Create(g, KvLayout::kSglang, 16, 16, {}, HugePages::kRequire).status().code(),
      StatusCode::kInvalidArgument);
}

// Needs free hugetlb pages (skipped on CI): the size rounded up to whole huge pages, on
// hugetlbfs, sealed against shrinking, zeroed and writable through the whole rounded size.
TEST(HostShmTest, HugetlbMemfdIsRoundedAndSealed) {
  const uint64_t page = machine::HugePageBytes();
  if (page == 0 || machine::HugetlbAvailableBytes() < 2 * page) {
    GTEST_SKIP() << "no free hugetlb pages (vm.nr_hugepages is "
                 << machine::MeminfoField("HugePages_Total") << "): reserve some to run this";
  }
  const size_t size = page + 4096;
  auto shm = HostShm::CreateMemfd("hugetlb", size, false, HugePages::kRequire);
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  EXPECT_EQ(shm->huge_page_backing(), HugePageBacking::kHugetlb);
  EXPECT_EQ(shm->size(), 2 * page);
  EXPECT_TRUE(OnHugetlbfs(shm->fd()));
  struct stat st;
  ASSERT_EQ(::fstat(shm->fd(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 2 * page);
  auto* bytes = static_cast<uint8_t*>(shm->data());
  EXPECT_EQ(bytes[0], 0);
  bytes[2 * page - 1] = 9;
  EXPECT_TRUE(::fcntl(shm->fd(), F_GET_SEALS) & F_SEAL_SHRINK);
  EXPECT_NE(::ftruncate(shm->fd(), 0), 0) << "a sealed hugetlb memfd was shrunk";
  HostShm moved = std::move(shm).value();
  EXPECT_EQ(moved.huge_page_backing(), HugePageBacking::kHugetlb);
}

TEST(HostShmTest, BadArguments) {
  EXPECT_EQ(HostShm::Create(HostShm::UniqueName("zero"), 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(HostShm::NormalizeName("abc"), "/abc");
  EXPECT_EQ(HostShm::NormalizeName("/abc"), "/abc");
  EXPECT_NE(HostShm::UniqueName("x"), HostShm::UniqueName("x"));
}

TEST(HostEventPoolTest, ReadStoreAndLayout) {
  auto events = HostEventPool::Create(8);
  ASSERT_TRUE(events.ok()) << events.status().ToString();
  EXPECT_EQ(events->count(), 8u);
  EXPECT_EQ(events->Read(3), 0u);
  events->Store(3, 0x0102030405060708ull);
  EXPECT_EQ(events->Read(3), 0x0102030405060708ull);
  // Slot i is a little-endian uint64 at byte 64*i of the shm object.
  auto raw = HostShm::Open(events->name(), 8 * 64);
  ASSERT_TRUE(raw.ok());
  const auto* bytes = static_cast<const uint8_t*>(raw->data());
  EXPECT_EQ(bytes[3 * 64], 0x08);
  EXPECT_EQ(bytes[3 * 64 + 7], 0x01);
  const EventPoolSpec spec = events->Spec();
  EXPECT_EQ(spec.host_shm_name, events->name());
  EXPECT_EQ(spec.count, 8u);
  events->Reset();
  EXPECT_EQ(events->Read(3), 0u);
}

TEST(HostEventPoolTest, WaitReturnsWhenAnotherThreadStoresTheTicket) {
  auto events = HostEventPool::Create(4);
  ASSERT_TRUE(events.ok());
  // Signalled through a second mapping, as the daemon would.
  auto other = HostEventPool::Open(events->name(), 4);
  ASSERT_TRUE(other.ok());
  std::thread signaller([&] {
    std::this_thread::sleep_for(milliseconds(20));
    other->Store(2, 6);  // lower than the ticket: must not release the waiter
    std::this_thread::sleep_for(milliseconds(20));
    other->Store(2, 7);
  });
  const auto start = std::chrono::steady_clock::now();
  // A missed wake-up would wait out the timeout, 5 times the margin.
  Status s = events->Wait(2, 7, test_time::Margin(milliseconds(10000)));
  const auto waited = std::chrono::steady_clock::now() - start;
  signaller.join();
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(waited, milliseconds(35));
  EXPECT_LT(waited, test_time::Margin(milliseconds(2000)));
  // A later ticket already covered returns at once.
  EXPECT_TRUE(events->Wait(2, 5, milliseconds(0)).ok());
}

TEST(HostEventPoolTest, WaitTimesOut) {
  auto events = HostEventPool::Create(2);
  ASSERT_TRUE(events.ok());
  events->Store(0, 3);
  const auto start = std::chrono::steady_clock::now();
  Status s = events->Wait(0, 4, milliseconds(50));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_GE(waited, milliseconds(50));
  EXPECT_LT(waited, test_time::Margin(milliseconds(1000)));
  EXPECT_EQ(events->Wait(2, 1, milliseconds(1)).code(), StatusCode::kInvalidArgument);
}

TEST(HostEventPoolTest, OpenChecksSize) {
  auto events = HostEventPool::Create(2);
  ASSERT_TRUE(events.ok());
  EXPECT_EQ(HostEventPool::Open(events->name(), 3).status().code(),
            StatusCode::kFailedPrecondition);
}

Geometry SmallGeometry() {
  Geometry g;
  g.num_layers = 3;
  g.num_kv_heads = 2;
  g.head_dim = 8;
  return g;
}

class HostKvPoolTest : public testing::TestWithParam<KvLayout> {};

TEST_P(HostKvPoolTest, HeadsAreDistinctAndInsideTheBuffer) {
  const Geometry g = SmallGeometry();
  auto pool = HostKvPool::Create(g, GetParam(), 40, 16);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const uint32_t rows = pool->num_rows();
  EXPECT_EQ(rows, GetParam() == KvLayout::kSglang ? 40u : 48u);
  EXPECT_EQ(pool->shm().size(), uint64_t{rows} * g.BytesPerToken());
  ASSERT_EQ(pool->layers().size(), 3u);
  // Every (layer, plane, row, head) gets its own head_dim elements: stamp then check.
  auto* base = static_cast<uint8_t*>(pool->shm().data());
  uint32_t stamp = 0;
  for (uint32_t l = 0; l < 3; ++l) {
    for (uint32_t p = 0; p < 2; ++p) {
      for (uint32_t r = 0; r < rows; ++r) {
        for (uint32_t h = 0; h < 2; ++h) {
          uint16_t* head = pool->Head(l, p, r, h);
          const auto* v = p == 0 ? &pool->layers()[l].k : &*pool->layers()[l].v;
          ASSERT_EQ(reinterpret_cast<uint8_t*>(head) - base,
                    static_cast<ptrdiff_t>(v->HeadOffset(r, h, g.HeadBytes())));
          ASSERT_LE(v->EndOffset(2, g.HeadBytes()), pool->shm().size());
          for (uint32_t d = 0; d < 8; ++d) head[d] = static_cast<uint16_t>(stamp + d);
          stamp += 8;
        }
      }
    }
  }
  stamp = 0;
  for (uint32_t l = 0; l < 3; ++l) {
    for (uint32_t p = 0; p < 2; ++p) {
      for (uint32_t r = 0; r < rows; ++r) {
        for (uint32_t h = 0; h < 2; ++h) {
          const uint16_t* head = pool->Head(l, p, r, h);
          for (uint32_t d = 0; d < 8; ++d) {
            ASSERT_EQ(head[d], static_cast<uint16_t>(stamp + d)) << l << p << r << h << d;
          }
          stamp += 8;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, HostKvPoolTest,
                         testing::Values(KvLayout::kSglang, KvLayout::kVllmPaged,
                                         KvLayout::kVllmPackedKv),
                         [](const auto& info) { return std::string(KvLayoutName(info.param)); });

TEST(HostKvPoolSpecTest, AddToRebasesBuffers) {
  const Geometry g = SmallGeometry();
  auto kv = HostKvPool::Create(g, KvLayout::kSglang, 64);
  ASSERT_TRUE(kv.ok());
  auto events = HostEventPool::Create(8);
  ASSERT_TRUE(events.ok());
  PoolSpec spec = MakeHostPoolSpec("m@r1", *kv, 16, &*events);
  EXPECT_EQ(spec.model, "m@r1");
  EXPECT_EQ(spec.block_tokens, 16u);
  EXPECT_EQ(spec.device, DeviceKind::kHost);
  ASSERT_EQ(spec.buffers.size(), 1u);
  EXPECT_EQ(spec.buffers[0].host_shm_name, kv->shm().name());
  EXPECT_EQ(spec.buffers[0].size_bytes, kv->shm().size());
  EXPECT_EQ(spec.events.host_shm_name, events->name());
  EXPECT_EQ(spec.events.count, 8u);
  EXPECT_EQ(spec.layers.size(), 3u);
  kv->AddTo(&spec);  // a second buffer set: views point at buffer 1
  ASSERT_EQ(spec.buffers.size(), 2u);
  EXPECT_EQ(spec.layers[3].k.buffer, 1u);
  EXPECT_EQ(spec.layers[3].v->buffer, 1u);
  EXPECT_EQ(spec.layers[0].k.buffer, 0u);
}

// "memfd:<tag>" pools and events reach the spec by fd, never by name.
TEST(HostKvPoolSpecTest, MemfdPoolsAndEventsGoByFd) {
  auto kv = HostKvPool::Create(SmallGeometry(), KvLayout::kVllmPaged, 64, 16, "memfd:kv");
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  auto events = HostEventPool::Create(8, "memfd:ev");
  ASSERT_TRUE(events.ok()) << events.status().ToString();
  ASSERT_TRUE(kv->shm().is_memfd());
  ASSERT_TRUE(events->shm().is_memfd());
  PoolSpec spec = MakeHostPoolSpec("m", *kv, 16, &*events);
  ASSERT_EQ(spec.buffers.size(), 1u);
  EXPECT_TRUE(spec.buffers[0].host_shm_name.empty());
  EXPECT_EQ(spec.buffers[0].host_fd, kv->shm().fd());
  EXPECT_EQ(spec.buffers[0].size_bytes, kv->shm().size());
  EXPECT_TRUE(spec.events.host_shm_name.empty());
  EXPECT_EQ(spec.events.host_fd, events->shm().fd());
  EXPECT_EQ(spec.events.count, 8u);
  events->Store(3, 42);
  EXPECT_EQ(events->Read(3), 42u);
  // Named objects have no fd in the spec.
  auto named = HostKvPool::Create(SmallGeometry(), KvLayout::kSglang, 16);
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(MakeHostPoolSpec("m", *named, 16).buffers[0].host_fd, -1);
}

TEST(HostKvPoolSpecTest, RejectsBadArguments) {
  Geometry g = SmallGeometry();
  EXPECT_FALSE(HostKvPool::Create(g, KvLayout::kSglang, 0).ok());
  EXPECT_FALSE(HostKvPool::Create(g, KvLayout::kVllmPaged, 16, 0).ok());
  g.attention = Attention::kMLA;
  EXPECT_FALSE(HostKvPool::Create(g, KvLayout::kVllmPackedKv, 16).ok());
  auto mla = HostKvPool::Create(g, KvLayout::kSglang, 16);
  ASSERT_TRUE(mla.ok());
  EXPECT_FALSE(mla->layers()[0].v.has_value());
  EXPECT_EQ(mla->shm().size(), 16u * g.BytesPerToken());
}

}  // namespace
}  // namespace hiqcache
