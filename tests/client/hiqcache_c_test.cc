// The C ABI (hiqcache/hiqcache_c.h) as a foreign-language engine sees it: libhiqcache.so loaded
// with dlopen, every entry point resolved by name, only hiq_* symbols exported, codes = gRPC
// codes with hiq_last_error naming the field, and a HOST pool round trip through the real
// hiqcached (backup, lookup, restore with per-layer event slots, evict, stats, release). No GPU
// needed: the hiq_cuda_* entry points must answer cleanly (UNIMPLEMENTED without CUDA in the
// build, FAILED_PRECONDITION with a reason without a GPU).
#include "hiqcache/hiqcache_c.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "hiqcache/block_keys.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/pool_spec.h"
#include "huge_pages.h"
#include "integration/daemon_process.h"
#include "time_margin.h"

#ifndef HIQ_C_LIB_PATH
#error "HIQ_C_LIB_PATH must name libhiqcache.so"
#endif

extern "C" int hiq_test_c_header_sizes(void);  // hiqcache_c_header_check.c

namespace hiqcache {
namespace {

// Every exported entry point, listed once (an X-macro), resolved below with dlsym as ctypes does.
#define HIQ_C_ABI_FUNCTIONS(X)   \
  X(hiq_abi_version)             \
  X(hiq_version)                 \
  X(hiq_last_error)              \
  X(hiq_connect)                 \
  X(hiq_close)                   \
  X(hiq_register_pool)           \
  X(hiq_release_pool)            \
  X(hiq_pool_info_get)           \
  X(hiq_host_pool_create)        \
  X(hiq_host_pool_create_memfd)  \
  X(hiq_host_pool_huge_pages)    \
  X(hiq_host_pool_destroy)       \
  X(hiq_host_pool_data)          \
  X(hiq_host_pool_num_rows)      \
  X(hiq_host_pool_head_offset)   \
  X(hiq_host_pool_wait)          \
  X(hiq_host_pool_event_read)    \
  X(hiq_host_pool_event_store)   \
  X(hiq_register_host_pool)      \
  X(hiq_lookup)                  \
  X(hiq_backup)                  \
  X(hiq_restore)                 \
  X(hiq_evict)                   \
  X(hiq_get_stats)               \
  X(hiq_get_l3_stats)            \
  X(hiq_compute_block_keys)      \
  X(hiq_cuda_available)          \
  X(hiq_cuda_device_uuid)        \
  X(hiq_cuda_export_pointer)     \
  X(hiq_cuda_slots_create)       \
  X(hiq_cuda_slots_destroy)      \
  X(hiq_cuda_slots_count)        \
  X(hiq_cuda_slots_read)         \
  X(hiq_cuda_slots_store)        \
  X(hiq_cuda_slots_wait)         \
  X(hiq_cuda_slots_stream_wait)  \
  X(hiq_cuda_slots_stream_write) \
  X(hiq_cuda_slots_device_address)

struct Api {
  void* lib = nullptr;
#define HIQ_FN(name) decltype(&::name) name = nullptr;
  HIQ_C_ABI_FUNCTIONS(HIQ_FN)
#undef HIQ_FN
  std::vector<std::string> missing;

