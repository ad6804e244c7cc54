// Namespaces: the unit of block sharing (DESIGN.md "Namespaces").
//
// A namespace is (model, tenant, geometry, tp_rank, tp_size, block_tokens, codec); MLA drops the
// TP fields because every rank holds the same latent rows. Two registrations with equal
// descriptors get the same namespace and therefore share blocks. Ids are small integers inside
// the daemon and a 128-bit hash (hex) on the wire. Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "record_format.h"

namespace hiqcache::server {

// An id no namespace has: stands for a namespace that no pool registered (it holds no block).
inline constexpr uint32_t kNoNamespace = UINT32_MAX;

struct NamespaceDesc {
  std::string model;
  std::string tenant;
  kernels::BlockLayout layout;
  bool mla = false;
  uint32_t tp_rank = 0;
  uint32_t tp_size = 1;

  // Canonical text of every field that defines the namespace.
  std::string CanonicalText() const;
  // XXH3-128 of CanonicalText(): the namespace's id on the wire and in the pool's extent headers,
  // by which a restarted daemon's store recognizes the namespace's blocks (block_store.h).
  std::array<uint8_t, 16> Hash() const;
};

struct NamespaceInfo {
  uint32_t id = 0;
  NamespaceDesc desc;
  std::array<uint8_t, 16> hash{};
  std::string hex_id;  // 32 hex digits of `hash`
};

class NamespaceTable {
 public:
  // Returns the namespace for `desc`, creating it on first use.
  const NamespaceInfo& Intern(const NamespaceDesc& desc);
  // The namespace for `desc` if Intern has created it, else null. Never creates one: lookups of
  // namespaces nobody registered cost no memory (CacheCore interns a looked-up namespace only
  // when the pool holds blocks of it that a previous daemon stored).
  const NamespaceInfo* Find(const NamespaceDesc& desc) const;
  // REQUIRES: id was returned by Intern.
  const NamespaceInfo& Get(uint32_t id) const;
  std::vector<const NamespaceInfo*> All() const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint32_t> by_text_;               // GUARDED_BY(mu_)
  std::vector<std::unique_ptr<NamespaceInfo>> by_id_;      // GUARDED_BY(mu_); stable addresses
};

}  // namespace hiqcache::server
