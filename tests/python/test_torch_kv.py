"""hiqcache.torch_kv: TensorViews derived from PyTorch strides address exactly the elements the
tensor does, checked through the real daemon on shm-backed tensors (HOST), for vLLM's
FlashAttention pages [2][blocks][block_size][heads][dim] and for a head-major page
[blocks][heads][block_size][dim]; the CUDA export needs a GPU and is skipped without one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import hiqcache as hq  # noqa: E402
from hiqcache.host import unique_name  # noqa: E402
from hiqcache.torch_kv import cuda_export, memfd_tensor, paged_view, shm_tensor  # noqa: E402

BS, HEADS, DIM, BLOCKS, LAYERS = 16, 2, 64, 6, 2


def layouts(t: torch.Tensor, layout: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) as [blocks, block_size, heads, dim] views of t."""
    if layout == "flash":  # t: [layers, 2, blocks, bs, heads, dim]
        return [(t[l, 0], t[l, 1]) for l in range(LAYERS)]
    # head-major: t: [layers, blocks, heads, 2 * bs, dim], K tokens then V tokens per head
    return [(t[l, :, :, :BS].permute(0, 2, 1, 3), t[l, :, :, BS:].permute(0, 2, 1, 3))
            for l in range(LAYERS)]


@pytest.mark.parametrize("layout,memory", [("flash", "memfd"), ("head_major", "memfd"),
                                           ("flash", "named")])
def test_views_from_strides_round_trip_through_the_daemon(daemon, layout, memory):
    shape = ((LAYERS, 2, BLOCKS, BS, HEADS, DIM) if layout == "flash"
             else (LAYERS, BLOCKS, HEADS, 2 * BS, DIM))
    nbytes = 2 * LAYERS * 2 * BLOCKS * BS * HEADS * DIM
    if memory == "memfd":
        shm, t = memfd_tensor(torch.bfloat16, shape)
        assert shm.is_memfd and shm.size == nbytes
    else:
        shm = hq.HostShm.create(unique_name("torch-kv"), nbytes)
        t = shm_tensor(shm, torch.bfloat16, shape)
    try:
        t.copy_(torch.randn(shape).to(torch.bfloat16))
        per_layer = layouts(t, layout)
        base = t.data_ptr()
        views = tuple(hq.LayerView(k=paged_view(k, 0, k.data_ptr() - base),
                                   v=paged_view(v, 0, v.data_ptr() - base))
                      for k, v in per_layer)
        g = hq.Geometry(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
        spec = hq.PoolSpec(model=f"torch-{layout}", geometry=g, block_tokens=BS,
                           codec=hq.Codec.RAW, layers=views,
                           buffers=(shm.shared_buffer(),))
        with hq.Client(daemon.target) as c:
            pool = c.register_pool(spec)
            keys = hq.compute_block_keys(range(2 * BS), BS)
            # Blocks 1 and 4 out, into blocks 2 and 5.
            src = [*range(1 * BS, 2 * BS), *range(4 * BS, 5 * BS)]
            dst = [*range(2 * BS, 3 * BS), *range(5 * BS, 6 * BS)]
            before = t.clone()
            assert c.backup(pool, keys, src).held == 2
            assert c.restore(pool, keys, dst).restored_blocks == 2
        for k, v in layouts(t, layout):
            for plane in (k, v):
                assert torch.equal(plane[2].view(torch.int16), plane[1].view(torch.int16))
                assert torch.equal(plane[5].view(torch.int16), plane[4].view(torch.int16))
        # Nothing outside the destination blocks moved.
        for (k, v), (k0, v0) in zip(layouts(t, layout), layouts(before, layout)):
            for plane, old in ((k, k0), (v, v0)):
                for b in (0, 1, 3, 4):
                    assert torch.equal(plane[b].view(torch.int16), old[b].view(torch.int16))
    finally:
        t = None
        shm.close()


def test_views_torch_cannot_express_are_refused():
    t = torch.zeros(2, 4, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        paged_view(t.transpose(2, 3), 0, 0)
    with pytest.raises(ValueError, match="2-byte"):
        paged_view(t.float(), 0, 0)
    with pytest.raises(ValueError, match="not a CUDA tensor"):
        cuda_export(t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_export_names_the_allocation_base():
    big = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    part = big[1000:2000]
    h_big, off_big, end_big = cuda_export(big)
    h_part, off_part, _ = cuda_export(part)
    assert len(h_big) == 64 and h_big == h_part
    assert off_part - off_big == 1000 * 2 and end_big >= off_big + big.numel() * 2
