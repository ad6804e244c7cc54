// Load: N client processes x M threads against one daemon for a bounded time, a random mix of
// Backup / Lookup / Restore / Evict over a block universe several times larger than a small pool,
// so the pool evicts constantly. Zero errors are allowed other than the documented misses
// (restored_blocks < requested, BLOCK_REJECTED when every slot is pinned); every restored block
// is verified against the INT8 bound by the worker that restored it. Reports p50/p99 latency per
// op and throughput.
//
// Memory: while the load runs, the daemon's /proc/<pid>/status is sampled. Bounds (docs/design.md's
// pool is the bulk; the rest is documented overhead):
//   RssShmem <= pool bytes + the client KV/event buffers the daemon maps + 8 MiB
//   RssAnon  <= 256 MiB + 4 MiB per registered pool   (gRPC, codec scratch, index, threads)
// Sanitizer builds skip the RssAnon bound (shadow memory).
//
// Two users: when the test runs as root, every other worker runs as uid 61001 (its namespaces
// are its own: namespace_scope = uid), so the daemon serves two users' sessions, quotas and
// namespaces concurrently; every worker of both verifies what it restores.
//
// Environment: HIQ_LOAD_PROCS (4), HIQ_LOAD_THREADS (4), HIQ_LOAD_SECONDS (10).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <fstream>
#include <map>
#include <thread>

#include "daemon_process.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using testing::DaemonProcess;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

uint32_t EnvOr(const char* name, uint32_t def) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? static_cast<uint32_t>(std::stoul(v)) : def;
}

constexpr uint64_t kPoolBytes = 16ull << 20;
constexpr uint64_t kAnonBound = 256ull << 20;
constexpr uint64_t kAnonPerPool = 4ull << 20;

TEST(LoadTest, ProcessesTimesThreadsMixedOpsOnAnEvictingPool) {
  const uint32_t procs = EnvOr("HIQ_LOAD_PROCS", 4);
  const uint32_t threads = EnvOr("HIQ_LOAD_THREADS", 4);
  const uint32_t seconds = EnvOr("HIQ_LOAD_SECONDS", 10);
  constexpr uint32_t kSecondUid = 61001;
  const bool two_users = ::geteuid() == 0;
  DaemonProcess daemon("16MiB", {"--socket-mode", "0666"});
  if (two_users) {
    const std::string sock = daemon.socket_path();
    ::chmod(sock.substr(0, sock.rfind('/')).c_str(), 0755);
  }
  ASSERT_TRUE(daemon.Start()) << "hiqcached did not start";
  const pid_t dpid = daemon.pid();
  const ProcMemory idle = ReadProcMemory(dpid);

  std::atomic<bool> sampling{true};
  ProcMemory peak;
  uint64_t samples = 0;
  std::thread sampler([&] {
    while (sampling.load()) {
      peak.MaxWith(ReadProcMemory(dpid));
      ++samples;
      std::this_thread::sleep_for(50ms);
    }
  });

  const std::string dir = "/tmp/hiq-rob-load-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  ::chmod(dir.c_str(), 0777);  // the second user's workers write their latencies here
  std::vector<std::thread> runners;
  std::vector<it::SpawnResult> results(procs);
  const auto t0 = Clock::now();
  for (uint32_t p = 0; p < procs; ++p) {
    runners.emplace_back([&, p] {
      std::vector<std::string> argv = {HIQ_ROB_WORKER_PATH,
                                       "--target",
                                       daemon.target(),
                                       "--mode",
                                       "load",
                                       "--threads",
                                       std::to_string(threads),
                                       "--seconds",
                                       std::to_string(seconds),
                                       "--universe",
                                       "2000",
                                       "--out",
                                       dir + "/lat." + std::to_string(p)};
      if (two_users && p % 2 == 1) argv = it::AsUid(kSecondUid, argv);
      results[p] = it::Spawn(argv, std::chrono::seconds(seconds + 60));
    });
  }
  for (auto& r : runners) r.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  sampling.store(false);
  sampler.join();

  // Every worker: exit 0, zero errors, zero corrupt.
  std::map<std::string, std::vector<double>> lat;
  uint64_t ops = 0;
  for (uint32_t p = 0; p < procs; ++p) {
    SCOPED_TRACE("worker " + std::to_string(p) + (two_users && p % 2 == 1 ? " (uid 61001)" : ""));
    std::printf("[load] worker %u: %s", p, results[p].out.c_str());
    EXPECT_EQ(results[p].exit_code, 0) << results[p].out;
    EXPECT_NE(results[p].out.find(" errors=0 corrupt=0 "), std::string::npos) << results[p].out;
    std::ifstream in(dir + "/lat." + std::to_string(p));
    std::string op;
    double us;
    while (in >> op >> us) {
      lat[op].push_back(us);
      ++ops;
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);

  auto stats_client = it::Connect(daemon.target());
  ASSERT_NE(stats_client, nullptr);
  auto stats = stats_client->GetStats();
  ASSERT_TRUE(stats.ok());
  uint64_t evictions = 0, rejected = 0;
  for (const auto& n : stats->namespaces) {
    evictions += n.evictions;
    rejected += n.rejected;
  }
  std::printf(
      "[load] %u procs x %u threads, %u s (wall %.1f s): %llu ops, %.0f ops/s; daemon "
      "evictions %llu, rejected %llu\n",
      procs, threads, seconds, wall, static_cast<unsigned long long>(ops),
      ops / static_cast<double>(seconds), static_cast<unsigned long long>(evictions),
      static_cast<unsigned long long>(rejected));
  for (auto& [op, v] : lat) {
    const size_t n = v.size();
    std::printf("[load]   %-8s n=%-7zu p50 %8.0f us  p99 %8.0f us  max %8.0f us\n", op.c_str(), n,
                Percentile(v, 50), Percentile(v, 99), Percentile(v, 100));
  }
  EXPECT_GT(ops, 0u);
  EXPECT_GT(evictions, 0u) << "the pool never evicted: the load did not exercise eviction";

  // Memory of the daemon under the load.
  const uint64_t pools = uint64_t{procs} * threads;
  // Each worker thread's pool: 128 rows of 4 layers x 2 planes x 4 heads x 64 dims x 2 bytes.
  const uint64_t client_buffers = pools * 128ull * 4 * 2 * 4 * 64 * 2;
  std::printf(
      "[load] daemon memory idle: VmRSS %.1f MiB RssAnon %.1f MiB RssShmem %.1f MiB; peak "
      "under load (%llu samples): VmRSS %.1f MiB RssAnon %.1f MiB RssFile %.1f MiB "
      "RssShmem %.1f MiB (pool %.0f MiB + client buffers %.1f MiB)\n",
      MiB(idle.vm_rss), MiB(idle.rss_anon), MiB(idle.rss_shmem),
      static_cast<unsigned long long>(samples), MiB(peak.vm_rss), MiB(peak.rss_anon),
      MiB(peak.rss_file), MiB(peak.rss_shmem), MiB(kPoolBytes), MiB(client_buffers));
  EXPECT_GT(samples, 0u);
  EXPECT_LE(peak.rss_shmem, kPoolBytes + client_buffers + (8ull << 20));
  if (!kSanitized) EXPECT_LE(peak.rss_anon, kAnonBound + pools * kAnonPerPool);
  EXPECT_EQ(daemon.Stop(), 0);
}

}  // namespace
}  // namespace hiqcache::rob
