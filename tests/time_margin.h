// Time margins of the tests: how long a test waits before it takes a call for hung, a wake-up
// for missed, or a wait for a wait on another, longer timeout. Speed is measured by the
// benchmarks (bench/), as ratios to a baseline of the same run; a test asserts an outcome, and
// where that outcome is "returned in time" it asserts Margin(base): a base duration chosen to
// hold on a 2-core machine at load 8 (every core busy with something else), times TimeScale().
// A contract's own bound (e.g. "within 1 s") stays in the assertion's message.
//
// TimeScale() is kSanitizerTimeFactor in a sanitizer build (ASan, TSan: -O1 code 2-10x slower),
// else 1, times HIQ_TEST_TIME_SCALE when that is set (a positive number, e.g. 3 on a slower
// machine). A malformed HIQ_TEST_TIME_SCALE ends the test binary with a message. Header-only;
// thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace hiqcache::test_time {

// Whether this binary (and so the daemon of its build directory) runs under a sanitizer.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

inline constexpr double kSanitizerTimeFactor = 4;

inline double TimeScale() {
  static const double scale = [] {
    double s = kSanitized ? kSanitizerTimeFactor : 1.0;
    const char* env = std::getenv("HIQ_TEST_TIME_SCALE");
    if (env != nullptr && *env != '\0') {
      char* end = nullptr;
      const double v = std::strtod(env, &end);
      if (end == env || *end != '\0' || !(v > 0) || v > 1000) {
        std::fprintf(stderr, "HIQ_TEST_TIME_SCALE=%s: want a positive number (at most 1000)\n",
                     env);
        std::exit(2);
      }
      s *= v;
    }
    return s;
  }();
  return scale;
}

// `base` times TimeScale().
template <class Rep, class Period>
std::chrono::milliseconds Margin(std::chrono::duration<Rep, Period> base) {
  const double ms = std::chrono::duration<double, std::milli>(base).count() * TimeScale();
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

}  // namespace hiqcache::test_time
