#include "hiqcache/host_shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace hiqcache {
namespace {

static_assert(std::endian::native == std::endian::little,
              "HOST event slots are little-endian uint64; big-endian hosts need byte swaps");

std::string ErrnoText(int err) { return std::strerror(err); }

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

uint64_t* SlotPtr(void* base, uint32_t slot) {
  return reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(base) +
                                     size_t{slot} * HostEventPool::kSlotBytes);
}

// The selected value of a sysfs switch written like "always within_size advise [never] deny force";
// empty when the file cannot be read.
std::string SelectedSysfsValue(const char* path) {
  std::ifstream in(path);
  std::string word;
  while (in >> word) {
    if (word.size() > 2 && word.front() == '[' && word.back() == ']') {
      return word.substr(1, word.size() - 2);
    }
  }
  return {};
}

// Whether the kernel backs a shmem mapping advised MADV_HUGEPAGE with transparent huge pages.
bool ShmemThpHonoursAdvice() {
  const std::string v = SelectedSysfsValue("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  return v == "advise" || v == "within_size" || v == "always" || v == "force";
}

}  // namespace

const char* HugePagesName(HugePages mode) {
  switch (mode) {
    case HugePages::kOff:
      return "off";
    case HugePages::kAuto:
      return "auto";
    case HugePages::kRequire:
      return "require";
  }
  return "unknown";
}

StatusOr<HugePages> ParseHugePages(std::string_view text, std::string_view field) {
  for (HugePages mode : {HugePages::kOff, HugePages::kAuto, HugePages::kRequire}) {
    if (text == HugePagesName(mode)) return mode;
  }
  return InvalidArgument(std::string(field) + ": '" + std::string(text) +
                         "' is not one of off, auto, require");
}

const char* HugePageBackingName(HugePageBacking backing) {
  switch (backing) {
    case HugePageBacking::kNone:
      return "none";
    case HugePageBacking::kTransparent:
      return "thp";
    case HugePageBacking::kHugetlb:
      return "hugetlb";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// HostShm

std::string HostShm::NormalizeName(std::string_view name) {
  if (!name.empty() && name.front() == '/') return std::string(name);
  return "/" + std::string(name);
}

std::string HostShm::UniqueName(std::string_view tag) {
  static std::atomic<uint64_t> counter{0};
  // A per-process random part: a process killed earlier may have left objects under a pid that
  // the kernel has since given to this process.
  static const std::string nonce = [] {
    std::random_device rd;
    char hex[9];
    std::snprintf(hex, sizeof(hex), "%08x", static_cast<unsigned>(rd()));
    return std::string(hex);
  }();
  return "/hiq-" + std::to_string(::getpid()) + "-" + nonce + "-" +
         std::to_string(counter.fetch_add(1)) + "-" + std::string(tag);
}

StatusOr<HostShm> HostShm::Create(std::string_view name, size_t size) {
  if (size == 0) return InvalidArgument("HostShm::Create: size must be > 0");
  HostShm shm;
  shm.name_ = NormalizeName(name);
  const int fd = ::shm_open(shm.name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST) {
      return Status(StatusCode::kAlreadyExists, "shm " + shm.name_ + " already exists");
    }
    return Internal("shm_open(" + shm.name_ + ", O_CREAT|O_EXCL): " + ErrnoText(err));
  }
  shm.owner_ = true;  // from here on, Reset() unlinks
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    ::close(fd);
    return ResourceExhausted("ftruncate(" + shm.name_ + ", " + std::to_string(size) +
                             "): " + ErrnoText(err));
  }
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) return Internal("mmap(" + shm.name_ + "): " + ErrnoText(err));
  shm.data_ = data;
  shm.size_ = size;
  return shm;
}

