// HOST-backend helpers: POSIX shared memory that an engine (or a test, or the demo) shares with
// hiqcached when KV lives in CPU memory (docs/design.md "HOST").
//
//   HostShm        RAII shm object: create (unlinked again on destruction), open, or a memfd
//                  (sealed against shrinking; reaches the daemon only by fd over a session;
//                  on huge pages where asked and the machine offers them), mapped.
//   HostEventPool  event slots (slot i = little-endian uint64 at byte 64*i); the daemon stores
//                  ticket T with release order when work T completes; Wait() blocks until a
//                  slot holds a value >= T.
//   HostKvPool     an SGLang- or vLLM-style KV buffer set in one shm object, plus its views.
//
// Thread-safety: the classes are move-only handles. Concurrent const calls are safe; Read, Wait
// and Store on HostEventPool are safe from any thread (atomic accesses to the shared slots).
// Callers synchronise their own writes to KV data.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "hiqcache/layouts.h"
#include "hiqcache/pool_spec.h"
#include "hiqcache/status.h"

namespace hiqcache {

// Whether a memfd asks for huge pages. The daemon's codec walks client rows of a few KiB each, so
// on 4 KiB pages it spends much of its time in TLB walks; 2 MiB pages remove most of them.
enum class HugePages : uint8_t {
  kOff = 0,      // a plain memfd
  kAuto = 1,     // MFD_HUGETLB when the hugetlb pool holds the object, else a plain memfd advised
                 // MADV_HUGEPAGE (shmem THP), else a plain memfd
  kRequire = 2,  // as kAuto, but FAILED_PRECONDITION when neither hugetlb nor shmem THP is there
};
// "off", "auto", "require".
const char* HugePagesName(HugePages mode);
// The inverse of HugePagesName; INVALID_ARGUMENT naming `field` for anything else.
StatusOr<HugePages> ParseHugePages(std::string_view text, std::string_view field = "huge_pages");

// What backs a memfd's pages.
enum class HugePageBacking : uint8_t {
  kNone = 0,         // 4 KiB pages
  kTransparent = 1,  // advised MADV_HUGEPAGE, and the kernel's shmem_enabled honours it (advise,
                     // within_size, always, force): 2 MiB pages where the kernel can find them
  kHugetlb = 2,      // MFD_HUGETLB: reserved pages of the hugetlb pool, size rounded up to them
};
// "none", "thp", "hugetlb".
const char* HugePageBackingName(HugePageBacking backing);

class HostShm {
 public:
  // Creates a new shm object of `size` bytes (shm_open O_CREAT|O_EXCL, mode 0600, ftruncate,
  // mmap), zero-filled. The object is unlinked when this handle is destroyed. `name` may omit the
  // leading "/". ALREADY_EXISTS when the name is taken.
  static StatusOr<HostShm> Create(std::string_view name, size_t size);
  // Opens and maps an existing object (its whole size). FAILED_PRECONDITION when it is smaller
  // than `min_size`. Never unlinks.
  static StatusOr<HostShm> Open(std::string_view name, size_t min_size = 0);
  // A new zero-filled memfd of `size` bytes (MFD_CLOEXEC), sealed with F_SEAL_SHRINK so that
  // nobody holding its fd can shrink it under the daemon's mapping, and with F_SEAL_GROW too when
  // `fixed_size`. It has no shm name: name() is "memfd:<tag>" (kMemfdPrefix), for logs; the daemon
  // gets it by fd over the client's session (SharedBuffer::host_fd, which AddTo and Spec fill
  // in). The fd stays open while this handle lives.
  //
  // `huge_pages` (HugePages): kAuto and kRequire try MFD_HUGETLB first, its size rounded up to a
  // whole number of huge pages (size() reports the rounded size), and fall back to a plain memfd
  // when the hugetlb pool cannot reserve it (mmap ENOMEM) or the kernel has none (EINVAL); a plain
  // memfd is then advised MADV_HUGEPAGE. huge_page_backing() says what it got. kRequire fails
  // with FAILED_PRECONDITION (both reasons in the message) when it got neither.
  static StatusOr<HostShm> CreateMemfd(std::string_view tag, size_t size, bool fixed_size = false,
                                       HugePages huge_pages = HugePages::kOff);
  static constexpr std::string_view kMemfdPrefix = "memfd:";
  // "/hiq-<pid>-<n>-<tag>": unique within this process and unlikely to collide across processes.
  static std::string UniqueName(std::string_view tag);
  // Adds the leading "/" when missing.
  static std::string NormalizeName(std::string_view name);

  HostShm() = default;
  HostShm(HostShm&& other) noexcept;
  HostShm& operator=(HostShm&& other) noexcept;
  HostShm(const HostShm&) = delete;
  HostShm& operator=(const HostShm&) = delete;
  ~HostShm();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }  // normalized, with leading "/"
  bool owner() const { return owner_; }              // created here: unlinked on destruction
  bool valid() const { return data_ != nullptr; }
  // The memfd (CreateMemfd), owned by this handle; -1 for named objects, which are opened by
  // name when they are passed.
  int fd() const { return fd_; }
  bool is_memfd() const { return fd_ >= 0; }
  // What backs the pages (CreateMemfd's huge_pages); kNone for named objects.
  HugePageBacking huge_page_backing() const { return backing_; }

