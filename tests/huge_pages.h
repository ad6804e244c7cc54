// What the machine offers a memfd that asks for huge pages, read from the kernel independently of
// the client library, for tests that must pass with and without huge pages (CI has none: its
// vm.nr_hugepages is 0 and its shmem_enabled never). Tests never change these settings; a test
// that needs hugetlb pages skips when none are free. Header-only; thread-compatible.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace hiqcache::machine {

// A field of /proc/meminfo ("HugePages_Free", "Hugepagesize"), as its number (kB for sizes); 0
// when missing.
inline uint64_t MeminfoField(const std::string& field) {
  std::ifstream in("/proc/meminfo");
  std::string name;
  uint64_t value = 0;
  std::string rest;
  while (in >> name >> value) {
    std::getline(in, rest);
    if (name == field + ":") return value;
  }
  return 0;
}

// The default huge page size in bytes (what MFD_HUGETLB gets).
inline uint64_t HugePageBytes() { return MeminfoField("Hugepagesize") * 1024; }

// Bytes of default-size hugetlb pages free and not reserved: what a new MFD_HUGETLB memfd can
// reserve now (another process may take them first).
inline uint64_t HugetlbAvailableBytes() {
  const uint64_t free = MeminfoField("HugePages_Free");
  const uint64_t reserved = MeminfoField("HugePages_Rsvd");
  return free > reserved ? (free - reserved) * HugePageBytes() : 0;
}

// The selected value of /sys/kernel/mm/transparent_hugepage/shmem_enabled ("" when unreadable).
inline std::string ShmemThpSetting() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string word;
  while (in >> word) {
    if (word.size() > 2 && word.front() == '[' && word.back() == ']') {
      return word.substr(1, word.size() - 2);
    }
  }
  return {};
}

// Whether shmem honours MADV_HUGEPAGE (or backs shmem with huge pages without it).
inline bool ShmemThpHonoursAdvice() {
  const std::string v = ShmemThpSetting();
  return v == "advise" || v == "within_size" || v == "always" || v == "force";
}

}  // namespace hiqcache::machine
