"""hiqcache.vllm.HiqCacheConnector and an engine's set-up, inside real vLLM engines (CPU, real
SmolLM2-135M weights) against the real hiqcached: a bad kv_connector_extra_config fails the
engine's start-up naming the key; a tensor-parallel engine registers a pool per rank and loads
only what every rank holds. (Apart from test_vllm_connector.py, so that the two files' engines
can run on two pytest workers at once.)"""

from __future__ import annotations

import pytest

import hiqcache as hq
from daemon import Daemon
from margins import margin
from vllm_jobs import BS, full_blocks, run_engine

pytest.importorskip("vllm")


def test_bad_extra_config_fails_engine_startup_naming_the_key(model, tmp_path):
    job = {"model": model, "connector": {"target": "unix:///nonexistent.sock", "codecs": "raw"},
           "batches": []}
    with pytest.raises(AssertionError) as err:
        run_engine("bad", job, tmp_path, timeout=300)
    assert "unknown kv_connector_extra_config key 'codecs'" in str(err.value)


def test_tensor_parallel_engine_loads_only_what_every_rank_holds(model, prompts, tmp_path):
    """TP=3 (SmolLM2 has 3 KV heads) on vLLM CPU: each rank registers its own pool and stores
    its heads; the scheduler, which has no buffers, asks what every rank holds. After one rank
    lost the tail of the prefix, a fresh TP engine loads only the blocks all three ranks hold."""
    from kv_util import HostKv

    p1, p2, shared = prompts[1]
    env_bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0"}  # 3 workers on this machine's 2 cores
    with Daemon(pool_bytes="512MiB") as d:
        conn = {"target": d.target, "codec": "raw"}
        a = run_engine("tp-a", {"model": model, "connector": conn, "tp": 3,
                                "batches": [[p1]]}, tmp_path, env=env_bind)
        client = hq.Client(d.target, call_timeout=margin(10))
        stats = client.get_stats()
        assert len(stats.namespaces) == 3 and all(n.blocks > 0 for n in stats.namespaces)
        identity = stats.namespaces[0].model
        keys = hq.compute_block_keys(p2, BS, salt=identity)[:full_blocks(len(p2), shared)]
        # Rank 1 loses every block from the 6th on.
        g = hq.Geometry(num_layers=30, num_kv_heads=1, head_dim=64, tp_rank=1, tp_size=3)
        kv = HostKv(g, BS)
        try:
            pool = client.register_pool(kv.spec(identity, BS, hq.Codec.RAW))
            assert client.lookup(pool, keys).prefix_blocks == len(keys)
            assert client.evict(pool, keys[6:]) == len(keys) - 6
            client.release_pool(pool)
        finally:
            kv.close()
        b = run_engine("tp-b", {"model": model, "connector": conn, "tp": 3,
                                "batches": [[p2]]}, tmp_path, env=env_bind)
        assert b["results"][0]["num_cached_tokens"] == 6 * BS
        assert len(b["results"][0]["tokens"]) == 8
        restores = sorted(n.restores for n in client.get_stats().namespaces)
        assert restores == [6, 6, 6]  # every rank restored the same 6 blocks
        assert a["results"][0]["num_cached_tokens"] == 0
