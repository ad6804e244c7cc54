"""hiqcache.sglang.HiqCacheStorage inside SGLang's real classes on this CPU, against the real
daemon: host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost) in shared memory, the backend
built by SGLang's StorageBackendFactory, and SGLang's own HiCacheController driving it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from daemon import Daemon  # noqa: E402
from kv_util import int8_violations  # noqa: E402
from sglang_kv import (  # noqa: E402
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    SMALL,
    SMALL_MLA,
    Engine,
    KvShape,
    bf16_bits,
    extra_config,
    make_backend,
    page_data,
    page_hashes,
)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/python: the helpers
OTHER_UID = 61001  # the reading engine runs as another user when the tests run as root


def run_peer(target: str, jobs: list[dict], uid: int | None = None) -> list[dict]:
    args = {"target": target, "jobs": jobs}
    if uid is not None:
        args["uid"] = uid
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH", ""), HERE) if p))
    home = tempfile.mkdtemp(prefix="hiq-sglang-peer-")
    os.chmod(home, 0o777)  # torch and SGLang write caches under $HOME
    env.update(HOME=home, XDG_CACHE_HOME=home, TORCHINDUCTOR_CACHE_DIR=home + "/inductor")
    try:
        out = subprocess.run([sys.executable, os.path.join(HERE, "sglang_peer.py"),
                              json.dumps(args)], capture_output=True, text=True, timeout=300,
                             env=env, cwd="/")
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def eventually(ok, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def equal_pages(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(bool(torch.equal(x, y)) for x, y in zip(a, b))


def violations(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int8_violations(bf16_bits(x), bf16_bits(y)) for x, y in zip(a, b))


@pytest.fixture
def open_daemon():
    with Daemon(open_to_all_users=True) as d:
        yield d


# --- start-up validation -------------------------------------------------------------------------


@pytest.mark.parametrize("change, named", [
    ({"codex": "raw"}, "'codex'"),
    ({"codec": "int3"}, "'codec'"),
    ({"allocator": "default"}, "'allocator'"),
    ({"timeout_ms": "5"}, "'timeout_ms'"),
    ({"timeout_ms": 0}, "'timeout_ms'"),
    ({"interface_v1": "yes"}, "'interface_v1'"),
    ({"target": "http://x"}, "'target'"),
    ({"tenant": "a\nb"}, "'tenant'"),
    ({"staging_pages": 129}, "'staging_pages'"),
    ({"huge_pages": "yes"}, "'huge_pages'"),
    ({"rope_theta": 0.5}, "'rope_theta'"),
    ({"rope_theta": "1e6"}, "'rope_theta'"),
    ({"rope_theta": float("nan")}, "'rope_theta'"),
    ({"rope_interleaved": "no"}, "'rope_interleaved'"),
])
def test_bad_extra_config_fails_start_up_naming_the_key(daemon, change, named):
    engine = Engine(SMALL, "layer_first")
    with pytest.raises(ValueError, match=named):
        make_backend(engine, {**extra_config(daemon.target), **change})


def test_host_pool_outside_shared_memory_fails_start_up(daemon):
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    engine = Engine(SMALL, "layer_first")
    plain = MHATokenToKVPoolHost(engine.device.get_device_pool_infos()[0].buffer_info, 2.0, 0,
                                 SMALL.page_size, "layer_first", pin_memory=False, device="cpu",
                                 allocator_type="default", device_capacity_tokens=256,
                                 start_layer=0, end_layer=SMALL.layers - 1)
    engine.host = plain
    with pytest.raises(ValueError, match='"allocator": "shm"'):
        make_backend(engine, extra_config(daemon.target))


def test_hybrid_model_host_pools_fail_the_attach(daemon):
    """A hybrid model's controller registers extra host pools (Mamba, SWA) after the KV pool
    and then calls on_host_pools_registered, where raising fails SGLang's attach."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    engine = Engine(SMALL, "layer_first")
    backend = make_backend(engine, extra_config(daemon.target))
    backend.register_mem_host_pool_v2(engine.host, "kv")
    backend.on_host_pools_registered()  # the KV pool alone is fine
    backend.register_mem_host_pool_v2(Engine(SMALL, "layer_first").host, "mamba")
    with pytest.raises(ValueError, match="mamba"):
        backend.on_host_pools_registered()
    # Served later anyway (SGLang's dynamic sidecars): misses, not exceptions.
    keys = page_hashes("hybrid", 2)
    side = PoolTransfer(name="mamba", keys=keys)
    assert backend.batch_exists_v2(keys, [side]).kv_hit_pages == 0
    assert backend.batch_get_v2([side]) == {"mamba": [False, False]}
    assert backend.batch_set_v2([side]) == {"mamba": [False, False]}
    backend.close()


