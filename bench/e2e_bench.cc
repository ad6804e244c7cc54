// e2e_bench: end-to-end Backup and Restore of a 2,048-token Qwen3-8B prefix through a real
// hiqcached (HOST backend), reported as GB/s of BF16-equivalent bytes and as a ratio to memcpy of
// the same bytes measured in the same run; Lookup latency p50/p99; the RPC share of a restore.
//
// Usage: e2e_bench [--tokens N] [--reps N] [--pool-bytes SIZE] [--target ADDR]
//                  [--huge-pages MODE[,MODE...]] [--daemon-arg=FLAG]...
// Without --target it starts its own daemon (path compiled in) on a temporary socket, with every
// --daemon-arg=FLAG appended to its command line (e.g. --daemon-arg=--transfer-chunk-bytes=1GiB),
// and also reports the daemon's CPU time over each operation's wall time ("daemon cores").
// The engine's KV is a named /dev/shm object; --huge-pages puts it in a memfd instead, created
// with each HugePages mode in turn (off, auto, require), and measures each against the same
// daemon in the same run, each with its own memcpy baseline, printing what backed the pages.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "daemon_process.h"
#include "gaussian_kv.h"
#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"

namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  size_t i = static_cast<size_t>(std::ceil(p * v.size())) - 1;
  return v[std::min(i, v.size() - 1)];
}

