"""Split TensorViews (row_group, dim_run, dim_stride_bytes: docs/design.md TensorView) against the
real hiqcached: tiles in vLLM CPU attention's orders round-trip through the daemon equal to plain
views of the same values, and hostile split views get INVALID_ARGUMENT naming the field and
change nothing."""

from __future__ import annotations

import numpy as np
import pytest

import hiqcache as hq
from kv_util import HostKv, int8_violations, to_bf16_bits

G = hq.Geometry(num_layers=2, num_kv_heads=3, head_dim=64)
BT = 16
BLOCKS = 6
TILE = 2 * BT * G.head_dim  # elements of one (block, head) tile: K, then V
ES = 2


def kvec(st: dict[str, int]) -> None:
    """K as [dim][token] (vLLM's "vec" ISAs)."""
    st.update(row_stride=1, dim_run=1, dim_run_stride=BT)


def kgroups(st: dict[str, int]) -> None:
    """K as [token / 8][dim / 2][token % 8][dim % 2] (token groups, dims in pairs)."""
    st.update(row_stride=2, row_group=8, row_group_stride=8 * G.head_dim, dim_run=2,
              dim_run_stride=16)


def vrows(st: dict[str, int]) -> None:
    """V as [token][dim]."""
    st.update(row_stride=G.head_dim)


def vpairs(st: dict[str, int]) -> None:
    """V as [dim / 16][token / 2][dim % 16][token % 2] (vLLM's AMX tiles: a run's elements 2
    apart, the pair's other token between them)."""
    st.update(row_stride=1, row_group=2, row_group_stride=32, dim_run=16, dim_run_stride=BT * 16,
              dim_stride=2)


def fields(st: dict[str, int]) -> dict[str, int]:
    """The TensorView fields (bytes) of a plane's order (elements)."""
    return dict(row_stride_bytes=st["row_stride"] * ES, row_group=st["row_group"],
                row_group_stride_bytes=st["row_group_stride"] * ES, dim_run=st["dim_run"],
                dim_run_stride_bytes=st["dim_run_stride"] * ES,
                dim_stride_bytes=st["dim_stride"] * ES)


