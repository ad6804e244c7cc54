// FlagReader: the command-line walk shared by the bench programs (hiq_demo, replay_bench).
// Accepts `--name VALUE` and `--name=VALUE`. Header-only; not thread-safe.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

namespace hiqcache::bench {

class FlagReader {
 public:
  FlagReader(int argc, char** argv) : argc_(argc), argv_(argv) {}

  // Moves to the next argument; false when none is left.
  bool Next() {
    if (++i_ >= argc_) return false;
    name_ = argv_[i_];
    inline_ = false;
    if (const size_t eq = name_.find('='); name_.starts_with("--") && eq != std::string::npos) {
      inline_value_ = name_.substr(eq + 1);
      name_ = name_.substr(0, eq);
      inline_ = true;
    }
    return true;
  }
  // The flag's name (the text before '=' for --name=VALUE).
  const std::string& name() const { return name_; }
  // The flag's value: after '=' or the next argument (consumed). False when there is none.
  bool Value(std::string* out) {
    if (inline_) {
      *out = inline_value_;
      return true;
    }
    if (i_ + 1 >= argc_) return false;
    *out = argv_[++i_];
    return true;
  }
  // The value as a uint32 (decimal, whole text); `text` receives it as written.
  bool U32(uint32_t* out, std::string* text) {
    if (!Value(text)) return false;
    char* end = nullptr;
    const unsigned long long x = std::strtoull(text->c_str(), &end, 10);
    if (end == text->c_str() || *end != '\0' || x > UINT32_MAX) return false;
    *out = static_cast<uint32_t>(x);
    return true;
  }

 private:
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string name_;
  std::string inline_value_;
  bool inline_ = false;
};

}  // namespace hiqcache::bench
