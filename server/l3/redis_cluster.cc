#include "redis_cluster.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>

#include <cerrno>

#include <algorithm>
#include <charconv>
#include <map>
#include <thread>

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
  for (unsigned char c : s) crc = static_cast<uint16_t>((crc << 8) ^ kCrc16[((crc >> 8) ^ c) & 0xff]);
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
  ReplyPtr reply;
};

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
    uint32_t failures = 0;  // consecutive
    Clock::time_point retry_at{};
  };

  RedisClusterOptions options;
  std::vector<std::unique_ptr<Node>> nodes;  // every node seen; never shrinks
  std::array<int32_t, kClusterSlots> slot_owner;  // index into nodes, -1 = unassigned
  bool map_stale = false;
  Clock::time_point last_refresh{};
  size_t refresh_cursor = 0;
  RedisClusterStats stats;

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
        return Unauthenticated("l3: AUTH at " + n.addr + " refused: " +
                               std::string(ReplyText(r.get())));
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
    ReplyPtr r(static_cast<redisReply*>(redisCommandArgv(
        n.ctx.get(), static_cast<int>(argv.size()), argv.data(), lens.data())));
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

  // Runs `reqs` to completion, redirections and retries included, by `deadline`. Each round
  // groups the pending requests by node, sends every node's batch (pipelined), then reads the
  // replies; MOVED, ASK and a failed node put a request back for the next round.
  std::vector<Response> Execute(std::span<const Request> reqs, Clock::time_point deadline) {
    BeginCall();
    SigpipeGuard no_sigpipe;
    std::vector<Response> out(reqs.size());
    std::vector<int> attempts(reqs.size(), 0);
    std::vector<int> ask_node(reqs.size(), -1);
    std::vector<size_t> pending(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) pending[i] = i;

    while (!pending.empty()) {
      if (Left(deadline).count() <= 0) {
        for (size_t i : pending) out[i].status = DeadlineExceeded("l3: deadline passed");
        break;
      }
      MaybeRefresh(deadline);
      std::map<int, std::vector<size_t>> by_node;
      for (size_t i : pending) {
        const int node = ask_node[i] >= 0 ? ask_node[i] : slot_owner[reqs[i].slot];
        if (node < 0) {
          out[i].status = Unavailable("l3: slot " + std::to_string(reqs[i].slot) +
                                      " has no master in the slot map");
          map_stale = true;
          continue;
        }
        by_node[node].push_back(i);
      }
      pending.clear();

      // Send every node's batch before reading any reply, so the nodes work in parallel.
      std::vector<int> sent;
      for (auto& [node, idx] : by_node) {
        Node& n = *nodes[node];
        Status st = Connect(n, deadline);
        if (st.ok()) {
          for (size_t i : idx) {
            if (ask_node[i] >= 0) {
              const char* asking = "ASKING";
              const size_t len = 6;
              redisAppendCommandArgv(n.ctx.get(), 1, &asking, &len);
              ++stats.commands;
            }
            std::vector<const char*> argv;
            std::vector<size_t> lens;
            for (auto a : reqs[i].argv) {
              argv.push_back(a.data());
              lens.push_back(a.size());
            }
            redisAppendCommandArgv(n.ctx.get(), static_cast<int>(argv.size()), argv.data(),
                                   lens.data());
            ++stats.commands;
          }
          int done = 0;
          while (!done && redisBufferWrite(n.ctx.get(), &done) == REDIS_OK) {
          }
          if (!done) {  // as a lost connection below: retried
            const bool timed_out = TimedOut();
            const Status lost = Unavailable("l3: " + n.addr + ": " + n.ctx->errstr);
            Disconnect(n, timed_out);
            for (size_t i : idx) {
              out[i].status = lost;
              if (++attempts[i] <= options.max_redirects) pending.push_back(i);
            }
            continue;
          }
        }
        if (!st.ok()) {  // down, in backoff, or AUTH refused: this call fails for these keys
          for (size_t i : idx) out[i].status = st;
          continue;
        }
        sent.push_back(node);
      }

      for (int node : sent) {
        Node& n = *nodes[node];
        Status lost;  // set once the connection fails: the rest of the batch has no replies
        for (size_t i : by_node[node]) {
          const bool asked = ask_node[i] >= 0;
          ask_node[i] = -1;
          ReplyPtr r;
          for (int k = asked ? 2 : 1; k > 0 && lost.ok(); --k) {  // ASKING's +OK first
            void* raw = nullptr;
            if (redisGetReply(n.ctx.get(), &raw) != REDIS_OK) {
              const bool timed_out = TimedOut();
              lost = Unavailable("l3: " + n.addr + ": " + n.ctx->errstr);
              Disconnect(n, timed_out);
              break;
            }
            r.reset(static_cast<redisReply*>(raw));
          }
          if (!lost.ok()) {
            // Retried next round: the map may name a promoted replica by then; else the call
            // fails with the node's state (in backoff).
            out[i].status = lost;
            if (++attempts[i] <= options.max_redirects) pending.push_back(i);
            continue;
          }
          Classify(i, std::move(r), reqs[i], attempts[i], ask_node[i], out[i], pending);
        }
      }
    }
    for (const auto& o : out) stats.errors += !o.status.ok();
    return out;
  }

  // Sorts one reply: a result, or a redirection that puts request `i` back into `pending`.
  void Classify(size_t i, ReplyPtr r, const Request& req, int& attempts, int& ask_node,
                Response& out, std::vector<size_t>& pending) {
    if (r->type != REDIS_REPLY_ERROR) {
      out.status = Status::Ok();
      out.reply = std::move(r);
      return;
    }
    const std::string_view err = ReplyText(r.get());
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
    return std::move(Execute(std::span<const Request>(&r, 1), deadline)[0]);
  }

  std::vector<KeyResult> Multi(std::string_view cmd, std::span<const std::string> keys,
                               Clock::time_point deadline) {
    std::vector<Request> reqs(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      reqs[i].slot = KeySlot(keys[i]);
      reqs[i].argv = {cmd, keys[i]};
    }
    std::vector<Response> resp = Execute(reqs, deadline);
    std::vector<KeyResult> out(keys.size());
    const bool get = cmd == "GET";
    for (size_t i = 0; i < keys.size(); ++i) {
      Response& r = resp[i];
      if (!r.status.ok()) {
        out[i].status = std::move(r.status);
      } else if (get && r.reply->type == REDIS_REPLY_STRING) {
        out[i].found = true;
        out[i].value.assign(r.reply->str, r.reply->len);
      } else if (get && r.reply->type == REDIS_REPLY_NIL) {
        out[i].found = false;
      } else if (!get && r.reply->type == REDIS_REPLY_INTEGER) {
        out[i].found = r.reply->integer > 0;
      } else {
        out[i].status = Internal("l3: unexpected reply type " + std::to_string(r.reply->type) +
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
  const auto deadline =
      Clock::now() + impl->options.connect_timeout * static_cast<int64_t>(impl->nodes.size()) +
      impl->options.command_timeout;
  HIQ_RETURN_IF_ERROR(impl->Refresh(deadline));
  return RedisCluster(std::move(impl));
}

StatusOr<std::optional<std::string>> RedisCluster::Get(std::string_view key, Deadline deadline) {
  Response r = impl_->One({"GET", key}, impl_->DeadlineOf(deadline));
  if (!r.status.ok()) return r.status;
  if (r.reply->type == REDIS_REPLY_NIL) return std::optional<std::string>();
  if (r.reply->type != REDIS_REPLY_STRING) return Internal("l3: GET: unexpected reply type");
  return std::optional<std::string>(std::string(r.reply->str, r.reply->len));
}

StatusOr<bool> RedisCluster::Exists(std::string_view key, Deadline deadline) {
  Response r = impl_->One({"EXISTS", key}, impl_->DeadlineOf(deadline));
  if (!r.status.ok()) return r.status;
  if (r.reply->type != REDIS_REPLY_INTEGER) return Internal("l3: EXISTS: unexpected reply type");
  return r.reply->integer > 0;
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
  if (r.reply->type != REDIS_REPLY_STATUS) return Internal("l3: SET: unexpected reply type");
  return Status::Ok();
}

StatusOr<bool> RedisCluster::Del(std::string_view key, Deadline deadline) {
  Response r = impl_->One({"DEL", key}, impl_->DeadlineOf(deadline));
  if (!r.status.ok()) return r.status;
  if (r.reply->type != REDIS_REPLY_INTEGER) return Internal("l3: DEL: unexpected reply type");
  return r.reply->integer > 0;
}

std::vector<KeyResult> RedisCluster::MultiGet(std::span<const std::string> keys,
                                              Deadline deadline) {
  return impl_->Multi("GET", keys, impl_->DeadlineOf(deadline));
}

std::vector<KeyResult> RedisCluster::MultiExists(std::span<const std::string> keys,
                                                 Deadline deadline) {
  return impl_->Multi("EXISTS", keys, impl_->DeadlineOf(deadline));
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