  bool Load() {
    lib = dlopen(HIQ_C_LIB_PATH, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      missing.push_back(dlerror());
      return false;
    }
#define HIQ_FN(name)                                          \
  name = reinterpret_cast<decltype(name)>(dlsym(lib, #name)); \
  if (name == nullptr) missing.push_back(#name);
    HIQ_C_ABI_FUNCTIONS(HIQ_FN)
#undef HIQ_FN
    return missing.empty();
  }
};

Api& C() {
  static Api* api = [] {
    auto* a = new Api();
    a->Load();
    return a;
  }();
  return *api;
}

class HiqcacheCTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(C().lib, nullptr) << (C().missing.empty() ? "" : C().missing[0]);
    ASSERT_TRUE(C().missing.empty()) << "unresolved: " << C().missing[0];
  }
};

TEST_F(HiqcacheCTest, ExportsOnlyTheCAbi) {
  EXPECT_EQ(C().hiq_abi_version(), HIQ_C_ABI_VERSION);
  EXPECT_STREQ(C().hiq_version(), HIQ_PROJECT_VERSION);
  EXPECT_EQ(hiq_test_c_header_sizes(), 1) << "the C view of the structs changed size";
  // The C++ client linked into the library is hidden: an engine's own copy cannot collide.
  for (const char* hidden :
       {"_ZN8hiqcache6Client7ConnectENS_13ClientOptionsE",
        "_ZN8hiqcache14StatusCodeNameENS_10StatusCodeE", "cudaMalloc", "cudaGetDeviceCount"}) {
    EXPECT_EQ(dlsym(C().lib, hidden), nullptr) << hidden << " is exported";
  }
}

TEST_F(HiqcacheCTest, ComputeBlockKeysMatchesTheCppLibrary) {
  std::vector<uint32_t> tokens(100);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 7919 + 3);
  const std::string salt = "lora:adapter-7";
  const std::vector<BlockKey> want = ComputeBlockKeys(tokens, 16, salt);
  ASSERT_EQ(want.size(), 6u);
  std::vector<uint8_t> got(16 * 10, 0xEE);
  uint64_t n = 0;
  ASSERT_EQ(C().hiq_compute_block_keys(tokens.data(), tokens.size(), 16, salt.data(), salt.size(),
                                       got.data(), 10, &n),
            HIQ_OK);
  ASSERT_EQ(n, 6u);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(std::memcmp(got.data() + 16 * i, want[i].data(), 16), 0) << i;
  }
  EXPECT_EQ(got[16 * 6], 0xEE);  // nothing past the keys
  // Truncated output still reports the full count.
  ASSERT_EQ(C().hiq_compute_block_keys(tokens.data(), tokens.size(), 16, salt.data(), salt.size(),
                                       got.data(), 2, &n),
            HIQ_OK);
  EXPECT_EQ(n, 6u);
  EXPECT_EQ(
      C().hiq_compute_block_keys(tokens.data(), tokens.size(), 0, nullptr, 0, got.data(), 10, &n),
      HIQ_INVALID_ARGUMENT);
  EXPECT_NE(std::string(C().hiq_last_error()).find("block_tokens"), std::string::npos);
}

TEST_F(HiqcacheCTest, ErrorsAreGrpcCodesWithMessages) {
  hiq_client* client = nullptr;
  EXPECT_EQ(C().hiq_connect("no-port-here", 100, &client), HIQ_INVALID_ARGUMENT);
  EXPECT_EQ(client, nullptr);
  EXPECT_NE(std::string(C().hiq_last_error()).find("no-port-here"), std::string::npos);
  EXPECT_EQ(C().hiq_connect("unix:///nonexistent/hiq.sock", 200, nullptr), HIQ_INVALID_ARGUMENT);

  // Fail-open against no daemon: UNAVAILABLE (or DEADLINE_EXCEEDED), results report misses.
  ASSERT_EQ(C().hiq_connect("unix:///nonexistent/hiq-c-test.sock", 300, &client), HIQ_OK);
  hiq_stats stats;
  const int rc = C().hiq_get_stats(client, &stats);
  EXPECT_TRUE(rc == HIQ_UNAVAILABLE || rc == HIQ_DEADLINE_EXCEEDED) << rc;
  EXPECT_STRNE(C().hiq_last_error(), "");
  uint32_t prefix = 99;
  uint8_t key[16] = {};
  EXPECT_EQ(C().hiq_lookup(client, 12345, key, 1, &prefix), HIQ_INVALID_ARGUMENT);  // unknown pool
  EXPECT_EQ(prefix, 0u);
  uint8_t status[2] = {0, 0};
  uint32_t rows[4] = {0, 1, 2, 3};
  EXPECT_EQ(C().hiq_backup(client, 12345, key, 1, rows, 4, -1, 0, -1, 1, status, nullptr),
            HIQ_INVALID_ARGUMENT);
  EXPECT_EQ(status[0], HIQ_BLOCK_NOT_STORED);
  C().hiq_close(client);
  C().hiq_close(nullptr);
}

TEST_F(HiqcacheCTest, CudaEntryPointsAnswerWithoutAGpu) {
  const int rc = C().hiq_cuda_available();
  if (rc == HIQ_OK) GTEST_SKIP() << "a CUDA device is usable here: see tests/gpu";
  EXPECT_TRUE(rc == HIQ_UNIMPLEMENTED || rc == HIQ_FAILED_PRECONDITION) << rc;
  const std::string why = C().hiq_last_error();
  EXPECT_FALSE(why.empty());
  std::printf("hiq_cuda_available: %d (%s)\n", rc, why.c_str());
  hiq_cuda_slots* slots = reinterpret_cast<hiq_cuda_slots*>(1);
  EXPECT_NE(C().hiq_cuda_slots_create(0, 4, &slots), HIQ_OK);
  EXPECT_EQ(slots, nullptr);
  EXPECT_EQ(C().hiq_cuda_slots_count(nullptr), 0u);
  EXPECT_EQ(C().hiq_cuda_slots_read(nullptr, 0), 0u);
  EXPECT_NE(C().hiq_cuda_slots_wait(nullptr, 0, 1, 0), HIQ_OK);
  EXPECT_NE(C().hiq_cuda_slots_stream_wait(nullptr, 0, 1, nullptr), HIQ_OK);
  EXPECT_NE(C().hiq_cuda_slots_stream_write(nullptr, 0, 1, nullptr), HIQ_OK);
  char uuid[64];
  EXPECT_NE(C().hiq_cuda_device_uuid(0, uuid, sizeof(uuid)), HIQ_OK);
  uint8_t handle[64];
  int host_value = 0;
  EXPECT_NE(C().hiq_cuda_export_pointer(&host_value, handle, nullptr, nullptr, nullptr), HIQ_OK);
}

// --- against the real daemon ------------------------------------------------------------------

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t b) {
  uint32_t u = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

class HiqcacheCDaemonTest : public HiqcacheCTest {
 protected:
  void SetUp() override {
    HiqcacheCTest::SetUp();
    daemon_ = std::make_unique<testing::DaemonProcess>(
        "64MiB", std::vector<std::string>{"--device", "host"});
    ASSERT_TRUE(daemon_->Start());
    ASSERT_EQ(C().hiq_connect(daemon_->target().c_str(), 5000, &client_), HIQ_OK)
        << C().hiq_last_error();
  }
  void TearDown() override {
    if (client_ != nullptr) C().hiq_close(client_);
    daemon_.reset();
  }
  std::unique_ptr<testing::DaemonProcess> daemon_;
  hiq_client* client_ = nullptr;
};

TEST_F(HiqcacheCDaemonTest, HostPoolRoundTrip) {
  const Api& c = C();
  hiq_geometry g{};
  g.num_layers = 3;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.dtype = HIQ_DTYPE_BF16;
  const uint32_t kRows = 64, kBlockTokens = 4, kBlocks = 3;
  hiq_host_pool* pool = nullptr;
  ASSERT_EQ(c.hiq_host_pool_create(&g, HIQ_LAYOUT_VLLM_PAGED, kRows, 8, 8, &pool), HIQ_OK)
      << c.hiq_last_error();
  ASSERT_EQ(c.hiq_host_pool_num_rows(pool), kRows);
  uint64_t size = 0;
  auto* data = static_cast<uint8_t*>(c.hiq_host_pool_data(pool, &size));
  ASSERT_NE(data, nullptr);
  EXPECT_EQ(c.hiq_host_pool_head_offset(pool, 3, 0, 0, 0), UINT64_MAX);
  EXPECT_EQ(c.hiq_host_pool_head_offset(pool, 0, 0, kRows, 0), UINT64_MAX);

  // Rows 10.. hold data; restore targets rows 40.. .
  std::vector<uint32_t> src_rows, dst_rows;
  for (uint32_t i = 0; i < kBlocks * kBlockTokens; ++i) {
    src_rows.push_back(10 + i);
    dst_rows.push_back(40 + i);
  }
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto head = [&](uint32_t l, uint32_t p, uint32_t r, uint32_t h) {
    const uint64_t off = c.hiq_host_pool_head_offset(pool, l, p, r, h);
    EXPECT_NE(off, UINT64_MAX);
    EXPECT_LE(off + g.head_dim * 2, size);
    return reinterpret_cast<uint16_t*>(data + off);
  };
  for (uint32_t l = 0; l < g.num_layers; ++l)
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t r : src_rows)
        for (uint32_t h = 0; h < g.num_kv_heads; ++h)
          for (uint32_t d = 0; d < g.head_dim; ++d)
            head(l, p, r, h)[d] = Bf16(normal(rng) * (h + 1));

  hiq_pool handle = 0;
  hiq_pool_info info;
  ASSERT_EQ(c.hiq_register_host_pool(client_, "c-abi-test", nullptr, kBlockTokens,
                                     HIQ_CODEC_INT8_PER_HEAD, pool, &handle, &info),
            HIQ_OK)
      << c.hiq_last_error();
  EXPECT_NE(handle, 0u);
  EXPECT_EQ(info.encoded_bytes_per_token, 3u * 2 * (2 * 64 + 2 * 2));
  EXPECT_GT(std::strlen(info.namespace_id), 0u);

  std::vector<uint32_t> tokens(kBlocks * kBlockTokens + 2);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i + 100);
  std::vector<uint8_t> keys(16 * kBlocks);
  uint64_t nkeys = 0;
  ASSERT_EQ(c.hiq_compute_block_keys(tokens.data(), tokens.size(), kBlockTokens, nullptr, 0,
                                     keys.data(), kBlocks, &nkeys),
            HIQ_OK);
  ASSERT_EQ(nkeys, kBlocks);

  // Bad rows count: INVALID_ARGUMENT naming rows, nothing stored.
  uint8_t status[kBlocks];
  EXPECT_EQ(c.hiq_backup(client_, handle, keys.data(), kBlocks, src_rows.data(),
                         src_rows.size() - 1, -1, 0, -1, 1, status, nullptr),
            HIQ_INVALID_ARGUMENT);
  EXPECT_NE(std::string(c.hiq_last_error()).find("rows"), std::string::npos);
  EXPECT_EQ(status[0], HIQ_BLOCK_NOT_STORED);

  uint64_t ticket = 0;
  ASSERT_EQ(c.hiq_backup(client_, handle, keys.data(), kBlocks, src_rows.data(), src_rows.size(),
                         -1, 0, -1, 1, status, &ticket),
            HIQ_OK)
      << c.hiq_last_error();
  for (uint8_t s : status) EXPECT_EQ(s, HIQ_BLOCK_STORED);
  EXPECT_GT(ticket, 0u);
  uint32_t prefix = 0;
  ASSERT_EQ(c.hiq_lookup(client_, handle, keys.data(), kBlocks, &prefix), HIQ_OK);
  EXPECT_EQ(prefix, kBlocks);

  // Asynchronous restore with per-layer event slots 2.. and done slot 1.
  uint32_t restored = 0;
  ASSERT_EQ(c.hiq_restore(client_, handle, keys.data(), kBlocks, dst_rows.data(), dst_rows.size(),
                          -1, 0, 2, 1, 0, &restored, &ticket),
            HIQ_OK)
      << c.hiq_last_error();
  EXPECT_EQ(restored, kBlocks);
  ASSERT_EQ(c.hiq_host_pool_wait(pool, 1, ticket, 5000), HIQ_OK) << c.hiq_last_error();
  for (uint32_t l = 0; l < g.num_layers; ++l)
    EXPECT_GE(c.hiq_host_pool_event_read(pool, 2 + l), ticket);

  // Every element within |x^ - x| <= (0.5 + 2^-8) s + 2^-8 |x^|, s = bf16(amax / 127).
  uint64_t checked = 0, bad = 0;
  for (uint32_t l = 0; l < g.num_layers; ++l)
    for (uint32_t p = 0; p < 2; ++p)
      for (size_t i = 0; i < src_rows.size(); ++i)
        for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
          const uint16_t* x = head(l, p, src_rows[i], h);
          const uint16_t* y = head(l, p, dst_rows[i], h);
          float amax = 0;
          for (uint32_t d = 0; d < g.head_dim; ++d)
            amax = std::max(amax, std::fabs(FromBf16(x[d])));
          const double s = FromBf16(Bf16(std::max(amax, 0x1p-112f) / 127.0f));
          for (uint32_t d = 0; d < g.head_dim; ++d) {
            const double xv = FromBf16(x[d]), yv = FromBf16(y[d]);
            bad += !(std::fabs(yv - xv) <= (0.5 + 0x1p-8) * s + 0x1p-8 * std::fabs(yv));
            ++checked;
          }
        }
  EXPECT_EQ(bad, 0u) << "of " << checked;
  EXPECT_EQ(checked, uint64_t{3} * 2 * 12 * 2 * 64);

  hiq_stats stats;
  ASSERT_EQ(c.hiq_get_stats(client_, &stats), HIQ_OK);
  EXPECT_EQ(stats.blocks, kBlocks);
  EXPECT_EQ(stats.num_pools, 1u);
  EXPECT_STREQ(stats.device, "host");
  hiq_l3_stats l3;
  std::memset(&l3, 0xAB, sizeof(l3));
  ASSERT_EQ(c.hiq_get_l3_stats(client_, &l3), HIQ_OK);
  EXPECT_EQ(l3.enabled, 0u);  // this daemon has no L3 store: every figure zeroed
  EXPECT_EQ(l3.writes, 0u);
  EXPECT_EQ(l3.budget_deletes, 0u);
  EXPECT_EQ(c.hiq_get_l3_stats(client_, nullptr), HIQ_INVALID_ARGUMENT);

  uint32_t evicted = 0;
  ASSERT_EQ(c.hiq_evict(client_, handle, keys.data(), 1, &evicted), HIQ_OK);
  EXPECT_EQ(evicted, 1u);
  ASSERT_EQ(c.hiq_lookup(client_, handle, keys.data(), kBlocks, &prefix), HIQ_OK);
  EXPECT_EQ(prefix, 0u);  // the prefix now misses at block 0

  ASSERT_EQ(c.hiq_release_pool(client_, handle), HIQ_OK);
  EXPECT_EQ(c.hiq_lookup(client_, handle, keys.data(), 1, &prefix), HIQ_INVALID_ARGUMENT);
  c.hiq_host_pool_destroy(pool);
}

