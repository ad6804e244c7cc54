// prefault_bench: how fast hiqcached makes its pool resident at start-up (PoolRegion::Prefault,
// the daemon's own code), against faulting the mapping in (what it did before) and against
// writing the same bytes once they are resident (memset: the memory bandwidth that bounds any
// pre-fault), in the same run.
//
//   prefault_bench [--gib N] [--reps R]      (default 2 GiB, 3 repetitions; medians printed)
//
// Every measurement starts from a fresh POSIX shm object, as a first start does. It also prints
// whether the shm filesystem gives huge pages (PoolRegion asks for them).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flag_reader.h"
#include "pool/pool_region.h"

namespace {

using hiqcache::server::PoolRegion;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line.empty() ? "(unreadable)" : line;
}

// The mount options of /dev/shm ("huge=..." when set).
std::string ShmMountOptions() {
  std::ifstream in("/proc/mounts");
  std::string dev, dir, type, opts, rest;
  while (in >> dev >> dir >> type >> opts && std::getline(in, rest)) {
    if (dir == "/dev/shm") return opts;
  }
  return "(not mounted)";
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t gib = 2;
  int reps = 3;
  hiqcache::bench::FlagReader flags(argc, argv);
  while (flags.Next()) {
    std::string v;
    if (flags.name() == "--gib" && flags.Value(&v)) {
      gib = std::stoull(v);
    } else if (flags.name() == "--reps" && flags.Value(&v)) {
      reps = std::max(1, std::stoi(v));
    } else {
      std::cerr << "usage: prefault_bench [--gib N] [--reps R]\n";
      return 2;
    }
  }
  const uint64_t bytes = gib << 30;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::printf("pool %llu GiB, %u cores; shmem_enabled: %s; /dev/shm: %s\n",
              static_cast<unsigned long long>(gib), cores,
              FirstLine("/sys/kernel/mm/transparent_hugepage/shmem_enabled").c_str(),
              ShmMountOptions().c_str());
  // Per repetition, each on a fresh object: the daemon's Prefault (fallocate) with 1 thread and
  // with `cores` threads, then its page tables (MapPages); the way the daemon pre-faulted before
  // (MADV_POPULATE_WRITE faulting the mapping, `cores` threads); memset of the resident bytes.
  std::vector<double> one, all, map, fault, fill;
  auto fresh = [&]() -> std::unique_ptr<PoolRegion> {
    const std::string name = "/hiq-prefault-bench-" + std::to_string(::getpid());
    ::shm_unlink(name.c_str());
    auto region = PoolRegion::Open(name, bytes);
    if (!region.ok()) {
      std::cerr << region.status().ToString() << "\n";
      std::exit(1);
    }
    ::shm_unlink(name.c_str());  // the mapping keeps it until reset
    return std::move(region).value();
  };
  auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  auto parallel = [&](auto fn) {
    std::vector<std::thread> workers;
    const uint64_t share = bytes / cores;
    for (unsigned t = 0; t < cores; ++t) workers.emplace_back([&, t] { fn(t * share, share); });
    for (auto& w : workers) w.join();
  };
  for (int r = 0; r < reps; ++r) {
    {
      auto region = fresh();
      auto t = std::chrono::steady_clock::now();
      if (!region->Prefault(1).ok()) return 1;
      one.push_back(gib / seconds_since(t));
    }
    {
      auto region = fresh();
      auto t = std::chrono::steady_clock::now();
      if (!region->Prefault(cores).ok()) return 1;
      all.push_back(gib / seconds_since(t));
      t = std::chrono::steady_clock::now();
      region->MapPages();
      map.push_back(gib / seconds_since(t));
      t = std::chrono::steady_clock::now();
      parallel([&](uint64_t off, uint64_t len) { std::memset(region->data() + off, 1, len); });
      fill.push_back(gib / seconds_since(t));
    }
    {
      auto region = fresh();
      auto t = std::chrono::steady_clock::now();
      parallel([&](uint64_t off, uint64_t len) {
        ::madvise(region->data() + off, len, MADV_POPULATE_WRITE);
      });
      fault.push_back(gib / seconds_since(t));
    }
  }
  const double m_all = Median(all);
  std::printf("Prefault (fallocate), 1 thread:     %6.2f GiB/s (median of %d)\n", Median(one),
              reps);
  std::printf("Prefault (fallocate), %u threads:    %6.2f GiB/s\n", cores, m_all);
  std::printf("MapPages after it (background):     %6.2f GiB/s\n", Median(map));
  std::printf("faulting the mapping, %u threads:    %6.2f GiB/s (MADV_POPULATE_WRITE)\n", cores,
              Median(fault));
  std::printf("memset of resident pages:           %6.2f GiB/s (%u threads)\n", Median(fill),
              cores);
  std::printf("Prefault / faulting the mapping:    %6.2fx\n", m_all / Median(fault));
  std::printf("Prefault / memset:                  %6.2fx\n", m_all / Median(fill));
  return 0;
}
