// The GPU tests' second process: a test re-executes its own binary (/proc/self/exe) with a gtest
// filter that selects the child half, because a process cannot open its own CUDA IPC handles
// (STYLE.md 10). posix_spawn, not fork: the parent uses gRPC and CUDA. Header-only; the functions
// are thread-compatible (they read `environ`; do not setenv concurrently).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace hiqcache::gpu_test {

// What the test process tells a child through its environment (HIQ_GPU_CHILD_*): the daemon to
// connect to, a directory for marker files, a data seed, the child's rank among several, and a
// shm object they share ("" for none).
struct ChildEnv {
  std::string target, dir, shm;
  uint64_t seed = 0;
  uint32_t role = 0;
  bool ok = false;  // GetChildEnv found target, dir and seed: this process is a child

  // "VAR=value" strings for SpawnSelf.
  std::vector<std::string> Vars() const {
    std::vector<std::string> vars = {"HIQ_GPU_CHILD_TARGET=" + target, "HIQ_GPU_CHILD_DIR=" + dir,
                                     "HIQ_GPU_CHILD_SEED=" + std::to_string(seed),
                                     "HIQ_GPU_CHILD_ROLE=" + std::to_string(role)};
    if (!shm.empty()) vars.push_back("HIQ_GPU_CHILD_SHM=" + shm);
    return vars;
  }
};

// This process's ChildEnv; ok is false in the test process itself.
inline ChildEnv GetChildEnv() {
  ChildEnv env;
  const char* target = std::getenv("HIQ_GPU_CHILD_TARGET");
  const char* dir = std::getenv("HIQ_GPU_CHILD_DIR");
  const char* seed = std::getenv("HIQ_GPU_CHILD_SEED");
  if (target == nullptr || dir == nullptr || seed == nullptr) return env;
  env.target = target;
  env.dir = dir;
  env.seed = std::strtoull(seed, nullptr, 10);
  if (const char* role = std::getenv("HIQ_GPU_CHILD_ROLE")) env.role = std::atoi(role);
  if (const char* shm = std::getenv("HIQ_GPU_CHILD_SHM")) env.shm = shm;
  env.ok = true;
  return env;
}

// Creates the (empty) marker file `path`: how a child tells the test process it got to the end.
inline void Touch(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
  if (fd >= 0) ::close(fd);
}

// Starts this binary again with `--gtest_filter=<gtest_filter>` and this process's environment
// plus `extra_env` ("VAR=value", appended). Returns the child's pid, or -1 (with a failed
// EXPECT naming the posix_spawn error) when it could not start.
inline pid_t SpawnSelf(const std::string& gtest_filter,
                       const std::vector<std::string>& extra_env = {}) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.insert(env_strings.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=" + gtest_filter;
  char* argv[] = {exe.data(), filter.data(), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data());
  EXPECT_EQ(rc, 0) << "posix_spawn: " << std::strerror(rc);
  return rc == 0 ? pid : -1;
}

// The exit status of child `pid` (128 + signal when a signal ended it), or -1 when it has not
// exited within `timeout`, after killing and reaping it.
inline int WaitChild(pid_t pid, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

// Whether child `pid` (a daemon this process started) is still running; reaps it if it exited.
inline bool ChildAlive(pid_t pid) {
  int status;
  return pid > 0 && ::waitpid(pid, &status, WNOHANG) == 0;
}

}  // namespace hiqcache::gpu_test
