// Security properties of the daemon's surface:
//  - the unix socket gets the configured mode (0660 by default, --socket-mode otherwise) and
//    group (--socket-group), owned by the daemon's user;
//  - tenants are isolated: two registrations differing only in tenant see none of each other's
//    blocks (Lookup, Restore and Evict all miss);
//  - requests above the configured limits (--max-blocks-per-request, --max-message-bytes) are
//    answered RESOURCE_EXHAUSTED and change nothing;
//  - error messages never carry key bytes, raw or as hex.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <thread>

#include "daemon_process.h"
#include "hiqcache/v1/cache.grpc.pb.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using testing::DaemonProcess;
namespace v1 = ::hiqcache::v1;
using namespace std::chrono_literals;

constexpr uint32_t kBt = 16;

struct SocketInfo {
  mode_t mode = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  bool is_socket = false;
};
SocketInfo StatSocket(const std::string& path) {
  struct stat st;
  SocketInfo s;
  if (::stat(path.c_str(), &st) != 0) return s;
  s.mode = st.st_mode & 07777;
  s.uid = st.st_uid;
  s.gid = st.st_gid;
  s.is_socket = S_ISSOCK(st.st_mode);
  return s;
}

// Starts `d` with umask 0 (the most open a socket could be created with) while a thread watches
// the socket file from its creation: it must never be more open than `mode`, and reach `mode`.
// Returns the final stat.
SocketInfo StartAndWatchSocket(DaemonProcess& d, mode_t mode, mode_t* extra_bits) {
  std::atomic<bool> stop{false};
  std::atomic<mode_t> extra{0};
  std::thread watcher([&] {
    while (!stop.load()) {
      SocketInfo s = StatSocket(d.socket_path());
      if (s.is_socket) extra.fetch_or(s.mode & ~mode);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  const mode_t saved = ::umask(0);
  const bool started = d.Start();
  ::umask(saved);
  EXPECT_TRUE(started);
  it::Eventually([&] { return StatSocket(d.socket_path()).mode == mode; }, 5s);
  stop.store(true);
  watcher.join();
  *extra_bits = extra.load();
  return StatSocket(d.socket_path());
}

TEST(SecurityTest, SocketModeAndOwnership) {
  mode_t extra = 0;
  {
    DaemonProcess d("16MiB");
    SocketInfo s = StartAndWatchSocket(d, 0660, &extra);
    EXPECT_TRUE(s.is_socket);
    EXPECT_EQ(s.mode, 0660u) << std::oct << s.mode;
    EXPECT_EQ(extra, 0u) << "the socket was briefly more open than 0660: extra bits " << std::oct
                         << extra;
    EXPECT_EQ(s.uid, ::geteuid());
    // The session socket beside it (session_protocol.h) is no more open.
    SocketInfo session = StatSocket(d.socket_path() + ".session");
    EXPECT_TRUE(session.is_socket);
    EXPECT_EQ(session.mode, 0660u) << std::oct << session.mode;
    EXPECT_EQ(d.Stop(), 0);
  }
  {
    DaemonProcess d("16MiB",
                    {"--socket-mode", "0600", "--socket-group", std::to_string(::getegid())});
    SocketInfo s = StartAndWatchSocket(d, 0600, &extra);
    EXPECT_EQ(s.mode, 0600u) << std::oct << s.mode;
    EXPECT_EQ(extra, 0u) << "the socket was briefly more open than 0600: extra bits " << std::oct
                         << extra;
    EXPECT_EQ(s.gid, ::getegid());
    SocketInfo session = StatSocket(d.socket_path() + ".session");
    EXPECT_TRUE(session.is_socket);
    EXPECT_EQ(session.mode, 0600u) << std::oct << session.mode;
    EXPECT_EQ(session.gid, ::getegid());
    EXPECT_EQ(d.Stop(), 0);
  }
  {
    // A bad mode is a configuration error: the daemon refuses to start.
    DaemonProcess d("16MiB", {"--socket-mode", "rw-rw----"});
    EXPECT_FALSE(d.Start(5s));
  }
}

class TenantTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Three namespaces, each its own 64 MiB extent (a smaller pool would make them take turns
    // at the whole pool); not pre-faulted, so only the touched pages cost memory.
    daemon_ = new DaemonProcess("256MiB", {"--max-blocks-per-request", "8", "--max-message-bytes",
                                           "1MiB", "--prefault", "false"});
    ASSERT_TRUE(daemon_->Start());
  }
  static void TearDownTestSuite() {
    if (daemon_ != nullptr) EXPECT_EQ(daemon_->Stop(), 0);
    delete daemon_;
    daemon_ = nullptr;
  }
  void SetUp() override {
    client_ = it::Connect(daemon_->target());
    ASSERT_NE(client_, nullptr);
    auto session = it::SessionContext::Open(daemon_->target());
    ASSERT_TRUE(session.ok()) << session.status().ToString();
    session_ = std::move(session).value();
  }
  it::TestPool Pool(const std::string& tenant) {
    it::PoolOptions o;
    o.model = "rob-sec";
    o.tenant = tenant;
    o.geometry = it::Geom(2, 2, 64);
    o.block_tokens = kBt;
    o.num_rows = 16 * kBt;
    auto p = it::MakePool(*client_, o);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return std::move(p).value();
  }
  std::unique_ptr<v1::Cache::Stub> Stub() {
    return v1::Cache::NewStub(
        grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
  }
  // A raw call named by this test's session (the pools belong to this process).
  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    session_.Attach(c.get());
    return c;
  }

  static DaemonProcess* daemon_;
  std::unique_ptr<Client> client_;
  it::SessionContext session_;
};
DaemonProcess* TenantTest::daemon_ = nullptr;

std::string Raw(const BlockKey& k) {
  return std::string(reinterpret_cast<const char*>(k.data()), 16);
}

// True when `text` contains any of `keys` as raw bytes, or as hex of 8 or more of its bytes
// (either case): the daemon must never echo key material.
bool LeaksKey(const std::string& text, const std::vector<BlockKey>& keys) {
  std::string lower;
  for (char c : text) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const BlockKey& k : keys) {
    if (text.find(Raw(k)) != std::string::npos) return true;
    const std::string hex = BlockKeyToHex(k);
    for (size_t i = 0; i + 16 <= hex.size(); i += 2) {
      if (lower.find(hex.substr(i, 16)) != std::string::npos) return true;
    }
  }
  return false;
}

TEST_F(TenantTest, TenantsDoNotSeeEachOthersBlocks) {
  it::TestPool a = Pool("tenant-a");
  it::TestPool b = Pool("tenant-b");
  it::TestPool none = Pool("");
  EXPECT_NE(a.info.namespace_id, b.info.namespace_id);
  EXPECT_NE(a.info.namespace_id, none.info.namespace_id);
  const auto keys = IndependentKeys(31, 0, 4);
  const auto rows = it::RowRange(0, 4 * kBt), dst = it::RowRange(4 * kBt, 4 * kBt);
  it::FillRows(a.kv, 31, rows, kBt);
  ASSERT_EQ(client_->Backup(a.handle, keys, rows).held(), 4u);
  for (it::TestPool* other : {&b, &none}) {
    SCOPED_TRACE(other->spec.tenant.empty() ? "no tenant" : other->spec.tenant);
    LookupResult l = client_->Lookup(other->handle, keys);
    EXPECT_TRUE(l.status.ok()) << l.status.ToString();
    EXPECT_EQ(l.prefix_blocks, 0u);
    it::FillSentinel(other->kv);
    RestoreResult r = client_->Restore(other->handle, keys, dst);
    EXPECT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.restored_blocks, 0u);
    EXPECT_EQ(it::ChangedOutside(other->kv, {}), 0u) << "another tenant's data was written";
    auto e = client_->Evict(other->handle, keys);
    ASSERT_TRUE(e.ok());
    EXPECT_EQ(*e, 0u);
  }
  // Tenant A still has every block, and the same keys backed up by B are B's own copies.
  EXPECT_EQ(client_->Lookup(a.handle, keys).prefix_blocks, 4u);
  it::FillRows(b.kv, 32, rows, kBt);
  BackupResult bb = client_->Backup(b.handle, keys, rows);
  for (BlockStatus s : bb.blocks) EXPECT_EQ(s, BlockStatus::kStored);
  ASSERT_EQ(client_->Restore(a.handle, keys, dst).restored_blocks, 4u);
  EXPECT_TRUE(it::CheckRows(a.kv, 31, dst, kBt, false).ok()) << "tenant A got tenant B's data";
}

