// Helpers of the robustness suite (tests/robustness) on top of the integration helpers
// (tests/integration/it_util.h, daemon_process.h): a child process read line by line while it
// runs, independent block keys, /proc readings of the daemon's memory, latency percentiles, and a
// reader of the daemon's shm pool layout for the corruption test. Header-only; not thread-safe
// unless stated.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "it_util.h"
#include "pool/pool_format.h"
#include "time_margin.h"

namespace hiqcache::rob {

// A child process whose stdout is read line by line while it runs.
class Child {
 public:
  explicit Child(const std::vector<std::string>& argv) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    std::vector<std::string> copy = argv;
    std::vector<char*> args;
    for (auto& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    if (::posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0) Kill();
    if (fd_ >= 0) ::close(fd_);
  }
  pid_t pid() const { return pid_; }
  // Waits for a line equal to `line`; false on EOF or timeout.
  bool WaitLine(const std::string& line, std::chrono::milliseconds timeout) {
    return WaitLineStartingWith(line, timeout, /*whole=*/true).has_value();
  }
  // Waits for a line that starts with `prefix` (the whole line `prefix` when `whole`) and
  // returns it; nullopt on EOF or timeout.
  std::optional<std::string> WaitLineStartingWith(const std::string& prefix,
                                                  std::chrono::milliseconds timeout,
                                                  bool whole = false) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      size_t nl;
      while ((nl = buf_.find('\n')) != std::string::npos) {
        std::string l = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        if (whole ? l == prefix : l.rfind(prefix, 0) == 0) return l;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return std::nullopt;
      char tmp[512];
      const ssize_t n = ::read(fd_, tmp, sizeof(tmp));
      if (n <= 0) return std::nullopt;
      buf_.append(tmp, n);
    }
  }
  // SIGKILL, then reap.
  // A killed client cannot unlink its shm objects (HostShm::UniqueName: /hiq-<pid>-...): the
  // test does, so repeated runs do not fill /dev/shm. Mappings the daemon still holds stay valid.
  void Kill() {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    const std::string prefix = "hiq-" + std::to_string(pid_) + "-";
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind(prefix, 0) == 0) ::shm_unlink(("/" + name).c_str());
    }
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string buf_;
};

// Whether this binary (and so the daemon of its build directory) runs under a sanitizer: memory
// bounds and timing targets are relaxed there (shadow memory, 2-20x slower code).
using test_time::kSanitized;

// A client for tests that restart the daemon under it: generous deadlines, and re-registration
// allowed every 50 ms, so that the first calls after a restart register again at once.
inline std::unique_ptr<Client> RestartingClient(const std::string& target) {
  ClientOptions o;
  o.target = target;
  o.call_timeout = std::chrono::milliseconds(3000);
  o.register_timeout = std::chrono::milliseconds(5000);
  o.reregister_interval = std::chrono::milliseconds(50);
  auto c = Client::Connect(o);
  return c.ok() ? std::move(c).value() : nullptr;
}

// The key of logical block `b` of key space `seed`: independent keys (not a chain), so that any
// subset of blocks can be backed up, looked up and restored in any order by any process.
inline BlockKey IndependentKey(uint64_t seed, uint64_t b) {
  BlockKey k;
  const uint64_t lo = it::Mix(seed, b), hi = it::Mix(seed ^ 0x5BD1E9955BD1E995ull, b);
  std::memcpy(k.data(), &lo, 8);
  std::memcpy(k.data() + 8, &hi, 8);
  return k;
}

inline std::vector<BlockKey> IndependentKeys(uint64_t seed, uint64_t first, uint32_t n) {
  std::vector<BlockKey> keys;
  for (uint32_t i = 0; i < n; ++i) keys.push_back(IndependentKey(seed, first + i));
  return keys;
}

// Memory of a process from /proc/<pid>/status, in bytes (0 when unreadable).
struct ProcMemory {
  uint64_t vm_rss = 0;
  uint64_t rss_anon = 0;
  uint64_t rss_file = 0;
  uint64_t rss_shmem = 0;
  void MaxWith(const ProcMemory& o) {
    vm_rss = std::max(vm_rss, o.vm_rss);
    rss_anon = std::max(rss_anon, o.rss_anon);
    rss_file = std::max(rss_file, o.rss_file);
    rss_shmem = std::max(rss_shmem, o.rss_shmem);
  }
};

inline ProcMemory ReadProcMemory(pid_t pid) {
  ProcMemory m;
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    std::string key;
    uint64_t kb = 0;
    ss >> key >> kb;
    if (key == "VmRSS:")
      m.vm_rss = kb << 10;
    else if (key == "RssAnon:")
      m.rss_anon = kb << 10;
    else if (key == "RssFile:")
      m.rss_file = kb << 10;
    else if (key == "RssShmem:")
      m.rss_shmem = kb << 10;
  }
  return m;
}

inline double MiB(uint64_t b) { return static_cast<double>(b) / (1 << 20); }

// p in [0, 100] of `v` (sorted in place); 0 for an empty vector.
inline double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * (v.size() - 1) + 0.5));
  return v[i];
}

// The daemon's pool shm object, opened by name while the daemon is stopped, walked through its
// persistent layout (server/pool/pool_format.h) to find committed blocks.
class PoolFile {
 public:
  static std::optional<PoolFile> Open(const std::string& shm_name) {
    int fd = ::shm_open(shm_name.c_str(), O_RDWR, 0);
    if (fd < 0) return std::nullopt;
    struct stat st;
    if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
      ::close(fd);
      return std::nullopt;
    }
    void* p = ::mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return std::nullopt;
    PoolFile f;
    f.base_ = static_cast<uint8_t*>(p);
    f.size_ = static_cast<uint64_t>(st.st_size);
    return f;
  }
  PoolFile(PoolFile&& o) noexcept : base_(o.base_), size_(o.size_) { o.base_ = nullptr; }
  ~PoolFile() {
    if (base_ != nullptr) ::munmap(base_, size_);
  }

  struct Block {
    BlockKey key;
    uint64_t payload_offset = 0;
    uint64_t payload_bytes = 0;
  };
  // Committed blocks named by the extent directory.
  std::vector<Block> CommittedBlocks() const {
    using namespace hiqcache::server;
    std::vector<Block> out;
    const auto* ph = reinterpret_cast<const PoolHeader*>(base_);
    if (ph->magic != kPoolMagic) return out;
    const auto* dir = reinterpret_cast<const ExtentDirEntry*>(base_ + kPoolHeaderBytes);
    for (uint64_t i = 0; i < ph->directory_entries; ++i) {
      if (dir[i].bytes == 0 || dir[i].offset + dir[i].bytes > size_) continue;
      const auto* eh = reinterpret_cast<const ExtentHeader*>(base_ + dir[i].offset);
      if (eh->magic != kExtentMagic) continue;
      for (uint32_t s = 0; s < eh->num_slots; ++s) {
        const uint64_t off = dir[i].offset + kExtentHeaderBytes + uint64_t{s} * eh->slot_bytes;
        const auto* bh = reinterpret_cast<const BlockHeader*>(base_ + off);
        if (bh->magic != kBlockMagic ||
            bh->state != static_cast<uint32_t>(BlockState::kCommitted)) {
          continue;
        }
        Block b;
        std::memcpy(b.key.data(), bh->key, 16);
        b.payload_offset = off + kBlockHeaderBytes;
        b.payload_bytes = bh->payload_bytes;
        out.push_back(b);
      }
    }
    return out;
  }
  uint8_t* data() const { return base_; }

 private:
  PoolFile() = default;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace hiqcache::rob
