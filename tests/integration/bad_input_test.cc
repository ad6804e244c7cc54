// Malformed requests against the real daemon, sent as raw gRPC where the client library would not
// let them through: each is answered with the contract's status code and a message naming the
// offending field, and changes nothing (the KV buffer bytes and GetStats are compared before and
// after). The daemon keeps serving afterwards. The raw calls carry a session token as the client
// library's do (it_util.h SessionContext); calls without one, or with a forged one, are refused.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "daemon_process.h"
#include "hiqcache/v1/cache.grpc.pb.h"
#include "it_util.h"

namespace hiqcache::it {
namespace {

using testing::DaemonProcess;
namespace v1 = ::hiqcache::v1;
using grpc::StatusCode;

constexpr uint32_t kBt = 16;
constexpr uint32_t kRows = 128;
constexpr uint32_t kLayers = 4;
constexpr uint32_t kEvents = 8;
constexpr uint32_t kMaxBlocks = 8;  // --max-blocks-per-request

void ToProto(const TensorView& in, v1::TensorView* out) {
  out->set_buffer(in.buffer);
  out->set_offset_bytes(in.offset_bytes);
  out->set_row_stride_bytes(in.row_stride_bytes);
  out->set_num_rows(in.num_rows);
  out->set_head_stride_bytes(in.head_stride_bytes);
  out->set_page_rows(in.page_rows);
  out->set_page_stride_bytes(in.page_stride_bytes);
}

// A RegisterPoolRequest for a HOST PoolSpec, built independently of the client library.
v1::RegisterPoolRequest ToProto(const PoolSpec& spec) {
  v1::RegisterPoolRequest r;
  r.set_model(spec.model);
  r.set_tenant(spec.tenant);
  auto* g = r.mutable_geometry();
  g->set_num_layers(spec.geometry.num_layers);
  g->set_num_kv_heads(spec.geometry.num_kv_heads);
  g->set_head_dim(spec.geometry.head_dim);
  g->set_dtype(v1::DTYPE_BF16);
  g->set_attention(v1::ATTENTION_MHA);
  g->set_tp_rank(0);
  g->set_tp_size(1);
  r.set_block_tokens(spec.block_tokens);
  r.set_codec(v1::CODEC_INT8_PER_HEAD);
  r.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  for (const auto& b : spec.buffers) {
    auto* o = r.add_buffers();
    o->set_host_shm_name(b.host_shm_name);
    o->set_size_bytes(b.size_bytes);
  }
  for (const auto& l : spec.layers) {
    auto* o = r.add_layers();
    ToProto(l.k, o->mutable_k());
    ToProto(*l.v, o->mutable_v());
  }
  r.mutable_events()->set_host_shm_name(spec.events.host_shm_name);
  r.mutable_events()->set_count(spec.events.count);
  return r;
}

std::string Bytes(const BlockKey& k) {
  return std::string(reinterpret_cast<const char*>(k.data()), 16);
}

class BadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new DaemonProcess("64MiB", {"--max-blocks-per-request", std::to_string(kMaxBlocks)});
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
    client_ = Connect(daemon_->target());
    ASSERT_NE(client_, nullptr);
    stub_ = v1::Cache::NewStub(
        grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
    auto session = SessionContext::Open(daemon_->target());
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    session_ = std::move(session).value();
    PoolOptions o;
    o.model = std::string("bad-") + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    o.geometry = Geom(kLayers, 4, 64);
    o.block_tokens = kBt;
    o.num_rows = kRows;
    o.event_slots = kEvents;
    auto p = MakePool(*client_, o);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    pool_ = std::make_unique<TestPool>(std::move(p).value());
    pool_id_ = pool_->info.pool_id;
    // Two stored blocks: a restore that slipped through would change the buffer.
    keys_ = Keys(500, 2, kBt);
    FillRows(pool_->kv, 500, RowRange(0, 2 * kBt), kBt);
    ASSERT_EQ(client_->Backup(pool_->handle, keys_, RowRange(0, 2 * kBt)).held(), 2u);
    FillSentinel(pool_->kv);
    valid_register_ = ToProto(pool_->spec);
  }

