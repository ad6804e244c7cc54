// The CUDA pieces of a registration that run without a GPU (hiqcache/cuda_ipc.h): the 64-byte
// wire form of IPC handles, GPU UUID strings (and their agreement with the daemon's
// server::NormalizeCudaUuid where the CUDA backend is built), and the allocation bookkeeping
// (base + offset, one buffer per allocation) driven by a fake CUDA runtime. Where the client's
// CUDA library is built (hiq_client_cuda), its entry points must fail cleanly, with a reason,
// on a machine without a usable GPU.
#include "hiqcache/cuda_ipc.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "hiqcache/layouts.h"

#if defined(HIQ_TEST_SERVER_UUID)
#include "backends/cuda_backend.h"
#endif
#if defined(HIQ_CLIENT_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "hiqcache/cuda_export.h"
#endif

namespace hiqcache {
namespace {

// --- IPC handle wire form ----------------------------------------------------------------------

CudaIpcHandle Pattern(uint8_t seed) {
  CudaIpcHandle h;
  for (size_t i = 0; i < h.bytes.size(); ++i) h.bytes[i] = static_cast<uint8_t>(seed + 37 * i);
  return h;
}

TEST(CudaIpcHandleTest, BytesRoundTripUnchanged) {
  const CudaIpcHandle h = Pattern(5);
  const std::string wire = h.ToBytes();
  ASSERT_EQ(wire.size(), kCudaIpcHandleBytes);
  EXPECT_EQ(std::memcmp(wire.data(), h.bytes.data(), kCudaIpcHandleBytes), 0);
  auto back = CudaIpcHandle::FromBytes(wire);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, h);
  // Embedded zero bytes survive (the proto field is `bytes`, not a C string).
  CudaIpcHandle zeros;
  zeros.bytes[63] = 1;
  auto z = CudaIpcHandle::FromBytes(zeros.ToBytes());
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(*z, zeros);
}

TEST(CudaIpcHandleTest, WrongSizesNameTheField) {
  for (size_t n : {0u, 1u, 63u, 65u, 128u}) {
    auto r = CudaIpcHandle::FromBytes(std::string(n, 'x'), "buffers[2].cuda_ipc_handle");
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("buffers[2].cuda_ipc_handle"), std::string::npos);
    EXPECT_NE(r.status().message().find(std::to_string(n)), std::string::npos);
  }
}

TEST(CudaIpcHandleTest, HexRoundTrip) {
  const CudaIpcHandle h = Pattern(200);
  const std::string hex = h.ToHex();
  ASSERT_EQ(hex.size(), 128u);
  auto back = CudaIpcHandle::FromHex(hex);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, h);
  std::string upper = hex;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_TRUE(CudaIpcHandle::FromHex(upper).ok());
  EXPECT_FALSE(CudaIpcHandle::FromHex(hex.substr(1)).ok());
  std::string bad = hex;
  bad[7] = 'g';
  EXPECT_EQ(CudaIpcHandle::FromHex(bad).status().code(), StatusCode::kInvalidArgument);
}

#if defined(HIQ_CLIENT_HAVE_CUDA)
// The wire form is the runtime's struct, byte for byte (no CUDA call is made).
TEST(CudaIpcHandleTest, MatchesTheRuntimeStructs) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);
  static_assert(sizeof(cudaIpcEventHandle_t) == kCudaIpcHandleBytes);
  cudaIpcMemHandle_t mem;
  for (size_t i = 0; i < sizeof(mem.reserved); ++i) mem.reserved[i] = static_cast<char>(i * 3 + 1);
  CudaIpcHandle h;
  std::memcpy(h.bytes.data(), &mem, sizeof(mem));
  const std::string wire = h.ToBytes();
  EXPECT_EQ(std::memcmp(wire.data(), &mem, sizeof(mem)), 0);
  cudaIpcEventHandle_t ev;
  auto parsed = CudaIpcHandle::FromBytes(wire);
  ASSERT_TRUE(parsed.ok());
  std::memcpy(&ev, parsed->bytes.data(), sizeof(ev));
  EXPECT_EQ(std::memcmp(&ev, &mem, sizeof(ev)), 0);
}
#endif

