// gpu_bench: the CUDA backend against the raw copy engine, same run, same buffers.
//
//   transfer       A Qwen3-8B KV pool in GPU memory (36 layers, 8 KV heads, head_dim 128, BF16),
//                  a 2,048-token prefix in it. Baseline: cudaMemcpyAsync of the prefix's BF16
//                  bytes device -> pinned host and back (one copy per layer tensor, the best
//                  case for the copy engine). Against it: hiqcached Backup and Restore (sync) of
//                  the same tokens through CUDA IPC, as BF16-equivalent GB/s and as ratios (the
//                  DESIGN.md target is >= 1.6x). Then the per-layer restore latency: time from
//                  sending an asynchronous Restore to each layer's IPC event completing.
//   interference   A second client process runs a steady stream of compute kernels (standing
//                  in for the forward pass) and measures its kernel time while the daemon backs
//                  up and restores, against the same process idle. Run without MPS and, with
//                  --mps both, again under a private MPS control daemon; the output says which.
//
// Usage: gpu_bench [--tokens N] [--reps N] [--block-tokens N] [--mps auto|off|both]
//                  [--interference-seconds S] [--json FILE]
// Each phase runs in a fresh process (so that an MPS phase starts with no CUDA context) that
// starts its own hiqcached (path compiled in) with --device cuda. Without a usable GPU the
// benchmark prints "no GPU: skipped (reason)" and exits 0.
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
  uint32_t block_tokens = 64;
  std::string mps = "auto";
  double interference_seconds = 3.0;
  std::string json;
  std::string label;    // interference: "without MPS" or "with MPS, ..."
  double duration = 0;  // forward: seconds to measure
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

struct Engine {
  std::unique_ptr<testing::DaemonProcess> daemon;
  std::unique_ptr<Client> client;
  CudaKvPool kv;
  CudaTicketSlots events;
  PoolHandle pool;
  std::vector<BlockKey> keys;
  std::vector<uint32_t> rows;
  kernels::CudaStream stream;
  uint32_t tokens = 0;

  void Start(const Options& o) {
    tokens = o.tokens / o.block_tokens * o.block_tokens;
    if (tokens == 0) Die("--tokens must be at least --block-tokens");
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
    auto ev = CudaTicketSlots::Create(0, kLayers + 2);
    Check(ev.status(), "CudaTicketSlots::Create");
    events = std::move(ev).value();
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
    auto h = client->RegisterPool(
        MakeCudaPoolSpec("Qwen/Qwen3-8B@gpu-bench", kv, o.block_tokens, &events));
    Check(h.status(), "RegisterPool");
    pool = *h;
    std::vector<uint32_t> ids(tokens);
    for (uint32_t i = 0; i < tokens; ++i) ids[i] = i * 13 + 1;
    keys = ComputeBlockKeys(ids, o.block_tokens);
    rows.resize(tokens);
    for (uint32_t i = 0; i < tokens; ++i) rows[i] = i;  // contiguous: the copy baseline's best case
  }

  double Backup() {
    auto ev = client->Evict(pool, keys);
    Check(ev.status(), "Evict");
    const auto t0 = Clock::now();
    BackupResult r = client->Backup(pool, keys, rows);
    const double ms = Ms(Clock::now() - t0);
    Check(r.status, "Backup");
    if (r.held() != keys.size()) Die("Backup stored " + std::to_string(r.held()) + " blocks");
    return ms;
  }

  double Restore(int32_t layer_event_base = -1) {
    RestoreOptions o;
    o.layer_event_base = layer_event_base;
    const auto t0 = Clock::now();
    RestoreResult r = client->Restore(pool, keys, rows, o);
    const double ms = Ms(Clock::now() - t0);
    Check(r.status, "Restore");
    if (r.restored_blocks != keys.size()) Die("Restore found " + std::to_string(r.restored_blocks));
    return ms;
  }

  uint64_t Bf16Bytes() const { return uint64_t{tokens} * kLayers * 2 * kRowBytes; }
};

// --- transfer ------------------------------------------------------------------------------------

