"""SGLang's real KV classes on this CPU, for the HiCache storage backend's tests and benchmark:
device pools (MHATokenToKVPool, MLATokenToKVPool) and their host pools (MHATokenToKVPoolHost,
MLATokenToKVPoolHost) in shared memory, the storage config SGLang's cache controller would pass,
and the backend built through SGLang's own StorageBackendFactory.

Page contents are addressed in one canonical shape, [planes, layers, page_size, heads, dim]
(MLA: one plane, one head), by views written here from SGLang's get_data_page(flat=False) for
each layout, independently of the backend's own layout code."""

from __future__ import annotations

import hashlib
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

warnings.filterwarnings("ignore", module="sglang")  # "Only CUDA ... support ..." at import

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

_parallel_lock = threading.Lock()
_parallel_done = False


def init_sglang_parallel() -> None:
    """The one-rank parallel context SGLang's host pools and controller read (once per process)."""
    global _parallel_done
    with _parallel_lock:
        if not _parallel_done:
            from sglang.srt.runtime_context import get_parallel

            get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0,
                                                tp_size=1, pp_rank=0, pp_size=1)
            _parallel_done = True


@dataclass(frozen=True)
class KvShape:
    layers: int
    heads: int  # MHA: KV heads of this rank; MLA: 1
    dim: int  # MHA: head_dim; MLA: kv_lora_rank + qk_rope_head_dim
    page_size: int
    mla: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def planes(self) -> int:
        return 1 if self.mla else 2

    @property
    def page_bytes(self) -> int:
        return self.planes * self.layers * self.page_size * self.heads * self.dim * 2


SMALL = KvShape(layers=3, heads=2, dim=16, page_size=4)
SMALL_MLA = KvShape(layers=3, heads=1, dim=48, page_size=4, mla=True)


class Engine:
    """One engine's KV: a device pool, its token allocator and a host pool in `layout` (shm
    allocator, as "allocator": "shm" makes SGLang build it)."""

    def __init__(self, shape: KvShape, layout: str, device_tokens: int = 256,
                 host_ratio: float = 2.0):
        init_sglang_parallel()
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        self.shape, self.layout = shape, layout
        s = shape
        layers = dict(start_layer=0, end_layer=s.layers - 1)
        if s.mla:
            rope = 8
            self.device = MLATokenToKVPool(device_tokens, s.page_size, s.dtype, s.dim - rope, rope,
                                           s.layers, "cpu", False, **layers)
            host_cls, more = MLATokenToKVPoolHost, {"target_layer_num": s.layers}
        else:
            self.device = MHATokenToKVPool(device_tokens, s.page_size, s.dtype, s.heads, s.dim,
                                           s.layers, "cpu", False, **layers)
            host_cls, more = MHATokenToKVPoolHost, {}
        self.host = host_cls(self.device.get_device_pool_infos()[0].buffer_info, host_ratio, 0,
                             s.page_size, layout, pin_memory=False, device="cpu",
                             allocator_type="shm", device_capacity_tokens=device_tokens,
                             **layers, **more)
        self.allocator = PagedTokenToKVPoolAllocator(device_tokens, s.page_size, s.dtype, "cpu",
                                                     self.device, need_sort=False)

    def alloc_pages(self, n: int) -> torch.Tensor:
        idx = self.host.alloc(n * self.shape.page_size)
        if idx is None:
            raise RuntimeError(f"host pool full ({n} pages asked)")
        return idx

    def page(self, first_slot: int) -> torch.Tensor:
        """The page at `first_slot` as a writable view [planes, layers, page_size, heads, dim]."""
        p = self.host.get_data_page(int(first_slot), flat=False)
        if self.shape.mla:
            return {"layer_first": lambda: p.unsqueeze(0),
                    "page_first": lambda: p.permute(1, 0, 2, 3).unsqueeze(0),
                    "page_first_direct": lambda: p[0].unsqueeze(0)}[self.layout]()
        return {"layer_first": lambda: p,
                "page_first": lambda: p.permute(0, 2, 1, 3, 4),
                "page_first_direct": lambda: p[:, 0],
                "page_head": lambda: p[:, 0].permute(0, 3, 2, 1, 4)}[self.layout]()

    def write_pages(self, slots: torch.Tensor, pages: list[torch.Tensor]) -> None:
        for i, data in enumerate(pages):
            self.page(int(slots[i * self.shape.page_size])).copy_(data)

    def read_pages(self, slots: torch.Tensor, n: int) -> list[torch.Tensor]:
        return [self.page(int(slots[i * self.shape.page_size])).clone() for i in range(n)]


def page_data(shape: KvShape, seed: int, index: int) -> torch.Tensor:
    """Deterministic KV of page `index` in the canonical shape: heads of very different
    magnitudes, and an all-zero head in page 0."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    x = torch.randn((shape.planes, shape.layers, shape.page_size, shape.heads, shape.dim),
                    generator=g)
    x *= torch.logspace(-3, 2, shape.heads).view(1, 1, 1, -1, 1)
    if index == 0:
        x[:, :, 0, 0, :] = 0
    return x.to(shape.dtype)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A BF16 tensor's bits, as kv_util.int8_violations takes them."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def page_hashes(prompt: str, n: int) -> list[str]:
    """Hex SHA-256 chains as SGLang's page hashes are (values differ, the form is theirs)."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{prompt}/{i}".encode()).digest()
        out.append(prev.hex())
    return out


def extra_config(target: str, codec: str = "int8_per_head", **more: object) -> dict:
    return {"backend_name": "hiqcache", "module_path": "hiqcache.sglang",
            "class_name": "HiqCacheStorage", "interface_v1": True, "allocator": "shm",
            "target": target, "codec": codec, **more}


def storage_config(extra: dict, model: str = "test-model", tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False, metrics: bool = True) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=False,
        model_name=model, extra_config=dict(extra))


def make_backend(engine: Engine, extra: dict, **cfg: object):
    """The backend as SGLang's cache controller makes it: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra, mla=engine.shape.mla, **cfg), engine.host)
    backend.register_mem_pool_host(engine.host)
    return backend