// --- UUIDs -------------------------------------------------------------------------------------

TEST(CudaUuidTest, FormatsLikeNvidiaSmi) {
  const std::array<uint8_t, 16> b = {0x8c, 0x1f, 0x0a, 0x8e, 0x12, 0x34, 0x56, 0x78,
                                     0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67};
  EXPECT_EQ(FormatCudaUuid(b), "GPU-8c1f0a8e-1234-5678-9abc-def001234567");
}

TEST(CudaUuidTest, NormalizesAcceptedSpellings) {
  const std::string want = "GPU-8c1f0a8e-1234-5678-9abc-def001234567";
  for (const char* in :
       {"GPU-8c1f0a8e-1234-5678-9abc-def001234567", "gpu-8C1F0A8E-1234-5678-9ABC-DEF001234567",
        "8c1f0a8e123456789abcdef001234567", "GPU-8c1f0a8e123456789abcdef001234567",
        "8c1f-0a8e-1234-5678-9abc-def0-0123-4567"}) {
    auto r = NormalizeCudaUuid(in);
    ASSERT_TRUE(r.ok()) << in << ": " << r.status().ToString();
    EXPECT_EQ(*r, want) << in;
  }
}

TEST(CudaUuidTest, RejectsMalformed) {
  for (const char* in : {"", "GPU-", "GPU-8c1f0a8e-1234-5678-9abc-def00123456",  // 31 digits
                         "GPU-8c1f0a8e-1234-5678-9abc-def0012345678",            // 33 digits
                         "MIG-8c1f0a8e-1234-5678-9abc-def001234567", "GPU 8c1f0a8e",
                         "GPU-8c1f0a8e-1234-5678-9abc-def00123456z", "0"}) {
    auto r = NormalizeCudaUuid(in);
    EXPECT_FALSE(r.ok()) << in;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(r.status().message().find("cuda_device_uuid"), std::string::npos);
    }
  }
}

#if defined(HIQ_TEST_SERVER_UUID)
// What the client sends is what the daemon's device lookup accepts and compares: for any UUID,
// server::NormalizeCudaUuid(client form) is the 32 lowercase hex digits of the bytes.
TEST(CudaUuidTest, AgreesWithTheDaemon) {
  std::mt19937 rng(11);
  for (int i = 0; i < 200; ++i) {
    std::array<uint8_t, 16> b;
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    std::string hex;
    for (uint8_t x : b) {
      char buf[3];
      std::snprintf(buf, sizeof(buf), "%02x", x);
      hex += buf;
    }
    const std::string formatted = FormatCudaUuid(b);
    std::string server;
    ASSERT_TRUE(server::NormalizeCudaUuid(formatted, &server)) << formatted;
    EXPECT_EQ(server, hex);
    auto client = NormalizeCudaUuid(hex);
    ASSERT_TRUE(client.ok());
    EXPECT_EQ(*client, formatted);
    std::string upper_in = formatted;
    for (char& c : upper_in) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    ASSERT_TRUE(server::NormalizeCudaUuid(upper_in, &server));
    EXPECT_EQ(server, hex);
  }
  std::string out;
  EXPECT_FALSE(server::NormalizeCudaUuid("GPU-1234", &out));
  EXPECT_FALSE(NormalizeCudaUuid("GPU-1234").ok());
}
#endif

// --- allocation bookkeeping with a fake runtime ------------------------------------------------

