"""SGLang HiCache L3 storage backend: SGLang's host KV pool is backed up to and restored from
hiqcached, so every SGLang instance on a node shares one compressed copy of what it offloads,
kept across engine and daemon restarts. SGLang loads it without a fork:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "hiqcache", "module_path": "hiqcache.sglang",
        "class_name": "HiqCacheStorage", "interface_v1": true, "allocator": "shm",
        "target": "unix:///run/hiqcache/hiqcached.sock", "codec": "int8_per_head"}'

Names are a contract (docs/design.md "Engine adapters"). Optional keys beyond it: `tenant`,
`identity` (anything else that changes the KV and is not in SGLang's model name, such as the
weights' revision or quantization), `timeout_ms` (deadline of every daemon call, default 10000:
a set waits until the daemon has read its pages), `staging_pages` (pages of the copy area of
the generic batch_get/batch_set path; 0 = as many as fit 64 MiB, at most 128) and `huge_pages`
(the copy area's memfd: "auto", the default, on hugetlb pages where the hugetlb pool holds it,
else advised for transparent huge pages; "off"; "require", under which every generic get or
set is a miss, logged, when neither is there: hiqcache.host.HostShm.create_memfd; the zero-copy
path uses SGLang's own memfd, whose pages SGLang chooses). An unknown key or
a bad value fails start-up with a message that names it, as does a host pool this backend cannot
serve exactly (an allocator other than "shm", a layout or KV dtype it cannot describe). After
start-up nothing raises into SGLang's cache controller: any failure is a miss (batch_exists
answers 0, a get reports the page as not retrieved and SGLang recomputes it, a set reports it as
not stored).

Zero copy. With "allocator": "shm" SGLang allocates the host pool in a memfd
(ShmHostTensorAllocator). register_mem_pool_host registers that memfd with the daemon as one
HOST buffer, passed by fd over the client's session (SCM_RIGHTS), with one TensorView per layer
and K|V describing the layout (layer_first, page_first, page_first_direct, page_head; MLA
pools: layer_first, page_first, page_first_direct); SGLang's memfd is not sealable, the daemon
guards its mapping against truncation. batch_set_v1 / batch_get_v1 are then one synchronous
Backup / Restore of exactly those host slots: the daemon encodes from and decodes into SGLang's
pages itself, and the call returns once it has, so SGLang may reuse the pages at once. The daemon
can run as its own user (deploy/hiqcached.service) and the engine as another: the fd is the only
access it is given.

Generic path (interface_v1 false: SGLang's batch_get / batch_set with flat page tensors): the
pages are copied through a memfd copy area with the host pool's own layout, registered as a
second pool of the same namespace.

Namespace: model "sglang:<SGLang's storage model name>" (plus `identity`, pipeline stage and
context-parallel shard when used), tenant, geometry (layers, this rank's KV heads, head dim,
dtype, MHA or MLA, tp_rank/tp_size), page size as block_tokens and codec. The host layout is not
part of it: engines with different layouts share pages. MLA pages are stored once per node (the
daemon leaves TP out of an MLA namespace), and SGLang lets only one rank write them. Keys: SGLang's
page hashes are hex SHA-256 chains (over the page's tokens, LoRA and cache salt); a key is their
first 16 bytes, any other string its XXH3-128.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from hiqcache.client import BlockStatus, Client, normalize_target
from hiqcache.host import HUGE_PAGES, HostShm
from hiqcache.keys import BlockKey
from hiqcache.options import ExtraConfig
from hiqcache.session import session_path_for_target
from hiqcache.spec import (
    Attention,
    Codec,
    DeviceKind,
    DType,
    Geometry,
    LayerView,
    PoolSpec,
    SharedBuffer,
    TensorView,
)
from hiqcache.status import HiqError, Status
from hiqcache.torch_kv import shm_tensor

log = logging.getLogger("hiqcache.sglang")

WHERE = "hicache-storage-backend-extra-config"
# SGLang's own keys (read by its StorageBackendFactory and cache controller), then ours.
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator")
_OUR_KEYS = ("target", "codec", "tenant", "identity", "timeout_ms", "staging_pages",
             "huge_pages", "rope_theta", "rope_interleaved")
_TORCH_DTYPES = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16}
_STAGING_BYTES = 64 << 20
_STORED = (BlockStatus.STORED, BlockStatus.ALREADY_PRESENT)


@dataclass(frozen=True)
class BackendOptions:
    target: str = ""
    codec: Codec = Codec.INT8_PER_HEAD
    tenant: str = ""
    identity: str = ""
    interface_v1: bool = True
    timeout_ms: int = 10_000
    staging_pages: int = 0
    huge_pages: str = "auto"
    # The model's RoPE (SGLang's storage config does not carry it), for codecs that turn keys
    # (int4_allot, int5_allot, int6_allot); 0 = none (no turn).
    rope_theta: float = 0.0
    rope_interleaved: bool = False

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> BackendOptions:
        """Validates the extra config; ValueError naming the offending key."""
        opts = ExtraConfig(extra, WHERE, _SGLANG_KEYS + _OUR_KEYS)
        allocator = opts.text("allocator")
        if allocator != "shm":
            raise ValueError(f"hiqcache: {WHERE}['allocator'] must be \"shm\" (the host pool "
                             "must live in a memfd the daemon can map), got "
                             f"{opts.extra.get('allocator')!r}")
        target = opts.target()
        if not session_path_for_target(normalize_target(target)):
            raise ValueError(f"hiqcache: {WHERE}['target'] must be the daemon's unix socket "
                             "(the host pool reaches it by fd over a session), got "
                             f"{target!r}")
        return cls(target=target, codec=opts.codec(), tenant=opts.text("tenant"),
                   identity=opts.text("identity"),
                   interface_v1=opts.flag("interface_v1", False),
                   timeout_ms=opts.integer("timeout_ms", 10_000, 1, 600_000),
                   staging_pages=opts.integer("staging_pages", 0, 0, STORAGE_BATCH_SIZE),
                   huge_pages=opts.choice("huge_pages", "auto", HUGE_PAGES),
                   rope_theta=opts.rope_theta(),
                   rope_interleaved=opts.flag("rope_interleaved", False))


def page_key(key: str) -> BlockKey:
    """The 16-byte daemon key of an SGLang page hash (see the module docstring)."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)[:16]
        except ValueError:
            pass
    return xxhash.xxh3_128_digest(key.encode("utf-8", "surrogatepass"))


