// SessionListener: the kernel's credentials of a connecting process become its Caller, fds sent
// with SCM_RIGHTS are held under ids until taken, malformed or oversized messages are answered
// ERR without changing the session, other uids get no admin right, and a closed connection ends
// the session (its fds closed, on_end called once) within a fraction of a second.
#include "transport/session_listener.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "hiqcache/session_protocol.h"
#include "time_margin.h"

namespace hiqcache::server {
namespace {

using namespace std::chrono_literals;

std::string TempSocketPath(const char* tag) {
  return "/tmp/hiq-sl-" + std::to_string(::getpid()) + "-" + tag + ".session";
}

int Connect(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;  // connect's
    return -1;
  }
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

std::string Recv(int fd) {
  char buf[4096];
  ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// "key=value" of a greeting.
std::string Field(const std::string& greeting, const std::string& key) {
  std::istringstream in(greeting);
  std::string word;
  while (in >> word) {
    if (word.rfind(key + "=", 0) == 0) return word.substr(key.size() + 1);
  }
  return {};
}

std::string SendFds(int sock, const std::vector<int>& fds, const std::string& text = "FDS") {
  iovec iov{const_cast<char*>(text.data()), text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(fds.size(), 1)));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  if (::sendmsg(sock, &msg, MSG_NOSIGNAL) < 0) return "sendmsg failed";
  return Recv(sock);
}

struct Ends {
  std::mutex mu;
  std::vector<uint64_t> ids;
  void Add(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    ids.push_back(id);
  }
  size_t Count(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<size_t>(std::count(ids.begin(), ids.end(), id));
  }
};

class SessionListenerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = TempSocketPath(::testing::UnitTest::GetInstance()->current_test_info()->name());
    SessionOptions options;
    options.socket_mode = 0666;
    options.max_sessions_per_uid = 4;
    auto started = SessionListener::Start({path_}, options, [this](uint64_t id) { ends_.Add(id); });
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    listener_ = std::move(started).value();
  }
  void TearDown() override { listener_.reset(); }

  // Waits until `pred` holds, at most the margin of 10 s (test_time::Margin).
  template <typename Pred>
  bool Eventually(Pred pred) {
    auto until = std::chrono::steady_clock::now() + test_time::Margin(10s);
    while (!pred()) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(5ms);
    }
    return true;
  }

  std::string path_;
  Ends ends_;
  std::unique_ptr<SessionListener> listener_;
};

