// The GPU tests' second process: a test re-executes its own binary (/proc/self/exe) with a gtest
// filter that selects the child half, because a process cannot open its own CUDA IPC handles
// (STYLE.md 10). posix_spawn, not fork: the parent uses gRPC and CUDA. Header-only; the functions
// are thread-compatible (they read `environ`; do not setenv concurrently).
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace hiqcache::gpu_test {

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
