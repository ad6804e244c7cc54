#include "hiqcache/layouts.h"

#include <gtest/gtest.h>

namespace hiqcache {
namespace {

Geometry Qwen3() {
  Geometry g;
  g.num_layers = 36;
  g.num_kv_heads = 8;
  g.head_dim = 128;
  return g;
}

TEST(LayoutsTest, GeometryBytes) {
  const Geometry g = Qwen3();
  EXPECT_EQ(g.HeadBytes(), 256u);
  EXPECT_EQ(g.RowBytes(), 2048u);
  EXPECT_EQ(g.BytesPerToken(), 147456u);
  Geometry mla = g;
  mla.attention = Attention::kMLA;
  mla.num_kv_heads = 1;
  mla.head_dim = 576;
  EXPECT_EQ(mla.BytesPerToken(), 36u * 576 * 2);
}

TEST(LayoutsTest, SglangSlotMajor) {
  const Geometry g = Qwen3();
  const LayerView l = SglangLayerView(g, 1000, {2, 4096}, {3, 128});
  EXPECT_EQ(l.k.buffer, 2u);
  ASSERT_TRUE(l.v.has_value());
  EXPECT_EQ(l.v->buffer, 3u);
  EXPECT_EQ(l.k.num_rows, 1000u);
  // [slots, heads, dim] BF16: row r head h at offset + (r*8 + h)*128*2.
  for (uint32_t r : {0u, 1u, 517u, 999u}) {
    for (uint32_t h : {0u, 3u, 7u}) {
      EXPECT_EQ(l.k.HeadOffset(r, h, g.HeadBytes()), 4096u + (r * 8u + h) * 256u);
      EXPECT_EQ(l.v->HeadOffset(r, h, g.HeadBytes()), 128u + (r * 8u + h) * 256u);
    }
  }
  EXPECT_EQ(l.k.EndOffset(8, g.HeadBytes()), 4096u + SlotMajorBytes(g, 1000));
  EXPECT_EQ(SlotMajorBytes(g, 1000), 1000u * 2048u);

  Geometry mla = g;
  mla.attention = Attention::kMLA;
  EXPECT_FALSE(SglangLayerView(mla, 10, {0, 0}, {0, 0}).v.has_value());
}

TEST(LayoutsTest, VllmPaged) {
  const Geometry g = Qwen3();
  const uint32_t blocks = 10, bs = 16;
  const LayerView l = VllmPagedLayerView(g, blocks, bs, {0, 0}, {0, VllmPagedBytes(g, blocks, bs)});
  EXPECT_EQ(l.k.num_rows, blocks * bs);
  EXPECT_EQ(l.k.page_rows, bs);
  // [blocks, block_size, heads, dim]: row = block*bs + t at ((block*bs + t)*8 + h)*256.
  for (uint32_t block : {0u, 3u, 9u}) {
    for (uint32_t t : {0u, 5u, 15u}) {
      for (uint32_t h : {0u, 7u}) {
        const uint32_t r = block * bs + t;
        const uint64_t k = ((uint64_t{block} * bs + t) * 8 + h) * 256;
        EXPECT_EQ(l.k.HeadOffset(r, h, g.HeadBytes()), k);
        EXPECT_EQ(l.v->HeadOffset(r, h, g.HeadBytes()), VllmPagedBytes(g, blocks, bs) + k);
      }
    }
  }
  EXPECT_EQ(l.k.EndOffset(8, g.HeadBytes()), VllmPagedBytes(g, blocks, bs));
  EXPECT_EQ(VllmPagedBytes(g, blocks, bs), uint64_t{blocks} * bs * 2048);

  // FlashInfer [blocks, 2, bs, heads, dim]: K and V pages interleave.
  const uint64_t page = uint64_t{bs} * 2048;
  const LayerView fi = VllmPagedLayerView(g, blocks, bs, {0, 0}, {0, page}, 2 * page);
  EXPECT_EQ(fi.k.HeadOffset(3 * bs + 2, 1, g.HeadBytes()), 3 * 2 * page + 2 * 2048 + 256);
  EXPECT_EQ(fi.v->HeadOffset(3 * bs + 2, 1, g.HeadBytes()), 3 * 2 * page + page + 2 * 2048 + 256);
  EXPECT_EQ(fi.v->EndOffset(8, g.HeadBytes()), 2 * page * blocks);
}

TEST(LayoutsTest, VllmPackedKv) {
  const Geometry g = Qwen3();
  const uint32_t blocks = 6, bs = 16;
  const uint64_t base = 1 << 20;
  const LayerView l = VllmPackedKvLayerView(g, blocks, bs, {1, base});
  ASSERT_TRUE(l.v.has_value());
  EXPECT_EQ(l.k.buffer, 1u);
  EXPECT_EQ(l.v->buffer, 1u);
  EXPECT_EQ(l.k.row_stride_bytes, 2u * 128 * 2);
  EXPECT_EQ(l.k.head_stride_bytes, uint64_t{bs} * 2 * 128 * 2);
  EXPECT_EQ(l.k.page_rows, bs);
  EXPECT_EQ(l.k.page_stride_bytes, 8u * bs * 2 * 128 * 2);
  EXPECT_EQ(l.v->offset_bytes, base + 128u * 2);
  // [blocks, heads, bs, 2*dim] in elements: ((block*8 + h)*bs + t)*256 + (0 for K | 128 for V).
  for (uint32_t block : {0u, 2u, 5u}) {
    for (uint32_t t : {0u, 9u, 15u}) {
      for (uint32_t h : {0u, 4u, 7u}) {
        const uint32_t r = block * bs + t;
        const uint64_t elem = ((uint64_t{block} * 8 + h) * bs + t) * 256;
        EXPECT_EQ(l.k.HeadOffset(r, h, g.HeadBytes()), base + elem * 2);
        EXPECT_EQ(l.v->HeadOffset(r, h, g.HeadBytes()), base + (elem + 128) * 2);
      }
    }
  }
  EXPECT_EQ(l.v->EndOffset(8, g.HeadBytes()), base + VllmPackedKvBytes(g, blocks, bs));
  EXPECT_EQ(VllmPackedKvBytes(g, blocks, bs), uint64_t{blocks} * 8 * bs * 256 * 2);
}

TEST(LayoutsTest, EndOffsetWithPartialLastPage) {
  // Pages that interleave (page_stride < page_rows * row_stride) with a partial last page: the
  // farthest byte is on the previous page.
  TensorView v;
  v.row_stride_bytes = 100;
  v.page_rows = 4;
  v.page_stride_bytes = 50;
  v.num_rows = 5;  // page 1 holds only row 4
  v.head_stride_bytes = 10;
  // Row 3: 3*100 + head 1 at 10 -> 310 + 10 bytes; row 4: 50 + 10 + 10 = 70.
  EXPECT_EQ(v.EndOffset(2, 10), 320u);
  EXPECT_EQ(TensorView{}.EndOffset(8, 256), 0u);
}

}  // namespace
}  // namespace hiqcache
