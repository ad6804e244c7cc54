// Where a caller runs, as the kernel tells the daemon through /proc/<pid> of its session's
// SO_PEERCRED pid: whether it is inside a container (a pid namespace below the daemon's), and
// which pod or container it belongs to. The daemon sees the pids of engines in containers only
// when it shares the host's pid namespace (the DaemonSet's hostPID: true, or a systemd service).
#pragma once

#include <sys/types.h>

#include <string>

namespace hiqcache::server {

struct PeerPlacement {
  // /proc/<pid> was readable: the caller runs in the daemon's pid namespace or below it.
  bool known = false;
  // Its NSpid lists more than one pid: it runs in a pid namespace below the daemon's (a
  // container), where uid 0 is no proof of being the node's root.
  bool in_container = false;
  // Its isolation unit beyond the uid: "k8s-pod:<pod uid>" when a component of its cgroup path
  // names a Kubernetes pod (kubepods/.../pod<uid>/, or kubepods-...-pod<uid>.slice), else
  // "cgroup:<path>" inside a container, else "" (a process of the host itself).
  std::string pod;
};

// `pid` as seen from the daemon's pid namespace; 0 (a peer outside it) gives known = false.
PeerPlacement PlacementOf(pid_t pid);

// The pod of the cgroup file text `cgroup` (/proc/<pid>/cgroup) for a process `in_container`
// or not: PeerPlacement::pod's rule, without reading /proc (unit-tested on texts).
std::string PodOfCgroup(const std::string& cgroup, bool in_container);

}  // namespace hiqcache::server