// A host pool in memfds through the C ABI: huge_pages checked; HIQ_HUGE_PAGES_AUTO gets what the
// machine offers (CI: 4 KiB pages), hiq_host_pool_huge_pages says so, and the pool, registered
// by fd, restores CODEC_RAW rows bit-exact.
TEST_F(HiqcacheCDaemonTest, MemfdHostPoolOnHugePagesRoundTrips) {
  const Api& c = C();
  hiq_geometry g{};
  g.num_layers = 2;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  const uint32_t kRows = 32, kBlockTokens = 4;
  hiq_host_pool* pool = nullptr;
  EXPECT_EQ(c.hiq_host_pool_create_memfd(&g, HIQ_LAYOUT_SGLANG, kRows, 0, 2, 3, &pool),
            HIQ_INVALID_ARGUMENT);
  EXPECT_NE(std::string(c.hiq_last_error()).find("huge_pages"), std::string::npos);
  EXPECT_EQ(pool, nullptr);
  ASSERT_EQ(
      c.hiq_host_pool_create_memfd(&g, HIQ_LAYOUT_SGLANG, kRows, 0, 2, HIQ_HUGE_PAGES_AUTO, &pool),
      HIQ_OK)
      << c.hiq_last_error();
  uint64_t size = 0;
  auto* data = static_cast<uint8_t*>(c.hiq_host_pool_data(pool, &size));
  const uint64_t page = machine::HugePageBytes();
  const uint32_t want =
      page != 0 && machine::HugetlbAvailableBytes() >= page
          ? HIQ_BACKING_HUGETLB
          : (machine::ShmemThpHonoursAdvice() ? HIQ_BACKING_TRANSPARENT : HIQ_BACKING_NONE);
  EXPECT_EQ(c.hiq_host_pool_huge_pages(pool), want);
  if (c.hiq_host_pool_huge_pages(pool) == HIQ_BACKING_HUGETLB) EXPECT_EQ(size % page, 0u);
  EXPECT_EQ(c.hiq_host_pool_huge_pages(nullptr), static_cast<uint32_t>(HIQ_BACKING_NONE));
  for (uint64_t i = 0; i < size; ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  hiq_pool handle = 0;
  ASSERT_EQ(c.hiq_register_host_pool(client_, "c-abi-huge", nullptr, kBlockTokens, HIQ_CODEC_RAW,
                                     pool, &handle, nullptr),
            HIQ_OK)
      << c.hiq_last_error();
  std::vector<uint32_t> tokens = {5, 6, 7, 8};
  uint8_t key[16];
  uint64_t nkeys = 0;
  ASSERT_EQ(c.hiq_compute_block_keys(tokens.data(), tokens.size(), kBlockTokens, nullptr, 0, key, 1,
                                     &nkeys),
            HIQ_OK);
  const std::vector<uint32_t> src = {0, 1, 2, 3}, dst = {20, 21, 22, 23};
  ASSERT_EQ(
      c.hiq_backup(client_, handle, key, 1, src.data(), src.size(), -1, 0, -1, 1, nullptr, nullptr),
      HIQ_OK)
      << c.hiq_last_error();
  uint32_t restored = 0;
  ASSERT_EQ(c.hiq_restore(client_, handle, key, 1, dst.data(), dst.size(), -1, 0, -1, -1, 1,
                          &restored, nullptr),
            HIQ_OK)
      << c.hiq_last_error();
  ASSERT_EQ(restored, 1u);
  for (uint32_t l = 0; l < g.num_layers; ++l)
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t i = 0; i < src.size(); ++i)
        for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
          ASSERT_EQ(std::memcmp(data + c.hiq_host_pool_head_offset(pool, l, p, dst[i], h),
                                data + c.hiq_host_pool_head_offset(pool, l, p, src[i], h),
                                g.head_dim * 2),
                    0)
              << "layer " << l << " plane " << p << " row " << dst[i] << " head " << h;
        }
  EXPECT_EQ(c.hiq_release_pool(client_, handle), HIQ_OK);
  c.hiq_host_pool_destroy(pool);
}

