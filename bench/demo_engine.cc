// hiq_demo: a CPU-only "engine" that exercises hiqcached end to end through the HOST backend.
//
// It registers a Qwen3-8B-shaped KV pool (36 layers x 8 KV heads x 128, BF16, 64-token blocks)
// in shared memory, then serves a shared-prefix workload: P long prefixes, each request one of
// them (Zipf-weighted) plus a random suffix. Per request: block keys -> Lookup -> Restore the hit
// blocks into fresh rows (checking every restored element against the codec's error bound) ->
// "prefill" the misses with synthetic KV derived from the block keys -> Backup. It prints bytes
// per token, capacity, hit rate, worst error relative to the bound and BF16-equivalent GB/s.
// Exits 1 on any bound violation or daemon error, 2 on bad flags.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "codec_math.h"
#include "flag_reader.h"
#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/layouts.h"
#include "hiqcache/paths.h"

namespace hiqcache {
namespace {

using Clock = std::chrono::steady_clock;
namespace kn = ::hiqcache::kernels;

struct Flags {
  std::string target;
  std::string model = "Qwen/Qwen3-8B@hiq_demo";
  KvLayout layout = KvLayout::kSglang;
  uint32_t slots = 4096;
  uint32_t block_tokens = 64;
  uint32_t prefixes = 8;
  uint32_t prefix_tokens = 2048;
  uint32_t suffix_tokens = 256;
  uint32_t requests = 32;
  double zipf = 1.0;
  uint64_t seed = 1;
  bool sync_restore = false;
  bool verbose = false;
  double timeout_s = 60;
  // --huge-pages: the KV in a memfd on huge pages as asked; unset: a named shm object.
  bool kv_memfd = false;
  HugePages huge_pages = HugePages::kOff;
};

void PrintUsage() {
  std::fprintf(stderr,
               "usage: hiq_demo [--target ADDR] [--requests N] [--prefixes N]\n"
               "                [--prefix-tokens N] [--suffix-tokens N] [--slots N]\n"
               "                [--layout sglang|vllm_paged|vllm_packed_kv] [--zipf S]\n"
               "                [--seed N] [--model NAME] [--sync-restore] [--timeout SECONDS]\n"
               "                [--huge-pages off|auto|require] [--verbose]\n"
               "default target: %s\n",
               DefaultTarget().c_str());
}

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (bench::FlagReader r(argc, argv); r.Next();) {
    const std::string a = r.name();
    std::string v;
    auto value = [&] { return r.Value(&v); };
    auto u32 = [&](uint32_t* out) { return r.U32(out, &v); };
    bool ok = true;
    if (a == "--target") {
      ok = value() && (f->target = v, true);
    } else if (a == "--model") {
      ok = value() && (f->model = v, true);
    } else if (a == "--requests") {
      ok = u32(&f->requests);
    } else if (a == "--prefixes") {
      ok = u32(&f->prefixes) && f->prefixes > 0;
    } else if (a == "--prefix-tokens") {
      ok = u32(&f->prefix_tokens);
    } else if (a == "--suffix-tokens") {
      ok = u32(&f->suffix_tokens);
    } else if (a == "--slots") {
      ok = u32(&f->slots);
    } else if (a == "--seed") {
      uint32_t s = 0;
      ok = u32(&s) && (f->seed = s, true);
    } else if (a == "--zipf") {
      ok = value() && (f->zipf = std::atof(v.c_str()), f->zipf >= 0);
    } else if (a == "--timeout") {
      ok = value() && (f->timeout_s = std::atof(v.c_str()), f->timeout_s > 0);
    } else if (a == "--layout") {
      ok = value();
      if (v == "sglang") {
        f->layout = KvLayout::kSglang;
      } else if (v == "vllm_paged") {
        f->layout = KvLayout::kVllmPaged;
      } else if (v == "vllm_packed_kv") {
        f->layout = KvLayout::kVllmPackedKv;
      } else {
        ok = false;
      }
    } else if (a == "--huge-pages") {
      ok = value();
      auto mode = ParseHugePages(v, "--huge-pages");
      ok = ok && mode.ok() && (f->huge_pages = *mode, f->kv_memfd = true);
    } else if (a == "--sync-restore") {
      f->sync_restore = true;
    } else if (a == "--verbose" || a == "-v") {
      f->verbose = true;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "hiq_demo: bad flag %s\n", a.c_str());
      return false;
    }
  }
  if (f->prefix_tokens % f->block_tokens != 0 || f->suffix_tokens % f->block_tokens != 0) {
    std::fprintf(stderr, "hiq_demo: --prefix-tokens and --suffix-tokens must be multiples of %u\n",
                 f->block_tokens);
    return false;
  }
  if (f->prefix_tokens + f->suffix_tokens == 0 || f->prefix_tokens + f->suffix_tokens > f->slots) {
    std::fprintf(stderr, "hiq_demo: a request (%u tokens) must fit in --slots (%u)\n",
                 f->prefix_tokens + f->suffix_tokens, f->slots);
    return false;
  }
  return true;
}

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The synthetic KV of one head: a function of the block key (which names the whole prefix, as
// real KV depends on it), the token's place in the block, layer, K|V and head. Magnitudes vary
// per head (2^-10 .. 2^5), with one outlier per head and an occasional all-zero head.
void SyntheticHead(const BlockKey& key, uint32_t token, uint32_t layer, uint32_t plane,
                   uint32_t head, uint32_t dim, uint16_t* out) {
  uint64_t k0, k1;
  std::memcpy(&k0, key.data(), 8);
  std::memcpy(&k1, key.data() + 8, 8);
  const uint64_t seed = SplitMix(k0 ^ SplitMix(k1 ^ (uint64_t{token} << 32 | uint64_t{layer} << 16 |
                                                     uint64_t{plane} << 8 | head)));
  if ((seed & 0x3FF) == 0) {
    std::memset(out, 0, dim * sizeof(uint16_t));
    return;
  }
  const float amp = std::ldexp(1.0f, static_cast<int>(seed >> 60) - 10);
  const uint32_t outlier = static_cast<uint32_t>(seed >> 20) % dim;
  uint64_t s = seed;
  for (uint32_t d = 0; d < dim; ++d) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float u = static_cast<float>(static_cast<int32_t>(s >> 40) - (1 << 23)) / (1 << 23);
    out[d] = kn::FloatToBf16Sat(d == outlier ? 4.0f * amp * u : amp * u);
  }
}