# --- host pool layouts ---------------------------------------------------------------------------

# For each (attention, layout): the dimension of the host pool's kv_buffer that counts token slots
# (or pages, when the layout is paged), and how one layer's K (plane 0) or V (plane 1) becomes a
# 4-D view [pages, page rows, heads, head_dim] of that buffer.
_Select = Callable[[torch.Tensor, int, int], torch.Tensor]
_MHA: dict[str, tuple[int, bool, _Select]] = {
    # (2, layers, slots, heads, dim)
    "layer_first": (2, False, lambda t, c, l: t[c, l].unsqueeze(0)),
    # (2, slots, layers, heads, dim)
    "page_first": (1, False, lambda t, c, l: t[c, :, l].unsqueeze(0)),
    # (2, pages, layers, page_size, heads, dim)
    "page_first_direct": (1, True, lambda t, c, l: t[c, :, l]),
    # (2, pages, heads, page_size, layers, dim)
    "page_head": (1, True, lambda t, c, l: t[c, :, :, :, l].permute(0, 2, 1, 3)),
}
_MLA: dict[str, tuple[int, bool, _Select]] = {
    # (layers, slots, 1, kv_cache_dim)
    "layer_first": (1, False, lambda t, c, l: t[l].unsqueeze(0)),
    # (slots, layers, 1, kv_cache_dim)
    "page_first": (0, False, lambda t, c, l: t[:, l].unsqueeze(0)),
    # (pages, layers, page_size, 1, kv_cache_dim)
    "page_first_direct": (0, True, lambda t, c, l: t[:, l]),
}


def _view(t4: torch.Tensor, base: int, buffer: int) -> TensorView:
    """A TensorView of a 4-D [pages, page rows, heads, dim] view into a buffer at `base`."""
    pages, page_rows = t4.shape[0], t4.shape[1]
    e = t4.element_size()
    if t4.stride(3) != 1:
        raise ValueError("hiqcache: the host pool's head_dim is not contiguous")
    return TensorView(buffer=buffer, offset_bytes=t4.data_ptr() - base,
                      row_stride_bytes=t4.stride(1) * e, num_rows=pages * page_rows,
                      head_stride_bytes=t4.stride(2) * e,
                      page_rows=page_rows if pages > 1 else 0,
                      page_stride_bytes=t4.stride(0) * e if pages > 1 else 0)


