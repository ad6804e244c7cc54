// ClientMemoryGuard: a memfd mapped and registered as a client's would be, then truncated under
// the mapping. Reads and writes of the lost pages must not kill the process: the range reads as
// zeros and is marked broken. SIGBUS outside every registered range keeps its old meaning (the
// default action kills, a previous handler is called), checked in death tests.
#include "backends/client_memory_guard.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace hiqcache::server {
namespace {

// A memfd of `bytes` bytes mapped shared, as a client's KV object is mapped by the daemon.
class Memfd {
 public:
  explicit Memfd(size_t bytes) : bytes_(bytes) {
    fd_ = ::memfd_create("hiq-guard-test", MFD_CLOEXEC);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p != MAP_FAILED) data_ = static_cast<uint8_t*>(p);
  }
  ~Memfd() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    if (fd_ >= 0) ::close(fd_);
  }
  uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }
  bool Truncate(size_t bytes) { return ::ftruncate(fd_, static_cast<off_t>(bytes)) == 0; }

 private:
  int fd_ = -1;
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

// Reads every byte through a volatile pointer (the compiler must do the loads); returns the sum.
uint64_t SumBytes(const uint8_t* p, size_t n) {
  const volatile uint8_t* v = p;
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) sum += v[i];
  return sum;
}

constexpr size_t kPage = 4096;

class ClientMemoryGuardTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(ClientMemoryGuard::Install().ok()); }
};

TEST_F(ClientMemoryGuardTest, InstallIsIdempotent) {
  EXPECT_TRUE(ClientMemoryGuard::Install().ok());
  EXPECT_TRUE(ClientMemoryGuard::Installed());
}

TEST_F(ClientMemoryGuardTest, TruncatedMappingReadsZeroesAndIsBroken) {
  Memfd m(4 * kPage);
  ASSERT_NE(m.data(), nullptr);
  std::memset(m.data(), 0x5A, m.size());
  auto g = GuardedRange::Register(m.data(), m.size());
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(SumBytes(m.data(), m.size()), 0x5Au * m.size());
  EXPECT_FALSE(g->broken());  // no fault yet

  const uint64_t faults = ClientMemoryGuard::RecoveredFaults();
  ASSERT_TRUE(m.Truncate(0));
  EXPECT_EQ(SumBytes(m.data(), m.size()), 0u);  // would be SIGBUS without the guard
  EXPECT_TRUE(g->broken());
  EXPECT_EQ(ClientMemoryGuard::RecoveredFaults(), faults + 1);
  // Writes land in the daemon's private zero pages now, and stay readable.
  std::memset(m.data(), 0x11, m.size());
  EXPECT_EQ(SumBytes(m.data(), m.size()), 0x11u * m.size());
  EXPECT_EQ(ClientMemoryGuard::RecoveredFaults(), faults + 1);  // no second fault
}

TEST_F(ClientMemoryGuardTest, PartlyTruncatedMappingIsReplacedWhole) {
  Memfd m(4 * kPage);
  ASSERT_NE(m.data(), nullptr);
  std::memset(m.data(), 0x5A, m.size());
  auto g = GuardedRange::Register(m.data(), m.size());
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(m.Truncate(2 * kPage));
  EXPECT_EQ(SumBytes(m.data(), 2 * kPage), 0x5Au * 2 * kPage);  // still backed
  EXPECT_FALSE(g->broken());
  m.data()[3 * kPage] = 7;  // a write past the end: SIGBUS without the guard
  EXPECT_TRUE(g->broken());
  // The whole range is private now: nothing the daemon writes reaches the client's object.
  EXPECT_EQ(SumBytes(m.data(), 2 * kPage), 0u);
  EXPECT_EQ(m.data()[3 * kPage], 7);
}

