// hiqcache::Session against a scripted SOCK_SEQPACKET listener (session_protocol.h): greeting
// parsing, fd passing in messages of at most kMaxFdsPerMessage, refusals, timeouts and the
// daemon going away.
#include "hiqcache/session.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "hiqcache/client.h"
#include "hiqcache/host_shm.h"
#include "hiqcache/session_protocol.h"
#include "time_margin.h"

namespace hiqcache {
namespace {

using std::chrono::milliseconds;

// Receives one packet and the fds attached to it (closed by the caller).
bool RecvWithFds(int fd, std::string* text, std::vector<int>* fds) {
  char buf[kMaxSessionMessageBytes];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 64)];
  iovec iov{buf, sizeof(buf)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  if (n <= 0) return false;
  text->assign(buf, static_cast<size_t>(n));
  fds->clear();
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int f;
      std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->push_back(f);
    }
  }
  return true;
}

void SendText(int fd, const std::string& s) { ::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

// A session socket at DIR/d.sock.session that accepts one connection and runs `script` on it.
class FakeListener {
 public:
  explicit FakeListener(std::function<void(int conn)> script) {
    static std::atomic<int> counter{0};
    dir_ = "/tmp/hiq-session-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    std::filesystem::create_directories(dir_);
    listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    const std::string path = dir_ + "/d.sock" + std::string(kSessionSocketSuffix);
    std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
    ok_ = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 &&
          ::listen(listen_fd_, 4) == 0;
    thread_ = std::thread([this, script = std::move(script)] {
      const int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) return;
      script(conn);
      ::close(conn);
    });
  }
  ~FakeListener() {
    ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept() when nobody connected
    thread_.join();
    ::close(listen_fd_);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  bool ok() const { return ok_; }
  std::string target() const { return "unix://" + dir_ + "/d.sock"; }

 private:
  std::string dir_;
  int listen_fd_ = -1;
  bool ok_ = false;
  std::thread thread_;
};

constexpr char kGreeting[] =
    "HIQ-SESSION 1 token=0123456789abcdef0123456789abcdef pid=4242 uid=61001 gid=61002";

// Waits until the client closes its end (so the script does not close first).
void WaitForClose(int conn) {
  char b;
  while (::recv(conn, &b, 1, 0) > 0) {
  }
}

TEST(SessionTest, NonUnixTargetHasNoSession) {
  auto s = Session::Open("localhost:7000", milliseconds(200));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition) << s.status().ToString();
  EXPECT_NE(s.status().message().find("no session"), std::string::npos);
}

TEST(SessionTest, NothingListeningIsUnavailable) {
  auto s = Session::Open("unix:///tmp/hiq-session-test-none/d.sock", milliseconds(200));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().ToString();
}

TEST(SessionTest, ParsesGreetingForEveryTargetForm) {
  for (int form = 0; form < 3; ++form) {
    FakeListener l([](int conn) {
      SendText(conn, kGreeting);
      WaitForClose(conn);
    });
    ASSERT_TRUE(l.ok());
    std::string target = l.target();  // unix:///...
    if (form == 1) target = "unix:" + target.substr(7);
    if (form == 2) target = target.substr(7);  // bare absolute path
    auto s = Session::Open(target, milliseconds(2000));
    ASSERT_TRUE(s.ok()) << target << ": " << s.status().ToString();
    EXPECT_EQ((*s)->token(), "0123456789abcdef0123456789abcdef");
    EXPECT_EQ((*s)->pid(), 4242u);
    EXPECT_EQ((*s)->uid(), 61001u);
    EXPECT_EQ((*s)->gid(), 61002u);
    EXPECT_TRUE((*s)->alive());
    EXPECT_TRUE((*s)->path().ends_with("/d.sock.session")) << (*s)->path();
  }
}

