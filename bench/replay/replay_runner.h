// ReplayRunner: one replay run = one hiqcached (the real binary, HOST backend, its own socket and
// shm pool sized to the configuration's budget), one engine KV pool registered with it, and the
// workload driven through EngineModel. Capacities come from the daemon (RegisterPool's
// capacity_tokens, GetStats).
//
// Layer scaling: token capacity depends only on budget / bytes-per-token, and bytes per token are
// proportional to the number of layers, so a run with L of Qwen3-8B's 36 layers gets the same
// token capacity from a pool of meta + (budget - meta) * L / 36 bytes (meta: the pool's fixed
// header and directory, measured once from a daemon). Per-block slot headers (64 B) do not scale,
// which costs the scaled runs < 0.05% of capacity. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine_model.h"
#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/status.h"
#include "synthetic_kv.h"
#include "workload.h"

namespace hiqcache::replay {

constexpr uint32_t kModelLayers = 36;  // Qwen3-8B: 36 layers x 8 KV heads x 128, BF16

// One way of storing the CPU tier.
struct StoreConfig {
  std::string name;   // "bf16", "int8_padded", "hiqcache", "fp8_e4m3_per_head", ...
  std::string label;  // for tables and plots
  Codec codec = Codec::kInt8PerHead;
  // Bytes per token of the format at full Qwen3-8B geometry: 147,456 (BF16) / 82,944 (padded
  // INT8) / 74,880 (INT8, FP8) / 41,472 (INT4 g32).
  uint64_t model_bytes_per_token = 0;
  // Daemon pool bytes per budget byte. Padded INT8 (1,152-byte rows) is emulated by running our
  // codec in a pool scaled by 74,880 / 82,944, so that the capacity is budget / 82,944 tokens.
  double pool_factor = 1.0;
};

// The configurations of the experiments: BF16, padded INT8, hiqcache's INT8, and the FP8 and INT4
// codecs (capacity and hit rate only; both fail the fidelity gates on real weights).
std::vector<StoreConfig> StandardConfigs();

struct RunSpec {
  StoreConfig config;
  double budget_bytes = 0;  // host budget at full geometry
  uint32_t layers = 1;      // 1..36; < 36 scales the daemon pool (see above)
  bool capacity_only = false;
};

struct RunResult {
  RunSpec spec;
  uint64_t pool_bytes = 0;  // --pool-bytes given to the daemon
  RegisteredPool registered;
  // GetStats after the run.
  uint64_t daemon_capacity_bytes = 0;
  uint64_t daemon_used_bytes = 0;
  NamespaceStats ns;
  ReplayCounters counters;
  double wall_seconds = 0;

  uint64_t capacity_tokens() const { return registered.capacity_tokens; }
  double L2HitRate() const;      // L2 hit tokens / tokens looked up in L2
  double PrefixHitRate() const;  // (L1 + L2 hit tokens) / prompt tokens
  // Bytes written into / read from the pool at full geometry in this format.
  double BackupBytesModel() const;
  double RestoreBytesModel() const;
  // Same, as the daemon moved them in this run (scaled geometry, our record format).
  uint64_t BackupBytesActual() const;
  uint64_t RestoreBytesActual() const;
  bool ok() const;
};

struct RunnerOptions {
  WorkloadOptions workload;
  uint32_t l1_tokens = 16384;
  uint32_t concurrency = 8;
  uint32_t verify_every = 8;
  uint64_t seed = 1;
  bool verbose = false;
};

class ReplayRunner {
 public:
  explicit ReplayRunner(const RunnerOptions& options);
  ~ReplayRunner();

  // Pool bytes of the daemon's header and directory, from a small daemon's GetStats. Call once
  // before Run with layers < 36.
  Status MeasurePoolMeta();
  uint64_t pool_meta_bytes() const { return meta_bytes_; }
  // The daemon pool for `spec` (layer scaling applied).
  uint64_t PoolBytesFor(const RunSpec& spec) const;

  StatusOr<RunResult> Run(const RunSpec& spec);
  const std::vector<Request>& requests() const { return requests_; }

 private:
  struct Engine {
    std::unique_ptr<HostKvPool> kv;
    std::unique_ptr<SyntheticKv> data;
  };
  StatusOr<Engine*> EngineFor(uint32_t layers);

  RunnerOptions options_;
  std::vector<Request> requests_;
  uint64_t meta_bytes_ = 0;
  std::map<uint32_t, Engine> engines_;  // by layer count; one KV pool of each size at a time
};

}  // namespace hiqcache::replay
