// Namespaces: the unit of block sharing (docs/design.md "Namespaces").
//
// A namespace is (model, tenant, geometry, tp_rank, tp_size, block_tokens, codec) within a scope
// (who may share it: every caller of the node, or one uid); MLA drops the TP fields because every
// rank holds the same latent rows. Two registrations with equal descriptors get the same
// namespace and therefore share blocks. Ids are small integers inside the daemon and a 128-bit
// hash (hex) on the wire.
//
// Lifetime: a namespace lives while a use (Acquire: a registered pool) holds it, and after its
// last use goes until its keeper (CacheCore) removes it, which it does once the block store holds
// no block of it (Release, RemoveIfUnused). Ids are not reused until 2^31 namespaces later, so a
// stale id names no other namespace. NamespaceInfo objects are shared: one outlives its removal
// from the table while anything still holds it. Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "hiqcache/block_id.h"
#include "hiqcache/mutex.h"
#include "pool/block_store.h"
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
  // Who shares the namespace. Empty: every caller of the node (namespace_scope = node; the
  // canonical text, and so the hash, of daemons before scopes existed). Otherwise a caller's
  // scope ("uid:1000", or "anonymous" for callers without a session), part of the canonical
  // text: blocks never flow between scopes, and a warm restart still finds a scope's blocks.
  std::string scope;

  // Canonical text of every field that defines the namespace.
  std::string CanonicalText() const;
  // XXH3-128 of CanonicalText(): the namespace's id on the wire and in the pool's extent headers,
  // by which a restarted daemon's store recognizes the namespace's blocks (block_store.h).
  NamespaceHash Hash() const;
};

struct NamespaceInfo {
  uint32_t id = 0;
  NamespaceDesc desc;
  NamespaceHash hash{};
  std::string hex_id;  // 32 hex digits of `hash`
  // What the block store keeps of it.
  StoreNamespace ForStore() const;
};

class NamespaceTable {
 public:
  // Returns the namespace for `desc`, creating it on first use (with no use: see Acquire). The
  // reference stays valid until the namespace is removed.
  const NamespaceInfo& Intern(const NamespaceDesc& desc);
  // Intern, and counts a use of the namespace (a pool): it is not removed until Release.
  std::shared_ptr<const NamespaceInfo> Acquire(const NamespaceDesc& desc);
  // Ends a use taken by Acquire. When it was the last one, calls `forget(id)` (under the table's
  // lock, so no Acquire of the namespace can race it) and removes the namespace when that returns
  // true (the block store held no block of it and forgot it). Returns whether it was removed.
  bool Release(uint32_t id, const std::function<bool(uint32_t)>& forget);
  // Removes namespace `id` when no use holds it and `forget(id)` returns true (called under the
  // table's lock). An id the table does not know is only passed to `forget` (a store entry left
  // by a namespace the table already dropped). Returns the namespace removed, or null.
  std::shared_ptr<const NamespaceInfo> RemoveIfUnused(uint32_t id,
                                                      const std::function<bool(uint32_t)>& forget);
  // The namespace for `desc` if it exists, else null. Never creates one: lookups of namespaces
  // nobody registered cost no memory (CacheCore interns a looked-up namespace only when the pool
  // holds blocks of it that a previous daemon stored).
  std::shared_ptr<const NamespaceInfo> Find(const NamespaceDesc& desc) const;
  // REQUIRES: id was returned by Intern and the namespace was not removed since.
  const NamespaceInfo& Get(uint32_t id) const;
  std::vector<std::shared_ptr<const NamespaceInfo>> All() const;
  // Namespaces in the table now.
  size_t size() const;
  // Uses (Acquire without Release) of namespace `id`; 0 for an unknown id.
  uint32_t Uses(uint32_t id) const;

 private:
  struct Entry {
    std::shared_ptr<NamespaceInfo> info;
    std::string text;  // canonical text: the by_text_ key
    uint32_t uses = 0;
  };
  Entry& InternLocked(const NamespaceDesc& desc) REQUIRES(mu_);

  mutable Mutex mu_;
  std::map<std::string, uint32_t> by_text_ GUARDED_BY(mu_);
  std::unordered_map<uint32_t, Entry> by_id_ GUARDED_BY(mu_);
  uint32_t next_id_ GUARDED_BY(mu_) = 0;
};

}  // namespace hiqcache::server
