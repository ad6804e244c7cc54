// gpu_bench: the CUDA backend against the raw copy engine, same run, same buffers.
//
//   transfer       A Qwen3-8B KV pool in GPU memory (36 layers, 8 KV heads, head_dim 128, BF16),
//                  a 2,048-token prefix in it. For each block size of --block-sweep (16, 64 and
//                  256 tokens): the baselines, cudaMemcpyAsync of the prefix's BF16 bytes
//                  device -> pinned host and back, one copy per layer tensor (the copy engine's
//                  best case) and one per block of each layer tensor; then hiqcached Backup and
//                  Restore (sync) of the same tokens through CUDA IPC, as BF16-equivalent GB/s
//                  and as ratios to both baselines (the docs/design.md target is >= 1.6x the
//                  per-tensor copy).
//                  Concurrent: a Backup of half the prefix while a Restore of another half runs,
//                  against each alone and against raw D2H + H2D copies on two streams at once.
//                  Per-layer restore latency: from sending an asynchronous Restore to each
//                  layer's ticket slot, polled from the host; and on the GPU timeline, CUDA
//                  events on the engine's stream that waits on each layer's slot (StreamWait),
//                  from the stream's store of the request's wait value, and from just before the
//                  request is sent.
//   interference   A second client process runs a steady stream of compute kernels (standing
//                  in for the forward pass) and measures its kernel time while the daemon backs
//                  up and restores, against the same process idle. Run without MPS and, with
//                  --mps both, again under a private MPS control daemon; the output says which.
//
// Usage: gpu_bench [--tokens N] [--reps N] [--block-tokens N] [--block-sweep N,N,...]
//                  [--mps auto|off|both] [--interference-seconds S] [--json FILE] [--codec NAME]
// --codec (default int8_per_head; int4_kivi, fp8_e4m3_per_head, ...: hiqcache::CodecName's
// names) is the codec of every pool the benchmark registers; GB/s stay BF16-equivalent.
// --block-tokens (default 64) is the block size of the concurrent, latency and interference
// phases. Each phase runs in a fresh process (so that an MPS phase starts with no CUDA context)
// that starts its own hiqcached ($HIQ_DAEMON_PATH, else the path compiled in) with --device
// cuda. Without a usable GPU the benchmark prints "no GPU: skipped (reason)" and exits 0.
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda_handles.h"
#include "hiqcache/client.h"
#include "hiqcache/cuda_export.h"
#include "hiqcache/pool_spec.h"
#include "kv_check.h"

extern char** environ;

namespace hiqcache {
// The daemon binary: $HIQ_DAEMON_PATH when set (binaries carried to another machine), else the
// one this build made.
inline const char* DaemonPath() {
  const char* env = std::getenv("HIQ_DAEMON_PATH");
  return env != nullptr && env[0] != '\0' ? env : HIQ_DAEMON_BUILD_PATH;
}
}  // namespace hiqcache
#define HIQ_DAEMON_PATH ::hiqcache::DaemonPath()
#include "daemon_process.h"

namespace hiqcache {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kLayers = 36, kHeads = 8, kDim = 128;
constexpr uint64_t kRowBytes = uint64_t{kHeads} * kDim * 2;

struct Options {
  std::string mode = "main";
  uint32_t tokens = 2048;
  uint32_t reps = 10;
  uint32_t block_tokens = 64;                         // concurrency, latency, interference
  std::vector<uint32_t> block_sweep = {16, 64, 256};  // transfer ratios, one table each
  std::string mps = "auto";
  double interference_seconds = 3.0;
  std::string json;
  std::string label;    // interference: "without MPS" or "with MPS, ..."
  double duration = 0;  // forward: seconds to measure
  Codec codec = Codec::kInt8PerHead;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
uint64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}
double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::ceil(p * v.size()));
  return v[std::min(i == 0 ? 0 : i - 1, v.size() - 1)];
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "gpu_bench: %s\n", what.c_str());
  std::fflush(stdout);
  std::exit(1);
}
void Check(const Status& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + s.ToString());
}
void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(e));
}

// Results collected for --json, as flat "key": number pairs.
std::map<std::string, double>& Results() {
  static std::map<std::string, double> r;
  return r;
}
void Report(const std::string& key, double value) {
  Results()[key] = value;
  std::printf("RESULT %s=%.4f\n", key.c_str(), value);
}
void WriteJson(const std::string& path) {
  if (path.empty()) return;
  std::ofstream out(path, std::ios::app);
  out << "{";
  bool first = true;
  for (const auto& [k, v] : Results()) {
    out << (first ? "" : ", ") << "\"" << k << "\": " << v;
    first = false;
  }
  out << "}\n";
}

// --- MPS -----------------------------------------------------------------------------------------

bool ProcessRunning(const std::string& comm_name) {
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return false;
  bool found = false;
  while (dirent* e = ::readdir(proc)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::ifstream comm(std::string("/proc/") + e->d_name + "/comm");
    std::string name;
    if (std::getline(comm, name) && name.rfind(comm_name, 0) == 0) {
      found = true;
      break;
    }
  }
  ::closedir(proc);
  return found;
}

// Whether CUDA processes started with this environment would be MPS clients: a control daemon
// runs and its pipe directory (CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps) has a control
// pipe.
std::string DetectMps() {
  const char* dir_env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string dir = dir_env != nullptr ? dir_env : "/tmp/nvidia-mps";
  const bool pipe = std::filesystem::exists(dir + "/control");
  const bool daemon = ProcessRunning("nvidia-cuda-mps");
  if (pipe && daemon) return "active (pipe directory " + dir + ")";
  return "not active";
}

