// The CUDA emulator (cuda_emulation.h): lanes as ucontext fibers, warp shuffles as lock-step
// exchanges, and the small host runtime of cuda_runtime_emulation.h.
#include "cuda_emulation.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_runtime_emulation.h"
#include "hiqcache/mutex.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define HIQ_EMU_ASAN 1
#endif

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace hiqcache::cuda_emulation {
namespace {

constexpr uint32_t kWarp = 32;
constexpr uint32_t kFull = 0xFFFFFFFFu;
constexpr size_t kStackBytes = 256 * 1024;
constexpr uint32_t kMaxThreadsPerBlock = 1024;

std::atomic<Fault> g_fault{Fault::kNone};
std::atomic<uint32_t> g_sm_count{2};

Mutex g_stats_mu;
Stats g_stats GUARDED_BY(g_stats_mu);

// One lane's fiber stack, with an inaccessible guard page below it (stacks grow down).
class FiberStack {
 public:
  FiberStack() {
    page_ = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    void* p = ::mmap(nullptr, kStackBytes + page_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (p == MAP_FAILED) std::abort();
    ::mprotect(p, page_, PROT_NONE);
    base_ = static_cast<uint8_t*>(p);
  }
  ~FiberStack() { ::munmap(base_, kStackBytes + page_); }
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;
  void* bottom() const { return base_ + page_; }
  size_t size() const { return kStackBytes; }

 private:
  uint8_t* base_ = nullptr;
  size_t page_ = 0;
};

enum class LaneState : uint8_t { kReady, kWaiting, kExited };

struct Lane {
  ucontext_t ctx;
  LaneState state = LaneState::kExited;
  uint3 tid{};
  // The pending shuffle while kWaiting; its result once it completes.
  ShuffleKind kind = ShuffleKind::kIdx;
  uint32_t mask = 0;
  uint64_t value = 0;
  int arg = 0;
  int width = 0;
  uint64_t result = 0;
};

// The warp being run on this host thread.
struct Warp {
  std::array<Lane, kWarp> lanes;
  ucontext_t scheduler;
  const std::function<void()>* body = nullptr;
  uint32_t current = 0;
  std::string error;  // first error of this warp's lanes
#if defined(HIQ_EMU_ASAN)
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
#endif
};

struct ThreadState {
  std::array<FiberStack, kWarp> stacks;
  Warp warp;
  cudaError_t last_error = cudaSuccess;
  std::string last_error_text;
};

ThreadState& Self() {
  thread_local ThreadState state;
  return state;
}
thread_local Warp* t_warp = nullptr;  // non-null while RunGrid runs a warp on this thread

void NoteError(Warp* w, const std::string& what) {
  if (w->error.empty()) w->error = what;
}

std::string LaneName(uint32_t lane) { return "lane " + std::to_string(lane); }

std::string Hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// Switches between the scheduler and a lane, telling ASan about the stack change.
void SwitchToLane(Warp* w, uint32_t lane) {
  w->current = lane;
  threadIdx = w->lanes[lane].tid;
#if defined(HIQ_EMU_ASAN)
  void* fake = nullptr;
  const FiberStack& st = Self().stacks[lane];
  __sanitizer_start_switch_fiber(&fake, st.bottom(), st.size());
#endif
  swapcontext(&w->scheduler, &w->lanes[lane].ctx);
#if defined(HIQ_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void SwitchToScheduler(Warp* w, bool exiting) {
#if defined(HIQ_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, w->sched_stack_bottom,
                                 w->sched_stack_size);
#endif
  if (exiting) {
    setcontext(&w->scheduler);
  } else {
    swapcontext(&w->lanes[w->current].ctx, &w->scheduler);
  }
#if defined(HIQ_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void LaneEntry() {
  Warp* w = t_warp;
#if defined(HIQ_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &w->sched_stack_bottom, &w->sched_stack_size);
#endif
  (*w->body)();
  w->lanes[w->current].state = LaneState::kExited;
  SwitchToScheduler(w, /*exiting=*/true);
}

// The lane `lane` reads for its pending shuffle, or -1 for "its own value" (CUDA: a source
// outside the lane's width segment, or beyond it for up/down).
int SourceLane(const Lane& l, uint32_t lane) {
  const int width = l.width;
  const int self = static_cast<int>(lane);
  const int seg = self & ~(width - 1);
  int src = 0;
  switch (l.kind) {
    case ShuffleKind::kIdx:
      src = seg + (l.arg & (width - 1));
      break;
    case ShuffleKind::kUp:
      src = self - l.arg;
      if (src < seg) return -1;
      break;
    case ShuffleKind::kDown:
      src = self + l.arg;
      if (src >= seg + width) return -1;
      break;
    case ShuffleKind::kXor:
      src = self ^ l.arg;
      if (src >= seg + width) return -1;  // later segments: own value
      break;
  }
  return src;
}

bool ValidWidth(int width) {
  return width >= 1 && width <= static_cast<int>(kWarp) && (width & (width - 1)) == 0;
}

// All runnable lanes have stopped (waiting at a shuffle or exited): completes every shuffle
// whose named lanes are all there with the same mask. Returns how many lanes it released.
uint32_t CompleteShuffles(Warp* w, uint32_t present) {
  uint32_t waiting = 0, exited = 0;
  for (uint32_t i = 0; i < kWarp; ++i) {
    if (!(present >> i & 1u)) continue;
    if (w->lanes[i].state == LaneState::kWaiting) waiting |= 1u << i;
    if (w->lanes[i].state == LaneState::kExited) exited |= 1u << i;
  }
  uint32_t released = 0;
  uint32_t done = 0;
  for (uint32_t i = 0; i < kWarp; ++i) {
    if (!(waiting >> i & 1u) || (done >> i & 1u)) continue;
    const Lane& first = w->lanes[i];
    const uint32_t m = first.mask;
    if (!(m >> i & 1u)) {
      NoteError(w, LaneName(i) + ": shuffle mask " + Hex(m) + " does not name the calling lane");
      return 0;
    }
    if ((m & ~present) != 0) {
      NoteError(w, LaneName(i) + ": shuffle mask names lanes that do not exist in this CTA");
      return 0;
    }
    if ((m & exited) != 0) {
      NoteError(w, LaneName(i) + ": shuffle mask names lanes that already exited (mask " + Hex(m) +
                       ", exited " + Hex(exited) + ")");
      return 0;
    }
    // Every named lane is waiting (it is present and not exited): it must be the same shuffle.
    for (uint32_t j = 0; j < kWarp; ++j) {
      if (!(m >> j & 1u)) continue;
      const Lane& o = w->lanes[j];
      if (o.mask != m || o.kind != first.kind || o.width != first.width) {
        NoteError(w, "divergent shuffle: " + LaneName(i) + " and " + LaneName(j) +
                         " wait at shuffles with different masks, kinds or widths");
        return 0;
      }
    }
    if (!ValidWidth(first.width)) {
      NoteError(w, LaneName(i) + ": shuffle width " + std::to_string(first.width) +
                       " is not a power of two in [1, 32]");
      return 0;
    }
    // Exchange: every source value was posted before any result is written.
    const bool wrong_lane = g_fault.load(std::memory_order_relaxed) == Fault::kShuffleWrongLane;
    for (uint32_t j = 0; j < kWarp; ++j) {
      if (!(m >> j & 1u)) continue;
      Lane& o = w->lanes[j];
      int src = SourceLane(o, j);
      if (src < 0) {
        o.result = o.value;
      } else {
        if (wrong_lane) src = (src + 1) % static_cast<int>(kWarp);
        if (!(m >> src & 1u)) {
          NoteError(w, LaneName(j) + ": shuffle reads " + LaneName(static_cast<uint32_t>(src)) +
                           ", which is not in the mask");
          return 0;
        }
        o.result = w->lanes[src].value;
      }
    }
    for (uint32_t j = 0; j < kWarp; ++j) {
      if (m >> j & 1u) w->lanes[j].state = LaneState::kReady;
    }
    done |= m;
    released |= m;
    MutexLock lock(&g_stats_mu);
    ++g_stats.shuffles;
  }
  return static_cast<uint32_t>(__builtin_popcount(released));
}

// Runs the lanes of one warp (lanes [first_thread, first_thread + count) of the CTA).
bool RunWarp(Warp* w, Dim block, uint32_t first_thread, uint32_t count,
             const std::function<void()>& body) {
  ThreadState& self = Self();
  w->body = &body;
  w->error.clear();
  const uint32_t present = count == kWarp ? kFull : (1u << count) - 1u;
  for (uint32_t i = 0; i < kWarp; ++i) {
    Lane& l = w->lanes[i];
    if (!(present >> i & 1u)) {
      l.state = LaneState::kExited;
      continue;
    }
    const uint32_t t = first_thread + i;
    l.tid = uint3{t % block.x, t / block.x % block.y, t / (block.x * block.y)};
    l.state = LaneState::kReady;
    getcontext(&l.ctx);
    l.ctx.uc_stack.ss_sp = self.stacks[i].bottom();
    l.ctx.uc_stack.ss_size = self.stacks[i].size();
    l.ctx.uc_link = nullptr;
    makecontext(&l.ctx, &LaneEntry, 0);
  }
  for (;;) {
    for (uint32_t i = 0; i < kWarp; ++i) {
      if (w->lanes[i].state != LaneState::kReady) continue;
      SwitchToLane(w, i);
      // A lane error (e.g. a misaligned load) does not stop the lane; a shuffle error does.
    }
    bool all_exited = true;
    for (uint32_t i = 0; i < kWarp; ++i) {
      all_exited &= w->lanes[i].state == LaneState::kExited;
    }
    if (all_exited) break;
    if (CompleteShuffles(w, present) == 0) {
      NoteError(w, "warp deadlocked: lanes wait at shuffles that can never complete");
      break;  // the waiting fibers are abandoned; their stacks are reused by the next warp
    }
  }
  return w->error.empty();
}

}  // namespace

bool RunGrid(Dim grid, Dim block, const std::function<void()>& body, std::string* error) {
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  const uint64_t ctas = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || ctas == 0 || grid.x > 0x7FFFFFFFu ||
      grid.y > 65535 || grid.z > 65535 || block.z > 64) {
    *error = "invalid launch configuration: grid " + std::to_string(grid.x) + "x" +
             std::to_string(grid.y) + "x" + std::to_string(grid.z) + ", block " +
             std::to_string(block.x) + "x" + std::to_string(block.y) + "x" +
             std::to_string(block.z);
    return false;
  }
  if (t_warp != nullptr) {
    *error = "a kernel launched another kernel (dynamic parallelism is not emulated)";
    return false;
  }
  ThreadState& self = Self();
  Warp* w = &self.warp;
  t_warp = w;
  const dim3 saved_block = blockDim, saved_grid = gridDim;
  const uint3 saved_bidx = blockIdx, saved_tidx = threadIdx;
  blockDim = dim3(block.x, block.y, block.z);
  gridDim = dim3(grid.x, grid.y, grid.z);
  bool ok = true;
  uint64_t lanes_run = 0;
  for (uint32_t bz = 0; bz < grid.z && ok; ++bz) {
    for (uint32_t by = 0; by < grid.y && ok; ++by) {
      for (uint32_t bx = 0; bx < grid.x && ok; ++bx) {
        blockIdx = uint3{bx, by, bz};
        for (uint64_t t0 = 0; t0 < threads && ok; t0 += kWarp) {
          const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(kWarp, threads - t0));
          ok = RunWarp(w, block, static_cast<uint32_t>(t0), n, body);
          lanes_run += n;
          if (!ok) {
            *error = "CTA (" + std::to_string(bx) + "," + std::to_string(by) + "," +
                     std::to_string(bz) + ") warp " + std::to_string(t0 / kWarp) + ": " + w->error;
          }
        }
      }
    }
  }
  t_warp = nullptr;
  blockDim = saved_block;
  gridDim = saved_grid;
  blockIdx = saved_bidx;
  threadIdx = saved_tidx;
  MutexLock lock(&g_stats_mu);
  ++g_stats.launches;
  g_stats.ctas += ctas;
  g_stats.max_grid = std::max(g_stats.max_grid, ctas);
  g_stats.lanes += lanes_run;
  return ok;
}

