#include "workload.h"

#include <algorithm>
#include <random>

namespace hiqcache::replay {
namespace {

constexpr uint32_t kVocab = 151936;  // Qwen3

uint32_t Around(std::mt19937_64& rng, uint32_t mean) {
  if (mean < 2) return mean;
  std::uniform_int_distribution<uint32_t> d(mean / 2, mean + mean / 2);
  return d(rng);
}

}  // namespace

std::vector<Request> MakeSharedPrefixWorkload(const WorkloadOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<uint32_t>> prefixes(o.groups, std::vector<uint32_t>(o.prefix_tokens));
  for (auto& p : prefixes) {
    for (uint32_t& t : p) t = static_cast<uint32_t>(rng() % kVocab);
  }
  std::vector<Request> requests(o.requests);
  for (uint32_t i = 0; i < o.requests; ++i) {
    Request& r = requests[i];
    r.group = o.groups ? i % o.groups : 0;
    const uint32_t suffix = Around(rng, o.suffix_tokens);
    r.output_tokens = std::max(1u, Around(rng, o.output_tokens));
    std::vector<uint32_t> tokens = o.groups ? prefixes[r.group] : std::vector<uint32_t>{};
    for (uint32_t t = 0; t < suffix + r.output_tokens; ++t) {
      tokens.push_back(static_cast<uint32_t>(rng() % kVocab));
    }
    r.prompt_tokens = static_cast<uint32_t>(tokens.size()) - r.output_tokens;
    r.keys = ComputeBlockKeys(tokens, o.block_tokens, "hiq-replay");
  }
  std::shuffle(requests.begin(), requests.end(), rng);
  for (uint32_t i = 0; i < o.requests; ++i) requests[i].id = i;
  return requests;
}

}  // namespace hiqcache::replay