// A dead daemon releases a C engine too: an asynchronous backup that waits for a wait value the
// engine never stores, the daemon killed with SIGKILL, and hiq_host_pool_wait on its done slot
// returns HIQ_ABORTED within 3 s (the slot holds the ticket with the failed bit).
TEST_F(HiqcacheCDaemonTest, KilledDaemonReleasesHostPoolWaiters) {
  const Api& c = C();
  hiq_geometry g{};
  g.num_layers = 2;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  const uint32_t kBlockTokens = 4;
  hiq_host_pool* pool = nullptr;
  ASSERT_EQ(c.hiq_host_pool_create(&g, HIQ_LAYOUT_SGLANG, 32, 0, 4, &pool), HIQ_OK)
      << c.hiq_last_error();
  hiq_pool handle = 0;
  ASSERT_EQ(c.hiq_register_host_pool(client_, "c-abi-death", nullptr, kBlockTokens,
                                     HIQ_CODEC_INT8_PER_HEAD, pool, &handle, nullptr),
            HIQ_OK)
      << c.hiq_last_error();
  const std::vector<uint32_t> rows = {0, 1, 2, 3};
  std::vector<uint32_t> tokens = {1, 2, 3, 4};
  uint8_t key[16];
  uint64_t nkeys = 0;
  ASSERT_EQ(c.hiq_compute_block_keys(tokens.data(), tokens.size(), kBlockTokens, nullptr, 0, key, 1,
                                     &nkeys),
            HIQ_OK);
  uint64_t ticket = 0;
  // Wait slot 0 (never stored), done slot 1, asynchronous.
  ASSERT_EQ(
      c.hiq_backup(client_, handle, key, 1, rows.data(), rows.size(), 0, 1, 1, 0, nullptr, &ticket),
      HIQ_OK)
      << c.hiq_last_error();
  ASSERT_GT(ticket, 0u);
  EXPECT_EQ(c.hiq_host_pool_wait(pool, 1, ticket, 200), HIQ_DEADLINE_EXCEEDED);

  daemon_->Kill();
  const auto killed_at = std::chrono::steady_clock::now();
  // A waiter the daemon's death does not wake waits out its timeout, 3 times the margin.
  const auto margin = test_time::Margin(std::chrono::seconds(3));
  EXPECT_EQ(c.hiq_host_pool_wait(pool, 1, ticket, static_cast<int64_t>(3 * margin.count())),
            HIQ_ABORTED)
      << c.hiq_last_error();
  EXPECT_LT(std::chrono::steady_clock::now() - killed_at, margin);
  EXPECT_EQ(c.hiq_host_pool_event_read(pool, 1), ticket | (uint64_t{1} << 63));
  EXPECT_EQ(c.hiq_host_pool_event_read(pool, 0), 0u) << "the engine's wait slot was written";
  c.hiq_close(client_);
  client_ = nullptr;
  c.hiq_host_pool_destroy(pool);
}

