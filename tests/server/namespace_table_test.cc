// NamespaceTable: equal descriptors share a namespace; every field that defines one separates it.
#include "namespace_table.h"

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
  EXPECT_EQ(ids.size(), 12u);
  EXPECT_EQ(t.All().size(), 12u);
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

}  // namespace
}  // namespace hiqcache::server