int RunTransfer(const Options& o) {
  Engine e;
  e.Start(o);
  const uint64_t bytes = e.Bf16Bytes();
  const uint64_t tensor_bytes = uint64_t{e.tokens} * kRowBytes;
  std::printf("transfer: %u tokens of Qwen3-8B (%.1f MB BF16), block_tokens %u, %u reps\n",
              e.tokens, bytes / 1e6, o.block_tokens, o.reps);
  cudaDeviceProp prop;
  CheckCuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  // Baseline: the same bytes through the copy engine, one copy per layer tensor.
  auto host = kernels::PinnedHostBuffer::Create(bytes);
  Check(host.status(), "cudaMallocHost");
  cudaEvent_t start, stop;
  CheckCuda(cudaEventCreate(&start), "cudaEventCreate");
  CheckCuda(cudaEventCreate(&stop), "cudaEventCreate");
  auto time_copies = [&](cudaMemcpyKind kind) {
    std::vector<double> ms;
    for (uint32_t rep = 0; rep < o.reps + 1; ++rep) {
      CheckCuda(cudaEventRecord(start, e.stream.get()), "cudaEventRecord");
      for (uint32_t l = 0; l < kLayers; ++l) {
        for (uint32_t p = 0; p < 2; ++p) {
          uint8_t* h = host->data() + (uint64_t{l} * 2 + p) * tensor_bytes;
          void* d = e.kv.Head(l, p, 0, 0);
          CheckCuda(kind == cudaMemcpyDeviceToHost
                        ? cudaMemcpyAsync(h, d, tensor_bytes, kind, e.stream.get())
                        : cudaMemcpyAsync(d, h, tensor_bytes, kind, e.stream.get()),
                    "cudaMemcpyAsync");
        }
      }
      CheckCuda(cudaEventRecord(stop, e.stream.get()), "cudaEventRecord");
      CheckCuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float t = 0;
      CheckCuda(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
      if (rep > 0) ms.push_back(t);  // rep 0 warms up
    }
    return Median(ms);
  };
  const double d2h_ms = time_copies(cudaMemcpyDeviceToHost);
  const double h2d_ms = time_copies(cudaMemcpyHostToDevice);  // writes back the same bytes

  std::vector<double> backup_ms, restore_ms;
  e.Backup();  // warm-up: staging buffers, first-touch of pool pages
  e.Restore();
  for (uint32_t rep = 0; rep < o.reps; ++rep) {
    backup_ms.push_back(e.Backup());
    restore_ms.push_back(e.Restore());
  }
  const double b_ms = Median(backup_ms), r_ms = Median(restore_ms);
  auto gbps = [&](double ms) { return bytes / (ms * 1e-3) / 1e9; };
  std::printf("\n%-34s %10s %12s %8s\n", "", "ms (p50)", "GB/s (BF16)", "ratio");
  std::printf("%-34s %10.2f %12.2f %8s\n", "cudaMemcpyAsync D2H (pinned)", d2h_ms, gbps(d2h_ms),
              "1.00");
  std::printf("%-34s %10.2f %12.2f %8.2f\n", "hiqcached Backup (sync, RPC incl.)", b_ms, gbps(b_ms),
              d2h_ms / b_ms);
  std::printf("%-34s %10.2f %12.2f %8s\n", "cudaMemcpyAsync H2D (pinned)", h2d_ms, gbps(h2d_ms),
              "1.00");
  std::printf("%-34s %10.2f %12.2f %8.2f\n", "hiqcached Restore (sync, RPC incl.)", r_ms,
              gbps(r_ms), h2d_ms / r_ms);
  Report("raw_d2h_gbps", gbps(d2h_ms));
  Report("raw_h2d_gbps", gbps(h2d_ms));
  Report("backup_gbps_bf16_equiv", gbps(b_ms));
  Report("restore_gbps_bf16_equiv", gbps(r_ms));
  Report("backup_ratio_vs_raw", d2h_ms / b_ms);
  Report("restore_ratio_vs_raw", h2d_ms / r_ms);
  Report("backup_ms_p99", Percentile(backup_ms, 0.99));
  Report("restore_ms_p99", Percentile(restore_ms, 0.99));
  std::printf("target >= 1.6x raw copy: backup %s, restore %s\n",
              d2h_ms / b_ms >= 1.6 ? "met" : "NOT met", h2d_ms / r_ms >= 1.6 ? "met" : "NOT met");

  // Per-layer restore latency: the host polls the layer slots, in layer order, for the ticket
  // the asynchronous reply carries, from the moment the request is sent.
  std::vector<std::vector<double>> layer_ms(kLayers);
  std::vector<double> reply_ms;
  for (uint32_t rep = 0; rep < o.reps; ++rep) {
    RestoreOptions ro;
    ro.layer_event_base = 0;
    ro.sync = false;
    const auto t0 = Clock::now();
    RestoreResult r = e.client->Restore(e.pool, e.keys, e.rows, ro);
    reply_ms.push_back(Ms(Clock::now() - t0));
    Check(r.status, "Restore (async)");
    for (uint32_t l = 0; l < kLayers; ++l) {
      Check(e.events.Wait(l, r.ticket, std::chrono::seconds(10)), "layer slot");
      layer_ms[l].push_back(Ms(Clock::now() - t0));
    }
  }
  std::printf(
      "\nper-layer restore latency (ms from sending Restore to the layer's slot, p50 of %u)\n",
      o.reps);
  std::printf("  reply (sync=false) %.3f\n", Median(reply_ms));
  for (uint32_t l = 0; l < kLayers; ++l) {
    std::printf("  layer %2u %8.3f%s", l, Median(layer_ms[l]), (l % 4 == 3) ? "\n" : "");
    Report("restore_layer_ms_p50_" + std::to_string(l), Median(layer_ms[l]));
  }
  Report("restore_first_layer_ms_p50", Median(layer_ms.front()));
  Report("restore_last_layer_ms_p50", Median(layer_ms.back()));
  Report("restore_async_reply_ms_p50", Median(reply_ms));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  Check(e.client->ReleasePool(e.pool), "ReleasePool");
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
  e.Start(o);
  e.Backup();
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
    e.Backup();
    e.Restore(0);
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
  Check(e.client->ReleasePool(e.pool), "ReleasePool");
  WriteJson(o.json);
  return 0;
}

// --- main ----------------------------------------------------------------------------------------

std::vector<std::string> PassThrough(const Options& o) {
  return {"--tokens",
          std::to_string(o.tokens),
          "--reps",
          std::to_string(o.reps),
          "--block-tokens",
          std::to_string(o.block_tokens),
          "--interference-seconds",
          std::to_string(o.interference_seconds),
          "--json",
          o.json};
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
    else if (a == "--mps")
      o.mps = v;
    else if (a == "--interference-seconds")
      o.interference_seconds = std::stod(v);
    else if (a == "--json")
      o.json = v;
    else if (a == "--label")
      o.label = v;
    else if (a == "--duration")
      o.duration = std::stod(v);
    else {
      std::fprintf(stderr, "gpu_bench: unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  if (o.mode == "transfer") return hiqcache::RunTransfer(o);
  if (o.mode == "interference") return hiqcache::RunInterference(o);
  if (o.mode == "forward") return hiqcache::RunForward(o);
  return hiqcache::RunMain(o);
}
