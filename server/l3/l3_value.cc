#include "l3_value.h"

#include <xxhash.h>

#include <cstddef>
#include <cstring>

namespace hiqcache::server::l3 {
namespace {

constexpr size_t kHeaderCheckedBytes = offsetof(L3ValueHeader, header_checksum);

std::string Hex(const uint8_t* p, size_t n) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out += kHex[p[i] >> 4];
    out += kHex[p[i] & 15];
  }
  return out;
}

}  // namespace

uint64_t L3Checksum(std::span<const uint8_t> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string L3Key(std::string_view prefix, const NamespaceHash& ns, const L3BlockKey& key) {
  std::string out(prefix);
  out += Hex(ns.data(), ns.size());
  out += ':';
  out += Hex(key.data(), key.size());
  return out;
}

void EncodeL3ValueInto(const NamespaceHash& ns, const L3BlockKey& key,
                       std::span<const uint8_t> payload, uint64_t payload_checksum,
                       std::string* out) {
  L3ValueHeader h{};
  h.magic = kL3ValueMagic;
  h.version = kL3ValueVersion;
  h.header_bytes = kL3ValueHeaderBytes;
  std::memcpy(h.namespace_hash, ns.data(), ns.size());
  std::memcpy(h.key, key.data(), key.size());
  h.payload_bytes = payload.size();
  h.payload_checksum = payload_checksum;
  h.header_checksum = XXH3_64bits(&h, kHeaderCheckedBytes);
  // A buffer of this size already (reused) is not filled first: header and payload overwrite it.
  out->resize(kL3ValueHeaderBytes + payload.size());
  std::memcpy(out->data(), &h, sizeof(h));
  if (!payload.empty()) std::memcpy(out->data() + sizeof(h), payload.data(), payload.size());
}

std::string EncodeL3Value(const NamespaceHash& ns, const L3BlockKey& key,
                          std::span<const uint8_t> payload, uint64_t payload_checksum) {
  std::string out;
  EncodeL3ValueInto(ns, key, payload, payload_checksum, &out);
  return out;
}

std::string EncodeL3Value(const NamespaceHash& ns, const L3BlockKey& key,
                          std::span<const uint8_t> payload) {
  return EncodeL3Value(ns, key, payload, L3Checksum(payload));
}

StatusOr<std::span<const uint8_t>> DecodeL3Value(std::string_view value, const NamespaceHash& ns,
                                                 const L3BlockKey& key,
                                                 uint64_t expected_payload_bytes) {
  if (value.size() < kL3ValueHeaderBytes) {
    return DataLoss("l3 value: " + std::to_string(value.size()) +
                    " bytes, shorter than its 64-byte header (truncated)");
  }
  L3ValueHeader h;
  std::memcpy(&h, value.data(), sizeof(h));
  if (h.magic != kL3ValueMagic) return DataLoss("l3 value: bad magic (not an hiqcache block)");
  if (h.version != kL3ValueVersion || h.header_bytes != kL3ValueHeaderBytes) {
    return FailedPrecondition("l3 value: unsupported version " + std::to_string(h.version) +
                              " (header " + std::to_string(h.header_bytes) + " bytes)");
  }
  if (XXH3_64bits(&h, kHeaderCheckedBytes) != h.header_checksum) {
    return DataLoss("l3 value: header checksum mismatch (corrupt header)");
  }
  if (std::memcmp(h.namespace_hash, ns.data(), ns.size()) != 0) {
    return DataLoss("l3 value: written for namespace " + Hex(h.namespace_hash, 16) +
                    ", expected " + Hex(ns.data(), ns.size()) + " (foreign namespace)");
  }
  if (std::memcmp(h.key, key.data(), key.size()) != 0) {
    return DataLoss("l3 value: written for key " + Hex(h.key, 16) + ", expected " +
                    Hex(key.data(), key.size()) + " (foreign key)");
  }
  const uint64_t have = value.size() - kL3ValueHeaderBytes;
  if (h.payload_bytes != have) {
    return DataLoss("l3 value: header says " + std::to_string(h.payload_bytes) +
                    " payload bytes, value holds " + std::to_string(have) +
                    (have < h.payload_bytes ? " (truncated)" : " (trailing bytes)"));
  }
  if (expected_payload_bytes != 0 && h.payload_bytes != expected_payload_bytes) {
    return DataLoss("l3 value: " + std::to_string(h.payload_bytes) +
                    " payload bytes, the namespace's blocks have " +
                    std::to_string(expected_payload_bytes));
  }
  std::span<const uint8_t> payload(reinterpret_cast<const uint8_t*>(value.data()) + sizeof(h),
                                   have);
  if (L3Checksum(payload) != h.payload_checksum) {
    return DataLoss("l3 value: payload checksum mismatch (corrupt payload)");
  }
  return payload;
}

}  // namespace hiqcache::server::l3