// HIQ_CODEC_INT4_G32_PER_HEAD through the C ABI: its row size (H*D/2 + 2*H*D/32), a head_dim that
// is not a multiple of 32 refused naming geometry.head_dim; HIQ_CODEC_INT4_KIVI's and
// HIQ_CODEC_INT4_HADAMARD's and the allot codecs' bytes per token; codec 9 unknown.
// hiq_get_l3_stats of a daemon with an L3 store (its cluster unreachable: nothing listens on port
// 1): enabled, with the policy and budget it was started with.
TEST_F(HiqcacheCTest, L3StatsOfADaemonWithL3) {
  testing::DaemonProcess d("16MiB",
                           {"--device", "host", "--prefault", "false", "--l3-seeds", "127.0.0.1:1",
                            "--l3-write-policy", "on_evict", "--l3-budget-bytes", "3MiB"});
  if (!d.Start()) GTEST_SKIP() << "this hiqcached has no L3 store (built without hiredis)";
  hiq_client* client = nullptr;
  ASSERT_EQ(C().hiq_connect(d.target().c_str(), 5000, &client), HIQ_OK) << C().hiq_last_error();
  hiq_l3_stats l3;
  std::memset(&l3, 0xAB, sizeof(l3));
  ASSERT_EQ(C().hiq_get_l3_stats(client, &l3), HIQ_OK) << C().hiq_last_error();
  EXPECT_EQ(l3.enabled, 1u);
  EXPECT_EQ(l3.on_evict, 1u);
  EXPECT_EQ(l3.budget_bytes, 3u << 20);
  EXPECT_EQ(l3.budget_used_bytes, 0u);
  EXPECT_EQ(l3.writes + l3.fetches + l3.spilled_blocks + l3.write_queue_blocks, 0u);
  C().hiq_close(client);
  EXPECT_EQ(d.Stop(), 0);
}