  void Snapshot() {
    const auto* p = static_cast<const uint8_t*>(pool_->kv.shm().data());
    kv_before_.assign(p, p + pool_->kv.shm().size());
    auto s = client_->GetStats();
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    stats_before_ = StatsText(*s);
  }
  void ExpectUnchanged(const std::string& what) {
    const auto* p = static_cast<const uint8_t*>(pool_->kv.shm().data());
    EXPECT_TRUE(std::equal(kv_before_.begin(), kv_before_.end(), p))
        << what << ": the KV buffer changed";
    auto s = client_->GetStats();
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(StatsText(*s), stats_before_) << what << ": GetStats changed";
  }
  // Checks code and field, and that nothing changed.
  void Expect(const grpc::Status& st, StatusCode code, const std::string& field,
              const std::string& what) {
    EXPECT_EQ(st.error_code(), code)
        << what << ": got " << st.error_code() << " '" << st.error_message() << "'";
    EXPECT_NE(st.error_message().find(field), std::string::npos)
        << what << ": message '" << st.error_message() << "' does not name " << field;
    ExpectUnchanged(what);
  }

  // A call of this test's session; AnonCtx: one without a session.
  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = AnonCtx();
    session_.Attach(c.get());
    return c;
  }
  static std::unique_ptr<grpc::ClientContext> AnonCtx() {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return c;
  }

  v1::Block* AddBlock(google::protobuf::RepeatedPtrField<v1::Block>* blocks, std::string key,
                      uint32_t first_row, uint32_t rows = kBt) {
    v1::Block* b = blocks->Add();
    b->set_key(std::move(key));
    for (uint32_t i = 0; i < rows; ++i) b->add_rows(first_row + i);
    return b;
  }
  // A valid backup / restore request of two blocks, for mutation.
  v1::BackupRequest GoodBackup() {
    v1::BackupRequest r;
    r.set_pool_id(pool_id_);
    AddBlock(r.mutable_blocks(), Bytes(Keys(501, 1, kBt)[0]), 0);
    AddBlock(r.mutable_blocks(), Bytes(Keys(502, 1, kBt)[0]), kBt);
    r.set_wait_event(-1);
    r.set_done_event(-1);
    r.set_sync(true);
    return r;
  }
  v1::RestoreRequest GoodRestore() {
    v1::RestoreRequest r;
    r.set_pool_id(pool_id_);
    AddBlock(r.mutable_blocks(), Bytes(keys_[0]), 64);
    AddBlock(r.mutable_blocks(), Bytes(keys_[1]), 80);
    r.set_wait_event(-1);
    r.set_layer_event_base(-1);
    r.set_done_event(-1);
    r.set_sync(true);
    return r;
  }
  grpc::Status Call(const v1::BackupRequest& r) {
    v1::BackupResponse resp;
    return stub_->Backup(Ctx().get(), r, &resp);
  }
  grpc::Status Call(const v1::RestoreRequest& r) {
    v1::RestoreResponse resp;
    return stub_->Restore(Ctx().get(), r, &resp);
  }
  grpc::Status Call(const v1::RegisterPoolRequest& r) {
    v1::RegisterPoolResponse resp;
    return stub_->RegisterPool(Ctx().get(), r, &resp);
  }

  void ExpectBackup(std::function<void(v1::BackupRequest&)> mutate, StatusCode code,
                    const std::string& field, const std::string& what) {
    v1::BackupRequest r = GoodBackup();
    mutate(r);
    Expect(Call(r), code, field, "Backup " + what);
  }
  void ExpectRestore(std::function<void(v1::RestoreRequest&)> mutate, StatusCode code,
                     const std::string& field, const std::string& what) {
    v1::RestoreRequest r = GoodRestore();
    mutate(r);
    Expect(Call(r), code, field, "Restore " + what);
  }
  void ExpectRegister(std::function<void(v1::RegisterPoolRequest&)> mutate, StatusCode code,
                      const std::string& field, const std::string& what) {
    v1::RegisterPoolRequest r = valid_register_;
    mutate(r);
    Expect(Call(r), code, field, "RegisterPool " + what);
  }

