"""A prefix's KV through the real hiqcached (HOST backend) and back, one pool per codec.

The KV lives in one memfd laid out as an SGLang-style pool, [layer][K|V][slot][head][dim] BF16
(hiqcache.slot_major_view per layer and plane). Rows [0, max_tokens) hold the prefix as the model
computed it; Backup reads them, Restore writes rows [max_tokens, 2 * max_tokens), and the harness
reads those back. Nothing here re-implements a codec: what comes back is what the daemon wrote.

Single-threaded: one round trip at a time.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

import hiqcache as hq

# bf16 NaN with every mantissa bit set: a restore that leaves a row unwritten leaves it NaN.
SENTINEL = np.uint16(0xFFFF).view(np.int16)
# Answers to RegisterPool that mean "this daemon does not do that codec".
REFUSALS = (hq.StatusCode.INVALID_ARGUMENT, hq.StatusCode.UNIMPLEMENTED,
            hq.StatusCode.FAILED_PRECONDITION)


@dataclasses.dataclass
class Accepted:
    codec: hq.Codec
    handle: int
    encoded_bytes_per_token: int


class DaemonKv:
    def __init__(self, client: hq.Client, geometry: hq.Geometry, model: str, block_tokens: int,
                 max_tokens: int):
        if max_tokens % block_tokens:
            raise ValueError(f"max_tokens {max_tokens} is not a multiple of {block_tokens}")
        self.client = client
        self.g = geometry
        self.model = model
        self.bt = block_tokens
        self.rows = 2 * max_tokens
        self.max_tokens = max_tokens
        plane = hq.slot_major_bytes(geometry, self.rows)
        self.shm = hq.HostShm.create_memfd("fidelity-kv", geometry.num_layers * 2 * plane)
        self.data = self.shm.array(np.int16).reshape(geometry.num_layers, 2, self.rows,
                                                     geometry.num_kv_heads, geometry.head_dim)
        self.layers = tuple(
            hq.LayerView(k=hq.slot_major_view(geometry, self.rows, 0, 2 * l * plane),
                         v=hq.slot_major_view(geometry, self.rows, 0, (2 * l + 1) * plane))
            for l in range(geometry.num_layers))
        self.pools: dict[hq.Codec, Accepted] = {}
        self.encoded_bytes: dict[hq.Codec, int] = {}  # kept after close()
        # A fresh salt per run: keys never meet blocks of an earlier run or another window.
        self.salt = "fidelity-" + os.urandom(6).hex()

    def register(self, codec: hq.Codec) -> tuple[Accepted | None, str]:
        """The pool for `codec`, or None and the reason the daemon (or this client) refused."""
        spec = hq.PoolSpec(model=self.model, geometry=self.g, block_tokens=self.bt, codec=codec,
                           buffers=(self.shm.shared_buffer(),), layers=self.layers)
        try:
            handle = self.client.register_pool(spec)
        except hq.HiqError as err:
            if err.status.code not in REFUSALS:
                raise  # the daemon is broken or gone: not a verdict on the codec
            return None, f"{err.status.code.name}: {err.status.message}"
        except (KeyError, ValueError) as err:  # a Codec value this client cannot encode yet
            return None, f"client cannot send it: {type(err).__name__} {err}"
        info = self.client.pool_info(handle)
        acc = Accepted(codec, handle, info.encoded_bytes_per_token if info else 0)
        self.pools[codec] = acc
        self.encoded_bytes[codec] = acc.encoded_bytes_per_token
        return acc, ""

    def put(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes the exact prefix KV (per layer [1, heads, P, dim] bf16) into rows [0, P)."""
        for l, (k, v) in enumerate(kv):
            p = k.shape[2]
            for plane, x in ((0, k), (1, v)):
                rows = x[0].transpose(0, 1).contiguous()  # [P, heads, dim]
                self.data[l, plane, :p] = rows.view(torch.int16).numpy()

    def round_trip(self, codec: hq.Codec, tokens: list[int], window: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Backup rows [0, P) under keys of `tokens` (P of them), Restore into the upper rows,
        read back; per layer (K, V) as [1, heads, P, dim] bf16 contiguous tensors. Raises
        RuntimeError when any step does not do all of its blocks."""
        acc = self.pools[codec]
        p = len(tokens)
        nb = p // self.bt
        if p % self.bt or p > self.max_tokens:
            raise ValueError(f"prefix of {p} tokens: need a multiple of {self.bt} <= "
                             f"{self.max_tokens}")
        keys = hq.compute_block_keys(tokens, self.bt, salt=f"{self.salt}-{window}")
        b = self.client.backup(acc.handle, keys, range(p), sync=True)
        if not b.status.ok or b.blocks != [hq.BlockStatus.STORED] * nb:
            raise RuntimeError(f"{codec.value}: backup of {nb} blocks: {b.status}, "
                               f"{[s.name for s in b.blocks]}")
        lo = self.max_tokens
        self.data[:, :, lo:lo + p] = SENTINEL
        r = self.client.restore(acc.handle, keys, range(lo, lo + p), sync=True)
        if not r.status.ok or r.restored_blocks != nb:
            raise RuntimeError(f"{codec.value}: restore: {r.status}, {r.restored_blocks}/{nb} "
                               "blocks")
        # Keep the daemon's pool small: these blocks are never read again.
        if self.client.evict(acc.handle, keys) != nb:
            raise RuntimeError(f"{codec.value}: evict did not find all {nb} blocks")
        out = []
        for l in range(self.g.num_layers):
            pair = []
            for plane in (0, 1):
                rows = torch.from_numpy(self.data[l, plane, lo:lo + p].copy()).view(torch.bfloat16)
                pair.append(rows.transpose(0, 1).unsqueeze(0).contiguous())
            out.append((pair[0], pair[1]))
        return out

    def source_bits(self, p: int) -> np.ndarray:
        return self.data[:, :, :p].view(np.uint16).copy()

    def restored_bits(self, p: int) -> np.ndarray:
        return self.data[:, :, self.max_tokens:self.max_tokens + p].view(np.uint16).copy()

    def close(self) -> None:
        for acc in self.pools.values():
            self.client.release_pool(acc.handle)
        self.pools.clear()
        self.data = None
        self.shm.close()
