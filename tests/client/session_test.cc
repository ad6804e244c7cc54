// hiqcache::Session against a scripted SOCK_SEQPACKET listener (session_protocol.h): greeting
// parsing, fd passing in messages of at most kMaxFdsPerMessage, refusals, timeouts and the
// daemon going away.
#include "hiqcache/session.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hiqcache/session_protocol.h"

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
    dir_ = "/tmp/hiq-session-test-" + std::to_string(::getpid()) + "-" +
           std::to_string(counter++);
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
  for (const char* g : {"HELLO 1 token=ab pid=1 uid=0 gid=0", "HIQ-SESSION 1 pid=1 uid=0 gid=0",
                        "HIQ-SESSION 1 token=ab pid=x uid=0 gid=0",
                        "HIQ-SESSION 1 token=ab pid=1 uid=99999999999 gid=0",
                        "HIQ-SESSION 2 token=ab pid=1"}) {
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
  EXPECT_LT(took, milliseconds(2000));
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
  for (const Case& c : {Case{"ERR FDS: this session would hold 257 unconsumed fds, at most 256",
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
