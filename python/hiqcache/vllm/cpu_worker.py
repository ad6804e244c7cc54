"""The worker half of the vLLM connector for vLLM on CPU (HOST device).

vLLM's CPU attention keeps each (block, head) tile in an order of its own that depends on the
ISA it picked ("vec": K as [head_dim][block_size], V as [block_size][head_dim]; "amx": tokens in
groups with pairs of dims interleaved). The worker learns the order by running vLLM's own
cpu_attn_reshape_and_cache on a probe tile at start-up; a layout it cannot map exactly fails
start-up, it never backs up scrambled KV. Then, by extra-config `cpu_transport`:

  tiles    the order factors into permuted token and dim axes (vec and vec16 on x86 without
           AMX; amx, whose K tiles pair dims inside groups of 16 tokens and whose V tiles
           interleave token pairs): each plane of a tile is a split TensorView (docs/design.md
           TensorView: row_group, dim_run, dim_stride_bytes). vLLM's KV tensors move into one
           memfd the daemon maps (their storage is swapped in place, so every holder of the
           tensors sees it), and a restore is one decode straight into vLLM's blocks: wait_layer
           only waits for the layer's slot. Behind each layer's blocks the memfd holds a save
           area of whole tiles: a save copies the step's new blocks there (tile for tile, no
           conversion) and the daemon encodes them from there, so vLLM's blocks are free again
           once the copy is made.
  staging  the daemon reads and writes a staging area in shared memory
           ([layer][K|V][row][head][dim]); loads: wait_layer(layer) waits for that layer and
           scatters it into vLLM's blocks; saves gather the step's new blocks into the save area.
  auto     (default) tiles where the order can be described, else staging; the choice is logged
           at start-up and kept in the worker's stats ("transport").

Both register one pool covering every layer, its buffer a memfd sealed against shrinking and
passed to the daemon by fd over the client's session (or a named shm object for a daemon without
sessions). Loads: start_load sends one asynchronous Restore per request, all signalling the same
per-layer event slots; a restore still running when the next step starts makes that step
recompute its loads (with tiles the late restore writes the blocks it was given: the blocks of
a running request, holding the same tokens). Saves: save (all layers written) copies the step's
newly computed full blocks into the save area and sends one asynchronous Backup.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hiqcache.client import Client
from hiqcache.host import SHM_DIR, HostEventPool, HostShm, reap_stale, unique_name
from hiqcache.spec import (
    DeviceKind,
    LayerView,
    PoolSpec,
    TensorView,
    slot_major_bytes,
    slot_major_view,
)
from hiqcache.status import HiqError
from hiqcache.torch_kv import shm_tensor
from hiqcache.vllm.common import (
    ConnectorOptions,
    HiqCacheConnectorMetadata,
    _engine_geometry,
    _Load,
    _LoadSteps,
    _LogOnce,
    _staging_tokens,
    model_identity,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("hiqcache.vllm")

# Event slots of a worker's registration.
_SLOT_BACKUP_DONE = 0
_SLOT_LAYER_BASE = 1  # + layer index
_MAX_LOADS_PER_STEP = 64  # done slots for loads follow the layer slots
_STAGING_TAG, _EVENTS_TAG = "vllm-kv", "vllm-ev"  # memfd labels; shm names unique_name(tag)


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


def tile_view_strides(factors: tuple[tuple[int, int, int, int], tuple[int, ...]] | None
                      ) -> dict[str, int] | None:
    """The split TensorView fields (in elements, not bytes) that address one plane of a tile
    whose order factors as _factor_order found: row_stride, row_group, row_group_stride,
    dim_run, dim_run_stride, dim_stride (0: a run's elements adjacent; AMX's V tiles put the
    other token of a pair between them). None when the order does not factor."""
    if factors is None:
        return None
    sizes, perm = factors
    stride = [0] * 4
    step = 1
    for axis in reversed(perm):  # the tile's axes from the innermost out
        stride[axis] = step
        step *= sizes[axis]
    out = {"row_stride": 0, "row_group": 0, "row_group_stride": 0, "dim_run": 0,
           "dim_run_stride": 0, "dim_stride": 0}
    run = sizes[_D0]
    dim_step = stride[_D0] if run > 1 else 1
    if sizes[_D1] > 1 and stride[_D1] != run * dim_step:  # else one run of head_dim elements
        out["dim_run"], out["dim_run_stride"] = run, stride[_D1]
    if dim_step != 1:
        out["dim_stride"] = dim_step
    if sizes[_T0] == 1:
        out["row_stride"] = stride[_T1]
    elif sizes[_T1] == 1:
        out["row_stride"] = stride[_T0]
    else:
        out["row_stride"], out["row_group"] = stride[_T0], sizes[_T0]
        out["row_group_stride"] = stride[_T1]
    return out


def tile_plane_view(st: dict[str, int], element_size: int, **where: int) -> TensorView:
    """The TensorView of one plane of vLLM's tiles: the split fields tile_view_strides gave (in
    elements) in bytes, with `where` the rest (buffer, offset_bytes, num_rows, head_stride_bytes,
    page_rows, page_stride_bytes)."""
    es = element_size
    return TensorView(row_stride_bytes=st["row_stride"] * es, row_group=st["row_group"],
                      row_group_stride_bytes=st["row_group_stride"] * es, dim_run=st["dim_run"],
                      dim_run_stride_bytes=st["dim_run_stride"] * es,
                      dim_stride_bytes=st["dim_stride"] * es, **where)


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
        self.bs, self.heads, self.dim, self.dtype = block_size, num_heads, head_dim, dtype
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


class CpuWorker(_LoadSteps):
    """The worker half for vLLM on CPU (see the module docstring)."""

    staging: torch.Tensor | None  # staging: [L, 2, rows, heads, dim] over the shm
    area: torch.Tensor | None  # tiles: [L, blocks + save blocks, heads, 2 * bs * dim] over the shm

    def __init__(self, vllm_config: VllmConfig, opts: ConnectorOptions):
        self.cfg = vllm_config
        self.opts = opts
        self.bs = vllm_config.cache_config.block_size
        self.identity = model_identity(vllm_config)
        self.client: Client | None = None
        self.pool = 0
        self.layers: list[torch.Tensor] = []  # per layer [num_blocks, heads, 2 * bs * dim]
        self.layer_index: dict[str, int] = {}
        self.staging = None
        self.area = None
        self.in_place = False
        self._init_loads()
        self.warn = _LogOnce()
        self.lock = threading.Lock()
        self.stats = {"loaded_blocks": 0, "failed_blocks": 0, "saved_blocks": 0,
                      "dropped_saves": 0, "load_seconds": 0.0, "save_seconds": 0.0,
                      "transport": ""}

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
            raise ValueError(f"hiqcache: KV cache on {first.device}: the CPU worker serves vLLM "
                             "on CPU only (CudaWorker serves CUDA)")
        want = (g.num_kv_heads, self.bs, 2 * g.head_dim)
        for name in names:
            kv = kv_caches[name]
            if kv.dim() != 4 or tuple(kv.shape[1:]) != want or kv.dtype != first.dtype:
                raise ValueError(f"hiqcache: KV cache {name} has shape {tuple(kv.shape)} "
                                 f"{kv.dtype}; expected [blocks, {want[0]}, {want[1]}, {want[2]}]"
                                 " (vLLM CPU attention)")
            try:
                kv.view(kv.shape[0], g.num_kv_heads, -1)
            except RuntimeError as err:
                raise ValueError(
                    f"hiqcache: KV cache {name} is not contiguous per block: {err}") from err
        self.layer_index = {n: i for i, n in enumerate(names)}
        self.geometry = g
        self.tiles = TileConverter(first.dtype, self.bs, g.num_kv_heads, g.head_dim)
        strides = tuple(tile_view_strides(f) for f in self.tiles.factors)
        tensors = [kv_caches[n] for n in names]
        why = self._tiles_refused(tensors, strides)
        if why and self.opts.cpu_transport == "tiles":
            raise ValueError(f"hiqcache: cpu_transport=tiles: {why}")
        self.in_place = not why
        self.stats["transport"] = "tiles" if self.in_place else "staging"

        rows = _staging_tokens(self.cfg, self.opts)
        self.load_rows = rows
        self.save_rows = rows
        # Staging objects of engines (of older versions, or without a session) that were killed
        # before they could unlink them.
        stale = reap_stale((_STAGING_TAG, _EVENTS_TAG))
        if stale:
            log.info("hiqcache: removed %d shm objects of dead engine processes", len(stale))
        self.client = Client(self.opts.target, call_timeout=self.opts.timeout_ms / 1000)
        # With a session the shared area and the event slots are memfds, passed to the daemon
        # by fd and sealed against shrinking: nothing to leak in /dev/shm, nothing another
        # process can open. A daemon without sessions (or one down at start-up) gets names.
        by_fd = self.client.session() is not None
        n_events = _SLOT_LAYER_BASE + g.num_layers + _MAX_LOADS_PER_STEP
        if self.in_place:
            views = self._share_tiles(tensors, strides, by_fd)
        else:
            views = self._make_staging(by_fd)
        self.layers = [kv.view(kv.shape[0], g.num_kv_heads, -1) for kv in tensors]
        if by_fd:
            self.events = HostEventPool.create(n_events)
        else:
            self.events = HostEventPool.create(n_events, unique_name(_EVENTS_TAG))
        self.spec = PoolSpec(model=self.identity, tenant=self.opts.tenant, geometry=g,
                             block_tokens=self.bs, codec=self.opts.codec, device=DeviceKind.HOST,
                             buffers=(self.shm.shared_buffer(),), layers=views,
                             events=self.events.spec())
        atexit.register(self.shutdown)  # unlinks named shm objects if vLLM never calls shutdown
        try:
            self.pool = self.client.register_pool(self.spec, pending_if_unavailable=True)
        except HiqError as err:
            # The daemon is up and refuses this pool: serve without the cache.
            log.error("hiqcache: hiqcached refused the pool registration (%s); serving without "
                      "the cache", err)
            self.pool = 0
        info = self.client.pool_info(self.pool) if self.pool else None
        log.info("hiqcache: %d layers, tile order %s, %s, %d load + %d save rows (%.1f MiB) in "
                 "%s (huge pages: %s); daemon %s: %s", g.num_layers, self.tiles.describe(),
                 "in place" if self.in_place else f"staging ({why})", self.load_rows,
                 self.save_rows, self.shm.size / 2**20, self.shm.name, self.shm.huge_pages,
                 self.client.target,
                 f"pool {info.pool_id}, {info.encoded_bytes_per_token} B/token" if info
                 else "not registered yet")

    def _tiles_refused(self, tensors: list[torch.Tensor],
                       strides: tuple[dict[str, int] | None, ...]) -> str:
        """Why vLLM's tiles cannot be the daemon's views ("" when they can)."""
        if self.opts.cpu_transport == "staging":
            return "cpu_transport=staging"
        if any(st is None for st in strides):
            return f"tile order {self.tiles.describe()} has no TensorView"
        if len({kv.data_ptr() for kv in tensors}) != len(tensors):
            return "layers share a KV cache tensor"
        if any(not kv.is_contiguous() or kv.shape[0] != tensors[0].shape[0] for kv in tensors):
            return "KV cache tensors are not contiguous tensors of equal size"
        return ""

    def _shared_memory(self, size: int, by_fd: bool) -> HostShm:
        """The memory the daemon shares: a memfd on the pages `huge_pages` asks for (hugetlb or
        transparent huge pages: one TLB entry per 2 MiB where the codec and vLLM's attention
        touch a 2 KB tile at a time), or, for a daemon without sessions, a named shm object,
        whose pages its filesystem decides. huge_pages=require without huge pages raises
        ValueError naming why: a start-up error, as a layout not understood is."""
        if not by_fd:
            if self.opts.huge_pages == "require":
                if self.client is not None and self.client.passes_fds:
                    # A unix target whose daemon is down now: the pool waits for it by fd.
                    return HostShm.create_memfd(_STAGING_TAG, size, huge_pages="require")
                raise ValueError(f"hiqcache: huge_pages=require needs a unix-socket target (a "
                                 f"session passes the memfd); {self.opts.target} has none")
            return HostShm.create(unique_name(_STAGING_TAG), size)
        return HostShm.create_memfd(_STAGING_TAG, size, huge_pages=self.opts.huge_pages)

    def _make_staging(self, by_fd: bool) -> tuple[LayerView, ...]:
        """The staging area: [layer][K|V][load rows + save rows][head][dim]."""
        g = self.geometry
        total = self.load_rows + self.save_rows
        plane_bytes = slot_major_bytes(g, total)
        size = g.num_layers * 2 * plane_bytes
        self.shm = self._shared_memory(size, by_fd)
        # shm_tensor counts the shape's elements: a hugetlb memfd is rounded up to whole pages
        self.staging = shm_tensor(self.shm, self.layers_dtype,
                                  (g.num_layers, 2, total, g.num_kv_heads, g.head_dim))
        return tuple(LayerView(k=slot_major_view(g, total, 0, (2 * l) * plane_bytes),
                               v=slot_major_view(g, total, 0, (2 * l + 1) * plane_bytes))
                     for l in range(g.num_layers))

    def _share_tiles(self, tensors: list[torch.Tensor],
                     strides: tuple[dict[str, int] | None, ...], by_fd: bool
                     ) -> tuple[LayerView, ...]:
        """Moves vLLM's KV tensors into one memfd, each layer followed by its save area, and
        answers the split views of their tiles: row = block * block_size + token (a save-area
        block i is block num_blocks + i)."""
        g = self.geometry
        self.blocks = tensors[0].shape[0]
        self.save_blocks = (self.save_rows + self.bs - 1) // self.bs
        tile = 2 * self.bs * g.head_dim  # elements of one (block, head) tile, K then V
        per_layer = self.blocks + self.save_blocks
        es = tensors[0].element_size()
        size = g.num_layers * per_layer * g.num_kv_heads * tile * es
        self.shm = self._shared_memory(size, by_fd)
        self.area = shm_tensor(self.shm, tensors[0].dtype,
                               (g.num_layers, per_layer, g.num_kv_heads, tile))
        for l, kv in enumerate(tensors):
            dst = self.area[l, :self.blocks].view(kv.shape)
            dst.copy_(kv)
            # In place: vLLM's attention layers and model runner hold this very tensor object.
            kv.set_(self.area.untyped_storage(), dst.storage_offset(), kv.shape, kv.stride())
        page = g.num_kv_heads * tile * es
        views = []
        for l in range(g.num_layers):
            planes = []
            for plane, st in enumerate(strides):
                assert st is not None
                planes.append(tile_plane_view(
                    st, es, buffer=0, offset_bytes=(l * per_layer * g.num_kv_heads * tile
                                                    + plane * self.bs * g.head_dim) * es,
                    num_rows=per_layer * self.bs, head_stride_bytes=tile * es, page_rows=self.bs,
                    page_stride_bytes=page))
            views.append(LayerView(k=planes[0], v=planes[1]))
        return tuple(views)

    @property
    def layers_dtype(self) -> torch.dtype:
        return self.tiles.dtype

    # -- tile conversion --

    def _tiles_to_rows(self, layer: int, block_ids: list[int], first_row: int) -> None:
        """Copies vLLM blocks of one layer into staging rows (first_row on)."""
        assert self.staging is not None  # registered, not shut down
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
        assert self.staging is not None  # registered, not shut down
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

    @property
    def load_slots(self) -> HostEventPool | None:
        return getattr(self, "events", None)

    def _done_slot(self, i: int) -> int:
        return _SLOT_LAYER_BASE + self.geometry.num_layers + i

    def start_load(self, meta: HiqCacheConnectorMetadata) -> None:
        if self.loads and not self._finish_loads(0.0):
            # A restore of an earlier step still writes its rows: recompute instead.
            self.warn("busy", "an earlier restore is still running; recomputing")
            self.load_ticket = 0  # no layer of this step waits or copies
            for tr in meta.loads:
                self._fail(tr.block_ids)
            return
        self.load_ticket = 0
        if not meta.loads:
            return
        t0 = time.perf_counter()
        row = 0
        for tr in meta.loads:
            need = len(tr.keys) * self.bs
            if (self.pool == 0 or len(self.loads) >= _MAX_LOADS_PER_STEP
                    or (not self.in_place and row + need > self.load_rows)):
                self._fail(tr.block_ids)
                continue
            rows: Sequence[int] = range(row, row + need)
            if self.in_place:  # straight into vLLM's blocks
                rows = [b * self.bs + t for b in tr.block_ids for t in range(self.bs)]
            assert self.client is not None  # registered the pool
            res = self.client.restore(
                self.pool, tr.keys, rows, layer_event_base=_SLOT_LAYER_BASE,
                done_event=self._done_slot(len(self.loads)),
                sync=False)
            if not res.status.ok:
                self.warn("restore", "restore failed, recomputing: %s", res.status)
            if res.restored_blocks < len(tr.keys):
                missed = tr.block_ids[res.restored_blocks:]
                self._fail(missed)
            if res.restored_blocks > 0:
                part = _Load(tr.req_id, tr.keys[:res.restored_blocks],
                             tr.block_ids[:res.restored_blocks])
                self.loads.append((part, row, res.ticket, self._done_slot(len(self.loads))))
                self.load_ticket = res.ticket
                row += need
        self.stats["load_seconds"] += time.perf_counter() - t0

    def wait_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if (layer is None or not self.loads or not self.load_ticket or layer in self.layers_done
                or self.layers_failed):
            return
        t0 = time.perf_counter()
        self.layers_done.add(layer)
        s = self.events.wait(_SLOT_LAYER_BASE + layer, self.load_ticket,
                             self.opts.timeout_ms / 1000)
        if not s.ok:
            # Reported when the step's restores are finished (their done slots say which).
            self.warn("layer", "layer %d of this step's restores failed (%s): recomputing",
                      layer, s)
            self.layers_done.discard(layer)
            self.layers_failed = True  # one deadline per step, not one per layer
            return
        if not self.in_place:
            for tr, first_row, _, _ in self.loads:
                self._rows_to_tiles(layer, tr.block_ids, first_row)
        self.stats["load_seconds"] += time.perf_counter() - t0

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
                self._drop_saves(meta)
                return
        keys, ids = self._saves_that_fit(meta, self.save_rows // self.bs)
        if not keys:
            return
        if self.in_place:
            assert self.area is not None  # registered, not shut down
            # Tile for tile into the save area behind each layer's blocks.
            first = self.blocks
            for layer in range(self.geometry.num_layers):
                kv, save = self.layers[layer], self.area[layer, first:first + len(ids)]
                for start, count, offset in _runs(ids):
                    save[offset:offset + count].copy_(kv[start:start + count])
            rows: Sequence[int] = range(first * self.bs, (first + len(keys)) * self.bs)
        else:
            for layer in range(self.geometry.num_layers):
                self._tiles_to_rows(layer, ids, self.load_rows)
            rows = range(self.load_rows, self.load_rows + len(keys) * self.bs)
        assert self.client is not None  # registered the pool
        res = self.client.backup(self.pool, keys, rows, done_event=_SLOT_BACKUP_DONE, sync=False)
        self._backup_sent(res)
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
        if self.in_place:
            # vLLM's KV tensors live in the mapping for as long as the process does: it stays
            # mapped; a named object loses its name.
            self.area = None
            self.shm.owner = False
            if not self.shm.is_memfd:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(SHM_DIR + self.shm.name)
            return
        self.shm.close()

