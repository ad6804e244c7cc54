// The client against no daemon, a daemon that never answers, and an in-process fake daemon that
// forgets its pools or restarts: calls must miss within their deadline and pools must re-register.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/v1/cache.grpc.pb.h"
#include "time_margin.h"

namespace hiqcache {
namespace {

namespace v1 = ::hiqcache::v1;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

Geometry SmallGeometry() {
  Geometry g;
  g.num_layers = 2;
  g.num_kv_heads = 2;
  g.head_dim = 8;
  return g;
}

// In a directory of this process's own (mkdtemp: 0700): clients refuse a socket in a directory
// others may write, such as /tmp itself (socket_trust.h). Removed when the process exits.
std::string SocketPath(const char* tag) {
  struct OwnDir {
    std::string path;
    OwnDir() {
      char tmpl[] = "/tmp/hiq-client-test-XXXXXX";
      path = ::mkdtemp(tmpl) != nullptr ? tmpl : "/nonexistent";
    }
    ~OwnDir() {
      std::error_code ignored;
      if (path != "/nonexistent") std::filesystem::remove_all(path, ignored);
    }
  };
  static std::atomic<int> n{0};
  static const OwnDir dir;
  return dir.path + "/" + tag + "-" + std::to_string(n++) + ".sock";
}

std::vector<BlockKey> Keys(size_t n) {
  std::vector<uint32_t> tokens(n * 4);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i);
  return ComputeBlockKeys(tokens, 4);
}

TEST(ClientTargetTest, Normalizes) {
  auto a = Client::Connect("/tmp/x.sock");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->target(), "unix:///tmp/x.sock");
  auto b = Client::Connect("unix:///tmp/y.sock");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->target(), "unix:///tmp/y.sock");
  auto c = Client::Connect("localhost:7070");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->target(), "localhost:7070");
  auto d = Client::Connect(ClientOptions{});
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE((*d)->target().starts_with("unix:///")) << (*d)->target();
  EXPECT_EQ(Client::Connect("nonsense").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Client::Connect("unix:").status().code(), StatusCode::kInvalidArgument);
}

class NoDaemonTest : public testing::Test {
 protected:
  void SetUp() override {
    auto kv = HostKvPool::Create(SmallGeometry(), KvLayout::kSglang, 64);
    ASSERT_TRUE(kv.ok());
    kv_ = std::move(kv).value();
    spec_ = MakeHostPoolSpec("test-model", kv_, 4);
  }
  HostKvPool kv_;
  PoolSpec spec_;
};

TEST_F(NoDaemonTest, CallsMissQuicklyWhenNothingListens) {
  // Deadlines far above the margin asserted below: a call that waited for one instead of
  // failing on the refused connection would take longer than all the calls together may.
  ClientOptions options;
  options.target = "unix://" + SocketPath("absent");
  options.call_timeout = test_time::Margin(std::chrono::seconds(10));
  options.register_timeout = test_time::Margin(std::chrono::seconds(10));
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  const auto start = Clock::now();
  auto registered = (*client)->RegisterPool(spec_);
  EXPECT_EQ(registered.status().code(), StatusCode::kUnavailable) << registered.status().ToString();

  auto pending = (*client)->RegisterPool(spec_, /*pending_if_unavailable=*/true);
  ASSERT_TRUE(pending.ok()) << pending.status().ToString();
  EXPECT_EQ((*client)->PoolInfo(*pending).status().code(), StatusCode::kUnavailable);

  const auto keys = Keys(3);
  std::vector<uint32_t> rows(12);
  for (uint32_t i = 0; i < 12; ++i) rows[i] = i;
  for (int i = 0; i < 3; ++i) {  // first attempt and rate-limited ones
    LookupResult lookup = (*client)->Lookup(*pending, keys);
    EXPECT_EQ(lookup.prefix_blocks, 0u);
    EXPECT_FALSE(lookup.status.ok());
    BackupResult backup = (*client)->Backup(*pending, keys, rows);
    EXPECT_FALSE(backup.status.ok());
    ASSERT_EQ(backup.blocks.size(), 3u);
    for (BlockStatus b : backup.blocks) EXPECT_EQ(b, BlockStatus::kNotStored);
    EXPECT_EQ(backup.held(), 0u);
    RestoreResult restore = (*client)->Restore(*pending, keys, rows);
    EXPECT_EQ(restore.restored_blocks, 0u);
    EXPECT_FALSE(restore.status.ok());
  }
  EXPECT_FALSE((*client)->Evict(*pending, keys).ok());
  EXPECT_FALSE((*client)->GetStats().ok());
  const NamespaceRef ref{spec_.model, spec_.tenant, spec_.geometry, spec_.block_tokens,
                         spec_.codec};
  LookupResult group = (*client)->LookupGroup(std::span(&ref, 1), keys);
  EXPECT_EQ(group.prefix_blocks, 0u);
  EXPECT_FALSE(group.status.ok());
  EXPECT_LT(Clock::now() - start, test_time::Margin(std::chrono::seconds(3)));
  EXPECT_TRUE((*client)->ReleasePool(*pending).ok());
  EXPECT_EQ((*client)->Lookup(*pending, keys).status.code(), StatusCode::kInvalidArgument);
}