  // The daemon still answers correctly: restore the stored blocks and check them.
  void ExpectStillServing() {
    RestoreResult r = client_->Restore(pool_->handle, keys_, RowRange(64, 2 * kBt));
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.restored_blocks, 2u);
    CheckResult c = CheckRows(pool_->kv, 500, RowRange(64, 2 * kBt), kBt, false);
    EXPECT_TRUE(c.ok()) << c.first;
    int status = 0;
    EXPECT_EQ(::waitpid(daemon_->pid(), &status, WNOHANG), 0) << "hiqcached exited";
  }

  static DaemonProcess* daemon_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<v1::Cache::Stub> stub_;
  SessionContext session_;
  std::unique_ptr<TestPool> pool_;
  uint64_t pool_id_ = 0;
  std::vector<BlockKey> keys_;
  v1::RegisterPoolRequest valid_register_;
  std::vector<uint8_t> kv_before_;
  std::string stats_before_;
};
DaemonProcess* BadInputTest::daemon_ = nullptr;

TEST_F(BadInputTest, ValidRequestsPassAsControl) {
  // The unmutated requests succeed: the rejections below are about the mutation alone.
  EXPECT_TRUE(Call(GoodRestore()).ok());
  EXPECT_TRUE(Call(GoodBackup()).ok());
  EXPECT_TRUE(Call(valid_register_).ok());
}

// Every pool call names its caller by a session: without one, or with a token that names no
// session of this daemon, it is UNAUTHENTICATED and changes nothing.
TEST_F(BadInputTest, CallsWithoutAValidSessionAreUnauthenticated) {
  Snapshot();
  for (int forged = 0; forged < 2; ++forged) {
    auto ctx = [forged] {
      auto c = AnonCtx();
      if (forged) c->AddMetadata(std::string(kSessionMetadataKey), std::string(32, '0'));
      return c;
    };
    const std::string what = forged ? " with a forged token" : " without a session";
    v1::BackupResponse br;
    Expect(stub_->Backup(ctx().get(), GoodBackup(), &br), StatusCode::UNAUTHENTICATED, "session",
           "Backup" + what);
    v1::RestoreResponse rr;
    Expect(stub_->Restore(ctx().get(), GoodRestore(), &rr), StatusCode::UNAUTHENTICATED, "session",
           "Restore" + what);
    v1::RegisterPoolResponse pr;
    Expect(stub_->RegisterPool(ctx().get(), valid_register_, &pr), StatusCode::UNAUTHENTICATED,
           "session", "RegisterPool" + what);
    v1::EvictRequest e;
    e.set_pool_id(pool_id_);
    e.add_keys(Bytes(keys_[0]));  // present: an evict that slipped through would drop it
    v1::EvictResponse er;
    Expect(stub_->Evict(ctx().get(), e, &er), StatusCode::UNAUTHENTICATED, "session",
           "Evict" + what);
    v1::ReleasePoolRequest rel;
    rel.set_pool_id(pool_id_);
    v1::ReleasePoolResponse relr;
    Expect(stub_->ReleasePool(ctx().get(), rel, &relr), StatusCode::UNAUTHENTICATED, "session",
           "ReleasePool" + what);
    // Drain needs an admin: an anonymous caller is none, a forged token names nobody.
    v1::DrainResponse dr;
    Expect(stub_->Drain(ctx().get(), v1::DrainRequest(), &dr),
           forged ? StatusCode::UNAUTHENTICATED : StatusCode::PERMISSION_DENIED,
           forged ? "session" : "admin", "Drain" + what);
  }
  ExpectStillServing();
}