std::string FindInPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path != nullptr ? path : "");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    const std::string p = dir + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

int RunShell(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// --- processes -----------------------------------------------------------------------------------

// Runs this binary with `args` (plus extra environment) and waits; its output goes to ours.
int RunSelf(const std::vector<std::string>& args, const std::vector<std::string>& extra_env) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> envp, argv;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  argv.push_back(exe.data());
  std::vector<std::string> a = args;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  pid_t pid;
  if (posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data()) != 0) return -1;
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// --- the engine side: pool, daemon, registration ----------------------------------------------

// Slots of each pool's CudaTicketSlots: one per layer, then the wait slot and the done slot.
constexpr uint32_t kWaitSlot = kLayers, kDoneSlot = kLayers + 1, kNumSlots = kLayers + 2;

// One registered pool over the engine's KV for one block size, with its own ticket slots (tickets
// are per pool), and the keys of one range of contiguous rows.
struct BenchPool {
  PoolHandle handle;
  uint32_t block_tokens = 0;
  std::unique_ptr<CudaTicketSlots> slots;
  std::vector<BlockKey> keys;
  std::vector<uint32_t> rows;
};

struct Engine {
  std::unique_ptr<testing::DaemonProcess> daemon;
  std::unique_ptr<Client> client;
  CudaKvPool kv;
  kernels::CudaStream stream;
  uint32_t tokens = 0;  // the prefix: rows [0, tokens); the pool has twice as many rows
  Codec codec = Codec::kInt8PerHead;

  // `granule`: tokens is rounded down to a multiple of it (the largest block size used).
  void Start(const Options& o, uint32_t granule) {
    codec = o.codec;
    tokens = o.tokens / granule * granule;
    if (tokens == 0) Die("--tokens must be at least the largest block size");
    // $HIQ_GPU_POOL_BYTES: a smaller pool where /dev/shm is small (run_on_device.sh sets it).
    const char* pool_bytes = std::getenv("HIQ_GPU_POOL_BYTES");
    daemon = std::make_unique<testing::DaemonProcess>(
        pool_bytes != nullptr && pool_bytes[0] != '\0' ? pool_bytes : "1GiB",
        std::vector<std::string>{"--device", "cuda"});
    if (!daemon->Start(std::chrono::seconds(60))) Die("hiqcached --device cuda did not start");
    ClientOptions co;
    co.target = daemon->target();
    co.call_timeout = std::chrono::seconds(30);
    auto c = Client::Connect(co);
    Check(c.status(), "Client::Connect");
    client = std::move(c).value();
    CheckCuda(cudaSetDevice(0), "cudaSetDevice");
    Geometry g;
    g.num_layers = kLayers;
    g.num_kv_heads = kHeads;
    g.head_dim = kDim;
    // Twice the prefix in slots, as an engine's pool is larger than one request.
    auto p = CudaKvPool::Allocate(0, g, KvLayout::kSglang, 2 * tokens);
    Check(p.status(), "CudaKvPool::Allocate");
    kv = std::move(p).value();
    auto s = kernels::CudaStream::Create(0);
    Check(s.status(), "CudaStream::Create");
    stream = std::move(s).value();
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t pl = 0; pl < 2; ++pl) {
        Check(gputest::LaunchFillPattern(kv.Head(l, pl, 0, 0), uint64_t{2} * tokens * kHeads * kDim,
                                         7, l * 2 + pl, stream.get()),
              "fill");
      }
    }
    Check(stream.Synchronize(), "fill");
  }

  // Registers a pool of `block_tokens` over the whole KV, with keys for rows
  // [first_row, first_row + count) (count a multiple of block_tokens); `salt` separates key sets.
  BenchPool AddPool(uint32_t block_tokens, uint32_t first_row, uint32_t count,
                    const std::string& salt) {
    BenchPool p;
    p.block_tokens = block_tokens;
    auto ev = CudaTicketSlots::Create(0, kNumSlots);
    Check(ev.status(), "CudaTicketSlots::Create");
    p.slots = std::make_unique<CudaTicketSlots>(std::move(ev).value());
    auto h = client->RegisterPool(
        MakeCudaPoolSpec("Qwen/Qwen3-8B@gpu-bench", kv, block_tokens, p.slots.get(), codec));
    Check(h.status(), "RegisterPool");
    p.handle = *h;
    p.keys = MoreKeys(p, first_row, count, salt);
    p.rows = RowsFrom(first_row, count);
    return p;
  }
  std::vector<BlockKey> MoreKeys(const BenchPool& p, uint32_t first_row, uint32_t count,
                                 const std::string& salt) const {
    std::vector<uint32_t> ids(count);
    for (uint32_t i = 0; i < count; ++i) ids[i] = (first_row + i) * 13 + 1;
    return ComputeBlockKeys(ids, p.block_tokens, salt);
  }
  static std::vector<uint32_t> RowsFrom(uint32_t first_row, uint32_t count) {
    // Contiguous rows: the copy baseline's best case.
    std::vector<uint32_t> rows(count);
    for (uint32_t i = 0; i < count; ++i) rows[i] = first_row + i;
    return rows;
  }

  void Evict(const BenchPool& p, const std::vector<BlockKey>& keys) {
    Check(client->Evict(p.handle, keys).status(), "Evict");
  }
  // A synchronous Backup of `keys` from `rows`, after evicting them: ms, the RPC included.
  double Backup(const BenchPool& p, const std::vector<BlockKey>& keys,
                const std::vector<uint32_t>& rows) {
    Evict(p, keys);
    const auto t0 = Clock::now();
    BackupResult r = client->Backup(p.handle, keys, rows);
    const double ms = Ms(Clock::now() - t0);
    Check(r.status, "Backup");
    if (r.held() != keys.size()) Die("Backup stored " + std::to_string(r.held()) + " blocks");
    return ms;
  }
  double Backup(const BenchPool& p) { return Backup(p, p.keys, p.rows); }

  double Restore(const BenchPool& p, const std::vector<BlockKey>& keys,
                 const std::vector<uint32_t>& rows, int32_t layer_event_base = -1) {
    RestoreOptions o;
    o.layer_event_base = layer_event_base;
    const auto t0 = Clock::now();
    RestoreResult r = client->Restore(p.handle, keys, rows, o);
    const double ms = Ms(Clock::now() - t0);
    Check(r.status, "Restore");
    if (r.restored_blocks != keys.size()) Die("Restore found " + std::to_string(r.restored_blocks));
    return ms;
  }
  double Restore(const BenchPool& p, int32_t layer_event_base = -1) {
    return Restore(p, p.keys, p.rows, layer_event_base);
  }

  void Release(BenchPool& p) {
    Evict(p, p.keys);
    Check(client->ReleasePool(p.handle), "ReleasePool");
    p.handle = {};
  }

  static uint64_t Bf16Bytes(uint32_t count) { return uint64_t{count} * kLayers * 2 * kRowBytes; }
  uint64_t Bf16Bytes() const { return Bf16Bytes(tokens); }
};

