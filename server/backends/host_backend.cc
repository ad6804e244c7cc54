#include "backends/host_backend.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <string>
#include <utility>

#include "backends/residency.h"
#include "codec_job.h"
#include "core/fault_budget.h"
#include "core/registration.h"
#include "hiqcache/log.h"
#include "hiqcache/mutex.h"
#include "hiqcache/xxh3.h"

namespace hiqcache::server {

namespace {

std::string Errno(int err) { return std::strerror(err); }

// The checks shared by names and fds, on the open `fd` of `what` ("shared memory '/x'", "the
// fd"). Owner: names of authenticated callers only (an fd is proof of access in itself).
Status CheckObject(int fd, uint64_t bytes, const std::string& field, const std::string& what,
                   const ClientObjectRules& rules, bool check_owner) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return InvalidArgument(field + ": cannot stat " + what + ": " + Errno(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument(field + ": " + what +
                           " is not a shared-memory object (a memfd or a file in /dev/shm)");
  }
  if (rules.has_pool_object && st.st_dev == rules.pool_dev && st.st_ino == rules.pool_ino) {
    return PermissionDenied(field + ": " + what + " is hiqcached's own pool, not client memory");
  }
  if (check_owner && rules.caller != nullptr && rules.caller->authenticated() &&
      st.st_uid != rules.caller->uid) {
    return PermissionDenied(field + ": " + what + " belongs to uid " + std::to_string(st.st_uid) +
                            ", not to the caller (uid " + std::to_string(rules.caller->uid) +
                            "): pass its fd over the session instead");
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    return InvalidArgument(field + ": " + what + " holds " + std::to_string(st.st_size) +
                           " bytes, " + std::to_string(bytes) + " registered");
  }
  return Status::Ok();
}

// Whether shmem_enabled lets a shmem mapping advised MADV_HUGEPAGE fault in 2 MiB pages.
bool ShmemThpHonoursAdvice() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string word;
  while (in >> word) {
    if (word == "[advise]" || word == "[within_size]" || word == "[always]" || word == "[force]") {
      return true;
    }
  }
  return false;
}

// Descriptors of shmem objects that mappings keep (ShmMapping::SetKeptDescriptors): the budget,
// and how many are kept now.
std::atomic<uint64_t> kept_descriptor_budget{0};
std::atomic<uint64_t> kept_descriptors{0};

// A descriptor of `fd`'s object for a mapping to keep, within the budget; -1 beyond it.
int KeepDescriptor(int fd) {
  const uint64_t budget = kept_descriptor_budget.load(std::memory_order_relaxed);
  if (kept_descriptors.fetch_add(1, std::memory_order_relaxed) >= budget) {
    kept_descriptors.fetch_sub(1, std::memory_order_relaxed);
    return -1;
  }
  const int kept = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (kept < 0) kept_descriptors.fetch_sub(1, std::memory_order_relaxed);
  return kept;
}

// Bytes of a hugetlbfs object's size whose pages are not allocated (hugetlbfs counts a page's
// blocks in st_blocks from the fault that allocates it to the truncate or hole punch that frees
// it).
uint64_t UnallocatedHugetlbBytes(const struct stat& st) {
  const uint64_t size = static_cast<uint64_t>(std::max<off_t>(st.st_size, 0));
  const uint64_t allocated = static_cast<uint64_t>(std::max<blkcnt_t>(st.st_blocks, 0)) * 512;
  return allocated >= size ? 0 : size - allocated;
}

// FAILED_PRECONDITION for a hugetlbfs object with `holes` bytes of pages not allocated:
// touching them would make the daemon allocate hugetlb pages (a node-wide pool, charged to the
// daemon's cgroup) on the client's behalf, which it never does.
Status HugetlbHolesError(const std::string& what, uint64_t holes, const struct stat& st,
                         const std::string& before) {
  return FailedPrecondition(
      what + " has " + std::to_string(holes) + " of its " + std::to_string(st.st_size) +
      " bytes in pages that are not allocated; the daemon does not allocate hugetlb pages on a "
      "client's behalf: write every page of the object (or map it with MAP_POPULATE) before " +
      before);
}

bool SealedAgainstShrinking(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
}

}  // namespace

StatusOr<std::unique_ptr<ShmMapping>> ShmMapping::Open(const std::string& name, uint64_t bytes,
                                                       const std::string& field,
                                                       const ClientObjectRules& rules,
                                                       Holds holds) {
  std::string path = name.empty() || name[0] != '/' ? "/" + name : name;
  const std::string what = "shared memory '" + path + "'";
  int fd = ::shm_open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    return InvalidArgument(field + ": cannot open " + what + ": " + Errno(errno));
  }
  Status st = CheckObject(fd, bytes, field, what, rules, /*check_owner=*/true);
  StatusOr<std::unique_ptr<ShmMapping>> out =
      st.ok() ? Map(fd, bytes, field, what, SealedAgainstShrinking(fd), holds)
              : StatusOr<std::unique_ptr<ShmMapping>>(st);
  ::close(fd);
  return out;
}