StatusOr<HostShm> HostShm::Open(std::string_view name, size_t min_size) {
  HostShm shm;
  shm.name_ = NormalizeName(name);
  const int fd = ::shm_open(shm.name_.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFound("shm " + shm.name_ + " does not exist");
    return Internal("shm_open(" + shm.name_ + "): " + ErrnoText(err));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Internal("fstat(" + shm.name_ + "): " + ErrnoText(err));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < min_size || size == 0) {
    ::close(fd);
    return FailedPrecondition("shm " + shm.name_ + " has " + std::to_string(size) +
                              " bytes, need " + std::to_string(std::max<size_t>(min_size, 1)));
  }
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (data == MAP_FAILED) return Internal("mmap(" + shm.name_ + "): " + ErrnoText(err));
  shm.data_ = data;
  shm.size_ = size;
  return shm;
}

StatusOr<HostShm> HostShm::CreateMemfd(std::string_view tag, size_t size, bool fixed_size,
                                       HugePages huge_pages) {
  if (size == 0) return InvalidArgument("HostShm::CreateMemfd: size must be > 0");
  std::string hugetlb_error;
  if (huge_pages != HugePages::kOff) {
    StatusOr<HostShm> huge = MapMemfd(tag, size, fixed_size, /*hugetlb=*/true);
    if (huge.ok()) return huge;
    hugetlb_error = huge.status().message();
  }
  HIQ_ASSIGN_OR_RETURN(HostShm shm, MapMemfd(tag, size, fixed_size, /*hugetlb=*/false));
  if (huge_pages == HugePages::kOff) return shm;
  // Advice only: a kernel whose shmem_enabled is never or deny keeps 4 KiB pages.
  const bool advised = ::madvise(shm.data_, shm.size_, MADV_HUGEPAGE) == 0;
  const int advise_err = errno;
  if (advised && ShmemThpHonoursAdvice()) {
    shm.backing_ = HugePageBacking::kTransparent;
  } else if (huge_pages == HugePages::kRequire) {
    const std::string thp = SelectedSysfsValue("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
    return FailedPrecondition(
        "huge_pages=require: memfd " + shm.name_ + " of " + std::to_string(size) +
        " bytes got no huge pages: hugetlb: " + hugetlb_error + "; transparent huge pages: " +
        (advised ? "/sys/kernel/mm/transparent_hugepage/shmem_enabled is '" +
                       (thp.empty() ? std::string("unreadable") : thp) +
                       "' (advise, within_size, always or force would honour MADV_HUGEPAGE)"
                 : "madvise(MADV_HUGEPAGE): " + ErrnoText(advise_err)) +
        " (reserve hugetlb pages with vm.nr_hugepages, or set shmem_enabled to advise, or ask "
        "for huge_pages=auto)");
  }
  return shm;
}

StatusOr<HostShm> HostShm::MapMemfd(std::string_view tag, size_t size, bool fixed_size,
                                    bool hugetlb) {
  HostShm shm;
  shm.name_ = std::string(kMemfdPrefix) + std::string(tag);
  const std::string label = "hiq-" + std::string(tag);
  const int fd =
      ::memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING | (hugetlb ? MFD_HUGETLB : 0));
  if (fd < 0) {
    return Internal(std::string(hugetlb ? "memfd_create(MFD_HUGETLB) " : "memfd_create(") + label +
                    "): " + ErrnoText(errno));
  }
  shm.fd_ = fd;  // from here on, Reset() closes it
  if (hugetlb) {
    // A hugetlbfs file holds whole huge pages (st_blksize): ftruncate and munmap take nothing else.
    struct stat st;
    if (::fstat(fd, &st) != 0 || st.st_blksize <= 0) {
      return Internal("fstat(" + shm.name_ + ", MFD_HUGETLB): " + ErrnoText(errno));
    }
    const size_t page = static_cast<size_t>(st.st_blksize);
    if (size > SIZE_MAX - page) return InvalidArgument("HostShm::CreateMemfd: size too large");
    size = (size + page - 1) / page * page;
  }
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return ResourceExhausted("ftruncate(" + shm.name_ + ", " + std::to_string(size) +
                             "): " + ErrnoText(errno));
  }
  const int seals = F_SEAL_SHRINK | (fixed_size ? F_SEAL_GROW : 0);
  if (::fcntl(fd, F_ADD_SEALS, seals) != 0) {
    return Internal("fcntl(" + shm.name_ + ", F_ADD_SEALS, " +
                    (fixed_size ? "F_SEAL_SHRINK|F_SEAL_GROW" : "F_SEAL_SHRINK") +
                    "): " + ErrnoText(errno));
  }
  // For MFD_HUGETLB this reserves the object's pages in the hugetlb pool (ENOMEM when it
  // cannot), and MAP_POPULATE allocates them now, from that reservation, on this process's
  // account: hiqcached maps a hugetlbfs object only while every page of it is allocated (it
  // never allocates hugetlb pages on a client's behalf).
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                      MAP_SHARED | (hugetlb ? MAP_POPULATE : 0), fd, 0);
  if (data == MAP_FAILED) {
    const int err = errno;
    return Status(hugetlb && err == ENOMEM ? StatusCode::kResourceExhausted : StatusCode::kInternal,
                  "mmap(" + shm.name_ + ", " + std::to_string(size) + " bytes" +
                      (hugetlb ? ", MFD_HUGETLB" : "") + "): " + ErrnoText(err) +
                      (hugetlb && err == ENOMEM ? " (the hugetlb pool cannot reserve them)" : ""));
  }
  shm.data_ = data;
  shm.size_ = size;
  if (hugetlb) shm.backing_ = HugePageBacking::kHugetlb;
  return shm;
}