TEST(SessionTest, BadGreetingsAreRefused) {
  for (const char* g :
       {"HELLO 1 token=ab pid=1 uid=0 gid=0", "HIQ-SESSION 1 pid=1 uid=0 gid=0",
        "HIQ-SESSION 1 token=ab pid=x uid=0 gid=0",
        "HIQ-SESSION 1 token=ab pid=1 uid=99999999999 gid=0", "HIQ-SESSION 2 token=ab pid=1"}) {
    FakeListener l([g](int conn) {
      SendText(conn, g);
      WaitForClose(conn);
    });
    auto s = Session::Open(l.target(), milliseconds(2000));
    ASSERT_FALSE(s.ok()) << g;
    EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition) << s.status().ToString();
  }
}

TEST(SessionTest, RefusedSessionIsAnError) {
  FakeListener l([](int conn) { SendText(conn, "ERR too many sessions (max_sessions 1)"); });
  auto s = Session::Open(l.target(), milliseconds(2000));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status().ToString();
  EXPECT_NE(s.status().message().find("max_sessions"), std::string::npos);
}

TEST(SessionTest, NoGreetingTimesOut) {
  FakeListener l([](int conn) { WaitForClose(conn); });
  const auto t0 = std::chrono::steady_clock::now();
  auto s = Session::Open(l.target(), milliseconds(200));
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().ToString();
  EXPECT_GE(took, milliseconds(180));
  EXPECT_LT(took, test_time::Margin(milliseconds(2000)));  // the 200 ms timeout, not a hang
}

// 20 fds go as 16 + 4, each message answered in order; the daemon side receives the same files.
TEST(SessionTest, SendFdsSplitsMessagesAndKeepsOrder) {
  std::vector<std::vector<ino_t>> received;  // inodes per message
  std::vector<std::string> texts;
  auto l = std::make_unique<FakeListener>([&](int conn) {
    SendText(conn, kGreeting);
    uint64_t next_id = 100;
    std::string text;
    std::vector<int> fds;
    while (RecvWithFds(conn, &text, &fds)) {
      texts.push_back(text);
      std::vector<ino_t> inos;
      std::string answer = "OK";
      for (int f : fds) {
        struct stat st {};
        ::fstat(f, &st);
        inos.push_back(st.st_ino);
        ::close(f);
        answer += " " + std::to_string(next_id++);
      }
      received.push_back(inos);
      SendText(conn, answer);
    }
  });
  auto s = Session::Open(l->target(), milliseconds(2000));
  ASSERT_TRUE(s.ok()) << s.status().ToString();

  std::vector<int> fds;
  std::vector<ino_t> want;
  for (int i = 0; i < 20; ++i) {
    char name[] = "/tmp/hiq-session-fd-XXXXXX";
    const int f = ::mkstemp(name);
    ASSERT_GE(f, 0);
    ::unlink(name);
    struct stat st {};
    ::fstat(f, &st);
    want.push_back(st.st_ino);
    fds.push_back(f);
  }
  auto ids = (*s)->SendFds(fds);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  ASSERT_EQ(ids->size(), 20u);
  for (size_t i = 0; i < ids->size(); ++i) EXPECT_EQ((*ids)[i], 100 + i);
  // The client's own fds stay open and usable.
  for (int f : fds) EXPECT_GE(::fcntl(f, F_GETFD), 0) << f;
  for (int f : fds) ::close(f);

  auto none = (*s)->SendFds({});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());

  s->reset();  // closes: the listener's loop ends
  l.reset();   // joins it
  ASSERT_EQ(received.size(), 2u);
  EXPECT_EQ(received[0].size(), kMaxFdsPerMessage);
  EXPECT_EQ(received[1].size(), 20 - kMaxFdsPerMessage);
  std::vector<ino_t> got = received[0];
  got.insert(got.end(), received[1].begin(), received[1].end());
  EXPECT_EQ(got, want);
  for (const std::string& t : texts) EXPECT_EQ(t, "FDS");
}

