#include "hiqcache/log.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace hiqcache {
namespace log_internal {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}

void SetLogLevel(LogLevel level) {
  log_internal::g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

LogLevel GetLogLevel() {
  return static_cast<LogLevel>(log_internal::g_level.load(std::memory_order_relaxed));
}

bool ParseLogLevel(const std::string& text, LogLevel* level) {
  if (text == "debug")
    *level = LogLevel::kDebug;
  else if (text == "info")
    *level = LogLevel::kInfo;
  else if (text == "warn" || text == "warning")
    *level = LogLevel::kWarn;
  else if (text == "error")
    *level = LogLevel::kError;
  else
    return false;
  return true;
}

namespace {

// True when stderr is connected to the systemd journal ($JOURNAL_STREAM names its device and
// inode): lines then carry a syslog priority prefix and no timestamp of their own.
bool StderrIsJournal() {
  static const bool journal = [] {
    const char* env = std::getenv("JOURNAL_STREAM");
    if (env == nullptr) return false;
    unsigned long long dev = 0, ino = 0;
    if (std::sscanf(env, "%llu:%llu", &dev, &ino) != 2) return false;
    struct stat st;
    if (::fstat(STDERR_FILENO, &st) != 0) return false;
    return static_cast<unsigned long long>(st.st_dev) == dev &&
           static_cast<unsigned long long>(st.st_ino) == ino;
  }();
  return journal;
}

}  // namespace

LogMessage::LogMessage(LogLevel level, const char* file, int line) {
  static const char kLetters[] = {'D', 'I', 'W', 'E'};
  const char* base = std::strrchr(file, '/');
  if (StderrIsJournal()) {
    static const char* kPriority[] = {"<7>", "<6>", "<4>", "<3>"};
    stream_ << kPriority[static_cast<int>(level)] << "src=" << (base ? base + 1 : file) << ':'
            << line << ' ';
    return;
  }
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  auto micros =
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() %
      1000000;
  std::tm tm;
  gmtime_r(&secs, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%m%d %H:%M:%S", &tm);
  char frac[8];
  std::snprintf(frac, sizeof(frac), ".%06ld", static_cast<long>(micros));
  stream_ << kLetters[static_cast<int>(level)] << stamp << frac << ' ' << (base ? base + 1 : file)
          << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  std::string text = stream_.str();
  ssize_t ignored = ::write(STDERR_FILENO, text.data(), text.size());
  (void)ignored;
}

}  // namespace hiqcache