StatusOr<std::unique_ptr<ShmMapping>> ShmMapping::FromFd(int fd, uint64_t bytes,
                                                         const std::string& field,
                                                         const ClientObjectRules& rules,
                                                         Holds holds) {
  const std::string what = "the fd";
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) {
    return InvalidArgument(field + ": " + what + " is not open: " + Errno(errno));
  }
  if ((flags & O_ACCMODE) != O_RDWR) {
    return PermissionDenied(field + ": " + what +
                            " is not open for reading and writing (O_RDWR): the daemon writes "
                            "restored KV and event slots into it");
  }
  HIQ_RETURN_IF_ERROR(CheckObject(fd, bytes, field, what, rules, /*check_owner=*/false));
  return Map(fd, bytes, field, what, SealedAgainstShrinking(fd), holds);
}

StatusOr<std::unique_ptr<ShmMapping>> ShmMapping::Map(int fd, uint64_t bytes,
                                                      const std::string& field,
                                                      const std::string& what, bool sealed,
                                                      Holds holds) {
  // A hugetlbfs object (a memfd made with MFD_HUGETLB) is mapped and unmapped in whole huge pages
  // (its st_blksize); its size is always a whole number of them.
  uint64_t mapped = bytes;
  struct statfs fs;
  const bool hugetlb = ::fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC;
  if (hugetlb) {
    struct stat st;
    if (::fstat(fd, &st) != 0 || st.st_blksize <= 0) {
      return InvalidArgument(field + ": cannot stat " + what + ": " + Errno(errno));
    }
    const uint64_t page = static_cast<uint64_t>(st.st_blksize);
    mapped = (bytes + page - 1) / page * page;
    if (static_cast<uint64_t>(st.st_size) < mapped) {
      return InvalidArgument(
          field + ": " + what + " (hugetlbfs, pages of " + std::to_string(page) + " bytes) holds " +
          std::to_string(st.st_size) + " bytes, less than the " + std::to_string(mapped) +
          " whole pages that " + std::to_string(bytes) + " registered bytes span");
    }
    const uint64_t holes = UnallocatedHugetlbBytes(st);
    if (holes > 0) {
      return HugetlbHolesError(field + ": " + what + " (hugetlbfs)", holes, st, "registering it");
    }
  }
  // MAP_NORESERVE on hugetlbfs: the daemon's mapping reserves nothing in the hugetlb pool (every
  // page is allocated already, checked above and before each task: CheckHugetlbPages).
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (hugetlb ? MAP_NORESERVE : 0), fd, 0);
  if (p == MAP_FAILED) {
    return InvalidArgument(field + ": cannot map " + what + ": " + Errno(errno));
  }
  int hugetlb_fd = -1;
  if (hugetlb) {
    hugetlb_fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (hugetlb_fd < 0) {
      const int err = errno;
      ::munmap(p, mapped);
      return ResourceExhausted(field + ": cannot keep " + what + " open: " + Errno(err));
    }
  }
  // Shmem: transparent huge pages for the pages this mapping faults in, where the kernel's
  // shmem_enabled honours the advice (fewer TLB misses in the codec); ignored elsewhere.
  const bool thp_faults =
      !hugetlb && ::madvise(p, mapped, MADV_HUGEPAGE) == 0 && ShmemThpHonoursAdvice();
  // Shmem sealed against growing: a descriptor for FullyAllocated, within the daemon's budget for
  // them (an object that may grow can hold pages beyond its size that st_blocks counts too).
  const int seals = ::fcntl(fd, F_GET_SEALS);
  const bool grow_sealed = seals >= 0 && (seals & F_SEAL_GROW) != 0;
  const int shmem_fd = hugetlb || !grow_sealed || holds != Holds::kKv ? -1 : KeepDescriptor(fd);
  auto release_shmem_fd = [shmem_fd] {
    if (shmem_fd < 0) return;
    ::close(shmem_fd);
    kept_descriptors.fetch_sub(1, std::memory_order_relaxed);
  };
  // Registered before anything reads it (TicketFloor reads event slots at once).
  auto guard = GuardedRange::Register(p, mapped);
  if (!guard.ok()) {
    ::munmap(p, mapped);
    release_shmem_fd();
    if (hugetlb_fd >= 0) ::close(hugetlb_fd);
    return Status(guard.status().code(), field + ": " + guard.status().message());
  }
  // Where the object holds data: SEEK_DATA/SEEK_HOLE (tmpfs and memfds answer them); on any
  // error, all of it. Only when asked (event objects, at most 64 MiB): a KV buffer of many
  // alternating holes would cost a range each.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  const bool find_data_ranges = holds == Holds::kEventSlots;
  if (!find_data_ranges) ranges = {{0, bytes}};
  for (off_t at = 0; find_data_ranges && static_cast<uint64_t>(at) < bytes;) {
    const off_t data = ::lseek(fd, at, SEEK_DATA);
    if (data < 0) {
      if (errno != ENXIO) ranges = {{0, bytes}};  // ENXIO: no data from `at` on
      break;
    }
    if (static_cast<uint64_t>(data) >= bytes) break;
    off_t hole = ::lseek(fd, data, SEEK_HOLE);
    if (hole < 0) {
      ranges = {{0, bytes}};
      break;
    }
    const uint64_t end = std::min<uint64_t>(static_cast<uint64_t>(hole), bytes);
    ranges.emplace_back(static_cast<uint64_t>(data), end);
    at = static_cast<off_t>(end);
  }
  return std::unique_ptr<ShmMapping>(new ShmMapping(static_cast<uint8_t*>(p), bytes, mapped, sealed,
                                                    hugetlb_fd, shmem_fd, thp_faults,
                                                    std::move(guard).value(), std::move(ranges)));
}

