// replay_bench: replays the HiQCache capacity experiments against the real hiqcached.
//
//   Experiment B  same host budget (8 GB): BF16 (CODEC_RAW), INT8 with HiQCache's padded rows
//                 (emulated), hiqcache's INT8 (1,040-byte rows), and hiqcache's FP8 E4M3 and
//                 INT4 g32 codecs (which fail the fidelity gates): capacity, hit rates, bytes.
//   Experiment A  same token capacity (54,254 tokens, BF16's in 8 GB): host memory each needs.
//   Sweep         hit rate against host budget, 0.5 to 16 GB, for every configuration.
//
// Every run starts its own hiqcached (HOST backend) sized to the budget and drives it through the
// client library with EngineModel; see replay_runner.h for layer scaling. Writes
// <out>/replay.json, replay.md, replay_sweep.dat and replay_hit_rate.png (gnuplot). Exits 0 when
// every run completed without daemon errors and every sampled restore matched, 1 otherwise, 2 on
// bad flags.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "../flag_reader.h"
#include "replay_report.h"
#include "replay_runner.h"

namespace hiqcache::replay {
namespace {

enum class FullGeometry { kNone, kOurs, kAll };

struct Flags {
  RunnerOptions runner;
  uint32_t layers = 2;  // 0.5 GB x 2/36 = 28 MB: above hiqcached's 16 MiB minimum pool
  FullGeometry full = FullGeometry::kOurs;
  std::vector<double> budgets_gb = {0.5, 1, 1.5, 2,  2.5, 3,  3.5, 4,  5,  6,
                                    7,   8, 9,   10, 11,  12, 13,  14, 15, 16};
  double budget_b_gb = 8;
  uint64_t target_a_tokens = 54254;
  std::string out = std::string(HIQ_SOURCE_DIR) + "/bench/results/replay";
  std::string gnuplot = "gnuplot";
  bool plot = true;
};

void PrintUsage() {
  std::fprintf(
      stderr,
      "usage: replay_bench [--quick] [--layers N] [--full ours|all|none] [--budgets GB,GB,...]\n"
      "                    [--out DIR] [--no-plot] [--gnuplot PATH] [--verbose]\n"
      "                    [--groups N] [--requests N] [--prefix-tokens N] [--suffix-tokens N]\n"
      "                    [--output-tokens N] [--l1-tokens N] [--concurrency N]\n"
      "                    [--verify-every N] [--seed N]\n"
      "  --quick    budgets 1,2,4,8,16 GB and no full-geometry run (CI-sized, ~1 min)\n"
      "  --layers   layers of the scaled runs (budgets scaled by N/36), default 2\n"
      "  --full     36-layer 8 GB runs: ours (default: hiqcache only), all, none\n"
      "default --out: %s/bench/results/replay\n",
      HIQ_SOURCE_DIR);
}

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (bench::FlagReader r(argc, argv); r.Next();) {
    const std::string a = r.name();
    std::string v;
    auto value = [&] { return r.Value(&v); };
    auto u32 = [&](uint32_t* out) { return r.U32(out, &v); };
    bool ok = true;
    if (a == "--help" || a == "-h") {
      PrintUsage();
      std::exit(0);
    } else if (a == "--quick") {
      f->budgets_gb = {1, 2, 4, 8, 16};
      f->full = FullGeometry::kNone;
    } else if (a == "--layers") {
      ok = u32(&f->layers) && f->layers >= 1 && f->layers <= kModelLayers;
    } else if (a == "--full") {
      ok = value();
      if (v == "ours") {
        f->full = FullGeometry::kOurs;
      } else if (v == "all") {
        f->full = FullGeometry::kAll;
      } else if (v == "none") {
        f->full = FullGeometry::kNone;
      } else {
        ok = false;
      }
    } else if (a == "--budgets") {
      ok = value();
      f->budgets_gb.clear();
      for (size_t p = 0; ok && p <= v.size();) {
        const size_t q = std::min(v.find(',', p), v.size());
        const double gb = std::atof(v.substr(p, q - p).c_str());
        ok = gb > 0;
        f->budgets_gb.push_back(gb);
        p = q + 1;
      }
    } else if (a == "--out") {
      ok = value() && (f->out = v, true);
    } else if (a == "--gnuplot") {
      ok = value() && (f->gnuplot = v, true);
    } else if (a == "--no-plot") {
      f->plot = false;
    } else if (a == "--verbose" || a == "-v") {
      f->runner.verbose = true;
    } else if (a == "--groups") {
      ok = u32(&f->runner.workload.groups) && f->runner.workload.groups > 0;
    } else if (a == "--requests") {
      ok = u32(&f->runner.workload.requests) && f->runner.workload.requests > 0;
    } else if (a == "--prefix-tokens") {
      ok = u32(&f->runner.workload.prefix_tokens);
    } else if (a == "--suffix-tokens") {
      ok = u32(&f->runner.workload.suffix_tokens);
    } else if (a == "--output-tokens") {
      ok = u32(&f->runner.workload.output_tokens);
    } else if (a == "--l1-tokens") {
      ok = u32(&f->runner.l1_tokens) && f->runner.l1_tokens >= f->runner.workload.block_tokens;
    } else if (a == "--concurrency") {
      ok = u32(&f->runner.concurrency) && f->runner.concurrency > 0;
    } else if (a == "--verify-every") {
      ok = u32(&f->runner.verify_every);
    } else if (a == "--seed") {
      uint32_t s = 0;
      ok = u32(&s);
      f->runner.seed = f->runner.workload.seed = s;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "replay_bench: bad flag %s\n", a.c_str());
      return false;
    }
  }
  if (std::find(f->budgets_gb.begin(), f->budgets_gb.end(), f->budget_b_gb) ==
      f->budgets_gb.end()) {
    f->budgets_gb.push_back(f->budget_b_gb);  // experiment B is the sweep's 8 GB point
  }
  std::sort(f->budgets_gb.begin(), f->budgets_gb.end());
  return true;
}