class FakeMemory : public CudaMemoryInfo {
 public:
  void AddAllocation(uint64_t base, uint64_t size, int device) {
    allocs_[base] = CudaAllocation{base, size, device};
  }
  StatusOr<CudaAllocation> Find(uint64_t ptr) const override {
    ++finds;
    auto it = allocs_.upper_bound(ptr);
    if (it == allocs_.begin()) return FailedPrecondition("fake: not device memory");
    --it;
    if (ptr - it->second.base >= it->second.size)
      return FailedPrecondition("fake: not device memory");
    return it->second;
  }
  StatusOr<CudaIpcHandle> ExportBase(const CudaAllocation& a) const override {
    ++exports;
    CudaIpcHandle h;
    std::memcpy(h.bytes.data(), &a.base, sizeof(a.base));
    h.bytes[8] = static_cast<uint8_t>(a.device);
    return h;
  }
  StatusOr<std::string> DeviceUuid(int device) const override {
    std::array<uint8_t, 16> b{};
    b[15] = static_cast<uint8_t>(device);
    return FormatCudaUuid(b);
  }
  mutable int finds = 0;
  mutable int exports = 0;

 private:
  std::map<uint64_t, CudaAllocation> allocs_;
};

const void* Ptr(uint64_t addr) { return reinterpret_cast<const void*>(addr); }

uint64_t BaseOf(const SharedBuffer& b) {
  uint64_t base;
  std::memcpy(&base, b.cuda_ipc_handle.data(), sizeof(base));
  return base;
}

TEST(CudaBufferSetTest, OneBufferPerAllocationWithOffsets) {
  FakeMemory mem;
  mem.AddAllocation(0x10000000, 1 << 20, 0);
  mem.AddAllocation(0x20000000, 1 << 16, 0);
  CudaBufferSet set(&mem);
  EXPECT_EQ(set.device(), -1);
  auto a = set.Add(Ptr(0x10000000 + 4096), 8192);
  auto b = set.Add(Ptr(0x20000000), 1 << 16);
  auto c = set.Add(Ptr(0x10000000 + 65536), 1000);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->buffer, 0u);
  EXPECT_EQ(a->offset_bytes, 4096u);
  EXPECT_EQ(b->buffer, 1u);
  EXPECT_EQ(b->offset_bytes, 0u);
  EXPECT_EQ(c->buffer, 0u);  // same allocation as a: deduplicated
  EXPECT_EQ(c->offset_bytes, 65536u);
  ASSERT_EQ(set.buffers().size(), 2u);
  EXPECT_EQ(mem.exports, 2);
  EXPECT_EQ(set.buffers()[0].size_bytes, 1u << 20);  // the allocation's size, from its base
  EXPECT_EQ(set.buffers()[0].cuda_ipc_handle.size(), kCudaIpcHandleBytes);
  EXPECT_EQ(BaseOf(set.buffers()[0]), 0x10000000u);
  EXPECT_EQ(BaseOf(set.buffers()[1]), 0x20000000u);
  EXPECT_TRUE(set.buffers()[0].host_shm_name.empty());
  EXPECT_EQ(set.device(), 0);
}

