// CUDA registrations against the real hiqcached where no CUDA backend serves them (started with
// --device host, as on a node without a GPU): well-formed CUDA pools, with or without ticket
// slots, are refused with FAILED_PRECONDITION naming device.kind, malformed IPC handles with
// INVALID_ARGUMENT naming the buffer, CUDA IPC events with FAILED_PRECONDITION naming
// events.cuda_ipc_event_handles, and none disturbs the daemon. Runs on any machine (label unit).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hiqcache/client.h"
#include "hiqcache/cuda_ipc.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/layouts.h"
#include "integration/daemon_process.h"

namespace hiqcache {
namespace {

Geometry Qwen3() {
  Geometry g;
  g.num_layers = 36;
  g.num_kv_heads = 8;
  g.head_dim = 128;
  return g;
}

// A CUDA spec as the client library builds it: one allocation holding every layer's K and V.
PoolSpec CudaSpec(uint32_t slots = 256) {
  const Geometry g = Qwen3();
  PoolSpec spec;
  spec.model = "qwen3-8b@cuda-registration-test";
  spec.geometry = g;
  spec.block_tokens = 16;
  spec.device = DeviceKind::kCuda;
  spec.cuda_device_uuid = "GPU-8c1f0a8e-1234-5678-9abc-def001234567";
  const uint64_t t = SlotMajorBytes(g, slots);
  SharedBuffer b;
  b.cuda_ipc_handle = std::string(kCudaIpcHandleBytes, '\x5a');
  b.size_bytes = t * 2 * g.num_layers;
  spec.buffers.push_back(b);
  for (uint32_t l = 0; l < g.num_layers; ++l) {
    spec.layers.push_back(SglangLayerView(g, slots, {0, 2 * l * t}, {0, (2 * l + 1) * t}));
  }
  return spec;
}

class CudaRegistrationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new testing::DaemonProcess("64MiB", {"--device", "host"});
    ASSERT_TRUE(daemon_->Start()) << "hiqcached did not start";
  }
  static void TearDownTestSuite() {
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(daemon_, nullptr);
    auto c = Client::Connect(daemon_->target());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(c).value();
  }
  void ExpectDaemonHealthy() {
    auto stats = client_->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    EXPECT_EQ(stats->device, "host");
    EXPECT_TRUE(stats->pools.empty()) << "a refused registration left a pool behind";
  }

  static testing::DaemonProcess* daemon_;
  std::unique_ptr<Client> client_;
};

testing::DaemonProcess* CudaRegistrationTest::daemon_ = nullptr;

TEST_F(CudaRegistrationTest, CudaPoolWithoutCudaBackendIsFailedPrecondition) {
  auto r = client_->RegisterPool(CudaSpec());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("device.kind"), std::string::npos) << r.status().ToString();
  // Any UUID: the device kind is refused before the GPU is looked up.
  PoolSpec spec = CudaSpec();
  spec.cuda_device_uuid = "not-a-uuid";
  r = client_->RegisterPool(spec);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  ExpectDaemonHealthy();
}

TEST_F(CudaRegistrationTest, MalformedBufferHandleIsInvalidArgument) {
  for (size_t n : {1u, 63u, 65u, 128u}) {
    PoolSpec spec = CudaSpec();
    SharedBuffer extra = spec.buffers[0];
    extra.cuda_ipc_handle = std::string(n, '\x11');
    spec.buffers.push_back(extra);
    auto r = client_->RegisterPool(spec);
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument)
        << n << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find("buffers[1].cuda_ipc_handle"), std::string::npos)
        << r.status().ToString();
  }
  // No handle at all (a CUDA buffer described like a HOST one).
  PoolSpec spec = CudaSpec();
  spec.buffers[0].cuda_ipc_handle.clear();
  auto r = client_->RegisterPool(spec);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("buffers[0].cuda_ipc_handle"), std::string::npos);
  ExpectDaemonHealthy();
}

// Ticket slots in a sealed memfd (CudaTicketSlots' layout, passed by fd over the session): the
// pool is refused for its device kind, not for its slots.
TEST_F(CudaRegistrationTest, CudaPoolWithTicketSlotsIsRefusedForItsDeviceKind) {
  auto slots = HostEventPool::Create(38, "memfd:cuda-registration-slots");
  ASSERT_TRUE(slots.ok()) << slots.status().ToString();
  PoolSpec spec = CudaSpec();
  spec.events = slots->Spec();
  auto r = client_->RegisterPool(spec);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("device.kind"), std::string::npos) << r.status().ToString();
  ExpectDaemonHealthy();
}

TEST_F(CudaRegistrationTest, IpcEventHandlesAreRefused) {
  for (size_t n : {0u, 63u, 64u}) {
    PoolSpec spec = CudaSpec();
    for (int i = 0; i < 38; ++i) {
      spec.events.cuda_ipc_event_handles.push_back(std::string(n, char(i)));
    }
    auto r = client_->RegisterPool(spec);
    ASSERT_FALSE(r.ok()) << n;
    if (n == kCudaIpcHandleBytes) {
      EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
    }
    EXPECT_NE(r.status().message().find("events.cuda_ipc_event_handles"), std::string::npos)
        << n << ": " << r.status().ToString();
  }
  ExpectDaemonHealthy();
}

// Bounds are checked against the buffer sizes the client reports (the allocation's), before the
// device kind matters.
TEST_F(CudaRegistrationTest, ViewPastTheAllocationIsInvalidArgument) {
  PoolSpec spec = CudaSpec();
  spec.buffers[0].size_bytes -= 1;
  auto r = client_->RegisterPool(spec);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("layers[35].v"), std::string::npos) << r.status().ToString();
  ExpectDaemonHealthy();
}

}  // namespace
}  // namespace hiqcache
