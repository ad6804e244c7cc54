// hiq_rob_worker: a client process for the robustness tests, driven by flags.
//
//   hiq_rob_worker --target T --mode hold [--pin-blocks N]
//     Registers pool A (with event slots) and pool B of namespace "rob-death". Backs up N blocks
//     through A, then leaves work on A that can never start: an async Restore of those N blocks
//     waiting for event 0 (pins them) and an async Backup of 4 more waiting for event 1 (keeps
//     them reserved, state kWriting). Prints "holding" and then streams sync backups and
//     restores through B until it is killed; "streaming" after the first round.
//
//   hiq_rob_worker --target T --mode connections --socket PATH --count N [--garbage 1]
//     Opens N connections to the unix socket PATH and sends nothing on them (T is not used), or
//     with --garbage 1 a line that is no HTTP/2 (the daemon's gRPC closes such a connection).
//     After a second, prints "connections open=K closed=C" (C: those the daemon closed), then
//     holds them until killed.
//
//   hiq_rob_worker --target T --mode stall --socket PATH --connections C --streams S --announce B
//                  [--session 1]
//     With --session 1, first opens a session with the daemon at T and holds it (its connections
//     then go to the daemon's full gRPC server, not the sessionless one). Speaks HTTP/2 by hand on
//     C connections to the unix socket PATH: on each, S GetStats calls whose one message announces
//     B bytes, of which it sends all but the last (as far as the daemon's flow-control windows let
//     it), then stalls. After 3 s without a window to send into, prints "stalled sent=N resets=R
//     ended=E" (payload bytes the daemon accepted, RST_STREAM and GOAWAY frames, calls the daemon
//     ended early), then holds the connections (answering PINGs and SETTINGS) until killed.
//
//   hiq_rob_worker --target T --mode load --threads M --seconds S --universe U --out FILE
//     M threads, each with its own HOST pool of namespace "rob-load" on one shared Client, run a
//     random mix of Backup / Lookup / Restore / Evict of blocks drawn from U logical blocks (data
//     and keys are functions of the block number, so every process can verify every block) for
//     S seconds. Every restored block is checked against docs/design.md's bound. Writes one line
//     "<op> <latency us>" per call to FILE and prints a summary line:
//     "ops=N errors=E corrupt=C rejected=R partial_restores=P ...". Exit 0 when E = C = 0.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "hiqcache/session.h"
#include "rob_util.h"

