#include "transport/peer_placement.h"

#include <cctype>
#include <fstream>
#include <sstream>
#include <vector>

namespace hiqcache::server {
namespace {

std::string ReadFile(const std::string& path, bool* ok) {
  std::ifstream in(path);
  *ok = static_cast<bool>(in);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool IsHex(char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; }

// The pod uid in one path component: "pod<uuid>" (cgroupfs driver) or "...-pod<uuid>.slice"
// (systemd driver, '-' written as '_'); "" when the component names none.
std::string PodUid(const std::string& component) {
  size_t at = component.rfind("pod");
  if (at == std::string::npos) return "";
  if (at != 0 && component[at - 1] != '-') return "";
  std::string uid = component.substr(at + 3);
  if (uid.size() >= 6 && uid.compare(uid.size() - 6, 6, ".slice") == 0) {
    uid.resize(uid.size() - 6);
  }
  if (uid.size() != 36) return "";
  for (size_t i = 0; i < uid.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash) {
      if (uid[i] != '-' && uid[i] != '_') return "";
      uid[i] = '-';
    } else if (!IsHex(uid[i])) {
      return "";
    }
  }
  return uid;
}

}  // namespace

std::string PodOfCgroup(const std::string& cgroup, bool in_container) {
  std::string unified, first;
  std::istringstream lines(cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string path = line.substr(b + 1);
    if (line.compare(0, b + 1, "0::") == 0) unified = path;
    if (first.empty() && path != "/") first = path;
    std::istringstream parts(path);
    std::string component;
    while (std::getline(parts, component, '/')) {
      std::string uid = PodUid(component);
      if (!uid.empty()) return "k8s-pod:" + uid;
    }
  }
  if (!in_container) return "";
  const std::string& path = unified.empty() || unified == "/" ? first : unified;
  return "cgroup:" + (path.empty() ? std::string("/") : path);
}

PeerPlacement PlacementOf(pid_t pid) {
  PeerPlacement p;
  if (pid <= 0) return p;
  const std::string dir = "/proc/" + std::to_string(pid);
  bool ok = false;
  const std::string status = ReadFile(dir + "/status", &ok);
  if (!ok) return p;
  const size_t at = status.find("\nNSpid:");
  if (at == std::string::npos) return p;
  std::istringstream ns(status.substr(at + 7, status.find('\n', at + 1) - at - 7));
  std::vector<long> pids;
  for (long v; ns >> v;) pids.push_back(v);
  if (pids.empty()) return p;
  const std::string cgroup = ReadFile(dir + "/cgroup", &ok);
  if (!ok) return p;
  p.known = true;
  p.in_container = pids.size() > 1;
  p.pod = PodOfCgroup(cgroup, p.in_container);
  return p;
}

}  // namespace hiqcache::server