ShmMapping::~ShmMapping() {
  guard_.Reset();  // before the range can be reused by another mapping
  if (data_ != nullptr && ::munmap(data_, mapped_) != 0) {
    HIQ_LOG(WARN) << "munmap failed: " << std::strerror(errno);
  }
  if (hugetlb_fd_ >= 0) ::close(hugetlb_fd_);
  if (shmem_fd_ >= 0) {
    ::close(shmem_fd_);
    kept_descriptors.fetch_sub(1, std::memory_order_relaxed);
  }
}

// A folio is aligned to its size, so one that holds the object's last page ends at the latest at
// the object's size rounded up to this.
uint64_t ShmMapping::ShmemLargestFolioBytes() {
  static const uint64_t bytes = [] {
    uint64_t n = 0;
    std::ifstream in("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    if (!(in >> n) || n == 0) {
      // No THP in this kernel: shmem allocates single pages.
      return std::ifstream("/sys/kernel/mm/transparent_hugepage").good()
                 ? uint64_t{0}
                 : ResidencyProbe::PageBytes();
    }
    return std::max<uint64_t>(n, ResidencyProbe::PageBytes());
  }();
  return bytes;
}

bool ShmMapping::FullyAllocated() const {
  if (shmem_fd_ < 0) return false;
  struct stat st;
  if (::fstat(shmem_fd_, &st) != 0 || st.st_size < 0 || st.st_blocks < 0) return false;
  // Sealed against growing, the object can hold no page beyond its size but the tail of a folio
  // that holds its last page (fallocate past the end and write past it are refused). So st_blocks
  // reaches the size rounded up to the largest folio only when no page before it is missing.
  const uint64_t unit = ShmemLargestFolioBytes();
  if (unit == 0) return false;
  const uint64_t size = (static_cast<uint64_t>(st.st_size) + unit - 1) / unit * unit;
  return static_cast<uint64_t>(st.st_blocks) * 512 >= size;
}

void ShmMapping::SetKeptDescriptors(uint64_t n) {
  kept_descriptor_budget.store(n, std::memory_order_relaxed);
}

bool ShmMapping::NoSwapActive() {
  struct sysinfo info;
  return ::sysinfo(&info) == 0 && info.totalswap == 0;
}

Status ShmMapping::CheckHugetlbPages(const std::string& field) const {
  if (hugetlb_fd_ < 0) return Status::Ok();
  struct stat st;
  if (::fstat(hugetlb_fd_, &st) != 0) {
    return FailedPrecondition(field +
                              ": cannot stat the client's hugetlbfs object: " + Errno(errno));
  }
  const uint64_t holes = UnallocatedHugetlbBytes(st);
  if (holes == 0) return Status::Ok();
  return HugetlbHolesError(field + ": the client's hugetlbfs object", holes, st,
                           "lending it again (hole-punched since RegisterPool?)");
}

