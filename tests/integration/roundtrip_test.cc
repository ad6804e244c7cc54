// Backup then restore through the real daemon: every element within its codec's bound (INT8:
// docs/design.md, FP8 E4M3 and INT4 per group of 32: kernels/README.md; CODEC_RAW bit-exact), for
// each KV layout, across layouts sharing one namespace, writing only the requested rows. Also:
// partial restores, NaN rejection, released pools, TP/MLA namespaces, INT4's head_dim requirement,
// KV in memfds on hugetlb pages and the fallback when the machine has none.
#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <tuple>

#include "daemon_process.h"
#include "huge_pages.h"
#include "it_util.h"

namespace hiqcache::it {
namespace {

using testing::DaemonProcess;

constexpr uint32_t kBlockTokens = 16;
constexpr uint32_t kBlocks = 4;
constexpr uint32_t kRows = 128;

class RoundTripBase : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new DaemonProcess("64MiB");
    ASSERT_TRUE(daemon_->Start()) << "hiqcached did not start";
  }
  static void TearDownTestSuite() {
    if (daemon_ != nullptr) {
      EXPECT_EQ(daemon_->Stop(), 0) << "hiqcached did not exit 0 on SIGTERM";
    }
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(daemon_->running());
    client_ = Connect(daemon_->target());
    ASSERT_NE(client_, nullptr);
  }

  PoolOptions Options(const std::string& model, DType dtype = DType::kBF16,
                      Codec codec = Codec::kInt8PerHead) {
    PoolOptions o;
    o.model = model;
    o.geometry = Geom(4, 4, 64, dtype);
    o.codec = codec;
    o.num_rows = kRows;
    o.page_rows = 8;  // blocks of 16 tokens span two pages
    o.block_tokens = kBlockTokens;
    return o;
  }

  NamespaceStats Ns(const std::string& id) {
    auto s = client_->GetStats();
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return {};
    const NamespaceStats* n = FindNamespace(*s, id);
    EXPECT_NE(n, nullptr) << "namespace " << id << " missing from GetStats";
    return n ? *n : NamespaceStats{};
  }

  static DaemonProcess* daemon_;
  std::unique_ptr<Client> client_;
};
DaemonProcess* RoundTripBase::daemon_ = nullptr;

using Param = std::tuple<KvLayout, Codec, DType>;

class RoundTripTest : public RoundTripBase, public ::testing::WithParamInterface<Param> {};

