// FakeManager: a bound SOCK_DGRAM socket standing in for systemd's service manager in the
// deploy tests (receives what sd_notify sends). Header-only; one instance per test.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>

namespace hiqcache::deploy_test {

using std::chrono::milliseconds;

class FakeManager {
 public:
  // `address`: a path, or "@name" for the abstract namespace.
  explicit FakeManager(std::string address) : address_(std::move(address)) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, address_.data(), address_.size());
    socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address_.size());
    if (address_[0] == '@') {
      sa.sun_path[0] = '\0';
    } else {
      ::unlink(address_.c_str());
      len += 1;
    }
    bound_ = ::bind(fd_, reinterpret_cast<sockaddr*>(&sa), len) == 0;
  }
  ~FakeManager() {
    ::close(fd_);
    if (address_[0] == '/') ::unlink(address_.c_str());
  }
  bool bound() const { return bound_; }
  const std::string& address() const { return address_; }

  // The next datagram, or "" after `timeout`.
  std::string Receive(milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return "";
    char buf[4096];
    ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  }

 private:
  std::string address_;
  int fd_ = -1;
  bool bound_ = false;
};

}  // namespace hiqcache::deploy_test