namespace {

// XXH3-64 of each block's payload of an EncodeJob, computed while the codec's threads encode it:
// a block's layers are hashed in layer order (streaming XXH3, the same digest as hashing the
// whole payload at once) by whichever thread finishes a layer that continues the block's hashed
// prefix, while the other threads go on encoding. So the hash runs on every codec thread and
// reads each layer while it is still in cache; a pass over the payloads after the encode would
// read them back from memory, one block per thread (a one-block sub-task: on one thread while
// the others wait). Thread-safe for LayerEncoded; Digest once Encode has returned. Throws
// std::bad_alloc when a hash state cannot be allocated (the task then fails alone).
class LayerHasher {
 public:
  LayerHasher(const kernels::BlockLayout& layout, const std::vector<uint8_t*>& payloads)
      : layers_(layout.num_layers),
        layer_bytes_(layout.LayerBytes()),
        payloads_(payloads),
        blocks_(payloads.size()),
        done_(new std::atomic<uint8_t>[payloads.size() * layout.num_layers]) {
    for (size_t i = 0; i < payloads.size() * layers_; ++i) done_[i].store(0);
    for (Block& b : blocks_) {
      if (b.state == nullptr) throw std::bad_alloc();
      XXH3_64bits_reset(b.state.get());
    }
  }

  // The EncodeJob::layer_encoded hook.
  static void LayerEncoded(void* self, uint32_t block, uint32_t layer) {
    static_cast<LayerHasher*>(self)->Done(block, layer);
  }

  // REQUIRES: every layer of `block` reported (Encode returned).
  uint64_t Digest(size_t block) const { return XXH3_64bits_digest(blocks_[block].state.get()); }

 private:
  struct StateDeleter {
    void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
  };
  struct Block {
    std::unique_ptr<XXH3_state_t, StateDeleter> state{XXH3_createState()};
    std::atomic<bool> busy{false};  // a thread is hashing this block's layers
    std::atomic<uint32_t> next{0};  // layers hashed so far (written by the busy thread only)
  };

  // Marks the layer encoded, then hashes what continues the block's hashed prefix unless another
  // thread is at it. The seq_cst marks and flag form a Dekker handshake: a thread that finds the
  // block busy has marked its layer before the busy thread releases the flag and looks again, so
  // no encoded layer is left unhashed, and Encode returns only after every hook call returned.
  void Done(uint32_t block, uint32_t layer) {
    Block& b = blocks_[block];
    std::atomic<uint8_t>* done = &done_[size_t{block} * layers_];
    done[layer].store(1);
    for (;;) {
      if (b.busy.exchange(true)) return;
      uint32_t n = b.next.load(std::memory_order_relaxed);
      for (; n < layers_ && done[n].load(); ++n) {
        XXH3_64bits_update(b.state.get(), payloads_[block] + size_t{n} * layer_bytes_,
                           layer_bytes_);
      }
      b.next.store(n, std::memory_order_relaxed);
      b.busy.store(false);
      if (n >= layers_ || !done[n].load()) return;
    }
  }

  const uint32_t layers_;
  const size_t layer_bytes_;
  const std::vector<uint8_t*>& payloads_;
  std::vector<Block> blocks_;
  std::unique_ptr<std::atomic<uint8_t>[]> done_;  // [block][layer]: encoded
};

// Bytes of a client's map-ahead allowance (FaultBudget::TakeMapAhead) taken for one Bind, given
// back when it goes out of scope unless Release()d to the binding. No budget: the bytes asked.
class MapAheadHold {
 public:
  MapAheadHold(const std::shared_ptr<FaultBudget>& budget, uint64_t want)
      : budget_(budget.get()), bytes_(budget_ != nullptr ? budget_->TakeMapAhead(want) : want) {}
  ~MapAheadHold() { GiveBack(bytes_); }
  MapAheadHold(const MapAheadHold&) = delete;
  MapAheadHold& operator=(const MapAheadHold&) = delete;
  uint64_t bytes() const { return bytes_; }
  // Gives back `n` of the bytes held (REQUIRES: n <= bytes()).
  void GiveBack(uint64_t n) {
    if (budget_ != nullptr && n > 0) budget_->GiveBackMapAhead(n);
    bytes_ -= n;
  }
  // The bytes still held, for the binding to give back; this hold gives back nothing more.
  uint64_t Release() { return std::exchange(bytes_, 0); }

 private:
  FaultBudget* budget_;
  uint64_t bytes_;
};

class HostBinding : public PoolBinding {
 public:
  // `names[i]` names buffers[i] in errors ("buffers[3]").
  HostBinding(kernels::CpuCodec* codec, std::chrono::milliseconds wait_timeout,
              kernels::BlockLayout layout, std::vector<std::unique_ptr<ShmMapping>> buffers,
              std::unique_ptr<TicketSlots> slots, std::vector<kernels::LayerViews> views,
              uint32_t num_rows, std::shared_ptr<FaultBudget> budget, uint64_t map_ahead)
      : codec_(codec),
        wait_timeout_(wait_timeout),
        layout_(layout),
        buffers_(std::move(buffers)),
        slots_(std::move(slots)),
        event_count_(slots_->count()),
        views_(std::move(views)),
        num_rows_(num_rows),
        budget_(std::move(budget)),
        map_ahead_(map_ahead) {
    std::vector<ResidencyProbe::Mapping> mappings;
    auto add = [&](const ShmMapping* m) {
      if (m == nullptr || (!m->hugetlb() && !m->thp_faults())) return;
      const auto base = reinterpret_cast<uintptr_t>(m->data());
      const uint64_t page = ResidencyProbe::PageBytes();  // the kernel maps whole pages
      mappings.push_back(
          {base, base + (m->mapped_bytes() + page - 1) / page * page,
           m->hugetlb() ? ResidencyProbe::Faults::kNone : ResidencyProbe::Faults::kHugeExtent});
    };
    for (const auto& b : buffers_) add(b.get());
    add(slots_->mapping());
    probe_.SetMappings(std::move(mappings));
  }

