// libFuzzer target over the daemon's request path (docs/design.md "Faults": no malformed request
// crashes the daemon or writes out of bounds).
//
// Input: a serialized hiqcache.fuzz.FuzzInput, a short list of hiqcache.v1 requests. Each request
// goes through the gRPC adapter's conversions (cache_service.h) into one CacheCore, exactly as a
// handler would, without a socket. The core serves a HOST pool registered once in
// LLVMFuzzerInitialize over small shm KV buffers and event slots created here. Mapping of fuzzed
// values onto real objects, so that mutations reach deep code:
//   pool_id 1 -> the pool registered at start; 2 -> the last pool this input registered
//   (0 stays 0: a Lookup over LookupRequest.namespaces alone);
//   host_shm_name "kv" -> the KV shm object, "ev" -> the event shm object; any other name that
//   shm_open would accept -> a name that does not exist (the fuzzer never opens foreign objects).
// Every backup and restore completes before the next request (the core is waited idle).
//
// Checks beyond the sanitizers:
//  - a request rejected by validation (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED,
//    FAILED_PRECONDITION) changes neither the KV buffer nor the block store's counters;
//  - a registration that is accepted addresses only bytes inside its buffers (every view's
//    last byte is recomputed here by brute force over its rows).
// The pool lives in a mapping between PROT_NONE guard pages: a stray access faults.
#include <fcntl.h>
#include <google/protobuf/stubs/logging.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backends/host_backend.h"
#include "codec_cpu.h"
#include "core/cache_core.h"
#include "fuzz_input.pb.h"
#include "hiqcache/log.h"
#include "pool/block_store.h"
#include "transport/cache_service.h"

namespace hiqcache::fuzz {
namespace {

namespace v1 = ::hiqcache::v1;
using server::CacheCore;

constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 32, kBlockTokens = 4, kRows = 64;
constexpr uint64_t kRowBytes = uint64_t{kHeads} * kDim * 2;
constexpr uint64_t kKvBytes = uint64_t{kLayers} * 2 * kRows * kRowBytes;  // 32 KiB
constexpr uint32_t kEvents = 8;
constexpr uint64_t kPoolBytes = 2ull << 20;
constexpr size_t kMaxCalls = 32;

struct World {
  std::string kv_name, ev_name, missing_name;
  uint8_t* kv = nullptr;
  uint64_t* events = nullptr;
  uint8_t* pool = nullptr;
  std::unique_ptr<kernels::CpuCodec> codec;
  std::unique_ptr<server::HostBackend> host;
  std::unique_ptr<server::BlockStore> store;
  std::unique_ptr<CacheCore> core;
  uint64_t base_pool = 0;
  v1::RegisterPoolRequest base_request;
};
World* world = nullptr;

// Outcomes per RPC (index: FuzzCall::call_case()), printed at exit: how deep the inputs get.
constexpr int kCases = 8;
uint64_t outcome_ok[kCases] = {}, outcome_err[kCases] = {};
const char* kCaseNames[kCases] = {"none",   "RegisterPool", "ReleasePool", "Lookup",
                                  "Backup", "Restore",      "Evict",       "GetStats"};

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "request_fuzzer: %s\n", why.c_str());
  std::abort();
}

void* CreateShm(const std::string& name, size_t bytes) {
  ::shm_unlink(name.c_str());
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) Die("cannot create " + name);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) Die("cannot map " + name);
  return p;
}

void Cleanup() {
  if (world == nullptr) return;
  std::fprintf(stderr, "request_fuzzer: outcomes (ok/error):");
  for (int c = 1; c < kCases; ++c) {
    std::fprintf(stderr, " %s %llu/%llu", kCaseNames[c],
                 static_cast<unsigned long long>(outcome_ok[c]),
                 static_cast<unsigned long long>(outcome_err[c]));
  }
  std::fprintf(stderr, "\n");
  ::shm_unlink(world->kv_name.c_str());
  ::shm_unlink(world->ev_name.c_str());
}

void SetView(v1::TensorView* t, uint64_t offset) {
  t->set_buffer(0);
  t->set_offset_bytes(offset);
  t->set_row_stride_bytes(kRowBytes);
  t->set_num_rows(kRows);
}

