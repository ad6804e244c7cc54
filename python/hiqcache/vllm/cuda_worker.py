"""The worker half of the vLLM connector for vLLM on CUDA.

vLLM's GPU attention backends keep each layer's KV as one tensor of pages: FlashAttention's
[2][blocks][block_size][heads][head_dim], FlashInfer's and Triton's [blocks][2][block_size][heads]
[head_dim], with strides that may put heads before tokens (the backend's stride order). head_dim
is always contiguous, so K and V of every layer are TensorViews (torch_kv.paged_view) and the
daemon can address vLLM's blocks as rows: row = block * block_size + token.

Transports (extra-config `cuda_transport`):
  ipc   hiqcached maps vLLM's KV allocations through CUDA IPC (torch_kv.cuda_export) and
        restores straight into vLLM's blocks on its own streams; a backup reads a GPU snapshot
        of the step's new blocks (vLLM may hand a block to another request once the step ends).
  host  hiqcached reads and writes page-locked staging in a memfd, as for vLLM on CPU; the
        engine's stream copies between the staging and its blocks. For nodes where the daemon
        cannot map the engine's GPU memory: a daemon built without CUDA, a daemon that does not
        see this GPU, PyTorch's expandable segments.
  auto  (default) ipc where the daemon accepts vLLM's allocations and a probe block makes the
        round trip through them, else host; the choice and its reason are logged at start-up
        and kept in the worker's stats ("transport").

Completion through ticket slots (torch_kv.CudaTicketSlots, docs/design.md "Completion: ticket
slots"), two pools and so two slot sets: the load pool (slot 0 the engine's wait slot, 1 + layer
the layer slots, then one done slot per restore of the step) and the save pool (slot 0 the wait
slot, 1 the backup's done slot). The engine's stream stores a fresh value into a wait slot behind
the work that must finish before the daemon touches the rows (the previous step's reads of the
blocks a restore overwrites; the snapshot a backup reads); with ipc each layer's attention waits
on its layer slot on the stream, so the forward pass never blocks the host. A failed or released
slot (the daemon failed the work or died) lets the stream go on, and take_load_errors reports
those blocks: vLLM recomputes them. A restore still running after its deadline keeps the stream
of the next step waiting for its done slot (ipc: it writes vLLM's blocks) or its staging rows
reserved (host), so no recompute races a late write.

The CUDA calls go through DeviceOps; tests/python/engines/test_vllm_cuda_worker.py runs the step
logic on CPU tensors in vLLM's layouts against the real daemon with a host stand-in.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from hiqcache.client import Client
from hiqcache.host import TICKET_MASK, HostEventPool, HostShm
from hiqcache.keys import BlockKey, root_block_key
from hiqcache.spec import (
    DeviceKind,
    LayerView,
    PoolSpec,
    SharedBuffer,
    slot_major_bytes,
    slot_major_view,
)
from hiqcache.status import HiqError
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

    from hiqcache.torch_kv import CudaTicketSlots

log = logging.getLogger("hiqcache.vllm")

_WAIT_SLOT = 0  # both pools: the slot the engine's stream stores wait values into
_LAYER_BASE = 1  # load pool: + layer index
_SAVE_DONE = 1  # save pool
_MAX_LOADS_PER_STEP = 64  # load pool: done slots follow the layer slots


def split_kv_layer(kv: torch.Tensor, block_size: int, heads: int, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one vLLM GPU layer tensor, each a [blocks, block_size, heads, head_dim] view.

    [2, blocks, ...] (FlashAttention) or [blocks, 2, ...] (FlashInfer, Triton); ValueError for
    any other shape, and for two blocks, where the two cannot be told apart."""
    page = (block_size, heads, head_dim)
    if kv.dim() != 5 or tuple(kv.shape[2:]) != page:
        raise ValueError(f"hiqcache: a KV cache of shape {tuple(kv.shape)}; expected [2, blocks, "
                         f"{block_size}, {heads}, {head_dim}] or [blocks, 2, {block_size}, "
                         f"{heads}, {head_dim}] (vLLM's GPU attention backends)")
    first, second = kv.shape[0] == 2, kv.shape[1] == 2
    if first and second:
        raise ValueError("hiqcache: a KV cache of 2 blocks: K|V axis ambiguous; give vLLM more "
                         "KV cache memory")
    if first:
        return kv[0], kv[1]
    if second:
        return kv[:, 0], kv[:, 1]
    raise ValueError(f"hiqcache: a KV cache of shape {tuple(kv.shape)} has no K|V axis of 2")


