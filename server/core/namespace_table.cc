#include "core/namespace_table.h"

#include <cstdio>

#include "hiqcache/xxh3.h"

namespace hiqcache::server {
namespace {

// Ids stay below the block store's ids for namespaces a rebuild found (its kFirstOrphanId).
constexpr uint32_t kIdLimit = 0x80000000u;

}  // namespace

std::string NamespaceDesc::CanonicalText() const {
  const auto& row = layout.row;
  std::string text = "v1";
  // Length-prefixed: no model/tenant pair can spell another's text.
  text += ";model=" + std::to_string(model.size()) + ":" + model;
  text += ";tenant=" + std::to_string(tenant.size()) + ":" + tenant;
  text += ";layers=" + std::to_string(layout.num_layers);
  text += ";heads=" + std::to_string(row.num_heads);
  text += ";dim=" + std::to_string(row.head_dim);
  text += row.dtype == kernels::DType::kBF16 ? ";dtype=bf16" : ";dtype=fp16";
  text += mla ? ";attn=mla" : ";attn=mha";
  // MLA latent rows are identical on every TP rank: one copy per node.
  if (!mla) text += ";tp=" + std::to_string(tp_rank) + "/" + std::to_string(tp_size);
  text += ";block=" + std::to_string(layout.block_tokens);
  text += std::string(";codec=") + kernels::CodecTextName(row.codec);
  // The rope belongs to a namespace only where its codec turns keys by it: the other codecs'
  // text (and hash) is that of daemons before geometry.rope, so their warm pools stay readable.
  if (row.IsAllot()) {
    if (row.rope_theta == 0) {
      text += ";rope=none";
    } else {
      char theta[32];  // %.17g: every double spelled exactly, so no two thetas share a text
      std::snprintf(theta, sizeof(theta), "%.17g", row.rope_theta);
      text += std::string(";rope=") + theta;
    }
    if (row.rope_interleaved) text += ",interleaved";
  }
  // Node scope adds nothing: its text (and hash) is that of daemons before scopes, so their warm
  // pools stay readable with namespace_scope = node.
  if (!scope.empty()) text += ";scope=" + std::to_string(scope.size()) + ":" + scope;
  return text;
}

namespace {

NamespaceHash HashOfText(const std::string& text) {
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, XXH3_128bits(text.data(), text.size()));
  std::array<uint8_t, 16> hash;
  for (int i = 0; i < 16; ++i) hash[i] = canon.digest[i];
  return hash;
}

}  // namespace

NamespaceHash NamespaceDesc::Hash() const { return HashOfText(CanonicalText()); }

NamespaceTable::Entry& NamespaceTable::InternLocked(const NamespaceDesc& desc) {
  std::string text = desc.CanonicalText();
  auto it = by_text_.find(text);
  if (it != by_text_.end()) return by_id_.at(it->second);
  // Monotonic ids (wrapping, skipping live ones): a removed namespace's id names nothing else
  // for a long while, so a lookup racing a removal finds no other namespace's blocks.
  while (by_id_.count(next_id_) != 0) next_id_ = (next_id_ + 1) % kIdLimit;
  const uint32_t id = next_id_;
  next_id_ = (next_id_ + 1) % kIdLimit;
  auto info = std::make_shared<NamespaceInfo>();
  info->id = id;
  info->desc = desc;
  info->hash = HashOfText(text);
  char hex[33];
  for (int i = 0; i < 16; ++i) std::snprintf(hex + 2 * i, 3, "%02x", info->hash[i]);
  info->hex_id = hex;
  by_text_.emplace(text, id);
  Entry& e = by_id_[id];
  e.info = std::move(info);
  e.text = std::move(text);
  return e;
}

StoreNamespace NamespaceInfo::ForStore() const {
  StoreNamespace out;
  out.id = id;
  out.hash = hash;
  out.payload_bytes = desc.layout.BlockBytes();
  out.text = desc.CanonicalText();
  out.owner = desc.scope;
  return out;
}

const NamespaceInfo& NamespaceTable::Intern(const NamespaceDesc& desc) {
  MutexLock lock(&mu_);
  return *InternLocked(desc).info;
}

std::shared_ptr<const NamespaceInfo> NamespaceTable::Acquire(const NamespaceDesc& desc) {
  MutexLock lock(&mu_);
  Entry& e = InternLocked(desc);
  ++e.uses;
  return e.info;
}

bool NamespaceTable::Release(uint32_t id, const std::function<bool(uint32_t)>& forget) {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return true;
  if (it->second.uses > 0) --it->second.uses;
  if (it->second.uses > 0 || !forget(id)) return false;
  by_text_.erase(it->second.text);
  by_id_.erase(it);
  return true;
}

std::shared_ptr<const NamespaceInfo> NamespaceTable::RemoveIfUnused(
    uint32_t id, const std::function<bool(uint32_t)>& forget) {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) {
    (void)forget(id);
    return nullptr;
  }
  if (it->second.uses > 0 || !forget(id)) return nullptr;
  std::shared_ptr<const NamespaceInfo> gone = std::move(it->second.info);
  by_text_.erase(it->second.text);
  by_id_.erase(it);
  return gone;
}

std::shared_ptr<const NamespaceInfo> NamespaceTable::Find(const NamespaceDesc& desc) const {
  const std::string text = desc.CanonicalText();
  MutexLock lock(&mu_);
  auto it = by_text_.find(text);
  return it == by_text_.end() ? nullptr : by_id_.at(it->second).info;
}

const NamespaceInfo& NamespaceTable::Get(uint32_t id) const {
  MutexLock lock(&mu_);
  return *by_id_.at(id).info;
}

std::vector<std::shared_ptr<const NamespaceInfo>> NamespaceTable::All() const {
  MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const NamespaceInfo>> out;
  out.reserve(by_id_.size());
  // In id order: creation order until ids wrap.
  std::map<uint32_t, const Entry*> ordered;
  for (const auto& [id, e] : by_id_) ordered.emplace(id, &e);
  for (const auto& [id, e] : ordered) out.push_back(e->info);
  return out;
}

size_t NamespaceTable::size() const {
  MutexLock lock(&mu_);
  return by_id_.size();
}

uint32_t NamespaceTable::Uses(uint32_t id) const {
  MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? 0 : it->second.uses;
}

}  // namespace hiqcache::server
