#include "backends/client_memory_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>

namespace hiqcache::server {
namespace {

// What the handler replaces around a fault when the whole range cannot be (see OnSigbus).
constexpr uintptr_t kRecoveryWindow = uintptr_t{2} << 20;

// A registry slot. `state` is generation << 2 | phase; the generation grows on every release,
// so that the handler, which reads base and bytes between two loads of state, can tell a
// consistent entry from one being reused under it (a seqlock without retries: a torn entry is
// skipped, and a range being registered or released is not the one faulting).
enum Phase : uint64_t { kFree = 0, kWriting = 1, kActive = 2 };

struct Slot {
  std::atomic<uint64_t> state{0};
  std::atomic<uintptr_t> base{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint32_t> broken{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the handler needs lock-free atomics");
static_assert(std::atomic<uintptr_t>::is_always_lock_free, "the handler needs lock-free atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the handler needs lock-free atomics");

Slot g_slots[kMaxGuardedRanges];
std::atomic<size_t> g_used{0};  // slots [0, g_used) may be active: the handler scans these
std::atomic<size_t> g_hint{0};  // where Register starts looking for a free slot
std::atomic<uint64_t> g_recovered{0};
std::atomic<bool> g_installed{false};
struct sigaction g_previous;  // written once, before the handler is installed

uint64_t PhaseOf(uint64_t state) { return state & 3; }

// The previous handler's turn (a fault that is none of ours).
void Chain(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: uninstall ourselves. A fault the kernel raised repeats when we return and
  // now kills the process (with the core showing the real faulting access); a SIGBUS some
  // process sent is raised again (pending until we return, as SIGBUS is blocked in here).
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
  if (info == nullptr || info->si_code <= 0) ::raise(SIGBUS);
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  // Only faults the kernel raised for an access (si_code > 0) carry an address to look up.
  if (info != nullptr && info->si_code > 0) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
    const size_t used = g_used.load(std::memory_order_acquire);
    for (size_t i = 0; i < used; ++i) {
      Slot& s = g_slots[i];
      const uint64_t before = s.state.load();
      if (PhaseOf(before) != kActive) continue;
      const uintptr_t base = s.base.load();
      const uint64_t bytes = s.bytes.load();
      if (s.state.load() != before) continue;
      if (addr < base || addr - base >= bytes) continue;
      // The client's object shrank under this mapping: private zero pages over all of it. The
      // faulting access resumes on them; the pages of the object that still exist are dropped
      // too, so nothing the daemon writes from now on reaches the client. MAP_NORESERVE: no
      // commit charge, so a range larger than RAM + swap (a sparse 64 GiB memfd) is replaced
      // all the same; only the pages the daemon then writes cost memory.
      constexpr int kFlags = MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
      void* p = ::mmap(reinterpret_cast<void*>(base), bytes, PROT_READ | PROT_WRITE, kFlags, -1, 0);
      if (p == MAP_FAILED) {
        // Strict overcommit (vm.overcommit_memory = 2) ignores MAP_NORESERVE: replace a bounded
        // window around the fault instead; a later fault elsewhere in the range lands here again
        // and replaces its own window.
        const uintptr_t start = std::max(base, (addr & ~(kRecoveryWindow - 1)));
        const uintptr_t end = std::min<uintptr_t>(base + bytes, start + kRecoveryWindow);
        p = ::mmap(reinterpret_cast<void*>(start), end - start, PROT_READ | PROT_WRITE, kFlags, -1,
                   0);
      }
      if (p == MAP_FAILED) break;  // cannot recover (out of memory): as if unguarded
      s.broken.store(1);
      g_recovered.fetch_add(1);
      errno = saved_errno;
      return;
    }
  }
  errno = saved_errno;
  Chain(sig, info, context);
}

Status DoInstall() {
  // Record the previous action first, so that the handler never sees a half-written one.
  if (::sigaction(SIGBUS, nullptr, &g_previous) != 0) {
    return Internal(std::string("sigaction(SIGBUS): ") + std::strerror(errno));
  }
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = OnSigbus;
  sigemptyset(&sa.sa_mask);
  // SA_ONSTACK: a thread with an alternate signal stack (sanitizers set one up) uses it.
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
  if (::sigaction(SIGBUS, &sa, nullptr) != 0) {
    return Internal(std::string("sigaction(SIGBUS): ") + std::strerror(errno));
  }
  // A sanitizer may keep its own handler and ignore ours (ASan with handle_sigbus=2): read back.
  struct sigaction now;
  std::memset(&now, 0, sizeof(now));
  if (::sigaction(SIGBUS, nullptr, &now) != 0 || (now.sa_flags & SA_SIGINFO) == 0 ||
      now.sa_sigaction != OnSigbus) {
    return FailedPrecondition(
        "the SIGBUS handler of the client memory guard did not stay installed (a sanitizer "
        "with handle_sigbus=2?): a client that truncates its shared memory can kill hiqcached");
  }
  g_installed.store(true);
  return Status::Ok();
}

}  // namespace

Status ClientMemoryGuard::Install() {
  static std::once_flag once;
  static Status outcome;
  std::call_once(once, [] { outcome = DoInstall(); });
  return outcome;
}

bool ClientMemoryGuard::Installed() { return g_installed.load(); }

uint64_t ClientMemoryGuard::RecoveredFaults() { return g_recovered.load(); }

StatusOr<GuardedRange> GuardedRange::Register(void* base, size_t bytes) {
  if (base == nullptr || bytes == 0) {
    return InvalidArgument("GuardedRange: empty range");
  }
  const size_t start = g_hint.load(std::memory_order_relaxed);
  for (size_t n = 0; n < kMaxGuardedRanges; ++n) {
    const size_t i = (start + n) % kMaxGuardedRanges;
    Slot& s = g_slots[i];
    uint64_t state = s.state.load();
    if (PhaseOf(state) != kFree) continue;
    if (!s.state.compare_exchange_strong(state, (state & ~uint64_t{3}) | kWriting)) continue;
    s.base.store(reinterpret_cast<uintptr_t>(base));
    s.bytes.store(bytes);
    s.broken.store(0);
    // Publish the slot to the handler's scan before it becomes active.
    size_t used = g_used.load();
    while (used < i + 1 && !g_used.compare_exchange_weak(used, i + 1)) {
    }
    s.state.store((state & ~uint64_t{3}) | kActive);
    g_hint.store((i + 1) % kMaxGuardedRanges, std::memory_order_relaxed);
    return GuardedRange(static_cast<int32_t>(i));
  }
  return ResourceExhausted("client mappings: " + std::to_string(kMaxGuardedRanges) +
                           " are registered with the SIGBUS guard, the most it holds");
}

GuardedRange::GuardedRange(GuardedRange&& other) noexcept : slot_(other.slot_) { other.slot_ = -1; }

GuardedRange& GuardedRange::operator=(GuardedRange&& other) noexcept {
  if (this != &other) {
    Reset();
    slot_ = other.slot_;
    other.slot_ = -1;
  }
  return *this;
}

void GuardedRange::Reset() {
  if (slot_ < 0) return;
  Slot& s = g_slots[slot_];
  const uint64_t state = s.state.load();
  // The next generation, free: a handler that read this entry before sees the state change.
  s.state.store(((state >> 2) + 1) << 2 | kFree);
  slot_ = -1;
}

bool GuardedRange::broken() const {
  return slot_ >= 0 && g_slots[slot_].broken.load(std::memory_order_acquire) != 0;
}

}  // namespace hiqcache::server