v1::RegisterPoolRequest BaseRequest() {
  v1::RegisterPoolRequest r;
  r.set_model("fuzz-model");
  auto* g = r.mutable_geometry();
  g->set_num_layers(kLayers);
  g->set_num_kv_heads(kHeads);
  g->set_head_dim(kDim);
  g->set_dtype(v1::DTYPE_BF16);
  g->set_attention(v1::ATTENTION_MHA);
  g->set_tp_rank(0);
  g->set_tp_size(1);
  r.set_block_tokens(kBlockTokens);
  r.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  auto* b = r.add_buffers();
  b->set_host_shm_name("kv");
  b->set_size_bytes(kKvBytes);
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto* lv = r.add_layers();
    SetView(lv->mutable_k(), (2ull * l) * kRows * kRowBytes);
    SetView(lv->mutable_v(), (2ull * l + 1) * kRows * kRowBytes);
  }
  r.mutable_events()->set_host_shm_name("ev");
  r.mutable_events()->set_count(kEvents);
  return r;
}

// Names as the fuzzer wrote them -> names of objects this process owns (or none at all).
std::string MapShmName(const std::string& name) {
  if (name == "kv") return world->kv_name;
  if (name == "ev") return world->ev_name;
  const size_t start = !name.empty() && name[0] == '/' ? 1 : 0;
  const bool openable = !name.empty() && name.size() <= 255 && start < name.size() &&
                        name.find('/', start) == std::string::npos &&
                        name.find('\0') == std::string::npos;
  return openable ? world->missing_name : name;
}

uint64_t MapPoolId(uint64_t id, uint64_t last) {
  if (id == 1) return world->base_pool;
  if (id == 2) return last != 0 ? last : world->base_pool;
  return id;
}

bool Rejected(const Status& st) {
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kResourceExhausted:
    case StatusCode::kFailedPrecondition:
      return true;
    default:
      return false;
  }
}

std::string CountersText(const server::StoreStats& s) {
  std::string out = std::to_string(s.blocks) + "/" + std::to_string(s.used_bytes);
  for (const auto& [id, c] : s.namespaces) {
    out += " " + std::to_string(id) + ":" + std::to_string(c.blocks) + "," +
           std::to_string(c.hits) + "," + std::to_string(c.misses) + "," +
           std::to_string(c.backups) + "," + std::to_string(c.restores) + "," +
           std::to_string(c.evictions) + "," + std::to_string(c.rejected);
  }
  return out;
}