TEST_P(RoundTripTest, RestoresIntoOtherRowsAndOtherLayouts) {
  const auto [src_layout, codec, dtype] = GetParam();
  const std::string model = std::string("rt-") + KvLayoutName(src_layout) + "-" + CodecName(codec) +
                            "-" + DTypeName(dtype);
  const uint64_t seed = std::hash<std::string>{}(model);

  // One pool per layout, same model/geometry/block_tokens/codec: one namespace.
  std::vector<TestPool> pools;
  for (KvLayout layout : {KvLayout::kSglang, KvLayout::kVllmPaged, KvLayout::kVllmPackedKv}) {
    PoolOptions o = Options(model, dtype, codec);
    o.layout = layout;
    auto p = MakePool(*client_, o);
    ASSERT_TRUE(p.ok()) << KvLayoutName(layout) << ": " << p.status().ToString();
    FillSentinel(p->kv);
    pools.push_back(std::move(p).value());
  }
  for (const auto& p : pools) EXPECT_EQ(p.info.namespace_id, pools[0].info.namespace_id);
  const std::string ns = pools[0].info.namespace_id;
  TestPool& src = pools[static_cast<int>(src_layout)];
  ASSERT_EQ(src.kv.layout(), src_layout);

  const std::vector<uint32_t> rows1 = PickRows(kRows, kBlocks * kBlockTokens, seed);
  FillRows(src.kv, seed, rows1, kBlockTokens);
  const std::vector<BlockKey> keys = Keys(seed, kBlocks, kBlockTokens);

  BackupResult b = client_->Backup(src.handle, keys, rows1);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  ASSERT_EQ(b.blocks.size(), kBlocks);
  for (BlockStatus s : b.blocks) EXPECT_EQ(s, BlockStatus::kStored);
  BackupResult again = client_->Backup(src.handle, keys, rows1);
  ASSERT_TRUE(again.status.ok()) << again.status.ToString();
  for (BlockStatus s : again.blocks) EXPECT_EQ(s, BlockStatus::kAlreadyPresent);
  EXPECT_GT(again.ticket, b.ticket);

  for (int d = 0; d < 3; ++d) {
    TestPool& dst = pools[d];
    SCOPED_TRACE(std::string("restore into ") + KvLayoutName(dst.kv.layout()));
    const bool same = &dst == &src;
    const std::vector<uint32_t> rows2 =
        same ? PickRows(kRows, kBlocks * kBlockTokens, seed + d + 1, rows1)
             : PickRows(kRows, kBlocks * kBlockTokens, seed + d + 1);
    RestoreResult r = client_->Restore(dst.handle, keys, rows2);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.restored_blocks, kBlocks);
    CheckResult c = CheckRowsOf(codec, dst.kv, seed, rows2, kBlockTokens);
    EXPECT_TRUE(c.ok()) << c.bad_heads << " of " << c.heads_checked
                        << " heads wrong; first: " << c.first;
    if (same) {
      // The source rows are untouched (bit-exact originals); nothing else changed.
      CheckResult orig = CheckRows(src.kv, seed, rows1, kBlockTokens, /*exact=*/true);
      EXPECT_TRUE(orig.ok()) << "source rows changed: " << orig.first;
      std::vector<uint32_t> both = rows1;
      both.insert(both.end(), rows2.begin(), rows2.end());
      EXPECT_EQ(ChangedOutside(dst.kv, both), 0u) << "restore wrote outside its rows";
    } else {
      EXPECT_EQ(ChangedOutside(dst.kv, rows2), 0u) << "restore wrote outside its rows";
    }
  }

  NamespaceStats n = Ns(ns);
  EXPECT_EQ(n.blocks, kBlocks);
  EXPECT_EQ(n.backups, kBlocks);
  EXPECT_EQ(n.restores, 3 * kBlocks);
  EXPECT_EQ(n.rejected, 0u);
  EXPECT_EQ(n.evictions, 0u);
  EXPECT_EQ(n.pools, 3u);
  EXPECT_EQ(n.codec, codec);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, RoundTripTest,
    ::testing::Combine(::testing::Values(KvLayout::kSglang, KvLayout::kVllmPaged,
                                         KvLayout::kVllmPackedKv),
                       ::testing::Values(Codec::kInt8PerHead, Codec::kRaw, Codec::kFp8E4m3PerHead,
                                         Codec::kInt4G32PerHead),
                       ::testing::Values(DType::kBF16, DType::kFP16)),
    [](const ::testing::TestParamInfo<Param>& info) {
      return std::string(KvLayoutName(std::get<0>(info.param))) + "_" +
             CodecName(std::get<1>(info.param)) + "_" + DTypeName(std::get<2>(info.param));
    });

// The checkers themselves: a test that cannot fail proves nothing.
TEST(CheckerSelfTest, BoundAndSentinelChecksCatchErrors) {
  uint16_t x[64], y[64];
  uint32_t head = 0;
  do {  // a head with non-zero data
    GenHead(1, 0, 0, 0, 0, head++, 64, DType::kBF16, x);
  } while (std::all_of(x, x + 64, [](uint16_t v) { return (v & 0x7FFF) == 0; }));
  std::copy(x, x + 64, y);
  EXPECT_EQ(CheckHead(DType::kBF16, x, y, 64), "");
  float m = 0;
  for (uint16_t v : x) m = std::max(m, std::fabs(FloatFromBf16(v)));
  const float s = FloatFromBf16(Bf16FromFloat(m / 127.0f));
  y[5] = Bf16FromFloat(FloatFromBf16(x[5]) + 1.5f * s);
  EXPECT_NE(CheckHead(DType::kBF16, x, y, 64), "");
  std::fill(x, x + 64, 0);
  std::fill(y, y + 64, 0);
  EXPECT_EQ(CheckHead(DType::kBF16, x, y, 64), "");
  y[3] = 1;  // the smallest subnormal: an all-zero head must restore exact zeros
  EXPECT_NE(CheckHead(DType::kBF16, x, y, 64), "");

  auto kv = HostKvPool::Create(Geom(2, 2, 64), KvLayout::kVllmPackedKv, 32, 8);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  FillSentinel(*kv);
  const std::vector<uint32_t> rows = {3, 17};
  EXPECT_EQ(ChangedOutside(*kv, rows), 0u);
  EXPECT_EQ(SentinelElements(*kv, rows, 1), 2u * 2 * 2 * 64);
  FillRows(*kv, 9, rows, 1);
  EXPECT_TRUE(CheckRows(*kv, 9, rows, 1, true).ok());
  EXPECT_FALSE(CheckRows(*kv, 10, rows, 1, false).ok());
  EXPECT_EQ(ChangedOutside(*kv, rows), 0u);
  kv->Head(1, 1, 4, 0)[7] ^= 1;  // V of a row that was not written
  EXPECT_EQ(ChangedOutside(*kv, rows), 1u);
  kv->Head(0, 1, 17, 1)[0] ^= 0x40;
  EXPECT_FALSE(CheckRows(*kv, 9, rows, 1, true).ok());
}

