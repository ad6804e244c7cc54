// The L3 reply fuzzer: what a Redis node (or whoever answers on its port) sends, through the
// daemon's own readers of it. Input bytes are a RESP stream, fed to ReplyParser (server/l3/
// resp_parser.h) twice: whole, and cut into chunks whose sizes come from the input, with bulk
// bytes received in place as RedisCluster does. Both runs must agree reply by reply and fail at
// the same reply; every bulk string is then checked as an L3 value by DecodeL3Value
// (server/l3/l3_value.h), which must accept it only when every byte verifies, and return a
// payload inside the value. Sanitizers (ASan+UBSan) catch the rest. Run:
//   hiq_l3_reply_fuzzer -max_total_time=30 WORKDIR tests/fuzz/l3_reply_corpus
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "l3/l3_value.h"
#include "l3/resp_parser.h"

namespace {

namespace l3 = ::hiqcache::server::l3;

struct Outcome {
  std::vector<l3::Reply> replies;
  bool failed = false;
  hiqcache::StatusCode code = hiqcache::StatusCode::kOk;
};

void Check(bool ok) {
  if (!ok) std::abort();
}

// The stream fed in chunks of `sizes` (cycled; 0 = the rest at once).
Outcome Parse(std::string_view in, size_t max_bulk, const std::vector<size_t>& sizes) {
  Outcome out;
  l3::ReplyParser parser(max_bulk);
  size_t pos = 0, turn = 0;
  while (pos < in.size()) {
    size_t n = sizes.empty() ? in.size() - pos : sizes[turn++ % sizes.size()];
    if (n == 0 || n > in.size() - pos) n = in.size() - pos;
    // In place, as RedisCluster receives a large bulk string: straight into the reply.
    if (const size_t left = parser.body_left(); left > 0 && !sizes.empty()) {
      const size_t k = std::min(left, n);
      std::memcpy(parser.body(), in.data() + pos, k);
      parser.BodyReceived(k);
      pos += k;
      continue;
    }
    std::string_view chunk = in.substr(pos, n);
    pos += n;
    while (!chunk.empty()) {
      bool done = false;
      auto used = parser.Feed(chunk, &done);
      if (!used.ok()) {
        out.failed = true;
        out.code = used.status().code();
        return out;
      }
      Check(*used <= chunk.size());
      Check(*used > 0);  // a non-empty chunk always makes progress
      chunk.remove_prefix(*used);
      if (!done) {
        Check(chunk.empty());
        break;
      }
      l3::Reply r = parser.Take();
      Check(r.type == REDIS_REPLY_STATUS || r.type == REDIS_REPLY_ERROR ||
            r.type == REDIS_REPLY_INTEGER || r.type == REDIS_REPLY_STRING ||
            r.type == REDIS_REPLY_NIL);
      if (r.type == REDIS_REPLY_STRING) Check(r.str.size() <= max_bulk);
      out.replies.push_back(std::move(r));
    }
  }
  return out;
}

void CheckValue(const std::string& v) {
  // The namespace and key it claims (when it is long enough to claim any), so that the decoder
  // is taken past its identity checks.
  hiqcache::NamespaceHash ns{};
  hiqcache::BlockKey key{};
  uint64_t claimed = 0;
  if (v.size() >= l3::kL3ValueHeaderBytes) {
    l3::L3ValueHeader h;
    std::memcpy(&h, v.data(), sizeof(h));
    std::memcpy(ns.data(), h.namespace_hash, 16);
    std::memcpy(key.data(), h.key, 16);
    claimed = h.payload_bytes;
  }
  for (uint64_t expected : {uint64_t{0}, claimed}) {
    auto payload = l3::DecodeL3Value(v, ns, key, expected);
    if (!payload.ok()) continue;
    const auto* begin = reinterpret_cast<const uint8_t*>(v.data());
    Check(payload->data() == begin + l3::kL3ValueHeaderBytes);
    Check(payload->size() == v.size() - l3::kL3ValueHeaderBytes);
    Check(l3::L3Checksum(*payload) == [&] {
      l3::L3ValueHeader h;
      std::memcpy(&h, v.data(), sizeof(h));
      return h.payload_checksum;
    }());
    // Accepted values re-encode to themselves.
    Check(l3::EncodeL3Value(ns, key, *payload) == v);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // Byte 0: the bulk bound (small values make the refusal path reachable); byte 1: the chunk
  // pattern's seed. The rest is the stream.
  const size_t max_bulk = data[0] < 128 ? size_t{data[0]} * 97 : size_t{1} << 20;
  std::vector<size_t> sizes;
  uint32_t x = data[1] * 2654435761u + 1;
  for (int i = 0; i < 8; ++i) {
    x = x * 1103515245u + 12345u;
    sizes.push_back(1 + (x >> 16) % 37);
  }
  const std::string_view in(reinterpret_cast<const char*>(data) + 2, size - 2);
  const Outcome whole = Parse(in, max_bulk, {});
  const Outcome cut = Parse(in, max_bulk, sizes);
  Check(whole.failed == cut.failed);
  Check(whole.code == cut.code);
  Check(whole.replies.size() == cut.replies.size());
  for (size_t i = 0; i < whole.replies.size(); ++i) {
    Check(whole.replies[i].type == cut.replies[i].type);
    Check(whole.replies[i].integer == cut.replies[i].integer);
    Check(whole.replies[i].str == cut.replies[i].str);
    if (whole.replies[i].type == REDIS_REPLY_STRING) CheckValue(whole.replies[i].str);
  }
  return 0;
}
