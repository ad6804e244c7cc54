// Validation of requests, before anything is read or written (docs/design.md "Validation is total
// and atomic"), and resolution of validated views into executor views. Pure functions.
//
// Error messages name the offending field ("layers[3].v.row_stride_bytes: ...") and never echo
// keys or data of other tenants.
#pragma once

#include <string>
#include <vector>

#include "core/namespace_table.h"
#include "core/requests.h"
#include "hiqcache/status.h"
#include "record_format.h"
#include "tensor_view.h"

namespace hiqcache::server {

struct Limits {
  uint32_t max_layers = 4096;
  uint32_t max_heads = 1024;
  uint32_t max_head_dim = 4096;
  uint32_t max_block_tokens = 65536;
  uint32_t max_buffers = 4096;
  uint32_t max_events = 1u << 20;
  uint32_t max_blocks_per_request = 4096;
  // Row entries of one Backup that repeat a row named earlier in the same request (a backup of
  // the same rows under many keys fills the pool from a small KV buffer). A Restore may repeat
  // none: it would write the same row twice.
  uint32_t max_repeated_rows_per_request = 1024;
  uint32_t max_keys_per_lookup = 65536;
  size_t max_string_bytes = 512;
  // Engine-side bytes of one block (tokens x layers x K|V x heads x head_dim x 2): a block is the
  // smallest unit of work, so this bounds what one request makes others wait for.
  uint64_t max_block_bytes = 64ull << 20;
};

struct ValidatedRegistration {
  kernels::BlockLayout layout;
  NamespaceDesc ns;
  bool cuda = false;
};

// Checks the parts a namespace is derived from (model, tenant, geometry, block_tokens, codec) and
// derives its descriptor (block layout included). RegisterPool and a Lookup's NamespaceRefs both
// go through here, so equal parts always name the same namespace (MLA drops tp_rank/tp_size).
// `pool_capacity_bytes` bounds the block size: a block must fit in the pool. Error text starts
// with `field_prefix` ("namespaces[1]." -> "namespaces[1].geometry.num_kv_heads: ...").
StatusOr<NamespaceDesc> ValidateNamespace(const NamespaceSpec& spec, const Limits& limits,
                                          uint64_t pool_capacity_bytes,
                                          const std::string& field_prefix = "");

// ValidateNamespace, then device, buffers, views (every addressable element inside its buffer)
// and events.
StatusOr<ValidatedRegistration> ValidateRegistration(const RegisterSpec& spec, const Limits& limits,
                                                     uint64_t pool_capacity_bytes);

// Byte offset one past the last byte `view` can address (from its buffer's start), or an error
// naming `field` on overflow. `heads` x `head_dim` elements of 2 bytes per row.
StatusOr<uint64_t> ViewEnd(const ViewSpec& view, uint32_t heads, uint32_t head_dim,
                           const std::string& field);

// The smallest num_rows over every view of the registration.
uint32_t MinRows(const RegisterSpec& spec);

// REQUIRES: spec validated. bases[i] is where buffers[i] is mapped.
std::vector<kernels::LayerViews> ResolveViews(const RegisterSpec& spec,
                                              const kernels::BlockLayout& layout,
                                              const std::vector<uint8_t*>& bases);

// Checks the blocks and events of a Backup/Restore against the pool it names: every row below
// `num_rows`, and repeated rows (a row named twice in the request) at most
// limits.max_repeated_rows_per_request for a backup (RESOURCE_EXHAUSTED), none for a restore
// (INVALID_ARGUMENT naming the second occurrence).
Status ValidateTransfer(const TransferSpec& spec, const kernels::BlockLayout& layout,
                        uint32_t num_rows, uint32_t event_count, bool restore,
                        const Limits& limits);

// Checks a list of keys (Lookup, Evict): each exactly 16 bytes, at most `max` of them.
Status ValidateKeys(const std::vector<std::string>& keys, uint32_t max, const char* field);

BlockKey ToBlockKey(const std::string& key);

}  // namespace hiqcache::server