// Timing events (cudaEventCreate's default: timing enabled), destroyed with this object.
class TimingEvents {
 public:
  explicit TimingEvents(size_t n) : events_(n, nullptr) {
    for (auto& e : events_) CheckCuda(cudaEventCreate(&e), "cudaEventCreate");
  }
  ~TimingEvents() {
    for (auto e : events_) cudaEventDestroy(e);
  }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
  cudaEvent_t operator[](size_t i) const { return events_[i]; }
  size_t size() const { return events_.size(); }
  // ms from event a to event b (both recorded and complete).
  double Between(size_t a, size_t b) const {
    float t = 0;
    CheckCuda(cudaEventElapsedTime(&t, events_[a], events_[b]), "cudaEventElapsedTime");
    return t;
  }

 private:
  std::vector<cudaEvent_t> events_;
};

// Waits for `event` for at most `timeout` (a stream that waits on a ticket slot that never
// comes would otherwise hang the benchmark).
void AwaitEvent(cudaEvent_t event, std::chrono::seconds timeout, const char* what) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) CheckCuda(e, what);
    if (Clock::now() > deadline) Die(std::string(what) + ": not complete after the timeout");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// --- transfer ------------------------------------------------------------------------------------

// The copy-engine baselines for rows [first_row, first_row + count) of every layer tensor, to and
// from `host` (laid out tensor after tensor), timed with CUDA events: the median of `reps`
// after a warm-up.
struct CopyBaseline {
  Engine* e;
  uint8_t* host;
  uint32_t reps;
  TimingEvents ev{2};

  // One cudaMemcpyAsync per layer tensor (granule 0) or per block of `granule` rows.
  double Time(cudaMemcpyKind kind, uint32_t first_row, uint32_t count, uint32_t granule) {
    const uint64_t piece_rows = granule == 0 ? count : granule;
    std::vector<double> ms;
    for (uint32_t rep = 0; rep < reps + 1; ++rep) {
      CheckCuda(cudaEventRecord(ev[0], e->stream.get()), "cudaEventRecord");
      Enqueue(kind, first_row, count, piece_rows, e->stream.get());
      CheckCuda(cudaEventRecord(ev[1], e->stream.get()), "cudaEventRecord");
      CheckCuda(cudaEventSynchronize(ev[1]), "cudaEventSynchronize");
      if (rep > 0) ms.push_back(ev.Between(0, 1));  // rep 0 warms up
    }
    return Median(ms);
  }
  void Enqueue(cudaMemcpyKind kind, uint32_t first_row, uint32_t count, uint64_t piece_rows,
               CUstream_st* stream) {
    const uint64_t tensor_bytes = uint64_t{count} * kRowBytes;
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t p = 0; p < 2; ++p) {
        uint8_t* h = host + (uint64_t{l} * 2 + p) * tensor_bytes;
        auto* d = reinterpret_cast<uint8_t*>(e->kv.Head(l, p, first_row, 0));
        for (uint64_t r = 0; r < count; r += piece_rows) {
          const uint64_t bytes = std::min<uint64_t>(piece_rows, count - r) * kRowBytes;
          const uint64_t off = r * kRowBytes;
          CheckCuda(kind == cudaMemcpyDeviceToHost
                        ? cudaMemcpyAsync(h + off, d + off, bytes, kind, stream)
                        : cudaMemcpyAsync(d + off, h + off, bytes, kind, stream),
                    "cudaMemcpyAsync");
        }
      }
    }
  }
};

double Gbps(uint64_t bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; }