# --- pages across processes, users and layouts ---------------------------------------------------


def test_pages_set_by_one_engine_are_read_by_another(open_daemon):
    """Engine A backs pages up in one layout, engine B (another process) restores them into its
    own host pool in another layout: raw bit-exact, INT8 within the bound, for every MHA and MLA
    layout. Run as root, both engines run as another user than the daemon's (the daemon maps
    their memfds by fd alone), and a third user's engine sees none of their pages (the
    daemon's default namespace_scope "uid")."""
    pairs = [(False, w, r) for w, r in zip(MHA_LAYOUTS, MHA_LAYOUTS[1:] + MHA_LAYOUTS[:1])]
    pairs += [(True, w, r) for w, r in zip(MLA_LAYOUTS, MLA_LAYOUTS[1:] + MLA_LAYOUTS[:1])]
    n = 6
    sets, gets = [], []
    for i, (mla, w, r) in enumerate(pairs):
        for codec in ("raw", "int8_per_head"):
            job = {"mla": mla, "codec": codec, "prompt": f"p{i}-{codec}", "pages": n, "seed": i}
            sets.append({**job, "mode": "set", "layout": w})
            gets.append({**job, "mode": "get", "layout": r})
    root = os.geteuid() == 0
    uid = OTHER_UID if root else None
    stored = run_peer(open_daemon.target, sets, uid=uid)
    assert [s["stored"] for s in stored] == [[True] * n] * len(sets)
    got = run_peer(open_daemon.target, gets, uid=uid)
    for job, res in zip(gets, got):
        assert res["restored"] == [True] * n, job
        if job["codec"] == "raw":
            assert res["exact"] == n, job
        else:
            assert res["violations"] == 0, job
            assert res["exact"] < n, job  # it really was INT8
    if root:
        stranger = run_peer(open_daemon.target, gets[:2], uid=OTHER_UID + 1)
        assert [r["restored"] for r in stranger] == [[False] * n] * 2


# --- batch_exists, restarts, namespaces ----------------------------------------------------------


def test_batch_exists_counts_the_leading_pages_held(daemon):
    engine = Engine(SMALL, "page_first")
    backend = make_backend(engine, extra_config(daemon.target, "raw"))
    keys = page_hashes("prefix", 6)
    data = [page_data(SMALL, 3, i) for i in range(6)]
    slots = engine.alloc_pages(6)
    engine.write_pages(slots, data)
    ps = SMALL.page_size
    held = [0, 1, 2, 4, 5]  # page 3 never stored
    sel = torch.cat([slots[i * ps:(i + 1) * ps] for i in held])
    assert backend.batch_set_v1([keys[i] for i in held], sel) == [True] * 5
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[3:]) == 0
    assert backend.batch_exists(keys[4:]) == 2
    assert backend.batch_exists([]) == 0
    assert backend.exists(keys[0]) and not backend.exists(keys[3])
    # A get stops at the first missing page; the pages after it are not written.
    other = engine.alloc_pages(6)
    before = engine.read_pages(other, 6)
    assert backend.batch_get_v1(keys, other) == [True, True, True, False, False, False]
    after = engine.read_pages(other, 6)
    assert equal_pages(after[:3], data[:3]) == 3
    assert equal_pages(after[3:], before[3:]) == 3
    backend.close()