@dataclass(frozen=True)
class HostLayout:
    """How one SGLang host pool lays out its KV, as hiqcache geometry and views."""

    attention: Attention
    layout: str
    num_layers: int
    num_heads: int
    head_dim: int
    dtype: DType
    page_size: int

    @classmethod
    def of(cls, host: Any) -> HostLayout:
        """ValueError naming what this backend cannot serve exactly."""
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        kind = type(host).__name__
        if type(host) is MHATokenToKVPoolHost:
            attention, table = Attention.MHA, _MHA
            heads, dim = host.head_num, host.head_dim
            if host.v_head_dim != host.head_dim:
                raise ValueError(f"hiqcache: {kind} with K head_dim {host.head_dim} and V "
                                 f"head_dim {host.v_head_dim}: K and V rows must be equal")
        elif type(host) is MLATokenToKVPoolHost:
            attention, table = Attention.MLA, _MLA
            heads, dim = 1, host.kv_cache_dim
            if getattr(host, "dsa_kv_cache_store_fp8", False):
                raise ValueError(f"hiqcache: {kind} stores packed FP8 rows; hiqcache stores "
                                 "BF16 or FP16 KV")
        else:
            raise ValueError(f"hiqcache: host pool {kind} is not supported (supported: "
                             "MHATokenToKVPoolHost, MLATokenToKVPoolHost)")
        if host.layout not in table:
            raise ValueError(f"hiqcache: {kind} layout {host.layout!r} is not supported "
                             f"(supported: {', '.join(table)})")
        dtype = _TORCH_DTYPES.get(host.dtype)
        if dtype is None:
            raise ValueError(f"hiqcache: {kind} holds {host.dtype}; hiqcache stores BF16 or "
                             "FP16 KV")
        return cls(attention=attention, layout=host.layout, num_layers=host.layer_num,
                   num_heads=heads, head_dim=dim, dtype=dtype, page_size=host.page_size)

    def _entry(self) -> tuple[int, bool, _Select]:
        return (_MHA if self.attention == Attention.MHA else _MLA)[self.layout]

    def views(self, kv: torch.Tensor, base: int, buffer: int = 0) -> tuple[LayerView, ...]:
        """One LayerView per layer of `kv` (a tensor in this layout) inside a buffer at `base`."""
        _, _, select = self._entry()
        out = []
        for l in range(self.num_layers):
            k = _view(select(kv, 0, l), base, buffer)
            v = _view(select(kv, 1, l), base, buffer) if self.attention == Attention.MHA else None
            out.append(LayerView(k=k, v=v))
        return tuple(out)

    def staging_shape(self, kv_shape: Sequence[int], pages: int) -> tuple[int, ...]:
        """kv's shape, cut down to `pages` pages."""
        dim, paged, _ = self._entry()
        shape = list(kv_shape)
        shape[dim] = pages if paged else pages * self.page_size
        return tuple(shape)

    def pages_in(self, kv: torch.Tensor) -> int:
        dim, paged, _ = self._entry()
        return kv.shape[dim] if paged else kv.shape[dim] // self.page_size

    def page(self, kv: torch.Tensor, first_slot: int) -> torch.Tensor:
        """The page starting at token slot `first_slot` of `kv`, shaped as SGLang's
        get_data_page(flat=False)."""
        dim, paged, _ = self._entry()
        start = first_slot // self.page_size if paged else first_slot
        return kv.narrow(dim, start, 1 if paged else self.page_size)


def _memfd_of(host: Any) -> int:
    """The memfd that backs host.kv_buffer from its first byte (ShmHostTensorAllocator)."""
    alloc = getattr(host, "allocator", None)
    fds: list[int] | None = getattr(alloc, "fds", None)
    mms: list[mmap.mmap] | None = getattr(alloc, "mms", None)
    if not fds or not mms or len(fds) != len(mms):
        raise ValueError(f"hiqcache: the host pool ({type(alloc).__name__}) is not in shared "
                         f"memory: set \"allocator\": \"shm\" in {WHERE}")
    import ctypes

    want = host.kv_buffer.data_ptr()
    for fd, mm in zip(fds, mms):
        c = ctypes.c_char.from_buffer(mm)
        try:
            if ctypes.addressof(c) == want:
                return fd
        finally:
            del c
    raise ValueError("hiqcache: no memfd of the host pool's allocator starts at its kv_buffer")


