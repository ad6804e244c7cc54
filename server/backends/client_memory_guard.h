// ClientMemoryGuard: keeps a client that shrinks a shared-memory object it lent the daemon (a
// HOST KV buffer or event object, truncated after registration) from killing the daemon with
// SIGBUS, the way Wayland compositors protect themselves from clients that shrink their wl_shm
// pools (libwayland's wl_shm_buffer_begin_access, wlroots, weston).
//
// Every client mapping is registered here (GuardedRange) for as long as it is mapped. The
// process-wide SIGBUS handler (Install) looks the faulting address up in a fixed-size, lock-free
// registry; when it falls in a registered range, it maps anonymous zero pages over the whole
// range (MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, same address and length: no
// memory commit, so any range the daemon could map can be replaced; where strict overcommit
// refuses that, a 2 MiB window around the fault, and each later fault its own), marks the range
// broken and returns: the faulting access is retried on the zero pages and succeeds, and every
// later access of that range touches memory private to the daemon. Any other SIGBUS goes to the
// handler that was installed before (ASan's, when it handles SIGBUS), or gets the default action
// (the process dies with SIGBUS, as without the guard).
//
// The code that touched client memory then checks its ranges' broken() flags: the data it read
// or wrote there is meaningless (zeros, or lost), so the operation fails and the owner stops
// using the mapping. A sealed memfd (F_SEAL_SHRINK) cannot shrink, but is guarded all the same.
//
// Thread-safety: everything here is thread-safe. The handler is async-signal-safe (atomics and
// mmap only) and runs on the faulting thread; a range's broken flag is set before the faulting
// access resumes, so a thread that joins the faulting one (e.g. the codec's ParallelFor) sees it.
// REQUIRES of callers: a GuardedRange is destroyed before its range is unmapped.
#pragma once

#include <cstddef>
#include <cstdint>

#include "hiqcache/status.h"

namespace hiqcache::server {

// At most this many ranges are registered at once (the kernel's default vm.max_map_count is
// 65,530 mappings for the whole process, so more could not be mapped anyway).
inline constexpr size_t kMaxGuardedRanges = size_t{1} << 16;

class ClientMemoryGuard {
 public:
  // Installs the SIGBUS handler, once per process; later calls only report the first outcome.
  // The handler that was installed before is kept and called for faults outside every range.
  static Status Install();
  static bool Installed();
  // Faults the handler recovered from since start (each remapped one range): a cheap test of
  // "did any client mapping break since I last looked".
  static uint64_t RecoveredFaults();
};

// One client mapping registered with the guard; unregistered on destruction or Reset(). Move-only.
class GuardedRange {
 public:
  // Registers [base, base + bytes). RESOURCE_EXHAUSTED when kMaxGuardedRanges are registered;
  // INVALID_ARGUMENT for an empty range. The range should be a whole mapping of its own: the
  // handler replaces all of it.
  static StatusOr<GuardedRange> Register(void* base, size_t bytes);

  GuardedRange() = default;
  GuardedRange(GuardedRange&& other) noexcept;
  GuardedRange& operator=(GuardedRange&& other) noexcept;
  GuardedRange(const GuardedRange&) = delete;
  GuardedRange& operator=(const GuardedRange&) = delete;
  ~GuardedRange() { Reset(); }

  // Unregisters. Idempotent.
  void Reset();
  bool registered() const { return slot_ >= 0; }
  // Whether a SIGBUS in the range replaced it with zero pages (it stays broken). False when
  // not registered.
  bool broken() const;

 private:
  explicit GuardedRange(int32_t slot) : slot_(slot) {}
  int32_t slot_ = -1;
};

}  // namespace hiqcache::server
