#include "l3/redis_cluster.h"

#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "l3/resp_parser.h"

namespace hiqcache::server::l3 {
namespace {

// CRC16-CCITT (XMODEM: polynomial 0x1021, init 0), as the Redis Cluster spec defines key slots.
constexpr std::array<uint16_t, 256> MakeCrc16Table() {
  std::array<uint16_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint16_t crc = static_cast<uint16_t>(i << 8);
    for (int b = 0; b < 8; ++b) {
      crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                           : static_cast<uint16_t>(crc << 1);
    }
    t[i] = crc;
  }
  return t;
}
constexpr std::array<uint16_t, 256> kCrc16 = MakeCrc16Table();

uint16_t Crc16(std::string_view s) {
  uint16_t crc = 0;
  for (unsigned char c : s)
    crc = static_cast<uint16_t>((crc << 8) ^ kCrc16[((crc >> 8) ^ c) & 0xff]);
  return crc;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r != nullptr) freeReplyObject(r);
  }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;

struct ContextDeleter {
  void operator()(redisContext* c) const {
    if (c != nullptr) redisFree(c);
  }
};
using ContextPtr = std::unique_ptr<redisContext, ContextDeleter>;

timeval ToTimeval(Millis ms) {
  const int64_t v = std::max<int64_t>(ms.count(), 1);
  return timeval{static_cast<time_t>(v / 1000), static_cast<suseconds_t>((v % 1000) * 1000)};
}

Millis Left(Clock::time_point deadline) {
  return std::chrono::duration_cast<Millis>(deadline - Clock::now());
}

bool ParseAddress(std::string_view addr, std::string* host, int* port) {
  const size_t colon = addr.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return false;
  const std::string_view p = addr.substr(colon + 1);
  int v = 0;
  auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), v);
  if (ec != std::errc() || end != p.data() + p.size() || v <= 0 || v > 65535) return false;
  *host = std::string(addr.substr(0, colon));
  *port = v;
  return true;
}

// After a failed hiredis call on a blocking socket: whether it was the socket timeout.
bool TimedOut() { return errno == EAGAIN || errno == EWOULDBLOCK; }

std::string_view ReplyText(const redisReply* r) {
  return r->str != nullptr ? std::string_view(r->str, r->len) : std::string_view();
}

// hiredis writes with write(2): a write to a connection the server closed raises SIGPIPE, whose
// default action ends the process. For the duration of a call, SIGPIPE is blocked in the calling
// thread (a write's SIGPIPE is directed at the writing thread), and one that became pending is
// consumed before the old mask comes back. The process's signal dispositions are left alone.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &old_);
    was_blocked_ = sigismember(&old_, SIGPIPE) == 1;
  }
  ~SigpipeGuard() {
    if (!was_blocked_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        sigset_t pipe;
        sigemptyset(&pipe);
        sigaddset(&pipe, SIGPIPE);
        const timespec zero{0, 0};
        while (sigtimedwait(&pipe, nullptr, &zero) == -1 && errno == EINTR) {
        }
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t old_;
  bool was_blocked_ = false;
};

// One command of a batch: its slot and its argv (views into the caller's strings).
struct Request {
  uint16_t slot = 0;
  std::vector<std::string_view> argv;
};

struct Response {
  Status status = Unavailable("not sent");
  Reply reply;
};

// Bytes one recv of a pipelined round reads into the parser (bulk strings past a chunk are
// received in place).
constexpr size_t kReadChunk = 256 << 10;
// GETs a node has in flight before the size of the call's values is known.
constexpr size_t kFirstGetWindow = 2;

}  // namespace

uint16_t KeySlot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  return Crc16(key) & (kClusterSlots - 1);
}

struct RedisCluster::Impl {
  struct Node {
    std::string addr;  // "host:port"
    std::string host;
    int port = 0;
    ContextPtr ctx;
    bool deadline_limited = false;  // its socket timeout is shorter than command_timeout
    bool reused = false;            // ctx was opened before the current call
    uint32_t failures = 0;          // consecutive
    Clock::time_point retry_at{};
  };