# --- the backend ---------------------------------------------------------------------------------


class _Pool:
    """One registration with the daemon: SGLang's host pool, or the generic path's copy area."""

    def __init__(self, client: Client, spec: PoolSpec, what: str):
        self.client = client
        try:
            self.handle = client.register_pool(spec, pending_if_unavailable=True)
        except HiqError as err:
            # The daemon is up and refuses the pool: serve without the cache.
            log.error("hiqcache: hiqcached refused the %s (%s); SGLang runs without it", what,
                      err)
            self.handle = 0
        info = client.pool_info(self.handle) if self.handle else None
        log.info("hiqcache: %s, %d layers, daemon %s: %s", what, spec.geometry.num_layers,
                 client.target, f"pool {info.pool_id}, {info.encoded_bytes_per_token} B/token"
                 if info else "not registered yet")


class HiqCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang's classes are untyped (Any)
    """The backend SGLang builds as cls(storage_config, kwargs) (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.config = storage_config
        self.opts = BackendOptions.parse(storage_config.extra_config)
        parts = [f"sglang:{storage_config.model_name or 'unnamed'}"]
        if self.opts.identity:
            parts.append(self.opts.identity)
        # Stages hold different layers and context-parallel ranks different shards of the same
        # pages: neither may share pages with another.
        if storage_config.pp_size > 1:
            parts.append(f"pp={storage_config.pp_rank}/{storage_config.pp_size}")
        if storage_config.attn_cp_size > 1:
            parts.append(f"cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}")
        if storage_config.dcp_size > 1:
            parts.append(f"dcp={storage_config.dcp_rank}/{storage_config.dcp_size}")
        self.model = "|".join(parts)
        self.client = Client(self.opts.target, call_timeout=self.opts.timeout_ms / 1000)
        self.mem_pool_host: Any = None  # set by HiCacheStorage.register_mem_pool_host
        self.layout: HostLayout | None = None
        self.pool: _Pool | None = None
        self._fd = -1
        self._geometry: Geometry | None = None
        self._staging: tuple[_Pool, HostShm, torch.Tensor] | None = None
        self._staging_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}
        self._warned: set[str] = set()
        self._closed = False

    # -- registration --

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers SGLang's host pool with the daemon, zero-copy. ValueError (start-up fails)
        for a pool this backend cannot describe exactly; a daemon that is down registers it
        later, one that refuses it leaves SGLang running without the cache."""
        super().register_mem_pool_host(mem_pool_host)
        self.layout = lay = HostLayout.of(mem_pool_host)
        kv = mem_pool_host.kv_buffer
        # A duplicate of SGLang's memfd: ours to keep open while the pool may re-register.
        self._fd = os.dup(_memfd_of(mem_pool_host))
        os.set_inheritable(self._fd, False)
        size = os.fstat(self._fd).st_size
        self._geometry = Geometry(
            num_layers=lay.num_layers, num_kv_heads=lay.num_heads, head_dim=lay.head_dim,
            dtype=lay.dtype, attention=lay.attention, tp_rank=self.config.tp_rank,
            tp_size=self.config.tp_size, rope_theta=self.opts.rope_theta,
            rope_interleaved=self.opts.rope_interleaved)
        spec = self._spec(SharedBuffer(size_bytes=size, host_fd=self._fd),
                          lay.views(kv, kv.data_ptr()))
        self.pool = _Pool(self.client, spec, f"SGLang host pool ({lay.attention.value}, "
                          f"{lay.layout}, {mem_pool_host.size} slots of {lay.page_size}-token "
                          f"pages, {size / 2**30:.2f} GiB)")

    def _spec(self, buffer: SharedBuffer, views: tuple[LayerView, ...]) -> PoolSpec:
        assert self._geometry is not None and self.layout is not None
        return PoolSpec(model=self.model, tenant=self.opts.tenant, geometry=self._geometry,
                        block_tokens=self.layout.page_size, codec=self.opts.codec,
                        device=DeviceKind.HOST, buffers=(buffer,), layers=views)

    # -- failures are misses --

    def _failed(self, what: str, s: Status | BaseException) -> None:
        """Logs a failure once per kind and status (then at debug level)."""
        text = f"{what}: {s}"
        kind = f"{what}:{getattr(s, 'code', type(s).__name__)}"
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("hiqcache: %s (treated as a miss; repeats are logged at debug level)",
                        text)
        else:
            log.debug("hiqcache: %s", text)

    def _handle(self) -> int:
        return self.pool.handle if self.pool is not None and not self._closed else 0

    def _rows(self, n: int, host_indices: torch.Tensor) -> list[int] | None:
        """The token slots of n pages, or None (logged) when they do not add up."""
        ps = self.layout.page_size if self.layout else 0
        if ps == 0 or host_indices is None or host_indices.numel() != n * ps:
            self._failed("host_indices", ValueError(
                f"{0 if host_indices is None else host_indices.numel()} slots for {n} pages "
                f"of {ps}"))
            return None
        return host_indices.to("cpu", torch.int64).tolist()

    def _note(self, kind: str, pages: int, seconds: float) -> None:
        if not self.config.enable_storage_metrics or pages == 0 or self.layout is None:
            return
        assert self._geometry is not None  # set with the layout
        nbytes = pages * self.layout.page_size * self._geometry.bytes_per_token
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    # -- zero-copy interface (interface_v1) --

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages the daemon holds (0 on any failure)."""
        try:
            handle = self._handle()
            if handle == 0 or not keys:
                return 0
            r = self.client.lookup(handle, [page_key(k) for k in keys])
            if not r.status.ok:
                self._failed("lookup", r.status)
            return r.prefix_blocks
        except Exception as err:  # never into SGLang
            self._failed("lookup", err)
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Backs up the pages at host_indices (page_size slots per key); per page, whether the
        daemon holds it now. Returns once the daemon has read the pages."""
        try:
            return self._set(self._handle(), keys, self._rows(len(keys), host_indices))
        except Exception as err:
            self._failed("backup", err)
            return [False] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Restores the pages into host_indices; True for the leading pages written."""
        try:
            return self._get(self._handle(), keys, self._rows(len(keys), host_indices))
        except Exception as err:
            self._failed("restore", err)
            return [False] * len(keys)

    def _set(self, handle: int, keys: list[str], rows: list[int] | None) -> list[bool]:
        if handle == 0 or rows is None or not keys:
            return [False] * len(keys)
        t = time.perf_counter()
        r = self.client.backup(handle, [page_key(k) for k in keys], rows, sync=True)
        if not r.status.ok:
            self._failed("backup", r.status)
        out = [st in _STORED for st in r.blocks]
        self._note("backup", sum(out), time.perf_counter() - t)
        return out

    def _get(self, handle: int, keys: list[str], rows: list[int] | None) -> list[bool]:
        if handle == 0 or rows is None or not keys:
            return [False] * len(keys)
        t = time.perf_counter()
        r = self.client.restore(handle, [page_key(k) for k in keys], rows, sync=True)
        if not r.status.ok:
            self._failed("restore", r.status)
        self._note("prefetch", r.restored_blocks, time.perf_counter() - t)
        return [i < r.restored_blocks for i in range(len(keys))]

    # -- generic interface: flat page tensors, through the copy area --

    def _copy_area(self) -> tuple[_Pool, HostShm, torch.Tensor] | None:
        """The generic path's memfd (the host pool's layout, staging_pages pages), registered
        on first use as a second pool of the same namespace."""
        if self._staging is not None or self.layout is None or self._closed:
            return self._staging
        lay, kv = self.layout, self.mem_pool_host.kv_buffer
        assert self._geometry is not None  # set with the layout
        page_bytes = lay.page_size * self._geometry.bytes_per_token
        pages = self.opts.staging_pages or max(1, min(STORAGE_BATCH_SIZE,
                                                      _STAGING_BYTES // page_bytes))
        shape = lay.staging_shape(kv.shape, pages)
        shm = HostShm.create_memfd("sglang-copy", pages * page_bytes,
                                   huge_pages=self.opts.huge_pages)
        area = shm_tensor(shm, kv.dtype, tuple(shape))
        spec = self._spec(shm.shared_buffer(), lay.views(area, area.data_ptr()))
        self._staging = (_Pool(self.client, spec, f"copy area of {pages} pages"), shm, area)
        return self._staging

    def _through_copy_area(self, n: int, run: Callable[[_Pool, torch.Tensor, int, int], bool]
                           ) -> None:
        """Calls run(pool, area, first, count) for the n pages in chunks that fit the area,
        until one returns False."""
        with self._staging_lock:
            staged = self._copy_area()
            if staged is None or staged[0].handle == 0:
                return
            pool, _, area = staged
            assert self.layout is not None  # the copy area is made from it
            cap = self.layout.pages_in(area)
            for first in range(0, n, cap):
                if not run(pool, area, first, min(cap, n - first)):
                    return

    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None, target_sizes: Any | None = None
                  ) -> bool:
        """Backs up flat pages (SGLang's get_data_page); True when every page is held."""
        try:
            if not keys or values is None or len(values) != len(keys):
                return False
            done = [False] * len(keys)
            ps = self.layout.page_size if self.layout else 0

            def run(pool: _Pool, area: torch.Tensor, first: int, count: int) -> bool:
                assert self.layout is not None  # the copy area is made from it
                for j in range(count):
                    dst = self.layout.page(area, j * ps)
                    dst.copy_(values[first + j].reshape(dst.shape))
                rows = list(range(count * ps))
                res = self._set(pool.handle, keys[first:first + count], rows)
                done[first:first + count] = res
                return all(res)

            self._through_copy_area(len(keys), run)
            return all(done)
        except Exception as err:
            self._failed("backup", err)
            return False

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """Restores pages into target_locations (flat page tensors, SGLang's
        get_dummy_flat_data_page); None for the pages from the first missing one on."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        try:
            if not keys or target_locations is None or len(target_locations) != len(keys):
                return out
            ps = self.layout.page_size if self.layout else 0

            def run(pool: _Pool, area: torch.Tensor, first: int, count: int) -> bool:
                assert self.layout is not None  # the copy area is made from it
                got = self._get(pool.handle, keys[first:first + count], list(range(count * ps)))
                for j in range(count):
                    if not got[j]:
                        return False
                    dst = target_locations[first + j]
                    src = self.layout.page(area, j * ps)
                    dst.copy_(src.reshape(dst.shape))
                    out[first + j] = dst
                return True

            self._through_copy_area(len(keys), run)
        except Exception as err:
            self._failed("restore", err)
        return out

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        if target_location is None and self.mem_pool_host is not None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- hybrid models (extra host pools: Mamba states, SWA, DSA indexers) --

    def on_host_pools_registered(self) -> None:
        """Fails the attach (start-up) when SGLang registered host pools besides the KV pool:
        this backend stores KV pages only."""
        extra = [str(name) for name, pool in getattr(self, "registered_pools", {}).items()
                 if pool is not self.mem_pool_host]
        if extra:
            raise ValueError(f"hiqcache: host pools {', '.join(extra)} of a hybrid model are not "
                             "supported (this backend stores KV pages only)")

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[Any] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> Any:
        """Pools added after start-up (SGLang's dynamic sidecars) are not served: a miss."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        if pool_transfers:
            self._failed("batch_exists_v2", ValueError("extra host pools are not supported"))
            return PoolTransferResult.empty()
        return PoolTransferResult(self.batch_exists(keys, extra_info), {})

    def batch_get_v2(self, transfers: list[Any], extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: list[Any], extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers}

    # -- the rest of SGLang's interface --

    def clear(self) -> None:
        """Does not clear: the daemon's pages are shared by every engine on the node (an
        operator evicts with hiqctl)."""
        log.info("hiqcache: clear() leaves the node's shared cache as it is")

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the last call (pages per batch, GB/s of BF16 KV)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics

            m = StorageMetrics()
            with self._metrics_lock:
                for name, values in self._metrics.items():
                    getattr(m, name).extend(values)
                    values.clear()
            return m
        except Exception as err:
            self._failed("get_stats", err)
            return None

    def close(self) -> None:
        """Releases the registrations and closes the client (the session's end releases them
        too, should this never be called)."""
        if self._closed:
            return
        self._closed = True
        try:
            for p in (self.pool, self._staging[0] if self._staging else None):
                if p is not None and p.handle:
                    self.client.release_pool(p.handle)
            self.client.close()
        except Exception as err:
            log.debug("hiqcache: close: %s", err)
        if self._staging is not None:
            self._staging[1].close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