// Backup and Restore against the raw copies of the same BF16 bytes, for one block size: the
// baselines are measured right before, in the same process and on the same buffers.
void TransferForBlockSize(Engine& e, CopyBaseline& raw, const Options& o, uint32_t bt) {
  BenchPool pool = e.AddPool(bt, 0, e.tokens, "sweep");
  const uint64_t bytes = e.Bf16Bytes();
  const double d2h_ms = raw.Time(cudaMemcpyDeviceToHost, 0, e.tokens, 0);
  const double h2d_ms = raw.Time(cudaMemcpyHostToDevice, 0, e.tokens, 0);  // same bytes back
  const double d2h_blk_ms = raw.Time(cudaMemcpyDeviceToHost, 0, e.tokens, bt);
  const double h2d_blk_ms = raw.Time(cudaMemcpyHostToDevice, 0, e.tokens, bt);
  std::vector<double> backup_ms, restore_ms;
  e.Backup(pool);  // warm-up: staging buffers, first-touch of pool pages
  e.Restore(pool);
  for (uint32_t rep = 0; rep < o.reps; ++rep) {
    backup_ms.push_back(e.Backup(pool));
    restore_ms.push_back(e.Restore(pool));
  }
  const double b_ms = Median(backup_ms), r_ms = Median(restore_ms);
  std::printf("\nblock_tokens %u (%zu blocks of %.2f MB BF16)\n", bt, pool.keys.size(),
              Engine::Bf16Bytes(bt) / 1e6);
  std::printf("%-40s %10s %12s %10s %10s\n", "", "ms (p50)", "GB/s (BF16)", "vs tensor",
              "vs block");
  auto row = [&](const char* name, double ms, double tensor_ms, double block_ms) {
    std::printf("%-40s %10.2f %12.2f %10.2f %10.2f\n", name, ms, Gbps(bytes, ms), tensor_ms / ms,
                block_ms / ms);
  };
  row("cudaMemcpyAsync D2H, one per tensor", d2h_ms, d2h_ms, d2h_blk_ms);
  row("cudaMemcpyAsync D2H, one per block", d2h_blk_ms, d2h_ms, d2h_blk_ms);
  row("hiqcached Backup (sync, RPC incl.)", b_ms, d2h_ms, d2h_blk_ms);
  row("cudaMemcpyAsync H2D, one per tensor", h2d_ms, h2d_ms, h2d_blk_ms);
  row("cudaMemcpyAsync H2D, one per block", h2d_blk_ms, h2d_ms, h2d_blk_ms);
  row("hiqcached Restore (sync, RPC incl.)", r_ms, h2d_ms, h2d_blk_ms);
  std::printf("target >= 1.6x the per-tensor copy: backup %s (%.2fx), restore %s (%.2fx)\n",
              d2h_ms / b_ms >= 1.6 ? "met" : "NOT met", d2h_ms / b_ms,
              h2d_ms / r_ms >= 1.6 ? "met" : "NOT met", h2d_ms / r_ms);
  const std::string sfx = "_bt" + std::to_string(bt);
  auto report = [&](const std::string& key, double v) {
    Report(key + sfx, v);
    if (bt == o.block_tokens) Report(key, v);  // the default block size, unsuffixed
  };
  report("raw_d2h_gbps", Gbps(bytes, d2h_ms));
  report("raw_h2d_gbps", Gbps(bytes, h2d_ms));
  report("raw_d2h_per_block_gbps", Gbps(bytes, d2h_blk_ms));
  report("raw_h2d_per_block_gbps", Gbps(bytes, h2d_blk_ms));
  report("backup_gbps_bf16_equiv", Gbps(bytes, b_ms));
  report("restore_gbps_bf16_equiv", Gbps(bytes, r_ms));
  report("backup_ratio_vs_raw", d2h_ms / b_ms);
  report("restore_ratio_vs_raw", h2d_ms / r_ms);
  report("backup_ratio_vs_raw_per_block", d2h_blk_ms / b_ms);
  report("restore_ratio_vs_raw_per_block", h2d_blk_ms / r_ms);
  report("backup_ms_p99", Percentile(backup_ms, 0.99));
  report("restore_ms_p99", Percentile(restore_ms, 0.99));
  e.Release(pool);
}

