// The L3 value format (server/l3/l3_value.h): round trip, and every way a fetched value can be
// wrong is rejected with an error that says which: corrupt payload or header, truncation,
// trailing bytes, foreign namespace or key, another version, an unexpected block size; with a
// fleet MAC key, a value not authenticated by it (forged with valid checksums, or unkeyed).
#include "l3/l3_value.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

// `text` contains `part` (the error names what failed).
#define EXPECT_CONTAINS(text, part)                              \
  do {                                                           \
    const std::string hiq_text_ = (text);                        \
    EXPECT_NE(hiq_text_.find(part), std::string::npos)           \
        << "\"" << hiq_text_ << "\" lacks \"" << (part) << "\""; \
  } while (0)

namespace hiqcache::server::l3 {
namespace {

NamespaceHash Ns(uint8_t v) {
  NamespaceHash h;
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint8_t>(v + i);
  return h;
}
BlockKey Key(uint8_t v) {
  BlockKey k;
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(v * 7 + i);
  return k;
}
std::vector<uint8_t> Payload(size_t n) {
  std::vector<uint8_t> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(i * 131 + 17);
  return p;
}

// The error of decoding `value` as block Key(2) of namespace Ns(1), or "" when it decodes.
std::string Why(const std::string& value, uint64_t expected = 0) {
  auto r = DecodeL3Value(value, Ns(1), Key(2), expected);
  return r.ok() ? "" : r.status().ToString();
}

TEST(L3ValueTest, RoundTrip) {
  const auto payload = Payload(4096);
  const std::string v = EncodeL3Value(Ns(1), Key(2), payload);
  ASSERT_EQ(v.size(), kL3ValueHeaderBytes + payload.size());
  auto r = DecodeL3Value(v, Ns(1), Key(2), payload.size());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), payload.size());
  EXPECT_EQ(std::memcmp(r->data(), payload.data(), payload.size()), 0);
  // The caller's checksum (the pool's block header) is the same function.
  EXPECT_EQ(EncodeL3Value(Ns(1), Key(2), payload, L3Checksum(payload)), v);
  // An empty payload is a valid value too.
  EXPECT_EQ(Why(EncodeL3Value(Ns(1), Key(2), {})), "");
}

L3MacKeys Keys(std::string current, std::string previous = "") {
  return L3MacKeys{std::move(current), std::move(previous)};
}
std::string WhyKeyed(const std::string& value, const L3MacKeys& mac) {
  auto r = DecodeL3Value(value, Ns(1), Key(2), 0, &mac);
  return r.ok() ? "" : r.status().ToString();
}

// A fleet key authenticates values: what a writer without it produces (valid XXH3 checksums
// included, even over a payload it changed) is refused, and so is a value a keyed daemon wrote
// for a daemon without the key; rotation accepts the previous key on reads only.
TEST(L3ValueTest, MacKeysAuthenticateValues) {
  const std::string key(32, 'k'), other(32, 'o'), next(40, 'n');
  const L3MacKeys mac = Keys(key);
  const auto payload = Payload(4096);
  std::string v;
  EncodeL3ValueInto(Ns(1), Key(2), payload, L3Checksum(payload), &v, &mac);
  ASSERT_EQ(v.size(), kL3ValueHeaderBytes + payload.size() + kL3MacBytes);
  L3ValueHeader h;
  std::memcpy(&h, v.data(), sizeof(h));
  EXPECT_EQ(h.version, kL3ValueVersionMac);
  auto r = DecodeL3Value(v, Ns(1), Key(2), payload.size(), &mac);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(std::memcmp(r->data(), payload.data(), payload.size()), 0);

  // Forged: an attacker plants another payload with correct checksums (v1, no key), or keeps
  // the tag and changes the payload and its checksum (v2), or signs with its own key.
  auto planted = Payload(4096);
  planted[100] ^= 0x5a;
  EXPECT_CONTAINS(WhyKeyed(EncodeL3Value(Ns(1), Key(2), planted), mac), "not authenticated");
  std::string tampered = v;
  tampered[kL3ValueHeaderBytes + 100] ^= 0x5a;
  L3ValueHeader th = h;
  th.payload_checksum = L3Checksum(planted);
  th.header_checksum = L3Checksum(std::span<const uint8_t>(
      reinterpret_cast<const uint8_t*>(&th), offsetof(L3ValueHeader, header_checksum)));
  std::memcpy(tampered.data(), &th, sizeof(th));
  EXPECT_CONTAINS(WhyKeyed(tampered, mac), "MAC mismatch");
  std::string foreign;
  const L3MacKeys theirs = Keys(other);
  EncodeL3ValueInto(Ns(1), Key(2), planted, L3Checksum(planted), &foreign, &theirs);
  EXPECT_CONTAINS(WhyKeyed(foreign, mac), "PERMISSION_DENIED: l3 value: MAC mismatch");
  // Truncated tag; a keyed value read by a daemon without a key.
  EXPECT_NE(WhyKeyed(v.substr(0, v.size() - 1), mac), "");
  EXPECT_CONTAINS(Why(v), "MAC key this daemon does not hold");

  // Rotation: the new key reads what the old one wrote only while it is the previous key.
  EXPECT_EQ(WhyKeyed(v, Keys(next, key)), "");
  EXPECT_CONTAINS(WhyKeyed(v, Keys(next)), "MAC mismatch");
  std::string rotated;
  const L3MacKeys after = Keys(next, key);
  EncodeL3ValueInto(Ns(1), Key(2), payload, L3Checksum(payload), &rotated, &after);
  EXPECT_EQ(WhyKeyed(rotated, Keys(next)), "");
  EXPECT_CONTAINS(WhyKeyed(rotated, mac), "MAC mismatch");  // the old key cannot read new values
}