HostShm::HostShm(HostShm&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      owner_(std::exchange(other.owner_, false)),
      fd_(std::exchange(other.fd_, -1)),
      backing_(std::exchange(other.backing_, HugePageBacking::kNone)) {}

HostShm& HostShm::operator=(HostShm&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    owner_ = std::exchange(other.owner_, false);
    fd_ = std::exchange(other.fd_, -1);
    backing_ = std::exchange(other.backing_, HugePageBacking::kNone);
  }
  return *this;
}

HostShm::~HostShm() { Reset(); }

void HostShm::Reset() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (owner_ && !name_.empty()) ::shm_unlink(name_.c_str());
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  size_ = 0;
  owner_ = false;
  fd_ = -1;
  backing_ = HugePageBacking::kNone;
}

// ---------------------------------------------------------------------------------------------
// Events

Status WaitForTicket(const uint64_t* slot, uint64_t ticket, std::chrono::nanoseconds timeout) {
  // atomic_ref needs a non-const referent; the loads below never write.
  std::atomic_ref<uint64_t> value(*const_cast<uint64_t*>(slot));
  // Bits 0..62 hold the latest completed ticket; bit 63 says that ticket's work failed, or (a
  // later ticket with the bit, stored by the client when the daemon died) that work up to it may
  // not have completed.
  auto done = [&](Status* out) {
    const uint64_t v = value.load(std::memory_order_acquire);
    const uint64_t part = v & ~kEventFailedBit;
    if (part < ticket) return false;
    if ((v & kEventFailedBit) != 0) {
      *out = Aborted(part == ticket ? "hiqcached reports that work " + std::to_string(ticket) +
                                          " failed: its rows were not written (treat as a miss)"
                                    : "work " + std::to_string(ticket) +
                                          " was released with the failed bit (slot holds ticket " +
                                          std::to_string(part) +
                                          "): its rows may not be written (treat as a miss)");
    } else {
      *out = Status::Ok();
    }
    return true;
  };
  Status result;
  if (done(&result)) return result;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int i = 0; i < 4096; ++i) {
    CpuRelax();
    if (done(&result)) return result;
  }
  auto sleep = std::chrono::microseconds(1);
  while (true) {
    if (done(&result)) return result;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      return DeadlineExceeded("event slot holds " + std::to_string(value.load()) + ", waited for " +
                              std::to_string(ticket));
    }
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(sleep, deadline - now));
    sleep = std::min<std::chrono::microseconds>(sleep * 2, std::chrono::microseconds(1000));
  }
}

