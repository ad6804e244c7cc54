#include "pool/pool_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "hiqcache/log.h"

namespace hiqcache::server {

namespace bip = boost::interprocess;

namespace {

// Where glibc's shm_open (and so Boost.Interprocess's POSIX shared_memory_object) keeps objects.
constexpr const char* kShmDir = "/dev/shm";

std::string GiB(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1ull << 30));
  return buf;
}

}  // namespace

Status CheckShmRoom(const std::string& shm_dir, const std::string& bare_name, uint64_t bytes) {
  struct statvfs fs {};
  if (::statvfs(shm_dir.c_str(), &fs) != 0) {
    return FailedPrecondition("shm_name: cannot statvfs " + shm_dir + ": " + std::strerror(errno));
  }
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  const uint64_t fs_bytes = static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize;
  uint64_t held = 0;
  struct stat st {};
  if (::stat((shm_dir + "/" + bare_name).c_str(), &st) == 0) {
    held = static_cast<uint64_t>(st.st_blocks) * 512;  // allocated, not apparent, size
  }
  const uint64_t needed = bytes > held ? bytes - held : 0;
  if (needed <= free_bytes) return Status::Ok();
  std::string msg = "pool_bytes " + std::to_string(bytes) + " (" + GiB(bytes) +
                    ") does not fit in " + shm_dir + ": " + std::to_string(free_bytes) +
                    " bytes (" + GiB(free_bytes) + ") free of " + std::to_string(fs_bytes) + " (" +
                    GiB(fs_bytes) + ")";
  if (held > 0) msg += ", plus " + std::to_string(held) + " bytes the existing object holds";
  msg += "; the pool would SIGBUS when pre-faulted or written. Lower pool_bytes (--pool-bytes) ";
  msg += "or enlarge " + shm_dir + " (docker run --shm-size; Kubernetes: an emptyDir of medium ";
  msg += "Memory mounted there)";
  return FailedPrecondition(std::move(msg));
}

struct PoolRegion::Impl {
  bip::shared_memory_object shm;
  bip::mapped_region region;
};

PoolRegion::PoolRegion(std::unique_ptr<Impl> impl, std::string name)
    : impl_(std::move(impl)), name_(std::move(name)) {
  data_ = static_cast<uint8_t*>(impl_->region.get_address());
  size_ = impl_->region.get_size();
}

PoolRegion::~PoolRegion() = default;

StatusOr<std::unique_ptr<PoolRegion>> PoolRegion::Open(const std::string& name, uint64_t bytes) {
  // Boost adds the leading '/' itself.
  std::string bare = name[0] == '/' ? name.substr(1) : name;
  if (bare.empty() || bare.find('/') != std::string::npos) {
    return InvalidArgument("shm_name: '" + name + "' is not a valid POSIX shm name");
  }
  HIQ_RETURN_IF_ERROR(CheckShmRoom(kShmDir, bare, bytes));
  try {
    auto impl = std::make_unique<Impl>();
    impl->shm = bip::shared_memory_object(bip::open_or_create, bare.c_str(), bip::read_write,
                                          bip::permissions(0600));
    // The pool must be the daemon's alone (docs/design.md: "owned and written by the daemon only"):
    // an object someone else created in the world-writable /dev/shm, or one others may have
    // opened, could be written under the daemon's feet, whatever the rebuild checks.
    struct stat st {};
    if (::fstat(impl->shm.get_mapping_handle().handle, &st) != 0) {
      return FailedPrecondition("shm_name: cannot stat '/" + bare + "': " + std::strerror(errno));
    }
    if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
      return FailedPrecondition(
          "shm_name: '/" + bare + "' exists and is owned by uid " + std::to_string(st.st_uid) +
          ", not by the daemon's uid " + std::to_string(::geteuid()) +
          ": another user created it, so its contents cannot be trusted; remove it or choose "
          "another --shm-name");
    }
    if ((st.st_mode & 077) != 0) {
      // Ours, but readable or writable by others, who may hold it open: start a new object.
      HIQ_LOG(WARN) << "event=pool_recreated shm_name=/" << bare << " mode=0" << std::oct
                    << (st.st_mode & 0777) << std::dec
                    << " reason=\"accessible to other users: its blocks are not reattached\"";
      impl->shm = bip::shared_memory_object();
      bip::shared_memory_object::remove(bare.c_str());
      impl->shm = bip::shared_memory_object(bip::create_only, bare.c_str(), bip::read_write,
                                            bip::permissions(0600));
    }
    bip::offset_t current = 0;
    if (!impl->shm.get_size(current) || static_cast<uint64_t>(current) != bytes) {
      impl->shm.truncate(static_cast<bip::offset_t>(bytes));
    }
    impl->region = bip::mapped_region(impl->shm, bip::read_write, 0, bytes);
    // Huge pages where the shm filesystem offers them on request (tmpfs mounted huge=advise, or
    // shmem_enabled=advise): fewer faults at pre-fault and fewer TLB misses in the codec. A
    // filesystem without them ignores the advice (huge=never, /dev/shm's default).
#ifdef MADV_HUGEPAGE
    (void)::madvise(impl->region.get_address(), bytes, MADV_HUGEPAGE);
#endif
    return std::unique_ptr<PoolRegion>(new PoolRegion(std::move(impl), "/" + bare));
  } catch (const bip::interprocess_exception& e) {
    return FailedPrecondition("shm_name: cannot create or map '/" + bare + "' of " +
                              std::to_string(bytes) + " bytes: " + e.what());
  }
}

