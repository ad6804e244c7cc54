#include "hiqcache/socket_trust.h"

#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

namespace hiqcache {
namespace {

std::string ModeText(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

bool OthersMayWrite(const struct stat& st) { return (st.st_mode & (S_IWGRP | S_IWOTH)) != 0; }

bool Contains(const std::vector<uint32_t>& v, uint32_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// HIQ_DAEMON_UID: unset or empty = none; a number; or a user name.
StatusOr<int64_t> ConfiguredDaemonUid() {
  const char* env = std::getenv(kDaemonUidEnv);
  if (env == nullptr || env[0] == '\0') return int64_t{-1};
  const std::string v(env);
  if (v.find_first_not_of("0123456789") == std::string::npos) {
    if (v.size() > 10 || std::stoull(v) > UINT32_MAX - 1) {
      return InvalidArgument(std::string(kDaemonUidEnv) + "=" + v + ": not a uid");
    }
    return static_cast<int64_t>(std::stoull(v));
  }
  std::vector<char> buf(16384);
  struct passwd pw;
  struct passwd* found = nullptr;
  if (::getpwnam_r(v.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    return InvalidArgument(std::string(kDaemonUidEnv) + "=" + v + ": no such user");
  }
  return static_cast<int64_t>(found->pw_uid);
}

std::string Parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

StatusOr<std::vector<uint32_t>> TrustedDaemonUids(const std::string& socket_path) {
  HIQ_ASSIGN_OR_RETURN(int64_t configured, ConfiguredDaemonUid());
  std::vector<uint32_t> trusted = {0, static_cast<uint32_t>(::geteuid())};
  if (configured >= 0) trusted.push_back(static_cast<uint32_t>(configured));

  // The directory as the kernel will resolve it (symlinks followed, so a link planted in /tmp
  // is judged by where it points).
  char real[PATH_MAX];
  if (::realpath(Parent(socket_path).c_str(), real) == nullptr) {
    return Unavailable("socket directory of " + socket_path + ": " + std::strerror(errno));
  }
  const std::string dir(real);
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Unavailable("socket directory " + dir + ": not a directory");
  }
  const std::string why_env =
      std::string("; if that is your hiqcached, set ") + kDaemonUidEnv + " to its uid";
  if (OthersMayWrite(st)) {
    return PermissionDenied("socket directory " + dir + " (owner uid " + std::to_string(st.st_uid) +
                            ", mode " + ModeText(st.st_mode) +
                            ") is writable by group or others, so anyone could have put the "
                            "socket there: hiqcached is not trusted with this process's memory");
  }
  if (Contains(trusted, st.st_uid)) return trusted;
  struct stat parent;
  const std::string up = Parent(dir);
  if (::stat(up.c_str(), &parent) == 0 && parent.st_uid == 0 && !OthersMayWrite(parent)) {
    trusted.push_back(st.st_uid);  // only root could have made `dir` and chosen its owner
    return trusted;
  }
  return PermissionDenied(
      "socket directory " + dir + " belongs to uid " + std::to_string(st.st_uid) +
      ", which is not root, this process's uid or " + kDaemonUidEnv + ", and its parent " + up +
      " may be written by others (anyone could have created it first): "
      "hiqcached is not trusted with this process's memory" +
      why_env);
}

Status CheckSocketOwner(const std::string& socket_path, const std::vector<uint32_t>& trusted) {
  struct stat st;
  if (::stat(socket_path.c_str(), &st) != 0) return Status::Ok();
  if (Contains(trusted, st.st_uid)) return Status::Ok();
  return PermissionDenied("socket " + socket_path + " belongs to uid " + std::to_string(st.st_uid) +
                          ", which is not a trusted hiqcached (root, this process's uid, " +
                          kDaemonUidEnv + " or the owner of its directory)");
}

Status CheckPeerUid(int fd, const std::vector<uint32_t>& trusted, const std::string& path) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return PermissionDenied("session " + path + ": SO_PEERCRED: " + std::strerror(errno) +
                            ": cannot tell who listens");
  }
  if (Contains(trusted, cred.uid)) return Status::Ok();
  return PermissionDenied("session " + path + ": the listener runs as uid " +
                          std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
                          "), which is not a trusted hiqcached (root, this process's uid, " +
                          kDaemonUidEnv + " or the owner of the socket's directory)");
}

Status CheckOwnSocketDirectory(const std::string& dir, uid_t uid) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return FailedPrecondition("listen: socket directory " + dir + ": " + std::strerror(errno));
  }
  if (!S_ISDIR(st.st_mode)) {
    return FailedPrecondition("listen: socket directory " + dir + " is not a directory");
  }
  if (st.st_uid != uid) {
    return FailedPrecondition("listen: socket directory " + dir + " belongs to uid " +
                              std::to_string(st.st_uid) + ", not to hiqcached (uid " +
                              std::to_string(uid) +
                              "): whoever owns it could replace the socket; use a directory "
                              "hiqcached owns (e.g. systemd's RuntimeDirectory)");
  }
  if (OthersMayWrite(st)) {
    return FailedPrecondition("listen: socket directory " + dir + " (mode " + ModeText(st.st_mode) +
                              ") is writable by group or others, who could replace the socket; "
                              "clients refuse such a directory too: chmod go-w it or use "
                              "another");
  }
  return Status::Ok();
}

}  // namespace hiqcache