TEST_F(ClientMemoryGuardTest, OtherRangesStayIntact) {
  Memfd a(2 * kPage), b(2 * kPage);
  ASSERT_NE(a.data(), nullptr);
  ASSERT_NE(b.data(), nullptr);
  std::memset(b.data(), 0x33, b.size());
  auto ga = GuardedRange::Register(a.data(), a.size());
  auto gb = GuardedRange::Register(b.data(), b.size());
  ASSERT_TRUE(ga.ok());
  ASSERT_TRUE(gb.ok());
  ASSERT_TRUE(a.Truncate(0));
  EXPECT_EQ(SumBytes(a.data(), a.size()), 0u);
  EXPECT_TRUE(ga->broken());
  EXPECT_FALSE(gb->broken());
  EXPECT_EQ(SumBytes(b.data(), b.size()), 0x33u * b.size());
}

TEST_F(ClientMemoryGuardTest, ConcurrentFaultsOnOneRange) {
  Memfd m(64 * kPage);
  ASSERT_NE(m.data(), nullptr);
  auto g = GuardedRange::Register(m.data(), m.size());
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(m.Truncate(0));
  std::vector<std::thread> threads;
  std::atomic<uint64_t> sum{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      // Each thread starts on other pages: several fault at once.
      const size_t first = (t * 8) * kPage;
      sum += SumBytes(m.data() + first, m.size() - first);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(sum.load(), 0u);
  EXPECT_TRUE(g->broken());
}

TEST_F(ClientMemoryGuardTest, UnregisteredRangeIsNoLongerGuarded) {
  Memfd m(kPage);
  ASSERT_NE(m.data(), nullptr);
  auto g = GuardedRange::Register(m.data(), m.size());
  ASSERT_TRUE(g.ok());
  GuardedRange moved = std::move(*g);
  EXPECT_FALSE(g->registered());
  EXPECT_TRUE(moved.registered());
  moved.Reset();
  EXPECT_FALSE(moved.registered());
  EXPECT_FALSE(moved.broken());
  ASSERT_TRUE(m.Truncate(0));
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // Dies by SIGBUS (or by the sanitizer's report, whose handler came before the guard's).
  EXPECT_DEATH(SumBytes(m.data(), m.size()), "");
}

TEST_F(ClientMemoryGuardTest, RegistryIsBounded) {
  Memfd m(kPage);
  ASSERT_NE(m.data(), nullptr);
  std::vector<GuardedRange> held;
  Status full;
  for (size_t i = 0; i <= kMaxGuardedRanges; ++i) {
    auto g = GuardedRange::Register(m.data(), m.size());
    if (!g.ok()) {
      full = g.status();
      break;
    }
    held.push_back(std::move(*g));
  }
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full.ToString();
  EXPECT_LE(held.size(), kMaxGuardedRanges);
  EXPECT_GT(held.size(), kMaxGuardedRanges / 2);  // other tests hold a few at most
  held.clear();
  auto again = GuardedRange::Register(m.data(), m.size());
  EXPECT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_FALSE(GuardedRange::Register(nullptr, 1).ok());
  EXPECT_FALSE(GuardedRange::Register(m.data(), 0).ok());
}

void PreviousHandler(int, siginfo_t*, void*) { _exit(42); }

// In a process where `PreviousHandler` was installed before the guard: a guarded fault is
// recovered (exit code 3 if not), a foreign one reaches PreviousHandler (exit code 42).
void FaultsWithAPreviousHandler() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = PreviousHandler;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
  if (!ClientMemoryGuard::Install().ok()) _exit(1);
  Memfd guarded(kPage), foreign(kPage);
  auto g = GuardedRange::Register(guarded.data(), guarded.size());
  if (!g.ok()) _exit(2);
  guarded.Truncate(0);
  if (SumBytes(guarded.data(), guarded.size()) != 0 || !g->broken()) _exit(3);
  foreign.Truncate(0);
  SumBytes(foreign.data(), foreign.size());  // not ours: PreviousHandler exits 42
  _exit(4);
}

// A fault outside every range goes to the handler installed before the guard. Runs in a fresh
// process (the "threadsafe" death test re-executes this test alone), where the guard is
// installed only after that handler.
TEST(ClientMemoryGuardChainTest, ForeignFaultGoesToThePreviousHandler) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(FaultsWithAPreviousHandler(), ::testing::ExitedWithCode(42), "");
}

}  // namespace
}  // namespace hiqcache::server
