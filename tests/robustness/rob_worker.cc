// hiq_rob_worker: a client process for the robustness tests, driven by flags.
//
//   hiq_rob_worker --target T --mode hold [--pin-blocks N]
//     Registers pool A (with event slots) and pool B of namespace "rob-death". Backs up N blocks
//     through A, then leaves work on A that can never start: an async Restore of those N blocks
//     waiting for event 0 (pins them) and an async Backup of 4 more waiting for event 1 (keeps
//     them reserved, state kWriting). Prints "holding" and then streams sync backups and
//     restores through B until it is killed; "streaming" after the first round.
//
//   hiq_rob_worker --target T --mode connections --socket PATH --count N
//     Opens N connections to the unix socket PATH and sends nothing on them (T is not used).
//     After a second, prints "connections open=K closed=C" (C: those the daemon closed), then
//     holds them until killed.
//
//   hiq_rob_worker --target T --mode load --threads M --seconds S --universe U --out FILE
//     M threads, each with its own HOST pool of namespace "rob-load" on one shared Client, run a
//     random mix of Backup / Lookup / Restore / Evict of blocks drawn from U logical blocks (data
//     and keys are functions of the block number, so every process can verify every block) for
//     S seconds. Every restored block is checked against DESIGN.md's bound. Writes one line
//     "<op> <latency us>" per call to FILE and prints a summary line:
//     "ops=N errors=E corrupt=C rejected=R partial_restores=P ...". Exit 0 when E = C = 0.
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
#include <string>
#include <thread>

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
  std::vector<int> fds;
  for (size_t i = 0; i < count; ++i) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      ::close(fd);
      continue;
    }
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(1s);
  std::vector<pollfd> p;
  for (int fd : fds) p.push_back({fd, POLLRDHUP, 0});
  ::poll(p.data(), p.size(), 0);
  size_t closed = 0;
  for (const pollfd& x : p) closed += (x.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  std::cout << "connections open=" << fds.size() - closed << " closed=" << closed
            << " failed=" << count - fds.size() << std::endl;
  for (;;) std::this_thread::sleep_for(1h);
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
  std::cerr << "worker: unknown mode " << a["mode"] << "\n";
  return 1;
}

}  // namespace
}  // namespace hiqcache::rob

int main(int argc, char** argv) { return hiqcache::rob::Main(argc, argv); }
