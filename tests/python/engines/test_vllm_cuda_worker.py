"""hiqcache.vllm.CudaWorker's step logic on this CPU: vLLM's real config for SmolLM2-135M, KV
tensors in vLLM's GPU layouts (FlashAttention [2, blocks, ...], FlashInfer [blocks, 2, ...] with
heads before tokens), the real daemon, and HostOps in place of DeviceOps: ticket slots in a
memfd, stream stores and waits done from the host at once (CPU tensor work is synchronous), and
no CUDA IPC, so `auto` must choose the host transport. The ipc transport itself needs a GPU
(tests/gpu)."""

from __future__ import annotations

import logging
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from daemon import Daemon  # noqa: E402
from hiqcache.host import HostEventPool  # noqa: E402
from hiqcache.keys import compute_block_keys  # noqa: E402
from hiqcache.vllm import ConnectorOptions, CudaWorker  # noqa: E402
from hiqcache.vllm.common import HiqCacheConnectorMetadata, _Transfer  # noqa: E402
from hiqcache.vllm.cuda_worker import DeviceOps, split_kv_layer  # noqa: E402
from margins import margin  # noqa: E402
from real_model import model_dir  # noqa: E402

BS, BLOCKS = 16, 24
LAYERS, HEADS, DIM = 30, 3, 64  # SmolLM2-135M


class HostOps(DeviceOps):
    """DeviceOps for CPU tensors. `silent` names slot sets whose stream stores never happen
    (an engine stream that never gets there)."""

    def __init__(self) -> None:
        self.silent: set[int] = set()
        self.pinned = 0

    def slots(self, count: int, device: torch.device) -> HostEventPool:
        return HostEventPool.create(count)

    def export(self, t: torch.Tensor) -> tuple[bytes, int, int]:
        raise ValueError("cuda_export: not a CUDA tensor")

    def device_uuid(self, device: torch.device) -> str:
        return ""

    def pin(self, t: torch.Tensor) -> None:
        self.pinned += 1

    def unpin(self, t: torch.Tensor) -> None:
        self.pinned -= 1

    def stream_write(self, slots: HostEventPool, slot: int, value: int) -> None:
        if id(slots) not in self.silent:
            slots.store(slot, value)

    def stream_wait(self, slots: HostEventPool, slot: int, ticket: int) -> None:
        slots.wait(slot, ticket, 10.0)


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir()), dtype="bfloat16", block_size=BS, max_model_len=512,
                      max_num_seqs=4, max_num_batched_tokens=512, enforce_eager=True)
    return args.create_engine_config()


@pytest.fixture(scope="module")
def hiqd():
    with Daemon(extra=("--wait-timeout-ms", "1500")) as d:
        yield d