namespace hiqcache::rob {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr uint32_t kBt = 16;
constexpr uint64_t kLoadSeed = 7001;
constexpr uint64_t kHoldSeed = 9001;

Geometry RobGeometry() { return it::Geom(4, 4, 64); }

int Hold(const std::map<std::string, std::string>& a) {
  const uint32_t pin_blocks = static_cast<uint32_t>(std::stoul(a.at("pin-blocks")));
  auto client = it::Connect(a.at("target"));
  if (!client) return 1;
  it::PoolOptions o;
  o.model = "rob-death";
  o.geometry = RobGeometry();
  o.block_tokens = kBt;
  o.num_rows = (pin_blocks + 4) * kBt;
  o.event_slots = 4;
  auto pa = it::MakePool(*client, o);
  o.num_rows = 8 * kBt;
  o.event_slots = 0;
  auto pb = it::MakePool(*client, o);
  if (!pa.ok() || !pb.ok()) {
    std::cerr << "worker: register: " << (pa.ok() ? pb.status() : pa.status()).ToString() << "\n";
    return 1;
  }
  const std::vector<uint32_t> rows = it::RowRange(0, pin_blocks * kBt);
  const std::vector<BlockKey> keys = IndependentKeys(kHoldSeed, 0, pin_blocks);
  it::FillRows(pa->kv, kHoldSeed, rows, kBt);
  for (uint32_t i = 0; i < pin_blocks; i += 8) {
    const uint32_t n = std::min(8u, pin_blocks - i);
    BackupResult b = client->Backup(pa->handle, std::span(keys).subspan(i, n),
                                    std::span(rows).subspan(i * kBt, n * kBt));
    if (b.held() != n) {
      std::cerr << "worker: backup held " << b.held() << " of " << n << ": " << b.status.ToString()
                << "\n";
      return 1;
    }
  }
  RestoreOptions ro;
  ro.wait_event = 0;  // never signalled
  ro.sync = false;
  RestoreResult r = client->Restore(pa->handle, keys, rows, ro);
  if (!r.status.ok() || r.restored_blocks != pin_blocks) {
    std::cerr << "worker: async restore: " << r.restored_blocks << " " << r.status.ToString()
              << "\n";
    return 1;
  }
  BackupOptions bo;
  bo.wait_event = 1;  // never signalled
  bo.sync = false;
  const std::vector<BlockKey> pending = IndependentKeys(kHoldSeed, 1000000, 4);
  BackupResult pb_async =
      client->Backup(pa->handle, pending, std::span(rows).subspan(0, 4 * kBt), bo);
  if (!pb_async.status.ok()) {
    std::cerr << "worker: async backup: " << pb_async.status.ToString() << "\n";
    return 1;
  }
  std::cout << "holding" << std::endl;
  // Stream through B until killed: the kill lands in the middle of a backup or a restore.
  const std::vector<uint32_t> src = it::RowRange(0, 4 * kBt), dst = it::RowRange(4 * kBt, 4 * kBt);
  for (uint64_t round = 0;; ++round) {
    const std::vector<BlockKey> k = IndependentKeys(kHoldSeed + 1, (round % 16) * 4, 4);
    it::FillRows(pb->kv, kHoldSeed + 1, src, kBt, static_cast<uint32_t>((round % 16) * 4));
    client->Backup(pb->handle, k, src);
    client->Restore(pb->handle, k, dst);
    if (round == 0) std::cout << "streaming" << std::endl;
  }
}

enum Op { kBackup = 0, kLookup = 1, kRestore = 2, kEvict = 3, kOps = 4 };
const char* kOpNames[kOps] = {"backup", "lookup", "restore", "evict"};

struct ThreadStats {
  std::vector<std::pair<uint8_t, uint32_t>> samples;  // op, latency us
  uint64_t errors = 0, corrupt = 0, rejected = 0, partial_restores = 0, stored = 0;
  uint64_t restored_blocks = 0, lookup_hits = 0, evicted = 0, heads_checked = 0;
  std::string first_error;
};

void LoadThread(Client* client, uint32_t index, uint32_t universe, Clock::time_point end,
                ThreadStats* st) {
  it::PoolOptions o;
  o.model = "rob-load";
  o.geometry = RobGeometry();
  o.block_tokens = kBt;
  o.num_rows = 8 * kBt;
  // A daemon that is still busy starting (sanitizer builds on a loaded machine) may not take the
  // connection at once: registration is retried while the daemon is unreachable.
  auto pool = it::MakePool(*client, o);
  for (int i = 0; i < 20 && !pool.ok() && pool.status().code() == StatusCode::kUnavailable; ++i) {
    std::this_thread::sleep_for(500ms);
    pool = it::MakePool(*client, o);
  }
  if (!pool.ok()) {
    st->errors++;
    st->first_error = "register: " + pool.status().ToString();
    return;
  }
  std::mt19937_64 rng(it::Mix(static_cast<uint64_t>(::getpid()), index));
  const std::vector<uint32_t> src = it::RowRange(0, 4 * kBt), dst = it::RowRange(4 * kBt, 4 * kBt);
  auto error = [&](const std::string& what) {
    if (st->errors++ == 0) st->first_error = what;
  };
  while (Clock::now() < end) {
    const uint32_t dice = static_cast<uint32_t>(rng() % 100);
    const Op op = dice < 35 ? kBackup : dice < 60 ? kLookup : dice < 90 ? kRestore : kEvict;
    const uint32_t n = 1 + static_cast<uint32_t>(rng() % 4);
    const uint32_t first = static_cast<uint32_t>(rng() % (universe - n));
    const std::vector<BlockKey> keys = IndependentKeys(kLoadSeed, first, n);
    // Block i of a call is logical block first + i (FillRows' block-major layout).
    const std::span<const uint32_t> src_rows = std::span(src).first(n * kBt);
    const std::span<const uint32_t> dst_rows = std::span(dst).first(n * kBt);
    if (op == kBackup) it::FillRows(pool->kv, kLoadSeed, src_rows, kBt, first);
    if (op == kRestore) it::SentinelRows(pool->kv, dst_rows);
    uint32_t restored = 0;
    const auto t0 = Clock::now();
    switch (op) {
      case kBackup: {
        BackupResult b = client->Backup(pool->handle, keys, src_rows);
        if (!b.status.ok()) error("backup: " + b.status.ToString());
        for (BlockStatus s : b.blocks) {
          st->rejected += s == BlockStatus::kRejected;
          st->stored += s == BlockStatus::kStored;
        }
        break;
      }
      case kLookup: {
        LookupResult l = client->Lookup(pool->handle, keys);
        if (!l.status.ok()) error("lookup: " + l.status.ToString());
        st->lookup_hits += l.prefix_blocks;
        break;
      }
      case kRestore: {
        RestoreResult r = client->Restore(pool->handle, keys, dst_rows);
        if (!r.status.ok()) error("restore: " + r.status.ToString());
        restored = r.restored_blocks;
        st->restored_blocks += restored;
        st->partial_restores += restored < n;
        break;
      }
      case kEvict: {
        auto e = client->Evict(pool->handle, keys);
        if (!e.ok())
          error("evict: " + e.status().ToString());
        else
          st->evicted += *e;
        break;
      }
      default:
        break;
    }
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0);
    st->samples.emplace_back(static_cast<uint8_t>(op), static_cast<uint32_t>(us.count()));
    if (restored > 0) {
      it::CheckResult c = it::CheckRows(pool->kv, kLoadSeed, dst_rows.first(restored * kBt), kBt,
                                        /*exact=*/false, first);
      st->heads_checked += c.heads_checked;
      if (!c.ok()) {
        if (st->corrupt++ == 0 && st->first_error.empty()) st->first_error = "corrupt: " + c.first;
      }
    }
  }
  (void)client->ReleasePool(pool->handle);
}

