#include "core/registration.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "hiqcache/split_view.h"
#include "pool/pool_format.h"

namespace hiqcache::server {
namespace {

constexpr size_t kIpcHandleBytes = 64;
// geometry.rope.theta, when not 0: RoPE bases in use run from 1e4 to a few 1e7.
constexpr double kMinRopeTheta = 1;
constexpr double kMaxRopeTheta = 1e12;

// A double as a message shows it: shortest round-trip-safe digits ("1e+06", "nan", "inf").
std::string DoubleText(double v) {
  char buf[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
    if (!std::isfinite(v) || std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string Idx(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

bool MulAdd(uint64_t a, uint64_t b, uint64_t* acc) {
  uint64_t prod;
  if (__builtin_mul_overflow(a, b, &prod)) return false;
  return !__builtin_add_overflow(*acc, prod, acc);
}

bool ValidShmName(const std::string& name) {
  if (name.empty() || name.size() > 255) return false;
  size_t start = name[0] == '/' ? 1 : 0;
  if (start == name.size()) return false;
  for (size_t i = start; i < name.size(); ++i) {
    if (name[i] == '/' || name[i] == '\0') return false;
  }
  return true;
}

// Repeated rows of a transfer whose rows are all below `num_rows` (checked before). A bitmap of
// the pool's rows when it is small against the request, else a sorted copy: memory stays
// proportional to the request.
Status CheckRepeatedRows(const TransferSpec& spec, uint32_t num_rows, bool restore,
                         const Limits& limits) {
  size_t total = 0;
  for (const BlockSpec& b : spec.blocks) total += b.rows.size();
  if (total < 2) return Status::Ok();
  uint64_t repeated = 0;
  auto repeat_at = [&](size_t i, size_t r) -> Status {
    if (restore) {
      return InvalidArgument(Idx("blocks", i) + Idx(".rows", r) + ": row " +
                             std::to_string(spec.blocks[i].rows[r]) +
                             " is written by an earlier entry of this restore (each row at most "
                             "once per request)");
    }
    if (++repeated > limits.max_repeated_rows_per_request) {
      return ResourceExhausted(
          "blocks: more than " + std::to_string(limits.max_repeated_rows_per_request) +
          " rows repeat rows named earlier in this backup (quota max_repeated_rows_per_request)");
    }
    return Status::Ok();
  };
  if (uint64_t{num_rows} <= 64ull * total) {
    std::vector<uint64_t> seen((uint64_t{num_rows} + 63) / 64, 0);
    for (size_t i = 0; i < spec.blocks.size(); ++i) {
      const auto& rows = spec.blocks[i].rows;
      for (size_t r = 0; r < rows.size(); ++r) {
        uint64_t& word = seen[rows[r] / 64];
        const uint64_t bit = 1ull << (rows[r] % 64);
        if (word & bit) HIQ_RETURN_IF_ERROR(repeat_at(i, r));
        word |= bit;
      }
    }
    return Status::Ok();
  }
  // (row, position) sorted: the first entry of each row is its earliest occurrence.
  std::vector<std::pair<uint32_t, uint64_t>> all;
  all.reserve(total);
  for (size_t i = 0; i < spec.blocks.size(); ++i) {
    const auto& rows = spec.blocks[i].rows;
    for (size_t r = 0; r < rows.size(); ++r) all.emplace_back(rows[r], (uint64_t{i} << 32) | r);
  }
  std::sort(all.begin(), all.end());
  // Report the earliest repeat in request order, as the bitmap path does.
  uint64_t first_repeat = UINT64_MAX;
  for (size_t k = 1; k < all.size(); ++k) {
    if (all[k].first != all[k - 1].first) continue;
    if (restore) {
      first_repeat = std::min(first_repeat, all[k].second);
    } else {
      HIQ_RETURN_IF_ERROR(repeat_at(all[k].second >> 32, all[k].second & 0xFFFFFFFFu));
    }
  }
  if (first_repeat != UINT64_MAX) return repeat_at(first_repeat >> 32, first_repeat & 0xFFFFFFFFu);
  return Status::Ok();
}

// One axis of a split view: `size` indices `stride` bytes apart, spelled by `field`.
struct ViewAxis {
  uint64_t size;
  uint64_t stride;
  const char* field;
};

// ViewEnd of a view that splits its slots (row_group) or a head's elements (dim_run,
// dim_stride_bytes): every address of the full grid of (page, group, slot, head, run, element)
// lies below the answer, and
// no two elements share a byte (sorted by stride, each axis steps past everything the smaller
// ones span), as the daemon writes every element of a restored row.
StatusOr<uint64_t> SplitViewEnd(const ViewSpec& v, uint32_t heads, uint32_t head_dim,
                                const std::string& field) {
  if (v.dim_run != 0 && head_dim % v.dim_run != 0) {
    return InvalidArgument(field + ".dim_run: must divide geometry.head_dim (" +
                           std::to_string(head_dim) + "), got " + std::to_string(v.dim_run));
  }
  if (v.offset_bytes % 2 || v.row_stride_bytes % 2 || v.head_stride_bytes % 2 ||
      v.page_stride_bytes % 2 || v.row_group_stride_bytes % 2 || v.dim_run_stride_bytes % 2 ||
      v.dim_stride_bytes % 2) {
    return InvalidArgument(field + ": offset and strides must be multiples of 2 bytes");
  }
  const uint64_t run = v.dim_run != 0 ? v.dim_run : head_dim;
  const uint64_t head_stride =
      v.head_stride_bytes != 0 ? v.head_stride_bytes : uint64_t{head_dim} * 2;
  const uint64_t slots =
      v.page_rows != 0 ? std::min<uint64_t>(v.page_rows, v.num_rows) : v.num_rows;
  const uint64_t pages = v.page_rows != 0 ? (v.num_rows + v.page_rows - 1) / v.page_rows : 1;
  const uint64_t group = v.row_group != 0 ? std::min<uint64_t>(v.row_group, slots) : slots;
  ViewAxis axes[] = {
      {run, v.dim_stride_bytes != 0 ? v.dim_stride_bytes : 2,
       v.dim_stride_bytes != 0 ? "dim_stride_bytes" : "dim_run"},
      {head_dim / run, v.dim_run_stride_bytes, "dim_run_stride_bytes"},
      {heads, head_stride, "head_stride_bytes"},
      {group, v.row_stride_bytes, "row_stride_bytes"},
      {(slots + group - 1) / group, v.row_group_stride_bytes, "row_group_stride_bytes"},
      {pages, v.page_stride_bytes, "page_stride_bytes"},
  };
  uint64_t span = 2;  // one element
  for (const ViewAxis& a : axes) {
    if (a.size > 1 && !MulAdd(a.size - 1, a.stride, &span)) {
      return InvalidArgument(field + "." + a.field + ": " + std::to_string(a.stride) + " x " +
                             std::to_string(a.size - 1) + " overflows");
    }
  }
  std::stable_sort(std::begin(axes), std::end(axes),
                   [](const ViewAxis& a, const ViewAxis& b) { return a.stride < b.stride; });
  uint64_t covered = 2;  // bytes the axes so far span from an element's first byte
  for (const ViewAxis& a : axes) {
    if (a.size <= 1) continue;
    if (a.stride < covered) {
      return InvalidArgument(field + "." + a.field + ": " + std::to_string(a.stride) +
                             " bytes steps inside the " + std::to_string(covered) +
                             " bytes the smaller strides span: elements of the view overlap");
    }
    covered += (a.size - 1) * a.stride;  // <= span: no overflow
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(v.offset_bytes, span, &end)) {
    return InvalidArgument(field + ".offset_bytes: " + std::to_string(v.offset_bytes) +
                           " plus the view's " + std::to_string(span) + " bytes overflows");
  }
  return end;
}

}  // namespace

StatusOr<uint64_t> ViewEnd(const ViewSpec& v, uint32_t heads, uint32_t head_dim,
                           const std::string& field) {
  const uint64_t head_bytes = uint64_t{head_dim} * 2;
  const uint64_t head_stride = v.head_stride_bytes != 0 ? v.head_stride_bytes : head_bytes;
  if (v.num_rows == 0) return InvalidArgument(field + ".num_rows: must be > 0");
  // A split stride without the count it steps over addresses nothing: a client's mistake (a
  // field dropped on its way), refused rather than ignored.
  if (v.row_group == 0 && v.row_group_stride_bytes != 0) {
    return InvalidArgument(field +
                           ".row_group_stride_bytes: set without row_group (0 = slots "
                           "not grouped)");
  }
  if (v.dim_run == 0 && v.dim_run_stride_bytes != 0) {
    return InvalidArgument(field +
                           ".dim_run_stride_bytes: set without dim_run (0 = one run "
                           "of head_dim elements)");
  }
  if (SplitViewField(v) != nullptr) return SplitViewEnd(v, heads, head_dim, field);
  if (v.row_stride_bytes == 0 && v.num_rows > 1) {
    return InvalidArgument(field + ".row_stride_bytes: must be > 0");
  }
  if (v.head_stride_bytes != 0 && v.head_stride_bytes < head_bytes && heads > 1) {
    return InvalidArgument(field + ".head_stride_bytes: " + std::to_string(v.head_stride_bytes) +
                           " is smaller than one head (" + std::to_string(head_bytes) + " bytes)");
  }
  if (v.offset_bytes % 2 || v.row_stride_bytes % 2 || head_stride % 2 || v.page_stride_bytes % 2) {
    return InvalidArgument(field + ": offset and strides must be multiples of 2 bytes");
  }
  // The view's extent from its first byte, then the offset: each overflow names its field.
  uint64_t span = 0;
  const uint64_t last = v.num_rows - 1ull;
  if (v.page_rows == 0) {
    if (!MulAdd(last, v.row_stride_bytes, &span)) {
      return InvalidArgument(field + ".row_stride_bytes: row_stride_bytes * num_rows overflows");
    }
  } else {
    if (v.page_stride_bytes == 0 && v.num_rows > v.page_rows) {
      return InvalidArgument(field + ".page_stride_bytes: must be > 0 when paged");
    }
    // The farthest row is either the last row or the last slot of the page before it.
    const uint64_t p_last = last / v.page_rows;
    const uint64_t t_last = last % v.page_rows;
    uint64_t a = 0, b = 0;
    if (!MulAdd(p_last, v.page_stride_bytes, &a) ||
        (p_last > 0 && !MulAdd(p_last - 1, v.page_stride_bytes, &b))) {
      return InvalidArgument(field + ".page_stride_bytes: page_stride_bytes * pages overflows");
    }
    if (!MulAdd(t_last, v.row_stride_bytes, &a) ||
        (p_last > 0 && !MulAdd(v.page_rows - 1, v.row_stride_bytes, &b))) {
      return InvalidArgument(field + ".row_stride_bytes: row_stride_bytes * page_rows overflows");
    }
    span = std::max(a, b);
  }
  if (!MulAdd(heads - 1ull, head_stride, &span) ||
      __builtin_add_overflow(span, head_bytes, &span)) {
    return InvalidArgument(field + ".head_stride_bytes: overflows");
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(v.offset_bytes, span, &end)) {
    return InvalidArgument(field + ".offset_bytes: " + std::to_string(v.offset_bytes) +
                           " plus the view's " + std::to_string(span) + " bytes overflows");
  }
  return end;
}

StatusOr<NamespaceDesc> ValidateNamespace(const NamespaceSpec& spec, const Limits& limits,
                                          uint64_t pool_capacity_bytes,
                                          const std::string& field_prefix) {
  auto invalid = [&](const std::string& field_and_text) {
    return InvalidArgument(field_prefix + field_and_text);
  };
  if (spec.model.empty()) return invalid("model: must not be empty");
  if (spec.model.size() > limits.max_string_bytes) return invalid("model: too long");
  if (spec.tenant.size() > limits.max_string_bytes) return invalid("tenant: too long");
  if (spec.num_layers == 0 || spec.num_layers > limits.max_layers) {
    return invalid("geometry.num_layers: must be in [1, " + std::to_string(limits.max_layers) +
                   "], got " + std::to_string(spec.num_layers));
  }
  if (spec.num_kv_heads == 0 || spec.num_kv_heads > limits.max_heads) {
    return invalid("geometry.num_kv_heads: must be in [1, " + std::to_string(limits.max_heads) +
                   "], got " + std::to_string(spec.num_kv_heads));
  }
  if (spec.head_dim == 0 || spec.head_dim > limits.max_head_dim) {
    return invalid("geometry.head_dim: must be in [1, " + std::to_string(limits.max_head_dim) +
                   "], got " + std::to_string(spec.head_dim));
  }
  if (spec.dtype != wire::kDTypeBf16 && spec.dtype != wire::kDTypeFp16) {
    return invalid("geometry.dtype: must be DTYPE_BF16 or DTYPE_FP16, got " +
                   std::to_string(spec.dtype));
  }
  if (spec.attention != wire::kAttentionMha && spec.attention != wire::kAttentionMla) {
    return invalid("geometry.attention: must be ATTENTION_MHA or ATTENTION_MLA, got " +
                   std::to_string(spec.attention));
  }
  if (spec.tp_size == 0 || spec.tp_size > 4096) {
    return invalid("geometry.tp_size: must be in [1, 4096], got " + std::to_string(spec.tp_size));
  }
  if (spec.tp_rank >= spec.tp_size) return invalid("geometry.tp_rank: must be < tp_size");
  if (spec.block_tokens == 0 || spec.block_tokens > limits.max_block_tokens) {
    return invalid("block_tokens: must be in [1, " + std::to_string(limits.max_block_tokens) +
                   "], got " + std::to_string(spec.block_tokens));
  }
  if (!std::isfinite(spec.rope_theta) ||
      (spec.rope_theta != 0 &&
       (spec.rope_theta < kMinRopeTheta || spec.rope_theta > kMaxRopeTheta))) {
    return invalid("geometry.rope.theta: must be 0 (no rotary embedding) or in [1, 1e12], got " +
                   DoubleText(spec.rope_theta));
  }
  kernels::CodecKind codec;
  if (!kernels::CodecKindFromWire(spec.codec, &codec)) {
    return invalid("codec: unknown value " + std::to_string(spec.codec));
  }
  const char* codec_name = kernels::CodecContractName(codec);
  if (kernels::CodecNeedsGroupedHeads(codec) && spec.head_dim % kernels::kInt4GroupElems != 0) {
    return invalid(std::string("geometry.head_dim: ") + codec_name + " needs a multiple of " +
                   std::to_string(kernels::kInt4GroupElems) + ", got " +
                   std::to_string(spec.head_dim));
  }
  const bool allot = kernels::AllotBitsOf(codec).value != 0;
  const bool mla = spec.attention == wire::kAttentionMla;
  if (allot && mla) {
    return invalid(std::string("geometry.attention: ") + codec_name +
                   " needs K and V planes, got ATTENTION_MLA");
  }

  NamespaceDesc ns;
  kernels::BlockLayout& lay = ns.layout;
  lay.row.num_heads = spec.num_kv_heads;
  lay.row.head_dim = spec.head_dim;
  lay.row.dtype = spec.dtype == wire::kDTypeBf16 ? kernels::DType::kBF16 : kernels::DType::kFP16;
  lay.row.codec = codec;
  if (allot) {
    // Only a codec that turns keys stores the rope in its layout (and so in its namespace). No
    // rotary embedding (theta 0) turns nothing, whatever its pairing: one namespace.
    lay.row.rope_theta = spec.rope_theta;
    lay.row.rope_interleaved = spec.rope_theta != 0 && spec.rope_interleaved;
  }
  lay.num_layers = spec.num_layers;
  lay.kv_planes = mla ? 1 : 2;
  lay.block_tokens = spec.block_tokens;
  if (lay.row.ElementsPerRow() > (1u << 22)) {
    return invalid("geometry: num_kv_heads * head_dim is too large");
  }
  const uint64_t engine_bytes =
      uint64_t{lay.block_tokens} * lay.num_layers * lay.kv_planes * lay.row.ElementsPerRow() * 2;
  if (engine_bytes > limits.max_block_bytes) {
    return invalid("block_tokens: a block of " + std::to_string(lay.block_tokens) + " tokens is " +
                   std::to_string(engine_bytes) +
                   " bytes in the engine, more "
                   "than max_block_bytes (" +
                   std::to_string(limits.max_block_bytes) +
                   "): a block is the daemon's smallest unit of work; use fewer tokens per "
                   "block or raise max_block_bytes");
  }
  // Two blocks, each in its own extent (header + slot), must fit: one alone would thrash.
  if (2 * (kExtentHeaderBytes + SlotBytesFor(lay.BlockBytes())) > pool_capacity_bytes) {
    return invalid("block_tokens: a block of " + std::to_string(lay.BlockBytes()) +
                   " bytes does not fit twice in the pool (" + std::to_string(pool_capacity_bytes) +
                   " bytes)");
  }
  if (kExtentHeaderBytes + SlotBytesFor(lay.BlockBytes()) > kPoolRegisterChunkBytes) {
    return invalid("block_tokens: a block of " + std::to_string(lay.BlockBytes()) +
                   " bytes does not fit one pool registration chunk (" +
                   std::to_string(kPoolRegisterChunkBytes) + " bytes)");
  }
  ns.model = spec.model;
  ns.tenant = spec.tenant;
  ns.mla = mla;
  ns.tp_rank = spec.tp_rank;
  ns.tp_size = spec.tp_size;
  return ns;
}

StatusOr<ValidatedRegistration> ValidateRegistration(const RegisterSpec& spec, const Limits& limits,
                                                     uint64_t pool_capacity_bytes) {
  ValidatedRegistration out;
  HIQ_ASSIGN_OR_RETURN(out.ns, ValidateNamespace(spec, limits, pool_capacity_bytes));
  out.layout = out.ns.layout;
  if (spec.device_kind != wire::kDeviceHost && spec.device_kind != wire::kDeviceCuda) {
    return InvalidArgument("device.kind: must be DEVICE_KIND_HOST or DEVICE_KIND_CUDA, got " +
                           std::to_string(spec.device_kind));
  }
  out.cuda = spec.device_kind == wire::kDeviceCuda;
  if (out.cuda && out.layout.row.IsAllot() && spec.head_dim > kernels::kAllotCudaMaxHeadDim) {
    return InvalidArgument(
        "geometry.head_dim: " + std::string(kernels::CodecContractName(out.layout.row.codec)) +
        " on a CUDA pool takes up to " + std::to_string(kernels::kAllotCudaMaxHeadDim) + ", got " +
        std::to_string(spec.head_dim) + "; use a HOST pool or another codec");
  }
  const bool mla = out.ns.mla;

  if (spec.buffers.empty() || spec.buffers.size() > limits.max_buffers) {
    return InvalidArgument("buffers: must hold 1 to " + std::to_string(limits.max_buffers) +
                           " entries, got " + std::to_string(spec.buffers.size()));
  }
  for (size_t i = 0; i < spec.buffers.size(); ++i) {
    const BufferSpec& b = spec.buffers[i];
    const std::string f = Idx("buffers", i);
    if (b.size_bytes == 0) return InvalidArgument(f + ".size_bytes: must be > 0");
    if (out.cuda) {
      if (!b.has_cuda_ipc_handle || b.cuda_ipc_handle.size() != kIpcHandleBytes) {
        return InvalidArgument(f + ".cuda_ipc_handle: a CUDA pool needs a 64-byte handle");
      }
    } else if (b.has_host_fd) {
      // An fd passed over the caller's session (the binding checks it: host_backend.cc).
      if (b.host_fd_id == 0) {
        return InvalidArgument(f + ".host_fd_id: 0 names no fd (ids start at 1)");
      }
    } else if (!b.has_host_shm_name || !ValidShmName(b.host_shm_name)) {
      return InvalidArgument(f +
                             ".host_shm_name: a HOST pool needs host_fd_id or a shm name like "
                             "'/name'");
    }
  }

  if (spec.layers.size() != spec.num_layers) {
    return InvalidArgument("layers: expected " + std::to_string(spec.num_layers) +
                           " entries (geometry.num_layers), got " +
                           std::to_string(spec.layers.size()));
  }
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    const LayerSpec& ls = spec.layers[l];
    for (int p = 0; p < 2; ++p) {
      const ViewSpec& v = p == 0 ? ls.k : ls.v;
      const std::string f = Idx("layers", l) + (p == 0 ? ".k" : ".v");
      if (p == 1 && mla) {
        if (v.present) return InvalidArgument(f + ": must be unset for ATTENTION_MLA");
        continue;
      }
      if (!v.present) return InvalidArgument(f + ": must be set");
      if (v.buffer >= spec.buffers.size()) {
        return InvalidArgument(f + ".buffer: index " + std::to_string(v.buffer) +
                               " out of range (" + std::to_string(spec.buffers.size()) +
                               " buffers)");
      }
      if (const char* split = SplitViewField(v); out.cuda && split != nullptr) {
        return InvalidArgument(f + "." + split + ": split views are for HOST pools only");
      }
      HIQ_ASSIGN_OR_RETURN(uint64_t end, ViewEnd(v, spec.num_kv_heads, spec.head_dim, f));
      if (end > spec.buffers[v.buffer].size_bytes) {
        return InvalidArgument(f + ": addresses up to byte " + std::to_string(end) +
                               " of buffers[" + std::to_string(v.buffer) + "], which holds " +
                               std::to_string(spec.buffers[v.buffer].size_bytes));
      }
    }
  }

  if (spec.events.count > limits.max_events) {
    return InvalidArgument("events.count: at most " + std::to_string(limits.max_events));
  }
  if (!spec.events.cuda_ipc_event_handles.empty()) {
    // An IPC event carries no value, and a record queued by a process that dies never runs: a
    // stream waiting on it would hang (docs/design.md "Completion: ticket slots").
    return FailedPrecondition(
        "events.cuda_ipc_event_handles: CUDA IPC events are not accepted for completion; pass "
        "ticket slots (events.host_fd_id of a memfd of 64-byte slots, and events.count) for "
        "every device kind");
  }
  if (spec.events.count > 0 && spec.events.host_fd_id == 0 &&
      !ValidShmName(spec.events.host_shm_name)) {
    return InvalidArgument(
        "events.host_shm_name: host_fd_id or a shm name is needed when "
        "events.count > 0");
  }

  return out;
}

uint32_t MinRows(const RegisterSpec& spec) {
  uint32_t rows = UINT32_MAX;
  for (const auto& l : spec.layers) {
    if (l.k.present) rows = std::min(rows, l.k.num_rows);
    if (l.v.present) rows = std::min(rows, l.v.num_rows);
  }
  return rows == UINT32_MAX ? 0 : rows;
}

std::vector<kernels::LayerViews> ResolveViews(const RegisterSpec& spec,
                                              const kernels::BlockLayout& layout,
                                              const std::vector<uint8_t*>& bases) {
  std::vector<kernels::LayerViews> out(spec.layers.size());
  const uint64_t head_bytes = uint64_t{layout.row.head_dim} * 2;
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    for (uint32_t p = 0; p < layout.kv_planes; ++p) {
      const ViewSpec& v = p == 0 ? spec.layers[l].k : spec.layers[l].v;
      kernels::StridedView& sv = out[l].planes[p];
      sv.base = bases[v.buffer] + v.offset_bytes;
      sv.row_stride = v.row_stride_bytes;
      sv.head_stride = v.head_stride_bytes != 0 ? v.head_stride_bytes : head_bytes;
      sv.page_rows = v.page_rows;
      sv.page_stride = v.page_stride_bytes;
      sv.num_rows = v.num_rows;
      sv.row_group = v.row_group;
      sv.row_group_stride = v.row_group_stride_bytes;
      // A run's elements 2 bytes apart are contiguous; one run of head_dim contiguous elements
      // is an unsplit head, and a head of spaced elements is one run of head_dim of them.
      const uint64_t step = v.dim_stride_bytes != 0 ? v.dim_stride_bytes : 2;
      const uint32_t run = v.dim_run != 0 ? v.dim_run : layout.row.head_dim;
      sv.dim_run = run == layout.row.head_dim && step == 2 ? 0 : run;
      sv.dim_step = sv.dim_run > 1 ? step : 2;  // a run of one element has no step
      sv.dim_run_stride = v.dim_run_stride_bytes;
    }
  }
  return out;
}

Status ValidateKeys(const std::vector<std::string>& keys, uint32_t max, const char* field) {
  if (keys.size() > max) {
    return ResourceExhausted(std::string(field) + ": " + std::to_string(keys.size()) +
                             " keys, at most " + std::to_string(max) + " per request");
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].size() != 16) {
      return InvalidArgument(Idx(field, i) + ": must be 16 bytes, got " +
                             std::to_string(keys[i].size()));
    }
  }
  return Status::Ok();
}

Status ValidateTransfer(const TransferSpec& spec, const kernels::BlockLayout& layout,
                        uint32_t num_rows, uint32_t event_count, bool restore,
                        const Limits& limits) {
  if (spec.blocks.size() > limits.max_blocks_per_request) {
    return ResourceExhausted("blocks: " + std::to_string(spec.blocks.size()) + " blocks, at most " +
                             std::to_string(limits.max_blocks_per_request) + " per request");
  }
  for (size_t i = 0; i < spec.blocks.size(); ++i) {
    const BlockSpec& b = spec.blocks[i];
    if (b.key.size() != 16) {
      return InvalidArgument(Idx("blocks", i) + ".key: must be 16 bytes, got " +
                             std::to_string(b.key.size()));
    }
    if (b.rows.size() != layout.block_tokens) {
      return InvalidArgument(Idx("blocks", i) + ".rows: must hold block_tokens = " +
                             std::to_string(layout.block_tokens) + " entries, got " +
                             std::to_string(b.rows.size()));
    }
    for (size_t r = 0; r < b.rows.size(); ++r) {
      if (b.rows[r] >= num_rows) {
        return InvalidArgument(Idx("blocks", i) + Idx(".rows", r) + ": row " +
                               std::to_string(b.rows[r]) + " is not below num_rows " +
                               std::to_string(num_rows));
      }
    }
  }
  HIQ_RETURN_IF_ERROR(CheckRepeatedRows(spec, num_rows, restore, limits));
  auto check_event = [&](int32_t e, const char* field) -> Status {
    if (e < -1 || (e >= 0 && static_cast<uint32_t>(e) >= event_count)) {
      return InvalidArgument(std::string(field) + ": " + std::to_string(e) +
                             " is not -1 or an event index below " + std::to_string(event_count));
    }
    return Status::Ok();
  };
  HIQ_RETURN_IF_ERROR(check_event(spec.wait_event, "wait_event"));
  HIQ_RETURN_IF_ERROR(check_event(spec.done_event, "done_event"));
  if (restore) {
    if (spec.layer_event_base < -1 ||
        (spec.layer_event_base >= 0 &&
         uint64_t{static_cast<uint32_t>(spec.layer_event_base)} + layout.num_layers >
             event_count)) {
      return InvalidArgument("layer_event_base: " + std::to_string(spec.layer_event_base) +
                             " + num_layers " + std::to_string(layout.num_layers) +
                             " exceeds the " + std::to_string(event_count) + " events");
    }
  }
  return Status::Ok();
}

BlockKey ToBlockKey(const std::string& key) {
  BlockKey k{};
  std::memcpy(k.data(), key.data(), std::min<size_t>(16, key.size()));
  return k;
}

}  // namespace hiqcache::server
