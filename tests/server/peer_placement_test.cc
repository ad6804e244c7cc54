// peer_placement.h: a caller's pod from its /proc/<pid>/cgroup text, for the layouts engines run
// in (Kubernetes with either cgroup driver, cgroup v1 and v2, plain containers, host processes),
// and this test process's own placement.
#include "transport/peer_placement.h"

#include <gtest/gtest.h>
#include <unistd.h>

namespace hiqcache::server {
namespace {

constexpr const char* kPod = "0a1b2c3d-1111-2222-3333-444455556666";

TEST(PodOfCgroupTest, KubernetesPodsWithEitherDriverAndCgroupVersion) {
  // cgroup v2, systemd driver ('-' in the uid written as '_').
  EXPECT_EQ(PodOfCgroup("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-"
                        "pod0a1b2c3d_1111_2222_3333_444455556666.slice/"
                        "cri-containerd-7f3e.scope\n",
                        true),
            std::string("k8s-pod:") + kPod);
  // cgroup v2, cgroupfs driver; two containers of one pod are one pod.
  const std::string a =
      PodOfCgroup("0::/kubepods/burstable/pod0a1b2c3d-1111-2222-3333-444455556666/aaaa\n", true);
  const std::string b =
      PodOfCgroup("0::/kubepods/burstable/pod0a1b2c3d-1111-2222-3333-444455556666/bbbb\n", true);
  EXPECT_EQ(a, std::string("k8s-pod:") + kPod);
  EXPECT_EQ(a, b);
  // cgroup v1: the pod is found on any controller's line; the pid namespace does not matter.
  EXPECT_EQ(PodOfCgroup("12:pids:/kubepods/besteffort/pod0a1b2c3d-1111-2222-3333-444455556666/c\n"
                        "1:name=systemd:/kubepods/besteffort/"
                        "pod0a1b2c3d-1111-2222-3333-444455556666/c\n",
                        false),
            std::string("k8s-pod:") + kPod);
  // Another pod is another scope.
  EXPECT_NE(PodOfCgroup("0::/kubepods/burstable/pod0a1b2c3d-1111-2222-3333-444455556667/a\n", true),
            a);
}

TEST(PodOfCgroupTest, ContainersOutsideKubernetesAndHostProcesses) {
  EXPECT_EQ(PodOfCgroup("0::/system.slice/docker-4f2a.scope\n", true),
            "cgroup:/system.slice/docker-4f2a.scope");
  // A host process (not in a container) shares by uid: no pod.
  EXPECT_EQ(PodOfCgroup("0::/user.slice/user-1000.slice/session-3.scope\n", false), "");
  // Names that only look like a pod are not one.
  EXPECT_EQ(PodOfCgroup("0::/podcast/pod123/xpod0a1b2c3d-1111-2222-3333-444455556666\n", false),
            "");
  // cgroup v1 without a unified line, in a container: the first non-root path.
  EXPECT_EQ(PodOfCgroup("4:memory:/lxc/box1\n3:pids:/lxc/box1\n", true), "cgroup:/lxc/box1");
  EXPECT_EQ(PodOfCgroup("", true), "cgroup:/");
}

TEST(PlacementOfTest, ThisProcessAndPidsTheDaemonCannotSee) {
  const PeerPlacement self = PlacementOf(::getpid());
  EXPECT_TRUE(self.known);
  EXPECT_FALSE(PlacementOf(0).known);  // SO_PEERCRED's pid of a peer outside our pid namespace
  EXPECT_FALSE(PlacementOf(-1).known);
}

}  // namespace
}  // namespace hiqcache::server
