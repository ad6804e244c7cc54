"""`vllm serve` with hiqcache's connector: the real OpenAI-compatible server (CPU, real
SmolLM2-135M weights) against the real hiqcached, driven over HTTP.

The first server computes two prompts that share a long prefix, then the second prompt once more
from vLLM's own prefix cache (the reference). It stops; a fresh server process, whose own prefix
cache is empty, gets the same prompt and takes its prefix from the daemon (codec raw): the same
cached tokens as the reference, the same text and logprobs, counted by vLLM's metrics as an
external KV transfer and by the daemon as restores.
"""

from __future__ import annotations

import pytest

import hiqcache as hq
from daemon import Daemon
from margins import margin
from real_model import model_dir
from vllm_server import VllmServer

pytest.importorskip("vllm")

BS = 32


def gpl_prompts() -> tuple[str, str]:
    """Two prompts sharing a prefix of about 1,000 tokens of real English text, with tails of
    about 100 tokens (several blocks) that differ."""
    text = open("/usr/share/common-licenses/GPL-3").read()
    prefix = text[:4500] + "\n\nExcerpt:\n"
    return (prefix + text[20000:20450] + "\n\nQuestion: who may copy this License?\nAnswer:",
            prefix + text[30000:30450] + "\n\nQuestion: what is this excerpt about?\nAnswer:")


def hiqcache_warnings(server: VllmServer) -> list[str]:
    return [line for line in server.log_tail(1 << 22).splitlines() if "hiqcache:" in line
            and ("failed" in line or "dropping" in line)]


def test_fresh_vllm_serve_takes_the_prefix_from_the_daemon(tmp_path):
    model = str(model_dir())
    a, b = gpl_prompts()
    with Daemon(pool_bytes="256MiB") as d:
        conn = {"target": d.target, "codec": "raw"}
        client = hq.Client(d.target, call_timeout=margin(10))
        first = VllmServer(model, tmp_path / "first", conn)
        try:
            first.start()
            got_a = first.complete(a)
            got_b = first.complete(b)  # the shared prefix from vLLM's own cache
            ref = first.complete(b)  # every full block of b from vLLM's own cache
            warnings = hiqcache_warnings(first)
        finally:
            first.stop()
        assert got_a.cached_tokens == 0
        assert 0 < got_b.cached_tokens < ref.cached_tokens
        full_blocks = (ref.prompt_tokens - 1) // BS
        assert ref.cached_tokens == full_blocks * BS
        assert got_b.text == ref.text and len(ref.token_logprobs) == 8
        assert not warnings, warnings
        after_first = {n.model: n for n in client.get_stats().namespaces}
        assert len(after_first) == 1
        ns = next(iter(after_first.values()))
        assert ns.model.startswith(model) and ns.codec == hq.Codec.RAW
        assert ns.blocks >= full_blocks and ns.restores == 0

        second = VllmServer(model, tmp_path / "second", conn)
        try:
            second.start()
            got = second.complete(b)
            metrics = second.metrics()
            warnings = hiqcache_warnings(second)
        finally:
            second.stop()
        assert not warnings, warnings
        # Restored from the daemon: the reference's cached tokens, exactly its output (raw).
        assert got.cached_tokens == ref.cached_tokens
        assert got.text == ref.text
        assert got.token_logprobs == ref.token_logprobs
        # vLLM counts the prefix as an external KV transfer, none from its own (empty) cache.
        assert metrics["vllm:prompt_tokens_by_source_total{external_kv_transfer}"] == \
            got.cached_tokens
        assert metrics["vllm:external_prefix_cache_hits_total"] == got.cached_tokens
        assert metrics["vllm:prefix_cache_hits_total"] == 0
        ns2 = {n.model: n for n in client.get_stats().namespaces}[ns.model]
        assert ns2.restores - ns.restores == full_blocks
        assert ns2.hits - ns.hits == full_blocks