// utime + stime of process `pid` in seconds (/proc/<pid>/stat), or -1 when unreadable.
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (pid <= 0 || !std::getline(in, line)) return -1;
  const size_t close = line.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return -1;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return double(utime + stime) / double(::sysconf(_SC_CLK_TCK));
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t tokens = 2048, reps = 7;
  std::string pool_bytes = "2GiB", target;
  std::vector<std::string> daemon_args;
  std::vector<hiqcache::HugePages> huge_modes;  // empty: the KV in a named shm object
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--daemon-arg=", 0) == 0) {
      daemon_args.push_back(a.substr(std::strlen("--daemon-arg=")));
      continue;
    }
    if (i + 1 >= argc) break;
    const char* v = argv[++i];
    if (a == "--tokens")
      tokens = static_cast<uint32_t>(std::stoul(v));
    else if (a == "--reps")
      reps = static_cast<uint32_t>(std::stoul(v));
    else if (a == "--pool-bytes")
      pool_bytes = v;
    else if (a == "--target")
      target = v;
    else if (a == "--huge-pages") {
      std::string list = v;
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        auto mode = hiqcache::ParseHugePages(list.substr(at, comma - at), "--huge-pages");
        if (!mode.ok()) return std::fprintf(stderr, "%s\n", mode.status().ToString().c_str()), 2;
        huge_modes.push_back(*mode);
        at = comma + 1;
      }
    }
  }
  const uint32_t block_tokens = 64;
  tokens = tokens / block_tokens * block_tokens;
  const uint32_t blocks = tokens / block_tokens;

  std::unique_ptr<hiqcache::testing::DaemonProcess> daemon;
  if (target.empty()) {
    daemon = std::make_unique<hiqcache::testing::DaemonProcess>(pool_bytes, daemon_args);
    if (!daemon->Start()) {
      std::fprintf(stderr, "e2e_bench: hiqcached did not start\n");
      return 1;
    }
    target = daemon->target();
  }
  auto client = hiqcache::Client::Connect(target);
  if (!client.ok())
    return std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str()), 1;

  // One measurement of the engine's KV in `kv_name` ("" = a named shm object) on `huge_pages`.
  auto measure = [&](uint32_t variant, const std::string& kv_name,
                     hiqcache::HugePages huge_pages) -> int {
    // Rows [0, tokens) are backed up, rows [tokens, 2*tokens) receive the restore.
    auto kv = hiqcache::bench::GaussianQwen3Kv(2 * tokens, tokens, kv_name, huge_pages);
    if (!kv.ok()) return std::fprintf(stderr, "kv: %s\n", kv.status().ToString().c_str()), 1;
    const hiqcache::Geometry& g = kv->geometry();
    const std::string what =
        kv_name.empty() ? std::string("a named shm object in /dev/shm")
                        : "a memfd, huge_pages=" + std::string(HugePagesName(huge_pages)) + ": " +
                              (kv->shm().huge_page_backing() == hiqcache::HugePageBacking::kNone
                                   ? "4 KiB"
                                   : HugePageBackingName(kv->shm().huge_page_backing())) +
                              " pages";
    auto spec = hiqcache::MakeHostPoolSpec("Qwen/Qwen3-8B@bench", *kv, block_tokens);
    auto pool = (*client)->RegisterPool(spec);
    if (!pool.ok())
      return std::fprintf(stderr, "register: %s\n", pool.status().ToString().c_str()), 1;
    auto info = (*client)->PoolInfo(*pool);

    std::vector<uint32_t> src_rows(tokens), dst_rows(tokens);
    for (uint32_t i = 0; i < tokens; ++i) {
      src_rows[i] = i;
      dst_rows[i] = tokens + i;
    }
    const double bf16_bytes = double(tokens) * g.BytesPerToken();
    std::vector<uint8_t> a(static_cast<size_t>(bf16_bytes)), b(a.size());
    std::memset(a.data(), 1, a.size());
    std::memset(b.data(), 2, b.size());

    std::vector<double> t_memcpy, t_backup, t_restore, t_lookup;
    // The daemon's CPU seconds per operation (its own daemon only; 10 ms ticks).
    const pid_t dpid = daemon ? daemon->pid() : -1;
    double cpu_backup = 0, cpu_restore = 0, wall_backup = 0, wall_restore = 0;
    std::vector<uint32_t> token_ids(tokens);
    for (uint32_t rep = 0; rep < reps; ++rep) {
      auto t0 = Clock::now();
      std::memcpy(b.data(), a.data(), a.size());
      t_memcpy.push_back(Seconds(Clock::now() - t0));

      for (uint32_t i = 0; i < tokens; ++i) token_ids[i] = variant * 7919u + rep * 1000003u + i;
      auto keys = hiqcache::ComputeBlockKeys(token_ids, block_tokens, "e2e");
      double c0 = CpuSeconds(dpid);
      t0 = Clock::now();
      auto br = (*client)->Backup(*pool, keys, src_rows);
      t_backup.push_back(Seconds(Clock::now() - t0));
      cpu_backup += CpuSeconds(dpid) - c0;
      wall_backup += t_backup.back();
      if (!br.status.ok() || br.held() != blocks) {
        std::fprintf(stderr, "backup failed: %s\n", br.status.ToString().c_str());
        return 1;
      }
      c0 = CpuSeconds(dpid);
      t0 = Clock::now();
      auto rr = (*client)->Restore(*pool, keys, dst_rows);
      t_restore.push_back(Seconds(Clock::now() - t0));
      cpu_restore += CpuSeconds(dpid) - c0;
      wall_restore += t_restore.back();
      if (!rr.status.ok() || rr.restored_blocks != blocks) {
        std::fprintf(stderr, "restore failed: %s\n", rr.status.ToString().c_str());
        return 1;
      }
      for (int i = 0; i < 200; ++i) {
        t0 = Clock::now();
        auto lr = (*client)->Lookup(*pool, keys);
        t_lookup.push_back(Seconds(Clock::now() - t0));
        if (lr.prefix_blocks != blocks) return std::fprintf(stderr, "lookup miss\n"), 1;
      }
    }
    // A restore of zero blocks costs one RPC and no codec work: the per-call overhead.
    std::vector<double> t_empty;
    for (int i = 0; i < 200; ++i) {
      auto t0 = Clock::now();
      (void)(*client)->Restore(*pool, {}, {});
      t_empty.push_back(Seconds(Clock::now() - t0));
    }

    const double m = Median(t_memcpy), bk = Median(t_backup), rs = Median(t_restore);
    const double gb = bf16_bytes / 1e9;
    std::printf(
        "e2e_bench: %u tokens of Qwen3-8B (36x8x128 BF16), %u blocks of %u tokens, "
        "%.1f MB BF16, medians of %u runs\n",
        tokens, blocks, block_tokens, bf16_bytes / 1e6, reps);
    std::printf("  engine KV                 %s\n", what.c_str());
    std::printf("  stored bytes/token        %llu (BF16 %llu)\n",
                info.ok() ? static_cast<unsigned long long>(info->encoded_bytes_per_token) : 0ull,
                static_cast<unsigned long long>(g.BytesPerToken()));
    std::printf("  memcpy (1 thread)         %7.2f GB/s\n", gb / m);
    std::printf("  Backup  (sync, e2e)       %7.2f GB/s BF16-equivalent  = %.2fx memcpy\n", gb / bk,
                m / bk);
    std::printf("  Restore (sync, e2e)       %7.2f GB/s BF16-equivalent  = %.2fx memcpy\n", gb / rs,
                m / rs);
    if (dpid > 0 && wall_backup > 0 && wall_restore > 0) {
      std::printf("  daemon cores (CPU time / wall, all runs): Backup %.2f  Restore %.2f\n",
                  cpu_backup / wall_backup, cpu_restore / wall_restore);
      // Bytes per CPU-second of the daemon: what a busy machine's time slicing leaves alone.
      if (cpu_backup > 0 && cpu_restore > 0) {
        std::printf("  per daemon CPU-second (all runs): Backup %.2f GB  Restore %.2f GB\n",
                    gb * reps / cpu_backup, gb * reps / cpu_restore);
      }
    }
    std::printf("  Lookup (%u keys)          p50 %.1f us  p99 %.1f us\n", blocks,
                Percentile(t_lookup, 0.5) * 1e6, Percentile(t_lookup, 0.99) * 1e6);
    std::printf("  empty Restore RPC         p50 %.1f us = %.2f%% of the %u-token restore\n",
                Median(t_empty) * 1e6, 100.0 * Median(t_empty) / rs, tokens);
    (void)(*client)->ReleasePool(*pool);
    return 0;
  };
  if (huge_modes.empty()) {
    if (int rc = measure(0, "", hiqcache::HugePages::kOff); rc != 0) return rc;
  }
  for (size_t i = 0; i < huge_modes.size(); ++i) {
    const std::string kv_name = "memfd:e2e-kv-" + std::string(HugePagesName(huge_modes[i]));
    if (int rc = measure(static_cast<uint32_t>(i + 1), kv_name, huge_modes[i]); rc != 0) return rc;
  }
  if (daemon) daemon->Stop();
  return 0;
}
