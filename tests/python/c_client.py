"""A thin ctypes wrapper over libhiqcache.so (client/include/hiqcache/hiqcache_c.h) with the shape
of hiqcache.Client's HOST calls, for the conformance suite and bench/clients: CClient registers
a HostKv's buffers by name and answers lookups, backups, restores, evictions and stats with the
C ABI's status codes and hiq_last_error() messages."""

from __future__ import annotations

import ctypes as C
import os
import sys
from collections.abc import Sequence

from daemon import ROOT

sys.path.insert(0, str(ROOT / "tests" / "client"))
from hiqcache_c_abi import Buffer, Geometry, LayerView, PoolDesc, PoolInfo, Stats  # noqa: E402

HIQ_OK = 0
HIQ_DEVICE_HOST = 0


_u8p, _u32p, _u64p = C.POINTER(C.c_uint8), C.POINTER(C.c_uint32), C.POINTER(C.c_uint64)
_SIGNATURES = {
    "hiq_abi_version": (C.c_int, []),
    "hiq_last_error": (C.c_char_p, []),
    "hiq_connect": (C.c_int, [C.c_char_p, C.c_int64, C.POINTER(C.c_void_p)]),
    "hiq_close": (None, [C.c_void_p]),
    "hiq_register_pool": (C.c_int, [C.c_void_p, C.POINTER(PoolDesc), C.c_int, _u64p,
                                    C.POINTER(PoolInfo)]),
    "hiq_release_pool": (C.c_int, [C.c_void_p, C.c_uint64]),
    "hiq_pool_info_get": (C.c_int, [C.c_void_p, C.c_uint64, C.POINTER(PoolInfo)]),
    "hiq_lookup": (C.c_int, [C.c_void_p, C.c_uint64, C.c_char_p, C.c_uint32, _u32p]),
    "hiq_backup": (C.c_int, [C.c_void_p, C.c_uint64, C.c_char_p, C.c_uint32, _u32p, C.c_uint64,
                             C.c_int32, C.c_uint64, C.c_int32, C.c_int, _u8p, _u64p]),
    "hiq_restore": (C.c_int, [C.c_void_p, C.c_uint64, C.c_char_p, C.c_uint32, _u32p, C.c_uint64,
                              C.c_int32, C.c_uint64, C.c_int32, C.c_int32, C.c_int, _u32p,
                              _u64p]),
    "hiq_evict": (C.c_int, [C.c_void_p, C.c_uint64, C.c_char_p, C.c_uint32, _u32p]),
    "hiq_get_stats": (C.c_int, [C.c_void_p, C.POINTER(Stats)]),
}


def lib_path() -> str:
    return os.environ.get("HIQ_C_LIB") or str(ROOT / "build" / "client" / "libhiqcache.so")


_lib: C.CDLL | None = None


def load() -> C.CDLL:
    global _lib
    if _lib is None:
        lib = C.CDLL(lib_path())
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _lib = lib
    return _lib


class CError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _rows(rows: Sequence[int]) -> C.Array:
    return (C.c_uint32 * len(rows))(*rows)


class CClient:
    """One hiq_client. Methods return (value, code, message); register raises CError."""

    def __init__(self, target: str, timeout_ms: int = 2000):
        self.lib = load()
        self._h = C.c_void_p()
        rc = self.lib.hiq_connect(target.encode(), timeout_ms, C.byref(self._h))
        if rc != HIQ_OK:
            raise CError(rc, self.error())
        self._bt: dict[int, int] = {}

    def error(self) -> str:
        return (self.lib.hiq_last_error() or b"").decode()

    def register_host(self, shm_name: str, size_bytes: int, geometry, layers, model: str,
                      block_tokens: int, codec: int, pending: bool = False) -> int:
        """layers: hiqcache.LayerView objects (every TensorView field is passed on)."""
        g = Geometry(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
                     int(geometry.dtype.value == "fp16"), 0, geometry.tp_rank, geometry.tp_size)
        bufs = (Buffer * 1)(Buffer(shm_name.encode(), None, 0, 0, size_bytes))
        lv = (LayerView * max(1, len(layers)))()
        for i, layer in enumerate(layers):
            for dst, src in ((lv[i].k, layer.k), (lv[i].v, layer.v)):
                for field, _ in dst._fields_:
                    setattr(dst, field, getattr(src, field))
            lv[i].has_v = 1
        desc = PoolDesc(model=model.encode(), geometry=g, block_tokens=block_tokens, codec=codec,
                        device_kind=HIQ_DEVICE_HOST, num_buffers=1, buffers=bufs, layers=lv)
        handle = C.c_uint64()
        rc = self.lib.hiq_register_pool(self._h, C.byref(desc), int(pending), C.byref(handle),
                                        None)
        if rc != HIQ_OK:
            raise CError(rc, self.error())
        self._bt[handle.value] = block_tokens
        return handle.value

    def pool_id(self, handle: int) -> int:
        info = PoolInfo()
        rc = self.lib.hiq_pool_info_get(self._h, handle, C.byref(info))
        return info.pool_id if rc == HIQ_OK else 0

    def lookup(self, handle: int, keys: Sequence[bytes]) -> tuple[int, int, str]:
        n = C.c_uint32()
        rc = self.lib.hiq_lookup(self._h, handle, b"".join(keys), len(keys), C.byref(n))
        return n.value, rc, self.error() if rc else ""

    def backup(self, handle: int, keys: Sequence[bytes], rows: Sequence[int]
               ) -> tuple[list[int], int, str]:
        status = (C.c_uint8 * max(1, len(keys)))()
        rc = self.lib.hiq_backup(self._h, handle, b"".join(keys), len(keys), _rows(rows),
                                 len(rows), -1, 0, -1, 1, status, None)
        return list(status)[:len(keys)], rc, self.error() if rc else ""

    def restore(self, handle: int, keys: Sequence[bytes], rows: Sequence[int]
                ) -> tuple[int, int, str]:
        n = C.c_uint32()
        rc = self.lib.hiq_restore(self._h, handle, b"".join(keys), len(keys), _rows(rows),
                                  len(rows), -1, 0, -1, -1, 1, C.byref(n), None)
        return n.value, rc, self.error() if rc else ""

    def evict(self, handle: int, keys: Sequence[bytes]) -> tuple[int, int, str]:
        n = C.c_uint32()
        rc = self.lib.hiq_evict(self._h, handle, b"".join(keys), len(keys), C.byref(n))
        return n.value, rc, self.error() if rc else ""

    def stats(self) -> tuple[Stats, int, str]:
        s = Stats()
        rc = self.lib.hiq_get_stats(self._h, C.byref(s))
        return s, rc, self.error() if rc else ""

    def release(self, handle: int) -> int:
        return self.lib.hiq_release_pool(self._h, handle)

    def close(self) -> None:
        if self._h:
            self.lib.hiq_close(self._h)
            self._h = C.c_void_p()