TEST_F(TenantTest, OverLimitRequestsAreResourceExhaustedAndLeakNoKeys) {
  it::TestPool a = Pool("tenant-a");
  it::TestPool b = Pool("tenant-b");
  const auto secret = IndependentKeys(41, 0, 4);  // tenant A's keys
  const auto rows = it::RowRange(0, 4 * kBt);
  it::FillRows(a.kv, 41, rows, kBt);
  ASSERT_EQ(client_->Backup(a.handle, secret, rows).held(), 4u);
  auto stub = Stub();
  std::vector<BlockKey> all = secret;
  std::vector<std::pair<std::string, grpc::Status>> answers;

  // Blocks per request above --max-blocks-per-request (8): Backup and Restore.
  const auto many = IndependentKeys(41, 0, 9);
  all.insert(all.end(), many.begin(), many.end());
  {
    v1::BackupRequest req;
    req.set_pool_id(b.info.pool_id);
    req.set_sync(true);
    req.set_wait_event(-1);
    req.set_done_event(-1);
    for (const auto& k : many) {
      auto* blk = req.add_blocks();
      blk->set_key(Raw(k));
      for (uint32_t r = 0; r < kBt; ++r) blk->add_rows(r);
    }
    v1::BackupResponse resp;
    grpc::Status st = stub->Backup(Ctx().get(), req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    answers.emplace_back("backup over max_blocks_per_request", st);
    v1::RestoreRequest rreq;
    rreq.set_pool_id(b.info.pool_id);
    rreq.set_sync(true);
    rreq.set_wait_event(-1);
    rreq.set_done_event(-1);
    rreq.set_layer_event_base(-1);
    *rreq.mutable_blocks() = req.blocks();
    v1::RestoreResponse rresp;
    st = stub->Restore(Ctx().get(), rreq, &rresp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    answers.emplace_back("restore over max_blocks_per_request", st);
  }
  // A message above --max-message-bytes (1 MiB): 70,000 keys of A in one Lookup.
  {
    v1::LookupRequest req;
    req.set_pool_id(b.info.pool_id);
    for (int i = 0; i < 70000; ++i) req.add_keys(Raw(secret[i % secret.size()]));
    ASSERT_GT(req.ByteSizeLong(), 1u << 20);
    v1::LookupResponse resp;
    grpc::Status st = stub->Lookup(Ctx().get(), req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    answers.emplace_back("lookup over max_message_bytes", st);
  }
  // Malformed requests naming A's keys: short key, unknown pool, rows out of range.
  {
    v1::LookupRequest req;
    req.set_pool_id(b.info.pool_id);
    req.add_keys(Raw(secret[0]));
    req.add_keys(Raw(secret[1]).substr(0, 15));
    v1::LookupResponse resp;
    grpc::Status st = stub->Lookup(Ctx().get(), req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    answers.emplace_back("lookup with a 15-byte key", st);
    req.set_pool_id(a.info.pool_id ^ 0x5A5A0000ull);
    st = stub->Lookup(Ctx().get(), req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
    answers.emplace_back("lookup of an unknown pool", st);
    v1::RestoreRequest rreq;
    rreq.set_pool_id(b.info.pool_id);
    rreq.set_sync(true);
    rreq.set_wait_event(-1);
    rreq.set_done_event(-1);
    rreq.set_layer_event_base(-1);
    auto* blk = rreq.add_blocks();
    blk->set_key(Raw(secret[2]));
    for (uint32_t r = 0; r < kBt; ++r) blk->add_rows(1000000 + r);
    v1::RestoreResponse rresp;
    st = stub->Restore(Ctx().get(), rreq, &rresp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    answers.emplace_back("restore with rows out of range", st);
    v1::EvictRequest ereq;
    ereq.set_pool_id(b.info.pool_id);
    ereq.add_keys(Raw(secret[3]) + "x");
    v1::EvictResponse eresp;
    st = stub->Evict(Ctx().get(), ereq, &eresp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    answers.emplace_back("evict with a 17-byte key", st);
  }
  for (const auto& [what, st] : answers) {
    std::printf("[security] %s -> %d '%s'\n", what.c_str(), static_cast<int>(st.error_code()),
                st.error_message().c_str());
    EXPECT_FALSE(st.ok()) << what;
    EXPECT_FALSE(LeaksKey(st.error_message(), all)) << what << ": " << st.error_message();
    EXPECT_FALSE(LeaksKey(st.error_details(), all)) << what;
  }
  // Nothing changed for A.
  EXPECT_EQ(client_->Lookup(a.handle, secret).prefix_blocks, 4u);
}

}  // namespace
}  // namespace hiqcache::rob