// The smallest budget (1 MB steps) whose daemon capacity holds `target` tokens, by bisection on
// capacity-only runs between a budget that is too small and one that is enough.
StatusOr<double> BudgetForCapacity(ReplayRunner& runner, const StoreConfig& config, uint32_t layers,
                                   uint64_t target, const RunResult& at_b) {
  constexpr double kStep = 1e6;
  auto capacity = [&](double budget) -> StatusOr<uint64_t> {
    RunSpec spec{config, budget, layers, /*capacity_only=*/true};
    HIQ_ASSIGN_OR_RETURN(RunResult r, runner.Run(spec));
    return r.capacity_tokens();
  };
  if (at_b.capacity_tokens() == 0) return Internal("no capacity at experiment B's budget");
  const double estimate =
      std::ceil(at_b.spec.budget_bytes * target / at_b.capacity_tokens() / kStep) * kStep;
  double lo = estimate - 64 * kStep, hi = estimate + 64 * kStep;
  HIQ_ASSIGN_OR_RETURN(uint64_t cap_hi, capacity(hi));
  if (cap_hi < target) return Internal("capacity estimate too small for " + config.name);
  for (int widen = 0;; ++widen) {
    HIQ_ASSIGN_OR_RETURN(uint64_t cap_lo, capacity(lo));
    if (cap_lo < target) break;
    if (widen == 4 || lo <= 512 * kStep) {
      return Internal("capacity estimate too large for " + config.name);
    }
    lo -= 256 * kStep;
  }
  while (hi - lo > kStep) {
    const double mid = std::floor((lo + hi) / 2 / kStep) * kStep;
    HIQ_ASSIGN_OR_RETURN(uint64_t cap, capacity(mid));
    (cap >= target ? hi : lo) = mid;
  }
  return hi;
}

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

