// hiq_it_peer: a second client process for the integration tests. It registers its own HOST KV
// pool with a running hiqcached and backs up, restores or looks up blocks of a deterministic data
// set (it_util.h), so a test can check that two processes share a namespace.
//
//   hiq_it_peer --target T --mode backup|restore|lookup [--model M] [--tenant X]
//               [--layout sglang|paged|packed] [--seed S] [--blocks N] [--codec int8|raw]
//               [--layers L] [--heads H] [--dim D] [--block-tokens B]
//
// Prints one line "<mode> <n>" (n = blocks stored / restored / prefix length) and, on failure,
// a reason on stderr. Exit: 0 success, 1 setup or RPC error, 2 restored data wrong.
#include <cstdio>
#include <iostream>
#include <map>
#include <string>

#include "it_util.h"

namespace hiqcache::it {
namespace {

int Main(int argc, char** argv) {
  std::map<std::string, std::string> a = {
      {"model", "it-peer"}, {"tenant", ""},        {"layout", "sglang"}, {"seed", "1"},
      {"blocks", "4"},      {"codec", "int8"},     {"layers", "4"},      {"heads", "4"},
      {"dim", "64"},        {"block-tokens", "16"}};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) {
      std::cerr << "peer: bad argument " << k << "\n";
      return 1;
    }
    a[k.substr(2)] = argv[i + 1];
  }
  if (!a.count("target") || !a.count("mode")) {
    std::cerr << "peer: --target and --mode are required\n";
    return 1;
  }
  const std::string mode = a["mode"];
  const uint64_t seed = std::stoull(a["seed"]);
  const uint32_t blocks = static_cast<uint32_t>(std::stoul(a["blocks"]));
  const uint32_t bt = static_cast<uint32_t>(std::stoul(a["block-tokens"]));
  PoolOptions o;
  o.model = a["model"];
  o.tenant = a["tenant"];
  o.geometry = Geom(std::stoul(a["layers"]), std::stoul(a["heads"]), std::stoul(a["dim"]));
  o.layout = a["layout"] == "paged"    ? KvLayout::kVllmPaged
             : a["layout"] == "packed" ? KvLayout::kVllmPackedKv
                                       : KvLayout::kSglang;
  o.codec = a["codec"] == "raw"                 ? Codec::kRaw
            : a["codec"] == "fp8_e4m3_per_head" ? Codec::kFp8E4m3PerHead
            : a["codec"] == "int4_g32_per_head" ? Codec::kInt4G32PerHead
                                                : Codec::kInt8PerHead;
  o.block_tokens = bt;
  o.num_rows = 2 * blocks * bt;
  o.page_rows = 8;

  auto client = Connect(a["target"]);
  if (!client) {
    std::cerr << "peer: cannot create client\n";
    return 1;
  }
  auto pool = MakePool(*client, o);
  if (!pool.ok()) {
    std::cerr << "peer: RegisterPool: " << pool.status().ToString() << "\n";
    std::cout << "register " << pool.status().ToString() << std::endl;
    return 1;
  }
  const std::vector<BlockKey> keys = Keys(seed, blocks, bt);
  // Rows of this process differ from the test's: a permutation of the upper half, reversed.
  std::vector<uint32_t> rows = PickRows(o.num_rows, blocks * bt, seed ^ 0x5eed);
  std::reverse(rows.begin(), rows.end());

  if (mode == "backup") {
    FillRows(pool->kv, seed, rows, bt);
    BackupResult r = client->Backup(pool->handle, keys, rows);
    if (!r.status.ok()) {
      std::cerr << "peer: Backup: " << r.status.ToString() << "\n";
      return 1;
    }
    std::cout << "backup " << r.held() << std::endl;
    return 0;
  }
  if (mode == "restore") {
    FillSentinel(pool->kv);
    RestoreResult r = client->Restore(pool->handle, keys, rows);
    if (!r.status.ok()) {
      std::cerr << "peer: Restore: " << r.status.ToString() << "\n";
      return 1;
    }
    std::cout << "restore " << r.restored_blocks << std::endl;
    const std::span<const uint32_t> done(rows.data(), size_t{r.restored_blocks} * bt);
    CheckResult c = CheckRowsOf(o.codec, pool->kv, seed, done, bt);
    if (r.restored_blocks > 0 && !c.ok()) {
      std::cerr << "peer: restored data wrong: " << c.bad_heads << " bad heads; " << c.first
                << "\n";
      return 2;
    }
    if (uint64_t n = ChangedOutside(pool->kv, done); n != 0) {
      std::cerr << "peer: " << n << " bytes outside the restored rows changed\n";
      return 2;
    }
    return 0;
  }
  if (mode == "lookup") {
    LookupResult r = client->Lookup(pool->handle, keys);
    if (!r.status.ok()) {
      std::cerr << "peer: Lookup: " << r.status.ToString() << "\n";
      return 1;
    }
    std::cout << "lookup " << r.prefix_blocks << std::endl;
    return 0;
  }
  std::cerr << "peer: unknown mode " << mode << "\n";
  return 1;
}

}  // namespace
}  // namespace hiqcache::it

int main(int argc, char** argv) { return hiqcache::it::Main(argc, argv); }
