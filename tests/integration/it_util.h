// Helpers shared by the integration tests and the peer client (hiq_it_peer): deterministic KV
// data sets, the docs/design.md error bound, sentinel checks of KV buffers, block keys, stats
// lookups, a session for raw gRPC calls and spawning a second process.
//
// The data of a set is a pure function of (seed, logical block, token, layer, plane, head, dim),
// so two processes agree on it without sharing memory: one fills rows and backs them up, the
// other restores into rows of its own and checks. The bound is computed here from the original
// data, independently of the codec. Header-only; not thread-safe unless stated.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../../kernels/codec_math.h"
#include "hiqcache/block_keys.h"
#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/pool_spec.h"
#include "hiqcache/session.h"
#include "hiqcache/session_protocol.h"
#include "time_margin.h"

extern char** environ;

namespace hiqcache::it {

// ---------------------------------------------------------------------------------------------
// 16-bit formats.

inline uint16_t Bf16FromFloat(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float FloatFromBf16(uint16_t b) {
  uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// fp16 through the kernels' conversions (_Float16 is not a type every compiler here has):
// round to nearest even, saturated to +-65504 (test data stays far below it).
inline uint16_t Fp16FromFloat(float f) { return kernels::FloatToFp16Sat(f); }
inline float FloatFromFp16(uint16_t b) { return kernels::Fp16ToFloat(b); }
inline uint16_t Encode16(DType t, float f) {
  return t == DType::kFP16 ? Fp16FromFloat(f) : Bf16FromFloat(f);
}
inline float Decode16(DType t, uint16_t b) {
  return t == DType::kFP16 ? FloatFromFp16(b) : FloatFromBf16(b);
}

// ---------------------------------------------------------------------------------------------
// Deterministic data.

inline uint64_t Mix(uint64_t z) {  // splitmix64 finalizer
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline uint64_t Mix(uint64_t a, uint64_t b) { return Mix(a ^ Mix(b)); }

// The head_dim values of head `head` of (layer, plane) of token `token` of logical block `block`
// of data set `seed`, in `dtype`. Heads come in classes: all zero, tiny (below the 2^-112 floor),
// one outlier, and random magnitudes; BF16 spans a wide exponent range, FP16 stays normal.
inline void GenHead(uint64_t seed, uint32_t block, uint32_t token, uint32_t layer, uint32_t plane,
                    uint32_t head, uint32_t head_dim, DType dtype, uint16_t* out) {
  uint64_t h = Mix(seed, (uint64_t{block} << 40) ^ (uint64_t{token} << 20) ^
                             (uint64_t{layer} << 10) ^ (uint64_t{plane} << 9) ^ head);
  const uint32_t cls = static_cast<uint32_t>(h % 29);
  int exponent;
  if (dtype == DType::kFP16) {
    exponent = -6 + static_cast<int>((h >> 8) % 14);  // [-6, 7]
  } else if (cls == 1) {
    exponent = -125;
  } else {
    exponent = -40 + static_cast<int>((h >> 8) % 80);  // [-40, 39]
  }
  const float scale = std::ldexp(1.0f, exponent);
  uint64_t r = h;
  for (uint32_t d = 0; d < head_dim; ++d) {
    if (cls == 0) {
      out[d] = 0;
      continue;
    }
    r = Mix(r + d);
    float u = static_cast<float>(static_cast<int64_t>(r >> 40) - (1ll << 23)) * 0x1p-23f;  // [-1,1)
    if (cls == 2) u *= (d == (h >> 20) % head_dim) ? 1.0f : 0.01f;  // one outlier
    out[d] = Encode16(dtype, u * scale);
  }
}

// Writes data set `seed` into `rows` (block-major: rows[b * block_tokens + t] holds logical block
// first_block + b, token t) of every layer and plane of `kv`.
inline void FillRows(const HostKvPool& kv, uint64_t seed, std::span<const uint32_t> rows,
                     uint32_t block_tokens, uint32_t first_block = 0) {
  const Geometry& g = kv.geometry();
  for (size_t i = 0; i < rows.size(); ++i) {
    const uint32_t b = first_block + static_cast<uint32_t>(i / block_tokens);
    const uint32_t t = static_cast<uint32_t>(i % block_tokens);
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      for (uint32_t p = 0; p < g.Planes(); ++p) {
        for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
          GenHead(seed, b, t, l, p, h, g.head_dim, g.dtype, kv.Head(l, p, rows[i], h));
        }
      }
    }
  }
}

// Puts a NaN into one element of logical row `row`.
inline void PoisonRow(const HostKvPool& kv, uint32_t row) {
  kv.Head(0, 0, row, 0)[0] = kv.geometry().dtype == DType::kFP16 ? 0x7E00 : 0x7FC0;
}

// docs/design.md's guarantee for one head: |x̂ - x| <= (0.5 + 2^-8) s + 2^-8 |x̂| with
// s = bf16(max(|x| over the head, 2^-112) / 127) computed in fp32; an all-zero head restores
// exact zeros. Returns an empty string or the first violation.
inline std::string CheckHead(DType dtype, const uint16_t* x, const uint16_t* xhat,
                             uint32_t head_dim) {
  float m = 0.0f;
  for (uint32_t d = 0; d < head_dim; ++d) m = std::max(m, std::fabs(Decode16(dtype, x[d])));
  const bool zero = m == 0.0f;
  const float q = std::max(m, 0x1p-112f) / 127.0f;
  const double s = FloatFromBf16(Bf16FromFloat(q));
  for (uint32_t d = 0; d < head_dim; ++d) {
    const double xv = Decode16(dtype, x[d]);
    const double yv = Decode16(dtype, xhat[d]);
    const bool ok = zero ? yv == 0.0
                         : std::isfinite(yv) &&
                               std::fabs(yv - xv) <= (0.5 + 0x1p-8) * s + 0x1p-8 * std::fabs(yv);
    if (!ok) {
      char buf[200];
      std::snprintf(buf, sizeof(buf), "dim %u: x=%.9g (0x%04x) restored=%.9g (0x%04x) s=%.9g", d,
                    xv, x[d], yv, xhat[d], s);
      return buf;
    }
  }
  return {};
}

// CODEC_FP8_E4M3_PER_HEAD's guarantee for one head (kernels/README.md):
// |x̂ - x| <= 2^-4 |x̂| + 2^-10 s + (1 + 2^-4) (u |x̂| + a), s = bf16(max(|x|, 2^-112) / 448) in
// fp32, u = 2^-8 (BF16) or 2^-11 (FP16), a = the output's half subnormal spacing where x̂ is at
// most its smallest normal; an all-zero head restores exact zeros. Returns "" or the first
// violation.
inline std::string CheckHeadFp8(DType dtype, const uint16_t* x, const uint16_t* xhat,
                                uint32_t head_dim) {
  float m = 0.0f;
  for (uint32_t d = 0; d < head_dim; ++d) m = std::max(m, std::fabs(Decode16(dtype, x[d])));
  const bool zero = m == 0.0f;
  const float q = std::max(m, 0x1p-112f) / 448.0f;
  const double s = FloatFromBf16(Bf16FromFloat(q));
  const bool bf16 = dtype == DType::kBF16;
  const double u = bf16 ? 0x1p-8 : 0x1p-11;
  for (uint32_t d = 0; d < head_dim; ++d) {
    const double xv = Decode16(dtype, x[d]);
    const double yv = Decode16(dtype, xhat[d]);
    const double ay = std::fabs(yv);
    const double a = ay <= (bf16 ? 0x1p-126 : 0x1p-14) ? (bf16 ? 0x1p-134 : 0x1p-25) : 0.0;
    const double bound = 0x1p-4 * ay + 0x1p-10 * s + (1 + 0x1p-4) * (u * ay + a);
    const bool ok = zero ? yv == 0.0 : std::isfinite(yv) && std::fabs(yv - xv) <= bound;
    if (!ok) {
      char buf[200];
      std::snprintf(buf, sizeof(buf), "dim %u: x=%.9g (0x%04x) restored=%.9g (0x%04x) s=%.9g", d,
                    xv, x[d], yv, xhat[d], s);
      return buf;
    }
  }
  return {};
}

// CODEC_INT4_G32_PER_HEAD's guarantee for one head (kernels/README.md): INT8's bound with the
// scale of the element's group of 32, |x̂ - x| <= (0.5 + 2^-8) s + 2^-8 |x̂| (+ 2^-25 where an
// FP16 x̂ is subnormal), s = bf16(max(|x| over the group, 2^-112) / 7) in fp32; an all-zero
// group restores exact zeros. Returns "" or the first violation. REQUIRES: head_dim % 32 == 0.
inline std::string CheckHeadInt4(DType dtype, const uint16_t* x, const uint16_t* xhat,
                                 uint32_t head_dim) {
  for (uint32_t g0 = 0; g0 < head_dim; g0 += 32) {
    float m = 0.0f;
    for (uint32_t d = g0; d < g0 + 32; ++d) m = std::max(m, std::fabs(Decode16(dtype, x[d])));
    const bool zero = m == 0.0f;
    const float q = std::max(m, 0x1p-112f) / 7.0f;
    const double s = FloatFromBf16(Bf16FromFloat(q));
    for (uint32_t d = g0; d < g0 + 32; ++d) {
      const double xv = Decode16(dtype, x[d]);
      const double yv = Decode16(dtype, xhat[d]);
      const double ay = std::fabs(yv);
      const double a = dtype == DType::kFP16 && ay <= 0x1p-14 ? 0x1p-25 : 0.0;
      const bool ok =
          zero ? yv == 0.0
               : std::isfinite(yv) && std::fabs(yv - xv) <= (0.5 + 0x1p-8) * s + 0x1p-8 * ay + a;
      if (!ok) {
        char buf[200];
        std::snprintf(buf, sizeof(buf), "dim %u: x=%.9g (0x%04x) restored=%.9g (0x%04x) s=%.9g", d,
                      xv, x[d], yv, xhat[d], s);
        return buf;
      }
    }
  }
  return {};
}

struct CheckResult {
  uint64_t heads_checked = 0;
  uint64_t bad_heads = 0;
  std::string first;  // description of the first bad head
  bool ok() const { return bad_heads == 0 && heads_checked > 0; }
};

// Checks `rows` of layers [layer_begin, layer_end) of `kv` against data set `seed` (layout of
// FillRows) as `codec` restores them: bit-exact for CODEC_RAW, else within that codec's bound.
inline CheckResult CheckRowsOf(Codec codec, const HostKvPool& kv, uint64_t seed,
                               std::span<const uint32_t> rows, uint32_t block_tokens,
                               uint32_t first_block = 0, uint32_t layer_begin = 0,
                               uint32_t layer_end = UINT32_MAX) {
  const bool exact = codec == Codec::kRaw;
  const Geometry& g = kv.geometry();
  layer_end = std::min(layer_end, g.num_layers);
  CheckResult res;
  std::vector<uint16_t> want(g.head_dim);
  for (size_t i = 0; i < rows.size(); ++i) {
    const uint32_t b = first_block + static_cast<uint32_t>(i / block_tokens);
    const uint32_t t = static_cast<uint32_t>(i % block_tokens);
    for (uint32_t l = layer_begin; l < layer_end; ++l) {
      for (uint32_t p = 0; p < g.Planes(); ++p) {
        for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
          GenHead(seed, b, t, l, p, h, g.head_dim, g.dtype, want.data());
          const uint16_t* got = kv.Head(l, p, rows[i], h);
          std::string why;
          if (exact) {
            if (std::memcmp(got, want.data(), g.HeadBytes()) != 0) why = "not bit-exact";
          } else if (codec == Codec::kFp8E4m3PerHead) {
            why = CheckHeadFp8(g.dtype, want.data(), got, g.head_dim);
          } else if (codec == Codec::kInt4G32PerHead) {
            why = CheckHeadInt4(g.dtype, want.data(), got, g.head_dim);
          } else {
            why = CheckHead(g.dtype, want.data(), got, g.head_dim);
          }
          ++res.heads_checked;
          if (!why.empty()) {
            if (res.bad_heads++ == 0) {
              res.first = "block " + std::to_string(b) + " token " + std::to_string(t) + " (row " +
                          std::to_string(rows[i]) + ") layer " + std::to_string(l) + " plane " +
                          std::to_string(p) + " head " + std::to_string(h) + ": " + why;
            }
          }
        }
      }
    }
  }
  return res;
}

// The same within INT8's bound, or bit-exact when `exact` (CODEC_RAW, or never-touched data).
inline CheckResult CheckRows(const HostKvPool& kv, uint64_t seed, std::span<const uint32_t> rows,
                             uint32_t block_tokens, bool exact, uint32_t first_block = 0,
                             uint32_t layer_begin = 0, uint32_t layer_end = UINT32_MAX) {
  return CheckRowsOf(exact ? Codec::kRaw : Codec::kInt8PerHead, kv, seed, rows, block_tokens,
                     first_block, layer_begin, layer_end);
}

constexpr uint8_t kSentinel = 0xA5;

inline void FillSentinel(const HostKvPool& kv) {
  std::memset(kv.shm().data(), kSentinel, kv.shm().size());
}

// Puts the sentinel back into the heads of `rows` (all layers and planes).
inline void SentinelRows(const HostKvPool& kv, std::span<const uint32_t> rows) {
  const Geometry& g = kv.geometry();
  for (uint32_t r : rows) {
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      for (uint32_t p = 0; p < g.Planes(); ++p) {
        for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
          std::memset(kv.Head(l, p, r, h), kSentinel, g.HeadBytes());
        }
      }
    }
  }
}