// host_fd_id must name an fd this caller's session holds: an unknown id, or an fd passed over
// another session, is refused naming the field.
TEST_F(BadInputTest, FdIdsMustNameFdsOfTheCallersSession) {
  using R = v1::RegisterPoolRequest;
  const StatusCode kInvalid = StatusCode::INVALID_ARGUMENT;
  Snapshot();
  ExpectRegister([](R& r) { r.mutable_buffers(0)->set_host_fd_id(999999); }, kInvalid,
                 "buffers[0].host_fd_id", "unknown buffer fd id");
  ExpectRegister([](R& r) { r.mutable_events()->set_host_fd_id(999999); }, kInvalid,
                 "events.host_fd_id", "unknown event fd id");
  auto other = SessionContext::Open(daemon_->target());
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  const int fd = ::shm_open(pool_->kv.shm().name().c_str(), O_RDWR | O_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  const uint64_t foreign = other->PassFd(fd);
  ::close(fd);
  ASSERT_NE(foreign, 0u);
  ExpectRegister([&](R& r) { r.mutable_buffers(0)->set_host_fd_id(foreign); }, kInvalid,
                 "buffers[0].host_fd_id", "fd id of another session");
  ExpectStillServing();
}

TEST_F(BadInputTest, UnknownPoolIsNotFound) {
  Snapshot();
  for (uint64_t id : {pool_id_ ^ uint64_t{0x5A5A}, uint64_t{0}, ~uint64_t{0}}) {
    const std::string what = " pool " + std::to_string(id);
    ExpectBackup([&](auto& r) { r.set_pool_id(id); }, StatusCode::NOT_FOUND, "pool_id", what);
    ExpectRestore([&](auto& r) { r.set_pool_id(id); }, StatusCode::NOT_FOUND, "pool_id", what);
    v1::LookupRequest l;
    l.set_pool_id(id);
    l.add_keys(Bytes(keys_[0]));
    v1::LookupResponse lr;
    // Pool id 0 names no pool: without namespaces the Lookup is malformed, not a miss.
    Expect(stub_->Lookup(Ctx().get(), l, &lr),
           id == 0 ? StatusCode::INVALID_ARGUMENT : StatusCode::NOT_FOUND, "pool_id",
           "Lookup" + what);
    v1::EvictRequest e;
    e.set_pool_id(id);
    e.add_keys(Bytes(keys_[0]));
    v1::EvictResponse er;
    Expect(stub_->Evict(Ctx().get(), e, &er), StatusCode::NOT_FOUND, "pool_id", "Evict" + what);
    v1::ReleasePoolRequest rel;
    rel.set_pool_id(id);
    v1::ReleasePoolResponse relr;
    Expect(stub_->ReleasePool(Ctx().get(), rel, &relr), StatusCode::NOT_FOUND, "pool_id",
           "ReleasePool" + what);
  }
  ExpectStillServing();
}

TEST_F(BadInputTest, KeysMustBe16Bytes) {
  Snapshot();
  const std::string k = Bytes(keys_[0]);
  for (size_t len : {size_t{15}, size_t{17}, size_t{0}}) {
    const std::string bad = len <= 16 ? k.substr(0, len) : k + "x";
    const std::string what = "key of " + std::to_string(len) + " bytes";
    ExpectBackup([&](auto& r) { r.mutable_blocks(1)->set_key(bad); }, StatusCode::INVALID_ARGUMENT,
                 "blocks[1].key", what);
    ExpectBackup([&](auto& r) { r.mutable_blocks(0)->set_key(bad); }, StatusCode::INVALID_ARGUMENT,
                 "blocks[0].key", what);
    // blocks[0] is stored: a non-atomic restore would write its rows.
    ExpectRestore([&](auto& r) { r.mutable_blocks(1)->set_key(bad); }, StatusCode::INVALID_ARGUMENT,
                  "blocks[1].key", what);
    v1::LookupRequest l;
    l.set_pool_id(pool_id_);
    l.add_keys(k);
    l.add_keys(bad);
    v1::LookupResponse lr;
    Expect(stub_->Lookup(Ctx().get(), l, &lr), StatusCode::INVALID_ARGUMENT, "keys[1]",
           "Lookup " + what);
    v1::EvictRequest e;
    e.set_pool_id(pool_id_);
    e.add_keys(k);  // present: a non-atomic evict would drop it
    e.add_keys(bad);
    v1::EvictResponse er;
    Expect(stub_->Evict(Ctx().get(), e, &er), StatusCode::INVALID_ARGUMENT, "keys[1]",
           "Evict " + what);
  }
  ExpectStillServing();
}

TEST_F(BadInputTest, RowsMustMatchBlockTokensAndNumRows) {
  Snapshot();
  ExpectBackup([](auto& r) { r.mutable_blocks(0)->mutable_rows()->RemoveLast(); },
               StatusCode::INVALID_ARGUMENT, "blocks[0].rows", "15 rows");
  ExpectRestore([](auto& r) { r.mutable_blocks(1)->add_rows(3); }, StatusCode::INVALID_ARGUMENT,
                "blocks[1].rows", "17 rows");
  ExpectRestore([](auto& r) { r.mutable_blocks(1)->clear_rows(); }, StatusCode::INVALID_ARGUMENT,
                "blocks[1].rows", "0 rows");
  ExpectRestore([](auto& r) { r.mutable_blocks(1)->set_rows(5, kRows); },
                StatusCode::INVALID_ARGUMENT, "blocks[1].rows[5]", "row = num_rows");
  ExpectBackup([](auto& r) { r.mutable_blocks(0)->set_rows(0, UINT32_MAX); },
               StatusCode::INVALID_ARGUMENT, "blocks[0].rows[0]", "row = 2^32-1");
  ExpectRestore([](auto& r) { r.mutable_blocks(0)->set_rows(15, 1u << 31); },
                StatusCode::INVALID_ARGUMENT, "blocks[0].rows[15]", "row = 2^31");
  ExpectStillServing();
}

TEST_F(BadInputTest, EventsMustBeInRange) {
  Snapshot();
  ExpectBackup([](auto& r) { r.set_wait_event(kEvents); }, StatusCode::INVALID_ARGUMENT,
               "wait_event", "wait_event = count");
  ExpectBackup([](auto& r) { r.set_wait_event(-2); }, StatusCode::INVALID_ARGUMENT, "wait_event",
               "wait_event = -2");
  ExpectBackup([](auto& r) { r.set_done_event(INT32_MAX); }, StatusCode::INVALID_ARGUMENT,
               "done_event", "done_event = INT32_MAX");
  ExpectRestore([](auto& r) { r.set_done_event(kEvents + 3); }, StatusCode::INVALID_ARGUMENT,
                "done_event", "done_event past count");
  ExpectRestore([](auto& r) { r.set_layer_event_base(kEvents - kLayers + 1); },
                StatusCode::INVALID_ARGUMENT, "layer_event_base", "last layer past count");
  ExpectRestore([](auto& r) { r.set_layer_event_base(-5); }, StatusCode::INVALID_ARGUMENT,
                "layer_event_base", "layer_event_base = -5");
  ExpectRestore([](auto& r) { r.set_layer_event_base(INT32_MAX); }, StatusCode::INVALID_ARGUMENT,
                "layer_event_base", "layer_event_base = INT32_MAX");
  ExpectStillServing();
}

TEST_F(BadInputTest, TooManyBlocksIsRefused) {
  Snapshot();
  ExpectRestore(
      [&](auto& r) {
        for (uint32_t i = 0; i < kMaxBlocks - 1; ++i) {
          AddBlock(r.mutable_blocks(), Bytes(Keys(600 + i, 1, kBt)[0]), 0);
        }
      },
      StatusCode::RESOURCE_EXHAUSTED, "blocks", "9 blocks");
  ExpectStillServing();
}

TEST_F(BadInputTest, MalformedNamespaceRefsAreRefused) {
  // A group lookup naming the pool's namespace by its parts (the RegisterPool fields).
  auto good = [&] {
    v1::LookupRequest l;
    v1::NamespaceRef* ref = l.add_namespaces();
    ref->set_model(valid_register_.model());
    ref->set_tenant(valid_register_.tenant());
    *ref->mutable_geometry() = valid_register_.geometry();
    ref->set_block_tokens(valid_register_.block_tokens());
    ref->set_codec(valid_register_.codec());
    *l.add_namespaces() = l.namespaces(0);
    for (const BlockKey& k : keys_) l.add_keys(Bytes(k));
    return l;
  };
  auto expect = [&](std::function<void(v1::LookupRequest&)> mutate, StatusCode code,
                    const std::string& field, const std::string& what) {
    v1::LookupRequest l = good();
    mutate(l);
    v1::LookupResponse lr;
    Expect(stub_->Lookup(Ctx().get(), l, &lr), code, field, "Lookup " + what);
  };
  Snapshot();
  using L = v1::LookupRequest;
  const StatusCode kInvalid = StatusCode::INVALID_ARGUMENT;
  expect([](L& l) { l.clear_namespaces(); }, kInvalid, "pool_id", "no pool, no namespaces");
  expect([](L& l) { l.mutable_namespaces(1)->set_model(""); }, kInvalid, "namespaces[1].model",
         "empty model");
  expect([](L& l) { l.mutable_namespaces(1)->mutable_geometry()->set_num_kv_heads(0); }, kInvalid,
         "namespaces[1].geometry.num_kv_heads", "0 heads");
  expect([](L& l) { l.mutable_namespaces(0)->mutable_geometry()->set_tp_rank(1); }, kInvalid,
         "namespaces[0].geometry.tp_rank", "tp_rank = tp_size");
  expect([](L& l) { l.mutable_namespaces(0)->clear_geometry(); }, kInvalid,
         "namespaces[0].geometry.num_layers", "no geometry");
  expect([](L& l) { l.mutable_namespaces(1)->set_block_tokens(32768); }, kInvalid,
         "namespaces[1].block_tokens", "block larger than half the pool");
  expect([](L& l) { l.mutable_namespaces(1)->set_codec(static_cast<v1::Codec>(9)); }, kInvalid,
         "namespaces[1].codec", "codec 9");
  expect([](L& l) { l.set_keys(1, "short"); }, kInvalid, "keys[1]", "short key");
  expect(
      [](L& l) {
        while (l.namespaces_size() <= 64) *l.add_namespaces() = l.namespaces(0);
      },
      StatusCode::RESOURCE_EXHAUSTED, "namespaces", "65 namespaces");
  expect([&](L& l) { l.set_pool_id(pool_id_ ^ 0x5A5A); }, StatusCode::NOT_FOUND, "pool_id",
         "unknown pool in a group");
  // Control (after the comparisons: it counts hits): the unmutated request answers.
  v1::LookupRequest l = good();
  v1::LookupResponse lr;
  ASSERT_TRUE(stub_->Lookup(Ctx().get(), l, &lr).ok());
  EXPECT_EQ(lr.prefix_blocks(), 2u);
  l.set_pool_id(pool_id_);
  ASSERT_TRUE(stub_->Lookup(Ctx().get(), l, &lr).ok());
  EXPECT_EQ(lr.prefix_blocks(), 2u);
  ExpectStillServing();
}

TEST_F(BadInputTest, BadGeometryAndEnums) {
  Snapshot();
  using R = v1::RegisterPoolRequest;
  const StatusCode kInvalid = StatusCode::INVALID_ARGUMENT;
  ExpectRegister([](R& r) { r.mutable_geometry()->set_num_layers(0); }, kInvalid,
                 "geometry.num_layers", "0 layers");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_num_layers(1u << 20); }, kInvalid,
                 "geometry.num_layers", "2^20 layers");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_num_kv_heads(0); }, kInvalid,
                 "geometry.num_kv_heads", "0 heads");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_num_kv_heads(UINT32_MAX); }, kInvalid,
                 "geometry.num_kv_heads", "2^32-1 heads");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_head_dim(0); }, kInvalid, "geometry.head_dim",
                 "head_dim 0");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_head_dim(1u << 30); }, kInvalid,
                 "geometry.head_dim", "head_dim 2^30");
  ExpectRegister([](R& r) { r.set_block_tokens(0); }, kInvalid, "block_tokens", "0 tokens");
  ExpectRegister([](R& r) { r.set_block_tokens(1u << 30); }, kInvalid, "block_tokens",
                 "2^30 tokens");
  ExpectRegister([](R& r) { r.set_block_tokens(32768); }, kInvalid, "block_tokens",
                 "block larger than half the pool");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_tp_size(0); }, kInvalid, "geometry.tp_size",
                 "tp_size 0");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_tp_rank(1); }, kInvalid, "geometry.tp_rank",
                 "tp_rank = tp_size");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_dtype(static_cast<v1::DType>(9)); }, kInvalid,
                 "geometry.dtype", "dtype 9");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_dtype(v1::DTYPE_UNSPECIFIED); }, kInvalid,
                 "geometry.dtype", "dtype unspecified");
  ExpectRegister([](R& r) { r.mutable_geometry()->set_attention(static_cast<v1::Attention>(5)); },
                 kInvalid, "geometry.attention", "attention 5");
  ExpectRegister([](R& r) { r.set_codec(static_cast<v1::Codec>(9)); }, kInvalid, "codec",
                 "codec 9");
  ExpectRegister([](R& r) { r.mutable_device()->set_kind(static_cast<v1::DeviceKind>(9)); },
                 kInvalid, "device.kind", "device kind 9");
  ExpectRegister([](R& r) { r.mutable_device()->set_kind(v1::DEVICE_KIND_UNSPECIFIED); }, kInvalid,
                 "device.kind", "device kind unspecified");
  ExpectRegister([](R& r) { r.set_model(""); }, kInvalid, "model", "empty model");
  ExpectStillServing();
}