TEST_F(RoundTripBase, RestoreStopsAtFirstMissingBlockAndWritesOnlyItsRows) {
  auto p = MakePool(*client_, Options("rt-partial"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const uint64_t seed = 41;
  const std::vector<BlockKey> keys = Keys(seed, kBlocks, kBlockTokens);
  const std::vector<uint32_t> rows1 = RowRange(0, kBlocks * kBlockTokens);
  FillRows(p->kv, seed, rows1, kBlockTokens);
  // Back up blocks 0, 1 and 3: block 2 is a hole.
  for (uint32_t b : {0u, 1u, 3u}) {
    BackupResult r = client_->Backup(p->handle, std::span(&keys[b], 1),
                                     std::span(rows1).subspan(b * kBlockTokens, kBlockTokens));
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_EQ(r.blocks[0], BlockStatus::kStored);
  }
  FillSentinel(p->kv);
  const std::vector<uint32_t> rows2 = PickRows(kRows, kBlocks * kBlockTokens, 7);
  RestoreResult r = client_->Restore(p->handle, keys, rows2);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 2u);
  const std::span<const uint32_t> written(rows2.data(), 2 * kBlockTokens);
  CheckResult c = CheckRows(p->kv, seed, written, kBlockTokens, false);
  EXPECT_TRUE(c.ok()) << c.first;
  EXPECT_EQ(ChangedOutside(p->kv, written), 0u) << "rows of blocks after the hole were written";
}

// Backs up rows [0, 64) of `p` (data set `seed`), fills the KV with sentinels, restores into rows
// [64, 128) and checks them as `codec` restores (bit-exact for CODEC_RAW).
void RoundTripThroughTheDaemon(Client& client, TestPool& p, Codec codec, uint64_t seed) {
  const std::vector<BlockKey> keys = Keys(seed, kBlocks, kBlockTokens);
  const std::vector<uint32_t> rows1 = RowRange(0, kBlocks * kBlockTokens);
  const std::vector<uint32_t> rows2 = RowRange(kBlocks * kBlockTokens, kBlocks * kBlockTokens);
  FillRows(p.kv, seed, rows1, kBlockTokens);
  BackupResult b = client.Backup(p.handle, keys, rows1);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  ASSERT_EQ(b.held(), kBlocks);
  FillSentinel(p.kv);
  RestoreResult r = client.Restore(p.handle, keys, rows2);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.restored_blocks, kBlocks);
  CheckResult c = CheckRowsOf(codec, p.kv, seed, rows2, kBlockTokens);
  EXPECT_TRUE(c.ok()) << c.first;
  EXPECT_EQ(ChangedOutside(p.kv, rows2), 0u);
}

// The engine's KV in a memfd on hugetlb pages (needs free ones; skipped on CI): the daemon maps
// the hugetlbfs fd (its registered size, the pool's, is no whole number of huge pages) and
// CODEC_RAW restores every row bit-exact, INT8 within its bound.
TEST_F(RoundTripBase, HugetlbMemfdRoundTrips) {
  if (machine::HugetlbAvailableBytes() < 2 * machine::HugePageBytes()) {
    GTEST_SKIP() << "no free hugetlb pages (vm.nr_hugepages is "
                 << machine::MeminfoField("HugePages_Total") << "): reserve some to run this";
  }
  for (Codec codec : {Codec::kRaw, Codec::kInt8PerHead}) {
    PoolOptions o = Options(std::string("rt-hugetlb-") + CodecName(codec), DType::kBF16, codec);
    o.kv_name = "memfd:rt-hugetlb";
    o.huge_pages = HugePages::kRequire;
    auto p = MakePool(*client_, o);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ASSERT_EQ(p->kv.shm().huge_page_backing(), HugePageBacking::kHugetlb);
    EXPECT_EQ(p->kv.shm().size() % machine::HugePageBytes(), 0u);
    RoundTripThroughTheDaemon(*client_, *p, codec, 77 + static_cast<uint64_t>(codec));
  }
}