// A Backup of the first half of the prefix and a Restore of another half-prefix of rows at the
// same time (two threads, one client), against each alone and against the raw copies of the same
// bytes in both directions at once (two streams).
void Concurrent(Engine& e, CopyBaseline& raw, const Options& o) {
  const uint32_t bt = o.block_tokens;
  const uint32_t half = e.tokens / 2 / bt * bt;
  if (half == 0) {
    std::printf("\nconcurrent: skipped (--tokens too small for two halves of %u-token blocks)\n",
                bt);
    return;
  }
  BenchPool pool = e.AddPool(bt, 0, half, "concurrent-backup");
  const std::vector<uint32_t> restore_rows = Engine::RowsFrom(e.tokens, half);
  const std::vector<BlockKey> restore_keys = e.MoreKeys(pool, e.tokens, half, "concurrent-restore");
  const uint64_t bytes = Engine::Bf16Bytes(half);
  e.Backup(pool, restore_keys, restore_rows);  // what the restores read

  // Raw: D2H of rows [0, half) on one stream while H2D of rows [tokens, tokens + half) runs on
  // another, from one start event to the later of the two ends.
  auto s2 = kernels::CudaStream::Create(0);
  Check(s2.status(), "CudaStream::Create");
  auto host2 = kernels::PinnedHostBuffer::Create(bytes);
  Check(host2.status(), "cudaMallocHost");
  std::memset(host2->data(), 0, bytes);  // finite BF16 in the rows the raw H2D copies overwrite
  CopyBaseline raw2{&e, host2->data(), o.reps};
  TimingEvents ev(3);
  std::vector<double> raw_ms;
  for (uint32_t rep = 0; rep < o.reps + 1; ++rep) {
    CheckCuda(cudaEventRecord(ev[0], e.stream.get()), "cudaEventRecord");
    CheckCuda(cudaStreamWaitEvent(s2->get(), ev[0], 0), "cudaStreamWaitEvent");
    raw.Enqueue(cudaMemcpyDeviceToHost, 0, half, half, e.stream.get());
    raw2.Enqueue(cudaMemcpyHostToDevice, e.tokens, half, half, s2->get());
    CheckCuda(cudaEventRecord(ev[1], s2->get()), "cudaEventRecord");
    CheckCuda(cudaStreamWaitEvent(e.stream.get(), ev[1], 0), "cudaStreamWaitEvent");
    CheckCuda(cudaEventRecord(ev[2], e.stream.get()), "cudaEventRecord");
    CheckCuda(cudaEventSynchronize(ev[2]), "cudaEventSynchronize");
    if (rep > 0) raw_ms.push_back(ev.Between(0, 2));
  }

  std::vector<double> b_alone, r_alone, b_conc, r_conc, wall;
  e.Backup(pool);  // warm-up
  e.Restore(pool, restore_keys, restore_rows);
  for (uint32_t rep = 0; rep < o.reps; ++rep) {
    b_alone.push_back(e.Backup(pool));
    r_alone.push_back(e.Restore(pool, restore_keys, restore_rows));
  }
  for (uint32_t rep = 0; rep < o.reps; ++rep) {
    e.Evict(pool, pool.keys);
    double b_ms = 0, r_ms = 0;
    const auto t0 = Clock::now();
    std::thread backup([&] {
      const auto t = Clock::now();
      BackupResult r = e.client->Backup(pool.handle, pool.keys, pool.rows);
      b_ms = Ms(Clock::now() - t);
      Check(r.status, "Backup (concurrent)");
      if (r.held() != pool.keys.size()) Die("concurrent Backup stored too few blocks");
    });
    r_ms = e.Restore(pool, restore_keys, restore_rows);
    backup.join();
    wall.push_back(Ms(Clock::now() - t0));
    b_conc.push_back(b_ms);
    r_conc.push_back(r_ms);
  }
  const double raw_p50 = Median(raw_ms), wall_p50 = Median(wall);
  std::printf(
      "\nconcurrent backup + restore (block_tokens %u, %u tokens each way, %.1f MB BF16 each)\n",
      bt, half, bytes / 1e6);
  std::printf("  raw D2H + H2D on two streams   %8.2f ms  %7.2f GB/s both ways\n", raw_p50,
              Gbps(2 * bytes, raw_p50));
  std::printf("  hiqcached Backup + Restore     %8.2f ms  %7.2f GB/s both ways  ratio %.2f\n",
              wall_p50, Gbps(2 * bytes, wall_p50), raw_p50 / wall_p50);
  std::printf("  Backup  alone %8.2f ms, with a Restore running %8.2f ms\n", Median(b_alone),
              Median(b_conc));
  std::printf("  Restore alone %8.2f ms, with a Backup running  %8.2f ms\n", Median(r_alone),
              Median(r_conc));
  Report("concurrent_raw_gbps_both_ways", Gbps(2 * bytes, raw_p50));
  Report("concurrent_gbps_bf16_equiv_both_ways", Gbps(2 * bytes, wall_p50));
  Report("concurrent_ratio_vs_raw", raw_p50 / wall_p50);
  Report("concurrent_backup_ms_p50", Median(b_conc));
  Report("concurrent_restore_ms_p50", Median(r_conc));
  Report("alone_backup_ms_p50", Median(b_alone));
  Report("alone_restore_ms_p50", Median(r_alone));
  e.Evict(pool, restore_keys);
  e.Release(pool);
}