  // The pages this pool faulted in on the client's account, and its map-ahead allowance, go
  // with the pool.
  ~HostBinding() override {
    if (budget_ == nullptr) return;
    budget_->Refund(charged_.load(std::memory_order_relaxed));
    budget_->GiveBackMapAhead(map_ahead_);
  }

  uint32_t event_count() const override { return event_count_; }
  uint32_t num_rows() const override { return num_rows_; }
  uint64_t TicketFloor() const override { return slots_->floor(); }
  uint64_t FaultedBytes() const override { return charged_.load(std::memory_order_relaxed); }

  StartResult StartBackup(const std::shared_ptr<BackupTask>& task) override {
    std::optional<Status> wait = Settle(*task);
    if (!wait) return StartResult::kNotReady;
    Status st = RunBackup(*task, *wait);
    task->on_complete(st);
    return StartResult::kCompleted;
  }

  StartResult StartRestore(const std::shared_ptr<RestoreTask>& task) override {
    std::optional<Status> wait = Settle(*task);
    if (!wait) return StartResult::kNotReady;
    Status st = RunRestore(*task, *wait);
    task->on_complete(st);
    return StartResult::kCompleted;
  }

  void Cancel() override { cancelled_.store(true, std::memory_order_release); }

  Status Failure() const override {
    if (!failed_.load(std::memory_order_acquire)) return Status::Ok();
    MutexLock lock(&failure_mu_);
    return failure_;
  }

  // event_count_ stays: a request racing the release may still validate against it.
  void Close() override {
    buffers_.clear();
    slots_->Close();
  }

 private:
  // Where a task stands before it runs, without blocking: the pool's failure if its memory
  // broke (now or before), DEADLINE_EXCEEDED if its caller gave up, else the state of its wait
  // (TicketSlots::CheckWait: nullopt while waiting; stamps its first try).
  template <typename Task>
  std::optional<Status> Settle(Task& task) {
    HIQ_RETURN_IF_ERROR(CheckMemory());
    HIQ_RETURN_IF_ERROR(CheckCallerDeadline(task.caller_deadline, task.ticket));
    if (task.first_try == std::chrono::steady_clock::time_point{}) {
      // Before the wait reads an event slot: a hugetlb page is never faulted in for a client.
      HIQ_RETURN_IF_ERROR(CheckHugetlbPages());
      task.first_try = std::chrono::steady_clock::now();
    }
    std::optional<Status> wait =
        slots_->CheckWait(task.wait_event, task.wait_value, task.first_try, wait_timeout_,
                          cancelled_.load(std::memory_order_acquire));
    if (!wait) return std::nullopt;
    // Reading the wait slot may have found the event object truncated.
    HIQ_RETURN_IF_ERROR(CheckMemory());
    return *wait;
  }

  // REQUIRES: the wait settled.
  Status RunBackup(BackupTask& task, Status st) {
    std::vector<uint8_t> nonfinite(task.payloads.size(), 0);
    if (st.ok()) st = ChargeRows(task.rows, "backup");
    if (st.ok()) {
      kernels::EncodeJob job;
      job.layout = layout_;
      job.layers = views_.data();
      job.rows = task.rows.data();
      job.blocks = task.payloads.data();
      job.num_blocks = static_cast<uint32_t>(task.payloads.size());
      job.nonfinite = nonfinite.data();
      // Block checksums for the pool headers, hashed as the layers are encoded.
      LayerHasher hasher(layout_, task.payloads);
      job.layer_encoded = &LayerHasher::LayerEncoded;
      job.layer_encoded_context = &hasher;
      codec_->Encode(job);
      // Zeros read from a truncated buffer are no KV: nothing of this task is committed.
      st = CheckMemory();
      if (st.ok()) {
        task.checksums.assign(task.payloads.size(), 0);
        for (size_t b = 0; b < task.payloads.size(); ++b) {
          if (!nonfinite[b]) task.checksums[b] = hasher.Digest(b);
        }
      }
    }
    task.on_written(nonfinite, st);
    SignalValue(task.done_event, task.ticket, !st.ok());
    // The blocks are committed (their bytes were read in full), but the engine cannot learn it.
    Status signalled = CheckMemory();
    return st.ok() ? signalled : st;
  }