class DeviceOps:
    """The CUDA calls of CudaWorker."""

    def slots(self, count: int, device: torch.device) -> HostEventPool:
        from hiqcache.torch_kv import CudaTicketSlots

        return CudaTicketSlots(count, device)

    def export(self, t: torch.Tensor) -> tuple[bytes, int, int]:
        """(IPC handle of t's allocation, offset of t from its base, bytes from base to end)."""
        from hiqcache.torch_kv import cuda_export

        return cuda_export(t)

    def device_uuid(self, device: torch.device) -> str:
        from hiqcache.torch_kv import cuda_device_uuid

        return cuda_device_uuid(device.index if device.index is not None
                                else torch.cuda.current_device())

    def pin(self, t: torch.Tensor) -> None:
        """Page-locks a tensor over host memory, so the stream's copies are asynchronous DMA."""
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if err != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of the staging area failed: "
                               f"{cudart.cudaGetErrorString(err)}")

    def unpin(self, t: torch.Tensor) -> None:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
        cudart.cudaHostUnregister(t.data_ptr())

    def stream_write(self, slots: HostEventPool, slot: int, value: int) -> None:
        """The current stream stores `value` into the slot once its earlier work completed."""
        cast("CudaTicketSlots", slots).write_on_stream(slot, value)  # made by slots()

    def stream_wait(self, slots: HostEventPool, slot: int, ticket: int) -> None:
        """Later work on the current stream waits until the slot reaches `ticket`."""
        cast("CudaTicketSlots", slots).wait_on_stream(slot, ticket)  # made by slots()


@dataclass
class _Side:
    """One pool registration of the worker: its slots and the wait values stored so far."""

    slots: HostEventPool
    pool: int = 0
    wait_value: int = 0

    def next_wait_value(self) -> int:
        self.wait_value += 1
        return self.wait_value