StatusOr<HostEventPool> HostEventPool::Create(uint32_t count, std::string_view name) {
  if (count == 0) return InvalidArgument("HostEventPool: count must be > 0");
  const std::string shm_name = name.empty() ? HostShm::UniqueName("ev") : std::string(name);
  const size_t bytes = size_t{count} * kSlotBytes;
  HIQ_ASSIGN_OR_RETURN(
      HostShm shm, shm_name.starts_with(HostShm::kMemfdPrefix)
                       ? HostShm::CreateMemfd(
                             std::string_view(shm_name).substr(HostShm::kMemfdPrefix.size()), bytes)
                       : HostShm::Create(shm_name, bytes));
  HostEventPool pool;
  pool.shm_ = std::move(shm);
  pool.count_ = count;
  return pool;
}

StatusOr<HostEventPool> HostEventPool::Open(std::string_view name, uint32_t count) {
  if (count == 0) return InvalidArgument("HostEventPool: count must be > 0");
  HIQ_ASSIGN_OR_RETURN(HostShm shm, HostShm::Open(name, size_t{count} * kSlotBytes));
  HostEventPool pool;
  pool.shm_ = std::move(shm);
  pool.count_ = count;
  return pool;
}

EventPoolSpec HostEventPool::Spec() const {
  EventPoolSpec spec;
  if (shm_.is_memfd()) {
    spec.host_fd = shm_.fd();
  } else {
    spec.host_shm_name = shm_.name();
  }
  spec.count = count_;
  return spec;
}

uint64_t HostEventPool::Read(uint32_t slot) const {
  return std::atomic_ref<uint64_t>(*SlotPtr(shm_.data(), slot)).load(std::memory_order_acquire);
}

void HostEventPool::Store(uint32_t slot, uint64_t value) const {
  std::atomic_ref<uint64_t>(*SlotPtr(shm_.data(), slot)).store(value, std::memory_order_release);
}

void HostEventPool::Reset() const {
  for (uint32_t i = 0; i < count_; ++i) Store(i, 0);
}

Status HostEventPool::Wait(uint32_t slot, uint64_t ticket, std::chrono::nanoseconds timeout) const {
  if (slot >= count_) {
    return InvalidArgument("event slot " + std::to_string(slot) + " out of range (count " +
                           std::to_string(count_) + ")");
  }
  return WaitForTicket(SlotPtr(shm_.data(), slot), ticket, timeout);
}

// ---------------------------------------------------------------------------------------------
// HostKvPool

const char* KvLayoutName(KvLayout layout) {
  switch (layout) {
    case KvLayout::kSglang:
      return "sglang";
    case KvLayout::kVllmPaged:
      return "vllm_paged";
    case KvLayout::kVllmPackedKv:
      return "vllm_packed_kv";
  }
  return "unknown";
}