  RedisClusterOptions options;
  std::vector<std::unique_ptr<Node>> nodes;       // every node seen; never shrinks
  std::array<int32_t, kClusterSlots> slot_owner;  // index into nodes, -1 = unassigned
  bool map_stale = false;
  Clock::time_point last_refresh{};
  size_t refresh_cursor = 0;
  RedisClusterStats stats;
  std::vector<char> read_buf;  // what one recv of a pipelined round takes (kReadChunk)

  Impl() { slot_owner.fill(-1); }

  int NodeIndex(const std::string& host, int port) {
    const std::string addr = host + ":" + std::to_string(port);
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i]->addr == addr) return static_cast<int>(i);
    }
    auto n = std::make_unique<Node>();
    n->addr = addr;
    n->host = host;
    n->port = port;
    nodes.push_back(std::move(n));
    return static_cast<int>(nodes.size() - 1);
  }

  // A node stopped answering: drop its connection, back off before the next attempt, and have
  // the map reloaded (its slots may have moved to a promoted replica).
  void MarkFailed(Node& n) {
    n.ctx.reset();
    ++stats.node_failures;
    ++n.failures;
    const int shift = static_cast<int>(std::min<uint32_t>(n.failures - 1, 16));
    const Millis wait = std::min(options.backoff_max, options.backoff_min * (int64_t{1} << shift));
    n.retry_at = Clock::now() + wait;
    map_stale = true;
  }

  // A round trip failed on `n`'s connection, which is then out of step: drop it. A timeout that
  // only the call's own short deadline caused says nothing about the node: no backoff.
  // A connection kept from an earlier call that fails otherwise may just have been closed by
  // the server (idle timeout, CLIENT KILL, restart): no backoff either, the retry reconnects,
  // and only a failure of that fresh connection counts against the node.
  void Disconnect(Node& n, bool timed_out) {
    if ((timed_out && n.deadline_limited) || (!timed_out && n.reused)) {
      n.ctx.reset();
      map_stale = map_stale || !timed_out;
      return;
    }
    MarkFailed(n);
  }

  // Connections open now were opened before this call.
  void BeginCall() {
    for (auto& n : nodes) n->reused = n->ctx != nullptr;
  }

  // An open, authenticated connection to `n`, its socket timeout set for a round trip that ends
  // by `deadline`. A node in backoff is not tried.
  Status Connect(Node& n, Clock::time_point deadline) {
    const Millis left = Left(deadline);
    if (left.count() <= 0) return DeadlineExceeded("l3: deadline passed before " + n.addr);
    const Millis io = std::min(options.command_timeout, left);
    n.deadline_limited = io < options.command_timeout;
    if (n.ctx != nullptr) {
      redisSetTimeout(n.ctx.get(), ToTimeval(io));
      return Status::Ok();
    }
    const auto now = Clock::now();
    if (now < n.retry_at) {
      map_stale = true;
      return Unavailable("l3: node " + n.addr + " is down (next attempt in " +
                         std::to_string(Left(n.retry_at).count()) + " ms)");
    }
    ContextPtr c(redisConnectWithTimeout(n.host.c_str(), n.port,
                                         ToTimeval(std::min(options.connect_timeout, left))));
    if (c == nullptr || c->err != 0) {
      const std::string why = c == nullptr ? "out of memory" : c->errstr;
      MarkFailed(n);
      return Unavailable("l3: cannot connect to " + n.addr + ": " + why);
    }
    redisSetTimeout(c.get(), ToTimeval(io));
    ++stats.connects;
    if (!options.password.empty()) {
      std::vector<const char*> argv = {"AUTH"};
      std::vector<size_t> lens = {4};
      if (!options.user.empty()) {
        argv.push_back(options.user.data());
        lens.push_back(options.user.size());
      }
      argv.push_back(options.password.data());
      lens.push_back(options.password.size());
      ++stats.commands;
      ReplyPtr r(static_cast<redisReply*>(
          redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lens.data())));
      if (r == nullptr) {
        const std::string why = c->errstr;
        MarkFailed(n);
        return Unavailable("l3: AUTH at " + n.addr + ": " + why);
      }
      if (r->type == REDIS_REPLY_ERROR) {
        // Not a node failure: no backoff, no refresh; every call will say the same.
        return Unauthenticated("l3: AUTH at " + n.addr +
                               " refused: " + std::string(ReplyText(r.get())));
      }
    }
    n.ctx = std::move(c);
    n.reused = false;
    n.failures = 0;
    return Status::Ok();
  }

  // One command at `n`, for the slot map and the like (no redirections).
  StatusOr<ReplyPtr> Command(Node& n, const std::vector<std::string_view>& args,
                             Clock::time_point deadline) {
    HIQ_RETURN_IF_ERROR(Connect(n, deadline));
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    ++stats.commands;
    ReplyPtr r(static_cast<redisReply*>(
        redisCommandArgv(n.ctx.get(), static_cast<int>(argv.size()), argv.data(), lens.data())));
    if (r == nullptr) {
      const bool timed_out = TimedOut();
      const std::string why = n.ctx->errstr;
      Disconnect(n, timed_out);
      return Unavailable("l3: " + n.addr + ": " + why);
    }
    return r;
  }

  // Parses a CLUSTER SLOTS reply into the map. Nodes that report an empty host are addressed as
  // the node that answered (`asked`).
  Status LoadSlots(const redisReply* r, const Node& asked) {
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string err(ReplyText(r));
      if (err.rfind("NOAUTH", 0) == 0 || err.rfind("WRONGPASS", 0) == 0) {
        return Unauthenticated("l3: CLUSTER SLOTS at " + asked.addr + ": " + err);
      }
      return Unavailable("l3: CLUSTER SLOTS at " + asked.addr + ": " + err);
    }
    if (r->type != REDIS_REPLY_ARRAY) {
      return Internal("l3: CLUSTER SLOTS at " + asked.addr + ": not an array");
    }
    std::array<int32_t, kClusterSlots> map;
    map.fill(-1);
    for (size_t i = 0; i < r->elements; ++i) {
      const redisReply* range = r->element[i];
      if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 ||
          range->element[0]->type != REDIS_REPLY_INTEGER ||
          range->element[1]->type != REDIS_REPLY_INTEGER) {
        return Internal("l3: CLUSTER SLOTS at " + asked.addr + ": malformed range");
      }
      const long long first = range->element[0]->integer, last = range->element[1]->integer;
      if (first < 0 || last >= kClusterSlots || first > last) {
        return Internal("l3: CLUSTER SLOTS at " + asked.addr + ": bad range");
      }
      int master = -1;
      for (size_t k = 2; k < range->elements; ++k) {  // the master, then its replicas
        const redisReply* nd = range->element[k];
        if (nd->type != REDIS_REPLY_ARRAY || nd->elements < 2 ||
            nd->element[0]->type != REDIS_REPLY_STRING ||
            nd->element[1]->type != REDIS_REPLY_INTEGER) {
          return Internal("l3: CLUSTER SLOTS at " + asked.addr + ": malformed node");
        }
        std::string host(ReplyText(nd->element[0]));
        if (host.empty() || host == "?") host = asked.host;
        const int idx = NodeIndex(host, static_cast<int>(nd->element[1]->integer));
        if (k == 2) master = idx;
      }
      for (long long s = first; s <= last; ++s) map[s] = master;
    }
    slot_owner = map;
    return Status::Ok();
  }

  // Asks the known nodes in turn (starting after the last one that answered, skipping those in
  // backoff) for the slot map.
  Status Refresh(Clock::time_point deadline) {
    SigpipeGuard no_sigpipe;
    last_refresh = Clock::now();
    Status last = Unavailable("l3: no cluster node known");
    const size_t count = nodes.size();
    for (size_t t = 0; t < count; ++t) {
      if (Left(deadline).count() <= 0) break;
      Node& n = *nodes[(refresh_cursor + t) % count];
      auto r = Command(n, {"CLUSTER", "SLOTS"}, deadline);
      if (!r.ok()) {
        if (r.status().code() == StatusCode::kUnauthenticated) return r.status();
        last = r.status();
        continue;
      }
      last = LoadSlots(r->get(), n);
      if (last.ok()) {
        refresh_cursor = (refresh_cursor + t) % count;
        map_stale = false;
        ++stats.slot_refreshes;
        return last;
      }
    }
    return last;
  }

  void MaybeRefresh(Clock::time_point deadline) {
    if (map_stale && Clock::now() - last_refresh >= options.min_refresh_interval) {
      (void)Refresh(deadline);  // on failure the commands below report their nodes' state
    }
  }

  // One node's part of a round of Execute: its requests in order, a prefix of them written and a
  // shorter prefix answered; at most a window of them is in flight at once.
  struct Flight {
    int node = -1;
    std::vector<size_t> idx;       // requests, in the order sent
    size_t sent = 0;               // idx[0, sent) written
    size_t answered = 0;           // idx[0, answered) answered (or put back)
    bool asking_answered = false;  // ASKING's +OK of idx[answered] read
    bool open = true;              // the connection is usable
    Millis io{0};                  // no byte for this long: the round trip timed out
    Clock::time_point progress{};  // last byte received, or the window (re)opened
    ReplyParser parser;
  };

  // Per-call state of Execute.
  struct Call {
    std::span<const Request> reqs;
    std::vector<Response> out;
    std::vector<int> attempts;
    std::vector<int> ask_node;
    std::vector<char> sent_asking;  // ASKING went before the request's last send
    std::vector<size_t> pending;
    size_t first_window = 0;
    size_t largest_reply = 0;  // bytes of the largest string reply so far
    size_t max_bulk = 0;       // longest bulk string a reply may carry
  };

  // Requests a node has in flight: `first_window` until a reply's size is known, then as many as
  // fit in options.pipeline_bytes of the largest reply seen, but never fewer than 2, so that the
  // node prepares the next reply while the current one is on the wire.
  size_t Window(const Call& call) const {
    if (call.largest_reply == 0) return std::max<size_t>(call.first_window, 1);
    return std::max<size_t>(2, options.pipeline_bytes / call.largest_reply);
  }

  // `f`'s connection failed: drop it and put its unanswered requests back for the next round
  // (the map may name a promoted replica by then; else they fail with the node's state).
  // `node_fault` false: the connection is only out of step (no backoff, no map refresh).
  void Lose(Call& call, Flight& f, bool timed_out, const Status& lost, bool node_fault = true) {
    if (node_fault) {
      Disconnect(*nodes[f.node], timed_out);
    } else {
      nodes[f.node]->ctx.reset();
    }
    f.open = false;
    for (size_t k = f.answered; k < f.idx.size(); ++k) {
      const size_t i = f.idx[k];
      call.out[i].status = lost;
      if (++call.attempts[i] <= options.max_redirects) call.pending.push_back(i);
    }
    f.answered = f.idx.size();
  }

  // Writes `f`'s next requests until its window is full. False when the connection failed.
  bool TopUp(Call& call, Flight& f) {
    Node& n = *nodes[f.node];
    const size_t until = std::min(f.idx.size(), f.answered + Window(call));
    if (f.sent >= until) return true;
    const bool was_idle = f.sent == f.answered;
    for (; f.sent < until; ++f.sent) {
      const size_t i = f.idx[f.sent];
      call.sent_asking[i] = call.ask_node[i] >= 0;
      call.ask_node[i] = -1;
      if (call.sent_asking[i]) {
        const char* asking = "ASKING";
        const size_t len = 6;
        redisAppendCommandArgv(n.ctx.get(), 1, &asking, &len);
        ++stats.commands;
      }
      std::vector<const char*> argv;
      std::vector<size_t> lens;
      for (auto a : call.reqs[i].argv) {
        argv.push_back(a.data());
        lens.push_back(a.size());
      }
      redisAppendCommandArgv(n.ctx.get(), static_cast<int>(argv.size()), argv.data(), lens.data());
      ++stats.commands;
    }
    int done = 0;
    while (!done && redisBufferWrite(n.ctx.get(), &done) == REDIS_OK) {
    }
    if (!done) {
      const bool timed_out = TimedOut();
      Lose(call, f, timed_out, Unavailable("l3: " + n.addr + ": " + n.ctx->errstr));
      return false;
    }
    if (was_idle) f.progress = Clock::now();  // nothing was in flight: the reply timer starts
    return true;
  }

  // Reads what `f`'s socket holds (poll said it is readable) and sorts the replies it completes.
  void ReadSome(Call& call, Flight& f) {
    Node& n = *nodes[f.node];
    const size_t in_place = f.parser.body_left();
    if (read_buf.empty()) read_buf.resize(kReadChunk);
    char* into = in_place >= kReadChunk ? f.parser.body() : read_buf.data();
    const size_t room = in_place >= kReadChunk ? in_place : read_buf.size();
    const ssize_t got = recv(n.ctx->fd, into, room, MSG_DONTWAIT);
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      Lose(call, f, false, Unavailable("l3: " + n.addr + ": " + std::strerror(errno)));
      return;
    }
    if (got == 0) {
      Lose(call, f, false, Unavailable("l3: " + n.addr + ": Server closed the connection"));
      return;
    }
    f.progress = Clock::now();
    if (into != read_buf.data()) {
      f.parser.BodyReceived(static_cast<size_t>(got));
      return;
    }
    std::string_view data(read_buf.data(), static_cast<size_t>(got));
    while (!data.empty()) {
      bool done = false;
      auto used = f.parser.Feed(data, &done);
      if (!used.ok() && used.status().code() == StatusCode::kResourceExhausted &&
          f.answered < f.sent) {
        // A value larger than the caller takes: that key fails; the rest of the stream is
        // unread, so the connection goes and the other requests are retried.
        call.out[f.idx[f.answered]].status = used.status();
        ++f.answered;
        Lose(call, f, false, Unavailable("l3: " + n.addr + ": connection dropped mid-reply"),
             /*node_fault=*/false);
        return;
      }
      if (!used.ok() || (done && f.answered >= f.sent)) {  // out of step with the requests
        Lose(call, f, false,
             Unavailable("l3: " + n.addr + ": " +
                         (used.ok() ? std::string("reply to no request")
                                    : std::string(used.status().message()))));
        return;
      }
      data.remove_prefix(*used);
      if (!done) break;
      Reply r = f.parser.Take();
      const size_t i = f.idx[f.answered];
      if (call.sent_asking[i] && !f.asking_answered) {  // ASKING's +OK first
        f.asking_answered = true;
        continue;
      }
      f.asking_answered = false;
      ++f.answered;
      if (r.type == REDIS_REPLY_STRING) {
        call.largest_reply = std::max(call.largest_reply, r.str.size());
      }
      Classify(i, std::move(r), call.reqs[i], call.attempts[i], call.ask_node[i], call.out[i],
               call.pending);
    }
    if (f.answered < f.idx.size()) (void)TopUp(call, f);
  }

  // Runs `reqs` to completion, redirections and retries included, by `deadline`. Each round
  // groups the pending requests by node and runs every node's requests at once: each node gets
  // a window of requests in flight (`first_window` at first, then what options.pipeline_bytes
  // allows), topped up as its replies are read, whichever node's arrive first. So the nodes
  // work in parallel, and no node has more than a window of large values queued for this
  // client. MOVED, ASK and a failed node put a request back for the next round.
  std::vector<Response> Execute(std::span<const Request> reqs, Clock::time_point deadline,
                                size_t first_window, size_t max_bulk) {
    BeginCall();
    SigpipeGuard no_sigpipe;
    Call call;
    call.reqs = reqs;
    call.out.resize(reqs.size());
    call.attempts.assign(reqs.size(), 0);
    call.ask_node.assign(reqs.size(), -1);
    call.sent_asking.assign(reqs.size(), 0);
    call.first_window = first_window;
    call.max_bulk = max_bulk;
    call.pending.resize(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) call.pending[i] = i;

    while (!call.pending.empty()) {
      if (Left(deadline).count() <= 0) {
        for (size_t i : call.pending) call.out[i].status = DeadlineExceeded("l3: deadline passed");
        break;
      }
      MaybeRefresh(deadline);
      std::map<int, std::vector<size_t>> by_node;
      for (size_t i : call.pending) {
        const int node = call.ask_node[i] >= 0 ? call.ask_node[i] : slot_owner[reqs[i].slot];
        if (node < 0) {
          call.out[i].status = Unavailable("l3: slot " + std::to_string(reqs[i].slot) +
                                           " has no master in the slot map");
          map_stale = true;
          continue;
        }
        by_node[node].push_back(i);
      }
      call.pending.clear();

      std::vector<Flight> flights;
      for (auto& [node, idx] : by_node) {
        Node& n = *nodes[node];
        if (Status st = Connect(n, deadline); !st.ok()) {
          // Down, in backoff, or AUTH refused: this call fails for these keys.
          for (size_t i : idx) call.out[i].status = st;
          continue;
        }
        Flight f{.parser = ReplyParser(call.max_bulk)};
        f.node = node;
        f.idx = std::move(idx);
        f.io = std::min(options.command_timeout, std::max(Left(deadline), Millis(1)));
        flights.push_back(std::move(f));
      }
      for (Flight& f : flights) (void)TopUp(call, f);

      std::vector<pollfd> fds;
      std::vector<Flight*> polled;
      for (;;) {
        fds.clear();
        polled.clear();
        auto now = Clock::now();
        auto wake = deadline;
        for (Flight& f : flights) {
          if (!f.open || f.answered >= f.sent) continue;
          fds.push_back(pollfd{nodes[f.node]->ctx->fd, POLLIN, 0});
          polled.push_back(&f);
          wake = std::min(wake, f.progress + f.io);
        }
        if (fds.empty()) break;
        if (now >= deadline) {
          // Out of time with replies outstanding: those connections are out of step. Not the
          // nodes' fault: no backoff, no refresh.
          for (Flight* f : polled) {
            nodes[f->node]->ctx.reset();
            f->open = false;
            for (size_t k = f->answered; k < f->idx.size(); ++k) {
              call.out[f->idx[k]].status = DeadlineExceeded("l3: deadline passed");
            }
          }
          break;
        }
        const auto wait = std::chrono::ceil<Millis>(std::max(wake - now, Clock::duration(0)));
        const int ready = poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
        if (ready < 0 && errno != EINTR) {
          const Status lost = Unavailable(std::string("l3: poll: ") + std::strerror(errno));
          for (Flight* f : polled) Lose(call, *f, false, lost);
          break;
        }
        now = Clock::now();
        for (size_t k = 0; k < fds.size(); ++k) {
          Flight& f = *polled[k];
          if (ready > 0 && fds[k].revents != 0) {
            ReadSome(call, f);
          } else if (now >= f.progress + f.io) {
            Lose(call, f, true,
                 Unavailable("l3: " + nodes[f.node]->addr + ": no reply in " +
                             std::to_string(f.io.count()) + " ms"));
          }
        }
      }
      // Requests of flights that ended early (a lost connection) are back in `pending`.
    }
    for (const auto& o : call.out) stats.errors += !o.status.ok();
    return std::move(call.out);
  }

  // Sorts one reply: a result, or a redirection that puts request `i` back into `pending`.
  void Classify(size_t i, Reply r, const Request& req, int& attempts, int& ask_node, Response& out,
                std::vector<size_t>& pending) {
    if (r.type != REDIS_REPLY_ERROR) {
      out.status = Status::Ok();
      out.reply = std::move(r);
      return;
    }
    const std::string_view err = r.str;
    const bool moved = err.rfind("MOVED ", 0) == 0;
    const bool ask = err.rfind("ASK ", 0) == 0;
    if (moved || ask) {
      // "MOVED <slot> <host>:<port>"
      const size_t sp = err.rfind(' ');
      std::string host;
      int port = 0;
      if (sp == std::string_view::npos || !ParseAddress(err.substr(sp + 1), &host, &port)) {
        out.status = Internal("l3: malformed redirection: " + std::string(err));
        return;
      }
      if (host.empty()) host = "127.0.0.1";
      const int target = NodeIndex(host, port);
      if (moved) {
        ++stats.moved;
        slot_owner[req.slot] = target;
        map_stale = true;  // a moved slot usually means a reshard: reload the rest
      } else {
        ++stats.ask;
        ask_node = target;
      }
      if (++attempts > options.max_redirects) {
        out.status = Unavailable("l3: slot " + std::to_string(req.slot) + ": more than " +
                                 std::to_string(options.max_redirects) +
                                 " redirections, last: " + std::string(err));
        return;
      }
      pending.push_back(i);
      return;
    }
    if (err.rfind("TRYAGAIN", 0) == 0 && ++attempts <= options.max_redirects) {
      std::this_thread::sleep_for(Millis(1));  // a multi-key command during a migration
      pending.push_back(i);
      return;
    }
    if (err.rfind("CLUSTERDOWN", 0) == 0) map_stale = true;
    if (err.rfind("NOAUTH", 0) == 0 || err.rfind("WRONGPASS", 0) == 0) {
      out.status = Unauthenticated("l3: " + std::string(err));
    } else if (err.rfind("NOPERM", 0) == 0) {
      out.status = PermissionDenied("l3: " + std::string(err));
    } else {
      out.status = Unavailable("l3: " + std::string(err));
    }
  }

  Clock::time_point DeadlineOf(const Deadline& d) const {
    return d.has_value() ? *d : Clock::now() + options.default_deadline;
  }

  Response One(std::vector<std::string_view> argv, Clock::time_point deadline) {
    Request r;
    r.slot = KeySlot(argv[1]);
    r.argv = std::move(argv);
    return std::move(
        Execute(std::span<const Request>(&r, 1), deadline, 1, options.max_value_bytes)[0]);
  }

  std::vector<KeyResult> Multi(std::string_view cmd, std::span<const std::string> keys,
                               Clock::time_point deadline, size_t max_value_bytes) {
    std::vector<Request> reqs(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      reqs[i].slot = KeySlot(keys[i]);
      reqs[i].argv = {cmd, keys[i]};
    }
    const bool get = cmd == "GET";
    // EXISTS replies are a few bytes: all of a node's at once. GET values may be megabytes:
    // a small window until the first one's size is known.
    std::vector<Response> resp =
        Execute(reqs, deadline, get ? kFirstGetWindow : reqs.size(),
                max_value_bytes == 0 ? options.max_value_bytes : max_value_bytes);
    std::vector<KeyResult> out(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      Response& r = resp[i];
      if (!r.status.ok()) {
        out[i].status = std::move(r.status);
      } else if (get && r.reply.type == REDIS_REPLY_STRING) {
        out[i].found = true;
        out[i].value = std::move(r.reply.str);
      } else if (get && r.reply.type == REDIS_REPLY_NIL) {
        out[i].found = false;
      } else if (!get && r.reply.type == REDIS_REPLY_INTEGER) {
        out[i].found = r.reply.integer > 0;
      } else {
        out[i].status = Internal("l3: unexpected reply type " + std::to_string(r.reply.type) +
                                 " to " + std::string(cmd));
      }
    }
    return out;
  }
};