// With no hugetlb pages to be had (CI has none; elsewhere this test holds every free one in a
// memfd of its own), huge_pages=auto falls back to a plain memfd (advised for THP, which
// shmem_enabled may honour), says so, and round-trips bit-exact through the daemon.
TEST_F(RoundTripBase, HugePagesFallBackWhenTheHugetlbPoolIsEmpty) {
  HostShm hold;
  if (const uint64_t free = machine::HugetlbAvailableBytes(); free > 0) {
    auto held = HostShm::CreateMemfd("rt-hold", free, false, HugePages::kRequire);
    ASSERT_TRUE(held.ok()) << held.status().ToString();
    ASSERT_EQ(held->huge_page_backing(), HugePageBacking::kHugetlb);
    hold = std::move(held).value();
  }
  PoolOptions o = Options("rt-huge-fallback", DType::kBF16, Codec::kRaw);
  o.kv_name = "memfd:rt-huge-fallback";
  o.huge_pages = HugePages::kAuto;
  auto p = MakePool(*client_, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->kv.shm().huge_page_backing(), machine::ShmemThpHonoursAdvice()
                                                 ? HugePageBacking::kTransparent
                                                 : HugePageBacking::kNone);
  RoundTripThroughTheDaemon(*client_, *p, Codec::kRaw, 78);
}

TEST_F(RoundTripBase, BlockWithNaNIsRejectedAndCounted) {
  auto p = MakePool(*client_, Options("rt-nan"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const std::vector<BlockKey> keys = Keys(43, 2, kBlockTokens);
  const std::vector<uint32_t> rows = RowRange(0, 2 * kBlockTokens);
  FillRows(p->kv, 43, rows, kBlockTokens);
  PoisonRow(p->kv, rows[kBlockTokens + 5]);  // block 1
  BackupResult b = client_->Backup(p->handle, keys, rows);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_EQ(b.blocks[0], BlockStatus::kStored);
  EXPECT_EQ(b.blocks[1], BlockStatus::kRejected);
  LookupResult l = client_->Lookup(p->handle, keys);
  ASSERT_TRUE(l.status.ok());
  EXPECT_EQ(l.prefix_blocks, 1u);
  LookupResult l1 = client_->Lookup(p->handle, std::span(&keys[1], 1));
  EXPECT_EQ(l1.prefix_blocks, 0u);
  NamespaceStats n = Ns(p->info.namespace_id);
  EXPECT_EQ(n.rejected, 1u);
  EXPECT_EQ(n.backups, 1u);
  EXPECT_EQ(n.blocks, 1u);
  // The rejected key can be backed up again once its data is finite.
  FillRows(p->kv, 43, rows, kBlockTokens);
  BackupResult again = client_->Backup(p->handle, keys, rows);
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(again.blocks[0], BlockStatus::kAlreadyPresent);
  EXPECT_EQ(again.blocks[1], BlockStatus::kStored);
}

// INT4 rejects a block holding Inf like INT8 (in any group), and takes only head_dims that are
// multiples of 32: the registration answer names the field.
TEST_F(RoundTripBase, Int4RejectsInfBlocksAndHeadDimsNotMultipleOf32) {
  PoolOptions o = Options("rt-int4-inf", DType::kBF16, Codec::kInt4G32PerHead);
  auto p = MakePool(*client_, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->info.encoded_bytes_per_token, 4u * 2 * (4 * 64 / 2 + 2 * 4 * 64 / 32));
  const std::vector<BlockKey> keys = Keys(47, 2, kBlockTokens);
  const std::vector<uint32_t> rows = RowRange(0, 2 * kBlockTokens);
  FillRows(p->kv, 47, rows, kBlockTokens);
  p->kv.Head(3, 1, rows[3], 2)[63] = 0x7F80;  // +Inf in the last group of block 0
  BackupResult b = client_->Backup(p->handle, keys, rows);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_EQ(b.blocks[0], BlockStatus::kRejected);
  EXPECT_EQ(b.blocks[1], BlockStatus::kStored);
  EXPECT_EQ(Ns(p->info.namespace_id).rejected, 1u);

  PoolOptions bad = Options("rt-int4-dim", DType::kBF16, Codec::kInt4G32PerHead);
  bad.geometry = Geom(2, 2, 48);
  auto r = MakePool(*client_, bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("geometry.head_dim"), std::string::npos)
      << r.status().ToString();
  bad.codec = Codec::kInt8PerHead;  // the same geometry is fine for INT8
  EXPECT_TRUE(MakePool(*client_, bad).ok());
}

TEST_F(RoundTripBase, ReleasedPoolLeavesBlocksInNamespace) {
  auto a = MakePool(*client_, Options("rt-release"));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  const std::vector<BlockKey> keys = Keys(44, kBlocks, kBlockTokens);
  const std::vector<uint32_t> rows = RowRange(0, kBlocks * kBlockTokens);
  FillRows(a->kv, 44, rows, kBlockTokens);
  ASSERT_EQ(client_->Backup(a->handle, keys, rows).held(), kBlocks);
  EXPECT_TRUE(client_->ReleasePool(a->handle).ok());
  EXPECT_EQ(Ns(a->info.namespace_id).pools, 0u);

  PoolOptions o = Options("rt-release");
  o.layout = KvLayout::kVllmPackedKv;
  auto b = MakePool(*client_, o);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->info.namespace_id, a->info.namespace_id);
  EXPECT_NE(b->info.pool_id, a->info.pool_id);
  FillSentinel(b->kv);
  RestoreResult r = client_->Restore(b->handle, keys, rows);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, kBlocks);
  CheckResult c = CheckRows(b->kv, 44, rows, kBlockTokens, false);
  EXPECT_TRUE(c.ok()) << c.first;
}

