"""vLLM KV connector (v1, out of tree): vLLM engines back up and restore KV through hiqcached.

    kv_transfer_config = {
        "kv_connector": "HiqCacheConnector",
        "kv_connector_module_path": "hiqcache.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"target": "unix:///run/hiqcache/hiqcached.sock",
                                      "codec": "int8_per_head", "tenant": ""},
    }

Names are a contract (DESIGN.md "Engine adapters"). Optional extra-config keys beyond the
contract: `timeout_ms` (deadline of every daemon call, default 1000) and `staging_tokens` (token
rows of each staging area, see below). An unknown key or a bad value fails engine start-up with a
message that names it; after start-up the connector never raises into vLLM: any failure is a miss
(the scheduler's lookup answers 0, a failed restore reports its blocks through
get_block_ids_with_load_errors so vLLM recomputes exactly those tokens, a failed backup is
dropped).

Scheduler half: keys are XXH3-128 chains (hiqcache.keys) over the request's token ids, salted
with the model's identity (name, revision, dtype, quantization, KV cache dtype) and the request's
LoRA adapter, multimodal inputs and cache salt, so every engine process on the node derives the
same keys without PYTHONHASHSEED and two models never share blocks. It has no KV buffers, so
get_num_new_matched_tokens asks the daemon how many leading full blocks every TP rank of this
engine holds (Lookup over the ranks' namespaces); build_connector_meta tells the workers which
stored blocks to load into which vLLM blocks and which newly computed full blocks to save.

Worker half, vLLM on CPU (HOST device): vLLM's CPU attention keeps each (block, head) tile in an
order of its own that depends on the ISA it picked ("vec": K as [head_dim][block_size], V as
[block_size][head_dim]; "amx": tokens in groups with pairs of dims interleaved), which no
TensorView can express. The connector therefore learns the order by running vLLM's own
cpu_attn_reshape_and_cache on a probe tile at start-up, and converts through a staging area in
shared memory that the daemon reads and writes ([layer][K|V][row][head][dim], one pool
registration covering every layer; a memfd sealed against shrinking, passed to the daemon by
fd over the client's session, or a named shm object for a daemon without sessions): a layout it
cannot map exactly fails start-up, it never backs up scrambled KV. Loads: start_load_kv sends one asynchronous Restore per request into the
load area, all signalling the same per-layer event slots; wait_for_layer_load(layer) waits for
that layer only and scatters it into vLLM's blocks. Saves: wait_for_save (all layers written)
gathers the step's newly computed full blocks into the save area and sends one asynchronous
Backup; vLLM's blocks are free again as soon as that copy is made, so request_finished never
delays freeing them.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

from hiqcache.client import Client
from hiqcache.host import HostEventPool, HostShm, reap_stale, unique_name
from hiqcache.keys import BlockKey, chain_block_key, root_block_key
from hiqcache.options import ExtraConfig
from hiqcache.spec import (Codec, DeviceKind, DType, Geometry, LayerView, NamespaceRef, PoolSpec,
                           slot_major_bytes, slot_major_view)
from hiqcache.status import HiqError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("hiqcache.vllm")

_EXTRA_KEYS = ("target", "codec", "tenant", "timeout_ms", "staging_tokens")
_TORCH_DTYPES = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16}

# Event slots of a worker's registration.
_SLOT_BACKUP_DONE = 0
_SLOT_LAYER_BASE = 1  # + layer index
_MAX_LOADS_PER_STEP = 64  # done slots for loads follow the layer slots
_STAGING_TAG, _EVENTS_TAG = "vllm-kv", "vllm-ev"  # memfd labels; shm names unique_name(tag)


@dataclass(frozen=True)
class ConnectorOptions:
    target: str = ""
    codec: Codec = Codec.INT8_PER_HEAD
    tenant: str = ""
    timeout_ms: int = 1000
    staging_tokens: int = 0  # 0 = derived from the scheduler limits

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> "ConnectorOptions":
        """Validates kv_connector_extra_config; ValueError naming the offending key."""
        opts = ExtraConfig(extra, "kv_connector_extra_config", _EXTRA_KEYS)
        return cls(target=opts.target(), codec=opts.codec(), tenant=opts.text("tenant"),
                   timeout_ms=opts.integer("timeout_ms", 1000, 1, 600_000),
                   staging_tokens=opts.integer("staging_tokens", 0, 0, 1 << 24))


def model_identity(vllm_config: "VllmConfig") -> str:
    """Everything about the model that changes its KV, as one string (the namespace's model)."""
    m = vllm_config.model_config
    parts = [f"{m.model}@{m.revision or 'main'}", f"dtype={str(m.dtype).removeprefix('torch.')}",
             f"quant={m.quantization or 'none'}",
             f"kv={vllm_config.cache_config.cache_dtype}"]
    return "|".join(parts)


def request_salt(identity: str, request: "Request") -> bytes:
    """The key chain's salt for one request: model identity, LoRA, multimodal inputs, cache salt."""
    parts = [identity]
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}:{getattr(lora, 'lora_path', '')}")
    for f in getattr(request, "mm_features", None) or ():
        parts.append(f"mm={f.identifier}")
    if getattr(request, "cache_salt", None):
        parts.append(f"salt={request.cache_salt}")
    return "\x1f".join(parts).encode()