  Status RunRestore(RestoreTask& task, Status st) {
    const uint32_t first = std::min(task.first_layer, layout_.num_layers);
    const uint32_t end = task.end_layer == 0
                             ? layout_.num_layers
                             : std::clamp(task.end_layer, first, layout_.num_layers);
    uint32_t signalled = first;  // layers before it got the ticket without the failure bit
    if (st.ok()) st = ChargeRows(task.rows, "restore", first, end);
    if (st.ok()) {
      kernels::DecodeJob job;
      job.layout = layout_;
      job.layers = views_.data();
      job.rows = task.rows.data();
      job.blocks = task.payloads.data();
      job.num_blocks = static_cast<uint32_t>(task.payloads.size());
      if (task.layer_event_base < 0 && first == 0 && end == layout_.num_layers) {
        // Every layer and no layer events to signal (a block-major sub-task that is not the
        // last): all layers in one loop of the codec's threads, not one loop (and one hand-off)
        // per layer.
        codec_->Decode(job);
        st = CheckMemory();
      } else {
        for (uint32_t l = first; l < end; ++l) {
          codec_->DecodeLayer(job, l);
          // A truncated buffer took this layer's writes: neither it nor the next are restored.
          st = CheckMemory();
          if (!st.ok()) break;
          if (task.layer_event_base >= 0) {
            Signal(task.layer_event_base + static_cast<int32_t>(l), task.ticket);
            signalled = l + 1;
          }
        }
      }
    }
    if (!st.ok() && task.layer_event_base >= 0) {
      // Nothing (more) was written: release the waiters (an engine never stalls on us), but with
      // the failure bit, so that they do not take the rows for restored KV.
      for (uint32_t l = signalled; l < layout_.num_layers; ++l) {
        SignalValue(task.layer_event_base + static_cast<int32_t>(l), task.ticket, true);
      }
    }
    task.layers_signalled = signalled;
    SignalValue(task.done_event, task.ticket, !st.ok());
    Status done = CheckMemory();
    return st.ok() ? done : st;
  }

  void Signal(int32_t event, uint64_t ticket) { SignalValue(event, ticket, false); }
  void SignalValue(int32_t event, uint64_t ticket, bool failed) {
    if (event < 0 || static_cast<uint32_t>(event) >= event_count_ || slots_->data() == nullptr)
      return;
    // A slot in a page the client never touched (or punched out) has no engine waiting on it:
    // an engine that waits reads its slot, which brings the page in on the engine's account.
    if (budget_ != nullptr) {
      const uint64_t missing = probe_.RangeNotResident(slots_->slot(event), sizeof(uint64_t));
      if (missing > 0 && !budget_->TryCharge(missing)) {
        Refused("events: slot " + std::to_string(event) + " lies in a page that is not in memory",
                missing);
        return;
      }
      charged_.fetch_add(missing, std::memory_order_relaxed);
    }
    slots_->Store(event, ticket, failed);
  }

  // Charges the bytes of the pages `rows` touch in layers [first_layer, end_layer) (end_layer 0:
  // every layer) that are not in memory (the daemon's access would fault them in on its own
  // account) to the client's budget; RESOURCE_EXHAUSTED, with nothing charged, when they do not
  // fit.
  Status ChargeRows(const std::vector<uint32_t>& rows, const char* what, uint32_t first_layer = 0,
                    uint32_t end_layer = 0) {
    HIQ_RETURN_IF_ERROR(CheckHugetlbPages());
    if (budget_ == nullptr || rows.empty() || NothingMissing()) return Status::Ok();
    // Only the layers the task touches: a layer-major restore's sub-tasks share their rows.
    kernels::BlockLayout touched = layout_;
    if (end_layer != 0) touched.num_layers = end_layer - first_layer;
    const uint64_t missing =
        probe_.RowsNotResident(touched, views_.data() + first_layer, rows.data(), rows.size());
    if (missing == 0) return Status::Ok();
    if (budget_->TryCharge(missing)) {
      charged_.fetch_add(missing, std::memory_order_relaxed);
      return Status::Ok();
    }
    const std::string why = "buffers: " + std::to_string(missing) + " bytes of the rows this " +
                            what + " touches are not in memory";
    Refused(why, missing);
    return ResourceExhausted(
        why +
        " (never written, hole-punched or swapped out); faulting them in would charge the "
        "daemon with memory the client lent but never touched, and this client already "
        "had " +
        std::to_string(budget_->charged()) + " of " + std::to_string(budget_->limit()) +
        " bytes faulted on its behalf (quota max_faulted_bytes_per_client): write the memory "
        "before lending it");
  }

