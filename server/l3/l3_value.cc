#include "l3/l3_value.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <cstddef>
#include <cstring>

#include "hiqcache/xxh3.h"

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

// HMAC-SHA-256 of `header` then `payload` under `key` into `tag` (OpenSSL 3's EVP_MAC); false
// (and a zero tag) when OpenSSL fails.
bool Mac(const std::string& key, const void* header, std::span<const uint8_t> payload,
         uint8_t tag[kL3MacBytes]) {
  static EVP_MAC* const hmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  EVP_MAC_CTX* ctx = hmac != nullptr ? EVP_MAC_CTX_new(hmac) : nullptr;
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                               OSSL_PARAM_construct_end()};
  size_t len = 0;
  const bool ok =
      ctx != nullptr &&
      EVP_MAC_init(ctx, reinterpret_cast<const unsigned char*>(key.data()), key.size(), params) ==
          1 &&
      EVP_MAC_update(ctx, static_cast<const unsigned char*>(header), kL3ValueHeaderBytes) == 1 &&
      EVP_MAC_update(ctx, payload.data(), payload.size()) == 1 &&
      EVP_MAC_final(ctx, tag, &len, kL3MacBytes) == 1 && len == kL3MacBytes;
  EVP_MAC_CTX_free(ctx);
  if (!ok) std::memset(tag, 0, kL3MacBytes);
  return ok;
}

}  // namespace

uint64_t L3Checksum(std::span<const uint8_t> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string L3Key(std::string_view prefix, const NamespaceHash& ns, const BlockKey& key) {
  std::string out(prefix);
  out += Hex(ns.data(), ns.size());
  out += ':';
  out += Hex(key.data(), key.size());
  return out;
}

void EncodeL3ValueInto(const NamespaceHash& ns, const BlockKey& key,
                       std::span<const uint8_t> payload, uint64_t payload_checksum,
                       std::string* out, const L3MacKeys* mac) {
  const size_t trailer = L3TrailerBytes(mac);
  L3ValueHeader h{};
  h.magic = kL3ValueMagic;
  h.version = trailer != 0 ? kL3ValueVersionMac : kL3ValueVersion;
  h.header_bytes = kL3ValueHeaderBytes;
  std::memcpy(h.namespace_hash, ns.data(), ns.size());
  std::memcpy(h.key, key.data(), key.size());
  h.payload_bytes = payload.size();
  h.payload_checksum = payload_checksum;
  h.header_checksum = XXH3_64bits(&h, kHeaderCheckedBytes);
  // A buffer of this size already (reused) is not filled first: header and payload overwrite it.
  out->resize(kL3ValueHeaderBytes + payload.size() + trailer);
  std::memcpy(out->data(), &h, sizeof(h));
  if (!payload.empty()) std::memcpy(out->data() + sizeof(h), payload.data(), payload.size());
  if (trailer != 0) {
    Mac(mac->current, &h, payload,
        reinterpret_cast<uint8_t*>(out->data()) + sizeof(h) + payload.size());
  }
}

std::string EncodeL3Value(const NamespaceHash& ns, const BlockKey& key,
                          std::span<const uint8_t> payload, uint64_t payload_checksum) {
  std::string out;
  EncodeL3ValueInto(ns, key, payload, payload_checksum, &out);
  return out;
}

std::string EncodeL3Value(const NamespaceHash& ns, const BlockKey& key,
                          std::span<const uint8_t> payload) {
  return EncodeL3Value(ns, key, payload, L3Checksum(payload));
}

StatusOr<std::span<const uint8_t>> DecodeL3Value(std::string_view value, const NamespaceHash& ns,
                                                 const BlockKey& key,
                                                 uint64_t expected_payload_bytes,
                                                 const L3MacKeys* mac) {
  if (value.size() < kL3ValueHeaderBytes) {
    return DataLoss("l3 value: " + std::to_string(value.size()) +
                    " bytes, shorter than its 64-byte header (truncated)");
  }
  L3ValueHeader h;
  std::memcpy(&h, value.data(), sizeof(h));
  if (h.magic != kL3ValueMagic) return DataLoss("l3 value: bad magic (not an hiqcache block)");
  if ((h.version != kL3ValueVersion && h.version != kL3ValueVersionMac) ||
      h.header_bytes != kL3ValueHeaderBytes) {
    return FailedPrecondition("l3 value: unsupported version " + std::to_string(h.version) +
                              " (header " + std::to_string(h.header_bytes) + " bytes)");
  }
  const bool keyed = mac != nullptr && mac->enabled();
  if (h.version == kL3ValueVersion && keyed) {
    return PermissionDenied(
        "l3 value: not authenticated (version 1, written by a daemon without l3_mac_key_file)");
  }
  if (h.version == kL3ValueVersionMac && !keyed) {
    return PermissionDenied(
        "l3 value: authenticated with a MAC key this daemon does not hold (l3_mac_key_file)");
  }
  const size_t trailer = keyed ? kL3MacBytes : 0;
  if (XXH3_64bits(&h, kHeaderCheckedBytes) != h.header_checksum) {
    return DataLoss("l3 value: header checksum mismatch (corrupt header)");
  }
  if (std::memcmp(h.namespace_hash, ns.data(), ns.size()) != 0) {
    return DataLoss("l3 value: written for namespace " + Hex(h.namespace_hash, 16) + ", expected " +
                    Hex(ns.data(), ns.size()) + " (foreign namespace)");
  }
  if (std::memcmp(h.key, key.data(), key.size()) != 0) {
    return DataLoss("l3 value: written for key " + Hex(h.key, 16) + ", expected " +
                    Hex(key.data(), key.size()) + " (foreign key)");
  }
  if (value.size() < kL3ValueHeaderBytes + trailer) {
    return DataLoss("l3 value: too short for its MAC (truncated)");
  }
  const uint64_t have = value.size() - kL3ValueHeaderBytes - trailer;
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
  if (keyed) {
    const uint8_t* tag = payload.data() + have;
    uint8_t want[kL3MacBytes];
    bool verified = false;
    for (const std::string* k : {&mac->current, &mac->previous}) {
      if (k->empty()) continue;
      verified |=
          Mac(*k, value.data(), payload, want) && CRYPTO_memcmp(want, tag, kL3MacBytes) == 0;
    }
    if (!verified) {
      return PermissionDenied(
          "l3 value: MAC mismatch (not written by a daemon holding the fleet's key)");
    }
  }
  if (L3Checksum(payload) != h.payload_checksum) {
    return DataLoss("l3 value: payload checksum mismatch (corrupt payload)");
  }
  return payload;
}

}  // namespace hiqcache::server::l3
