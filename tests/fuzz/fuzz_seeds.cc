// hiq_fuzz_seeds DIR: writes the request fuzzer's seed corpus (serialized hiqcache.fuzz.FuzzInput
// messages) into DIR. The committed corpus (tests/fuzz/corpus/) is this program's output; rerun it
// when fuzz_input.proto or the fuzzer's pool geometry changes. Values follow request_fuzzer.cc:
// pool_id 1 = the fuzzer's registered pool, 2 = the last pool an input registered; shm names
// "kv" and "ev" = the fuzzer's KV buffer (2 layers x 2 heads x 32 dims BF16, 64 rows, SGLang
// layout, 32 KiB) and its 8 event slots. The "amx" pools address that buffer as vLLM's AMX tiles
// (split views).
#include <cstdio>
#include <fstream>
#include <string>

#include "fuzz_input.pb.h"

namespace {

namespace v1 = ::hiqcache::v1;
using hiqcache::fuzz::FuzzInput;

constexpr uint32_t kRows = 64, kRowBytes = 128, kBt = 4;

std::string Key(int i) {
  std::string k(16, '\0');
  for (int b = 0; b < 16; ++b) k[b] = static_cast<char>(i * 31 + b * 7);
  return k;
}

void AddBlocks(google::protobuf::RepeatedPtrField<v1::Block>* blocks, int first, int n,
               uint32_t row0) {
  for (int i = 0; i < n; ++i) {
    auto* b = blocks->Add();
    b->set_key(Key(first + i));
    for (uint32_t t = 0; t < kBt; ++t) b->add_rows(row0 + i * kBt + t);
  }
}

v1::RegisterPoolRequest Register(const char* layout, const char* model) {
  v1::RegisterPoolRequest r;
  r.set_model(model);
  auto* g = r.mutable_geometry();
  g->set_num_layers(2);
  g->set_num_kv_heads(2);
  g->set_head_dim(32);
  g->set_dtype(v1::DTYPE_BF16);
  g->set_attention(std::string(layout) == "mla" ? v1::ATTENTION_MLA : v1::ATTENTION_MHA);
  g->set_tp_size(1);
  r.set_block_tokens(kBt);
  r.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  auto* buf = r.add_buffers();
  buf->set_host_shm_name("kv");
  buf->set_size_bytes(2 * 2 * kRows * kRowBytes);
  for (uint32_t l = 0; l < 2; ++l) {
    auto* lv = r.add_layers();
    auto* k = lv->mutable_k();
    k->set_num_rows(kRows);
    k->set_row_stride_bytes(kRowBytes);
    if (std::string(layout) == "paged") {
      // [2, pages, 16 rows, heads, dim] per layer.
      k->set_page_rows(16);
      k->set_page_stride_bytes(16 * kRowBytes);
      k->set_offset_bytes(2ull * l * kRows * kRowBytes);
      auto* v = lv->mutable_v();
      *v = *k;
      v->set_offset_bytes((2ull * l + 1) * kRows * kRowBytes);
    } else if (std::string(layout) == "amx" || std::string(layout) == "amx_overlap") {
      // vLLM's CPU attention with AMX: per layer K's pages then V's, each page a 1 KiB
      // (16 tokens x 32 dims) tile per head. K is [d/2][t][d%2] (dims in pairs), V is
      // [d/16][t/2][d%16][t%2] (token pairs interleaved); "amx_overlap" spaces V's elements 2
      // bytes apart, onto the other token of the pair (refused: elements overlap).
      k->set_page_rows(16);
      k->set_page_stride_bytes(16 * kRowBytes);
      k->set_head_stride_bytes(1024);
      k->set_offset_bytes(2ull * l * kRows * kRowBytes);
      k->set_row_stride_bytes(4);
      k->set_dim_run(2);
      k->set_dim_run_stride_bytes(64);
      auto* v = lv->mutable_v();
      v->set_num_rows(kRows);
      v->set_page_rows(16);
      v->set_page_stride_bytes(16 * kRowBytes);
      v->set_head_stride_bytes(1024);
      v->set_offset_bytes((2ull * l + 1) * kRows * kRowBytes);
      v->set_row_group(2);
      v->set_row_group_stride_bytes(64);
      v->set_row_stride_bytes(2);
      v->set_dim_run(16);
      v->set_dim_run_stride_bytes(512);
      v->set_dim_stride_bytes(std::string(layout) == "amx" ? 4 : 2);
    } else if (std::string(layout) == "mla") {
      k->set_offset_bytes(2ull * l * kRows * kRowBytes);
    } else {
      k->set_offset_bytes(2ull * l * kRows * kRowBytes);
      auto* v = lv->mutable_v();
      *v = *k;
      v->set_offset_bytes((2ull * l + 1) * kRows * kRowBytes);
    }
  }
  r.mutable_events()->set_host_shm_name("ev");
  r.mutable_events()->set_count(8);
  return r;
}

v1::BackupRequest Backup(uint64_t pool, int first, int n, uint32_t row0, bool sync) {
  v1::BackupRequest r;
  r.set_pool_id(pool);
  AddBlocks(r.mutable_blocks(), first, n, row0);
  r.set_wait_event(-1);
  r.set_done_event(-1);
  r.set_sync(sync);
  return r;
}

v1::RestoreRequest Restore(uint64_t pool, int first, int n, uint32_t row0) {
  v1::RestoreRequest r;
  r.set_pool_id(pool);
  AddBlocks(r.mutable_blocks(), first, n, row0);
  r.set_wait_event(-1);
  r.set_done_event(-1);
  r.set_layer_event_base(-1);
  r.set_sync(true);
  return r;
}

void Write(const std::string& dir, const std::string& name, const FuzzInput& in) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out << in.SerializeAsString();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: hiq_fuzz_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  {  // Round trip on the registered pool.
    FuzzInput in;
    *in.add_calls()->mutable_backup() = Backup(1, 0, 3, 0, true);
    auto* l = in.add_calls()->mutable_lookup();
    l->set_pool_id(1);
    for (int i = 0; i < 4; ++i) l->add_keys(Key(i));
    *in.add_calls()->mutable_restore() = Restore(1, 0, 3, 32);
    auto* e = in.add_calls()->mutable_evict();
    e->set_pool_id(1);
    e->add_keys(Key(1));
    in.add_calls()->mutable_get_stats();
    Write(dir, "roundtrip", in);
  }
  {  // Register another pool of each layout, use it, release it.
    for (const char* layout : {"sglang", "paged", "mla", "amx", "amx_overlap"}) {
      FuzzInput in;
      *in.add_calls()->mutable_register_pool() = Register(layout, layout);
      *in.add_calls()->mutable_backup() = Backup(2, 10, 2, 8, true);
      *in.add_calls()->mutable_restore() = Restore(2, 10, 2, 40);
      in.add_calls()->mutable_release_pool()->set_pool_id(2);
      Write(dir, std::string("register_") + layout, in);
    }
  }
  {  // Events: async backup after a satisfied wait, restore signalling per layer.
    FuzzInput in;
    v1::BackupRequest b = Backup(1, 20, 2, 0, false);
    b.set_wait_event(1);  // the fuzzer's odd slots hold 2^40
    b.set_wait_value(5);
    b.set_done_event(2);
    *in.add_calls()->mutable_backup() = b;
    v1::RestoreRequest r = Restore(1, 20, 2, 16);
    r.set_layer_event_base(4);
    r.set_done_event(3);
    *in.add_calls()->mutable_restore() = r;
    Write(dir, "events", in);
  }
  {  // Group lookups: the base pool's namespace by its parts, an unknown one, the pool and a ref.
    FuzzInput in;
    *in.add_calls()->mutable_backup() = Backup(1, 0, 3, 0, true);
    v1::NamespaceRef ref;
    ref.set_model("fuzz-model");
    auto* g = ref.mutable_geometry();
    g->set_num_layers(2);  // the fuzzer's base pool (request_fuzzer.cc BaseRequest)
    g->set_num_kv_heads(2);
    g->set_head_dim(32);
    g->set_dtype(v1::DTYPE_BF16);
    g->set_attention(v1::ATTENTION_MHA);
    g->set_tp_size(1);
    ref.set_block_tokens(kBt);
    v1::NamespaceRef unknown = ref;
    unknown.set_model("fuzz-unknown");
    auto* l = in.add_calls()->mutable_lookup();
    *l->add_namespaces() = ref;
    for (int i = 0; i < 4; ++i) l->add_keys(Key(i));
    l = in.add_calls()->mutable_lookup();
    *l->add_namespaces() = ref;
    *l->add_namespaces() = unknown;
    for (int i = 0; i < 4; ++i) l->add_keys(Key(i));
    l = in.add_calls()->mutable_lookup();
    l->set_pool_id(1);
    *l->add_namespaces() = ref;
    for (int i = 0; i < 4; ++i) l->add_keys(Key(i));
    Write(dir, "group_lookup", in);
  }
  {  // Malformed: short key, rows out of range, unknown pool.
    FuzzInput in;
    auto* l = in.add_calls()->mutable_lookup();
    l->set_pool_id(1);
    l->add_keys("short");
    v1::BackupRequest b = Backup(1, 30, 1, 0, true);
    b.mutable_blocks(0)->set_rows(1, 4096);
    *in.add_calls()->mutable_backup() = b;
    *in.add_calls()->mutable_restore() = Restore(12345, 0, 1, 0);
    Write(dir, "malformed", in);
  }
  return 0;
}
