"""hiqcache.torch_kv: TensorViews derived from PyTorch strides address exactly the elements the
tensor does, checked through the real daemon on shm-backed tensors (HOST), for vLLM's
FlashAttention pages [2][blocks][block_size][heads][dim] and for a head-major page
[blocks][heads][block_size][dim]; PyTorch's IPC handles (hiqcache.torch_ipc) of every known
version give the cudaIpcMemHandle_t and others are refused; the expandable-segments check sees
settings made at run time; CudaTicketSlots refuses cleanly without a GPU. The CUDA export and
the slots' stream operations need a GPU and are skipped without one."""

from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest

torch = pytest.importorskip("torch")

import hiqcache as hq  # noqa: E402
from hiqcache.host import unique_name  # noqa: E402
from hiqcache.torch_ipc import parse_torch_ipc_handle  # noqa: E402
from hiqcache.torch_kv import (  # noqa: E402
    CudaTicketSlots,
    cuda_export,
    expandable_segments_enabled,
    memfd_tensor,
    paged_view,
    shm_tensor,
)
from margins import margin  # noqa: E402

HANDLE = bytes(range(64))  # a cudaIpcMemHandle_t
ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")

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
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
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


@pytest.mark.parametrize("version", [1, 2, 3])
def test_torch_ipc_handles_of_known_versions_give_the_cuda_handle(version):
    assert parse_torch_ipc_handle(bytes([version]) + b"c" + HANDLE) == HANDLE


def test_torch_ipc_handles_cuda_ipc_cannot_open_are_refused():
    with pytest.raises(ValueError, match="expandable segment.*expandable_segments:False"):
        parse_torch_ipc_handle(bytes([3]) + b"e" + bytes(40))
    with pytest.raises(ValueError, match=r"version 4, known versions are 1, 2, 3"):
        parse_torch_ipc_handle(bytes([4]) + b"c" + HANDLE)
    with pytest.raises(ValueError, match=r"type byte 0x78, expected 0x63"):
        parse_torch_ipc_handle(bytes([2]) + b"x" + HANDLE)


@pytest.mark.parametrize("raw,expected", [
    (HANDLE, r"64 bytes, the size of a bare cudaIpcMemHandle_t; expected .* 66 bytes"),
    (bytes([2]) + b"c" + HANDLE[:63], r"65 bytes, expected 66 bytes"),
    (bytes([2]) + b"c" + HANDLE + b"\0", r"67 bytes, expected 66 bytes"),
    (b"\x02", r"1 bytes, expected 66 bytes"),
])
def test_torch_ipc_handles_of_wrong_length_are_refused(raw, expected):
    with pytest.raises(ValueError, match=expected):
        parse_torch_ipc_handle(raw)


def test_torch_ipc_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import hiqcache.torch_ipc as t; "
            "assert t.parse_torch_ipc_handle(b'\\x03c' + bytes(64)) == bytes(64)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_expandable_segments_set_at_run_time_are_seen(monkeypatch):
    for name in ALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    settings = [""]  # what torch._C._accelerator_getAllocatorSettings answers
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: settings[0],
                        raising=False)
    assert not expandable_segments_enabled()
    settings[0] = "max_split_size_mb:100, expandable_segments:True"
    assert expandable_segments_enabled()
    settings[0] = "expandable_segments:True,expandable_segments:False"
    assert not expandable_segments_enabled()
    # The settings last applied decide over the environment...
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert not expandable_segments_enabled()
    # ...unless they do not name expandable_segments.
    settings[0] = "max_split_size_mb:100"
    assert expandable_segments_enabled()
    # Where the getter exists, PYTORCH_ALLOC_CONF is read first (as c10 does).
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.5")
    assert not expandable_segments_enabled()
    # A fake tensor on a GPU: cuda_export refuses before it asks the storage for a handle.
    settings[0] = "expandable_segments:True"
    with pytest.raises(ValueError, match="expandable_segments:False"):
        cuda_export(types.SimpleNamespace(is_cuda=True))


def test_expandable_segments_check_falls_back_to_the_environment(monkeypatch):
    for name in ALLOC_ENV:
        monkeypatch.delenv(name, raising=False)

    def broken() -> str:
        raise RuntimeError("no allocator config")

    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", broken, raising=False)
    assert not expandable_segments_enabled()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert expandable_segments_enabled()
    # An older torch without the getter reads PYTORCH_CUDA_ALLOC_CONF first.
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    assert expandable_segments_enabled()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments : False")
    assert not expandable_segments_enabled()


def test_cuda_ticket_slots_refuse_cleanly_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="torch.cuda is not available"):
        CudaTicketSlots(4, 0)
    with pytest.raises(ValueError, match="count"):
        CudaTicketSlots(0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_export_names_the_allocation_base():
    big = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    part = big[1000:2000]
    h_big, off_big, end_big = cuda_export(big)
    h_part, off_part, _ = cuda_export(part)
    raw = big.untyped_storage()._share_cuda_()[1]
    assert len(raw) == 66 and raw[1:2] == b"c"
    assert len(h_big) == 64 and h_big == parse_torch_ipc_handle(raw) and h_big == h_part
    assert off_part - off_big == 1000 * 2 and end_big >= off_big + big.numel() * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ticket_slots_wait_and_write_on_a_stream():
    """A stream waits for a slot the host stores into (a ticket, then a failed value), then
    stores into another slot; the memfd's other mapping (as hiqcache.Client maps it) sees the
    device's store."""
    slots = CudaTicketSlots(4)
    try:
        assert slots.spec().host_fd == slots.shm.fd and slots.spec().count == 4
        other = hq.HostEventPool(hq.HostShm.from_fd(slots.shm.fd), 4)
        stream = torch.cuda.Stream(slots.device)
        slots.wait_on_stream(1, 3, stream)
        slots.write_on_stream(2, 9, stream)
        time.sleep(0.2)
        assert slots.read(2) == 0  # the stream still waits for slot 1
        slots.store(1, 3)
        assert slots.wait(2, 9, 10).ok
        assert other.read(2) == 9
        stream.synchronize()
        # A failed value releases a stream too (the wait is on the slot's low word).
        slots.wait_on_stream(3, 7, stream)
        slots.write_on_stream(2, 11, stream)
        time.sleep(0.2)
        assert slots.read(2) == 9
        slots.store(3, 7 | hq.EVENT_FAILED_BIT)
        assert slots.wait(2, 11, 10).ok
        assert slots.wait(3, 7, 0).code == hq.StatusCode.ABORTED
        stream.synchronize()
        slots.write_on_stream(0, 5)  # the current stream
        torch.cuda.current_stream(slots.device).synchronize()
        assert slots.read(0) == 5
        other.close()
    finally:
        slots.close()
        slots.close()  # idempotent