// Number of bytes of `kv` outside the heads of `rows` (all layers and planes) that no longer hold
// the sentinel.
inline uint64_t ChangedOutside(const HostKvPool& kv, std::span<const uint32_t> rows) {
  const Geometry& g = kv.geometry();
  const auto* base = static_cast<const uint8_t*>(kv.shm().data());
  std::vector<uint8_t> mask(kv.shm().size(), 0);
  for (uint32_t r : rows) {
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      for (uint32_t p = 0; p < g.Planes(); ++p) {
        for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
          const size_t off = reinterpret_cast<const uint8_t*>(kv.Head(l, p, r, h)) - base;
          std::memset(mask.data() + off, 1, g.HeadBytes());
        }
      }
    }
  }
  uint64_t n = 0;
  for (size_t i = 0; i < mask.size(); ++i) n += !mask[i] && base[i] != kSentinel;
  return n;
}

// Number of bytes of `rows` (all layers, planes, heads) that still hold the sentinel pattern in
// both bytes of an element: a quick "was it written" test.
inline uint64_t SentinelElements(const HostKvPool& kv, std::span<const uint32_t> rows,
                                 uint32_t layer) {
  const Geometry& g = kv.geometry();
  const uint16_t pattern = uint16_t{kSentinel} * 0x0101;
  uint64_t n = 0;
  for (uint32_t r : rows) {
    for (uint32_t p = 0; p < g.Planes(); ++p) {
      for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
        const uint16_t* e = kv.Head(layer, p, r, h);
        for (uint32_t d = 0; d < g.head_dim; ++d) n += e[d] == pattern;
      }
    }
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// Keys and rows.

// Keys of `n` blocks of a token sequence derived from `seed`.
inline std::vector<BlockKey> Keys(uint64_t seed, uint32_t n, uint32_t block_tokens) {
  std::vector<uint32_t> tokens(size_t{n} * block_tokens);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(Mix(seed, i));
  return ComputeBlockKeys(tokens, block_tokens);
}

// `count` distinct rows below `num_rows`, shuffled, none in `exclude`.
inline std::vector<uint32_t> PickRows(uint32_t num_rows, uint32_t count, uint64_t seed,
                                      std::span<const uint32_t> exclude = {}) {
  std::vector<uint8_t> taken(num_rows, 0);
  for (uint32_t r : exclude) taken[r] = 1;
  std::vector<uint32_t> all;
  for (uint32_t r = 0; r < num_rows; ++r) {
    if (!taken[r]) all.push_back(r);
  }
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(std::min<size_t>(count, all.size()));
  return all;
}

// rows [first, first + count).
inline std::vector<uint32_t> RowRange(uint32_t first, uint32_t count) {
  std::vector<uint32_t> v(count);
  std::iota(v.begin(), v.end(), first);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Stats.

inline const NamespaceStats* FindNamespace(const DaemonStats& s, const std::string& id) {
  for (const auto& n : s.namespaces) {
    if (n.namespace_id == id) return &n;
  }
  return nullptr;
}

// Everything GetStats reports except uptime and peers, as text, for before/after comparisons.
inline std::string StatsText(const DaemonStats& s) {
  std::string out = "pool_bytes=" + std::to_string(s.pool_bytes) +
                    " used=" + std::to_string(s.used_bytes) +
                    " capacity=" + std::to_string(s.capacity_bytes) +
                    " blocks=" + std::to_string(s.blocks) + " clients=" + std::to_string(s.clients);
  for (const auto& n : s.namespaces) {
    out += "\n ns " + n.namespace_id + " " + n.model + "/" + n.tenant +
           " blocks=" + std::to_string(n.blocks) + " bytes=" + std::to_string(n.bytes) +
           " hits=" + std::to_string(n.hits) + " misses=" + std::to_string(n.misses) +
           " backups=" + std::to_string(n.backups) + " restores=" + std::to_string(n.restores) +
           " evictions=" + std::to_string(n.evictions) + " rejected=" + std::to_string(n.rejected) +
           " pools=" + std::to_string(n.pools);
  }
  for (const auto& p : s.pools) {
    out += "\n pool " + std::to_string(p.pool_id) + " ns=" + p.namespace_id +
           " backups=" + std::to_string(p.backups) + " restores=" + std::to_string(p.restores);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Pools.

inline Geometry Geom(uint32_t layers, uint32_t heads, uint32_t dim, DType dtype = DType::kBF16) {
  Geometry g;
  g.num_layers = layers;
  g.num_kv_heads = heads;
  g.head_dim = dim;
  g.dtype = dtype;
  return g;
}

// A HOST KV pool (and event slots) registered with a daemon through the client library.
struct TestPool {
  HostKvPool kv;
  HostEventPool events;  // invalid when created with 0 slots
  PoolSpec spec;
  PoolHandle handle;
  RegisteredPool info;
};

struct PoolOptions {
  std::string model = "it-model";
  std::string tenant;
  Geometry geometry;
  KvLayout layout = KvLayout::kSglang;
  uint32_t num_rows = 128;
  uint32_t page_rows = 16;
  uint32_t block_tokens = 16;
  Codec codec = Codec::kInt8PerHead;
  uint32_t event_slots = 0;
  std::string kv_name;  // HostKvPool::Create's name: "" = a named shm object, "memfd:<tag>"
  HugePages huge_pages = HugePages::kAuto;
};

inline StatusOr<TestPool> MakePool(Client& client, const PoolOptions& o) {
  TestPool p;
  HIQ_ASSIGN_OR_RETURN(p.kv, HostKvPool::Create(o.geometry, o.layout, o.num_rows, o.page_rows,
                                                o.kv_name, o.huge_pages));
  if (o.event_slots > 0) {
    HIQ_ASSIGN_OR_RETURN(p.events, HostEventPool::Create(o.event_slots));
  }
  p.spec = MakeHostPoolSpec(o.model, p.kv, o.block_tokens, o.event_slots > 0 ? &p.events : nullptr,
                            o.codec);
  p.spec.tenant = o.tenant;
  HIQ_ASSIGN_OR_RETURN(p.handle, client.RegisterPool(p.spec));
  HIQ_ASSIGN_OR_RETURN(p.info, client.PoolInfo(p.handle));
  return p;
}

// The namespace `s` registers in, named by its parts, as a scheduler that holds no pool names it.
inline NamespaceRef RefOf(const PoolSpec& s) {
  NamespaceRef r;
  r.model = s.model;
  r.tenant = s.tenant;
  r.geometry = s.geometry;
  r.block_tokens = s.block_tokens;
  r.codec = s.codec;
  return r;
}

inline std::unique_ptr<Client> Connect(
    const std::string& target,
    std::chrono::milliseconds call_timeout = test_time::Margin(std::chrono::seconds(5))) {
  ClientOptions o;
  o.target = target;
  o.call_timeout = call_timeout;
  auto c = Client::Connect(o);
  return c.ok() ? std::move(c).value() : nullptr;
}

// ---------------------------------------------------------------------------------------------
// Sessions for raw gRPC.

// A session with the daemon for tests that speak raw gRPC: the daemon names the caller of
// RegisterPool, ReleasePool, Lookup, Backup, Restore, Evict and Drain by the session token in the
// call's metadata (session_protocol.h), as the client library sends it. Attach is a template so
// that this header needs no gRPC: pass a grpc::ClientContext. Pools belong to the registering
// process, so a SessionContext of the same process may use the pools a Client registered.
class SessionContext {
 public:
  static StatusOr<SessionContext> Open(
      const std::string& target, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    HIQ_ASSIGN_OR_RETURN(std::unique_ptr<Session> s, Session::Open(target, timeout));
    SessionContext c;
    c.session_ = std::move(s);
    return c;
  }
  SessionContext() = default;

  // Adds the token to `ctx` (a grpc::ClientContext, before its call starts). Does nothing on an
  // empty SessionContext (an anonymous call).
  template <typename Context>
  void Attach(Context* ctx) const {
    if (session_ != nullptr) {
      ctx->AddMetadata(std::string(kSessionMetadataKey), session_->token());
    }
  }
  // Passes one fd and returns its id for SharedBuffer/EventPool.host_fd_id (0 on failure).
  uint64_t PassFd(int fd) const {
    if (session_ == nullptr) return 0;
    auto ids = session_->SendFds(std::span<const int>(&fd, 1));
    return ids.ok() && ids->size() == 1 ? (*ids)[0] : 0;
  }
  Session* session() const { return session_.get(); }
  bool valid() const { return session_ != nullptr; }
  void Close() { session_.reset(); }

 private:
  std::unique_ptr<Session> session_;
};

// ---------------------------------------------------------------------------------------------
// Processes.

struct SpawnResult {
  int exit_code = -1;  // -1: could not start or killed
  pid_t pid = -1;
  std::string out;  // stdout
};

// `argv` run as uid and gid `uid` with no supplementary groups (util-linux setpriv, part of every
// Debian system): for Spawn, when a test acting as root needs a client of another user. A forked
// child of a gRPC-using test process cannot be used for that (gRPC does not survive a fork).
inline std::vector<std::string> AsUid(uint32_t uid, std::vector<std::string> argv) {
  std::vector<std::string> out = {"/usr/bin/setpriv", "--reuid=" + std::to_string(uid),
                                  "--regid=" + std::to_string(uid), "--clear-groups", "--"};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

// Runs `argv` (argv[0] = path) with posix_spawn (no fork of this gRPC-using process), collects
// its stdout and waits for it, killing it after `timeout`.
inline SpawnResult Spawn(const std::vector<std::string>& argv,
                         std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  SpawnResult res;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return res;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  std::vector<char*> args;
  std::vector<std::string> copy = argv;
  for (auto& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return res;
  }
  res.pid = pid;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
  char buf[4096];
  int status = 0;
  for (;;) {
    ssize_t n;
    while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) res.out.append(buf, n);
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ::close(fds[0]);
      return res;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) res.out.append(buf, n);
  ::close(fds[0]);
  res.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return res;
}

// Polls `pred` every 10 ms until it holds or `timeout` passes (by default the margin of 10 s,
// test_time::Margin, in which a loaded machine gets done what an idle one does at once).
template <typename Pred>
bool Eventually(Pred pred,
                std::chrono::milliseconds timeout = test_time::Margin(std::chrono::seconds(10))) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace hiqcache::it
