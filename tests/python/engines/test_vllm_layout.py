"""The connector's view of vLLM's CPU KV cache: the tile order probed from vLLM's own
cpu_attn_reshape_and_cache, conversion both ways checked element by element against that op for
several geometries (and so several ISAs), and the extra-config validation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402

from hiqcache.spec import Codec  # noqa: E402
from hiqcache.vllm import ConnectorOptions, TileConverter  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,heads,dim", [(32, 3, 64), (64, 2, 128), (32, 1, 80), (16, 2, 64)])
def test_tiles_and_rows_round_trip_through_vllms_own_cache_op(dtype, bs, heads, dim):
    conv = TileConverter(dtype, bs, heads, dim)
    nb = 3
    g = torch.Generator().manual_seed(bs * dim + heads)
    k = torch.randn(nb * bs, heads, dim, generator=g).to(dtype)
    v = torch.randn(nb * bs, heads, dim, generator=g).to(dtype)
    # vLLM writes the blocks in its own order (blocks 2, 0, 4 of a 5-block cache).
    cache = torch.zeros(5, heads, 2 * bs, dim, dtype=dtype)
    kc, vc = cache.chunk(2, dim=2)
    block_ids = torch.tensor([2, 0, 4])
    slots = (block_ids.view(-1, 1) * bs + torch.arange(bs)).flatten()
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, conv.isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    tiles = cache.view(5, heads, -1)
    k_out = torch.empty_like(k)
    v_out = torch.empty_like(v)
    conv.to_rows(tiles.index_select(0, block_ids), k_out, v_out)
    assert torch.equal(k_out.view(torch.int16), k.view(torch.int16))
    assert torch.equal(v_out.view(torch.int16), v.view(torch.int16))
    back = torch.zeros_like(tiles)
    back.index_copy_(0, block_ids, conv.to_tiles(k, v))
    assert torch.equal(back.view(torch.int16), tiles.view(torch.int16))


def test_this_machines_isa_is_converted_by_strided_copies():
    # On x86 without AMX vLLM picks "vec": K [dim][tokens], V [tokens][dim]; the connector must
    # have found that by itself, and as permuted axes (no element gather).
    conv = TileConverter(torch.bfloat16, 32, 3, 64)
    assert all(f is not None for f in conv.factors), conv.describe()
    if conv.isa == "vec":
        assert conv.factors[0][1] != (0, 1, 2, 3) and conv.factors[1][1] == (0, 1, 2, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,heads,dim", [(32, 3, 64), (64, 2, 128), (32, 1, 80), (16, 2, 64)])
def test_split_views_address_every_element_where_vllm_puts_it(dtype, bs, heads, dim):
    """The split TensorView fields the worker registers (tile_view_strides) put token t, dim d
    of each plane exactly where vLLM's own op stores it."""
    from hiqcache.vllm.cpu_worker import tile_view_strides

    conv = TileConverter(dtype, bs, heads, dim)
    t = torch.arange(bs).view(bs, 1)
    d = torch.arange(dim).view(1, dim)
    for plane in range(2):
        st = tile_view_strides(conv.factors[plane])
        assert st is not None, conv.describe()
        slot = ((t // st["row_group"]) * st["row_group_stride"] + (t % st["row_group"])
                * st["row_stride"]) if st["row_group"] else t * st["row_stride"]
        run = st["dim_run"] or dim
        pos = (slot + (d // run) * (st["dim_run_stride"] if st["dim_run"] else 0)
               + (d % run) * (st["dim_stride"] or 1))
        assert torch.equal(conv.orders[plane][pos], t * dim + d), (plane, st)
    if conv.isa in ("vec", "vec16"):  # K as [dim][token]: runs of one element
        assert tile_view_strides(conv.factors[0]) == {
            "row_stride": 1, "row_group": 0, "row_group_stride": 0, "dim_run": 1,
            "dim_run_stride": bs, "dim_stride": 0}
        assert tile_view_strides(conv.factors[1])["dim_run"] == 0  # V rows as they are
    if conv.isa == "amx":  # V in token pairs: a run's elements 2 apart, the pair's other between
        assert tile_view_strides(conv.factors[1])["dim_stride"] == 2


def test_every_factored_order_has_a_split_view():
    from hiqcache.vllm.cpu_worker import tile_view_strides

    # [d % 2][t][d // 2] (4 tokens, 16 dims): runs of one element 1 apart would overlap, so the
    # head is 8 runs of 2 elements 32 apart (dim_stride), the runs adjacent.
    assert tile_view_strides(((4, 1, 8, 2), (3, 1, 0, 2))) == {
        "row_stride": 8, "row_group": 0, "row_group_stride": 0, "dim_run": 2,
        "dim_run_stride": 1, "dim_stride": 32}
    # [d][t] (4 tokens) factored as one run of 16 dims: a head of elements 4 apart.
    assert tile_view_strides(((4, 1, 1, 16), (3, 0, 1, 2))) == {
        "row_stride": 1, "row_group": 0, "row_group_stride": 0, "dim_run": 0,
        "dim_run_stride": 0, "dim_stride": 4}
    assert tile_view_strides(None) is None


@pytest.mark.parametrize("block_ids", [[4, 5, 6, 7], [9, 2, 5, 0], [1, 2, 3, 8]])
def test_worker_moves_exactly_the_named_blocks(block_ids):
    """The worker's staging <-> cache copies (runs of consecutive blocks straight, fragmented
    ones through a gather) against vLLM's own op, leaving every other block untouched."""
    from hiqcache.vllm import CpuWorker

    bs, heads, dim, nb = 32, 3, 64, len(block_ids)
    w = CpuWorker.__new__(CpuWorker)
    w.bs, w.tiles = bs, TileConverter(torch.bfloat16, bs, heads, dim)
    g = torch.Generator().manual_seed(len(block_ids))
    k = torch.randn(nb * bs, heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(nb * bs, heads, dim, generator=g).to(torch.bfloat16)
    want = torch.zeros(10, heads, 2 * bs, dim, dtype=torch.bfloat16)
    kc, vc = want.chunk(2, dim=2)
    slots = (torch.tensor(block_ids).view(-1, 1) * bs + torch.arange(bs)).flatten()
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, w.tiles.isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    cache = torch.full((10, heads, 2 * bs * dim), 7.0, dtype=torch.bfloat16)
    untouched = [b for b in range(10) if b not in block_ids]
    w.layers = [cache]
    w.staging = torch.zeros(1, 2, (nb + 2) * bs, heads, dim, dtype=torch.bfloat16)
    w.staging[0, 0, bs:(nb + 1) * bs] = k
    w.staging[0, 1, bs:(nb + 1) * bs] = v
    w._rows_to_tiles(0, block_ids, bs)
    assert torch.equal(cache[block_ids].view(torch.int16),
                       want.view(10, heads, -1)[block_ids].view(torch.int16))
    assert bool((cache[untouched] == 7.0).all())
    w.staging.zero_()
    w._tiles_to_rows(0, block_ids, 2 * bs)
    assert torch.equal(w.staging[0, 0, 2 * bs:(nb + 2) * bs].view(torch.int16), k.view(torch.int16))
    assert torch.equal(w.staging[0, 1, 2 * bs:(nb + 2) * bs].view(torch.int16), v.view(torch.int16))
    assert bool((w.staging[0, :, :2 * bs] == 0).all())


def test_extra_config_is_validated():
    assert ConnectorOptions.parse({}) == ConnectorOptions()
    o = ConnectorOptions.parse({"target": "/run/hiq.sock", "codec": "raw", "tenant": "t",
                                "timeout_ms": 250, "staging_tokens": 4096})
    assert o.codec is Codec.RAW and o.timeout_ms == 250 and o.staging_tokens == 4096
    assert o.huge_pages == "auto"
    assert ConnectorOptions.parse({"huge_pages": "off"}).huge_pages == "off"
    bad = [({"codecs": "raw"}, "'codecs'"), ({"codec": "int4"}, "unknown codec 'int4'"),
           ({"codec": 1}, "'codec'"), ({"target": "nonsense"}, "'target'"),
           ({"timeout_ms": 0}, "'timeout_ms'"), ({"timeout_ms": True}, "'timeout_ms'"),
           ({"staging_tokens": -1}, "'staging_tokens'"), ({"tenant": "a\nb"}, "'tenant'"),
           ({"cpu_transport": "ipc"}, "'cpu_transport'"), ({"huge_pages": "yes"}, "'huge_pages'"),
           ({"huge_pages": True}, "'huge_pages'")]
    for extra, needle in bad:
        with pytest.raises(ValueError) as err:
            ConnectorOptions.parse(extra)
        assert needle in str(err.value), (extra, str(err.value))
