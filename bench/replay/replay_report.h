// The replay's outputs: bench/results/replay/replay.json (every run, every counter), replay.md (the
// experiment tables), replay_sweep.dat (gnuplot input) and, through bench/plot_replay.gp, the
// hit-rate plot. Pure formatting plus file writes; not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hiqcache/status.h"
#include "replay_runner.h"

namespace hiqcache::replay {

// Published HiQCache figures (RTX A6000, SGLang, Qwen3-8B, 8 GB host budget).
struct PublishedReference {
  double budget_bytes = 8e9;
  double bf16_hit_rate = 0.561;
  double int8_hit_rate = 0.727;
  uint64_t bf16_capacity_tokens = 54254;
  uint64_t int8_capacity_tokens = 96451;
};

struct ReplayReport {
  std::string command;
  std::string date;     // UTC, ISO 8601
  std::string machine;  // CPU model, cores, memory, kernel
  RunnerOptions options;
  uint32_t scaled_layers = 1;
  uint64_t pool_meta_bytes = 0;
  PublishedReference reference;
  double wall_seconds = 0;

  std::vector<RunResult> experiment_b;  // same budget (8 GB), scaled layers
  uint64_t experiment_a_target_tokens = 0;
  std::vector<RunResult> experiment_a;   // same capacity, scaled layers
  std::vector<RunResult> full_geometry;  // 36 layers, 8 GB
  std::vector<RunResult> sweep;          // budgets x configs, scaled layers

  // Prompt tokens served by L1 alone (the same in every run: L1 never depends on L2).
  double L1OnlyHitRate() const;
};

// "Intel(R) Xeon(R) ... , 2 cores, 23.4 GiB RAM, Linux 6.1.0".
std::string DescribeMachine();
std::string UtcNow();

Status WriteJson(const ReplayReport& report, const std::string& path);
Status WriteMarkdown(const ReplayReport& report, const std::string& path);
// One line per budget: budget_gb, then per config (StandardConfigs order) prefix hit %, L2 hit %,
// capacity tokens.
Status WriteSweepData(const ReplayReport& report, const std::string& path);

}  // namespace hiqcache::replay