class CudaWorker(_LoadSteps):
    """The worker half for vLLM on CUDA (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, opts: ConnectorOptions,
                 ops: DeviceOps | None = None):
        self.cfg = vllm_config
        self.opts = opts
        self.ops = ops if ops is not None else DeviceOps()
        self.bs = vllm_config.cache_config.block_size
        self.identity = model_identity(vllm_config)
        self.client: Client | None = None
        self.transport = ""
        self.k: list[torch.Tensor] = []  # per layer [blocks, bs, heads, dim]
        self.v: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.load: _Side | None = None
        self.save_side: _Side | None = None
        self.shms: list[HostShm] = []
        self.pinned: list[torch.Tensor] = []
        self.load_stage: torch.Tensor | None = None  # host: [L, 2, rows, heads, dim], pinned
        self.save_stage: torch.Tensor | None = None  # ipc: on the GPU; host: pinned
        self._init_loads()
        self.warn = _LogOnce()
        self.lock = threading.Lock()
        self.stats: dict[str, Any] = {"loaded_blocks": 0, "failed_blocks": 0, "saved_blocks": 0,
                                      "dropped_saves": 0, "load_seconds": 0.0,
                                      "save_seconds": 0.0, "transport": ""}

    # -- registration --

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self.register_layers([kv_caches[n] for n in names], get_tensor_model_parallel_rank())
        self.layer_index = {n: i for i, n in enumerate(names)}

    def register_layers(self, layers: list[torch.Tensor], tp_rank: int) -> None:
        """Start-up with vLLM's layer tensors in layer order: the transport is chosen and the
        pools registered. ValueError for a layout or an option this worker cannot serve."""
        g = _engine_geometry(self.cfg, tp_rank)
        if len(layers) != g.num_layers:
            raise ValueError(f"hiqcache: {len(layers)} KV cache tensors for {g.num_layers} layers")
        first = layers[0]
        for kv in layers:
            if kv.device != first.device or kv.dtype != first.dtype:
                raise ValueError(f"hiqcache: KV caches on {kv.device} {kv.dtype} and "
                                 f"{first.device} {first.dtype}: one device and dtype expected")
            k, v = split_kv_layer(kv, self.bs, g.num_kv_heads, g.head_dim)
            if self.k and k.shape[0] != self.k[0].shape[0]:
                raise ValueError("hiqcache: layers with different block counts")
            self.k.append(k)
            self.v.append(v)
        self.layer_index = {str(i): i for i in range(len(layers))}
        self.geometry = g
        self.device = first.device
        self.dtype = first.dtype
        self.rows = _staging_tokens(self.cfg, self.opts)
        self.client = Client(self.opts.target, call_timeout=self.opts.timeout_ms / 1000)
        if not self.client.passes_fds:
            raise ValueError(f"hiqcache: vLLM on CUDA needs hiqcached on this node (a unix "
                             f"socket target passing memory by fd), got {self.client.target!r}")
        want = self.opts.cuda_transport
        why = "cuda_transport=host"
        if want in ("auto", "ipc"):
            try:
                why = self._register_ipc()
            except (ValueError, RuntimeError, HiqError) as err:
                self._release()
                if want == "ipc":
                    raise ValueError(f"hiqcache: cuda_transport=ipc: {err}") from err
                why = f"ipc not possible: {err}"
        if not self.transport:
            self._register_host()
        self.stats["transport"] = self.transport
        info = self.client.pool_info(self.load.pool) if self.load and self.load.pool else None
        log.info("hiqcache: vLLM on %s, %d layers, transport %s (%s), staging %d rows per step; "
                 "daemon %s: %s", self.device, g.num_layers, self.transport, why, self.rows,
                 self.client.target, f"{info.encoded_bytes_per_token} B/token" if info
                 else "not registered yet")

    def _spec(self, device: DeviceKind, buffers: tuple[SharedBuffer, ...],
              layers: tuple[LayerView, ...], slots: HostEventPool) -> PoolSpec:
        uuid = self.ops.device_uuid(self.device) if device is DeviceKind.CUDA else ""
        return PoolSpec(model=self.identity, tenant=self.opts.tenant, geometry=self.geometry,
                        block_tokens=self.bs, codec=self.opts.codec, device=device,
                        buffers=buffers, layers=layers, events=slots.spec(),
                        cuda_device_uuid=uuid)

    def _register(self, spec: PoolSpec) -> int:
        """The pool's handle (pending while the daemon is unreachable); HiqError when the
        daemon refuses it."""
        assert self.client is not None
        return self.client.register_pool(spec, pending_if_unavailable=True)

    def _register_ipc(self) -> str:
        """vLLM's allocations and a GPU snapshot area as CUDA pools; the reason it was chosen."""
        from hiqcache.torch_kv import paged_view

        g, dev = self.geometry, self.device
        n_load = _LAYER_BASE + g.num_layers + _MAX_LOADS_PER_STEP
        self.load = _Side(self.ops.slots(n_load, dev))
        self.save_side = _Side(self.ops.slots(_SAVE_DONE + 1, dev))
        # The allocations holding vLLM's layers, each exported once (a handle names the
        # allocation: several layers may share one).
        handles: dict[bytes, int] = {}
        ends: list[int] = []
        views = []
        for k, v in zip(self.k, self.v):
            pair = []
            for t in (k, v):
                handle, offset, end = self.ops.export(t)
                i = handles.setdefault(handle, len(handles))
                if i == len(ends):
                    ends.append(end)
                ends[i] = max(ends[i], end)
                pair.append(paged_view(t, i, offset))
            views.append(LayerView(k=pair[0], v=pair[1]))
        buffers = tuple(SharedBuffer(size_bytes=end, cuda_ipc_handle=h)
                        for h, end in zip(handles, ends))
        self.save_stage = torch.empty(g.num_layers, 2, self.rows, g.num_kv_heads, g.head_dim,
                                      dtype=self.dtype, device=dev)
        stage_views, stage_buffers = self._stage_views(self.save_stage)
        assert self.client is not None  # made by register_layers
        reachable = self.client.session() is not None
        self.load.pool = self._register(self._spec(DeviceKind.CUDA, buffers, tuple(views),
                                                   self.load.slots))
        self.save_side.pool = self._register(self._spec(DeviceKind.CUDA, stage_buffers,
                                                        stage_views, self.save_side.slots))
        self.transport = "ipc"
        if not reachable:
            return "daemon unreachable at start-up: registers once it is up, not probed"
        self._probe()
        return "the daemon maps vLLM's KV memory; probe block restored"

    def _stage_views(self, stage: torch.Tensor) -> tuple[tuple[LayerView, ...],
                                                         tuple[SharedBuffer, ...]]:
        """Views of a [L, 2, rows, heads, dim] area: on the GPU (exported), or over a memfd."""
        g = self.geometry
        plane = slot_major_bytes(g, self.rows)
        if stage.is_cuda:
            handle, offset, end = self.ops.export(stage)
            buffers = (SharedBuffer(size_bytes=end, cuda_ipc_handle=handle),)
        else:
            offset = 0
            buffers = (self.shms[-1].shared_buffer(),)
        views = tuple(LayerView(k=slot_major_view(g, self.rows, 0, offset + 2 * l * plane),
                                v=slot_major_view(g, self.rows, 0, offset + (2 * l + 1) * plane))
                      for l in range(g.num_layers))
        return views, buffers

    def _probe(self) -> None:
        """Backs up rows of the save area under a key of this process, restores them into the
        next rows through the daemon's mapping and compares: RuntimeError when they differ (a
        daemon that maps the handles but not this GPU's memory as the engine sees it)."""
        assert (self.client is not None and self.save_side is not None
                and self.save_stage is not None)
        bs, stage = self.bs, self.save_stage
        g = torch.Generator(device="cpu").manual_seed(os.getpid())
        want = torch.randn(stage.shape[0], 2, bs, *stage.shape[3:], generator=g).to(self.dtype)
        stage[:, :, :bs].copy_(want.to(stage.device))
        stage[:, :, bs:2 * bs].zero_()
        self._sync()
        key: BlockKey = root_block_key(f"hiqcache-probe|{self.identity}|{os.getpid()}|"
                                       f"{time.time_ns()}")
        pool = self.save_side.pool
        b = self.client.backup(pool, [key], range(bs), sync=True)
        if not b.status.ok:
            raise RuntimeError(f"probe backup: {b.status}")
        r = self.client.restore(pool, [key], range(bs, 2 * bs), sync=True)
        self.client.evict(pool, [key])
        if not r.status.ok or r.restored_blocks != 1:
            raise RuntimeError(f"probe restore: {r.status}")
        got = stage[:, :, bs:2 * bs].float().cpu()
        err = (got - want.float()).abs().max().item()
        # Raw is exact; a lossy codec is far closer than this (a wrong mapping is off by the
        # data's own size).
        bound = 0.0 if self.opts.codec.name == "RAW" else want.float().abs().max().item() / 4
        if not err <= bound:
            raise RuntimeError(f"probe block came back {err:.4g} off (bound {bound:.4g})")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _register_host(self) -> None:
        """Page-locked staging in memfds (load rows, then save rows) as HOST pools."""
        g = self.geometry
        self.transport = "host"
        n_load = _LAYER_BASE + g.num_layers + _MAX_LOADS_PER_STEP
        self.load = _Side(self.ops.slots(n_load, self.device))
        self.save_side = _Side(self.ops.slots(_SAVE_DONE + 1, self.device))
        stages = []
        for side, tag in ((self.load, "vllm-load"), (self.save_side, "vllm-save")):
            shm = HostShm.create_memfd(tag, g.num_layers * 2 * slot_major_bytes(g, self.rows))
            self.shms.append(shm)
            from hiqcache.torch_kv import shm_tensor

            stage = shm_tensor(shm, self.dtype,
                               (g.num_layers, 2, self.rows, g.num_kv_heads, g.head_dim))
            self.ops.pin(stage)
            self.pinned.append(stage)
            views, buffers = self._stage_views(stage)
            try:
                side.pool = self._register(self._spec(DeviceKind.HOST, buffers, views,
                                                      side.slots))
            except HiqError as err:
                log.error("hiqcache: hiqcached refused the %s pool (%s); serving without the "
                          "cache", tag, err)
                side.pool = 0
            stages.append(stage)
        self.load_stage, self.save_stage = stages

    def _release(self) -> None:
        """Drops what a failed registration attempt left (pools, slots, staging)."""
        for side in (self.load, self.save_side):
            if side is None:
                continue
            if side.pool and self.client is not None:
                self.client.release_pool(side.pool)
            side.slots.close()
        self.load = self.save_side = None
        for t in self.pinned:
            self.ops.unpin(t)
        self.pinned = []
        self.load_stage = self.save_stage = None
        for shm in self.shms:
            shm.close()
        self.shms = []
        self.transport = ""

    # -- loads --

    @property
    def load_slots(self) -> HostEventPool | None:
        return self.load.slots if self.load is not None else None

    def _done_slot(self, i: int) -> int:
        return _LAYER_BASE + self.geometry.num_layers + i

    def _rows(self, tr: _Load, first_row: int) -> list[int]:
        """The rows a restore writes: vLLM's blocks (ipc) or staging rows (host)."""
        if self.transport == "ipc":
            return [b * self.bs + t for b in tr.block_ids for t in range(self.bs)]
        return list(range(first_row, first_row + len(tr.block_ids) * self.bs))

    def start_load(self, meta: HiqCacheConnectorMetadata) -> None:
        load = self.load
        if self.loads and not self._finish_loads(0.0):
            if self.transport == "ipc":
                # Late restores still write vLLM's blocks: this step's work (and the recompute
                # of those blocks) waits on the stream for their done slots.
                assert load is not None  # restores went through it
                for _, _, ticket, slot in self.loads:
                    self.ops.stream_wait(load.slots, slot, ticket)
            self.warn("busy", "an earlier restore is still running; recomputing")
            self.load_ticket = 0  # no layer of this step waits or copies
            for tr in meta.loads:
                self._fail(tr.block_ids)
            return
        self.load_ticket = 0
        if not meta.loads:
            return
        t0 = time.perf_counter()
        if load is None or load.pool == 0:
            for tr in meta.loads:
                self._fail(tr.block_ids)
            return
        # The daemon writes the rows only once the stream has finished what it enqueued before:
        # the previous step's reads of these blocks (ipc), its copies out of the staging (host).
        wait_value = load.next_wait_value()
        self.ops.stream_write(load.slots, _WAIT_SLOT, wait_value)
        assert self.client is not None  # registered the pool
        row = 0
        for tr in meta.loads:
            need = len(tr.keys) * self.bs
            if len(self.loads) >= _MAX_LOADS_PER_STEP or (self.transport == "host"
                                                          and row + need > self.rows):
                self._fail(tr.block_ids)
                continue
            part = _Load(tr.req_id, tr.keys, tr.block_ids)
            slot = self._done_slot(len(self.loads))
            res = self.client.restore(load.pool, tr.keys, self._rows(part, row),
                                      wait_event=_WAIT_SLOT, wait_value=wait_value,
                                      layer_event_base=_LAYER_BASE, done_event=slot, sync=False)
            if not res.status.ok:
                self.warn("restore", "restore failed, recomputing: %s", res.status)
            if res.restored_blocks < len(tr.keys):
                self._fail(tr.block_ids[res.restored_blocks:])
            if res.restored_blocks > 0:
                part = _Load(tr.req_id, tr.keys[:res.restored_blocks],
                             tr.block_ids[:res.restored_blocks])
                self.loads.append((part, row, res.ticket, slot))
                self.load_ticket = res.ticket
                row += need
        self.stats["load_seconds"] += time.perf_counter() - t0

    def wait_layer(self, layer_name: str) -> None:
        layer = self.layer_index.get(layer_name)
        if (layer is None or not self.loads or not self.load_ticket or layer in self.layers_done
                or self.layers_failed):
            return
        t0 = time.perf_counter()
        load = self.load
        assert load is not None  # the step's restores went through it
        if self.transport == "ipc":
            # The layer's attention waits on the stream; a failed slot lets it go on and
            # take_load_errors reports the blocks.
            self.ops.stream_wait(load.slots, _LAYER_BASE + layer, self.load_ticket)
            self.layers_done.add(layer)
            self.stats["load_seconds"] += time.perf_counter() - t0
            return
        s = load.slots.wait(_LAYER_BASE + layer, self.load_ticket, self.opts.timeout_ms / 1000)
        if not s.ok:
            self.warn("layer", "layer %d of this step's restores failed (%s): recomputing",
                      layer, s)
            self.layers_failed = True  # one deadline per step, not one per layer
            return
        self.layers_done.add(layer)
        assert self.load_stage is not None  # host transport
        stage = self.load_stage[layer]
        heads, dim = self.geometry.num_kv_heads, self.geometry.head_dim
        for tr, first_row, _, _ in self.loads:
            n = len(tr.block_ids)
            if tr.reported:
                continue
            ids = torch.tensor(tr.block_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            rows = slice(first_row, first_row + n * self.bs)
            for plane, dst in ((0, self.k[layer]), (1, self.v[layer])):
                src = stage[plane, rows].view(n, self.bs, heads, dim)
                dst.index_copy_(0, ids, src.to(self.device, non_blocking=True))
        self.stats["load_seconds"] += time.perf_counter() - t0

    # -- saves --

    def save(self, meta: HiqCacheConnectorMetadata) -> None:
        side = self.save_side
        if side is None or side.pool == 0 or not meta.saves:
            return
        t0 = time.perf_counter()
        # The previous backup must be done reading the save area before the stream writes it;
        # never stall the engine for a save: drop this step's while the daemon lags.
        done = side.slots.read(_SAVE_DONE) & TICKET_MASK
        if self.backup_ticket and done < self.backup_ticket:
            self._drop_saves(meta)
            return
        keys, ids = self._saves_that_fit(meta, self.rows // self.bs)
        if not keys:
            return
        n = len(ids)
        assert self.save_stage is not None and self.client is not None  # made with save_side
        heads, dim = self.geometry.num_kv_heads, self.geometry.head_dim
        index = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        for layer in range(self.geometry.num_layers):
            for plane, src in ((0, self.k[layer]), (1, self.v[layer])):
                dst = self.save_stage[layer, plane, :n * self.bs].view(n, self.bs, heads, dim)
                dst.copy_(src.index_select(0, index), non_blocking=True)
        # The daemon reads the snapshot once the stream has written it.
        wait_value = side.next_wait_value()
        self.ops.stream_write(side.slots, _WAIT_SLOT, wait_value)
        res = self.client.backup(side.pool, keys, range(n * self.bs), wait_event=_WAIT_SLOT,
                                 wait_value=wait_value, done_event=_SAVE_DONE, sync=False)
        self._backup_sent(res)
        self.stats["save_seconds"] += time.perf_counter() - t0

    def shutdown(self) -> None:
        if self.client is None:
            return
        # Nothing of the daemon may still read or write our memory when it is freed: the
        # release waits for the pool's queued work.
        self._release()
        self.client.close()
        self.client = None
