"""HOST KV buffers for Python tests: SGLang-style [layer][K|V][rows][heads][dim] in one shm object,
bf16 values as uint16 bits, and the INT8, FP8, INT4 and INT4 KIVI codecs' elementwise error
bounds."""

from __future__ import annotations

import numpy as np

import hiqcache as hq


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


class HostKv:
    """memfd=True: the buffer is a sealed memfd, registered by fd, on huge pages as `huge_pages`
    asks (HostShm.create_memfd); else a named shm object (which the client still passes by fd
    when it has a session)."""

    def __init__(self, geometry: hq.Geometry, rows: int, memfd: bool = False,
                 huge_pages: str = "off"):
        self.g = geometry
        self.rows = rows
        plane = hq.slot_major_bytes(geometry, rows)
        size = geometry.num_layers * 2 * plane
        self.shm = (hq.HostShm.create_memfd("test-kv", size, huge_pages=huge_pages) if memfd
                    else hq.HostShm.create(hq.host.unique_name("test-kv"), size))
        self.data = self.shm.array(np.uint16)[:size // 2].reshape(geometry.num_layers, 2, rows,
                                                      geometry.num_kv_heads, geometry.head_dim)
        self.layers = tuple(
            hq.LayerView(k=hq.slot_major_view(geometry, rows, 0, 2 * l * plane),
                         v=hq.slot_major_view(geometry, rows, 0, (2 * l + 1) * plane))
            for l in range(geometry.num_layers))

    def spec(self, model: str, block_tokens: int, codec: hq.Codec = hq.Codec.INT8_PER_HEAD,
             events: hq.HostEventPool | None = None) -> hq.PoolSpec:
        return hq.PoolSpec(model=model, geometry=self.g, block_tokens=block_tokens, codec=codec,
                           buffers=(self.shm.shared_buffer(),),
                           layers=self.layers,
                           events=events.spec() if events else hq.EventPoolSpec())

    def fill(self, rows: range, seed: int) -> None:
        rng = np.random.default_rng(seed)
        shape = self.data[:, :, rows.start:rows.stop].shape
        self.data[:, :, rows.start:rows.stop] = to_bf16_bits(rng.standard_normal(shape) * 3)

    def close(self) -> None:
        self.data = None
        self.shm.close()


def int8_violations(original: np.ndarray, restored: np.ndarray) -> int:
    """Elements outside |x̂ - x| <= (0.5 + 2^-8)·s + 2^-8·|x̂|, s = max|x| / 127 per head (the
    scale rounded up to bf16 precision, so the check never flags a correct encoder)."""
    x = from_bf16_bits(original).astype(np.float64)
    y = from_bf16_bits(restored).astype(np.float64)
    s = np.abs(x).max(axis=-1, keepdims=True) / 127 * (1 + 2 ** -8)
    bound = (0.5 + 2 ** -8) * s + 2 ** -8 * np.abs(y)
    return int((np.abs(y - x) > bound).sum())


def fp8_violations(original: np.ndarray, restored: np.ndarray) -> int:
    """Elements outside CODEC_FP8_E4M3_PER_HEAD's bound for BF16 (kernels/README.md),
    |x̂ - x| <= 2^-4·|x̂| + 2^-10·s + (1 + 2^-4)·(2^-8·|x̂| + a), s = max|x| / 448 per head (rounded
    up to bf16 precision), a = 2^-134 where x̂ is a bf16 subnormal."""
    x = from_bf16_bits(original).astype(np.float64)
    y = from_bf16_bits(restored).astype(np.float64)
    s = np.maximum(np.abs(x).max(axis=-1, keepdims=True), 2.0 ** -112) / 448 * (1 + 2 ** -8)
    ay = np.abs(y)
    a = np.where(ay <= 2.0 ** -126, 2.0 ** -134, 0.0)
    bound = 2 ** -4 * ay + 2 ** -10 * s + (1 + 2 ** -4) * (2 ** -8 * ay + a)
    return int((np.abs(y - x) > bound).sum())


def int4_violations(original: np.ndarray, restored: np.ndarray) -> int:
    """Elements outside CODEC_INT4_G32_PER_HEAD's bound (kernels/README.md): INT8's with the scale
    of the element's group of 32, |x̂ - x| <= (0.5 + 2^-8)·s + 2^-8·|x̂|, s = max|x| / 7 over the
    group (rounded up to bf16 precision). The last axis is head_dim, a multiple of 32."""
    x = from_bf16_bits(original).astype(np.float64)
    y = from_bf16_bits(restored).astype(np.float64)
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    yg = y.reshape(*y.shape[:-1], y.shape[-1] // 32, 32)
    s = np.abs(xg).max(axis=-1, keepdims=True) / 7 * (1 + 2 ** -8)
    bound = (0.5 + 2 ** -8) * s + 2 ** -8 * np.abs(yg)
    return int((np.abs(yg - xg) > bound).sum())


def kivi_k_violations(original: np.ndarray, restored: np.ndarray, block_tokens: int) -> int:
    """K elements outside CODEC_INT4_KIVI's bound (kernels/README.md):
    |x̂ - x| <= (0.5 + 2^-8)·s + (2^-8 + 2^-22)·|x̂|, s = (max - min) / 15 of the element's channel
    over its block (rounded up to bf16 precision). Axes [..., tokens, heads, head_dim], the
    tokens a whole number of blocks in order."""
    x = from_bf16_bits(original).astype(np.float64)
    y = from_bf16_bits(restored).astype(np.float64)
    t = x.shape[-3]
    xb = x.reshape(*x.shape[:-3], t // block_tokens, block_tokens, *x.shape[-2:])
    yb = y.reshape(xb.shape)
    s = (xb.max(axis=-3, keepdims=True) - xb.min(axis=-3, keepdims=True)) / 15 * (1 + 2 ** -8)
    s = np.maximum(s, 2.0 ** -112 / 7.5)
    bound = (0.5 + 2 ** -8) * s + (2 ** -8 + 2 ** -22) * np.abs(yb)
    return int((np.abs(yb - xb) > bound).sum())