TEST(CudaBufferSetTest, RejectsBadTensors) {
  FakeMemory mem;
  mem.AddAllocation(0x10000000, 4096, 0);
  mem.AddAllocation(0x30000000, 4096, 1);
  CudaBufferSet set(&mem);
  EXPECT_EQ(set.Add(nullptr, 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(set.Add(Ptr(0x10000000), 0).status().code(), StatusCode::kInvalidArgument);
  auto past = set.Add(Ptr(0x10000000 + 4000), 97);
  EXPECT_EQ(past.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past.status().message().find("past the end"), std::string::npos);
  EXPECT_TRUE(set.Add(Ptr(0x10000000 + 4000), 96).ok());
  auto other_device = set.Add(Ptr(0x30000000), 16);
  EXPECT_EQ(other_device.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other_device.status().message().find("one pool is one GPU"), std::string::npos);
  EXPECT_EQ(set.Add(Ptr(0x50000000), 16).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(set.buffers().size(), 1u);
}

Geometry Small() {
  Geometry g;
  g.num_layers = 3;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  return g;
}

// SGLang-style per-layer tensors where the engine carved every K and V out of one slab (as a
// caching allocator does): one buffer, views at the tensors' offsets from the slab base.
TEST(ResolveCudaTensorsTest, RebasesViewsOntoAllocations) {
  const Geometry g = Small();
  const uint32_t slots = 100;
  const uint64_t t_bytes = SlotMajorBytes(g, slots);
  FakeMemory mem;
  const uint64_t slab = 0x7f0000000000;
  mem.AddAllocation(slab, 64 * t_bytes, 0);
  const uint64_t lone = 0x7f8000000000;
  mem.AddAllocation(lone, t_bytes + 512, 0);
  std::vector<CudaTensor> tensors;
  PoolSpec spec;
  spec.geometry = g;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    const uint64_t k = l == 2 ? lone + 512 : slab + (2 * l + 1) * t_bytes;
    const uint64_t v = slab + (2 * l + 7) * t_bytes;
    tensors.push_back({Ptr(k), t_bytes});
    tensors.push_back({Ptr(v), t_bytes});
    spec.layers.push_back(SglangLayerView(g, slots, {2 * l, 0}, {2 * l + 1, 0}));
  }
  std::vector<CudaAllocation> allocs;
  ASSERT_TRUE(ResolveCudaTensors(tensors, mem, &spec, &allocs).ok());
  ASSERT_EQ(spec.buffers.size(), 2u);
  ASSERT_EQ(allocs.size(), 2u);
  EXPECT_EQ(allocs[0].base, slab);
  EXPECT_EQ(allocs[1].base, lone);
  EXPECT_EQ(spec.device, DeviceKind::kCuda);
  EXPECT_EQ(spec.cuda_device_uuid, "GPU-00000000-0000-0000-0000-000000000000");
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    const uint64_t k_base =
        spec.buffers[spec.layers[l].k.buffer].size_bytes == t_bytes + 512 ? lone : slab;
    const uint64_t k_addr = k_base + spec.layers[l].k.offset_bytes;
    EXPECT_EQ(k_addr, reinterpret_cast<uint64_t>(tensors[2 * l].ptr)) << l;
    EXPECT_EQ(spec.layers[l].v->buffer, 0u);
    EXPECT_EQ(slab + spec.layers[l].v->offset_bytes,
              reinterpret_cast<uint64_t>(tensors[2 * l + 1].ptr));
    EXPECT_EQ(spec.layers[l].k.row_stride_bytes, g.RowBytes());  // strides untouched
  }
  EXPECT_EQ(spec.layers[2].k.buffer, 1u);
  EXPECT_EQ(spec.layers[2].k.offset_bytes, 512u);
  // Every view still lies inside its buffer, as the daemon will check.
  for (const LayerView& l : spec.layers) {
    EXPECT_LE(l.k.EndOffset(g.num_kv_heads, g.HeadBytes()), spec.buffers[l.k.buffer].size_bytes);
    EXPECT_LE(l.v->EndOffset(g.num_kv_heads, g.HeadBytes()), spec.buffers[l.v->buffer].size_bytes);
  }
}

// vLLM packed K|V: V's view starts head_dim elements into the same tensor; the tensor offset
// is added on top of the view's own offset.
TEST(ResolveCudaTensorsTest, KeepsViewOffsetsWithinTensors) {
  const Geometry g = Small();
  const uint64_t t_bytes = VllmPackedKvBytes(g, 4, 16);
  FakeMemory mem;
  mem.AddAllocation(0x1000000, 10 * t_bytes, 0);
  std::vector<CudaTensor> tensors;
  PoolSpec spec;
  spec.geometry = g;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    tensors.push_back({Ptr(0x1000000 + (l + 1) * t_bytes), t_bytes});
    spec.layers.push_back(VllmPackedKvLayerView(g, 4, 16, {l, 0}));
  }
  ASSERT_TRUE(ResolveCudaTensors(tensors, mem, &spec).ok());
  ASSERT_EQ(spec.buffers.size(), 1u);
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    EXPECT_EQ(spec.layers[l].k.offset_bytes, (l + 1) * t_bytes);
    EXPECT_EQ(spec.layers[l].v->offset_bytes, (l + 1) * t_bytes + g.HeadBytes());
  }
}