class Tiles:
    """[layer][block][head][K|V tile] in a memfd; each plane in the order its function sets."""

    def __init__(self, k_order, v_order=vrows) -> None:
        self.shm = hq.HostShm.create_memfd("test-tiles", G.num_layers * BLOCKS * G.num_kv_heads
                                           * TILE * ES)
        self.data = self.shm.array(np.uint16).reshape(G.num_layers, BLOCKS, G.num_kv_heads, TILE)
        self.planes = []
        t = np.arange(BT).reshape(BT, 1)
        d = np.arange(G.head_dim).reshape(1, G.head_dim)
        index = []  # element offsets inside a tile of (plane, token, dim)
        for plane, order in enumerate((k_order, v_order)):
            st = {"row_stride": 0, "row_group": 0, "row_group_stride": 0, "dim_run": 0,
                  "dim_run_stride": 0, "dim_stride": 0}
            order(st)
            self.planes.append(st)
            slot = ((t // st["row_group"]) * st["row_group_stride"] + (t % st["row_group"])
                    * st["row_stride"]) if st["row_group"] else t * st["row_stride"]
            run = st["dim_run"] or G.head_dim
            index.append(plane * BT * G.head_dim + slot + (d // run) * st["dim_run_stride"]
                         + (d % run) * (st["dim_stride"] or 1))
        self.index = np.stack(index)  # [2][BT][dim]
        assert np.unique(self.index).size == TILE  # a permutation of the tile

    def views(self, **bad_k: int) -> tuple[hq.LayerView, ...]:
        out = []
        for l in range(G.num_layers):
            base = l * BLOCKS * G.num_kv_heads * TILE * ES
            common = dict(buffer=0, num_rows=BLOCKS * BT, head_stride_bytes=TILE * ES,
                          page_rows=BT, page_stride_bytes=G.num_kv_heads * TILE * ES)
            k_fields = dict(common, offset_bytes=base, **fields(self.planes[0]))
            if l == 1:
                k_fields.update(bad_k)
            k = hq.TensorView(**k_fields)
            v = hq.TensorView(offset_bytes=base + BT * G.head_dim * ES, **common,
                              **fields(self.planes[1]))
            out.append(hq.LayerView(k=k, v=v))
        return tuple(out)

    def spec(self, model: str, codec: hq.Codec, **bad_k: int) -> hq.PoolSpec:
        return hq.PoolSpec(model=model, geometry=G, block_tokens=BT, codec=codec,
                           buffers=(self.shm.shared_buffer(),), layers=self.views(**bad_k))

    def rows_of(self, blocks: list[int]) -> np.ndarray:
        """[layer][K|V][rows of blocks][head][dim], read from the tiles."""
        t = self.data[:, blocks]  # [L][b][H][TILE]
        g = t[..., self.index]  # [L][b][H][2][BT][dim]
        return g.transpose(0, 3, 1, 4, 2, 5).reshape(G.num_layers, 2, len(blocks) * BT,
                                                     G.num_kv_heads, G.head_dim)

    def close(self) -> None:
        self.data = None
        self.shm.close()


def rows(blocks: list[int]) -> list[int]:
    return [b * BT + t for b in blocks for t in range(BT)]


@pytest.mark.parametrize("k_order,v_order", [(kvec, vrows), (kgroups, vrows), (kgroups, vpairs)],
                         ids=["k-dim-major", "k-token-groups", "amx-v-token-pairs"])
def test_tiles_round_trip_equal_to_plain_views(daemon, k_order, v_order):
    tiles, plain = Tiles(k_order, v_order), HostKv(G, 8 * BT, memfd=True)
    rng = np.random.default_rng(7)
    try:
        with hq.Client(daemon.target) as c:
            for codec in (hq.Codec.RAW, hq.Codec.INT8_PER_HEAD):
                model = f"split-{k_order.__name__}-{v_order.__name__}-{codec.value}"
                tp = c.register_pool(tiles.spec(model, codec))
                pp = c.register_pool(plain.spec(model, BT, codec))
                tiles.data[:] = to_bf16_bits(rng.standard_normal(tiles.data.shape) * 3)
                # Tiles -> daemon -> plain rows: the plain pool restores the tiles' values.
                src = [4, 1, 2]  # not in order
                keys = hq.compute_block_keys(range(100, 100 + 3 * BT), BT, salt=model)
                assert c.backup(tp, keys, rows(src)).blocks == [hq.BlockStatus.STORED] * 3
                assert c.restore(pp, keys, range(0, 3 * BT)).restored_blocks == 3
                # Plain rows -> daemon -> other tiles: exactly what a plain restore writes.
                plain.fill(range(3 * BT, 5 * BT), seed=11)
                keys2 = hq.compute_block_keys(range(500, 500 + 2 * BT), BT, salt=model)
                assert c.backup(pp, keys2, range(3 * BT, 5 * BT)).blocks == [
                    hq.BlockStatus.STORED] * 2
                before = tiles.data.copy()
                dst = [5, 0]
                assert c.restore(tp, keys2, rows(dst)).restored_blocks == 2
                assert c.restore(pp, keys2, range(5 * BT, 7 * BT)).restored_blocks == 2
                got = tiles.rows_of(dst)
                if codec is hq.Codec.RAW:
                    assert np.array_equal(plain.data[:, :, :3 * BT], tiles.rows_of(src))
                    assert np.array_equal(got, plain.data[:, :, 3 * BT:5 * BT])
                else:  # through the codec; into tiles, the bytes a plain restore writes
                    assert not np.array_equal(plain.data[:, :, :3 * BT], tiles.rows_of(src))
                    assert int8_violations(tiles.rows_of(src), plain.data[:, :, :3 * BT]) == 0
                    assert np.array_equal(got, plain.data[:, :, 5 * BT:7 * BT])
                # Only the restored blocks changed.
                untouched = [b for b in range(BLOCKS) if b not in dst]
                assert np.array_equal(tiles.data[:, untouched], before[:, untouched])
                assert c.release_pool(tp).ok and c.release_pool(pp).ok
    finally:
        tiles.close()
        plain.close()


# Hostile layer-1 K views: (fields, what the message names).
BAD = [
    (dict(num_rows=BLOCKS * BT + 1), "layers[1].k: addresses up to byte"),
    (dict(offset_bytes=(1 << 64) - 2), "layers[1].k.offset_bytes"),
    (dict(dim_run_stride_bytes=16), "layers[1].k.dim_run_stride_bytes: 16 bytes steps inside"),
    (dict(dim_run=2), "elements of the view overlap"),
    (dict(dim_run_stride_bytes=0), "layers[1].k.dim_run_stride_bytes"),
    (dict(head_stride_bytes=BT * G.head_dim), "layers[1].k.head_stride_bytes"),
    (dict(dim_run=3), "layers[1].k.dim_run: must divide geometry.head_dim"),
    (dict(dim_run_stride_bytes=1 << 62),
     f"layers[1].k.dim_run_stride_bytes: {1 << 62} x 63 overflows"),
    (dict(row_group=4, row_group_stride_bytes=(1 << 64) - 2), "layers[1].k.row_group_stride_bytes"),
    (dict(page_stride_bytes=1 << 62), "layers[1].k.page_stride_bytes"),
    (dict(dim_run_stride_bytes=33), "multiples of 2 bytes"),
    # A run's second element 8 elements on: inside the block's 16 tokens, 1 element apart.
    (dict(dim_run=2, dim_run_stride_bytes=64, dim_stride_bytes=16),
     "layers[1].k.dim_stride_bytes: 16 bytes steps inside"),
    (dict(dim_stride_bytes=3), "multiples of 2 bytes"),
    (dict(dim_run=0, dim_run_stride_bytes=0, dim_stride_bytes=1 << 62),
     f"layers[1].k.dim_stride_bytes: {1 << 62} x 63 overflows"),
    # A stride without the count it steps over: refused, not ignored.
    (dict(dim_run=0), "layers[1].k.dim_run_stride_bytes: set without dim_run"),
    (dict(row_group_stride_bytes=64), "layers[1].k.row_group_stride_bytes: set without row_group"),
]


def test_hostile_split_views_are_invalid_argument_and_change_nothing(daemon):
    tiles = Tiles(kvec)
    try:
        with hq.Client(daemon.target) as c:
            for bad, field in BAD:
                with pytest.raises(hq.HiqError) as err:
                    c.register_pool(tiles.spec("hostile", hq.Codec.RAW, **bad))
                assert err.value.status.code == hq.StatusCode.INVALID_ARGUMENT, (bad, err.value)
                assert field in err.value.status.message, (bad, err.value.status.message)
            stats = c.get_stats()
            assert not stats.pools and not stats.namespaces  # nothing registered, nothing made
            assert c.release_pool(c.register_pool(tiles.spec("hostile", hq.Codec.RAW))).ok
    finally:
        tiles.close()