// A socket in a directory anyone may write (/tmp itself) is refused before any call is made:
// PERMISSION_DENIED naming the directory, a miss for every data call, and no pending pool.
TEST_F(NoDaemonTest, ASocketInAWorldWritableDirectoryIsNotTrusted) {
  ClientOptions options;
  options.target = "unix:///tmp/hiq-untrusted-" + std::to_string(::getpid()) + ".sock";
  options.call_timeout = milliseconds(500);
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  auto registered = (*client)->RegisterPool(spec_, /*pending_if_unavailable=*/true);
  EXPECT_EQ(registered.status().code(), StatusCode::kPermissionDenied)
      << registered.status().ToString();
  EXPECT_NE(registered.status().message().find("socket directory /tmp "), std::string::npos)
      << registered.status().ToString();
  auto stats = (*client)->GetStats();
  EXPECT_EQ(stats.status().code(), StatusCode::kPermissionDenied) << stats.status().ToString();
}

TEST_F(NoDaemonTest, CallsMissAtTheDeadlineWhenTheDaemonNeverAnswers) {
  // A TCP listener that never accepts: connects, but no HTTP/2 handshake ever completes.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);

  ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  options.call_timeout = milliseconds(300);
  options.register_timeout = milliseconds(300);
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  auto start = Clock::now();
  auto pool = (*client)->RegisterPool(spec_, true);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  // The 300 ms deadline; what fails is a call that waits for the connection (gRPC: 20 s).
  EXPECT_LT(Clock::now() - start, test_time::Margin(milliseconds(1500)));
  std::this_thread::sleep_for(milliseconds(600));  // past the re-registration rate limit
  start = Clock::now();
  LookupResult lookup = (*client)->Lookup(*pool, Keys(2));
  EXPECT_EQ(lookup.prefix_blocks, 0u);
  EXPECT_FALSE(lookup.status.ok());
  EXPECT_LT(Clock::now() - start, test_time::Margin(milliseconds(1500)));
  ::close(fd);
}

