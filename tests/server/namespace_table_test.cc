// NamespaceTable: equal descriptors share a namespace; every field that defines one separates it.
#include "core/namespace_table.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <set>
#include <string>

namespace hiqcache::server {
namespace {

NamespaceDesc Desc() {
  NamespaceDesc d;
  d.model = "Qwen/Qwen3-8B";
  d.tenant = "";
  d.layout.row = {8, 128, kernels::DType::kBF16, kernels::CodecKind::kInt8PerHead};
  d.layout.num_layers = 36;
  d.layout.kv_planes = 2;
  d.layout.block_tokens = 64;
  d.tp_rank = 0;
  d.tp_size = 1;
  return d;
}

TEST(NamespaceTableTest, EqualDescriptorsShareOneNamespace) {
  NamespaceTable t;
  const NamespaceInfo& a = t.Intern(Desc());
  const NamespaceInfo& b = t.Intern(Desc());
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(a.id, 0u);
  EXPECT_EQ(t.All().size(), 1u);
  EXPECT_EQ(&t.Get(a.id), &a);
  ASSERT_EQ(a.hex_id.size(), 32u);
  std::string hex;
  for (uint8_t byte : a.hash) {
    char buf[3];
    std::snprintf(buf, sizeof(buf), "%02x", byte);
    hex += buf;
  }
  EXPECT_EQ(a.hex_id, hex);
  // The hash depends only on the descriptor: another table agrees (a restarted daemon too).
  NamespaceTable other;
  NamespaceDesc d2 = Desc();
  d2.model = "x";
  other.Intern(d2);
  EXPECT_EQ(other.Intern(Desc()).hash, a.hash);
}

TEST(NamespaceTableTest, EveryDefiningFieldSeparates) {
  NamespaceTable t;
  std::set<std::string> ids;
  auto add = [&](const NamespaceDesc& d) { ids.insert(t.Intern(d).hex_id); };
  add(Desc());
  {
    auto d = Desc();
    d.model = "Qwen/Qwen3-8B@rev2";
    add(d);
  }
  {
    auto d = Desc();
    d.tenant = "alice";
    add(d);
  }
  {
    auto d = Desc();
    d.layout.num_layers = 35;
    add(d);
  }
  {
    auto d = Desc();
    d.layout.row.num_heads = 4;
    add(d);
  }
  {
    auto d = Desc();
    d.layout.row.head_dim = 64;
    add(d);
  }
  {
    auto d = Desc();
    d.layout.row.dtype = kernels::DType::kFP16;
    add(d);
  }
  {
    auto d = Desc();
    d.layout.row.codec = kernels::CodecKind::kRaw;
    add(d);
  }
  {
    auto d = Desc();
    d.layout.row.codec = kernels::CodecKind::kFp8E4m3PerHead;
    add(d);
  }
  {
    auto d = Desc();
    d.layout.row.codec = kernels::CodecKind::kInt4G32PerHead;
    add(d);
  }
  {
    auto d = Desc();
    d.layout.row.codec = kernels::CodecKind::kInt4Hadamard;
    add(d);
  }
  {
    auto d = Desc();
    d.layout.block_tokens = 16;
    add(d);
  }
  {
    auto d = Desc();
    d.tp_size = 2;
    d.tp_rank = 1;
    add(d);
  }
  {
    auto d = Desc();
    d.tp_size = 2;
    d.tp_rank = 0;
    add(d);
  }
  {
    auto d = Desc();
    d.mla = true;
    d.layout.kv_planes = 1;
    add(d);
  }
  EXPECT_EQ(ids.size(), 15u);
  EXPECT_EQ(t.All().size(), 15u);
}

TEST(NamespaceTableTest, MlaIgnoresTensorParallelRank) {
  NamespaceTable t;
  NamespaceDesc a = Desc();
  a.mla = true;
  a.layout.kv_planes = 1;
  a.layout.row.num_heads = 1;
  a.layout.row.head_dim = 576;
  NamespaceDesc b = a;
  b.tp_rank = 3;
  b.tp_size = 8;
  EXPECT_EQ(t.Intern(a).id, t.Intern(b).id);
}

TEST(NamespaceTableTest, ModelAndTenantCannotBeConfused) {
  // (model "m;tenant=x", tenant "") and (model "m", tenant "x;tenant=") are different namespaces.
  NamespaceTable t;
  NamespaceDesc a = Desc(), b = Desc();
  a.model = "m;tenant=x";
  a.tenant = "";
  b.model = "m";
  b.tenant = "x;tenant=";
  const uint32_t ia = t.Intern(a).id;
  const uint32_t ib = t.Intern(b).id;
  if (ia == ib) {
    FAIL() << "regression: NamespaceDesc::CanonicalText (namespace_table.cc) concatenates model "
              "and tenant unescaped, so different (model, tenant) pairs share a namespace";
  }
  EXPECT_NE(ia, ib);
}

TEST(NamespaceTableTest, NodeScopeKeepsTheTextOfDaemonsBeforeScopes) {
  // The canonical text (so the hash, and the warm pool's extent headers) of an unscoped
  // namespace is exactly what daemons wrote before scopes existed.
  EXPECT_EQ(Desc().CanonicalText(),
            "v1;model=13:Qwen/Qwen3-8B;tenant=0:;layers=36;heads=8;dim=128;dtype=bf16;attn=mha;"
            "tp=0/1;block=64;codec=int8_per_head");
  NamespaceDesc a = Desc(), b = Desc(), anon = Desc();
  a.scope = "uid:1000";
  b.scope = "uid:1001";
  anon.scope = "anonymous";
  NamespaceTable t;
  std::set<std::string> ids;
  for (const NamespaceDesc& d : {Desc(), a, b, anon}) ids.insert(t.Intern(d).hex_id);
  EXPECT_EQ(ids.size(), 4u);
  // Length-prefixed: a scope cannot be spelled by a tenant.
  NamespaceDesc forged = Desc();
  forged.tenant = ";scope=8:uid:1000";
  EXPECT_NE(forged.CanonicalText(), a.CanonicalText());
  EXPECT_EQ(NamespaceTable().Intern(a).hash, t.Intern(a).hash);
}

// CODEC_INT5_ALLOT turns keys by the model's rope: its theta (exactly) and pairing are part of the
// namespace. Every other codec ignores the rope: its text stays that of daemons before the rope.
TEST(NamespaceTableTest, Int5AllotNamesItsRopeAndOtherCodecsIgnoreIt) {
  auto allot = [](double theta, bool interleaved) {
    NamespaceDesc d = Desc();
    d.layout.row.codec = kernels::CodecKind::kInt5Allot;
    d.layout.row.rope_theta = theta;
    d.layout.row.rope_interleaved = interleaved;
    return d;
  };
  const std::string prefix =
      "v1;model=13:Qwen/Qwen3-8B;tenant=0:;layers=36;heads=8;dim=128;dtype=bf16;attn=mha;"
      "tp=0/1;block=64;codec=int5_allot";
  EXPECT_EQ(allot(1e6, false).CanonicalText(), prefix + ";rope=1000000");
  EXPECT_EQ(allot(1e5, false).CanonicalText(), prefix + ";rope=100000");
  EXPECT_EQ(allot(1e6, true).CanonicalText(), prefix + ";rope=1000000,interleaved");
  EXPECT_EQ(allot(0, false).CanonicalText(), prefix + ";rope=none");
  EXPECT_EQ(allot(500000.25, false).CanonicalText(), prefix + ";rope=500000.25");
  NamespaceTable t;
  std::set<std::string> ids;
  for (const NamespaceDesc& d : {allot(1e6, false), allot(1e5, false), allot(1e6, true),
                                 allot(0, false), allot(1e6 + 1e-9, false), Desc()}) {
    ids.insert(t.Intern(d).hex_id);
  }
  EXPECT_EQ(ids.size(), 6u);
  EXPECT_EQ(t.Intern(allot(1e6, false)).id, t.Intern(allot(1e6, false)).id);

  // CODEC_INT6_ALLOT names its rope likewise, in a namespace of its own.
  NamespaceDesc six = allot(1e6, false);
  six.layout.row.codec = kernels::CodecKind::kInt6Allot;
  EXPECT_EQ(six.CanonicalText(),
            "v1;model=13:Qwen/Qwen3-8B;tenant=0:;layers=36;heads=8;dim=128;dtype=bf16;attn=mha;"
            "tp=0/1;block=64;codec=int6_allot;rope=1000000");
  EXPECT_NE(t.Intern(six).id, t.Intern(allot(1e6, false)).id);
  NamespaceDesc four = allot(1e6, false);
  four.layout.row.codec = kernels::CodecKind::kInt4Allot;
  EXPECT_EQ(four.CanonicalText(),
            "v1;model=13:Qwen/Qwen3-8B;tenant=0:;layers=36;heads=8;dim=128;dtype=bf16;attn=mha;"
            "tp=0/1;block=64;codec=int4_allot;rope=1000000");
  EXPECT_NE(t.Intern(four).id, t.Intern(six).id);

  NamespaceDesc scoped = allot(1e6, true);
  scoped.scope = "uid:1000";
  EXPECT_EQ(scoped.CanonicalText(), prefix + ";rope=1000000,interleaved;scope=8:uid:1000");

  for (auto codec : {kernels::CodecKind::kInt8PerHead, kernels::CodecKind::kInt4Hadamard}) {
    NamespaceDesc plain = Desc();
    plain.layout.row.codec = codec;
    NamespaceDesc roped = plain;
    roped.layout.row.rope_theta = 1e6;
    roped.layout.row.rope_interleaved = true;
    EXPECT_EQ(roped.CanonicalText(), plain.CanonicalText());
    EXPECT_EQ(roped.Hash(), plain.Hash());
  }
  EXPECT_EQ(Desc().CanonicalText(),
            "v1;model=13:Qwen/Qwen3-8B;tenant=0:;layers=36;heads=8;dim=128;dtype=bf16;attn=mha;"
            "tp=0/1;block=64;codec=int8_per_head");
}

TEST(NamespaceTableTest, ANamespaceGoesWithItsLastUseOnceTheStoreForgetsIt) {
  NamespaceTable t;
  auto first = t.Acquire(Desc());
  auto second = t.Acquire(Desc());
  EXPECT_EQ(first, second);
  EXPECT_EQ(t.Uses(first->id), 2u);
  int forgets = 0;
  auto forget_ok = [&](uint32_t) {
    ++forgets;
    return true;
  };
  EXPECT_FALSE(t.Release(first->id, forget_ok));  // a use is left: the store is not asked
  EXPECT_EQ(forgets, 0);
  EXPECT_FALSE(t.Release(first->id, [](uint32_t) { return false; }));  // still holds blocks
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.RemoveIfUnused(first->id, forget_ok)->id, first->id);
  EXPECT_EQ(t.size(), 0u);
  EXPECT_EQ(t.Find(Desc()), nullptr);
  EXPECT_EQ(first->desc.model, "Qwen/Qwen3-8B");  // holders keep their copy alive
  // A new namespace never takes a removed one's id.
  const uint32_t old_id = first->id;
  NamespaceDesc d = Desc();
  for (int i = 0; i < 100; ++i) {
    d.model = "m" + std::to_string(i);
    auto n = t.Acquire(d);
    EXPECT_NE(n->id, old_id);
    EXPECT_TRUE(t.Release(n->id, forget_ok));
  }
  EXPECT_EQ(t.size(), 0u);
  // In use: never removed.
  auto used = t.Acquire(Desc());
  EXPECT_EQ(t.RemoveIfUnused(used->id, forget_ok), nullptr);
  EXPECT_EQ(t.size(), 1u);
}

}  // namespace
}  // namespace hiqcache::server