int Run(const Flags& f, const std::string& command) {
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  std::filesystem::create_directories(f.out, ec);
  if (ec) {
    std::fprintf(stderr, "replay_bench: %s: %s\n", f.out.c_str(), ec.message().c_str());
    return 1;
  }
  ReplayRunner runner(f.runner);
  ReplayReport report;
  report.command = command;
  report.date = UtcNow();
  report.machine = DescribeMachine();
  report.options = f.runner;
  report.scaled_layers = f.layers;
  report.experiment_a_target_tokens = f.target_a_tokens;
  if (Status s = runner.MeasurePoolMeta(); !s.ok()) {
    std::fprintf(stderr, "replay_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  report.pool_meta_bytes = runner.pool_meta_bytes();
  const std::vector<StoreConfig> configs = StandardConfigs();
  bool failed = false;
  auto run = [&](const RunSpec& spec, std::vector<RunResult>* into) -> const RunResult* {
    auto r = runner.Run(spec);
    if (!r.ok()) {
      std::fprintf(stderr, "replay_bench: %s at %.2f GB x%u layers: %s\n", spec.config.name.c_str(),
                   spec.budget_bytes / 1e9, spec.layers, r.status().ToString().c_str());
      failed = true;
      return nullptr;
    }
    failed |= !r->ok();
    into->push_back(std::move(r).value());
    return &into->back();
  };

  std::printf("replay_bench: %u requests, %u groups x %u tokens, L1 %u tokens, concurrency %u\n",
              f.runner.workload.requests, f.runner.workload.groups, f.runner.workload.prefix_tokens,
              f.runner.l1_tokens, f.runner.concurrency);
  // Sweep (experiment B is its 8 GB point).
  for (double gb : f.budgets_gb) {
    for (const StoreConfig& c : configs) {
      const RunResult* r = run({c, gb * 1e9, f.layers}, &report.sweep);
      if (r == nullptr) continue;
      std::printf(
          "  sweep %5.2f GB %-17s capacity %7llu tokens  prefix hit %5.1f%%  L2 hit %5.1f%%\n", gb,
          c.name.c_str(), static_cast<unsigned long long>(r->capacity_tokens()),
          100 * r->PrefixHitRate(), 100 * r->L2HitRate());
      if (gb == f.budget_b_gb) report.experiment_b.push_back(*r);
    }
  }
  // Experiment A.
  for (const StoreConfig& c : configs) {
    const RunResult* at_b = nullptr;
    for (const RunResult& r : report.experiment_b) {
      if (r.spec.config.name == c.name) at_b = &r;
    }
    if (at_b == nullptr) continue;
    auto budget = BudgetForCapacity(runner, c, f.layers, f.target_a_tokens, *at_b);
    if (!budget.ok()) {
      std::fprintf(stderr, "replay_bench: experiment A %s: %s\n", c.name.c_str(),
                   budget.status().ToString().c_str());
      failed = true;
      continue;
    }
    if (const RunResult* r = run({c, *budget, f.layers}, &report.experiment_a)) {
      std::printf(
          "  same capacity: %-17s needs %.3f GB (capacity %llu tokens), prefix hit %.1f%%\n",
          c.name.c_str(), *budget / 1e9, static_cast<unsigned long long>(r->capacity_tokens()),
          100 * r->PrefixHitRate());
    }
  }
  // Full geometry.
  if (f.full != FullGeometry::kNone && f.layers != kModelLayers) {
    for (const StoreConfig& c : configs) {
      if (f.full == FullGeometry::kOurs && c.name != "hiqcache") continue;
      if (const RunResult* r = run({c, f.budget_b_gb * 1e9, kModelLayers}, &report.full_geometry)) {
        std::printf(
            "  full geometry %.0f GB %-17s capacity %llu tokens, prefix hit %.1f%%, "
            "L2 hit %.1f%%, %.0f s\n",
            f.budget_b_gb, c.name.c_str(), static_cast<unsigned long long>(r->capacity_tokens()),
            100 * r->PrefixHitRate(), 100 * r->L2HitRate(), r->wall_seconds);
      }
    }
  }
  report.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const std::string json = f.out + "/replay.json", md = f.out + "/replay.md",
                    dat = f.out + "/replay_sweep.dat", png = f.out + "/replay_hit_rate.png";
  for (Status s :
       {WriteJson(report, json), WriteMarkdown(report, md), WriteSweepData(report, dat)}) {
    if (!s.ok()) {
      std::fprintf(stderr, "replay_bench: %s\n", s.ToString().c_str());
      failed = true;
    }
  }
  std::printf("wrote %s, %s, %s\n", json.c_str(), md.c_str(), dat.c_str());
  if (f.plot) {
    char ref[320];
    const WorkloadOptions& w = f.runner.workload;
    std::snprintf(ref, sizeof(ref),
                  "ref_bf16=%.1f; ref_int8=%.1f; ref_budget=%.1f; l1_only=%.2f; subtitle='%u x "
                  "%u-token prefix groups, %u requests, concurrency %u, L1 %u tokens'",
                  100 * report.reference.bf16_hit_rate, 100 * report.reference.int8_hit_rate,
                  report.reference.budget_bytes / 1e9, 100 * report.L1OnlyHitRate(), w.groups,
                  w.prefix_tokens, w.requests, f.runner.concurrency, f.runner.l1_tokens);
    const std::string cmd = ShellQuote(f.gnuplot) + " -e " +
                            ShellQuote("datafile='" + dat + "'; outfile='" + png + "'; " + ref) +
                            " " + ShellQuote(std::string(HIQ_SOURCE_DIR) + "/bench/plot_replay.gp");
    if (std::system(cmd.c_str()) == 0) {
      std::printf("wrote %s\n", png.c_str());
    } else {
      std::fprintf(stderr, "replay_bench: plot failed (is gnuplot installed? %s)\n", cmd.c_str());
    }
  }
  std::printf("replay_bench: %s in %.0f s\n", failed ? "FAIL" : "OK", report.wall_seconds);
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace hiqcache::replay

int main(int argc, char** argv) {
  hiqcache::replay::Flags flags;
  if (!hiqcache::replay::ParseFlags(argc, argv, &flags)) {
    hiqcache::replay::PrintUsage();
    return 2;
  }
  std::string command = "replay_bench";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  return hiqcache::replay::Run(flags, command);
}