namespace {
// Steps small enough to report progress, balance the threads and answer a stop within a
// fraction of a second, large enough that a step's system call costs nothing beside its pages.
constexpr uint64_t kPrefaultStep = 64ull << 20;
}  // namespace

Status PoolRegion::Prefault(unsigned threads, std::atomic<uint64_t>* done,
                            const std::atomic<bool>* stop) {
  if (threads == 0) threads = 1;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t steps = (size_ + kPrefaultStep - 1) / kPrefaultStep;
  const int fd = impl_->shm.get_mapping_handle().handle;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> can_allocate{true};
  std::atomic<int> full_errno{0};
  auto work = [&] {
    for (;;) {
      if (stop != nullptr && stop->load(std::memory_order_relaxed)) return;
      if (full_errno.load(std::memory_order_relaxed) != 0) return;
      const uint64_t step = next.fetch_add(1, std::memory_order_relaxed);
      if (step >= steps) return;
      const uint64_t begin = step * kPrefaultStep;
      const uint64_t end = std::min(size_, begin + kPrefaultStep);
      bool resident = false;
      if (can_allocate.load(std::memory_order_relaxed)) {
        if (::fallocate(fd, 0, static_cast<off_t>(begin), static_cast<off_t>(end - begin)) == 0) {
          resident = true;
        } else if (errno == ENOSPC) {
          full_errno.store(errno);
          return;
        } else {
          can_allocate.store(false);  // EOPNOTSUPP and the like: fault the pages instead
        }
      }
#ifdef MADV_POPULATE_WRITE
      if (!resident) resident = ::madvise(data_ + begin, end - begin, MADV_POPULATE_WRITE) == 0;
#endif
      if (!resident) {
        // Write each page once; values are not disturbed: read and write back.
        for (uint64_t off = begin; off < end; off += page) {
          volatile uint8_t* p = data_ + off;
          *p = *p;
        }
      }
      if (done != nullptr) done->fetch_add(end - begin, std::memory_order_relaxed);
    }
  };
  std::vector<std::thread> workers;
  for (unsigned t = 1; t < std::min<uint64_t>(threads, steps); ++t) workers.emplace_back(work);
  work();
  for (auto& w : workers) w.join();
  if (full_errno.load() != 0) {
    return ResourceExhausted("pool " + name_ + ": the shm filesystem ran out of room while " +
                             "allocating its " + GiB(size_) + ": " +
                             std::strerror(full_errno.load()));
  }
  if (next.load() < steps) return {StatusCode::kCancelled, "pool " + name_ + ": pre-fault stopped"};
  return Status::Ok();
}

uint64_t PoolRegion::MapPages(const std::atomic<bool>* stop) {
  uint64_t mapped = 0;
#ifdef MADV_POPULATE_WRITE
  for (uint64_t begin = 0; begin < size_; begin += kPrefaultStep) {
    if (stop != nullptr && stop->load(std::memory_order_relaxed)) break;
    const uint64_t len = std::min(size_ - begin, kPrefaultStep);
    if (::madvise(data_ + begin, len, MADV_POPULATE_WRITE) != 0) break;
    mapped += len;
  }
#else
  (void)stop;
#endif
  return mapped;
}

}  // namespace hiqcache::server
