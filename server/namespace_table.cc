#include "namespace_table.h"

#include <xxhash.h>

#include <cstdio>

namespace hiqcache::server {

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
  text += row.codec == kernels::CodecKind::kRaw ? ";codec=raw" : ";codec=int8_per_head";
  return text;
}

namespace {

std::array<uint8_t, 16> HashOfText(const std::string& text) {
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, XXH3_128bits(text.data(), text.size()));
  std::array<uint8_t, 16> hash;
  for (int i = 0; i < 16; ++i) hash[i] = canon.digest[i];
  return hash;
}

}  // namespace

std::array<uint8_t, 16> NamespaceDesc::Hash() const { return HashOfText(CanonicalText()); }

const NamespaceInfo& NamespaceTable::Intern(const NamespaceDesc& desc) {
  std::string text = desc.CanonicalText();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_text_.find(text);
  if (it != by_text_.end()) return *by_id_[it->second];
  auto info = std::make_unique<NamespaceInfo>();
  info->id = static_cast<uint32_t>(by_id_.size());
  info->desc = desc;
  info->hash = HashOfText(text);
  char hex[33];
  for (int i = 0; i < 16; ++i) std::snprintf(hex + 2 * i, 3, "%02x", info->hash[i]);
  info->hex_id = hex;
  by_text_.emplace(std::move(text), info->id);
  by_id_.push_back(std::move(info));
  return *by_id_.back();
}

const NamespaceInfo* NamespaceTable::Find(const NamespaceDesc& desc) const {
  const std::string text = desc.CanonicalText();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_text_.find(text);
  return it == by_text_.end() ? nullptr : by_id_[it->second].get();
}

const NamespaceInfo& NamespaceTable::Get(uint32_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return *by_id_.at(id);
}

std::vector<const NamespaceInfo*> NamespaceTable::All() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const NamespaceInfo*> out;
  for (const auto& p : by_id_) out.push_back(p.get());
  return out;
}

}  // namespace hiqcache::server