// Time to each restored layer. On the host: from sending an asynchronous Restore to each layer's
// slot, polled in layer order. On the GPU timeline (CUDA events on the engine's stream, which
// waits on each layer's ticket slot with StreamWait): (a) from the engine's stream storing the
// request's wait value (the rows are the engine's to give: the daemon starts once it sees it) to
// each layer, and (b) from an event recorded just before the Restore is sent (no wait value) to
// each layer, the RPC included.
void LayerLatency(Engine& e, const Options& o) {
  BenchPool pool = e.AddPool(o.block_tokens, 0, e.tokens, "latency");
  e.Backup(pool);
  const CudaTicketSlots& slots = *pool.slots;
  std::vector<std::vector<double>> host_ms(kLayers), gpu_wait_ms(kLayers), gpu_req_ms(kLayers);
  std::vector<double> reply_ms;
  TimingEvents ev(kLayers + 1);  // [0] the start, [1 + l] layer l usable on the stream
  auto enqueue_layer_waits = [&](uint64_t ticket) {
    for (uint32_t l = 0; l < kLayers; ++l) {
      Check(slots.StreamWait(e.stream.get(), l, ticket), "StreamWait");
      CheckCuda(cudaEventRecord(ev[1 + l], e.stream.get()), "cudaEventRecord");
    }
  };
  auto check_done = [&](uint64_t ticket, const char* what) {
    Check(slots.Wait(kDoneSlot, ticket, std::chrono::seconds(10)), what);
  };
  for (uint32_t rep = 0; rep < o.reps; ++rep) {
    // Host view, and (b): the start event is recorded on the idle stream right before sending.
    CheckCuda(cudaEventRecord(ev[0], e.stream.get()), "cudaEventRecord");
    RestoreOptions ro;
    ro.layer_event_base = 0;
    ro.done_event = kDoneSlot;
    ro.sync = false;
    const auto t0 = Clock::now();
    RestoreResult r = e.client->Restore(pool.handle, pool.keys, pool.rows, ro);
    reply_ms.push_back(Ms(Clock::now() - t0));
    Check(r.status, "Restore (async)");
    enqueue_layer_waits(r.ticket);
    for (uint32_t l = 0; l < kLayers; ++l) {
      Check(slots.Wait(l, r.ticket, std::chrono::seconds(10)), "layer slot");
      host_ms[l].push_back(Ms(Clock::now() - t0));
    }
    AwaitEvent(ev[kLayers], std::chrono::seconds(10), "layer waits on the stream");
    check_done(r.ticket, "done slot");
    for (uint32_t l = 0; l < kLayers; ++l) gpu_req_ms[l].push_back(ev.Between(0, 1 + l));

    // (a): the request waits for a wait value that the engine's stream stores after the start
    // event; the stream then waits on each layer's slot.
    const uint64_t wait_value = (slots.Read(kWaitSlot) & ~kEventFailedBit) + 1;
    ro.wait_event = kWaitSlot;
    ro.wait_value = wait_value;
    r = e.client->Restore(pool.handle, pool.keys, pool.rows, ro);
    Check(r.status, "Restore (async, with a wait value)");
    CheckCuda(cudaEventRecord(ev[0], e.stream.get()), "cudaEventRecord");
    Check(slots.StreamWrite(e.stream.get(), kWaitSlot, wait_value), "StreamWrite");
    enqueue_layer_waits(r.ticket);
    AwaitEvent(ev[kLayers], std::chrono::seconds(10), "layer waits on the stream");
    check_done(r.ticket, "done slot (with a wait value)");
    for (uint32_t l = 0; l < kLayers; ++l) gpu_wait_ms[l].push_back(ev.Between(0, 1 + l));
  }
  std::printf("\nper-layer restore latency, block_tokens %u, %u tokens (ms, p50 of %u)\n",
              o.block_tokens, e.tokens, o.reps);
  std::printf("  reply (sync=false) %.3f\n", Median(reply_ms));
  std::printf("  %-8s %12s %16s %16s\n", "layer", "host poll", "GPU from request", "GPU from wait");
  for (uint32_t l = 0; l < kLayers; ++l) {
    if (l < 4 || l % 8 == 7 || l == kLayers - 1) {
      std::printf("  %-8u %12.3f %16.3f %16.3f\n", l, Median(host_ms[l]), Median(gpu_req_ms[l]),
                  Median(gpu_wait_ms[l]));
    }
    Report("restore_layer_ms_p50_" + std::to_string(l), Median(host_ms[l]));
  }
  std::printf(
      "time to first layer on the GPU timeline: %.3f ms from the wait value's store, %.3f ms "
      "from the request (host poll: %.3f ms)\n",
      Median(gpu_wait_ms.front()), Median(gpu_req_ms.front()), Median(host_ms.front()));
  Report("restore_first_layer_ms_p50", Median(host_ms.front()));
  Report("restore_last_layer_ms_p50", Median(host_ms.back()));
  Report("restore_async_reply_ms_p50", Median(reply_ms));
  Report("ttfl_gpu_from_wait_value_ms_p50", Median(gpu_wait_ms.front()));
  Report("ttfl_gpu_from_wait_value_ms_p99", Percentile(gpu_wait_ms.front(), 0.99));
  Report("ttfl_gpu_from_request_ms_p50", Median(gpu_req_ms.front()));
  Report("last_layer_gpu_from_wait_value_ms_p50", Median(gpu_wait_ms.back()));
  Report("last_layer_gpu_from_request_ms_p50", Median(gpu_req_ms.back()));
  e.Release(pool);
}

int RunTransfer(const Options& o) {
  uint32_t granule = o.block_tokens;
  for (uint32_t bt : o.block_sweep) granule = std::max(granule, bt);
  Engine e;
  e.Start(o, granule);
  const uint64_t bytes = e.Bf16Bytes();
  std::printf("transfer: %u tokens of Qwen3-8B (%.1f MB BF16), block sizes", e.tokens, bytes / 1e6);
  for (uint32_t bt : o.block_sweep) std::printf(" %u", bt);
  std::printf(", %u reps\n", o.reps);
  cudaDeviceProp prop;
  CheckCuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  auto host = kernels::PinnedHostBuffer::Create(bytes);
  Check(host.status(), "cudaMallocHost");
  CopyBaseline raw{&e, host->data(), o.reps};
  for (uint32_t bt : o.block_sweep) TransferForBlockSize(e, raw, o, bt);
  Concurrent(e, raw, o);
  LayerLatency(e, o);
  WriteJson(o.json);
  return 0;
}

// --- interference --------------------------------------------------------------------------------

