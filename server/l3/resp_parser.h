// ReplyParser: the incremental RESP2 reader of RedisCluster's pipelined rounds
// (redis_cluster.cc), in its own header so that the fuzzer (tests/fuzz/l3_reply_fuzzer.cc) runs
// the very code the daemon runs on what a Redis node (or whoever answers on its port) sends.
// Internal to server/l3.
#pragma once

#include <hiredis/hiredis.h>

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "hiqcache/status.h"

namespace hiqcache::server::l3 {

// A reply to a pipelined command. GET, EXISTS, SET, DEL and ASKING answer with a simple
// string, an error, an integer or a bulk string (nil included), never an array.
struct Reply {
  int type = REDIS_REPLY_NIL;  // REDIS_REPLY_STATUS, _ERROR, _INTEGER, _STRING or _NIL
  long long integer = 0;
  std::string str;  // status and error text, bulk string
};

// Incremental RESP2 parser of the replies of a pipelined round, fed at any byte boundary. Its
// own rather than hiredis's reader, so that a large bulk string is received straight into the
// std::string the caller gets (hiredis would gather it in its buffer, then copy it into a reply
// object, which the caller copies again: with multi-megabyte values, three fresh copies).
class ReplyParser {
 public:
  // A bulk string longer than `max_bulk` bytes is refused (RESOURCE_EXHAUSTED) before anything
  // is allocated for it: a server (or a stranger's key) cannot make the client hold more than
  // the caller expects.
  explicit ReplyParser(size_t max_bulk = kMaxBulk) : max_bulk_(max_bulk) {}

  // Consumes from `data` until a reply is complete or `data` is used up; returns the bytes
  // used. `*done` says whether a reply is complete (Take() it); an error means the stream is out of
  // step.
  StatusOr<size_t> Feed(std::string_view data, bool* done) {
    *done = false;
    size_t used = 0;
    while (used < data.size() && !*done) {
      if (state_ == kHeader) {
        const size_t nl = data.find('\n', used);
        const size_t end = nl == std::string_view::npos ? data.size() : nl + 1;
        line_.append(data.substr(used, end - used));
        used = end;
        if (line_.size() > kMaxLine) return Internal("l3: reply line too long");
        if (nl != std::string_view::npos) HIQ_RETURN_IF_ERROR(Header(done));
      } else if (state_ == kBody) {
        const size_t n = std::min(data.size() - used, reply_.str.size() - have_);
        std::memcpy(reply_.str.data() + have_, data.data() + used, n);
        have_ += n;
        used += n;
        if (have_ == reply_.str.size()) state_ = kCrlf;
      } else {  // kCrlf
        if (data[used] != "\r\n"[crlf_]) return Internal("l3: bulk string not ended by CRLF");
        ++used;
        if (++crlf_ == 2) Finish(done);
      }
    }
    return used;
  }
  // Inside a bulk string's bytes: where the rest of them go, and how many are left (so that
  // the caller can receive them in place).
  char* body() { return reply_.str.data() + have_; }
  size_t body_left() const { return state_ == kBody ? reply_.str.size() - have_ : 0; }
  void BodyReceived(size_t n) {
    have_ += n;
    if (have_ == reply_.str.size()) state_ = kCrlf;
  }
  Reply Take() { return std::exchange(reply_, Reply()); }

 private:
  static constexpr size_t kMaxLine = 64 << 10;
  static constexpr size_t kMaxBulk = size_t{1} << 32;
  enum State { kHeader, kBody, kCrlf };

  Status Header(bool* done) {
    if (line_.size() < 3 || line_[line_.size() - 2] != '\r') {
      return Internal("l3: malformed reply line");
    }
    const std::string_view text(line_.data() + 1, line_.size() - 3);
    long long v = 0;
    const auto number = [&]() {
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      return ec == std::errc() && end == text.data() + text.size();
    };
    switch (line_[0]) {
      case '+':
      case '-':
        reply_.type = line_[0] == '+' ? REDIS_REPLY_STATUS : REDIS_REPLY_ERROR;
        reply_.str.assign(text);
        Finish(done);
        return Status::Ok();
      case ':':
        if (!number()) return Internal("l3: malformed integer reply");
        reply_.type = REDIS_REPLY_INTEGER;
        reply_.integer = v;
        Finish(done);
        return Status::Ok();
      case '$':
        if (!number() || v < -1) return Internal("l3: malformed bulk length");
        if (v > 0 && static_cast<unsigned long long>(v) > max_bulk_) {
          return ResourceExhausted("l3: a value of " + std::to_string(v) +
                                   " bytes, more than the " + std::to_string(max_bulk_) +
                                   " expected");
        }
        if (v == -1) {
          reply_.type = REDIS_REPLY_NIL;
          Finish(done);
          return Status::Ok();
        }
        reply_.type = REDIS_REPLY_STRING;
        reply_.str.resize(static_cast<size_t>(v));
        have_ = 0;
        crlf_ = 0;
        line_.clear();
        state_ = v == 0 ? kCrlf : kBody;
        return Status::Ok();
      default:
        return Internal("l3: unexpected reply type byte " + std::to_string(int(line_[0])));
    }
  }
  void Finish(bool* done) {
    line_.clear();
    state_ = kHeader;
    *done = true;
  }

  size_t max_bulk_;
  State state_ = kHeader;
  std::string line_;
  size_t have_ = 0;
  int crlf_ = 0;
  Reply reply_;
};

}  // namespace hiqcache::server::l3
