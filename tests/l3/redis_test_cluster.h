// RedisTestCluster: a real Redis Cluster on loopback for the L3 tests: 6 redis-server processes
// (3 masters + 3 replicas) formed with `redis-cli --cluster create --cluster-replicas 1`, each
// with its own data dir under /tmp, ports chosen free at runtime in [20000, 40000) (client port
// and cluster-bus port; never 6379, so a system redis is neither used nor disturbed), and a short
// cluster-node-timeout so that a killed master's replica takes over within seconds.
//
// Every server runs in one process group that the destructor kills (SIGKILL) and reaps; each
// also gets PR_SET_PDEATHSIG, so none outlives a crashed test. Admin commands go over hiredis
// directly (Admin). Header-only; not thread-safe (one test thread drives it).
#pragma once

#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace hiqcache::l3_test {

// The path of `name` on PATH (or /usr/bin, /usr/sbin), or "" when absent.
inline std::string FindProgram(const std::string& name) {
  std::string path = std::getenv("PATH") != nullptr ? std::getenv("PATH") : "";
  path += ":/usr/bin:/usr/sbin:/usr/local/bin";
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    const std::string p = dir + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

inline bool PortFree(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
  ::close(fd);
  return ok;
}

// A reply flattened for tests: type, text (string, status, error), integer, array elements.
struct AdminReply {
  int type = 0;  // REDIS_REPLY_*; 0: no reply (connection failed)
  std::string str;
  long long integer = 0;
  std::vector<AdminReply> elements;
  bool ok() const { return type != 0 && type != REDIS_REPLY_ERROR; }
};

inline AdminReply Flatten(const redisReply* r) {
  AdminReply out;
  out.type = r->type;
  out.integer = r->integer;
  if (r->str != nullptr) out.str.assign(r->str, r->len);
  for (size_t i = 0; i < r->elements; ++i) out.elements.push_back(Flatten(r->element[i]));
  return out;
}

struct ClusterNode {
  int port = 0;
  int bus_port = 0;
  pid_t pid = -1;
  std::string dir;
  std::string id;         // cluster node id, after Start
  bool master = false;    // at Start
  std::string master_id;  // replicas: whose
  std::string addr() const { return "127.0.0.1:" + std::to_string(port); }
};

struct ClusterOptions {
  std::string user;      // ACL user created on every node ("" = none)
  std::string password;  // its password; with a user, the default user is switched off
  // Long enough that nodes of a loaded machine (every core busy elsewhere) are not taken for
  // failed between their pings; a killed master's replica takes over within seconds still.
  int node_timeout_ms = 3000;
};

class RedisTestCluster {
 public:
  static bool Available() {
    return !FindProgram("redis-server").empty() && !FindProgram("redis-cli").empty();
  }

  explicit RedisTestCluster(ClusterOptions o = {}) : options_(std::move(o)) {}
  ~RedisTestCluster() { Stop(); }
  RedisTestCluster(const RedisTestCluster&) = delete;
  RedisTestCluster& operator=(const RedisTestCluster&) = delete;

  // Starts the 6 servers, forms the cluster and waits until every node says cluster_state:ok
  // and every replica is in sync. Returns "" or what failed.
  std::string Start(std::chrono::seconds timeout = std::chrono::seconds(30)) {
    static std::atomic<int> counter{0};
    const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(counter++);
    root_ = "/tmp/hiq-l3-" + tag;
    std::filesystem::create_directories(root_);
    const int base = PickPorts();
    if (base < 0) return "no free ports";
    for (int i = 0; i < 6; ++i) {
      ClusterNode n;
      n.port = base + i;
      n.bus_port = base + 6 + i;
      n.dir = root_ + "/n" + std::to_string(i);
      std::filesystem::create_directories(n.dir);
      nodes_.push_back(n);
    }
    for (auto& n : nodes_) {
      if (!Launch(n)) return "cannot start redis-server on port " + std::to_string(n.port);
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto& n : nodes_) {
      while (Admin(n.port, {"PING"}).str != "PONG") {
        if (std::chrono::steady_clock::now() > deadline) {
          return "redis-server on port " + std::to_string(n.port) + " does not answer: " + Log(n);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    std::vector<std::string> create = {FindProgram("redis-cli")};
    AddAuth(&create);
    create.push_back("--cluster");
    create.push_back("create");
    for (auto& n : nodes_) create.push_back(n.addr());
    for (const char* a : {"--cluster-replicas", "1", "--cluster-yes"}) create.push_back(a);
    std::string out;
    if (Run(create, &out) != 0) return "redis-cli --cluster create failed: " + out;
    if (!WaitHealthy(deadline)) return "cluster did not become healthy";
    return LoadTopology();
  }

  // Waits until every running node says cluster_state:ok, knows every running node, and every
  // running replica's link to its master is up.
  bool WaitHealthy(std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      bool ok = true;
      int running = 0;
      for (auto& n : nodes_) running += n.pid > 0;
      for (auto& n : nodes_) {
        if (n.pid <= 0) continue;
        const std::string info = Admin(n.port, {"CLUSTER", "INFO"}).str;
        ok = ok && info.find("cluster_state:ok") != std::string::npos;
        const AdminReply repl = Admin(n.port, {"INFO", "replication"});
        if (repl.str.find("role:slave") != std::string::npos) {
          ok = ok && repl.str.find("master_link_status:up") != std::string::npos;
        }
        ok = ok && CountNodes(n.port) >= running;
      }
      if (ok) return true;
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // Reads each running node's id and role from its own line ("myself") of CLUSTER NODES: what
  // other nodes say may lag behind by a gossip round. "" or what failed.
  std::string LoadTopology() {
    for (auto& n : nodes_) {
      if (n.pid <= 0) continue;
      const AdminReply r = Admin(n.port, {"CLUSTER", "NODES"});
      std::stringstream ss(r.str);
      std::string line;
      bool found = false;
      while (std::getline(ss, line)) {
        std::stringstream ls(line);
        std::string id, addr, flags, master;
        ls >> id >> addr >> flags >> master;
        if (flags.find("myself") == std::string::npos) continue;
        n.id = id;
        n.master = flags.find("master") != std::string::npos;
        n.master_id = n.master ? "" : master;
        found = true;
      }
      if (!found) return "node " + n.addr() + " does not describe itself: " + r.str;
    }
    return "";
  }

  // One command at the node on `port` (authenticated as the cluster's user).
  AdminReply Admin(int port, const std::vector<std::string>& args) const {
    timeval tv{2, 0};
    std::unique_ptr<redisContext, void (*)(redisContext*)> c(
        redisConnectWithTimeout("127.0.0.1", port, tv), redisFree);
    if (c == nullptr || c->err != 0) return {};
    redisSetTimeout(c.get(), timeval{10, 0});
    if (!options_.password.empty()) {
      AdminReply a = Command(
          c.get(), options_.user.empty()
                       ? std::vector<std::string>{"AUTH", options_.password}
                       : std::vector<std::string>{"AUTH", options_.user, options_.password});
      if (!a.ok()) return a;
    }
    return Command(c.get(), args);
  }

  // The node that serves `slot` as a master, per the first running node's CLUSTER SLOTS.
  const ClusterNode* MasterOfSlot(int slot) const {
    for (const auto& n : nodes_) {
      if (n.pid <= 0) continue;
      const AdminReply r = Admin(n.port, {"CLUSTER", "SLOTS"});
      for (const auto& range : r.elements) {
        if (range.elements.size() < 3) continue;
        if (slot < range.elements[0].integer || slot > range.elements[1].integer) continue;
        const int port = static_cast<int>(range.elements[2].elements[1].integer);
        for (const auto& m : nodes_) {
          if (m.port == port) return &m;
        }
      }
      return nullptr;
    }
    return nullptr;
  }

  const ClusterNode* ReplicaOf(const ClusterNode& master) const {
    for (const auto& n : nodes_) {
      if (!n.master && n.master_id == master.id) return &n;
    }
    return nullptr;
  }

  // SIGKILL one node (and reap it).
  void Kill(const ClusterNode& node) {
    for (auto& n : nodes_) {
      if (n.port != node.port || n.pid <= 0) continue;
      ::kill(n.pid, SIGKILL);
      ::waitpid(n.pid, nullptr, 0);
      n.pid = -1;
    }
  }

  std::vector<std::string> Seeds() const {
    std::vector<std::string> s;
    for (const auto& n : nodes_) s.push_back(n.addr());
    return s;
  }
  const std::vector<ClusterNode>& nodes() const { return nodes_; }
  std::vector<const ClusterNode*> Masters() const {
    std::vector<const ClusterNode*> out;
    for (const auto& n : nodes_) {
      if (n.master) out.push_back(&n);
    }
    return out;
  }
  std::string Log(const ClusterNode& n) const {
    std::ifstream f(n.dir + "/redis.log");
    std::stringstream ss;
    ss << f.rdbuf();
    std::string s = ss.str();
    return s.size() > 2000 ? s.substr(s.size() - 2000) : s;
  }

  void Stop() {
    if (pgid_ > 0) ::killpg(pgid_, SIGKILL);
    for (auto& n : nodes_) {
      if (n.pid > 0) {
        ::kill(n.pid, SIGKILL);
        ::waitpid(n.pid, nullptr, 0);
        n.pid = -1;
      }
    }
    pgid_ = -1;
    if (!root_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(root_, ec);
      root_.clear();
    }
  }

 private:
  // 12 consecutive free ports (6 client + 6 bus) in [20000, 40000), starting from a place that
  // depends on the pid so that concurrent test processes rarely collide.
  static int PickPorts() {
    static std::atomic<int> next{0};
    for (int attempt = 0; attempt < 200; ++attempt) {
      const int base = 20000 + ((::getpid() * 97 + (next++) * 12) % 1666) * 12;
      bool ok = true;
      for (int p = base; p < base + 12 && ok; ++p) ok = PortFree(p);
      if (ok) return base;
    }
    return -1;
  }

  void AddAuth(std::vector<std::string>* argv) const {
    if (options_.password.empty()) return;
    if (!options_.user.empty()) {
      argv->push_back("--user");
      argv->push_back(options_.user);
    }
    argv->push_back("--pass");
    argv->push_back(options_.password);
    argv->push_back("--no-auth-warning");
  }

  bool Launch(ClusterNode& n) {
    std::vector<std::string> argv = {
        FindProgram("redis-server"), "--bind", "127.0.0.1", "--port", std::to_string(n.port),
        "--cluster-enabled", "yes", "--cluster-port", std::to_string(n.bus_port),
        "--cluster-config-file", n.dir + "/nodes.conf", "--cluster-node-timeout",
        std::to_string(options_.node_timeout_ms), "--dir", n.dir, "--logfile", n.dir + "/redis.log",
        "--save", "", "--appendonly", "no",
        // Replicas sync at once (the default waits 5 s for more).
        "--repl-diskless-sync-delay", "0", "--daemonize", "no"};
    if (!options_.password.empty()) {
      if (options_.user.empty()) {
        for (const std::string& a : {std::string("--requirepass"), options_.password,
                                     std::string("--masterauth"), options_.password}) {
          argv.push_back(a);
        }
      } else {
        for (const std::string& a :
             {std::string("--user"), options_.user, std::string("on"), ">" + options_.password,
              std::string("~*"), std::string("&*"), std::string("+@all")}) {
          argv.push_back(a);
        }
        for (const std::string& a : {std::string("--user"), std::string("default"),
                                     std::string("off"), std::string("--masteruser"), options_.user,
                                     std::string("--masterauth"), options_.password}) {
          argv.push_back(a);
        }
      }
    }
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) return false;
    if (pid == 0) {
      ::setpgid(0, pgid_ > 0 ? pgid_ : 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      std::vector<char*> a;
      for (auto& s : argv) a.push_back(s.data());
      a.push_back(nullptr);
      ::execv(a[0], a.data());
      ::_exit(127);
    }
    if (pgid_ <= 0) pgid_ = pid;
    ::setpgid(pid, pgid_);  // also from here: no race with the child's own call
    n.pid = pid;
    return true;
  }

  // Runs `argv` (stdout+stderr into `out`) and returns its exit code.
  int Run(const std::vector<std::string>& argv, std::string* out) const {
    const std::string log = root_ + "/cmd.log";
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      FILE* f = std::fopen(log.c_str(), "w");
      if (f != nullptr) {
        ::dup2(fileno(f), 1);
        ::dup2(fileno(f), 2);
      }
      std::vector<char*> a;
      std::vector<std::string> copy = argv;
      for (auto& s : copy) a.push_back(s.data());
      a.push_back(nullptr);
      ::execv(a[0], a.data());
      ::_exit(127);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    std::ifstream f(log);
    std::stringstream ss;
    ss << f.rdbuf();
    *out = ss.str();
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  static AdminReply Command(redisContext* c, const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(
        redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (r == nullptr) return {};
    AdminReply out = Flatten(r);
    freeReplyObject(r);
    return out;
  }

  int CountNodes(int port) const {
    const std::string s = Admin(port, {"CLUSTER", "NODES"}).str;
    int n = 0;
    std::stringstream ss(s);
    std::string line;
    while (std::getline(ss, line)) {
      n += !line.empty() && line.find("fail") == std::string::npos &&
           line.find("handshake") == std::string::npos;
    }
    return n;
  }

  ClusterOptions options_;
  std::string root_;
  std::vector<ClusterNode> nodes_;
  pid_t pgid_ = -1;
};

}  // namespace hiqcache::l3_test