RedisCluster::RedisCluster(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RedisCluster::RedisCluster(RedisCluster&&) noexcept = default;
RedisCluster& RedisCluster::operator=(RedisCluster&&) noexcept = default;
RedisCluster::~RedisCluster() = default;

StatusOr<RedisCluster> RedisCluster::Open(RedisClusterOptions options) {
  if (options.seeds.empty()) return InvalidArgument("l3: no seed nodes");
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  for (const auto& s : impl->options.seeds) {
    std::string host;
    int port = 0;
    if (!ParseAddress(s, &host, &port)) {
      return InvalidArgument("l3: seed \"" + s + "\": expected host:port");
    }
    impl->NodeIndex(host, port);
  }
  const auto deadline = Clock::now() +
                        impl->options.connect_timeout * static_cast<int64_t>(impl->nodes.size()) +
                        impl->options.command_timeout;
  HIQ_RETURN_IF_ERROR(impl->Refresh(deadline));
  return RedisCluster(std::move(impl));
}

StatusOr<std::optional<std::string>> RedisCluster::Get(std::string_view key, Deadline deadline) {
  Response r = impl_->One({"GET", key}, impl_->DeadlineOf(deadline));
  if (!r.status.ok()) return r.status;
  if (r.reply.type == REDIS_REPLY_NIL) return std::optional<std::string>();
  if (r.reply.type != REDIS_REPLY_STRING) return Internal("l3: GET: unexpected reply type");
  return std::optional<std::string>(std::move(r.reply.str));
}

StatusOr<bool> RedisCluster::Exists(std::string_view key, Deadline deadline) {
  Response r = impl_->One({"EXISTS", key}, impl_->DeadlineOf(deadline));
  if (!r.status.ok()) return r.status;
  if (r.reply.type != REDIS_REPLY_INTEGER) return Internal("l3: EXISTS: unexpected reply type");
  return r.reply.integer > 0;
}

Status RedisCluster::Set(std::string_view key, std::string_view value, Millis ttl,
                         Deadline deadline) {
  const std::string px = std::to_string(ttl.count());
  std::vector<std::string_view> argv = {"SET", key, value};
  if (ttl.count() > 0) {
    argv.push_back("PX");
    argv.push_back(px);
  }
  Response r = impl_->One(std::move(argv), impl_->DeadlineOf(deadline));
  if (!r.status.ok()) return r.status;
  if (r.reply.type != REDIS_REPLY_STATUS) return Internal("l3: SET: unexpected reply type");
  return Status::Ok();
}

StatusOr<bool> RedisCluster::Del(std::string_view key, Deadline deadline) {
  Response r = impl_->One({"DEL", key}, impl_->DeadlineOf(deadline));
  if (!r.status.ok()) return r.status;
  if (r.reply.type != REDIS_REPLY_INTEGER) return Internal("l3: DEL: unexpected reply type");
  return r.reply.integer > 0;
}

std::vector<KeyResult> RedisCluster::MultiGet(std::span<const std::string> keys, Deadline deadline,
                                              size_t max_value_bytes) {
  return impl_->Multi("GET", keys, impl_->DeadlineOf(deadline), max_value_bytes);
}

std::vector<KeyResult> RedisCluster::MultiExists(std::span<const std::string> keys,
                                                 Deadline deadline) {
  // Integer replies: no value of any size is expected.
  return impl_->Multi("EXISTS", keys, impl_->DeadlineOf(deadline), 1);
}

Status RedisCluster::RefreshSlots(Deadline deadline) {
  impl_->BeginCall();
  return impl_->Refresh(impl_->DeadlineOf(deadline));
}

std::string RedisCluster::MasterOf(uint16_t slot) const {
  const int n = slot < kClusterSlots ? impl_->slot_owner[slot] : -1;
  return n < 0 ? std::string() : impl_->nodes[n]->addr;
}

const RedisClusterStats& RedisCluster::stats() const { return impl_->stats; }

}  // namespace hiqcache::server::l3
