// Minimal leveled logging to stderr for the daemon and tools.
//
// HIQ_LOG(INFO) << "..."; levels DEBUG < INFO < WARN < ERROR. The level is process-wide
// (SetLogLevel), read with a relaxed atomic so a disabled statement costs one load and a branch.
// Thread-safe: each statement is formatted into its own buffer and written with one write(2).
#pragma once

#include <atomic>
#include <sstream>
#include <string>

namespace hiqcache {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug", "info", "warn", "error"; returns false on anything else.
bool ParseLogLevel(const std::string& text, LogLevel* level);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

namespace log_internal {
extern std::atomic<int> g_level;
}

}  // namespace hiqcache

#define HIQ_LOG_LEVEL_DEBUG ::hiqcache::LogLevel::kDebug
#define HIQ_LOG_LEVEL_INFO ::hiqcache::LogLevel::kInfo
#define HIQ_LOG_LEVEL_WARN ::hiqcache::LogLevel::kWarn
#define HIQ_LOG_LEVEL_ERROR ::hiqcache::LogLevel::kError

namespace hiqcache::log_internal {
// Turns `stream << ...` into void so that HIQ_LOG is one expression (safe inside an unbraced if).
struct Voidify {
  void operator&(std::ostream&) {}
};
}  // namespace hiqcache::log_internal

#define HIQ_LOG(level)                                                               \
  (static_cast<int>(HIQ_LOG_LEVEL_##level) <                                         \
   ::hiqcache::log_internal::g_level.load(std::memory_order_relaxed))                \
      ? (void)0                                                                      \
      : ::hiqcache::log_internal::Voidify() &                                        \
            ::hiqcache::LogMessage(HIQ_LOG_LEVEL_##level, __FILE__, __LINE__).stream()