uint64_t Shuffle(ShuffleKind kind, uint32_t mask, uint64_t value, int arg, int width) {
  Warp* w = t_warp;
  if (w == nullptr) std::abort();  // a device function called outside a launch
  Lane& l = w->lanes[w->current];
  l.kind = kind;
  l.mask = mask;
  l.value = value;
  l.arg = arg;
  l.width = width;
  l.state = LaneState::kWaiting;
  SwitchToScheduler(w, /*exiting=*/false);
  return w->lanes[w->current].result;
}

uint32_t CurrentLane() {
  if (t_warp == nullptr) std::abort();
  return t_warp->current;
}

void ReportLaneError(const std::string& what) {
  if (t_warp == nullptr) std::abort();
  NoteError(t_warp,
            LaneName(t_warp->current) + " (thread " + std::to_string(threadIdx.x) + "): " + what);
}

void SetFault(Fault fault) { g_fault.store(fault, std::memory_order_relaxed); }

void SetSmCount(uint32_t sms) { g_sm_count.store(sms, std::memory_order_relaxed); }
uint32_t SmCount() { return g_sm_count.load(std::memory_order_relaxed); }

Stats GetStats() {
  MutexLock lock(&g_stats_mu);
  return g_stats;
}

void ResetStats() {
  MutexLock lock(&g_stats_mu);
  g_stats = Stats{};
}