TEST_F(HiqcacheCDaemonTest, Int4CodecRegistersWithItsRowSize) {
  const Api& c = C();
  for (uint32_t dim : {64u, 48u}) {
    hiq_geometry g{};
    g.num_layers = 3;
    g.num_kv_heads = 2;
    g.head_dim = dim;
    g.dtype = HIQ_DTYPE_BF16;
    hiq_host_pool* pool = nullptr;
    ASSERT_EQ(c.hiq_host_pool_create(&g, HIQ_LAYOUT_SGLANG, 32, 8, 8, &pool), HIQ_OK)
        << c.hiq_last_error();
    hiq_pool handle = 0;
    hiq_pool_info info;
    const int rc = c.hiq_register_host_pool(client_, "c-abi-int4", nullptr, 4,
                                            HIQ_CODEC_INT4_G32_PER_HEAD, pool, &handle, &info);
    if (dim == 64) {
      ASSERT_EQ(rc, HIQ_OK) << c.hiq_last_error();
      EXPECT_EQ(info.encoded_bytes_per_token, 3u * 2 * (2 * 64 / 2 + 2 * 2 * 64 / 32));
      EXPECT_EQ(c.hiq_release_pool(client_, handle), HIQ_OK);
      // Each codec registered on the same pool: its bytes per token, then released.
      auto expect_bytes = [&](uint32_t codec, uint64_t bytes) {
        SCOPED_TRACE("codec " + std::to_string(codec));
        ASSERT_EQ(c.hiq_register_host_pool(client_, "c-abi-int4", nullptr, 4, codec, pool, &handle,
                                           &info),
                  HIQ_OK)
            << c.hiq_last_error();
        EXPECT_EQ(info.encoded_bytes_per_token, bytes);
        EXPECT_EQ(c.hiq_release_pool(client_, handle), HIQ_OK);
      };
      // HIQ_CODEC_INT4_KIVI: K codes + 4 bytes per channel over the 4-token block, V as INT4.
      expect_bytes(HIQ_CODEC_INT4_KIVI,
                   3u * ((2 * 64 / 2 + 4 * 2 * 64 / 4) + (2 * 64 / 2 + 2 * 2 * 64 / 32)));
      // HIQ_CODEC_INT4_HADAMARD, per layer of a 4-token block: K an INT8 first row (132), 3 rows
      // of codes (64) and 4 bytes per channel (512); V an INT8 first row and 3 rows of codes + 4
      // bytes per group of 32 (64 + 16).
      expect_bytes(HIQ_CODEC_INT4_HADAMARD, 3u * ((132 + 3 * 64 + 512) + (132 + 3 * 80)) / 4);
      // HIQ_CODEC_INT5_ALLOT (no rope through the C ABI), per layer of a 4-token block: K an INT8
      // first row (132), 3 rows of 21*128/32 = 84 bytes and 2H + 2*H*D = 260 of channel
      // parameters; V an INT8 first row and 3 rows of 5*128/8 + 4H = 88.
      expect_bytes(HIQ_CODEC_INT5_ALLOT, 3u * ((132 + 3 * 84 + 260) + (132 + 3 * 88)) / 4);
      // HIQ_CODEC_INT6_ALLOT: INT5 allot's K plane, V rows of 6*128/8 + 4H = 104.
      expect_bytes(HIQ_CODEC_INT6_ALLOT, 3u * ((132 + 3 * 84 + 260) + (132 + 3 * 104)) / 4);
      // HIQ_CODEC_INT4_ALLOT: K rows of 71*128/128 = 71 bytes, V rows of 4*128/8 + 4H = 72;
      // 2,859 bytes per 4 tokens, rounded up.
      expect_bytes(HIQ_CODEC_INT4_ALLOT, (3u * ((132 + 3 * 71 + 260) + (132 + 3 * 72)) + 3) / 4);
      EXPECT_EQ(
          c.hiq_register_host_pool(client_, "c-abi-int4", nullptr, 4, 9, pool, &handle, &info),
          HIQ_INVALID_ARGUMENT);
      EXPECT_NE(std::string(c.hiq_last_error()).find("codec"), std::string::npos);
    } else {
      EXPECT_EQ(rc, HIQ_INVALID_ARGUMENT);
      EXPECT_NE(std::string(c.hiq_last_error()).find("geometry.head_dim"), std::string::npos)
          << c.hiq_last_error();
    }
    c.hiq_host_pool_destroy(pool);
  }
}

