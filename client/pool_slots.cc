#include "pool_slots.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "hiqcache/host_shm.h"

namespace hiqcache::client_internal {

StatusOr<std::shared_ptr<PoolSlots>> PoolSlots::Map(const EventPoolSpec& events) {
  if (events.count == 0) return std::shared_ptr<PoolSlots>();
  int fd = -1;
  if (events.host_fd >= 0) {
    fd = ::fcntl(events.host_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return Internal(std::string("events: dup: ") + std::strerror(errno));
  } else {
    if (events.host_shm_name.empty()) return std::shared_ptr<PoolSlots>();
    const std::string name = HostShm::NormalizeName(events.host_shm_name);
    fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
      return Internal("events: cannot open " + name + ": " + std::strerror(errno));
    }
  }
  const size_t bytes = size_t{events.count} * HostEventPool::kSlotBytes;
  struct stat st {};
  void* data = MAP_FAILED;
  Status status;
  if (::fstat(fd, &st) != 0) {
    status = Internal(std::string("events: fstat: ") + std::strerror(errno));
  } else if (static_cast<uint64_t>(st.st_size) < bytes) {
    status = FailedPrecondition("events: the slot object has " + std::to_string(st.st_size) +
                                " bytes, " + std::to_string(events.count) + " slots need " +
                                std::to_string(bytes));
  } else {
    data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      status = Internal(std::string("events: mmap: ") + std::strerror(errno));
    }
  }
  if (!status.ok()) {
    ::close(fd);
    return status;
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  const bool sealed = seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
  return std::shared_ptr<PoolSlots>(new PoolSlots(fd, sealed, data, bytes, events.count));
}

PoolSlots::PoolSlots(int fd, bool sealed, void* data, size_t bytes, uint32_t count)
    : fd_(fd),
      sealed_(sealed),
      data_(data),
      bytes_(bytes),
      count_(count),
      daemon_slots_((size_t{count} + 63) / 64) {}

PoolSlots::~PoolSlots() {
  ::munmap(data_, bytes_);
  ::close(fd_);
}

bool PoolSlots::Intact() const {
  if (sealed_) return true;
  struct stat st {};
  return ::fstat(fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) >= bytes_;
}

std::atomic_ref<uint64_t> PoolSlots::Slot(uint32_t i) const {
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(
      static_cast<char*>(data_) + size_t{i} * HostEventPool::kSlotBytes));
}

void PoolSlots::NoteDaemonSlots(int32_t done_event, int32_t layer_event_base, uint32_t layers) {
  auto mark = [&](int64_t slot) {
    if (slot < 0 || slot >= count_) return;
    std::atomic<uint64_t>& word = daemon_slots_[static_cast<size_t>(slot) / 64];
    const uint64_t bit = uint64_t{1} << (slot % 64);
    if ((word.load(std::memory_order_relaxed) & bit) == 0) {
      word.fetch_or(bit, std::memory_order_relaxed);
    }
  };
  mark(done_event);
  if (layer_event_base >= 0) {
    for (uint32_t l = 0; l < layers; ++l) mark(int64_t{layer_event_base} + l);
  }
}

void PoolSlots::NoteTicket(uint64_t ticket) {
  uint64_t cur = highest_.load(std::memory_order_relaxed);
  while (cur < ticket && !highest_.compare_exchange_weak(cur, ticket, std::memory_order_release,
                                                         std::memory_order_relaxed)) {
  }
}

uint32_t PoolSlots::FailBelow(uint64_t ticket) const {
  ticket &= ~kEventFailedBit;
  if (ticket == 0 || forgotten() || !Intact()) return 0;
  const uint64_t failed = ticket | kEventFailedBit;
  uint32_t written = 0;
  for (uint32_t i = 0; i < count_; ++i) {
    if ((daemon_slots_[i / 64].load(std::memory_order_relaxed) & (uint64_t{1} << (i % 64))) == 0) {
      continue;
    }
    std::atomic_ref<uint64_t> slot = Slot(i);
    uint64_t cur = slot.load(std::memory_order_relaxed);
    while ((cur & ~kEventFailedBit) < ticket) {
      if (slot.compare_exchange_weak(cur, failed, std::memory_order_release,
                                     std::memory_order_relaxed)) {
        ++written;
        break;
      }
    }
  }
  return written;
}

void PoolSlots::Reset() const {
  if (!Intact()) return;
  for (uint32_t i = 0; i < count_; ++i) Slot(i).store(0, std::memory_order_release);
}

}  // namespace hiqcache::client_internal