// The forward-pass stand-in: back-to-back compute kernels of about 1 ms on all SMs, timed one
// by one (launch + synchronize), reported in 50 ms windows with monotonic timestamps.
int RunForward(const Options& o) {
  CheckCuda(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop;
  CheckCuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const uint32_t blocks = 4 * prop.multiProcessorCount;
  auto sink = kernels::DeviceBuffer::Create(0, size_t{blocks} * 256 * 4);
  Check(sink.status(), "sink");
  auto s = kernels::CudaStream::Create(0);
  Check(s.status(), "stream");
  float* out = reinterpret_cast<float*>(sink->data());
  auto run = [&](uint32_t iters) {
    const auto t0 = Clock::now();
    Check(gputest::LaunchBusyKernel(out, blocks, iters, s->get()), "busy kernel");
    Check(s->Synchronize(), "busy kernel");
    return Ms(Clock::now() - t0);
  };
  uint32_t iters = 4096;
  run(iters);
  for (int i = 0; i < 4; ++i) {  // calibrate to ~1 ms
    const double ms = run(iters);
    iters = static_cast<uint32_t>(std::clamp(iters * (1.0 / std::max(ms, 1e-3)), 64.0, 1e7));
  }
  std::printf("ready %u\n", iters);
  std::fflush(stdout);
  const uint64_t end = NowNs() + static_cast<uint64_t>(o.duration * 1e9);
  uint64_t win_start = NowNs(), count = 0;
  double sum = 0;
  while (NowNs() < end) {
    sum += run(iters);
    ++count;
    const uint64_t now = NowNs();
    if (now - win_start >= 50'000'000ull) {
      std::printf("win %llu %llu %llu %.6f\n", static_cast<unsigned long long>(win_start),
                  static_cast<unsigned long long>(now), static_cast<unsigned long long>(count),
                  sum);
      win_start = now;
      count = 0;
      sum = 0;
    }
  }
  std::printf("done\n");
  std::fflush(stdout);
  return 0;
}

int RunInterference(const Options& o) {
  Engine e;
  e.Start(o, o.block_tokens);
  BenchPool pool = e.AddPool(o.block_tokens, 0, e.tokens, "interference");
  e.Backup(pool);
  const double idle_s = 1.5, busy_s = o.interference_seconds, tail_s = 1.0;
  // The forward process, its stdout on a pipe.
  int fds[2];
  if (::pipe(fds) != 0) Die("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  std::string exe = "/proc/self/exe", mode = "--mode", forward = "forward", dur = "--duration",
              dur_v = std::to_string(idle_s + busy_s + tail_s + 0.5);
  char* argv[] = {exe.data(), mode.data(), forward.data(), dur.data(), dur_v.data(), nullptr};
  pid_t pid;
  if (posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, environ) != 0) Die("spawn forward");
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  FILE* in = ::fdopen(fds[0], "r");
  char line[256];
  if (std::fgets(line, sizeof(line), in) == nullptr || std::strncmp(line, "ready", 5) != 0) {
    Die("forward process did not start");
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(idle_s));
  const uint64_t busy_start = NowNs();
  uint64_t moved = 0;
  uint32_t ops = 0;
  while (NowNs() - busy_start < static_cast<uint64_t>(busy_s * 1e9)) {
    e.Backup(pool);
    e.Restore(pool, 0);
    moved += 2 * e.Bf16Bytes();
    ops += 2;
  }
  const uint64_t busy_end = NowNs();
  std::vector<double> idle_ms, busy_ms;
  while (std::fgets(line, sizeof(line), in) != nullptr) {
    unsigned long long a, b, n;
    double sum;
    if (std::sscanf(line, "win %llu %llu %llu %lf", &a, &b, &n, &sum) != 4 || n == 0) continue;
    const double per = sum / n;
    if (b <= busy_start || a >= busy_end)
      idle_ms.push_back(per);
    else if (a >= busy_start && b <= busy_end)
      busy_ms.push_back(per);
  }
  std::fclose(in);
  int status;
  ::waitpid(pid, &status, 0);
  if (idle_ms.empty() || busy_ms.empty()) Die("forward process reported no windows");
  const double idle = Median(idle_ms), busy = Median(busy_ms);
  const std::string tag = o.label.rfind("with MPS", 0) == 0 ? "mps" : "no_mps";
  std::printf(
      "\ninterference (%s): forward kernel %.3f ms idle, %.3f ms while hiqcached moves "
      "%.1f GB/s BF16-equiv (%u ops): slowdown %.1f%%\n",
      o.label.c_str(), idle, busy, moved / ((busy_end - busy_start) * 1e-9) / 1e9, ops,
      100.0 * (busy / idle - 1.0));
  Report("interference_" + tag + "_idle_kernel_ms", idle);
  Report("interference_" + tag + "_busy_kernel_ms", busy);
  Report("interference_" + tag + "_slowdown_pct", 100.0 * (busy / idle - 1.0));
  Report("interference_" + tag + "_daemon_gbps", moved / ((busy_end - busy_start) * 1e-9) / 1e9);
  e.Release(pool);
  WriteJson(o.json);
  return 0;
}

// --- main ----------------------------------------------------------------------------------------

std::string JoinList(const std::vector<uint32_t>& v) {
  std::string out;
  for (uint32_t x : v) out += (out.empty() ? "" : ",") + std::to_string(x);
  return out;
}
// "16,64,256": the positive values, in order; empty for a malformed list.
std::vector<uint32_t> ParseList(const std::string& text) {
  std::vector<uint32_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const unsigned long v = std::strtoul(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v == 0 || v > 4096) return {};
    out.push_back(static_cast<uint32_t>(v));
  }
  return out;
}

