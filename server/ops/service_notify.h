// ServiceNotifier: the systemd readiness protocol (sd_notify(3)) without libsystemd, so that
// hiqcached runs as a Type=notify service (deploy/hiqcached.service).
//
// The service manager passes $NOTIFY_SOCKET (a filesystem path, or "@name" for an abstract
// socket); each state change is one datagram of newline-separated VAR=VALUE lines ("READY=1",
// "STATUS=...", "STOPPING=1", "WATCHDOG=1"). With $WATCHDOG_USEC set (and $WATCHDOG_PID unset or
// our pid) StartWatchdog() sends WATCHDOG=1 every WATCHDOG_USEC/2 from its own thread, while an
// optional liveness probe answers true. Without $NOTIFY_SOCKET every call is a no-op, so the
// daemon behaves the same outside systemd. Thread-safe: Notify may be called from any thread.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <thread>

#include "hiqcache/mutex.h"
#include "hiqcache/status.h"

namespace hiqcache::server {

class ServiceNotifier {
 public:
  // Reads $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID. The environment is left as it is.
  static ServiceNotifier FromEnvironment();
  // For tests: an explicit socket address ("" = disabled) and watchdog interval (0 = none).
  ServiceNotifier(std::string socket, std::chrono::microseconds watchdog);
  // Stops the watchdog thread.
  ~ServiceNotifier();
  ServiceNotifier(const ServiceNotifier&) = delete;
  ServiceNotifier& operator=(const ServiceNotifier&) = delete;

  bool enabled() const { return !socket_.empty(); }
  const std::string& socket() const { return socket_; }
  // The watchdog timeout the manager asked for; 0 when none.
  std::chrono::microseconds watchdog_timeout() const { return watchdog_; }

  // Sends `state` (one or more "VAR=VALUE" lines) as one datagram. OK and nothing sent when
  // disabled; an error when the socket cannot be reached (callers log it, nothing else fails).
  Status Notify(std::string_view state) const;
  Status Ready(std::string_view status) const;      // READY=1 + STATUS=
  Status SetStatus(std::string_view status) const;  // STATUS=
  Status Stopping(std::string_view status) const;   // STOPPING=1 + STATUS=

  // Starts pinging WATCHDOG=1 every watchdog_timeout()/2 while `alive` (if set) answers true:
  // a core that deadlocks stops the pings and the manager restarts the service. No-op when
  // disabled or no watchdog was requested. Call at most once.
  void StartWatchdog(std::function<bool()> alive = {});
  // Stops and joins the watchdog thread. Idempotent.
  void StopWatchdog();

 private:
  std::string socket_;
  std::chrono::microseconds watchdog_{0};

  Mutex mu_;
  CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread watchdog_thread_;
};

}  // namespace hiqcache::server