TEST_F(BadInputTest, BadViewsAndBuffers) {
  Snapshot();
  using R = v1::RegisterPoolRequest;
  const StatusCode kInvalid = StatusCode::INVALID_ARGUMENT;
  const uint64_t size = pool_->kv.shm().size();
  ExpectRegister([&](R& r) { r.mutable_layers(1)->mutable_k()->set_offset_bytes(size); }, kInvalid,
                 "layers[1].k", "view past its buffer");
  ExpectRegister(
      [&](R& r) {
        auto* v = r.mutable_layers(3)->mutable_v();
        v->set_num_rows(v->num_rows() + 1);
      },
      kInvalid, "layers[3].v", "one row too many");
  ExpectRegister([](R& r) { r.mutable_layers(0)->mutable_k()->set_num_rows(UINT32_MAX); }, kInvalid,
                 "layers[0].k", "2^32-1 rows");
  ExpectRegister([](R& r) { r.mutable_layers(0)->mutable_k()->set_row_stride_bytes(1ull << 62); },
                 kInvalid, "layers[0].k", "overflowing row stride");
  ExpectRegister([](R& r) { r.mutable_layers(2)->mutable_k()->set_head_stride_bytes(1ull << 63); },
                 kInvalid, "layers[2].k", "overflowing head stride");
  ExpectRegister([](R& r) { r.mutable_layers(0)->mutable_k()->set_row_stride_bytes(0); }, kInvalid,
                 "layers[0].k.row_stride_bytes", "row stride 0");
  ExpectRegister([](R& r) { r.mutable_layers(2)->mutable_v()->set_num_rows(0); }, kInvalid,
                 "layers[2].v.num_rows", "0 rows");
  ExpectRegister([](R& r) { r.mutable_layers(0)->mutable_v()->set_buffer(3); }, kInvalid,
                 "layers[0].v.buffer", "buffer index 3");
  ExpectRegister([](R& r) { r.mutable_layers(0)->mutable_k()->set_offset_bytes(1); }, kInvalid,
                 "layers[0].k", "odd offset");
  ExpectRegister(
      [](R& r) {
        auto* k = r.mutable_layers(1)->mutable_k();
        k->set_page_rows(8);
        k->set_page_stride_bytes(0);
      },
      kInvalid, "layers[1].k.page_stride_bytes", "paged without page stride");
  ExpectRegister([](R& r) { r.mutable_layers(1)->clear_v(); }, kInvalid, "layers[1].v",
                 "MHA without V");
  ExpectRegister([](R& r) { r.mutable_layers()->RemoveLast(); }, kInvalid, "layers",
                 "3 layer views for 4 layers");
  ExpectRegister([](R& r) { r.clear_buffers(); }, kInvalid, "buffers", "no buffers");
  ExpectRegister([](R& r) { r.mutable_buffers(0)->set_size_bytes(0); }, kInvalid,
                 "buffers[0].size_bytes", "size 0");
  ExpectRegister([](R& r) { r.mutable_buffers(0)->set_cuda_ipc_handle(std::string(64, 'x')); },
                 kInvalid, "buffers[0]", "CUDA handle for a HOST pool");
  ExpectRegister([](R& r) { r.mutable_buffers(0)->set_host_shm_name("a/b"); }, kInvalid,
                 "buffers[0].host_shm_name", "shm name with a slash");
  ExpectRegister([](R& r) { r.mutable_buffers(0)->set_host_shm_name(""); }, kInvalid,
                 "buffers[0].host_shm_name", "empty shm name");
  ExpectRegister(
      [](R& r) {
        r.mutable_buffers(0)->set_host_shm_name("/hiq-it-absent-" + std::to_string(::getpid()));
      },
      kInvalid, "buffers[0].host_shm_name", "shm object that does not exist");
  // size_bytes larger than the shm object (the views fit the declared size).
  ExpectRegister([&](R& r) { r.mutable_buffers(0)->set_size_bytes(size + 4096); }, kInvalid,
                 "buffers[0].host_shm_name", "size_bytes larger than the shm object");
  auto small = HostShm::Create(HostShm::UniqueName("small"), 4096);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  ExpectRegister([&](R& r) { r.mutable_buffers(0)->set_host_shm_name(small->name()); }, kInvalid,
                 "buffers[0].host_shm_name", "shm object too small for the views");
  ExpectRegister([](R& r) { r.mutable_events()->set_host_shm_name("/hiq-it-absent-events"); },
                 kInvalid, "events.host_shm_name", "event shm that does not exist");
  ExpectRegister([](R& r) { r.mutable_events()->set_count(kEvents * 64); }, kInvalid,
                 "events.host_shm_name", "more event slots than the event shm holds");
  ExpectRegister([](R& r) { r.mutable_events()->set_host_shm_name(""); }, kInvalid,
                 "events.host_shm_name", "events without a name");
  ExpectRegister([](R& r) { r.mutable_events()->set_count(1u << 30); }, kInvalid, "events.count",
                 "2^30 events");
  ExpectStillServing();
}