TEST(SessionTest, RefusalsAndMalformedAnswersAreErrors) {
  struct Case {
    const char* answer;
    StatusCode code;
  };
  for (const Case& c :
       {Case{"ERR FDS: this session would hold 257 unconsumed fds, at most 256",
             StatusCode::kResourceExhausted},
        Case{"ERR bad message", StatusCode::kFailedPrecondition},
        Case{"OK 1 2", StatusCode::kUnavailable},  // two ids for one fd
        Case{"OK x", StatusCode::kUnavailable}, Case{"YES", StatusCode::kUnavailable}}) {
    FakeListener l([&c](int conn) {
      SendText(conn, kGreeting);
      std::string text;
      std::vector<int> fds;
      if (RecvWithFds(conn, &text, &fds)) {
        for (int f : fds) ::close(f);
        SendText(conn, c.answer);
      }
      WaitForClose(conn);
    });
    auto s = Session::Open(l.target(), milliseconds(2000));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    auto ids = (*s)->SendFds(std::span<const int>(&fd, 1));
    ::close(fd);
    ASSERT_FALSE(ids.ok()) << c.answer;
    EXPECT_EQ(ids.status().code(), c.code) << c.answer << ": " << ids.status().ToString();
  }
}

TEST(SessionTest, BadFdIsInvalidArgument) {
  FakeListener l([](int conn) {
    SendText(conn, kGreeting);
    WaitForClose(conn);
  });
  auto s = Session::Open(l.target(), milliseconds(2000));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const int bad = 1000000;
  auto ids = (*s)->SendFds(std::span<const int>(&bad, 1));
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), StatusCode::kInvalidArgument) << ids.status().ToString();
}

TEST(SessionTest, DaemonClosingMakesItDeadAndSendFdsUnavailable) {
  std::atomic<bool> close_now{false};
  FakeListener l([&](int conn) {
    SendText(conn, kGreeting);
    while (!close_now.load()) std::this_thread::sleep_for(milliseconds(5));
  });
  auto s = Session::Open(l.target(), milliseconds(2000));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_TRUE((*s)->alive());
  close_now.store(true);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while ((*s)->alive() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_FALSE((*s)->alive());
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  auto ids = (*s)->SendFds(std::span<const int>(&fd, 1));
  ::close(fd);
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), StatusCode::kUnavailable) << ids.status().ToString();
}

TEST(SessionTest, SessionFdIsCloseOnExec) {
  FakeListener l([](int conn) {
    SendText(conn, kGreeting);
    WaitForClose(conn);
  });
  // The session's fd is the lowest free one after a probe's.
  const int probe = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ::close(probe);
  auto s = Session::Open(l.target(), milliseconds(2000));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const int flags = ::fcntl(probe, F_GETFD);
  ASSERT_GE(flags, 0);
  EXPECT_TRUE(flags & FD_CLOEXEC);
}

}  // namespace
}  // namespace hiqcache

// ---------------------------------------------------------------------------------------------
// Through the client library, without a daemon.

namespace hiqcache {
namespace {

// A buffer given only by fd has no name to fall back on: without a session (a TCP target) it
// cannot be registered, and nothing is sent.
TEST(ClientSessionTest, FdOnlyBufferNeedsASession) {
  ClientOptions o;
  o.target = "127.0.0.1:1";
  o.register_timeout = milliseconds(500);
  auto client = Client::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  auto kv = HostKvPool::Create(Geometry{2, 2, 64}, KvLayout::kSglang, 32, 16, "memfd:kv");
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  auto h = (*client)->RegisterPool(MakeHostPoolSpec("m", *kv, 16));
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kFailedPrecondition) << h.status().ToString();
  EXPECT_NE(h.status().message().find("session"), std::string::npos) << h.status().message();
}

}  // namespace
}  // namespace hiqcache

#ifdef HIQ_DAEMON_PATH
// ---------------------------------------------------------------------------------------------
// Against the real daemon.

#include <grpcpp/grpcpp.h>

#include "hiqcache/v1/cache.grpc.pb.h"
#include "integration/daemon_process.h"
#include "integration/it_util.h"

