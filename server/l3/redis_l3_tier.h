// The Redis Cluster implementation of core's L3Tier (core/l3_tier.h): values in l3_value.h's
// format, through redis_cluster.h's client.
#pragma once

#include <memory>

#include "core/l3_tier.h"
#include "hiqcache/status.h"
#include "pool/block_store.h"

namespace hiqcache::server {

// The Redis Cluster tier over `store` (which must outlive it); its writers copy published blocks
// out of the store (write_through), or it sets itself as the store's eviction sink (on_evict) and
// copies evicted blocks into its write queue while the store evicts them. Connections open in
// the background: the tier is usable (answering misses) while the cluster is unreachable.
StatusOr<std::unique_ptr<L3Tier>> CreateRedisL3Tier(const L3Options& options, BlockStore* store);

}  // namespace hiqcache::server