std::vector<std::string> PassThrough(const Options& o) {
  return {"--tokens",
          std::to_string(o.tokens),
          "--reps",
          std::to_string(o.reps),
          "--block-tokens",
          std::to_string(o.block_tokens),
          "--block-sweep",
          JoinList(o.block_sweep),
          "--interference-seconds",
          std::to_string(o.interference_seconds),
          "--json",
          o.json,
          "--codec",
          CodecName(o.codec)};
}

int RunMain(const Options& o) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);  // no context: an MPS phase may follow
  if (err != cudaSuccess || count == 0) {
    std::printf("no GPU: skipped (%s)\n",
                err != cudaSuccess
                    ? (std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)).c_str()
                    : "no CUDA device visible");
    return 0;
  }
  if (!o.json.empty()) std::filesystem::remove(o.json);
  std::printf("codec: %s\n", CodecName(o.codec));
  int rc = 0;
  std::vector<std::string> args = {"--mode", "transfer"};
  for (auto& a : PassThrough(o)) args.push_back(a);
  if (RunSelf(args, {}) != 0) rc = 1;

  if (o.mps == "off") return rc;
  const std::string state = DetectMps();
  std::printf("\nMPS: %s\n", state.c_str());
  args = {"--mode", "interference", "--label",
          state == "not active" ? "without MPS" : "with MPS, " + state};
  for (auto& a : PassThrough(o)) args.push_back(a);
  if (RunSelf(args, {}) != 0) rc = 1;
  if (o.mps != "both") return rc;
  if (state != "not active") {
    std::printf("MPS already active: the run without MPS is not possible here\n");
    return rc;
  }
  const std::string control = FindInPath("nvidia-cuda-mps-control");
  if (control.empty()) {
    std::printf(
        "MPS: cannot start (nvidia-cuda-mps-control not in PATH): measured without MPS only\n");
    return rc;
  }
  const std::string dir = "/tmp/hiq-mps-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir + "/pipe");
  std::filesystem::create_directories(dir + "/log");
  const std::string env =
      "CUDA_MPS_PIPE_DIRECTORY=" + dir + "/pipe CUDA_MPS_LOG_DIRECTORY=" + dir + "/log ";
  if (RunShell(env + control + " -d") != 0) {
    std::printf("MPS: cannot start a private control daemon (%s -d failed)\n", control.c_str());
    return rc;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::printf("\nMPS: active (private control daemon, pipe directory %s/pipe)\n", dir.c_str());
  args = {"--mode", "interference", "--label", "with MPS, private control daemon"};
  for (auto& a : PassThrough(o)) args.push_back(a);
  // Optional measurement: a failure under MPS (e.g. an MPS server this machine refuses) is
  // reported, not fatal.
  const int mps_rc = RunSelf(
      args, {"CUDA_MPS_PIPE_DIRECTORY=" + dir + "/pipe", "CUDA_MPS_LOG_DIRECTORY=" + dir + "/log"});
  if (mps_rc != 0) std::printf("MPS: the interference run under MPS failed (exit %d)\n", mps_rc);
  RunShell("echo quit | " + env + control);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}

}  // namespace
}  // namespace hiqcache

int main(int argc, char** argv) {
  hiqcache::Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--mode")
      o.mode = v;
    else if (a == "--tokens")
      o.tokens = static_cast<uint32_t>(std::stoul(v));
    else if (a == "--reps")
      o.reps = std::max(1u, static_cast<uint32_t>(std::stoul(v)));
    else if (a == "--block-tokens")
      o.block_tokens = std::max(1u, static_cast<uint32_t>(std::stoul(v)));
    else if (a == "--block-sweep") {
      o.block_sweep = hiqcache::ParseList(v);
      if (o.block_sweep.empty()) {
        std::fprintf(stderr, "gpu_bench: --block-sweep wants block sizes like 16,64,256\n");
        return 2;
      }
    } else if (a == "--mps")
      o.mps = v;
    else if (a == "--interference-seconds")
      o.interference_seconds = std::stod(v);
    else if (a == "--json")
      o.json = v;
    else if (a == "--label")
      o.label = v;
    else if (a == "--duration")
      o.duration = std::stod(v);
    else if (a == "--codec") {
      bool known = false;
      std::string names;  // for the error
      for (const hiqcache::Codec c :
           {hiqcache::Codec::kInt8PerHead, hiqcache::Codec::kRaw, hiqcache::Codec::kFp8E4m3PerHead,
            hiqcache::Codec::kInt4G32PerHead, hiqcache::Codec::kInt4Kivi,
            hiqcache::Codec::kInt4Hadamard, hiqcache::Codec::kInt5Allot,
            hiqcache::Codec::kInt6Allot, hiqcache::Codec::kInt4Allot}) {
        names += std::string(names.empty() ? "" : ", ") + hiqcache::CodecName(c);
        if (v == hiqcache::CodecName(c)) {
          o.codec = c;
          known = true;
        }
      }
      if (!known) {
        std::fprintf(stderr, "gpu_bench: --codec wants one of %s, got %s\n", names.c_str(),
                     v.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "gpu_bench: unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  if (o.mode == "transfer") return hiqcache::RunTransfer(o);
  if (o.mode == "interference") return hiqcache::RunInterference(o);
  if (o.mode == "forward") return hiqcache::RunForward(o);
  return hiqcache::RunMain(o);
}
