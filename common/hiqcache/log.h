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

// `text` as a log line may show it: bytes outside printable ASCII, backslash and double quote
// become \xNN escapes, and it is cut at 256 bytes. Every string a client chose (model, tenant,
// shm names, peers) goes through this before it reaches a log line, so that no client can forge
// or break log lines (newlines, terminal escapes).
inline std::string LogSafe(const std::string& text) {
  static const char* kHex = "0123456789abcdef";
  constexpr size_t kMax = 256;
  std::string out;
  out.reserve(text.size() < kMax ? text.size() : kMax);
  for (size_t i = 0; i < text.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '"') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (text.size() > kMax) out += "...";
  return out;
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

#define HIQ_LOG(level)                                                \
  (static_cast<int>(HIQ_LOG_LEVEL_##level) <                          \
   ::hiqcache::log_internal::g_level.load(std::memory_order_relaxed)) \
      ? (void)0                                                       \
      : ::hiqcache::log_internal::Voidify() &                         \
            ::hiqcache::LogMessage(HIQ_LOG_LEVEL_##level, __FILE__, __LINE__).stream()