TEST_F(SessionListenerTest, GreetingCarriesTheKernelsCredentialsAndTheTokenAuthenticates) {
  int sock = Connect(path_);
  ASSERT_GE(sock, 0);
  const std::string greeting = Recv(sock);
  ASSERT_EQ(greeting.rfind(std::string(kSessionGreeting), 0), 0u) << greeting;
  EXPECT_EQ(Field(greeting, "pid"), std::to_string(::getpid()));
  EXPECT_EQ(Field(greeting, "uid"), std::to_string(::getuid()));
  EXPECT_EQ(Field(greeting, "gid"), std::to_string(::getgid()));
  const std::string token = Field(greeting, "token");
  ASSERT_EQ(token.size(), 32u);

  Caller c = listener_->Authenticate(token);
  EXPECT_TRUE(c.authenticated());
  EXPECT_EQ(c.pid, static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(c.uid, ::getuid());
  EXPECT_EQ(c.admin, ::getuid() == 0 || ::getuid() == ::geteuid());
  EXPECT_FALSE(listener_->Authenticate(std::string(32, '0')).authenticated());
  EXPECT_FALSE(listener_->Authenticate("").authenticated());
  ::close(sock);
}

TEST_F(SessionListenerTest, FdsAreHeldUnderIdsUntilTakenAndClosedWhenTheSessionEnds) {
  int sock = Connect(path_);
  ASSERT_GE(sock, 0);
  const std::string token = Field(Recv(sock), "token");
  const Caller c = listener_->Authenticate(token);
  int a = ::memfd_create("hiq-test-a", MFD_CLOEXEC);
  int b = ::memfd_create("hiq-test-b", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(a, 4096), 0);
  const std::string reply = SendFds(sock, {a, b});
  ASSERT_EQ(reply, "OK 1 2");
  // The daemon's copy of `a` is the same file: what one writes the other reads.
  {
    SessionListener::TakenFds taken = listener_->TakeFds(c.session, {1, 7});
    const int mine = taken.Get(1);
    ASSERT_GE(mine, 0);
    EXPECT_EQ(taken.Get(7), -1);  // never sent
    ASSERT_EQ(::pwrite(a, "hiq", 3, 0), 3);
    char got[3] = {};
    ASSERT_EQ(::pread(mine, got, 3, 0), 3);
    EXPECT_EQ(std::string(got, 3), "hiq");
  }
  // Taken once: a second take of the same id finds nothing.
  EXPECT_EQ(listener_->TakeFds(c.session, {1}).Get(1), -1);
  // Another session cannot take this session's fds.
  int other = Connect(path_);
  const Caller oc = listener_->Authenticate(Field(Recv(other), "token"));
  EXPECT_EQ(listener_->TakeFds(oc.session, {2}).Get(2), -1);

  ::close(sock);
  ASSERT_TRUE(Eventually([&] { return ends_.Count(c.session) == 1; }));
  EXPECT_FALSE(listener_->Authenticate(token).authenticated());
  EXPECT_EQ(listener_->TakeFds(c.session, {2}).Get(2), -1);
  EXPECT_EQ(ends_.Count(oc.session), 0u);
  ::close(other);
  ::close(a);
  ::close(b);
}

TEST_F(SessionListenerTest, MalformedAndOversizedMessagesAreRefusedAndTheirFdsClosed) {
  int sock = Connect(path_);
  ASSERT_GE(sock, 0);
  const Caller c = listener_->Authenticate(Field(Recv(sock), "token"));
  int fd = ::memfd_create("hiq-test", MFD_CLOEXEC);
  EXPECT_EQ(SendFds(sock, {fd}, "GIVE").rfind("ERR ", 0), 0u);
  EXPECT_EQ(SendFds(sock, {}, "FDS").rfind("ERR ", 0), 0u);
  // 17 fds in one message: more than the daemon accepts; the session stays usable.
  std::vector<int> many(kMaxFdsPerMessage + 1, fd);
  EXPECT_EQ(SendFds(sock, many).rfind("ERR ", 0), 0u);
  EXPECT_EQ(SendFds(sock, {fd}), "OK 1");
  // Beyond the per-session bound of unconsumed fds.
  std::vector<int> batch(kMaxFdsPerMessage, fd);
  std::string last;
  for (size_t i = 0; i < kMaxHeldFdsPerSession / kMaxFdsPerMessage + 1; ++i) {
    last = SendFds(sock, batch);
  }
  EXPECT_EQ(last.rfind("ERR ", 0), 0u) << last;
  // What was accepted is still there.
  EXPECT_GE(listener_->TakeFds(c.session, {1}).Get(1), 0);
  ::close(fd);
  ::close(sock);
}

// A bound listener's socket file exists with its mode but refuses connections (as when no
// daemon runs) until Open: the daemon opens it only once its services serve.
TEST(SessionListenerOpen, ABoundListenerRefusesConnectionsUntilOpen) {
  const std::string path = TempSocketPath("open");
  SessionOptions options;
  options.socket_mode = 0600;
  auto listener = SessionListener::Bind({path}, options, [](uint64_t) {});
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  struct stat st;
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(Connect(path), -1);
  EXPECT_EQ(errno, ECONNREFUSED);
  ASSERT_TRUE((*listener)->Open().ok());
  EXPECT_FALSE((*listener)->Open().ok()) << "a second Open";
  int sock = Connect(path);
  ASSERT_GE(sock, 0);
  EXPECT_FALSE(Field(Recv(sock), "token").empty());
  ::close(sock);
  listener->reset();
  EXPECT_NE(::lstat(path.c_str(), &st), 0) << "the socket file outlives its listener";
}

TEST(SessionListenerBounds, TheSessionsOfOneUidHoldBoundedFds) {
  const std::string path = TempSocketPath("uidfds");
  SessionOptions options;
  options.max_held_fds_per_uid = 40;
  auto listener = SessionListener::Start({path}, options, [](uint64_t) {});
  ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  int a = Connect(path), b = Connect(path);
  const Caller ca = (*listener)->Authenticate(Field(Recv(a), "token"));
  (void)Recv(b);
  int fd = ::memfd_create("hiq-test", MFD_CLOEXEC);
  std::vector<int> batch(16, fd);
  EXPECT_EQ(SendFds(a, batch).rfind("OK ", 0), 0u);
  EXPECT_EQ(SendFds(b, batch).rfind("OK ", 0), 0u);
  // 48 > 40: the uid's third batch is refused, whichever session sends it.
  EXPECT_EQ(SendFds(b, batch).rfind("ERR ", 0), 0u);
  // Taking fds (a RegisterPool consumed them) gives room back.
  std::vector<uint64_t> ids;
  for (uint64_t i = 1; i <= 16; ++i) ids.push_back(i);
  EXPECT_GE((*listener)->TakeFds(ca.session, ids).Get(16), 0);
  EXPECT_EQ(SendFds(b, batch).rfind("OK ", 0), 0u);
  ::close(fd);
  ::close(a);
  ::close(b);
}

TEST_F(SessionListenerTest, AnotherUidIsNoAdminAndSessionsPerUidAreBounded) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to act as another uid";
  // A child of another uid connects and reports its greeting through a pipe.
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(pipefd[0]);
    if (::setresgid(61001, 61001, 61001) != 0 || ::setresuid(61001, 61001, 61001) != 0) _exit(2);
    int s = Connect(path_);
    std::string g = s >= 0 ? Recv(s) : "connect failed";
    (void)!::write(pipefd[1], g.data(), g.size());
    ::close(pipefd[1]);
    char x;
    (void)!::read(s, &x, 1);  // hold the session until the parent closes the pipe... or 5 s
    _exit(0);
  }
  ::close(pipefd[1]);
  char buf[512];
  ssize_t n = ::read(pipefd[0], buf, sizeof(buf));
  ASSERT_GT(n, 0);
  const std::string greeting(buf, static_cast<size_t>(n));
  EXPECT_EQ(Field(greeting, "uid"), "61001") << greeting;
  EXPECT_EQ(Field(greeting, "pid"), std::to_string(child));
  const Caller c = listener_->Authenticate(Field(greeting, "token"));
  EXPECT_TRUE(c.authenticated());
  EXPECT_EQ(c.uid, 61001u);
  EXPECT_FALSE(c.admin);
  ::kill(child, SIGKILL);
  int status;
  ::waitpid(child, &status, 0);
  // The kernel closed the child's socket: its session ends.
  EXPECT_TRUE(Eventually([&] { return ends_.Count(c.session) == 1; }));
  ::close(pipefd[0]);

  // max_sessions_per_uid = 4: a fifth connection of this uid is answered ERR and closed.
  std::vector<int> socks;
  for (int i = 0; i < 4; ++i) {
    socks.push_back(Connect(path_));
    EXPECT_EQ(Recv(socks.back()).rfind(std::string(kSessionGreeting), 0), 0u);
  }
  int fifth = Connect(path_);
  EXPECT_EQ(Recv(fifth).rfind("ERR ", 0), 0u);
  ::close(fifth);
  for (int s : socks) ::close(s);
}

}  // namespace
}  // namespace hiqcache::server