def _engine_geometry(vllm_config: "VllmConfig", tp_rank: int) -> Geometry:
    m, p = vllm_config.model_config, vllm_config.parallel_config
    dtype = _TORCH_DTYPES.get(m.dtype)
    if dtype is None:
        raise ValueError(f"hiqcache: model dtype {m.dtype} is not supported (bf16 or fp16)")
    if vllm_config.cache_config.cache_dtype not in ("auto", "bfloat16", "float16"):
        raise ValueError(f"hiqcache: kv cache dtype {vllm_config.cache_config.cache_dtype!r} is "
                         "not supported (use 'auto')")
    if m.use_mla:
        raise ValueError("hiqcache: MLA models are not supported by the vLLM connector yet")
    return Geometry(num_layers=m.get_num_layers(p), num_kv_heads=m.get_num_kv_heads(p),
                    head_dim=m.get_head_size(), dtype=dtype, tp_rank=tp_rank,
                    tp_size=p.tensor_parallel_size)


def _staging_tokens(vllm_config: "VllmConfig", opts: ConnectorOptions) -> int:
    """Rows of each staging area: one step's loads (the scheduler never promises more) and one
    step's saves (at most the step's token budget plus one partial block per request)."""
    if opts.staging_tokens:
        return opts.staging_tokens
    s = vllm_config.scheduler_config
    bs = vllm_config.cache_config.block_size
    rows = max(s.max_num_batched_tokens + s.max_num_seqs * bs, min(vllm_config.model_config.max_model_len, 8192))
    return -(-rows // bs) * bs


class _LogOnce:
    """Logs a failure once per kind and period, so a daemon that is down does not flood logs."""

    def __init__(self, period: float = 30.0):
        self.period = period
        self.last: dict[str, float] = {}

    def __call__(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -1e9) >= self.period:
            self.last[kind] = now
            log.warning("hiqcache: " + msg, *args)


# --- metadata --------------------------------------------------------------------------------


@dataclass
class _Transfer:
    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]


@dataclass
class _Load(_Transfer):
    """A restore in flight on a worker."""

    reported: bool = False  # its outcome went into the step's loaded or failed blocks


@dataclass
class HiqCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


# --- scheduler half --------------------------------------------------------------------------