// Independent check of an accepted registration, by docs/design.md's formulas rather than the
// daemon's code: every element of every view, by brute force over its rows (sampled for views of
// very many rows), lies inside its buffer; and a split view (row_group, dim_run or
// dim_stride_bytes set) addresses each of its elements at bytes of its own, every byte of its
// rows' elements marked once (a split view is written by several codec threads at once).
void CheckViewsInside(const server::RegisterSpec& spec) {
  using u128 = unsigned __int128;
  const uint64_t d = spec.head_dim;
  uint64_t budget = 1u << 20;
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    for (const server::ViewSpec* v : {&spec.layers[l].k, &spec.layers[l].v}) {
      if (!v->present) continue;
      if (v->buffer >= spec.buffers.size()) Die("accepted view names a missing buffer");
      const u128 hs = v->head_stride_bytes != 0 ? v->head_stride_bytes : u128{d} * 2;
      // A head: runs of run_len elements, run j at j * run_stride, element i at i * es.
      const uint64_t run_len = v->dim_run != 0 ? v->dim_run : d;
      const uint64_t runs = run_len != 0 ? d / run_len : 0;
      const u128 run_stride = v->dim_run_stride_bytes;
      const u128 es = v->dim_stride_bytes != 0 ? v->dim_stride_bytes : 2;
      if (runs * run_len != d) Die("accepted a dim_run that does not divide head_dim");
      const bool split = v->row_group != 0 || v->dim_run != 0 || v->dim_stride_bytes != 0;
      const uint64_t size = spec.buffers[v->buffer].size_bytes;
      auto head0 = [&](uint64_t r) -> u128 {
        const uint64_t p = v->page_rows != 0 ? r / v->page_rows : 0;
        const uint64_t t = v->page_rows != 0 ? r % v->page_rows : r;
        const u128 slot = v->row_group != 0 ? u128{t / v->row_group} * v->row_group_stride_bytes +
                                                  u128{t % v->row_group} * v->row_stride_bytes
                                            : u128{t} * v->row_stride_bytes;
        return u128{v->offset_bytes} + u128{p} * v->page_stride_bytes + slot;
      };
      auto check_row = [&](uint64_t r) {
        // Every stride is unsigned: the farthest element is the last one of the last head.
        const u128 end = head0(r) + u128{spec.num_kv_heads - 1} * hs + u128{runs - 1} * run_stride +
                         u128{run_len - 1} * es + 2;
        if (end > size) {
          Die("registration accepted a view that addresses byte " +
              std::to_string(static_cast<uint64_t>(end)) + " of a " + std::to_string(size) +
              "-byte buffer (layer " + std::to_string(l) + ", row " + std::to_string(r) + ")");
        }
      };
      const uint64_t n = v->num_rows;
      if (n <= 4096 && budget >= n) {
        for (uint64_t r = 0; r < n; ++r) check_row(r);
        budget -= n;
      } else {
        for (uint64_t r = 0; r < std::min<uint64_t>(n, 256); ++r) check_row(r);
        for (uint64_t r = n > 256 ? n - 256 : 0; r < n; ++r) check_row(r);
        for (uint64_t i = 1; i < 64; ++i) check_row(n / 64 * i);
      }
      // Inside its buffer, a view without overlap has at most size / 2 elements: the walk below
      // stops at the first byte marked twice, so it costs at most that many steps.
      if (!split || size > (4u << 20)) continue;
      std::vector<uint8_t> owner(size, 0);
      for (uint64_t r = 0; r < n; ++r) {
        for (uint64_t h = 0; h < spec.num_kv_heads; ++h) {
          for (uint64_t j = 0; j < runs; ++j) {
            for (uint64_t i = 0; i < run_len; ++i) {
              const uint64_t at = static_cast<uint64_t>(head0(r) + u128{h} * hs +
                                                        u128{j} * run_stride + u128{i} * es);
              if (owner[at] != 0 || owner[at + 1] != 0) {
                Die("registration accepted a split view whose elements overlap (layer " +
                    std::to_string(l) + ", row " + std::to_string(r) + ", head " +
                    std::to_string(h) + ", element " + std::to_string(j * run_len + i) +
                    " at byte " + std::to_string(at) + ")");
              }
              owner[at] = owner[at + 1] = 1;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace hiqcache::fuzz

using namespace hiqcache;
using namespace hiqcache::fuzz;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Quiet: protobuf logs every string field with invalid UTF-8, the core every registration.
  google::protobuf::SetLogHandler(nullptr);
  SetLogLevel(LogLevel::kError);
  world = new World();
  const std::string tag = std::to_string(::getpid());
  world->kv_name = "/hiq-fuzz-kv-" + tag;
  world->ev_name = "/hiq-fuzz-ev-" + tag;
  world->missing_name = "/hiq-fuzz-none-" + tag;
  world->kv = static_cast<uint8_t*>(CreateShm(world->kv_name, kKvBytes));
  world->events = static_cast<uint64_t*>(CreateShm(world->ev_name, 64 * kEvents));
  std::atexit(Cleanup);
  // Finite BF16 data (small integers), and event slots some waits find satisfied.
  auto* kv16 = reinterpret_cast<uint16_t*>(world->kv);
  for (uint64_t i = 0; i < kKvBytes / 2; ++i) kv16[i] = static_cast<uint16_t>(0x3F80 + (i % 97));
  for (uint32_t e = 0; e < kEvents; ++e) world->events[8 * e] = e % 2 == 0 ? 0 : (1ull << 40);

  const long page = ::sysconf(_SC_PAGESIZE);
  void* region = ::mmap(nullptr, kPoolBytes + 2 * page, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (region == MAP_FAILED) Die("cannot map the pool");
  world->pool = static_cast<uint8_t*>(region) + page;
  if (::mprotect(world->pool, kPoolBytes, PROT_READ | PROT_WRITE) != 0) Die("mprotect");

  world->codec = std::make_unique<kernels::CpuCodec>(1);
  world->host =
      std::make_unique<server::HostBackend>(world->codec.get(), std::chrono::milliseconds(1));
  world->store = std::make_unique<server::BlockStore>(world->pool, kPoolBytes);
  server::CoreOptions options;
  options.transfer_workers = 1;
  options.limits.max_blocks_per_request = 64;
  world->core =
      std::make_unique<CacheCore>(options, world->store.get(), world->host.get(), nullptr);
  world->base_request = BaseRequest();
  server::RegisterSpec spec = server::RegisterSpecFromProto(world->base_request, "fuzz");
  for (auto& b : spec.buffers) b.host_shm_name = MapShmName(b.host_shm_name);
  spec.events.host_shm_name = MapShmName(spec.events.host_shm_name);
  auto reg = world->core->RegisterPool(spec);
  if (!reg.ok()) Die("base registration failed: " + reg.status().ToString());
  world->base_pool = reg->pool_id;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hiqcache::fuzz::FuzzInput input;
  if (!input.ParseFromArray(data, static_cast<int>(size))) return -1;  // not kept in the corpus
  CacheCore& core = *world->core;
  std::vector<uint64_t> registered;
  std::vector<uint8_t> kv_before(kKvBytes);
  size_t calls = 0;
  for (const auto& call : input.calls()) {
    if (++calls > kMaxCalls) break;
    const uint64_t last = registered.empty() ? 0 : registered.back();
    std::memcpy(kv_before.data(), world->kv, kKvBytes);
    const std::string counters_before = CountersText(world->store->Stats());
    Status st;
    const char* what = "";
    switch (call.call_case()) {
      case FuzzCall::kRegisterPool: {
        what = "RegisterPool";
        server::RegisterSpec spec = server::RegisterSpecFromProto(call.register_pool(), "fuzz");
        for (auto& b : spec.buffers) b.host_shm_name = MapShmName(b.host_shm_name);
        spec.events.host_shm_name = MapShmName(spec.events.host_shm_name);
        spec.client_pid = 0;
        auto reg = core.RegisterPool(spec);
        st = reg.status();
        if (reg.ok()) {
          CheckViewsInside(spec);
          registered.push_back(reg->pool_id);
        }
        break;
      }
      case FuzzCall::kReleasePool: {
        what = "ReleasePool";
        const uint64_t id = MapPoolId(call.release_pool().pool_id(), last);
        if (id == world->base_pool) continue;  // the shared pool stays for later inputs
        st = core.ReleasePool(id);
        break;
      }
      case FuzzCall::kLookup: {
        what = "Lookup";
        // pool_id 0 stays 0: a group lookup over LookupRequest.namespaces alone.
        server::LookupSpec spec = server::LookupSpecFromProto(call.lookup());
        if (spec.pool_id != 0) spec.pool_id = MapPoolId(spec.pool_id, last);
        st = core.Lookup(spec).status();
        break;
      }
      case FuzzCall::kEvict: {
        what = "Evict";
        std::vector<std::string> keys(call.evict().keys().begin(), call.evict().keys().end());
        st = core.Evict(MapPoolId(call.evict().pool_id(), last), keys).status();
        break;
      }
      case FuzzCall::kBackup: {
        what = "Backup";
        server::TransferSpec spec = server::BackupSpecFromProto(call.backup());
        spec.pool_id = MapPoolId(spec.pool_id, last);
        const size_t n = spec.blocks.size();
        core.Backup(std::move(spec), [&st, n](StatusOr<server::BackupResult> r) {
          st = r.status();
          if (r.ok() && r->results.size() != n) Die("Backup answered the wrong number of results");
        });
        break;
      }
      case FuzzCall::kRestore: {
        what = "Restore";
        server::TransferSpec spec = server::RestoreSpecFromProto(call.restore());
        spec.pool_id = MapPoolId(spec.pool_id, last);
        const size_t n = spec.blocks.size();
        core.Restore(std::move(spec), [&st, n](StatusOr<server::RestoreResult> r) {
          st = r.status();
          if (r.ok() && r->restored_blocks > n) Die("Restore restored more blocks than asked");
        });
        break;
      }
      case FuzzCall::kGetStats:
        what = "GetStats";
        (void)core.Snapshot();
        break;
      default:
        continue;
    }
    core.WaitIdle();  // sync or not, the work is done before the next request
    const int c = static_cast<int>(call.call_case());
    if (c > 0 && c < kCases) (st.ok() ? outcome_ok : outcome_err)[c]++;
    if (Rejected(st)) {
      if (std::memcmp(kv_before.data(), world->kv, kKvBytes) != 0) {
        Die(std::string(what) + " was rejected (" + st.ToString() + ") but wrote the KV buffer");
      }
      const std::string counters_after = CountersText(world->store->Stats());
      if (counters_after != counters_before) {
        Die(std::string(what) + " was rejected (" + st.ToString() +
            ") but changed the store: " + counters_before + " -> " + counters_after);
      }
    }
  }
  for (uint64_t id : registered) (void)core.ReleasePool(id);
  core.WaitIdle();
  return 0;
}