namespace hiqcache {
namespace {

using testing::DaemonProcess;
namespace v1 = ::hiqcache::v1;

class DaemonSessionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    daemon_ = new DaemonProcess("64MiB");
    ASSERT_TRUE(daemon_->Start()) << "hiqcached did not start";
  }
  static void TearDownTestSuite() {
    if (daemon_ != nullptr) EXPECT_EQ(daemon_->Stop(), 0);
    delete daemon_;
    daemon_ = nullptr;
  }
  static it::PoolOptions Options(const std::string& model) {
    it::PoolOptions o;
    o.model = model;
    o.geometry = it::Geom(2, 2, 64);
    o.num_rows = 64;
    o.event_slots = 4;
    return o;
  }
  // Pools of namespace `ns` GetStats lists.
  static size_t PoolsOf(Client& c, const std::string& ns) {
    auto s = c.GetStats();
    if (!s.ok()) return SIZE_MAX;
    size_t n = 0;
    for (const PoolStats& p : s->pools) n += p.namespace_id == ns;
    return n;
  }

  static DaemonProcess* daemon_;
};
DaemonProcess* DaemonSessionTest::daemon_ = nullptr;

TEST_F(DaemonSessionTest, GreetingNamesThisProcess) {
  auto a = Session::Open(daemon_->target(), std::chrono::seconds(5));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->pid(), static_cast<uint32_t>(::getpid()));
  EXPECT_EQ((*a)->uid(), static_cast<uint32_t>(::getuid()));
  EXPECT_EQ((*a)->gid(), static_cast<uint32_t>(::getgid()));
  EXPECT_EQ((*a)->token().size(), 32u);
  EXPECT_EQ((*a)->token().find_first_not_of("0123456789abcdef"), std::string::npos)
      << (*a)->token();
  EXPECT_TRUE((*a)->alive());
  auto b = Session::Open(daemon_->target(), std::chrono::seconds(5));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NE((*a)->token(), (*b)->token());
}

TEST_F(DaemonSessionTest, SendFdsReturnsDistinctIds) {
  auto s = Session::Open(daemon_->target(), std::chrono::seconds(5));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::vector<HostShm> objects;
  std::vector<int> fds;
  for (int i = 0; i < 20; ++i) {
    auto m = HostShm::CreateMemfd("fd" + std::to_string(i), 4096);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    fds.push_back(m->fd());
    objects.push_back(std::move(m).value());
  }
  auto ids = (*s)->SendFds(fds);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  ASSERT_EQ(ids->size(), 20u);
  auto more = (*s)->SendFds(std::span<const int>(fds).first(3));
  ASSERT_TRUE(more.ok()) << more.status().ToString();
  std::vector<uint64_t> all = *ids;
  all.insert(all.end(), more->begin(), more->end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end()) << "an fd id repeats";
  EXPECT_EQ(all.front() == 0, false);
  EXPECT_TRUE((*s)->alive());
}

// What the protocol does not know is answered "ERR ...", and the session goes on.
TEST_F(DaemonSessionTest, BadMessagesAreAnsweredErr) {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  const std::string path = daemon_->socket_path() + std::string(kSessionSocketSuffix);
  std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0) << path;
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string text;
  std::vector<int> fds;
  ASSERT_TRUE(RecvWithFds(fd, &text, &fds));
  EXPECT_TRUE(text.starts_with(kSessionGreeting)) << text;
  for (const char* bad : {"HELLO", "FDS"}) {  // unknown; FDS without fds
    SendText(fd, bad);
    ASSERT_TRUE(RecvWithFds(fd, &text, &fds)) << bad;
    EXPECT_TRUE(text.starts_with("ERR ")) << bad << " answered " << text;
  }
  // Still a session: a proper FDS message is answered OK.
  const int passed = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  static constexpr char kFds[] = "FDS";
  iovec iov{const_cast<char*>(kFds), 3};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &passed, sizeof(int));
  ASSERT_EQ(::sendmsg(fd, &msg, MSG_NOSIGNAL), 3);
  ::close(passed);
  ASSERT_TRUE(RecvWithFds(fd, &text, &fds));
  EXPECT_TRUE(text.starts_with("OK ")) << text;
  ::close(fd);
}