template <typename F>
void ParallelFor(uint32_t n, F&& f) {
  const uint32_t threads = std::max(1u, std::min(n, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (uint32_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (uint32_t i = t; i < n; i += threads) f(i);
    });
  }
  for (auto& th : pool) th.join();
}

struct Check {
  double max_ratio = 0;  // max |x^ - x| / bound
  uint64_t elements = 0;
  uint64_t violations = 0;
};

// Writes the synthetic KV of blocks [first, last) of a request into its rows.
void Prefill(const HostKvPool& kv, const std::vector<BlockKey>& keys,
             const std::vector<uint32_t>& rows, uint32_t first, uint32_t last,
             uint32_t block_tokens) {
  const Geometry& g = kv.geometry();
  ParallelFor(g.num_layers, [&](uint32_t l) {
    for (uint32_t b = first; b < last; ++b) {
      for (uint32_t t = 0; t < block_tokens; ++t) {
        const uint32_t row = rows[b * block_tokens + t];
        for (uint32_t p = 0; p < g.Planes(); ++p) {
          for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
            SyntheticHead(keys[b], t, l, p, h, g.head_dim, kv.Head(l, p, row, h));
          }
        }
      }
    }
  });
}

// Checks every restored element of blocks [0, n) against
// |x^ - x| <= (0.5 + 2^-8) * s + 2^-8 * |x^|, s = bf16(max|x| / 127) from the original data.
Check Verify(const HostKvPool& kv, const std::vector<BlockKey>& keys,
             const std::vector<uint32_t>& rows, uint32_t n, uint32_t block_tokens) {
  const Geometry& g = kv.geometry();
  std::vector<Check> per_layer(g.num_layers);
  ParallelFor(g.num_layers, [&](uint32_t l) {
    Check& c = per_layer[l];
    std::vector<uint16_t> x(g.head_dim);
    for (uint32_t b = 0; b < n; ++b) {
      for (uint32_t t = 0; t < block_tokens; ++t) {
        const uint32_t row = rows[b * block_tokens + t];
        for (uint32_t p = 0; p < g.Planes(); ++p) {
          for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
            SyntheticHead(keys[b], t, l, p, h, g.head_dim, x.data());
            uint16_t amax = 0;
            for (uint16_t bits : x) amax = std::max<uint16_t>(amax, bits & 0x7FFF);
            const double s = kn::Bf16ToFloat(kn::ScaleBf16FromAmaxBits(amax, kn::DType::kBF16));
            const uint16_t* got = kv.Head(l, p, row, h);
            for (uint32_t d = 0; d < g.head_dim; ++d) {
              const double xv = kn::Bf16ToFloat(x[d]);
              const double xh = kn::Bf16ToFloat(got[d]);
              const double err = std::fabs(xh - xv);
              const double bound = (0.5 + 1.0 / 256) * s + std::fabs(xh) / 256;
              if (!(err <= bound)) ++c.violations;  // NaN counts as a violation
              if (bound > 0) c.max_ratio = std::max(c.max_ratio, err / bound);
            }
            c.elements += g.head_dim;
          }
        }
      }
    }
  });
  Check total;
  for (const Check& c : per_layer) {
    total.max_ratio = std::max(total.max_ratio, c.max_ratio);
    total.elements += c.elements;
    total.violations += c.violations;
  }
  return total;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string WithCommas(uint64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(i, ",");
  return s;
}