int Load(const std::map<std::string, std::string>& a) {
  const uint32_t threads = static_cast<uint32_t>(std::stoul(a.at("threads")));
  const double seconds = std::stod(a.at("seconds"));
  const uint32_t universe = static_cast<uint32_t>(std::stoul(a.at("universe")));
  auto client = it::Connect(a.at("target"), 10s);
  if (!client) return 1;
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(seconds));
  std::vector<ThreadStats> stats(threads);
  std::vector<std::thread> pool;
  for (uint32_t t = 0; t < threads; ++t) {
    pool.emplace_back(LoadThread, client.get(), t, universe, end, &stats[t]);
  }
  for (auto& t : pool) t.join();
  ThreadStats sum;
  std::ofstream out(a.at("out"));
  for (const ThreadStats& s : stats) {
    for (const auto& [op, us] : s.samples) out << kOpNames[op] << " " << us << "\n";
    sum.errors += s.errors;
    sum.corrupt += s.corrupt;
    sum.rejected += s.rejected;
    sum.partial_restores += s.partial_restores;
    sum.stored += s.stored;
    sum.restored_blocks += s.restored_blocks;
    sum.lookup_hits += s.lookup_hits;
    sum.evicted += s.evicted;
    sum.heads_checked += s.heads_checked;
    sum.samples.insert(sum.samples.end(), s.samples.begin(), s.samples.end());
    if (sum.first_error.empty()) sum.first_error = s.first_error;
  }
  out.close();
  std::cout << "ops=" << sum.samples.size() << " errors=" << sum.errors
            << " corrupt=" << sum.corrupt << " rejected=" << sum.rejected
            << " partial_restores=" << sum.partial_restores << " stored=" << sum.stored
            << " restored_blocks=" << sum.restored_blocks << " lookup_hits=" << sum.lookup_hits
            << " evicted=" << sum.evicted << " heads_checked=" << sum.heads_checked << std::endl;
  if (!sum.first_error.empty()) std::cerr << "worker: first problem: " << sum.first_error << "\n";
  return sum.errors == 0 && sum.corrupt == 0 ? 0 : 2;
}

int Connections(const std::map<std::string, std::string>& a) {
  const std::string path = a.at("socket");
  const size_t count = std::stoul(a.at("count"));
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
  // A few descriptors kept spare while the flood may use up the rest, closed before the report:
  // the sanitizer runtimes of a checking build open pipes and files as the report is written.
  std::vector<int> spare;
  for (int i = 0; i < 4; ++i) spare.push_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  std::vector<int> fds;
  for (size_t i = 0; i < count; ++i) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      ::close(fd);
      continue;
    }
    if (a.count("garbage") && a.at("garbage") == "1") {
      (void)!::send(fd, "GET / HTTP/1.1\r\n\r\n", 18, MSG_NOSIGNAL);
    }
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(1s);
  for (int fd : spare) {
    if (fd >= 0) ::close(fd);
  }
  std::vector<pollfd> p;
  for (int fd : fds) p.push_back({fd, POLLRDHUP, 0});
  ::poll(p.data(), p.size(), 0);
  size_t closed = 0;
  for (const pollfd& x : p) closed += (x.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  std::cout << "connections open=" << fds.size() - closed << " closed=" << closed
            << " failed=" << count - fds.size() << std::endl;
  for (;;) std::this_thread::sleep_for(1h);
}