// GetStats knows the caller by its session, and its pools as its own.
TEST_F(DaemonSessionTest, StatsNameTheCallerAndItsPools) {
  auto client = it::Connect(daemon_->target());
  ASSERT_NE(client, nullptr);
  auto p = it::MakePool(*client, Options("session-stats"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  auto s = client->GetStats();
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->caller_uid, static_cast<uint32_t>(::getuid()));
  EXPECT_EQ(s->caller_admin, ::getuid() == 0);
  EXPECT_GE(s->namespaces_total, 1u);
  const PoolStats* mine = nullptr;
  for (const PoolStats& ps : s->pools) {
    if (ps.pool_id == p->info.pool_id) mine = &ps;
  }
  ASSERT_NE(mine, nullptr) << it::StatsText(*s);
  EXPECT_TRUE(mine->owned);
  EXPECT_EQ(mine->uid, static_cast<uint32_t>(::getuid()));
  EXPECT_EQ(mine->client_pid, static_cast<uint32_t>(::getpid()));
}

// The session closing (here: the Client destroyed, as when the process dies) releases every pool
// registered through it, within 1 s, without a ReleasePool.
TEST_F(DaemonSessionTest, SessionEndReleasesItsPools) {
  auto observer = it::Connect(daemon_->target());
  ASSERT_NE(observer, nullptr);
  auto client = it::Connect(daemon_->target());
  ASSERT_NE(client, nullptr);
  auto a = it::MakePool(*client, Options("session-end"));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = it::MakePool(*client, Options("session-end"));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const std::string ns = a->info.namespace_id;
  ASSERT_EQ(PoolsOf(*observer, ns), 2u);
  client.reset();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(it::Eventually([&] { return PoolsOf(*observer, ns) == 0; },
                             test_time::Margin(milliseconds(3000))))
      << "pools of a closed session still listed: " << PoolsOf(*observer, ns);
  std::printf(
      "pools released %.0f ms after the session closed\n",
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

// HOST pools go by fd: a memfd pool, which has no name at all, registers and round-trips.
TEST_F(DaemonSessionTest, MemfdPoolRoundTrips) {
  auto client = it::Connect(daemon_->target());
  ASSERT_NE(client, nullptr);
  it::TestPool p;
  auto kv = HostKvPool::Create(it::Geom(2, 2, 64), KvLayout::kVllmPaged, 64, 16, "memfd:kv");
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  p.kv = std::move(kv).value();
  auto ev = HostEventPool::Create(4, "memfd:ev");
  ASSERT_TRUE(ev.ok()) << ev.status().ToString();
  p.events = std::move(ev).value();
  p.spec = MakeHostPoolSpec("session-memfd", p.kv, 16, &p.events);
  ASSERT_TRUE(p.spec.buffers[0].host_shm_name.empty());
  auto h = client->RegisterPool(p.spec);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const auto keys = it::Keys(77, 2, 16);
  const auto rows = it::RowRange(0, 32), dst = it::RowRange(32, 32);
  it::FillRows(p.kv, 77, rows, 16);
  BackupOptions bo;
  bo.done_event = 1;
  BackupResult b = client->Backup(*h, keys, rows, bo);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_EQ(b.held(), 2u);
  EXPECT_GE(p.events.Read(1), b.ticket) << "the done event went elsewhere";
  RestoreResult r = client->Restore(*h, keys, dst);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.restored_blocks, 2u);
  it::CheckResult c = it::CheckRows(p.kv, 77, dst, 16, false);
  EXPECT_TRUE(c.ok()) << c.first;
}

// A named HOST object goes by fd too: the client opens it with its own rights and passes the fd.
// Shown with an object owned by another uid, which the daemon refuses by name (the owner must
// be the caller) but takes as an fd, the fd being the proof of access. Needs root (fchown).
TEST_F(DaemonSessionTest, NamedObjectsArePassedByFd) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give the object to another uid";
  auto client = it::Connect(daemon_->target());
  ASSERT_NE(client, nullptr);
  auto kv = HostKvPool::Create(it::Geom(2, 2, 64), KvLayout::kSglang, 64);
  ASSERT_TRUE(kv.ok()) << kv.status().ToString();
  const PoolSpec spec = MakeHostPoolSpec("session-named", *kv, 16);
  ASSERT_FALSE(spec.buffers[0].host_shm_name.empty());

  // The same registration by name alone, raw, as a daemon without sessions would get it.
  auto session = it::SessionContext::Open(daemon_->target());
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  auto stub = v1::Cache::NewStub(
      grpc::CreateChannel(daemon_->target(), grpc::InsecureChannelCredentials()));
  v1::RegisterPoolRequest req;
  req.set_model("session-named");
  auto* g = req.mutable_geometry();
  g->set_num_layers(2);
  g->set_num_kv_heads(2);
  g->set_head_dim(64);
  g->set_dtype(v1::DTYPE_BF16);
  g->set_attention(v1::ATTENTION_MHA);
  g->set_tp_size(1);
  req.set_block_tokens(16);
  req.set_codec(v1::CODEC_INT8_PER_HEAD);
  req.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  auto* b = req.add_buffers();
  b->set_host_shm_name(spec.buffers[0].host_shm_name);
  b->set_size_bytes(spec.buffers[0].size_bytes);
  for (const LayerView& l : spec.layers) {
    auto* out = req.add_layers();
    for (int plane = 0; plane < 2; ++plane) {
      const TensorView& in = plane == 0 ? l.k : *l.v;
      v1::TensorView* t = plane == 0 ? out->mutable_k() : out->mutable_v();
      t->set_buffer(in.buffer);
      t->set_offset_bytes(in.offset_bytes);
      t->set_row_stride_bytes(in.row_stride_bytes);
      t->set_num_rows(in.num_rows);
    }
  }
  auto raw_register = [&] {
    grpc::ClientContext ctx;
    session->Attach(&ctx);
    v1::RegisterPoolResponse resp;
    return stub->RegisterPool(&ctx, req, &resp);
  };
  grpc::Status own = raw_register();
  ASSERT_TRUE(own.ok()) << "control: by name, own object: " << own.error_message();

  const int fd = ::shm_open(kv->shm().name().c_str(), O_RDWR | O_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchown(fd, 61001, 61001), 0);
  ::close(fd);
  grpc::Status foreign = raw_register();
  EXPECT_FALSE(foreign.ok()) << "the daemon opened another uid's object by name";
  EXPECT_NE(foreign.error_message().find("buffers[0]"), std::string::npos)
      << foreign.error_message();

  // Through the client, which opens the name itself (root may) and passes the fd.
  auto h = client->RegisterPool(spec);
  ASSERT_TRUE(h.ok()) << "a named object was not passed by fd: " << h.status().ToString();
  const auto keys = it::Keys(79, 1, 16);
  it::FillRows(*kv, 79, it::RowRange(0, 16), 16);
  EXPECT_EQ(client->Backup(*h, keys, it::RowRange(0, 16)).held(), 1u);
}

// A restarted daemon forgets the session: the client opens a new one and registers again.
TEST(DaemonRestartSessionTest, ClientReopensTheSessionAfterARestart) {
  DaemonProcess d("32MiB");
  ASSERT_TRUE(d.Start());
  auto client = it::Connect(d.target());
  ASSERT_NE(client, nullptr);
  it::PoolOptions o;
  o.model = "session-restart";
  o.geometry = it::Geom(2, 2, 64);
  o.num_rows = 64;
  auto p = it::MakePool(*client, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  d.Kill();
  ASSERT_TRUE(d.Start());
  const auto keys = it::Keys(78, 1, 16);
  const auto rows = it::RowRange(0, 16);
  it::FillRows(p->kv, 78, rows, 16);
  bool stored = it::Eventually([&] { return client->Backup(p->handle, keys, rows).held() == 1; },
                               std::chrono::seconds(5));
  EXPECT_TRUE(stored) << "no backup after the restart";
  auto info = client->PoolInfo(p->handle);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  auto s = client->GetStats();
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  size_t owned = 0;
  for (const PoolStats& ps : s->pools) owned += ps.owned;
  EXPECT_EQ(owned, 1u) << it::StatsText(*s);
}

}  // namespace
}  // namespace hiqcache
#endif  // HIQ_DAEMON_PATH