// Split views (row_group, dim_run) through hiq_register_pool: a HOST buffer laid out as vLLM's
// CPU attention tiles ([layer][K|V][page][head][tile]: K as [dim][token], runs of one element;
// V as [token / 8][dim / 2][token % 8][dim % 2]), a RAW backup of two pages and a restore into
// two others give back every element at the address the C++ TensorView computes; a dim_run that
// does not divide head_dim and a row_group_stride_bytes that makes elements overlap get
// INVALID_ARGUMENT naming the field.
TEST_F(HiqcacheCDaemonTest, SplitViewsRoundTrip) {
  const Api& c = C();
  constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 64, kBs = 16, kPages = 4;
  constexpr uint64_t kTile = uint64_t{kBs} * kDim * 2, kPage = kHeads * kTile;
  constexpr uint64_t kPlane = kPages * kPage, kBytes = kLayers * 2 * kPlane;
  // Zero-filled; unlinked when `shm` goes, whatever the test's outcome.
  StatusOr<HostShm> shm = HostShm::Create("/hiq-c-split-" + std::to_string(::getpid()), kBytes);
  ASSERT_TRUE(shm.ok()) << shm.status().ToString();
  auto* data = static_cast<uint8_t*>(shm->data());
  const std::string& name = shm->name();

  std::vector<hiq_layer_view> layers(kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t p = 0; p < 2; ++p) {
      hiq_tensor_view& v = p == 0 ? layers[l].k : layers[l].v;
      v.buffer = 0;
      v.num_rows = kPages * kBs;
      v.offset_bytes = (2 * l + p) * kPlane;
      v.head_stride_bytes = kTile;
      v.page_rows = kBs;
      v.page_stride_bytes = kPage;
      if (p == 0) {
        v.row_stride_bytes = 2;
        v.dim_run = 1;
        v.dim_run_stride_bytes = kBs * 2;
      } else {
        v.row_stride_bytes = 4;
        v.row_group = 8;
        v.row_group_stride_bytes = 8 * kDim * 2;
        v.dim_run = 2;
        v.dim_run_stride_bytes = 8 * 2 * 2;
      }
    }
    layers[l].has_v = 1;
  }
  // The C++ client's view of the same layer: where element (row, head, d) lies.
  auto element = [&](uint32_t l, uint32_t p, uint32_t r, uint32_t h, uint32_t d) {
    const hiq_tensor_view& cv = p == 0 ? layers[l].k : layers[l].v;
    TensorView v;
    v.offset_bytes = cv.offset_bytes;
    v.row_stride_bytes = cv.row_stride_bytes;
    v.num_rows = cv.num_rows;
    v.head_stride_bytes = cv.head_stride_bytes;
    v.page_rows = cv.page_rows;
    v.page_stride_bytes = cv.page_stride_bytes;
    v.row_group = cv.row_group;
    v.row_group_stride_bytes = cv.row_group_stride_bytes;
    v.dim_run = cv.dim_run;
    v.dim_run_stride_bytes = cv.dim_run_stride_bytes;
    EXPECT_LE(v.EndOffset(kHeads, kDim * 2), kPlane * (2 * l + p + 1));
    return reinterpret_cast<uint16_t*>(data + v.ElementOffset(r, h, d, kDim * 2));
  };
  std::vector<uint32_t> src_rows, dst_rows;
  for (uint32_t t = 0; t < 2 * kBs; ++t) {
    src_rows.push_back(t);                            // pages 0, 1
    dst_rows.push_back((t < kBs ? 3 : 1) * kBs + t);  // pages 3, 2
  }
  std::mt19937 rng(5);
  for (uint32_t l = 0; l < kLayers; ++l)
    for (uint32_t p = 0; p < 2; ++p)
      for (uint32_t r : src_rows)
        for (uint32_t h = 0; h < kHeads; ++h)
          for (uint32_t d = 0; d < kDim; ++d) *element(l, p, r, h, d) = rng() & 0x7F7F;

  hiq_buffer buffer{};
  buffer.host_shm_name = name.c_str();
  buffer.size_bytes = kBytes;
  hiq_pool_desc desc{};
  desc.model = "c-abi-split";
  desc.geometry = {kLayers, kHeads, kDim, HIQ_DTYPE_BF16, HIQ_ATTENTION_MHA, 0, 1};
  desc.block_tokens = kBs;
  desc.codec = HIQ_CODEC_RAW;
  desc.device_kind = HIQ_DEVICE_HOST;
  desc.num_buffers = 1;
  desc.buffers = &buffer;
  desc.layers = layers.data();

  // Bad split views first: refused, nothing registered.
  hiq_pool handle = 0;
  layers[1].k.dim_run = 3;
  EXPECT_EQ(c.hiq_register_pool(client_, &desc, 0, &handle, nullptr), HIQ_INVALID_ARGUMENT);
  EXPECT_NE(std::string(c.hiq_last_error()).find("layers[1].k.dim_run"), std::string::npos)
      << c.hiq_last_error();
  layers[1].k.dim_run = 1;
  layers[0].v.row_group_stride_bytes = 64;  // inside the 8 slots x 4 bytes x 32 runs of a group
  EXPECT_EQ(c.hiq_register_pool(client_, &desc, 0, &handle, nullptr), HIQ_INVALID_ARGUMENT);
  EXPECT_NE(std::string(c.hiq_last_error()).find("layers[0].v.row_group_stride_bytes"),
            std::string::npos)
      << c.hiq_last_error();
  layers[0].v.row_group_stride_bytes = 8 * kDim * 2;
  EXPECT_EQ(handle, 0u);

  ASSERT_EQ(c.hiq_register_pool(client_, &desc, 0, &handle, nullptr), HIQ_OK) << c.hiq_last_error();
  std::vector<uint32_t> tokens(2 * kBs);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i + 7);
  std::vector<uint8_t> keys(16 * 2);
  uint64_t nkeys = 0;
  ASSERT_EQ(c.hiq_compute_block_keys(tokens.data(), tokens.size(), kBs, nullptr, 0, keys.data(), 2,
                                     &nkeys),
            HIQ_OK);
  uint8_t status[2];
  ASSERT_EQ(c.hiq_backup(client_, handle, keys.data(), 2, src_rows.data(), src_rows.size(), -1, 0,
                         -1, 1, status, nullptr),
            HIQ_OK)
      << c.hiq_last_error();
  EXPECT_EQ(status[0], HIQ_BLOCK_STORED);
  EXPECT_EQ(status[1], HIQ_BLOCK_STORED);
  uint32_t restored = 0;
  ASSERT_EQ(c.hiq_restore(client_, handle, keys.data(), 2, dst_rows.data(), dst_rows.size(), -1, 0,
                          -1, -1, 1, &restored, nullptr),
            HIQ_OK)
      << c.hiq_last_error();
  EXPECT_EQ(restored, 2u);
  uint64_t checked = 0, differ = 0, nonzero = 0;
  for (uint32_t l = 0; l < kLayers; ++l)
    for (uint32_t p = 0; p < 2; ++p)
      for (size_t i = 0; i < src_rows.size(); ++i)
        for (uint32_t h = 0; h < kHeads; ++h)
          for (uint32_t d = 0; d < kDim; ++d) {
            const uint16_t x = *element(l, p, src_rows[i], h, d);
            differ += x != *element(l, p, dst_rows[i], h, d);
            nonzero += x != 0;
            ++checked;
          }
  EXPECT_EQ(differ, 0u) << "of " << checked;
  EXPECT_GT(nonzero, checked / 2);
  EXPECT_EQ(checked, uint64_t{kLayers} * 2 * 2 * kBs * kHeads * kDim);
  EXPECT_EQ(c.hiq_release_pool(client_, handle), HIQ_OK);
}