TEST_F(RoundTripBase, TpRanksSeparateMhaButShareMla) {
  // MHA: rank 0 and rank 1 of TP=2 hold different heads: different namespaces.
  PoolOptions o = Options("rt-tp");
  o.geometry.tp_size = 2;
  auto r0 = MakePool(*client_, o);
  o.geometry.tp_rank = 1;
  auto r1 = MakePool(*client_, o);
  ASSERT_TRUE(r0.ok() && r1.ok());
  EXPECT_NE(r0->info.namespace_id, r1->info.namespace_id);
  const std::vector<BlockKey> keys = Keys(45, 2, kBlockTokens);
  const std::vector<uint32_t> rows = RowRange(0, 2 * kBlockTokens);
  FillRows(r0->kv, 45, rows, kBlockTokens);
  ASSERT_EQ(client_->Backup(r0->handle, keys, rows).held(), 2u);
  EXPECT_EQ(client_->Lookup(r1->handle, keys).prefix_blocks, 0u);
  EXPECT_EQ(client_->Restore(r1->handle, keys, rows).restored_blocks, 0u);

  // MLA: one latent row per token, identical on every rank: one copy per node.
  PoolOptions m = Options("rt-mla");
  m.geometry = Geom(4, 1, 576);
  m.geometry.attention = Attention::kMLA;
  m.geometry.tp_size = 2;
  auto m0 = MakePool(*client_, m);
  m.geometry.tp_rank = 1;
  auto m1 = MakePool(*client_, m);
  ASSERT_TRUE(m0.ok()) << m0.status().ToString();
  ASSERT_TRUE(m1.ok()) << m1.status().ToString();
  EXPECT_EQ(m0->info.namespace_id, m1->info.namespace_id);
  FillRows(m0->kv, 46, rows, kBlockTokens);
  ASSERT_EQ(client_->Backup(m0->handle, keys, rows).held(), 2u);
  FillSentinel(m1->kv);
  const std::vector<uint32_t> rows2 = PickRows(kRows, 2 * kBlockTokens, 46);
  RestoreResult r = client_->Restore(m1->handle, keys, rows2);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 2u);
  CheckResult c = CheckRows(m1->kv, 46, rows2, kBlockTokens, false);
  EXPECT_TRUE(c.ok()) << c.first;
  EXPECT_EQ(ChangedOutside(m1->kv, rows2), 0u);
  // MLA stores one plane: half the bytes per token of the same heads x dim in MHA.
  EXPECT_EQ(m0->info.encoded_bytes_per_token, uint64_t{4} * (576 + 2));
}

}  // namespace
}  // namespace hiqcache::it
