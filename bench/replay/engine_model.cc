#include "engine_model.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

namespace hiqcache::replay {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

size_t EngineModel::KeyHash::operator()(const BlockKey& k) const {
  size_t h;
  std::memcpy(&h, k.data(), sizeof(h));
  return h;
}

EngineModel::EngineModel(Client* client, PoolHandle pool, const HostKvPool* kv,
                         const SyntheticKv* data, const Options& options)
    : client_(client), pool_(pool), kv_(kv), data_(data), options_(options) {
  const uint32_t n = options_.l1_tokens / options_.block_tokens;
  slots_.resize(n);
  free_.resize(n);
  std::iota(free_.begin(), free_.end(), 0u);
  // Scatter allocations over the pool, as a long-running engine's free list is.
  std::mt19937_64 rng(options_.seed);
  std::shuffle(free_.begin(), free_.end(), rng);
}

std::vector<uint32_t> EngineModel::Rows(std::span<const uint32_t> slots) const {
  std::vector<uint32_t> rows;
  rows.reserve(slots.size() * options_.block_tokens);
  for (uint32_t s : slots) {
    for (uint32_t t = 0; t < options_.block_tokens; ++t)
      rows.push_back(s * options_.block_tokens + t);
  }
  return rows;
}

void EngineModel::Pin(uint32_t slot) {
  Slot& s = slots_[slot];
  if (s.pins++ == 0 && s.cached) lru_.erase(s.lru);
}

void EngineModel::Unpin(uint32_t slot) {
  Slot& s = slots_[slot];
  if (--s.pins > 0) return;
  if (s.cached) {
    lru_.push_front(slot);
    s.lru = lru_.begin();
  } else {
    free_.push_back(slot);
  }
}

bool EngineModel::FitsAlone(const Request& request) const {
  return request.SlotBlocks(options_.block_tokens) <= slots_.size();
}

std::vector<uint32_t> EngineModel::TakeSlots(uint32_t n) {
  std::vector<uint32_t> out;
  out.reserve(n);
  while (out.size() < n && !free_.empty()) {
    out.push_back(free_.back());
    free_.pop_back();
  }
  std::vector<uint32_t> evicted;
  std::vector<BlockKey> keys;
  while (out.size() + evicted.size() < n) {
    const uint32_t slot = lru_.back();
    lru_.pop_back();
    Slot& s = slots_[slot];
    index_.erase(s.key);
    s.cached = false;
    evicted.push_back(slot);
    keys.push_back(s.key);
  }
  if (!evicted.empty()) {
    // Back up what L1 drops, before its rows are reused (sync: the daemon has read them when the
    // call returns).
    counters_.l1_evicted_blocks += evicted.size();
    const std::vector<uint32_t> rows = Rows(evicted);
    const auto t0 = Clock::now();
    BackupResult b = client_->Backup(pool_, keys, rows);
    counters_.backup_seconds += Since(t0);
    ++counters_.backup_calls;
    if (!b.status.ok()) {
      ++counters_.daemon_errors;
      std::fprintf(stderr, "replay: Backup: %s\n", b.status.ToString().c_str());
    }
    for (BlockStatus st : b.blocks) {
      counters_.backup_blocks_stored += st == BlockStatus::kStored;
      counters_.backup_blocks_present += st == BlockStatus::kAlreadyPresent;
      counters_.backup_blocks_rejected += st == BlockStatus::kRejected;
    }
    out.insert(out.end(), evicted.begin(), evicted.end());
  }
  for (uint32_t slot : out) slots_[slot].pins = 1;
  return out;
}

bool EngineModel::Admit(const Request& r) {
  const uint32_t bt = options_.block_tokens;
  const uint32_t prompt_blocks = r.PromptBlocks(bt);
  const std::span<const BlockKey> keys(r.keys);

  // 1. Longest prefix in L1.
  uint32_t l1 = 0;
  size_t unpinned_hits = 0;
  for (; l1 < prompt_blocks; ++l1) {
    auto it = index_.find(keys[l1]);
    if (it == index_.end()) break;
    unpinned_hits += slots_[it->second].pins == 0;
  }
  const uint32_t need = r.SlotBlocks(bt) - l1;
  if (need > free_.size() + lru_.size() - unpinned_hits) return false;
  std::vector<uint32_t> slots;
  slots.reserve(r.SlotBlocks(bt));
  for (uint32_t i = 0; i < l1; ++i) {
    const uint32_t slot = index_.at(keys[i]);
    Pin(slot);
    slots.push_back(slot);
  }

  // 2. The rest of the prompt's full blocks in L2.
  uint32_t hits = 0;
  if (l1 < prompt_blocks) {
    const auto t0 = Clock::now();
    LookupResult lookup = client_->Lookup(pool_, keys.subspan(l1, prompt_blocks - l1));
    counters_.lookup_seconds += Since(t0);
    if (!lookup.status.ok()) {
      ++counters_.daemon_errors;
      std::fprintf(stderr, "replay: Lookup: %s\n", lookup.status.ToString().c_str());
    }
    hits = lookup.prefix_blocks;
  }

  // 3. Room for the rest of prompt and output; evictions are backed up.
  const std::vector<uint32_t> fresh = TakeSlots(need);
  slots.insert(slots.end(), fresh.begin(), fresh.end());

  // 4. Restore the L2 hits into their new rows.
  uint32_t restored = 0;
  if (hits > 0) {
    const std::vector<uint32_t> rows = Rows(std::span(fresh).first(hits));
    const auto t0 = Clock::now();
    RestoreResult res = client_->Restore(pool_, keys.subspan(l1, hits), rows);
    counters_.restore_seconds += Since(t0);
    if (!res.status.ok()) {
      ++counters_.daemon_errors;
      std::fprintf(stderr, "replay: Restore: %s\n", res.status.ToString().c_str());
    }
    restored = res.status.ok() ? std::min(res.restored_blocks, hits) : 0;
    counters_.restore_short_blocks += hits - restored;
    counters_.restore_blocks += restored;
    if (options_.verify_every > 0 && counters_.restore_calls % options_.verify_every == 0 &&
        restored > 0) {
      counters_.verify.Add(data_->Verify(*kv_, keys.subspan(l1, restored),
                                         std::span(rows).first(size_t{restored} * bt), bt,
                                         options_.codec));
      ++counters_.verified_restores;
    }
    ++counters_.restore_calls;
  }

  // 5. "Prefill" the prompt's remaining full blocks (the partial last block is computed too, but
  // nothing reads it).
  const uint32_t computed_blocks = prompt_blocks - l1 - restored;
  if (computed_blocks > 0) {
    const std::vector<uint32_t> rows = Rows(std::span(fresh).subspan(restored, computed_blocks));
    data_->Fill(*kv_, keys.subspan(l1 + restored, computed_blocks), rows, bt);
  }
  for (uint32_t i = l1; i < prompt_blocks; ++i) {
    Slot& s = slots_[slots[i]];
    s.key = keys[i];
    s.cached = index_.emplace(keys[i], slots[i]).second;
  }

  counters_.requests += 1;
  counters_.prompt_tokens += r.prompt_tokens;
  counters_.l1_hit_tokens += uint64_t{l1} * bt;
  counters_.l2_lookup_tokens += uint64_t{prompt_blocks - l1} * bt;
  counters_.l2_hit_tokens += uint64_t{restored} * bt;
  counters_.computed_tokens += r.prompt_tokens - uint64_t{l1 + restored} * bt;
  running_[r.id].slots = std::move(slots);
  return true;
}

void EngineModel::Finish(const Request& r) {
  const uint32_t bt = options_.block_tokens;
  const uint32_t prompt_blocks = r.PromptBlocks(bt);
  const uint32_t full_blocks = static_cast<uint32_t>(r.keys.size());
  auto node = running_.extract(r.id);
  const std::vector<uint32_t>& slots = node.mapped().slots;
  // The output's full blocks (the first may end the prompt) now have KV and join the cache.
  if (full_blocks > prompt_blocks) {
    const std::span<const BlockKey> out_keys =
        std::span(r.keys).subspan(prompt_blocks, full_blocks - prompt_blocks);
    const std::span<const uint32_t> out_slots =
        std::span(slots).subspan(prompt_blocks, full_blocks - prompt_blocks);
    data_->Fill(*kv_, out_keys, Rows(out_slots), bt);
    for (size_t i = 0; i < out_keys.size(); ++i) {
      Slot& s = slots_[out_slots[i]];
      s.key = out_keys[i];
      s.cached = index_.emplace(out_keys[i], out_slots[i]).second;
    }
  }
  // Last block first, so that every prefix ends up more recent than its extensions.
  for (size_t i = slots.size(); i-- > 0;) Unpin(slots[i]);
}

}  // namespace hiqcache::replay