TEST_F(BadInputTest, CudaWithoutCudaIsFailedPrecondition) {
  Snapshot();
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  if (stats->device != "host") GTEST_SKIP() << "this hiqcached has a CUDA device";
  v1::RegisterPoolRequest r = valid_register_;
  r.mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
  r.mutable_buffers(0)->set_cuda_ipc_handle(std::string(64, '\x01'));
  r.mutable_events()->Clear();
  Expect(Call(r), StatusCode::FAILED_PRECONDITION, "device", "raw CUDA RegisterPool");

  // Through the client library as an engine would.
  PoolSpec spec = pool_->spec;
  spec.device = DeviceKind::kCuda;
  spec.buffers[0].host_shm_name.clear();
  spec.buffers[0].cuda_ipc_handle = std::string(64, '\x02');
  spec.events = {};
  auto h = client_->RegisterPool(spec);
  EXPECT_EQ(h.status().code(), hiqcache::StatusCode::kFailedPrecondition) << h.status().ToString();
  ExpectUnchanged("client CUDA RegisterPool");
  ExpectStillServing();
}

TEST_F(BadInputTest, ClientLibraryRejectsMismatchedRowsLocally) {
  Snapshot();
  BackupResult b = client_->Backup(pool_->handle, keys_, RowRange(0, kBt));
  EXPECT_EQ(b.status.code(), hiqcache::StatusCode::kInvalidArgument);
  for (BlockStatus s : b.blocks) EXPECT_EQ(s, BlockStatus::kNotStored);
  RestoreResult r = client_->Restore(pool_->handle, keys_, RowRange(0, 3 * kBt));
  EXPECT_EQ(r.status.code(), hiqcache::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.restored_blocks, 0u);
  // A row past num_rows goes to the daemon and comes back INVALID_ARGUMENT.
  std::vector<uint32_t> rows = RowRange(0, 2 * kBt);
  rows[20] = kRows + 7;
  RestoreResult r2 = client_->Restore(pool_->handle, keys_, rows);
  EXPECT_EQ(r2.status.code(), hiqcache::StatusCode::kInvalidArgument) << r2.status.ToString();
  EXPECT_NE(r2.status.message().find("blocks[1].rows[4]"), std::string::npos)
      << r2.status.message();
  EXPECT_EQ(r2.restored_blocks, 0u);
  ExpectUnchanged("client calls with bad rows");
  ExpectStillServing();
}

}  // namespace
}  // namespace hiqcache::it