void SetLastLaunchError(cudaError_t err, const std::string& detail) {
  ThreadState& self = Self();
  self.last_error = err;
  self.last_error_text = detail;
}

}  // namespace hiqcache::cuda_emulation

// ---------------------------------------------------------------------------------------------
// Host runtime API.

using hiqcache::cuda_emulation::Self;

cudaError_t cudaGetLastError() {
  const cudaError_t err = Self().last_error;
  Self().last_error = cudaSuccess;
  return err;
}

cudaError_t cudaPeekAtLastError() { return Self().last_error; }

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorMisalignedAddress:
      return "cudaErrorMisalignedAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t err) {
  if (err == cudaErrorLaunchFailure && !Self().last_error_text.empty()) {
    return Self().last_error_text.c_str();
  }
  switch (err) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    default:
      return "emulated CUDA error";
  }
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cudaErrorInvalidValue;
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr || device != 0 || attr != cudaDevAttrMultiProcessorCount) {
    return cudaErrorInvalidValue;
  }
  *value = static_cast<int>(hiqcache::cuda_emulation::SmCount());
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  (void)kind;
  (void)stream;
  if (count == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  std::memmove(dst, src, count);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t count, cudaStream_t stream) {
  (void)stream;
  if (count == 0) return cudaSuccess;
  if (dst == nullptr) return cudaErrorInvalidValue;
  std::memset(dst, value, count);
  return cudaSuccess;
}