 private:
  // One CreateMemfd attempt: MFD_HUGETLB when `hugetlb`, else a plain memfd.
  static StatusOr<HostShm> MapMemfd(std::string_view tag, size_t size, bool fixed_size,
                                    bool hugetlb);
  void Reset();

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  int fd_ = -1;  // memfd only
  HugePageBacking backing_ = HugePageBacking::kNone;
};

class HostEventPool {
 public:
  static constexpr size_t kSlotBytes = 64;

  // Creates `count` zeroed slots in a new shm object (name empty = HostShm::UniqueName("ev");
  // "memfd:<tag>" = a sealed memfd, HostShm::CreateMemfd).
  static StatusOr<HostEventPool> Create(uint32_t count, std::string_view name = {});
  // Opens an existing event object of at least `count` slots.
  static StatusOr<HostEventPool> Open(std::string_view name, uint32_t count);

  uint32_t count() const { return count_; }
  const std::string& name() const { return shm_.name(); }
  // The EventPool piece of RegisterPool (host_fd for a memfd, else host_shm_name).
  EventPoolSpec Spec() const;
  const HostShm& shm() const { return shm_; }

  // Acquire load of slot `slot`. REQUIRES: slot < count().
  uint64_t Read(uint32_t slot) const;
  // Release store, e.g. to signal the daemon that a request's wait_event is satisfied.
  void Store(uint32_t slot, uint64_t value) const;
  // Zeroes every slot (release stores).
  void Reset() const;
  // Waits until slot `slot` holds a ticket >= ticket: spins briefly, then sleeps with growing
  // backoff (up to 1 ms). OK; ABORTED when that value carries kEventFailedBit; DEADLINE_EXCEEDED
  // after `timeout`; INVALID_ARGUMENT for a bad slot.
  Status Wait(uint32_t slot, uint64_t ticket, std::chrono::nanoseconds timeout) const;

 private:
  HostShm shm_;
  uint32_t count_ = 0;
};

// Bit 63 of a slot: the work of the ticket in bits 0..62 failed and wrote nothing (the daemon's
// value), or the daemon died with work up to that ticket outstanding (the client library's value,
// client.h). A Wait() for any ticket up to the ticket part then returns ABORTED: the caller must
// treat its rows as a miss.
constexpr uint64_t kEventFailedBit = 1ull << 63;

// Waits until the 64-bit slot at `slot` holds a value >= ticket (the algorithm of
// HostEventPool::Wait), for slots mapped by other means. `slot` must be 8-byte aligned.
Status WaitForTicket(const uint64_t* slot, uint64_t ticket, std::chrono::nanoseconds timeout);

enum class KvLayout : uint8_t {
  kSglang = 0,        // per layer: K [rows, heads, dim], then V [rows, heads, dim]
  kVllmPaged = 1,     // per layer: [2, blocks, page_rows, heads, dim] (K pages, then V pages)
  kVllmPackedKv = 2,  // per layer: [blocks, heads, page_rows, 2*dim] (K|V packed)
};
const char* KvLayoutName(KvLayout layout);

// An engine-style KV buffer set for all layers, in one shm object.
class HostKvPool {
 public:
  // `num_rows` token slots; paged layouts use pages of `page_rows` rows and round num_rows up to
  // a whole number of pages. MLA geometry is supported by kSglang only. `name` empty = a unique
  // shm name; "memfd:<tag>" = a memfd sealed against shrinking and growing (HostShm::CreateMemfd,
  // fixed_size) on huge pages as `huge_pages` asks. Named objects live in /dev/shm, whose mount
  // decides their pages (huge=): kRequire with a name is INVALID_ARGUMENT, kAuto is kOff there.
  static StatusOr<HostKvPool> Create(const Geometry& geometry, KvLayout layout, uint32_t num_rows,
                                     uint32_t page_rows = 16, std::string_view name = {},
                                     HugePages huge_pages = HugePages::kAuto);

  const Geometry& geometry() const { return geometry_; }
  KvLayout layout() const { return layout_; }
  uint32_t num_rows() const { return num_rows_; }
  const HostShm& shm() const { return shm_; }
  // Views of all layers; buffer index 0 is this pool's shm object.
  const std::vector<LayerView>& layers() const { return layers_; }

  // Appends this pool's buffer (host_fd for a memfd, else host_shm_name) to spec->buffers and its
  // layer views (buffer index rebased) to spec->layers; sets spec->geometry and spec->device =
  // kHost. The spec borrows a memfd's fd: keep this pool alive while the spec is registered.
  void AddTo(PoolSpec* spec) const;

  // head_dim elements of (layer, plane 0 = K / 1 = V, row, head), as raw BF16/FP16 bits.
  // REQUIRES: indices in range.
  uint16_t* Head(uint32_t layer, uint32_t plane, uint32_t row, uint32_t head) const;

 private:
  HostShm shm_;
  Geometry geometry_;
  KvLayout layout_ = KvLayout::kSglang;
  uint32_t num_rows_ = 0;
  std::vector<LayerView> layers_;
};

// A HOST PoolSpec for `kv` (and `events`, when not null), ready for Client::RegisterPool.
PoolSpec MakeHostPoolSpec(std::string model, const HostKvPool& kv, uint32_t block_tokens,
                          const HostEventPool* events = nullptr, Codec codec = Codec::kInt8PerHead);

}  // namespace hiqcache