def layers(layout: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(LAYERS):
        if layout == "flash_attn":
            t = torch.randn(2, BLOCKS, BS, HEADS, DIM, generator=g)
        else:  # flashinfer with the HND stride order: heads before tokens in memory
            t = torch.randn(BLOCKS, 2, HEADS, BS, DIM, generator=g).permute(0, 1, 3, 2, 4)
        out.append(t.to(torch.bfloat16))
    return out


def worker(cfg, hiqd, caches, ops=None, **extra) -> CudaWorker:
    opts = ConnectorOptions.parse({"target": hiqd.target, **extra})
    w = CudaWorker(cfg, opts, ops or HostOps())
    w.register_layers(caches, tp_rank=0)
    return w


def keys(seed: int, n: int) -> list[bytes]:
    return compute_block_keys(list(range(seed, seed + n * BS)), BS, salt=f"cuda-worker-{seed}")


def save(w: CudaWorker, ks: list[bytes], ids: list[int]) -> None:
    meta = HiqCacheConnectorMetadata(saves=[_Transfer("r", ks, ids)])
    w.save(meta)
    s = w.save_side.slots.wait(1, w.backup_ticket, 10.0)
    assert s.ok, s


def load(w: CudaWorker, ks: list[bytes], ids: list[int]) -> set[int]:
    w.start_load(HiqCacheConnectorMetadata(loads=[_Transfer("r", ks, ids)]))
    for name in w.layer_index:
        w.wait_layer(name)
    return w.take_load_errors()


def blocks(caches: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """[layers, 2, len(ids), bs, heads, dim] of the named blocks, as vLLM addresses them."""
    out = []
    for kv in caches:
        k, v = split_kv_layer(kv, BS, HEADS, DIM)
        out.append(torch.stack([k[ids], v[ids]]))
    return torch.stack(out)


def test_split_kv_layer_views_both_layouts_and_refuses_the_rest():
    fa = torch.zeros(2, 5, BS, HEADS, DIM)
    k, v = split_kv_layer(fa, BS, HEADS, DIM)
    assert k.data_ptr() == fa.data_ptr() and v.data_ptr() == fa[1].data_ptr()
    fi = torch.zeros(5, 2, HEADS, BS, DIM).permute(0, 1, 3, 2, 4)
    k, v = split_kv_layer(fi, BS, HEADS, DIM)
    assert tuple(k.shape) == (5, BS, HEADS, DIM) and k.stride()[1] == DIM
    for bad, needle in ((torch.zeros(2, 2, BS, HEADS, DIM), "ambiguous"),
                        (torch.zeros(3, 5, BS, HEADS, DIM), "no K|V axis"),
                        (torch.zeros(5, HEADS, 2 * BS, DIM), "expected")):
        with pytest.raises(ValueError, match=needle):
            split_kv_layer(bad, BS, HEADS, DIM)


def test_auto_without_ipc_serves_through_host_staging_and_ipc_refuses(vllm_config, hiqd, caplog):
    caches = layers("flash_attn")
    with caplog.at_level(logging.INFO, logger="hiqcache.vllm"):
        w = worker(vllm_config, hiqd, caches)
    try:
        assert w.transport == "host" and w.stats["transport"] == "host"
        assert "ipc not possible: cuda_export: not a CUDA tensor" in caplog.text
        assert w.load.pool and w.save_side.pool and w.ops.pinned == 2
    finally:
        w.shutdown()
    assert w.ops.pinned == 0
    with pytest.raises(ValueError, match="cuda_transport=ipc: cuda_export"):
        worker(vllm_config, hiqd, caches, cuda_transport="ipc")
    with pytest.raises(ValueError, match="'cuda_transport'"):
        ConnectorOptions.parse({"cuda_transport": "nvlink"})


@pytest.mark.parametrize("layout", ["flash_attn", "flashinfer_hnd"])
def test_saved_blocks_come_back_into_other_blocks_exactly(vllm_config, hiqd, layout):
    caches = layers(layout)
    w = worker(vllm_config, hiqd, caches, codec="raw")
    try:
        # Keys of their own per layout: a block already held is not stored again.
        ks, src, dst = keys(100 + len(layout), 3), [3, 4, 5], [20, 1, 9]
        want = blocks(caches, src).clone()
        save(w, ks, src)
        assert w.stats["saved_blocks"] == 3
        before = [kv.clone() for kv in caches]
        assert load(w, ks, dst) == set()
        assert torch.equal(blocks(caches, dst).view(torch.int16), want.view(torch.int16))
        others = [b for b in range(BLOCKS) if b not in dst]
        assert torch.equal(blocks(caches, others).view(torch.int16),
                           blocks(before, others).view(torch.int16))
        assert w.stats["loaded_blocks"] == 3 and w.stats["failed_blocks"] == 0
    finally:
        w.shutdown()


def test_int8_restore_is_within_the_codec_bound(vllm_config, hiqd):
    caches = layers("flash_attn")
    w = worker(vllm_config, hiqd, caches)
    try:
        ks = keys(200, 2)
        want = blocks(caches, [0, 1]).float()
        save(w, ks, [0, 1])
        assert load(w, ks, [10, 11]) == set()
        got = blocks(caches, [10, 11]).float()
        scale = want.abs().amax(dim=-1, keepdim=True) / 127
        assert bool(((got - want).abs() <= 0.51 * scale + 2 ** -8 * got.abs()).all())
    finally:
        w.shutdown()


def test_blocks_the_daemon_lacks_are_load_errors_and_left_alone(vllm_config, hiqd):
    caches = layers("flash_attn")
    w = worker(vllm_config, hiqd, caches)
    try:
        ks = keys(300, 3)
        save(w, ks[:2], [2, 3])
        before = blocks(caches, [14]).clone()
        assert load(w, ks, [12, 13, 14]) == {14}
        assert torch.equal(blocks(caches, [14]).view(torch.int16), before.view(torch.int16))
        assert load(w, keys(400, 2), [5, 6]) == {5, 6}
        assert w.stats["failed_blocks"] == 3 and w.stats["loaded_blocks"] == 2
    finally:
        w.shutdown()


def test_a_stream_that_never_signals_drops_later_saves_without_stalling(vllm_config, hiqd):
    caches = layers("flash_attn")
    ops = HostOps()
    w = worker(vllm_config, hiqd, caches, ops=ops)
    try:
        ops.silent.add(id(w.save_side.slots))
        w.save(HiqCacheConnectorMetadata(saves=[_Transfer("r", keys(500, 2), [0, 1])]))
        t = time.monotonic()
        w.save(HiqCacheConnectorMetadata(saves=[_Transfer("r", keys(600, 2), [2, 3])]))
        # Not stalled: a stall lasts until the daemon's wait_timeout_ms (1500).
        assert time.monotonic() - t < margin(1.0) and w.stats["dropped_saves"] == 2
        # The daemon gives up on the wait value (wait_timeout_ms 1500) and fails the backup.
        s = w.save_side.slots.wait(1, w.backup_ticket, 10.0)
        assert s.code.name == "ABORTED", s
        ops.silent.clear()
        save(w, keys(700, 2), [4, 5])
        assert load(w, keys(500, 2), [6, 7]) == {6, 7}  # the failed backup stored nothing
        assert load(w, keys(700, 2), [8, 9]) == set()
    finally:
        w.shutdown()


def test_a_dead_daemon_releases_a_waiting_step(vllm_config):
    """The engine's stream never stored the step's wait value when the daemon is killed: the
    client releases the layer and done slots, no layer waits out its deadline, and every block of
    the step is a load error."""
    caches = layers("flash_attn")
    ops = HostOps()
    with Daemon(extra=("--wait-timeout-ms", "60000")) as d:
        w = worker(vllm_config, d, caches, ops=ops, timeout_ms=20000)
        try:
            ks = keys(800, 2)
            save(w, ks, [0, 1])
            ops.silent.add(id(w.load.slots))
            w.start_load(HiqCacheConnectorMetadata(loads=[_Transfer("r", ks, [5, 6])]))
            assert w.loads, "the restore was queued"
            d.kill()
            t = time.monotonic()
            for name in w.layer_index:
                w.wait_layer(name)
            errors = w.take_load_errors()
            assert time.monotonic() - t < 10, "waited for a daemon that is gone"
            assert errors == {5, 6}
        finally:
            w.shutdown()
