// Helpers shared by the daemon-core unit tests (tests/server): Status assertions, an anonymous
// mapping to serve as the L2 pool, and 16-byte block keys. Header-only; not thread-safe.
#pragma once

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "hiqcache/status.h"
#include "pool/block_store.h"

#define HIQ_EXPECT_OK(expr)                                           \
  do {                                                                \
    const ::hiqcache::Status hiq_st_ = (expr);                        \
    EXPECT_TRUE(hiq_st_.ok()) << #expr << ": " << hiq_st_.ToString(); \
  } while (0)
#define HIQ_ASSERT_OK(expr)                                           \
  do {                                                                \
    const ::hiqcache::Status hiq_st_ = (expr);                        \
    ASSERT_TRUE(hiq_st_.ok()) << #expr << ": " << hiq_st_.ToString(); \
  } while (0)

namespace hiqcache::server::testing {

// A zero-filled, page-aligned anonymous mapping. Pages are committed only when touched, so a
// large pool of which the store writes only headers costs little memory.
class AnonBuffer {
 public:
  explicit AnonBuffer(size_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~AnonBuffer() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }
  AnonBuffer(const AnonBuffer&) = delete;
  AnonBuffer& operator=(const AnonBuffer&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

// Key i: distinct for distinct (i, salt), deterministic.
inline BlockKey KeyOf(uint64_t i, uint64_t salt = 0) {
  BlockKey k{};
  uint64_t a = i * 0x9E3779B97F4A7C15ull + 1;
  uint64_t b = salt ^ 0xD1B54A32D192ED03ull;
  std::memcpy(k.data(), &a, 8);
  std::memcpy(k.data() + 8, &b, 8);
  return k;
}

inline std::string KeyString(uint64_t i, uint64_t salt = 0) {
  BlockKey k = KeyOf(i, salt);
  return std::string(reinterpret_cast<const char*>(k.data()), k.size());
}

}  // namespace hiqcache::server::testing
