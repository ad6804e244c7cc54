// The replay's workload: SGLang's "generated shared prefix" benchmark shape (bench_serving
// --dataset-name generated-shared-prefix), seeded, as block keys an engine would look up.
//
// `groups` system prompts of `prefix_tokens` random tokens; requests are spread evenly over the
// groups (group = i % groups) and shuffled. Each request appends its own question (suffix) and,
// while it runs, generates its own output; suffix and output lengths vary per request, uniformly
// in [len/2, 3*len/2]. Keys are the client library's chained XXH3-128 block keys over
// prompt + output, so a key names the whole sequence up to its block. Pure; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "hiqcache/block_keys.h"

namespace hiqcache::replay {

struct WorkloadOptions {
  uint32_t groups = 32;
  uint32_t requests = 128;
  uint32_t prefix_tokens = 2048;
  uint32_t suffix_tokens = 128;  // mean question length
  uint32_t output_tokens = 256;  // mean output length (decode steps)
  uint32_t block_tokens = 64;
  uint64_t seed = 1;
};

struct Request {
  uint32_t id = 0;
  uint32_t group = 0;
  uint32_t prompt_tokens = 0;  // prefix + suffix
  uint32_t output_tokens = 0;  // also the request's decode steps
  // Keys of the full blocks of prompt + output. The first prompt_tokens / block_tokens of them
  // cover the prompt only and are what the engine matches on arrival; the rest are complete only
  // once the request has finished.
  std::vector<BlockKey> keys;

  uint32_t PromptBlocks(uint32_t block_tokens) const { return prompt_tokens / block_tokens; }
  // L1 blocks the running request occupies (partial last block included).
  uint32_t SlotBlocks(uint32_t block_tokens) const {
    return (prompt_tokens + output_tokens + block_tokens - 1) / block_tokens;
  }
};

// The requests in arrival order.
std::vector<Request> MakeSharedPrefixWorkload(const WorkloadOptions& options);

}  // namespace hiqcache::replay