def test_daemon_down_misses_then_restart_serves_warm_pages(daemon):
    engine = Engine(SMALL, "page_head")
    backend = make_backend(engine, extra_config(daemon.target, "raw", timeout_ms=2000))
    keys = page_hashes("warm", 4)
    data = [page_data(SMALL, 5, i) for i in range(4)]
    slots = engine.alloc_pages(4)
    engine.write_pages(slots, data)
    assert backend.batch_set_v1(keys, slots) == [True] * 4

    daemon.stop()
    other = engine.alloc_pages(4)
    t = time.monotonic()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, other) == [False] * 4
    assert backend.batch_set_v1(page_hashes("down", 4), slots) == [False] * 4
    assert backend.batch_get(keys, [engine.host.get_dummy_flat_data_page()] * 4) == [None] * 4
    assert backend.batch_set(keys, [engine.host.get_data_page(int(slots[0]))]) is False
    assert time.monotonic() - t < 20  # misses, not hangs
    # An engine that starts while the daemon is down registers once it is back.
    late = Engine(SMALL, "layer_first")
    late_backend = make_backend(late, extra_config(daemon.target, "raw", timeout_ms=2000))
    assert late_backend.batch_exists(keys) == 0

    daemon.start()  # same pool: the pages survived the restart
    # The client registers again at most every 0.5 s per pool: the first calls may still miss.
    assert eventually(lambda: backend.batch_exists(keys) == 4)
    assert eventually(lambda: late_backend.batch_exists(keys) == 4)
    assert backend.batch_get_v1(keys, other) == [True] * 4
    assert equal_pages(engine.read_pages(other, 4), data) == 4
    late_slots = late.alloc_pages(4)
    assert late_backend.batch_get_v1(keys, late_slots) == [True] * 4
    assert equal_pages(late.read_pages(late_slots, 4), data) == 4
    backend.close()
    late_backend.close()


def test_engines_of_another_model_or_tp_size_never_see_the_pages(daemon):
    keys = page_hashes("ns", 3)
    writer = Engine(SMALL, "layer_first")
    backend = make_backend(writer, extra_config(daemon.target), model="model-a")
    slots = writer.alloc_pages(3)
    writer.write_pages(slots, [page_data(SMALL, 1, i) for i in range(3)])
    assert backend.batch_set_v1(keys, slots) == [True] * 3

    def held(shape: KvShape, layout: str, extra: dict | None = None, **cfg: object) -> int:
        b = make_backend(Engine(shape, layout), extra or extra_config(daemon.target), **cfg)
        try:
            return b.batch_exists(keys)
        finally:
            b.close()

    assert held(SMALL, "page_head", model="model-a") == 3  # the layout is not the namespace
    assert held(SMALL, "layer_first", model="model-b") == 0
    assert held(SMALL, "layer_first", model="model-a", tp_rank=0, tp_size=2) == 0
    assert held(SMALL, "layer_first", model="model-a", tp_rank=1, tp_size=2) == 0
    assert held(KvShape(3, 4, 16, 4), "layer_first", model="model-a") == 0
    assert held(KvShape(3, 2, 16, 8), "layer_first", model="model-a") == 0  # page size
    assert held(SMALL, "layer_first", extra_config(daemon.target, "raw"), model="model-a") == 0
    assert held(SMALL, "layer_first", extra_config(daemon.target, tenant="t2"),
                model="model-a") == 0
    assert held(SMALL, "layer_first", extra_config(daemon.target, identity="revision=2"),
                model="model-a") == 0
    backend.close()


def test_mla_pages_are_stored_once_for_every_tp_rank(daemon):
    keys = page_hashes("mla", 3)
    data = [page_data(SMALL_MLA, 2, i) for i in range(3)]
    rank0 = Engine(SMALL_MLA, "page_first")
    b0 = make_backend(rank0, extra_config(daemon.target, "raw"), tp_rank=0, tp_size=2)
    slots = rank0.alloc_pages(3)
    rank0.write_pages(slots, data)
    assert b0.batch_set_v1(keys, slots) == [True] * 3
    for tp_rank, tp_size in ((1, 2), (3, 4)):
        peer = Engine(SMALL_MLA, "layer_first")
        b = make_backend(peer, extra_config(daemon.target, "raw"), tp_rank=tp_rank,
                         tp_size=tp_size)
        got = peer.alloc_pages(3)
        assert b.batch_get_v1(keys, got) == [True] * 3
        assert equal_pages(peer.read_pages(got, 3), data) == 3
        b.close()
    stats = b0.client.get_stats()
    mla = [ns for ns in stats.namespaces if ns.model.startswith("sglang:test-model")]
    assert len(mla) == 1 and mla[0].blocks == 3
    b0.close()