// An in-process stand-in for hiqcached: pool ids from 1, NOT_FOUND for ids it does not know.
class FakeCache final : public v1::Cache::Service {
 public:
  grpc::Status RegisterPool(grpc::ServerContext*, const v1::RegisterPoolRequest* req,
                            v1::RegisterPoolResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    valid_.insert(id);
    last_register_ = *req;
    log_.push_back("register:" + std::to_string(id));
    resp->set_pool_id(id);
    resp->set_namespace_id("ns-1");
    resp->set_encoded_bytes_per_token(74880);
    resp->set_block_bytes(74880 * req->block_tokens());
    resp->set_capacity_tokens(1000);
    return grpc::Status::OK;
  }
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest* req,
                      v1::LookupResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("lookup:" + std::to_string(req->pool_id()));
    last_lookup_ = *req;
    if (req->pool_id() == 0 && req->namespaces_size() > 0) {  // a group lookup: one less
      resp->set_prefix_blocks(static_cast<uint32_t>(req->keys_size()) - 1);
      return grpc::Status::OK;
    }
    if (!valid_.contains(req->pool_id())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "pool_id: unknown pool");
    }
    for (const std::string& k : req->keys()) {
      if (k.size() != 16) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "keys: 16");
    }
    resp->set_prefix_blocks(static_cast<uint32_t>(req->keys_size()));
    return grpc::Status::OK;
  }
  grpc::Status Backup(grpc::ServerContext*, const v1::BackupRequest* req,
                      v1::BackupResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!valid_.contains(req->pool_id())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "pool_id: unknown pool");
    }
    last_backup_ = *req;
    for (int i = 0; i < req->blocks_size(); ++i) {
      resp->add_results(i == 0 ? v1::BLOCK_ALREADY_PRESENT : v1::BLOCK_STORED);
    }
    resp->set_ticket(++ticket_);
    return grpc::Status::OK;
  }
  grpc::Status Restore(grpc::ServerContext*, const v1::RestoreRequest* req,
                       v1::RestoreResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!valid_.contains(req->pool_id())) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "pool_id: unknown pool");
    }
    last_restore_ = *req;
    resp->set_restored_blocks(static_cast<uint32_t>(req->blocks_size()) - 1);
    resp->set_ticket(++ticket_);
    return grpc::Status::OK;
  }
  grpc::Status ReleasePool(grpc::ServerContext*, const v1::ReleasePoolRequest* req,
                           v1::ReleasePoolResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("release:" + std::to_string(req->pool_id()));
    valid_.erase(req->pool_id());
    return grpc::Status::OK;
  }

  void Forget() {
    std::lock_guard<std::mutex> lock(mu_);
    valid_.clear();
  }
  std::vector<std::string> log() {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }
  v1::RegisterPoolRequest last_register() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_register_;
  }
  v1::LookupRequest last_lookup() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_lookup_;
  }
  v1::BackupRequest last_backup() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_backup_;
  }
  v1::RestoreRequest last_restore() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_restore_;
  }

 private:
  std::mutex mu_;
  uint64_t next_id_ = 1;
  uint64_t ticket_ = 0;
  std::set<uint64_t> valid_;
  std::vector<std::string> log_;
  v1::RegisterPoolRequest last_register_;
  v1::LookupRequest last_lookup_;
  v1::BackupRequest last_backup_;
  v1::RestoreRequest last_restore_;
};

struct FakeDaemon {
  explicit FakeDaemon(const std::string& path) : service(std::make_unique<FakeCache>()) {
    ::unlink(path.c_str());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix://" + path, grpc::InsecureServerCredentials());
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
  }
  ~FakeDaemon() { server->Shutdown(std::chrono::system_clock::now()); }
  std::unique_ptr<FakeCache> service;
  std::unique_ptr<grpc::Server> server;
};

class FakeDaemonTest : public NoDaemonTest {
 protected:
  void SetUp() override {
    NoDaemonTest::SetUp();
    auto events = HostEventPool::Create(4);
    ASSERT_TRUE(events.ok());
    events_ = std::move(events).value();
    spec_.events = events_.Spec();
    path_ = SocketPath("fake");
    daemon_ = std::make_unique<FakeDaemon>(path_);
    ASSERT_NE(daemon_->server, nullptr);
    ClientOptions options;
    options.target = "unix://" + path_;
    options.call_timeout = milliseconds(1000);
    auto client = Client::Connect(options);
    ASSERT_TRUE(client.ok());
    client_ = std::move(client).value();
  }
  void TearDown() override {
    client_.reset();
    daemon_.reset();
    ::unlink(path_.c_str());
  }