  // FAILED_PRECONDITION naming the buffer (or "events") when a hugetlbfs object of the pool has
  // pages that are not allocated now (hole-punched since Bind, which refused any): touching them
  // would allocate hugetlb pages on the daemon's account. The task then touches nothing; a page
  // the client punches after this check is faulted in, one page per race it wins. An fstat per
  // hugetlbfs object of the pool.
  Status CheckHugetlbPages() const {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (!buffers_[i]->hugetlb()) continue;
      HIQ_RETURN_IF_ERROR(buffers_[i]->CheckHugetlbPages("buffers[" + std::to_string(i) + "]"));
    }
    const ShmMapping* events = slots_->mapping();
    return events == nullptr ? Status::Ok() : events->CheckHugetlbPages("events");
  }

  // Whether no page of the client's buffers can be missing now: no swap space is active and every
  // shmem object is allocated in full (ShmMapping::FullyAllocated; hugetlbfs objects are checked
  // by CheckHugetlbPages). One fstat per buffer instead of the probe's mincore per layer and
  // plane of every block (about 1 us a call: 72 per Qwen3-8B block, bench/README.md).
  bool NothingMissing() const {
    if (buffers_.empty()) return false;
    for (const auto& b : buffers_) {
      if (!b->hugetlb() && !b->FullyAllocated()) return false;
    }
    return ShmMapping::NoSwapActive();
  }

  // Logs a refusal of the fault budget, once per binding (a client that keeps trying would
  // flood the log otherwise).
  void Refused(const std::string& why, uint64_t bytes) {
    if (refusal_logged_.exchange(true, std::memory_order_relaxed)) return;
    HIQ_LOG(WARN) << "event=fault_budget_exhausted bytes=" << bytes
                  << " charged=" << budget_->charged() << " limit=" << budget_->limit()
                  << " reason=\"" << why << "\" (logged once per pool)";
  }

  // OK unless a mapping of this pool broke (a SIGBUS guarded by ClientMemoryGuard), now or
  // before: the binding is then failed for good, and this returns its FAILED_PRECONDITION. Cheap
  // while no client mapping of the whole daemon broke since the last look (one atomic load).
  // Called by the task on the worker (Start* are serialized).
  Status CheckMemory() {
    if (failed_.load(std::memory_order_acquire)) return Failure();
    const uint64_t faults = ClientMemoryGuard::RecoveredFaults();
    if (faults == checked_faults_) return Status::Ok();
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i]->broken()) return Fail("buffers[" + std::to_string(i) + "]");
    }
    if (slots_->broken()) return Fail("events");
    checked_faults_ = faults;
    return Status::Ok();
  }

  Status Fail(const std::string& field) {
    MutexLock lock(&failure_mu_);
    if (!failed_.load(std::memory_order_relaxed)) {
      failure_ = FailedPrecondition(
          field +
          ": the client's shared memory shrank under the daemon (truncated after "
          "RegisterPool); this pool's memory is gone: release it and register again");
      failed_.store(true, std::memory_order_release);
      HIQ_LOG(WARN) << "event=host_pool_failed error=\"" << failure_.message() << "\"";
    }
    return failure_;
  }

  kernels::CpuCodec* codec_;
  std::chrono::milliseconds wait_timeout_;
  kernels::BlockLayout layout_;
  std::vector<std::unique_ptr<ShmMapping>> buffers_;
  std::unique_ptr<TicketSlots> slots_;
  uint32_t event_count_;
  std::vector<kernels::LayerViews> views_;
  uint32_t num_rows_;
  std::shared_ptr<FaultBudget> budget_;  // null: nothing is counted (no quota)
  ResidencyProbe probe_;                 // used by Start* only (serialized)
  std::atomic<uint64_t> charged_{0};     // bytes this pool charged to budget_
  const uint64_t map_ahead_;             // bytes of budget_'s map-ahead allowance Bind used
  std::atomic<bool> refusal_logged_{false};
  std::atomic<bool> cancelled_{false};
  uint64_t checked_faults_ = 0;  // RecoveredFaults() when CheckMemory last found nothing broken
  std::atomic<bool> failed_{false};
  mutable Mutex failure_mu_;
  Status failure_ GUARDED_BY(failure_mu_);
};

}  // namespace

HostBackend::HostBackend(kernels::CpuCodec* codec, std::chrono::milliseconds wait_timeout)
    : codec_(codec), wait_timeout_(wait_timeout) {
  Status guard = ClientMemoryGuard::Install();
  if (!guard.ok()) {
    HIQ_LOG(ERROR) << "event=sigbus_guard_missing error=\"" << guard.message() << "\"";
  }
}