int Run(const Flags& f) {
  Geometry g;
  g.num_layers = 36;
  g.num_kv_heads = 8;
  g.head_dim = 128;
  g.dtype = DType::kBF16;

  ClientOptions options;
  options.target = f.target;
  options.call_timeout = std::chrono::milliseconds(static_cast<int64_t>(f.timeout_s * 1000));
  options.register_timeout = options.call_timeout;
  auto connected = Client::Connect(options);
  if (!connected.ok()) {
    std::fprintf(stderr, "hiq_demo: %s\n", connected.status().ToString().c_str());
    return 2;
  }
  Client& client = **connected;

  auto kv_or =
      HostKvPool::Create(g, f.layout, f.slots, 16, f.kv_memfd ? "memfd:demo-kv" : "", f.huge_pages);
  if (!kv_or.ok()) {
    std::fprintf(stderr, "hiq_demo: KV pool: %s\n", kv_or.status().ToString().c_str());
    return 1;
  }
  const HostKvPool& kv = *kv_or;
  // Slots 0..L-1: per-layer restore events; L: restore done; L+1: backup done.
  auto events_or = HostEventPool::Create(g.num_layers + 2);
  if (!events_or.ok()) {
    std::fprintf(stderr, "hiq_demo: events: %s\n", events_or.status().ToString().c_str());
    return 1;
  }
  const HostEventPool& events = *events_or;
  const int32_t restore_done = static_cast<int32_t>(g.num_layers);

  std::printf("hiq_demo: Qwen3-8B geometry (%u layers x %u KV heads x %u, BF16), %u-token blocks\n",
              g.num_layers, g.num_kv_heads, g.head_dim, f.block_tokens);
  std::printf("  engine KV pool: %u slots, layout %s, %.0f MiB in %s (%s pages)\n", kv.num_rows(),
              KvLayoutName(f.layout), kv.shm().size() / 1048576.0, kv.shm().name().c_str(),
              kv.shm().huge_page_backing() == HugePageBacking::kNone
                  ? "4 KiB"
                  : HugePageBackingName(kv.shm().huge_page_backing()));
  std::printf("  target: %s\n", client.target().c_str());

  const PoolSpec spec = MakeHostPoolSpec(f.model, kv, f.block_tokens, &events);
  auto pool = client.RegisterPool(spec);
  if (!pool.ok()) {
    std::fprintf(stderr, "hiq_demo: RegisterPool: %s\n", pool.status().ToString().c_str());
    return 1;
  }
  auto info = client.PoolInfo(*pool);
  if (!info.ok()) {
    std::fprintf(stderr, "hiq_demo: %s\n", info.status().ToString().c_str());
    return 1;
  }
  const uint64_t bf16_per_token = g.BytesPerToken();
  std::printf("  registered: pool %" PRIu64 ", namespace %s\n", info->pool_id,
              info->namespace_id.c_str());
  std::printf("bytes/token: BF16 %s, hiqcache %s (%.2fx)\n", WithCommas(bf16_per_token).c_str(),
              WithCommas(info->encoded_bytes_per_token).c_str(),
              info->encoded_bytes_per_token
                  ? static_cast<double>(bf16_per_token) / info->encoded_bytes_per_token
                  : 0.0);
  std::printf(
      "capacity: %s tokens (%s blocks of %s bytes); BF16 would hold %s\n",
      WithCommas(info->capacity_tokens).c_str(),
      WithCommas(info->capacity_tokens / f.block_tokens).c_str(),
      WithCommas(info->block_bytes).c_str(),
      WithCommas(info->capacity_tokens * info->encoded_bytes_per_token / bf16_per_token).c_str());

  // The workload.
  std::mt19937_64 rng(f.seed);
  std::vector<std::vector<uint32_t>> prefixes(f.prefixes);
  for (auto& p : prefixes) {
    p.resize(f.prefix_tokens);
    for (uint32_t& t : p) t = static_cast<uint32_t>(rng() % 151936);  // Qwen3 vocabulary
  }
  std::vector<double> weights(f.prefixes);
  for (uint32_t k = 0; k < f.prefixes; ++k) weights[k] = 1.0 / std::pow(k + 1.0, f.zipf);
  std::discrete_distribution<uint32_t> pick(weights.begin(), weights.end());
  std::vector<uint32_t> slot_ids(kv.num_rows());
  std::iota(slot_ids.begin(), slot_ids.end(), 0u);

  uint64_t total_blocks = 0, hit_blocks = 0, restored_blocks = 0, short_restores = 0;
  uint64_t backed_blocks = 0, stored = 0, present = 0, rejected = 0, errors = 0;
  double backup_s = 0, restore_s = 0;
  Check check;
  const auto event_timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(f.timeout_s));
  const auto run_start = Clock::now();

  for (uint32_t r = 0; r < f.requests; ++r) {
    const uint32_t p = pick(rng);
    std::vector<uint32_t> tokens = prefixes[p];
    for (uint32_t i = 0; i < f.suffix_tokens; ++i) {
      tokens.push_back(static_cast<uint32_t>(rng() % 151936));
    }
    const std::vector<BlockKey> keys = ComputeBlockKeys(tokens, f.block_tokens, "hiq_demo");
    const uint32_t n = static_cast<uint32_t>(keys.size());
    total_blocks += n;
    // Fresh rows for every request, scattered over the pool: restore writes rows other than
    // the ones the blocks were backed up from.
    std::shuffle(slot_ids.begin(), slot_ids.end(), rng);
    const std::vector<uint32_t> rows(slot_ids.begin(), slot_ids.begin() + n * f.block_tokens);

    LookupResult lookup = client.Lookup(*pool, keys);
    if (!lookup.status.ok()) {
      std::fprintf(stderr, "hiq_demo: request %u: Lookup: %s\n", r,
                   lookup.status.ToString().c_str());
      ++errors;
    }
    const uint32_t hits = lookup.prefix_blocks;
    hit_blocks += hits;

    uint32_t restored = 0;
    if (hits > 0) {
      RestoreOptions ro;
      ro.sync = f.sync_restore;
      if (!f.sync_restore) {
        ro.layer_event_base = 0;
        ro.done_event = restore_done;
      }
      const auto start = Clock::now();
      RestoreResult res = client.Restore(*pool, std::span(keys).first(hits),
                                         std::span(rows).first(size_t{hits} * f.block_tokens), ro);
      if (!res.status.ok()) {
        std::fprintf(stderr, "hiq_demo: request %u: Restore: %s\n", r,
                     res.status.ToString().c_str());
        ++errors;
      } else if (!f.sync_restore) {
        // Layers become readable in order; a real engine would start layer l's attention here.
        for (uint32_t l = 0; l < g.num_layers; ++l) {
          Status s = events.Wait(l, res.ticket, event_timeout);
          if (!s.ok()) {
            std::fprintf(stderr, "hiq_demo: request %u: layer %u event: %s\n", r, l,
                         s.ToString().c_str());
            ++errors;
            break;
          }
        }
        Status s = events.Wait(restore_done, res.ticket, event_timeout);
        if (!s.ok()) {
          std::fprintf(stderr, "hiq_demo: request %u: restore done event: %s\n", r,
                       s.ToString().c_str());
          ++errors;
        }
      }
      restored = res.status.ok() ? res.restored_blocks : 0;
      if (restored > 0) restore_s += Seconds(Clock::now() - start);
      if (restored < hits) ++short_restores;
      restored_blocks += restored;
      const Check c = Verify(kv, keys, rows, restored, f.block_tokens);
      check.max_ratio = std::max(check.max_ratio, c.max_ratio);
      check.elements += c.elements;
      check.violations += c.violations;
    }

    // "Prefill" whatever was not restored, then back it up.
    Prefill(kv, keys, rows, restored, n, f.block_tokens);
    if (restored < n) {
      const auto start = Clock::now();
      BackupResult b = client.Backup(*pool, std::span(keys).subspan(restored),
                                     std::span(rows).subspan(size_t{restored} * f.block_tokens));
      if (!b.status.ok()) {
        std::fprintf(stderr, "hiq_demo: request %u: Backup: %s\n", r, b.status.ToString().c_str());
        ++errors;
      } else {
        backup_s += Seconds(Clock::now() - start);
        backed_blocks += n - restored;
      }
      for (BlockStatus s : b.blocks) {
        stored += s == BlockStatus::kStored;
        present += s == BlockStatus::kAlreadyPresent;
        rejected += s == BlockStatus::kRejected;
      }
    }
    if (f.verbose) {
      std::printf("  request %3u: prefix %u, %u blocks, hit %u, restored %u, backed up %u\n", r, p,
                  n, hits, restored, n - restored);
    }
  }
  const double wall = Seconds(Clock::now() - run_start);
  Status released = client.ReleasePool(*pool);
  if (!released.ok()) {
    std::fprintf(stderr, "hiq_demo: ReleasePool: %s\n", released.ToString().c_str());
    ++errors;
  }

  const double block_gb = static_cast<double>(f.block_tokens) * bf16_per_token / 1e9;
  std::printf("requests: %u (%u prefixes of %u tokens, Zipf %.2f, +%u-token suffixes), %.1f s\n",
              f.requests, f.prefixes, f.prefix_tokens, f.zipf, f.suffix_tokens, wall);
  std::printf(
      "hit rate: %.1f%% (%s of %s blocks); restored %s blocks%s\n",
      total_blocks ? 100.0 * hit_blocks / total_blocks : 0.0, WithCommas(hit_blocks).c_str(),
      WithCommas(total_blocks).c_str(), WithCommas(restored_blocks).c_str(),
      short_restores
          ? (", " + std::to_string(short_restores) + " restores shorter than their lookup").c_str()
          : "");
  std::printf("backup: %s blocks (%s stored, %s already present, %s rejected)\n",
              WithCommas(backed_blocks).c_str(), WithCommas(stored).c_str(),
              WithCommas(present).c_str(), WithCommas(rejected).c_str());
  std::printf("max error / bound: %.3f over %s restored elements, %s violations\n", check.max_ratio,
              WithCommas(check.elements).c_str(), WithCommas(check.violations).c_str());
  std::printf("backup:  %.2f GB/s BF16-equivalent (%.2f GB in %.2f s of sync calls)\n",
              backup_s > 0 ? backed_blocks * block_gb / backup_s : 0.0, backed_blocks * block_gb,
              backup_s);
  std::printf("restore: %.2f GB/s BF16-equivalent (%.2f GB in %.2f s, %s)\n",
              restore_s > 0 ? restored_blocks * block_gb / restore_s : 0.0,
              restored_blocks * block_gb, restore_s,
              f.sync_restore ? "sync calls" : "call to last layer event");

  const bool ok = errors == 0 && check.violations == 0 && rejected == 0;
  std::printf(
      "summary: %s: %.2fx the tokens of BF16 per byte, %.1f%% of blocks served from the "
      "cache, %s restored elements within the bound%s\n",
      ok ? "OK" : "FAIL",
      info->encoded_bytes_per_token
          ? static_cast<double>(bf16_per_token) / info->encoded_bytes_per_token
          : 0.0,
      total_blocks ? 100.0 * restored_blocks / total_blocks : 0.0,
      check.violations ? "NOT all" : "all",
      errors ? (", " + std::to_string(errors) + " daemon errors").c_str() : "");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace hiqcache

int main(int argc, char** argv) {
  hiqcache::Flags flags;
  if (!hiqcache::ParseFlags(argc, argv, &flags)) {
    hiqcache::PrintUsage();
    return 2;
  }
  return hiqcache::Run(flags);
}