TEST(ResolveCudaTensorsTest, ErrorsNameTheTensorOrViewAndChangeNothing) {
  const Geometry g = Small();
  FakeMemory mem;
  mem.AddAllocation(0x1000000, 1 << 20, 0);
  PoolSpec spec;
  spec.geometry = g;
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    spec.layers.push_back(SglangLayerView(g, 10, {0, 0}, {1, 0}));
  }
  const PoolSpec before = spec;
  // A view larger than its tensor.
  std::vector<CudaTensor> small = {{Ptr(0x1000000), 100}, {Ptr(0x1000000 + 4096), 100}};
  Status s = ResolveCudaTensors(small, mem, &spec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layers[0].k"), std::string::npos) << s.message();
  EXPECT_TRUE(spec.buffers.empty());
  EXPECT_EQ(spec.layers[0].k.buffer, before.layers[0].k.buffer);
  // A tensor index out of range.
  std::vector<CudaTensor> one = {{Ptr(0x1000000), 1 << 16}};
  s = ResolveCudaTensors(one, mem, &spec);
  EXPECT_NE(s.message().find("layers[0].v.buffer"), std::string::npos) << s.message();
  // A pointer that is not device memory names its tensor.
  std::vector<CudaTensor> host = {{Ptr(0x1000000), 1 << 16}, {Ptr(0x9000000), 1 << 16}};
  s = ResolveCudaTensors(host, mem, &spec);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("tensors[1]"), std::string::npos) << s.message();
  EXPECT_EQ(spec.device, DeviceKind::kHost);
  // Split views are HOST-only: a dim_run larger than head_dim is refused by name, not wrapped.
  std::vector<CudaTensor> two = {{Ptr(0x1000000), 1 << 16}, {Ptr(0x1000000 + (1 << 16)), 1 << 16}};
  PoolSpec split = before;
  split.layers[1].v->dim_run = g.head_dim + 1;
  s = ResolveCudaTensors(two, mem, &split);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layers[1].v.dim_run"), std::string::npos) << s.message();
  EXPECT_TRUE(split.buffers.empty());
  split = before;
  split.layers[0].k.row_group = 4;
  s = ResolveCudaTensors(two, mem, &split);
  EXPECT_NE(s.message().find("layers[0].k.row_group"), std::string::npos) << s.message();
  EXPECT_TRUE(ResolveCudaTensors(two, mem, &spec).ok());  // the same views, not split
}

// --- the real CUDA entry points without a usable GPU ------------------------------------------

#if defined(HIQ_CLIENT_HAVE_CUDA)
TEST(CudaExportNoGpuTest, FailsCleanlyWithAReason) {
  std::string why;
  if (CudaClientAvailable(&why)) GTEST_SKIP() << "a CUDA device is usable here: see tests/gpu";
  EXPECT_FALSE(why.empty());
  std::printf("CUDA unavailable here: %s\n", why.c_str());
  Geometry g = Small();
  auto pool = CudaKvPool::Allocate(0, g, KvLayout::kSglang, 16);
  ASSERT_FALSE(pool.ok());
  EXPECT_FALSE(pool.status().message().empty());
  auto slots = CudaTicketSlots::Create(0, 4);
  ASSERT_FALSE(slots.ok());
  EXPECT_FALSE(slots.status().message().empty());
  EXPECT_FALSE(CudaDeviceUuid(0).ok());
  int host_value = 0;
  EXPECT_FALSE(FindCudaAllocation(&host_value).ok());
  // Still usable afterwards (no sticky state, nothing thrown).
  EXPECT_FALSE(CudaClientAvailable(nullptr));
}
#endif

}  // namespace
}  // namespace hiqcache
