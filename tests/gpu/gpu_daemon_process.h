// integration/daemon_process.h for the GPU tests, which start hiqcached --device cuda: the daemon
// binary is $HIQ_DAEMON_PATH when set (binaries carried to another machine, see
// tests/gpu/DEVELOPERS.md), else the one this build made (HIQ_DAEMON_BUILD_PATH, set by
// tests/gpu/CMakeLists.txt). Include it instead of daemon_process.h. Header-only.
#pragma once

#include <cstdlib>

namespace hiqcache {
inline const char* GpuTestDaemonPath() {
  const char* env = std::getenv("HIQ_DAEMON_PATH");
  return env != nullptr && env[0] != '\0' ? env : HIQ_DAEMON_BUILD_PATH;
}
}  // namespace hiqcache

#define HIQ_DAEMON_PATH ::hiqcache::GpuTestDaemonPath()
#include "integration/daemon_process.h"
