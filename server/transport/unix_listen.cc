#include "transport/unix_listen.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace hiqcache::server {

StatusOr<int> BindUnix(const std::string& path, int type, mode_t mode, gid_t gid) {
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.size() >= sizeof(sa.sun_path)) {
    return InvalidArgument("listen: socket path " + path + " is longer than " +
                           std::to_string(sizeof(sa.sun_path) - 1) + " bytes");
  }
  std::memcpy(sa.sun_path, path.data(), path.size());
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return FailedPrecondition("listen: " + path + " exists and is not a socket");
    }
    ::unlink(path.c_str());
  }
  int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Internal("socket " + path + ": " + std::strerror(errno));
  const mode_t saved = ::umask(0177);
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  ::umask(saved);
  if (rc != 0) {
    std::string why = std::strerror(errno);
    ::close(fd);
    return FailedPrecondition("bind: " + path + ": " + why);
  }
  auto fail = [&](const std::string& why) {
    ::close(fd);
    ::unlink(path.c_str());
    return FailedPrecondition(why + ": " + std::strerror(errno));
  };
  if (gid != static_cast<gid_t>(-1) && ::chown(path.c_str(), -1, gid) != 0) {
    return fail("socket_group: chown " + path);
  }
  if (::chmod(path.c_str(), mode) != 0) return fail("socket_mode: chmod " + path);
  return fd;
}

StatusOr<int> ListenUnix(const std::string& path, int type, int backlog, mode_t mode, gid_t gid) {
  HIQ_ASSIGN_OR_RETURN(int fd, BindUnix(path, type, mode, gid));
  if (::listen(fd, backlog) != 0) {
    std::string why = std::strerror(errno);
    ::close(fd);
    ::unlink(path.c_str());
    return FailedPrecondition("listen: " + path + ": " + why);
  }
  return fd;
}

}  // namespace hiqcache::server
