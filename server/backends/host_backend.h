// HostBackend: the HOST device kind. An engine's "device" KV buffers are shared-memory objects
// mapped into the daemon (memfds or shm objects whose fds the engine passed over its session,
// or POSIX shm names), its events are 64-bit counters in another such object (slot i at byte
// 64*i; the daemon stores ticket T there with release order when work T completes), and the
// codec runs on the SIMD CPU executor. Serves CPU-only inference and lets CI run every part of the
// daemon but the CUDA kernels. Thread-safe as DeviceBackend says.
//
// Client memory is the client's: it may shrink it under the daemon (ftruncate after
// RegisterPool). Every mapping is registered with the SIGBUS guard (client_memory_guard.h), so
// an access to a lost page reads or writes private zero pages instead of killing the daemon; the
// task that touched it fails (a backup commits nothing, a restore reports an error, its events
// get the failure bit), and the pool's binding is failed for good: every later task of the pool
// fails with FAILED_PRECONDITION naming the buffer ("buffers[0]: the client's shared memory
// shrank under the daemon ..."). Other pools are not affected.
//
// Which objects are accepted (Bind):
//   - an fd (BufferSpec.has_host_fd, EventsSpec.host_fd_id != 0): open O_RDWR, a regular file
//     (a memfd or a shm object), at least as large as registered. The fd is borrowed: it is
//     mapped, never closed (the mapping keeps the object alive). Whether it is sealed against
//     shrinking (F_SEAL_SHRINK) is recorded; sealed or not, the guard covers it. A hugetlbfs
//     object (MFD_HUGETLB) is mapped in whole huge pages (the registered size rounded up; the
//     object holds them, as hugetlbfs sizes are whole pages), with MAP_NORESERVE, and only
//     while every page of the object is allocated (FAILED_PRECONDITION at Bind, and for a task,
//     when one is not: the daemon never reserves or allocates hugetlb pages, a node-wide pool
//     charged to the cgroup that faults them, on a client's behalf); other objects are advised
//     MADV_HUGEPAGE (transparent huge pages where shmem_enabled honours it). Pages of a
//     hugetlbfs object are never charged to the fault budget: they are all allocated when
//     touched, and are never swapped out. Where
//     shmem_enabled honours the advice, a wholly missing 2 MiB extent of another object is
//     charged whole (the daemon's fault there may allocate a huge page).
//   - a name (host_shm_name): opened O_RDWR | O_NOFOLLOW | O_CLOEXEC with the daemon's rights,
//     a regular file, and, for an authenticated caller, owned by the caller's uid.
//   - never the daemon's own pool object (SetPoolObject): same device and inode, by name or fd.
//
// Event slots and tickets: tickets of a pool start above the largest ticket already in its
// event slots (TicketFloor), so that a client re-registering slots from an earlier daemon never
// sees a slot already past a new ticket. A slot whose ticket part (bits 0..62) is at or above
// kHostTicketLimit (2^62) cannot be continued from: no daemon issues such tickets (one per
// request, from 1), and continuing would run tickets into the failure bit (bit 63). Bind resets
// such slots to 0 and ignores them, so tickets stay far below bit 63 whatever the slots held.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/client_memory_guard.h"
#include "backends/ticket_slots.h"
#include "codec_cpu.h"
#include "core/device_backend.h"

namespace hiqcache::server {

// The slot bits of ticket_slots.h, by their HOST names.
constexpr uint64_t kHostEventFailedBit = kTicketFailedBit;
constexpr uint64_t kHostTicketLimit = kTicketLimit;

class HostBackend : public DeviceBackend {
 public:
  // `codec` must outlive the backend and every binding it returns. Installs the SIGBUS guard
  // (ClientMemoryGuard::Install; once per process).
  HostBackend(kernels::CpuCodec* codec, std::chrono::milliseconds wait_timeout);
  const char* name() const override { return "host"; }
  // Charges `fault_budget` for the pages of client memory a task would fault in (not resident
  // when asked, mincore), before it touches them; refuses the task when they do not fit.
  StatusOr<std::unique_ptr<PoolBinding>> Bind(const RegisterSpec& spec,
                                              const kernels::BlockLayout& layout,
                                              std::shared_ptr<FaultBudget> fault_budget) override;

  // The daemon's own pool object: a buffer or event object with this device and inode is
  // refused (PERMISSION_DENIED naming the field). Call before serving; any thread.
  void SetPoolObject(dev_t dev, ino_t ino);
  // The same, for the pool's POSIX shm name (opened read-only and fstat'ed here).
  Status SetPoolObject(const std::string& shm_name);
  // What a client object of `caller` must be to be mapped (the pool object refused). Any thread.
  ClientObjectRules RulesFor(const Caller* caller) const;