@dataclass
class _Request:
    request: "Request"
    salt: bytes
    bs: int
    keys: list[BlockKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0  # vLLM's own prefix-cache hit, as passed to get_num_new_matched_tokens
    daemon_blocks: int = 0  # leading blocks the daemon is known to hold
    saved_blocks: int = 0  # leading blocks saved or known to be held
    load: tuple[int, int] | None = None  # (first block, count) to load in the next step

    def keys_upto(self, n: int) -> list[BlockKey]:
        """The first n block keys, extending the chain over the request's tokens as needed."""
        bs = self.bs
        tokens = self.request.all_token_ids
        while len(self.keys) < n:
            i = len(self.keys)
            prev = self.keys[-1] if self.keys else root_block_key(self.salt)
            self.keys.append(chain_block_key(prev, tokens[i * bs:(i + 1) * bs]))
        return self.keys[:n]


class _Scheduler:
    def __init__(self, vllm_config: "VllmConfig", opts: ConnectorOptions):
        self.bs = vllm_config.cache_config.block_size
        self.identity = model_identity(vllm_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.namespaces = [NamespaceRef(model=self.identity, tenant=opts.tenant,
                                        geometry=_engine_geometry(vllm_config, r),
                                        block_tokens=self.bs, codec=opts.codec)
                           for r in range(tp)]
        self.capacity_tokens = _staging_tokens(vllm_config, opts)
        self.client = Client(opts.target, call_timeout=opts.timeout_ms / 1000)
        self.reqs: dict[str, _Request] = {}
        self.promised_tokens = 0  # load tokens promised to the step being scheduled
        self.warn = _LogOnce()

    def _state(self, request: "Request") -> _Request:
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _Request(request=request, salt=request_salt(self.identity, request), bs=self.bs)
            self.reqs[request.request_id] = st
        return st

    @staticmethod
    def cacheable(request: "Request") -> bool:
        return getattr(request, "prompt_embeds", None) is None

    def num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        if not self.cacheable(request):
            return 0
        st = self._state(request)  # tracked for its saves even when nothing is looked up
        st.local_tokens = num_computed_tokens
        # vLLM must compute at least the last token itself.
        n_max = (request.num_tokens - 1) // self.bs
        n_local = num_computed_tokens // self.bs
        room = (self.capacity_tokens - self.promised_tokens) // self.bs
        if n_max <= n_local or room <= 0:
            return 0
        res = self.client.lookup_group(self.namespaces, st.keys_upto(n_max))
        if not res.status.ok:
            self.warn("lookup", "lookup failed, serving without the cache: %s", res.status)
            return 0
        st.daemon_blocks = res.prefix_blocks
        hit = min(res.prefix_blocks, n_local + room)
        return max(0, hit - n_local) * self.bs

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        if num_external_tokens > 0:
            first = st.local_tokens // self.bs
            st.load = (first, num_external_tokens // self.bs)
            self.promised_tokens += num_external_tokens

    def _saves(self, st: _Request, computed: int, scheduled: int) -> _Transfer | None:
        """Full blocks whose KV this step completes and that the daemon may not hold yet."""
        if not self.cacheable(st.request):
            return None
        end = min(computed + scheduled, len(st.request.all_token_ids)) // self.bs
        start = max(st.saved_blocks, st.daemon_blocks)
        end = min(end, len(st.block_ids))
        if end <= start:
            return None
        st.saved_blocks = end
        return _Transfer(st.request.request_id, st.keys_upto(end)[start:end],
                         st.block_ids[start:end])

    def build_meta(self, out: "SchedulerOutput") -> HiqCacheConnectorMetadata:
        meta = HiqCacheConnectorMetadata()
        self.promised_tokens = 0
        steps: list[tuple[_Request, int, int]] = []
        for new in out.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:
                continue  # never seen by get_num_new_matched_tokens (not cacheable)
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            steps.append((st, new.num_computed_tokens, out.num_scheduled_tokens.get(new.req_id, 0)))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            steps.append((st, cached.num_computed_tokens[i], out.num_scheduled_tokens.get(req_id, 0)))
        for st, computed, scheduled in steps:
            if st.load is not None:
                first, n = st.load
                st.load = None
                if first + n <= len(st.block_ids):
                    meta.loads.append(_Transfer(st.request.request_id,
                                                st.keys_upto(first + n)[first:first + n],
                                                st.block_ids[first:first + n]))
                    st.saved_blocks = max(st.saved_blocks, first + n)
            try:
                save = self._saves(st, computed, scheduled)
            except Exception as err:  # a save is optional: never lose the step's loads over it
                self.warn("save-plan", "planning saves failed (%s: %s)", type(err).__name__, err)
                save = None
            if save is not None:
                meta.saves.append(save)
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        return meta

    def request_finished(self, request: "Request") -> None:
        self.reqs.pop(request.request_id, None)


# --- worker half -----------------------------------------------------------------------------


def probe_tile_order(dtype: torch.dtype, block_size: int, num_heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Where vLLM's CPU attention puts each (token, dim) of a (block, head) tile.

    Runs vLLM's own cpu_attn_reshape_and_cache on one block whose values name their token and
    dim, and returns (k_order, v_order, isa): k_order[p] is the row-major index t*head_dim + d of
    the K element stored at position p of the tile (likewise V). ValueError when the tile is not
    a permutation of the block (a layout this connector does not understand)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    n = block_size * head_dim
    t = torch.arange(block_size).view(block_size, 1, 1).expand(block_size, num_heads, head_dim)
    d = torch.arange(head_dim).view(1, 1, head_dim).expand(block_size, num_heads, head_dim)
    slots = torch.arange(block_size, dtype=torch.int64)
    # Small integers are exact in bf16/fp16: probe each index in base-128 digits.
    found = {}
    for name, idx in (("t", t), ("d", d)):
        for digit in range(2):
            vals = ((idx // (128 ** digit)) % 128 + 1).to(dtype).contiguous()
            cache = torch.zeros(1, num_heads, 2 * block_size, head_dim, dtype=dtype)
            kc, vc = cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(vals, vals + 0, kc, vc, slots, isa, k_scale=1.0,
                                           v_scale=1.0, kv_cache_dtype="auto")
            tiles = cache.view(1, num_heads, 2 * n).to(torch.int64) - 1
            found[(name, digit)] = tiles
    tok = found[("t", 0)] + 128 * found[("t", 1)]
    dim = found[("d", 0)] + 128 * found[("d", 1)]
    flat = tok * head_dim + dim  # [1, heads, 2n]
    orders = []
    for plane in range(2):
        o = flat[0, :, plane * n:(plane + 1) * n]
        if not bool((o == o[0:1]).all()):
            raise ValueError(f"hiqcache: vLLM CPU attention ({isa}) lays heads out differently")
        o = o[0]
        if o.min() < 0 or o.max() >= n or torch.unique(o).numel() != n:
            raise ValueError(f"hiqcache: vLLM CPU attention ({isa}) stores a "
                             f"{'KV'[plane]} tile that is not a permutation of its block: "
                             "layout not understood")
        orders.append(o.contiguous())
    return orders[0], orders[1], isa


_T1, _T0, _D1, _D0 = range(4)  # a tile's token and dim indices, each split in two


def _factor_order(order: torch.Tensor, block_size: int, head_dim: int
                  ) -> tuple[tuple[int, int, int, int], tuple[int, ...]] | None:
    """(sizes of t1, t0, d1, d0; axis order) such that a tile viewed with those axes permuted is
    the row-major [t][d] block: token t = t1 * t0_size + t0, dim d = d1 * d0_size + d0. The
    orders vLLM's ISAs use (row-major, K transposed, tokens in groups with dims interleaved in
    pairs) all factor like this, and then a tile converts with one strided copy instead of an
    element gather. None when the order is something else."""
    import itertools

    n = block_size * head_dim
    ident = torch.arange(n)
    splits_t = [s for s in (1, 2, 4, 8, 16, 32, 64) if block_size % s == 0]
    splits_d = [s for s in (1, 2, 4, 8, 16, 32, 64) if head_dim % s == 0]
    for t0 in splits_t:
        for d0 in splits_d:
            sizes = (block_size // t0, t0, head_dim // d0, d0)
            base = ident.view(sizes)
            for perm in itertools.permutations(range(4)):
                if torch.equal(base.permute(perm).reshape(-1), order):
                    return sizes, perm
    return None


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first block id, count, index in block_ids) of each run of consecutive ids: a run is
    converted straight into (or out of) vLLM's cache, with no gather or scatter copy."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][1] == b:
            start, count, offset = runs[-1]
            runs[-1] = (start, count + 1, offset)
        else:
            runs.append((b, 1, i))
    return runs


class TileConverter:
    """Moves KV between vLLM CPU attention's (block, head) tiles and row-major token rows.

    A tile holds block_size * head_dim K elements, then as many V elements, each plane in the
    order probe_tile_order found; rows are [token][head][dim]. An order that factors into
    permuted token/dim axes (every ISA vLLM has) converts with one strided copy per plane; any
    other permutation with an element gather (exact, slower)."""

    def __init__(self, dtype: torch.dtype, block_size: int, num_heads: int, head_dim: int):
        self.bs, self.heads, self.dim = block_size, num_heads, head_dim
        k_order, v_order, self.isa = probe_tile_order(dtype, block_size, num_heads, head_dim)
        self.orders = (k_order, v_order)
        # tile[..., p] = rowmajor[..., order[p]]; rowmajor[..., q] = tile[..., inverse[q]]
        self.inverse = tuple(torch.argsort(o) for o in self.orders)
        self.factors = tuple(_factor_order(o, block_size, head_dim) for o in self.orders)

    def describe(self) -> str:
        def how(f: Any) -> str:
            if f is None:
                return "gathered"
            return "direct" if f[1] == (0, 1, 2, 3) else f"axes {f[1]} of {f[0]}"

        return f"{self.isa} (K {how(self.factors[0])}, V {how(self.factors[1])})"

    def to_rows(self, tiles: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """tiles [b, heads, 2 * bs * dim] -> k_rows, v_rows [b * bs, heads, dim]."""
        n, nb = self.bs * self.dim, tiles.shape[0]
        for plane, out in enumerate((k_rows, v_rows)):
            t = tiles[:, :, plane * n:(plane + 1) * n]
            f = self.factors[plane]
            if f is None:
                t = t.index_select(2, self.inverse[plane])
                rows = t.reshape(nb, self.heads, self.bs, self.dim).transpose(1, 2)
                out.view(nb, self.bs, self.heads, self.dim).copy_(rows)
                continue
            sizes, perm = f
            tv = t.reshape(nb, self.heads, *(sizes[a] for a in perm))
            at = [2 + perm.index(a) for a in range(4)]
            out.view(nb, sizes[_T1], sizes[_T0], self.heads, sizes[_D1], sizes[_D0]).copy_(
                tv.permute(0, at[_T1], at[_T0], 1, at[_D1], at[_D0]))

    def to_tiles_into(self, k_rows: torch.Tensor, v_rows: torch.Tensor,
                      tiles: torch.Tensor) -> None:
        """k_rows, v_rows [b * bs, heads, dim] -> tiles [b, heads, 2 * bs * dim] (contiguous)."""
        n, nb = self.bs * self.dim, k_rows.shape[0] // self.bs
        for plane, src in enumerate((k_rows, v_rows)):
            dst = tiles[:, :, plane * n:(plane + 1) * n]
            f = self.factors[plane]
            if f is None:
                t = src.view(nb, self.bs, self.heads, self.dim).transpose(1, 2).reshape(
                    nb, self.heads, n)
                dst.copy_(t.index_select(2, self.orders[plane]))
                continue
            sizes, perm = f
            sv = src.view(nb, sizes[_T1], sizes[_T0], self.heads, sizes[_D1], sizes[_D0])
            axis = {_T1: 1, _T0: 2, _D1: 4, _D0: 5}
            dst.view(nb, self.heads, *(sizes[a] for a in perm)).copy_(
                sv.permute(0, 3, *(axis[a] for a in perm)))

    def to_tiles(self, k_rows: torch.Tensor, v_rows: torch.Tensor) -> torch.Tensor:
        nb = k_rows.shape[0] // self.bs
        tiles = torch.empty(nb, self.heads, 2 * self.bs * self.dim, dtype=k_rows.dtype)
        self.to_tiles_into(k_rows, v_rows, tiles)
        return tiles


class _Worker:
    def __init__(self, vllm_config: "VllmConfig", opts: ConnectorOptions):
        self.cfg = vllm_config
        self.opts = opts
        self.bs = vllm_config.cache_config.block_size
        self.identity = model_identity(vllm_config)
        self.client: Client | None = None
        self.pool = 0
        self.layers: list[torch.Tensor] = []  # per layer [num_blocks, heads, 2 * bs * dim]
        self.layer_index: dict[str, int] = {}
        # Restores in flight: (transfer, first staging row, ticket, done slot).
        self.loads: list[tuple[_Load, int, int, int]] = []
        self.layers_failed = False  # a layer of this step's restores failed: stop waiting
        self.load_ticket = 0  # last Restore ticket of this step (per-layer slots)
        self.layers_done: set[int] = set()
        self.load_errors: set[int] = set()
        self.backup_ticket = 0
        self.warn = _LogOnce()
        self.lock = threading.Lock()
        self.stats = {"loaded_blocks": 0, "failed_blocks": 0, "saved_blocks": 0,
                      "dropped_saves": 0, "load_seconds": 0.0, "save_seconds": 0.0}

    # -- registration --

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        g = _engine_geometry(self.cfg, get_tensor_model_parallel_rank())
        if len(names) != g.num_layers:
            raise ValueError(f"hiqcache: {len(names)} KV cache tensors for {g.num_layers} layers")
        first = kv_caches[names[0]]
        if first.device.type != "cpu":
            raise ValueError(f"hiqcache: KV cache on {first.device}: this connector serves vLLM on "
                             "CPU (HOST device) only")
        want = (g.num_kv_heads, self.bs, 2 * g.head_dim)
        for name in names:
            kv = kv_caches[name]
            if kv.dim() != 4 or tuple(kv.shape[1:]) != want or kv.dtype != first.dtype:
                raise ValueError(f"hiqcache: KV cache {name} has shape {tuple(kv.shape)} "
                                 f"{kv.dtype}; expected [blocks, {want[0]}, {want[1]}, {want[2]}]"
                                 " (vLLM CPU attention)")
            try:
                self.layers.append(kv.view(kv.shape[0], g.num_kv_heads, -1))
            except RuntimeError as err:
                raise ValueError(f"hiqcache: KV cache {name} is not contiguous per block: {err}")
        self.layer_index = {n: i for i, n in enumerate(names)}
        self.geometry = g
        self.tiles = TileConverter(first.dtype, self.bs, g.num_kv_heads, g.head_dim)

        rows = _staging_tokens(self.cfg, self.opts)
        self.load_rows = rows
        self.save_rows = rows
        total = self.load_rows + self.save_rows
        plane_bytes = slot_major_bytes(g, total)
        # Staging objects of engines (of older versions, or without a session) that were killed
        # before they could unlink them.
        stale = reap_stale((_STAGING_TAG, _EVENTS_TAG))
        if stale:
            log.info("hiqcache: removed %d shm objects of dead engine processes", len(stale))
        self.client = Client(self.opts.target, call_timeout=self.opts.timeout_ms / 1000)
        # With a session the staging area and the event slots are memfds, passed to the daemon
        # by fd and sealed against shrinking: nothing to leak in /dev/shm, nothing another
        # process can open. A daemon without sessions (or one down at start-up) gets names.
        by_fd = self.client.session() is not None
        staging_bytes = g.num_layers * 2 * plane_bytes
        n_events = _SLOT_LAYER_BASE + g.num_layers + _MAX_LOADS_PER_STEP
        if by_fd:
            self.shm = HostShm.create_memfd(_STAGING_TAG, staging_bytes)
            self.events = HostEventPool.create(n_events)
        else:
            self.shm = HostShm.create(unique_name(_STAGING_TAG), staging_bytes)
            self.events = HostEventPool.create(n_events, unique_name(_EVENTS_TAG))
        torch_dtype = first.dtype
        self.staging = torch.frombuffer(self.shm.buf, dtype=torch_dtype).view(
            g.num_layers, 2, total, g.num_kv_heads, g.head_dim)
        views = tuple(LayerView(k=slot_major_view(g, total, 0, (2 * l) * plane_bytes),
                                v=slot_major_view(g, total, 0, (2 * l + 1) * plane_bytes))
                      for l in range(g.num_layers))
        self.spec = PoolSpec(model=self.identity, tenant=self.opts.tenant, geometry=g,
                             block_tokens=self.bs, codec=self.opts.codec, device=DeviceKind.HOST,
                             buffers=(self.shm.shared_buffer(),), layers=views,
                             events=self.events.spec())
        atexit.register(self.shutdown)  # unlinks named staging objects if vLLM never calls shutdown
        try:
            self.pool = self.client.register_pool(self.spec, pending_if_unavailable=True)
        except HiqError as err:
            # The daemon is up and refuses this pool: serve without the cache.
            log.error("hiqcache: hiqcached refused the pool registration (%s); serving without "
                      "the cache", err)
            self.pool = 0
        info = self.client.pool_info(self.pool) if self.pool else None
        log.info("hiqcache: %d layers, tile order %s, staging %d+%d rows (%.1f MiB) in %s; "
                 "daemon %s: %s", g.num_layers, self.tiles.describe(), self.load_rows,
                 self.save_rows, self.shm.size / 2**20, self.shm.name, self.client.target,
                 f"pool {info.pool_id}, {info.encoded_bytes_per_token} B/token" if info
                 else "not registered yet")

    # -- tile conversion --

    def _tiles_to_rows(self, layer: int, block_ids: list[int], first_row: int) -> None:
        """Copies vLLM blocks of one layer into staging rows (first_row on)."""
        kv, st = self.layers[layer], self.staging[layer]
        runs = _runs(block_ids)
        if len(runs) * 4 > len(block_ids):  # fragmented: one gather beats many small copies
            end = first_row + len(block_ids) * self.bs
            ids = torch.tensor(block_ids, dtype=torch.int64)
            self.tiles.to_rows(kv.index_select(0, ids), st[0, first_row:end], st[1, first_row:end])
            return
        for start, count, offset in runs:
            rows = slice(first_row + offset * self.bs, first_row + (offset + count) * self.bs)
            self.tiles.to_rows(kv[start:start + count], st[0, rows], st[1, rows])

    def _rows_to_tiles(self, layer: int, block_ids: list[int], first_row: int) -> None:
        """Writes staging rows of one layer into vLLM blocks, in the attention's tile order."""
        kv, st = self.layers[layer], self.staging[layer]
        runs = _runs(block_ids)
        if len(runs) * 4 > len(block_ids):
            end = first_row + len(block_ids) * self.bs
            ids = torch.tensor(block_ids, dtype=torch.int64)
            kv.index_copy_(0, ids, self.tiles.to_tiles(st[0, first_row:end], st[1, first_row:end]))
            return
        for start, count, offset in runs:
            rows = slice(first_row + offset * self.bs, first_row + (offset + count) * self.bs)
            self.tiles.to_tiles_into(st[0, rows], st[1, rows], kv[start:start + count])

    # -- loads --

    def _finish_loads(self, timeout: float) -> bool:
        """Ends the step's restores: waits (up to `timeout`) for each one's done slot and turns
        every failure, and every layer the forward pass did not wait for, into load errors of
        this step. Restores still running stay listed (their staging rows are not reused); true
        when none is left."""
        pending = []
        deadline = time.monotonic() + timeout
        for tr, first_row, ticket, slot in self.loads:
            s = self.events.wait(slot, ticket, max(0.0, deadline - time.monotonic()))
            if not tr.reported and (not s.ok or len(self.layers_done) < self.geometry.num_layers):
                if s.code.name != "ABORTED" and s.ok:
                    self.warn("layers", "the forward pass skipped layers of a restore; recomputing")
                self.load_errors.update(tr.block_ids)
                self.stats["failed_blocks"] += len(tr.block_ids)
                tr.reported = True
            elif not tr.reported:
                self.stats["loaded_blocks"] += len(tr.block_ids)
                tr.reported = True
            if s.code.name == "DEADLINE_EXCEEDED":
                pending.append((tr, first_row, ticket, slot))
        self.loads = pending
        self.layers_done = set()
        self.layers_failed = False
        return not pending

    def _done_slot(self, i: int) -> int:
        return _SLOT_LAYER_BASE + self.geometry.num_layers + i

    def start_load(self, meta: HiqCacheConnectorMetadata) -> None:
        if self.loads and not self._finish_loads(0.0):
            # A restore of an earlier step still writes the staging area: recompute instead.
            self.warn("busy", "an earlier restore is still running; recomputing")
            for tr in meta.loads:
                self.load_errors.update(tr.block_ids)
                self.stats["failed_blocks"] += len(tr.block_ids)
            return
        self.load_ticket = 0
        if not meta.loads:
            return
        t0 = time.perf_counter()
        row = 0
        for i, tr in enumerate(meta.loads):
            need = len(tr.keys) * self.bs
            if self.pool == 0 or len(self.loads) >= _MAX_LOADS_PER_STEP or row + need > self.load_rows:
                self.load_errors.update(tr.block_ids)
                self.stats["failed_blocks"] += len(tr.block_ids)
                continue
            rows = range(row, row + need)
            res = self.client.restore(
                self.pool, tr.keys, rows, layer_event_base=_SLOT_LAYER_BASE,
                done_event=self._done_slot(len(self.loads)),
                sync=False)
            if not res.status.ok:
                self.warn("restore", "restore failed, recomputing: %s", res.status)
            if res.restored_blocks < len(tr.keys):
                missed = tr.block_ids[res.restored_blocks:]
                self.load_errors.update(missed)
                self.stats["failed_blocks"] += len(missed)
            if res.restored_blocks > 0:
                part = _Load(tr.req_id, tr.keys[:res.restored_blocks],
                             tr.block_ids[:res.restored_blocks])
                self.loads.append((part, row, res.ticket, self._done_slot(len(self.loads))))
                self.load_ticket = res.ticket
                row += need
        self.stats["load_seconds"] += time.perf_counter() - t0

    def wait_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if layer is None or not self.loads or layer in self.layers_done or self.layers_failed:
            return
        t0 = time.perf_counter()
        self.layers_done.add(layer)
        s = self.events.wait(_SLOT_LAYER_BASE + layer, self.load_ticket, self.opts.timeout_ms / 1000)
        if not s.ok:
            # Reported when the step's restores are finished (their done slots say which).
            self.warn("layer", "layer %d of this step's restores failed (%s): recomputing", layer, s)
            self.layers_done.discard(layer)
            self.layers_failed = True  # one deadline per step, not one per layer
            return
        for tr, first_row, _, _ in self.loads:
            self._rows_to_tiles(layer, tr.block_ids, first_row)
        self.stats["load_seconds"] += time.perf_counter() - t0

    def take_load_errors(self) -> set[int]:
        """This step's failed loads; called by vLLM after the forward pass."""
        if self.loads:
            self._finish_loads(self.opts.timeout_ms / 1000)
        errors, self.load_errors = self.load_errors, set()
        return errors

    # -- saves --

    def save(self, meta: HiqCacheConnectorMetadata) -> None:
        if self.pool == 0 or not meta.saves:
            return
        t0 = time.perf_counter()
        # The previous step's backup must be done reading the save area before it is reused.
        if self.backup_ticket:
            # Never stall the engine long for a save: drop this step's if the daemon lags.
            s = self.events.wait(_SLOT_BACKUP_DONE, self.backup_ticket,
                                 min(self.opts.timeout_ms / 1000, 0.25))
            if s.code.name == "DEADLINE_EXCEEDED":
                self.warn("save", "previous backup still running; dropping this step's saves")
                self.stats["dropped_saves"] += sum(len(t.keys) for t in meta.saves)
                return
        keys: list[BlockKey] = []
        ids: list[int] = []
        for tr in meta.saves:
            room = self.save_rows // self.bs - len(ids)
            take = min(room, len(tr.keys))
            keys.extend(tr.keys[:take])
            ids.extend(tr.block_ids[:take])
            self.stats["dropped_saves"] += len(tr.keys) - take
        if not keys:
            return
        for layer in range(self.geometry.num_layers):
            self._tiles_to_rows(layer, ids, self.load_rows)
        rows = range(self.load_rows, self.load_rows + len(keys) * self.bs)
        res = self.client.backup(self.pool, keys, rows, done_event=_SLOT_BACKUP_DONE, sync=False)
        if not res.status.ok:
            self.warn("backup", "backup failed (blocks stay uncached): %s", res.status)
            self.backup_ticket = 0
        else:
            self.backup_ticket = res.ticket
            self.stats["saved_blocks"] += res.held
        self.stats["save_seconds"] += time.perf_counter() - t0

    def shutdown(self) -> None:
        if self.client is None:
            return
        if self.pool:
            self.client.release_pool(self.pool)
        self.client.close()
        self.client = None
        self.staging = None
        self.events.close()
        self.shm.close()


# --- the connector ---------------------------------------------------------------------------


class HiqCacheConnector(KVConnectorBase_V1):
    """hiqcached as vLLM's KV connector (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._opts = ConnectorOptions.parse(extra)
        bs = vllm_config.cache_config.block_size
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("hiqcache: models with several KV cache groups (hybrid or sliding-"
                             "window attention) are not supported yet")
        _engine_geometry(vllm_config, 0)  # fails start-up for unsupported models
        if bs <= 0:
            raise ValueError("hiqcache: block_size must be > 0")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A block the daemon promised can be evicted before the load: that must be a miss.
            log.info("hiqcache: kv_load_failure_policy set to 'recompute' (was %r): a block "
                     "hiqcached cannot deliver is recomputed",
                     self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._scheduler = _Scheduler(vllm_config, self._opts) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _Worker(vllm_config, self._opts) if role == KVConnectorRole.WORKER else None
        self._warn = _LogOnce()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    def _guard(self, what: str, fn: Any, default: Any = None) -> Any:
        try:
            return fn()
        except Exception as err:  # never raise into vLLM
            self._warn(what, "%s failed (%s: %s); treated as a miss", what, type(err).__name__, err)
            return default

    # -- worker --

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)  # start-up: a layout not understood fails loudly

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiqCacheConnectorMetadata)

        def fail_all() -> None:
            # Restores already sent stay listed: their staging rows are not reused until done.
            self._worker.load_errors.update(b for t in meta.loads for b in t.block_ids)
            self._worker.layers_failed = True

        try:
            self._worker.start_load(meta)
        except Exception as err:
            self._warn("start_load_kv", "start_load_kv failed (%s); recomputing", err)
            fail_all()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is None:
            return
        try:
            self._worker.wait_layer(layer_name)
        except Exception as err:
            self._warn("wait_for_layer_load", "loading %s failed (%s); recomputing", layer_name,
                       err)
            self._worker.layers_done.discard(self._worker.layer_index.get(layer_name, -1))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # saved in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        self._guard("wait_for_save", lambda: self._worker.save(meta))

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._guard("shutdown", self._worker.shutdown)
        if self._scheduler is not None:
            self._guard("shutdown", self._scheduler.client.close)

    # -- scheduler --

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        n = self._guard("lookup", lambda: self._scheduler.num_new_matched_tokens(
            request, num_computed_tokens), 0)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._guard("update_state_after_alloc", lambda: self._scheduler.update_state_after_alloc(
            request, blocks, num_external_tokens))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._guard("build_connector_meta",
                           lambda: self._scheduler.build_meta(scheduler_output))
        return meta if meta is not None else HiqCacheConnectorMetadata()

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._guard("request_finished", lambda: self._scheduler.request_finished(request))
        return False, None  # saves copy out of vLLM's blocks at once: free them now