TEST(L3ValueTest, KeyNamesNamespaceAndBlock) {
  const std::string k = L3Key("hiq:", Ns(1), Key(2));
  EXPECT_EQ(k.size(), 4 + 32 + 1 + 32);
  EXPECT_EQ(k.substr(0, 12), "hiq:01020304");
  EXPECT_EQ(k[36], ':');
  EXPECT_EQ(k.find('{'), std::string::npos);  // no hash tag: blocks spread over all slots
  EXPECT_NE(L3Key("hiq:", Ns(1), Key(3)), k);
  EXPECT_NE(L3Key("hiq:", Ns(9), Key(2)), k);
}

TEST(L3ValueTest, EveryCorruptPayloadByteIsRejected) {
  const auto payload = Payload(512);
  const std::string good = EncodeL3Value(Ns(1), Key(2), payload);
  for (size_t i = kL3ValueHeaderBytes; i < good.size(); i += 37) {
    std::string bad = good;
    bad[i] ^= 0x01;
    SCOPED_TRACE("byte " + std::to_string(i));
    EXPECT_CONTAINS(Why(bad), "payload checksum mismatch");
  }
}

TEST(L3ValueTest, EveryCorruptHeaderByteIsRejected) {
  const std::string good = EncodeL3Value(Ns(1), Key(2), Payload(100));
  for (size_t i = 0; i < kL3ValueHeaderBytes; ++i) {
    std::string bad = good;
    bad[i] ^= 0x40;
    EXPECT_NE(Why(bad), "") << "header byte " << i;
  }
  std::string bad = good;
  bad[40] ^= 0x40;  // payload_bytes: the header's own checksum catches it
  EXPECT_CONTAINS(Why(bad), "header checksum mismatch");
  bad = good;
  bad[0] ^= 0x40;
  EXPECT_CONTAINS(Why(bad), "bad magic");
}

TEST(L3ValueTest, TruncatedAndOversizedValuesAreRejected) {
  const std::string good = EncodeL3Value(Ns(1), Key(2), Payload(1000));
  EXPECT_CONTAINS(Why(good.substr(0, 10)), "shorter than its 64-byte header");
  EXPECT_CONTAINS(Why(""), "truncated");
  EXPECT_CONTAINS(Why(good.substr(0, good.size() - 1)), "(truncated)");
  EXPECT_CONTAINS(Why(good.substr(0, kL3ValueHeaderBytes)), "(truncated)");
  EXPECT_CONTAINS(Why(good + "x"), "trailing bytes");
  EXPECT_CONTAINS(Why(good, 2000), "the namespace's blocks have 2000");
  EXPECT_EQ(Why(good, 1000), "");
}

TEST(L3ValueTest, ForeignNamespaceAndKeyAreRejected) {
  const auto payload = Payload(64);
  EXPECT_CONTAINS(Why(EncodeL3Value(Ns(5), Key(2), payload)), "foreign namespace");
  EXPECT_CONTAINS(Why(EncodeL3Value(Ns(1), Key(3), payload)), "foreign key");
  auto r = DecodeL3Value(EncodeL3Value(Ns(1), Key(3), payload), Ns(1), Key(2));
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
}

TEST(L3ValueTest, OtherVersionIsRefusedNotMisread) {
  std::string v = EncodeL3Value(Ns(1), Key(2), Payload(64));
  L3ValueHeader h;
  std::memcpy(&h, v.data(), sizeof(h));
  h.version = 3;  // a newer writer's: FAILED_PRECONDITION (a miss), not DATA_LOSS (corruption)
  std::memcpy(v.data(), &h, sizeof(h));
  auto r = DecodeL3Value(v, Ns(1), Key(2));
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_CONTAINS(r.status().message(), "unsupported version 3");
}

}  // namespace
}  // namespace hiqcache::server::l3