 private:
  kernels::CpuCodec* codec_;
  std::chrono::milliseconds wait_timeout_;
  std::atomic<bool> has_pool_object_{false};
  std::atomic<uint64_t> pool_dev_{0};
  std::atomic<uint64_t> pool_ino_{0};
};

// What a client's object must be to be mapped (ShmMapping). Value type.
struct ClientObjectRules {
  // Names only: when authenticated, the object's owner must be caller->uid. May be null.
  const Caller* caller = nullptr;
  // The daemon's own pool object, refused.
  bool has_pool_object = false;
  dev_t pool_dev = 0;
  ino_t pool_ino = 0;
};

// A client's shared-memory object mapped read-write (its first `bytes` bytes) and registered
// with the SIGBUS guard. `field` names the request field in error messages. Move-only RAII: the
// guard registration ends before the munmap.
class ShmMapping {
 public:
  // What a mapping holds. kKv: a pool's KV buffer (a shmem object sealed against growing keeps a
  // descriptor for FullyAllocated, within SetKeptDescriptors). kEventSlots: an event object,
  // whose data_ranges() are found from the object (else the whole mapping); it keeps none.
  enum class Holds : uint8_t { kKv, kEventSlots };
  // Opens the POSIX shm object `name` ("/" optional) read-write, without following symlinks.
  static StatusOr<std::unique_ptr<ShmMapping>> Open(const std::string& name, uint64_t bytes,
                                                    const std::string& field,
                                                    const ClientObjectRules& rules = {},
                                                    Holds holds = Holds::kKv);
  // Maps the borrowed `fd` (never closed here). REQUIRES: fd >= 0.
  static StatusOr<std::unique_ptr<ShmMapping>> FromFd(int fd, uint64_t bytes,
                                                      const std::string& field,
                                                      const ClientObjectRules& rules = {},
                                                      Holds holds = Holds::kKv);
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  uint8_t* data() const { return data_; }
  // The registered bytes; the mapping spans mapped_bytes() >= size() (whole huge pages of a
  // hugetlbfs object).
  uint64_t size() const { return size_; }
  uint64_t mapped_bytes() const { return mapped_; }
  // The object is on hugetlbfs (a memfd made with MFD_HUGETLB): its pages are the hugetlb pool's
  // and never swapped; it is mapped only while every page of it is allocated (Map, and
  // CheckHugetlbPages before each task), so none is faulted in on the daemon's account (and
  // mincore, which reports only this process's page tables for them, is not asked).
  bool hugetlb() const { return hugetlb_fd_ >= 0; }
  // OK unless the object is on hugetlbfs with pages not allocated now: FAILED_PRECONDITION
  // naming `field` (touching such a page would allocate a hugetlb page on the daemon's account).
  Status CheckHugetlbPages(const std::string& field) const;
  // Not hugetlbfs, advised MADV_HUGEPAGE, and the kernel's shmem_enabled honours that: a fault
  // of this mapping in a wholly missing 2 MiB extent of the object may allocate all of it
  // (ResidencyProbe::Faults::kHugeExtent).
  bool thp_faults() const { return thp_faults_; }
  // Sealed against shrinking (F_SEAL_SHRINK) when mapped: it cannot be truncated.
  bool sealed() const { return sealed_; }
  // A shmem object sealed against growing (F_SEAL_GROW) with every page of its size allocated now
  // (fstat: st_blocks counts a shmem page from the write that allocates it to the hole punch or
  // truncate that frees it, swapped out or not; the size is rounded up to the largest folio,
  // whose tail past the end st_blocks counts too). False when the mapping keeps no descriptor of
  // the object (not sealed so, hugetlbfs, event slots, or beyond SetKeptDescriptors), or the answer
  // is unknown. An object that may grow is never "fully allocated": fallocate(FALLOC_FL_KEEP_SIZE)
  // past its end allocates pages st_blocks counts while holes remain before it. With no swap
  // active (NoSwapActive), a fully allocated object has no page the daemon's access could fault
  // in: the residency probe is not needed.
  bool FullyAllocated() const;
  // How many descriptors of shmem objects mappings may keep open (daemon-wide) for
  // FullyAllocated; a mapping made beyond it keeps none. 0 (the default) keeps none.
  static void SetKeptDescriptors(uint64_t n);
  // Whether the machine has no active swap space (sysinfo), so no shmem page is swapped out.
  static bool NoSwapActive();
  // The largest folio shmem may allocate here (the PMD size of transparent huge pages; the page
  // size without THP); 0 when unknown (then nothing is FullyAllocated).
  static uint64_t ShmemLargestFolioBytes();
  // A SIGBUS replaced the mapping with zero pages: the client's object shrank.
  bool broken() const { return guard_.broken(); }
  // The [begin, end) byte ranges of the mapping that held data when it was mapped (lseek
  // SEEK_DATA / SEEK_HOLE); the rest were holes and read as zeros. Reading a hole of a shmem
  // object allocates a page, charged to the daemon: code that scans client memory it never
  // asked the client to write (event slots at registration) scans these ranges only. The whole
  // mapping where the kernel cannot tell, or when it holds KV (Holds::kKv).
  const std::vector<std::pair<uint64_t, uint64_t>>& data_ranges() const { return data_ranges_; }

 private:
  ShmMapping(uint8_t* data, uint64_t size, uint64_t mapped, bool sealed, int hugetlb_fd,
             int shmem_fd, bool thp_faults, GuardedRange guard,
             std::vector<std::pair<uint64_t, uint64_t>> data_ranges)
      : data_(data),
        size_(size),
        mapped_(mapped),
        sealed_(sealed),
        hugetlb_fd_(hugetlb_fd),
        shmem_fd_(shmem_fd),
        thp_faults_(thp_faults),
        guard_(std::move(guard)),
        data_ranges_(std::move(data_ranges)) {}
  static StatusOr<std::unique_ptr<ShmMapping>> Map(int fd, uint64_t bytes, const std::string& field,
                                                   const std::string& what, bool sealed,
                                                   Holds holds);
  uint8_t* data_;
  uint64_t size_;
  uint64_t mapped_;
  bool sealed_;
  int hugetlb_fd_;  // a hugetlbfs object: the daemon's own fd of it (fstat), closed here; else -1
  int shmem_fd_;    // sealed shmem within SetKeptDescriptors: likewise (FullyAllocated); else -1
  bool thp_faults_;
  GuardedRange guard_;
  std::vector<std::pair<uint64_t, uint64_t>> data_ranges_;
};

}  // namespace hiqcache::server