// The flat description path, for CUDA pools on a daemon without a CUDA backend: the slot fields
// are checked locally, handle sizes by the daemon (INVALID_ARGUMENT naming the buffer), then the
// device kind (FAILED_PRECONDITION).
TEST_F(HiqcacheCDaemonTest, CudaDescriptionsAreValidated) {
  const Api& c = C();
  hiq_geometry g{};
  g.num_layers = 2;
  g.num_kv_heads = 8;
  g.head_dim = 128;
  const uint32_t slots = 32;
  const uint64_t t = uint64_t{slots} * 8 * 128 * 2;
  std::vector<uint8_t> handle(64, 0x42);
  hiq_buffer buffer{};
  buffer.cuda_ipc_handle = handle.data();
  buffer.cuda_ipc_handle_len = 64;
  buffer.size_bytes = 4 * t;
  std::vector<hiq_layer_view> layers(2);
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t p = 0; p < 2; ++p) {
      hiq_tensor_view& v = p == 0 ? layers[l].k : layers[l].v;
      v.buffer = 0;
      v.num_rows = slots;
      v.offset_bytes = (2 * l + p) * t;
      v.row_stride_bytes = 8 * 128 * 2;
    }
    layers[l].has_v = 1;
  }
  hiq_pool_desc desc{};
  desc.model = "c-abi-cuda";
  desc.geometry = g;
  desc.block_tokens = 16;
  desc.device_kind = HIQ_DEVICE_CUDA;
  desc.cuda_device_uuid = "GPU-00000000-0000-0000-0000-000000000001";
  desc.num_buffers = 1;
  desc.buffers = &buffer;
  desc.layers = layers.data();
  hiq_pool out = 7;
  // Slots given twice, or the reserved field set: refused before anything is sent.
  desc.cuda_slots = reinterpret_cast<const hiq_cuda_slots*>(&out);  // never dereferenced
  desc.event_shm_name = "/not-used";
  EXPECT_EQ(c.hiq_register_pool(client_, &desc, 0, &out, nullptr), HIQ_INVALID_ARGUMENT);
  EXPECT_NE(std::string(c.hiq_last_error()).find("cuda_slots"), std::string::npos)
      << c.hiq_last_error();
  desc.cuda_slots = nullptr;
  desc.event_shm_name = nullptr;
  desc.reserved_events = 1;
  EXPECT_EQ(c.hiq_register_pool(client_, &desc, 0, &out, nullptr), HIQ_INVALID_ARGUMENT);
  EXPECT_NE(std::string(c.hiq_last_error()).find("reserved_events"), std::string::npos);
  desc.reserved_events = 0;
  EXPECT_EQ(c.hiq_register_pool(client_, &desc, 0, &out, nullptr), HIQ_FAILED_PRECONDITION);
  EXPECT_EQ(out, 0u);
  EXPECT_NE(std::string(c.hiq_last_error()).find("device.kind"), std::string::npos)
      << c.hiq_last_error();
  buffer.cuda_ipc_handle_len = 63;
  EXPECT_EQ(c.hiq_register_pool(client_, &desc, 0, &out, nullptr), HIQ_INVALID_ARGUMENT);
  EXPECT_NE(std::string(c.hiq_last_error()).find("buffers[0].cuda_ipc_handle"), std::string::npos)
      << c.hiq_last_error();
  desc.device_kind = 7;
  EXPECT_EQ(c.hiq_register_pool(client_, &desc, 0, &out, nullptr), HIQ_INVALID_ARGUMENT);
  hiq_stats stats;
  ASSERT_EQ(c.hiq_get_stats(client_, &stats), HIQ_OK);
  EXPECT_EQ(stats.num_pools, 0u);
}

}  // namespace
}  // namespace hiqcache