StatusOr<HostKvPool> HostKvPool::Create(const Geometry& g, KvLayout layout, uint32_t num_rows,
                                        uint32_t page_rows, std::string_view name,
                                        HugePages huge_pages) {
  if (g.num_layers == 0 || g.num_kv_heads == 0 || g.head_dim == 0 || num_rows == 0) {
    return InvalidArgument("HostKvPool: geometry and num_rows must be non-zero");
  }
  if (layout != KvLayout::kSglang && page_rows == 0) {
    return InvalidArgument("HostKvPool: page_rows must be > 0 for paged layouts");
  }
  if (layout == KvLayout::kVllmPackedKv && g.attention == Attention::kMLA) {
    return InvalidArgument("HostKvPool: MLA has no V to pack");
  }
  HostKvPool pool;
  pool.geometry_ = g;
  pool.layout_ = layout;
  uint64_t layer_bytes = 0;
  uint32_t num_blocks = 0;
  if (layout == KvLayout::kSglang) {
    pool.num_rows_ = num_rows;
    layer_bytes = SlotMajorBytes(g, num_rows) * g.Planes();
  } else {
    num_blocks = (num_rows + page_rows - 1) / page_rows;
    pool.num_rows_ = num_blocks * page_rows;
    layer_bytes = layout == KvLayout::kVllmPaged ? VllmPagedBytes(g, num_blocks, page_rows) * 2
                                                 : VllmPackedKvBytes(g, num_blocks, page_rows);
  }
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    const uint64_t base = l * layer_bytes;
    switch (layout) {
      case KvLayout::kSglang: {
        const uint64_t plane = SlotMajorBytes(g, num_rows);
        pool.layers_.push_back(SglangLayerView(g, num_rows, {0, base}, {0, base + plane}));
        break;
      }
      case KvLayout::kVllmPaged: {
        const uint64_t plane = VllmPagedBytes(g, num_blocks, page_rows);
        pool.layers_.push_back(
            VllmPagedLayerView(g, num_blocks, page_rows, {0, base}, {0, base + plane}));
        break;
      }
      case KvLayout::kVllmPackedKv:
        pool.layers_.push_back(VllmPackedKvLayerView(g, num_blocks, page_rows, {0, base}));
        break;
    }
  }
  const std::string shm_name = name.empty()
                                   ? HostShm::UniqueName(std::string("kv-") + KvLayoutName(layout))
                                   : std::string(name);
  const uint64_t bytes = layer_bytes * g.num_layers;
  if (shm_name.starts_with(HostShm::kMemfdPrefix)) {
    HIQ_ASSIGN_OR_RETURN(
        pool.shm_,
        HostShm::CreateMemfd(std::string_view(shm_name).substr(HostShm::kMemfdPrefix.size()), bytes,
                             /*fixed_size=*/true, huge_pages));
  } else {
    if (huge_pages == HugePages::kRequire) {
      return InvalidArgument("huge_pages=require: shm " + shm_name +
                             " is a named object in /dev/shm, whose mount decides its pages; "
                             "name a memfd (\"memfd:<tag>\") to ask for huge pages");
    }
    HIQ_ASSIGN_OR_RETURN(pool.shm_, HostShm::Create(shm_name, bytes));
  }
  return pool;
}

void HostKvPool::AddTo(PoolSpec* spec) const {
  const uint32_t index = static_cast<uint32_t>(spec->buffers.size());
  SharedBuffer buffer;
  if (shm_.is_memfd()) {
    buffer.host_fd = shm_.fd();
  } else {
    buffer.host_shm_name = shm_.name();
  }
  buffer.size_bytes = shm_.size();
  spec->buffers.push_back(std::move(buffer));
  for (LayerView layer : layers_) {
    layer.k.buffer += index;
    if (layer.v) layer.v->buffer += index;
    spec->layers.push_back(layer);
  }
  spec->geometry = geometry_;
  spec->device = DeviceKind::kHost;
}

uint16_t* HostKvPool::Head(uint32_t layer, uint32_t plane, uint32_t row, uint32_t head) const {
  const LayerView& view = layers_[layer];
  const TensorView& t = plane == 0 ? view.k : *view.v;
  return reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(shm_.data()) +
                                     t.HeadOffset(row, head, geometry_.HeadBytes()));
}

PoolSpec MakeHostPoolSpec(std::string model, const HostKvPool& kv, uint32_t block_tokens,
                          const HostEventPool* events, Codec codec) {
  PoolSpec spec;
  spec.model = std::move(model);
  spec.block_tokens = block_tokens;
  spec.codec = codec;
  kv.AddTo(&spec);
  if (events != nullptr) spec.events = events->Spec();
  return spec;
}

}  // namespace hiqcache