  HostEventPool events_;
  std::string path_;
  std::unique_ptr<FakeDaemon> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_F(FakeDaemonTest, RequestsCarryTheSpecAndOptions) {
  auto pool = client_->RegisterPool(spec_);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const v1::RegisterPoolRequest reg = daemon_->service->last_register();
  EXPECT_EQ(reg.client_pid(), static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(reg.model(), "test-model");
  EXPECT_EQ(reg.block_tokens(), 4u);
  EXPECT_EQ(reg.geometry().num_layers(), 2u);
  EXPECT_EQ(reg.geometry().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(reg.geometry().attention(), v1::ATTENTION_MHA);
  EXPECT_FALSE(reg.geometry().has_rope());  // no rope given: unset, as before Geometry.rope
  EXPECT_EQ(reg.device().kind(), v1::DEVICE_KIND_HOST);
  ASSERT_EQ(reg.buffers_size(), 1);
  EXPECT_EQ(reg.buffers(0).host_shm_name(), kv_.shm().name());
  ASSERT_EQ(reg.layers_size(), 2);
  EXPECT_EQ(reg.layers(1).v().offset_bytes(), kv_.layers()[1].v->offset_bytes);
  EXPECT_EQ(reg.events().host_shm_name(), events_.name());
  EXPECT_EQ(reg.events().count(), 4u);

  auto info = client_->PoolInfo(*pool);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pool_id, 1u);
  EXPECT_EQ(info->encoded_bytes_per_token, 74880u);

  const auto keys = Keys(3);
  std::vector<uint32_t> rows(12);
  for (uint32_t i = 0; i < 12; ++i) rows[i] = 40 + i;
  BackupOptions bo;
  bo.sync = false;
  bo.done_event = 1;
  bo.wait_event = 0;
  bo.wait_value = 9;
  BackupResult backup = client_->Backup(*pool, keys, rows, bo);
  ASSERT_TRUE(backup.status.ok()) << backup.status.ToString();
  EXPECT_EQ(backup.blocks[0], BlockStatus::kAlreadyPresent);
  EXPECT_EQ(backup.blocks[2], BlockStatus::kStored);
  EXPECT_EQ(backup.held(), 3u);
  EXPECT_EQ(backup.ticket, 1u);
  const v1::BackupRequest br = daemon_->service->last_backup();
  EXPECT_EQ(br.pool_id(), 1u);
  ASSERT_EQ(br.blocks_size(), 3);
  EXPECT_EQ(br.blocks(1).key(), std::string(reinterpret_cast<const char*>(keys[1].data()), 16));
  ASSERT_EQ(br.blocks(1).rows_size(), 4);
  EXPECT_EQ(br.blocks(1).rows(3), 47u);
  EXPECT_FALSE(br.sync());
  EXPECT_EQ(br.done_event(), 1);
  EXPECT_EQ(br.wait_event(), 0);
  EXPECT_EQ(br.wait_value(), 9u);

  RestoreOptions ro;
  ro.layer_event_base = 2;
  RestoreResult restore = client_->Restore(*pool, keys, rows, ro);
  ASSERT_TRUE(restore.status.ok());
  EXPECT_EQ(restore.restored_blocks, 2u);
  EXPECT_EQ(restore.ticket, 2u);
  const v1::RestoreRequest rr = daemon_->service->last_restore();
  EXPECT_EQ(rr.layer_event_base(), 2);
  EXPECT_EQ(rr.done_event(), -1);
  EXPECT_EQ(rr.wait_event(), -1);
  EXPECT_TRUE(rr.sync());

  // A group lookup names namespaces by their parts and no pool.
  NamespaceRef r0{spec_.model, "t", spec_.geometry, spec_.block_tokens, Codec::kRaw};
  r0.geometry.tp_size = 2;
  NamespaceRef r1 = r0;
  r1.geometry.tp_rank = 1;
  r1.geometry.attention = Attention::kMLA;
  r1.geometry.dtype = DType::kFP16;
  r1.geometry.rope_theta = 1e6;
  r1.geometry.rope_interleaved = true;
  r1.codec = Codec::kInt5Allot;
  const std::vector<NamespaceRef> refs = {r0, r1};
  LookupResult group = client_->LookupGroup(refs, keys);
  ASSERT_TRUE(group.status.ok()) << group.status.ToString();
  EXPECT_EQ(group.prefix_blocks, 2u);
  const v1::LookupRequest lr = daemon_->service->last_lookup();
  EXPECT_EQ(lr.pool_id(), 0u);
  ASSERT_EQ(lr.keys_size(), 3);
  EXPECT_EQ(lr.keys(2), std::string(reinterpret_cast<const char*>(keys[2].data()), 16));
  ASSERT_EQ(lr.namespaces_size(), 2);
  EXPECT_EQ(lr.namespaces(0).model(), "test-model");
  EXPECT_EQ(lr.namespaces(0).tenant(), "t");
  EXPECT_EQ(lr.namespaces(0).block_tokens(), 4u);
  EXPECT_EQ(lr.namespaces(0).codec(), v1::CODEC_RAW);
  EXPECT_EQ(lr.namespaces(0).geometry().num_layers(), 2u);
  EXPECT_EQ(lr.namespaces(0).geometry().num_kv_heads(), spec_.geometry.num_kv_heads);
  EXPECT_EQ(lr.namespaces(0).geometry().head_dim(), spec_.geometry.head_dim);
  EXPECT_EQ(lr.namespaces(0).geometry().tp_rank(), 0u);
  EXPECT_EQ(lr.namespaces(0).geometry().tp_size(), 2u);
  EXPECT_EQ(lr.namespaces(0).geometry().attention(), v1::ATTENTION_MHA);
  EXPECT_EQ(lr.namespaces(1).geometry().tp_rank(), 1u);
  EXPECT_EQ(lr.namespaces(1).geometry().attention(), v1::ATTENTION_MLA);
  EXPECT_EQ(lr.namespaces(1).geometry().dtype(), v1::DTYPE_FP16);
  EXPECT_FALSE(lr.namespaces(0).geometry().has_rope());
  EXPECT_EQ(lr.namespaces(1).codec(), v1::CODEC_INT5_ALLOT);
  EXPECT_EQ(lr.namespaces(1).geometry().rope().theta(), 1e6);
  EXPECT_TRUE(lr.namespaces(1).geometry().rope().interleaved());
  // Nothing to ask about: answered locally.
  EXPECT_EQ(client_->LookupGroup({}, keys).status.code(), StatusCode::kInvalidArgument);
  group = client_->LookupGroup(refs, {});
  EXPECT_TRUE(group.status.ok());
  EXPECT_EQ(group.prefix_blocks, 0u);

  // Row count mismatch: refused, nothing stored.
  BackupResult bad = client_->Backup(*pool, keys, std::span(rows).first(11));
  EXPECT_EQ(bad.status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.held(), 0u);

  EXPECT_TRUE(client_->ReleasePool(*pool).ok());
  EXPECT_EQ(daemon_->service->log().back(), "release:1");
}

TEST_F(FakeDaemonTest, ReRegistersWhenTheDaemonForgetsThePool) {
  auto pool = client_->RegisterPool(spec_);
  ASSERT_TRUE(pool.ok());
  const auto keys = Keys(2);
  EXPECT_EQ(client_->Lookup(*pool, keys).prefix_blocks, 2u);
  events_.Store(0, 41);
  std::this_thread::sleep_for(milliseconds(600));  // past the re-registration rate limit
  daemon_->service->Forget();
  LookupResult lookup = client_->Lookup(*pool, keys);
  EXPECT_TRUE(lookup.status.ok()) << lookup.status.ToString();
  EXPECT_EQ(lookup.prefix_blocks, 2u);
  auto info = client_->PoolInfo(*pool);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pool_id, 2u);
  EXPECT_EQ(daemon_->service->log(), (std::vector<std::string>{"register:1", "lookup:1", "lookup:1",
                                                               "register:2", "lookup:2"}));
  // The new registration's tickets restart: the client zeroed its event slots.
  EXPECT_EQ(events_.Read(0), 0u);
}

TEST_F(FakeDaemonTest, ReRegistersAfterADaemonRestartThatReusesPoolIds) {
  auto pool = client_->RegisterPool(spec_);
  ASSERT_TRUE(pool.ok());
  const auto keys = Keys(2);
  EXPECT_EQ(client_->Lookup(*pool, keys).prefix_blocks, 2u);

  daemon_.reset();  // the daemon dies: calls miss
  std::this_thread::sleep_for(milliseconds(100));
  LookupResult down = client_->Lookup(*pool, keys);
  EXPECT_EQ(down.prefix_blocks, 0u);
  EXPECT_FALSE(down.status.ok());

  // A new daemon hands out pool id 1 again; the client must not reuse its stale id 1 unseen.
  daemon_ = std::make_unique<FakeDaemon>(path_);
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  LookupResult up;
  while (Clock::now() < deadline) {
    up = client_->Lookup(*pool, keys);
    if (up.status.ok()) break;
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_TRUE(up.status.ok()) << up.status.ToString();
  EXPECT_EQ(up.prefix_blocks, 2u);
  const auto log = daemon_->service->log();
  ASSERT_GE(log.size(), 2u);
  EXPECT_EQ(log.front(), "register:1");
}

TEST_F(FakeDaemonTest, ManyThreadsShareOneClient) {
  auto pool = client_->RegisterPool(spec_);
  ASSERT_TRUE(pool.ok());
  const auto keys = Keys(4);
  std::this_thread::sleep_for(milliseconds(600));  // past the re-registration rate limit
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        if (t == 0 && i == 25) daemon_->service->Forget();
        if (client_->Lookup(*pool, keys).prefix_blocks != 4) failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  // After Forget, every thread re-registers or rides on another's re-registration; at most a
  // few calls inside the rate-limit window may miss.
  EXPECT_LE(failures.load(), 8);
  EXPECT_TRUE(client_->PoolInfo(*pool).ok());
}

}  // namespace
}  // namespace hiqcache