void HostBackend::SetPoolObject(dev_t dev, ino_t ino) {
  pool_dev_.store(dev);
  pool_ino_.store(ino);
  has_pool_object_.store(true, std::memory_order_release);
}

Status HostBackend::SetPoolObject(const std::string& shm_name) {
  const std::string path = shm_name.empty() || shm_name[0] != '/' ? "/" + shm_name : shm_name;
  int fd = ::shm_open(path.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) {
    return FailedPrecondition("shm_name: cannot open the pool '" + path + "': " + Errno(errno));
  }
  struct stat st;
  const int rc = ::fstat(fd, &st);
  const int err = errno;
  ::close(fd);
  if (rc != 0) {
    return FailedPrecondition("shm_name: cannot stat the pool '" + path + "': " + Errno(err));
  }
  SetPoolObject(st.st_dev, st.st_ino);
  return Status::Ok();
}

ClientObjectRules HostBackend::RulesFor(const Caller* caller) const {
  ClientObjectRules rules;
  rules.caller = caller;
  if (has_pool_object_.load(std::memory_order_acquire)) {
    rules.has_pool_object = true;
    rules.pool_dev = static_cast<dev_t>(pool_dev_.load());
    rules.pool_ino = static_cast<ino_t>(pool_ino_.load());
  }
  return rules;
}

StatusOr<std::unique_ptr<PoolBinding>> HostBackend::Bind(const RegisterSpec& spec,
                                                         const kernels::BlockLayout& layout,
                                                         std::shared_ptr<FaultBudget> budget) {
  const ClientObjectRules rules = RulesFor(&spec.caller);
  // The engine's KV pages a restore writes are in memory already (the client libraries write
  // what they lend); mapping them now spares the first restore into them a page fault per
  // page. Pages not in memory stay unmapped, for the fault budget to charge when touched. At
  // most FaultBudget::kDefaultMapAheadBytes of a pool's buffers are looked at (mincore walks
  // every page, and a client may lend terabytes of holes), and at most the client's map-ahead
  // allowance across its pools (FaultBudget::TakeMapAhead; given back with the pool); beyond,
  // pages fault in as tasks touch them.
  uint64_t want = 0;
  for (const BufferSpec& b : spec.buffers) {
    want = std::min(FaultBudget::kDefaultMapAheadBytes,
                    want + std::min(b.size_bytes, FaultBudget::kDefaultMapAheadBytes));
  }
  MapAheadHold map_ahead(budget, want);
  uint64_t map_left = map_ahead.bytes();
  std::vector<std::unique_ptr<ShmMapping>> buffers;
  std::vector<uint8_t*> bases;
  for (size_t i = 0; i < spec.buffers.size(); ++i) {
    const BufferSpec& b = spec.buffers[i];
    const std::string f = "buffers[" + std::to_string(i) + "]";
    std::unique_ptr<ShmMapping> m;
    if (b.has_host_fd) {
      if (b.fd < 0) {
        return InvalidArgument(f + ".host_fd_id: " + std::to_string(b.host_fd_id) +
                               " names no fd passed on this caller's session");
      }
      HIQ_ASSIGN_OR_RETURN(m, ShmMapping::FromFd(b.fd, b.size_bytes, f + ".host_fd_id", rules));
    } else if (b.has_host_shm_name) {
      HIQ_ASSIGN_OR_RETURN(
          m, ShmMapping::Open(b.host_shm_name, b.size_bytes, f + ".host_shm_name", rules));
    } else {
      return InvalidArgument(f +
                             ": a HOST pool needs host_fd_id or host_shm_name, not "
                             "cuda_ipc_handle");
    }
    if (!m->hugetlb()) {  // mincore sees only the daemon's own page tables there: nothing to map
      const uint64_t look = std::min(map_left, m->size());
      ResidencyProbe::MapResident(m->data(), look);
      map_left -= look;
    }
    bases.push_back(m->data());
    buffers.push_back(std::move(m));
  }
  HIQ_ASSIGN_OR_RETURN(std::unique_ptr<TicketSlots> slots, TicketSlots::Open(spec.events, rules));
  if (!ClientMemoryGuard::Installed()) {
    HIQ_LOG(WARN) << "event=host_bind_unguarded (no SIGBUS guard: a client that truncates its "
                     "shared memory can kill hiqcached)";
  }
  std::vector<kernels::LayerViews> views = ResolveViews(spec, layout, bases);
  uint32_t rows = MinRows(spec);
  map_ahead.GiveBack(map_left);  // what no buffer used
  return std::unique_ptr<PoolBinding>(
      new HostBinding(codec_, wait_timeout_, layout, std::move(buffers), std::move(slots),
                      std::move(views), rows, std::move(budget), map_ahead.Release()));
}

}  // namespace hiqcache::server