// One HTTP/2 connection of the "stall" mode: frames by hand (RFC 9113), HPACK literals only.
class StallConnection {
 public:
  bool Open(const std::string& path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::strncpy(sa.sun_path, path.c_str(), sizeof(sa.sun_path) - 1);
    if (fd_ < 0 || ::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) return false;
    const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    return Write(preface) && Frame(0x4, 0, 0, "");  // our (empty) SETTINGS
  }
  // Opens `streams` GetStats calls, each announcing a message of `announce` bytes.
  bool Start(int streams, uint64_t announce) {
    for (int i = 0; i < streams; ++i) {
      const uint32_t id = 2 * static_cast<uint32_t>(i) + 1;
      std::string h;
      h += '\x83';                                       // :method POST
      h += '\x86';                                       // :scheme http
      Literal(&h, 0x04, "/hiqcache.v1.Cache/GetStats");  // :path
      Literal(&h, 0x01, "localhost");                    // :authority
      h += '\x0f';
      Literal(&h, 0x10, "application/grpc");  // content-type (static index 31)
      h += '\x00';
      Str(&h, "te");
      Str(&h, "trailers");
      if (!Frame(0x1, 0x4, id, h)) return false;  // HEADERS, END_HEADERS
      Stream s;
      s.id = id;
      s.left = announce + 5 - 1;  // the 5-byte gRPC prefix and all but the last byte
      s.window = initial_window_;
      s.prefix_sent = false;
      s.announce = announce;
      streams_.push_back(s);
    }
    return true;
  }
  // Sends what the windows allow; false when nothing could be sent.
  bool Pump() {
    Read();
    bool sent = false;
    for (Stream& s : streams_) {
      if (ended_.count(s.id) != 0) continue;  // refused: the daemon would discard the rest
      while (s.left > 0 && s.window > 0 && conn_window_ > 0) {
        uint64_t n = std::min<uint64_t>(
            {s.left, uint64_t{16384}, uint64_t(s.window), uint64_t(conn_window_)});
        std::string data(n, '\0');
        if (!s.prefix_sent) {
          data[0] = 0;
          for (int b = 0; b < 4; ++b) data[1 + b] = static_cast<char>(s.announce >> (24 - 8 * b));
          s.prefix_sent = true;
        }
        if (!Frame(0x0, 0, s.id, data)) return false;
        s.left -= n;
        s.window -= static_cast<int64_t>(n);
        conn_window_ -= static_cast<int64_t>(n);
        sent_ += n;
        sent = true;
      }
    }
    return sent;
  }
  // Answers SETTINGS and PING, takes WINDOW_UPDATEs; non-blocking.
  void Read() {
    char buf[65536];
    for (;;) {
      ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n <= 0) break;
      in_.append(buf, static_cast<size_t>(n));
    }
    while (in_.size() >= 9) {
      const uint32_t len = (uint8_t(in_[0]) << 16) | (uint8_t(in_[1]) << 8) | uint8_t(in_[2]);
      if (in_.size() < 9 + len) break;
      const uint8_t type = uint8_t(in_[3]), flags = uint8_t(in_[4]);
      const uint32_t id = ((uint8_t(in_[5]) & 0x7f) << 24) | (uint8_t(in_[6]) << 16) |
                          (uint8_t(in_[7]) << 8) | uint8_t(in_[8]);
      const std::string payload = in_.substr(9, len);
      in_.erase(0, 9 + len);
      if (type == 0x4 && !(flags & 1)) {  // SETTINGS: INITIAL_WINDOW_SIZE, then ACK
        for (size_t i = 0; i + 6 <= payload.size(); i += 6) {
          const uint16_t key = (uint8_t(payload[i]) << 8) | uint8_t(payload[i + 1]);
          const uint32_t v = (uint8_t(payload[i + 2]) << 24) | (uint8_t(payload[i + 3]) << 16) |
                             (uint8_t(payload[i + 4]) << 8) | uint8_t(payload[i + 5]);
          if (key == 0x4) {
            for (Stream& s : streams_) s.window += int64_t{v} - initial_window_;
            initial_window_ = v;
          }
        }
        Frame(0x4, 0x1, 0, "");
      } else if (type == 0x6 && !(flags & 1)) {  // PING: ACK
        Frame(0x6, 0x1, 0, payload);
      } else if (type == 0x8 && payload.size() == 4) {  // WINDOW_UPDATE
        const uint32_t inc = ((uint8_t(payload[0]) & 0x7f) << 24) | (uint8_t(payload[1]) << 16) |
                             (uint8_t(payload[2]) << 8) | uint8_t(payload[3]);
        if (id == 0) {
          conn_window_ += inc;
        } else {
          for (Stream& s : streams_) {
            if (s.id == id) s.window += inc;
          }
        }
      } else if (type == 0x7 || type == 0x3) {  // GOAWAY, RST_STREAM
        ++resets_;
        if (type == 0x3) ended_.insert(id);
      } else if (type == 0x1 && (flags & 0x1) && id != 0) {  // HEADERS ending the stream
        ended_.insert(id);  // trailers: the daemon answered (refused) the call
      }
    }
  }
  uint64_t sent() const { return sent_; }
  uint64_t resets() const { return resets_; }
  // Streams the daemon ended (trailers or RST_STREAM) before their message was complete.
  size_t ended() const { return ended_.size(); }

 private:
  struct Stream {
    uint32_t id = 0;
    uint64_t left = 0, announce = 0;
    int64_t window = 0;
    bool prefix_sent = false;
  };
  static void Str(std::string* out, const std::string& v) {
    out->push_back(static_cast<char>(v.size()));  // < 127, no Huffman
    *out += v;
  }
  static void Literal(std::string* out, uint8_t name_index, const std::string& v) {
    out->push_back(static_cast<char>(name_index));  // without indexing, indexed name
    Str(out, v);
  }
  bool Frame(uint8_t type, uint8_t flags, uint32_t id, const std::string& payload) {
    std::string f(9, '\0');
    f[0] = static_cast<char>(payload.size() >> 16);
    f[1] = static_cast<char>(payload.size() >> 8);
    f[2] = static_cast<char>(payload.size());
    f[3] = static_cast<char>(type);
    f[4] = static_cast<char>(flags);
    for (int b = 0; b < 4; ++b) f[5 + b] = static_cast<char>(id >> (24 - 8 * b));
    return Write(f + payload);
  }
  bool Write(const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(fd_, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  int fd_ = -1;
  std::string in_;
  std::vector<Stream> streams_;
  int64_t initial_window_ = 65535;
  int64_t conn_window_ = 65535;
  uint64_t sent_ = 0, resets_ = 0;
  std::set<uint32_t> ended_;
};

int Stall(const std::map<std::string, std::string>& a) {
  const int conns = std::stoi(a.at("connections"));
  const int streams = std::stoi(a.at("streams"));
  const uint64_t announce = std::stoull(a.at("announce"));
  std::unique_ptr<Session> session;
  if (a.count("session") && a.at("session") == "1") {
    auto opened = Session::Open(a.at("target"), std::chrono::milliseconds(5000));
    if (!opened.ok()) {
      std::cerr << "worker: session: " << opened.status().ToString() << "\n";
      return 1;
    }
    session = std::move(opened).value();
  }
  std::vector<std::unique_ptr<StallConnection>> c;
  for (int i = 0; i < conns; ++i) {
    auto x = std::make_unique<StallConnection>();
    if (!x->Open(a.at("socket")) || !x->Start(streams, announce)) {
      std::cerr << "worker: connection " << i << " failed\n";
      continue;
    }
    c.push_back(std::move(x));
  }
  auto idle_since = Clock::now();
  while (Clock::now() - idle_since < 3s) {
    bool any = false;
    for (auto& x : c) any = x->Pump() || any;
    if (any)
      idle_since = Clock::now();
    else
      std::this_thread::sleep_for(10ms);
  }
  uint64_t sent = 0, resets = 0, ended = 0;
  for (auto& x : c) {
    sent += x->sent();
    resets += x->resets();
    ended += x->ended();
  }
  std::cout << "stalled sent=" << sent << " resets=" << resets << " ended=" << ended
            << " connections=" << c.size() << std::endl;
  for (;;) {
    for (auto& x : c) x->Read();
    std::this_thread::sleep_for(100ms);
  }
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> a = {{"pin-blocks", "40"},
                                          {"threads", "4"},
                                          {"seconds", "10"},
                                          {"universe", "2000"},
                                          {"out", "/dev/null"}};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) {
      std::cerr << "worker: bad argument " << k << "\n";
      return 1;
    }
    a[k.substr(2)] = argv[i + 1];
  }
  if (!a.count("target") || !a.count("mode")) {
    std::cerr << "worker: --target and --mode are required\n";
    return 1;
  }
  if (a["mode"] == "hold") return Hold(a);
  if (a["mode"] == "load") return Load(a);
  if (a["mode"] == "connections") return Connections(a);
  if (a["mode"] == "stall") return Stall(a);
  std::cerr << "worker: unknown mode " << a["mode"] << "\n";
  return 1;
}

}  // namespace
}  // namespace hiqcache::rob

int main(int argc, char** argv) { return hiqcache::rob::Main(argc, argv); }