def test_malformed_calls_are_misses_not_exceptions(daemon):
    engine = Engine(SMALL, "layer_first")
    backend = make_backend(engine, extra_config(daemon.target))
    keys = page_hashes("bad", 2)
    slots = engine.alloc_pages(2)
    assert backend.batch_set_v1(keys, slots[:5]) == [False, False]  # slots do not add up
    assert backend.batch_get_v1(keys, slots[:5]) == [False, False]
    assert backend.batch_set_v1(keys, None) == [False, False]
    assert backend.batch_get(keys, None) == [None, None]
    assert backend.batch_set(keys, [torch.zeros(3)] * 2) is False  # not a page
    assert backend.batch_exists(["not-a-hash", "\udcff"]) == 0
    outside = torch.arange(10**9, 10**9 + 2 * SMALL.page_size)
    assert backend.batch_set_v1(keys, outside) == [False, False]  # the daemon says no
    assert backend.batch_exists(keys) == 0
    backend.close()
    assert backend.batch_exists(keys) == 0  # closed: misses


# --- SGLang's cache controller driving the backend -----------------------------------------------


def _controller(engine: Engine, target: str, interface_v1: bool):
    from sglang.srt.managers.cache_controller import HiCacheController

    return HiCacheController(
        engine.allocator, engine.host, engine.shape.page_size, tp_group=None,
        load_cache_event=threading.Event(), write_policy="write_through", io_backend="direct",
        storage_backend="dynamic", prefetch_threshold=engine.shape.page_size,
        model_name="controller-model",
        storage_backend_extra_config=extra_config(target, "raw", interface_v1=interface_v1))


@pytest.mark.parametrize("interface_v1", [True, False], ids=["zero_copy", "generic"])
def test_cache_controller_backs_up_and_prefetches_through_the_daemon(daemon, interface_v1):
    """HiCacheController's storage threads (write_storage -> _page_backup -> page_set_func;
    prefetch -> batch_exists hit query -> _page_transfer -> page_get_func) over 130 pages, two
    of SGLang's 128-page storage batches, from one engine's host pool into another's."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ps, n = SMALL.page_size, 130
    writer, reader = Engine(SMALL, "layer_first", 512), Engine(SMALL, "page_head", 512)
    wc, rc = _controller(writer, daemon.target, interface_v1), \
        _controller(reader, daemon.target, interface_v1)
    try:
        assert wc.page_set_func.__name__ == ("_page_set_zero_copy" if interface_v1
                                             else "_generic_page_set")
        tokens = list(range(1000, 1000 + n * ps))
        hashes = get_storage_hash_str(tokens, None, page_size=ps)
        slots = writer.alloc_pages(n)
        data = [page_data(SMALL, 9, i) for i in range(n)]
        writer.write_pages(slots, data)
        wc.write_storage(slots, tokens, hash_value=hashes)
        assert wc.ack_backup_queue.get(timeout=60).completed_tokens == n * ps

        extra = list(range(9000, 9000 + ps))  # one more page, never stored
        rc.prefetch("req-1", tokens + extra)
        hit = rc.prefetch_hit_queue.get(timeout=60)
        assert hit.storage_hit_count == n * ps
        hit.host_indices = rc.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
        rc.prefetch_buffer.put(hit)  # what the scheduler does with a hit
        while not rc.ack_prefetch_queue.get(timeout=60).completed_req:
            pass
        assert equal_pages(reader.read_pages(hit.host_indices, n), data) == n
    finally:
        wc.detach_storage_backend()
        rc.detach_storage_backend()


def test_storage_metrics_report_pages_and_bandwidth(daemon):
    engine = Engine(SMALL, "layer_first")
    backend = make_backend(engine, extra_config(daemon.target))
    keys = page_hashes("metrics", 3)
    slots = engine.alloc_pages(3)
    engine.write_pages(slots, [page_data(SMALL, 4, i) for i in range(3)])
    backend.batch_set_v1(keys, slots)
    backend.batch_get_v1(keys, engine.alloc_pages(3))
    m = backend.get_stats()
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
    assert m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # since the last call
    backend.close()
