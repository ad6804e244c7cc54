"""One real vLLM engine process (CPU, single process, real SmolLM2 weights), driven by a JSON job.

    python vllm_engine.py JOB.json OUT.json

JOB: {"model": dir, "connector": {extra config} | null, "kv_connector": vLLM connector class
      (default HiqCacheConnector from hiqcache.vllm; another name is one of vLLM's own, e.g.
      LMCacheMPConnector, given "connector" as its extra config), "batches": [[prompt, ...], ...],
      "max_tokens": 8, "prefix_caching": true, "before_batch": "path-{n}" (wait for that file
      before batch n), "after_batch": "path-{n}" (create it after n batches),
      "evict_before_load": k (see _evict_before_load), "kv_cache_bytes": vLLM's own KV cache
      size, "log_stats": true (per-request time to first token), "tp": tensor parallel size,
      "pause_s": seconds the engine idles before each batch after the first (a tier finishes
      storing what the previous batch sent)}
where each prompt is a list of token ids; the prompts of one batch are submitted together
(concurrency), the batches one after another. OUT: per prompt the greedy token ids, their
logprobs and the time to first token of its batch, plus the worker connector's counters.
Used by the engine tests and the vLLM benchmark; `engine_env()` gives the environment.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a fast single-process vLLM on CPU."""
    env = dict(base if base is not None else os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        gomp = pathlib.Path(torch.__file__).parent / "lib" / "libgomp.so.1"
        if gomp.exists() and "libgomp" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(p for p in (str(gomp), env.get("LD_PRELOAD")) if p)
    except ImportError:
        pass
    return env


def _evict_before_load(keep: int) -> None:
    """Test hook: every restore first evicts all but its first `keep` blocks from the daemon,
    as another engine's traffic could between the scheduler's lookup and the worker's load."""
    import hiqcache.client as hc

    restore = hc.Client.restore

    def evicting_restore(self, handle, keys, rows, **kwargs):
        if len(keys) > keep:
            self.evict(handle, keys[keep:])
        return restore(self, handle, keys, rows, **kwargs)

    hc.Client.restore = evicting_restore


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kv_cfg = None
    if job.get("connector") is not None:
        from vllm.config import KVTransferConfig

        name = job.get("kv_connector", "HiqCacheConnector")
        module = "hiqcache.vllm" if name == "HiqCacheConnector" else None
        kv_cfg = KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                                  kv_role="kv_both", kv_connector_extra_config=job["connector"])
    if job.get("kv_cache_bytes"):
        # vLLM's CPU platform lets this variable override kv_cache_memory_bytes.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    t0 = time.monotonic()
    llm = LLM(model=job["model"], dtype="bfloat16", block_size=job.get("block_size", 32),
              max_model_len=job.get("max_model_len", 4096), enforce_eager=True,
              enable_prefix_caching=job.get("prefix_caching", True), seed=0,
              max_num_seqs=job.get("max_num_seqs", 8), kv_transfer_config=kv_cfg,
              tensor_parallel_size=job.get("tp", 1),
              max_num_batched_tokens=job.get("max_num_batched_tokens", 4096),
              kv_cache_memory_bytes=job.get("kv_cache_bytes"),
              disable_log_stats=not job.get("log_stats", False))
    startup = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), logprobs=1,
                            ignore_eos=True)
    if job.get("evict_before_load") is not None:
        _evict_before_load(job["evict_before_load"])
    results = []
    for index, batch in enumerate(job["batches"]):
        if index and job.get("pause_s"):
            time.sleep(job["pause_s"])
        if job.get("before_batch"):
            # A hook for failure tests: wait until a file exists (another process acts).
            flag = pathlib.Path(job["before_batch"].format(n=index))
            deadline = time.monotonic() + 60
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        t = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                            use_tqdm=False)
        elapsed = time.monotonic() - t
        for o in outs:
            c = o.outputs[0]
            lps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, c.token_ids)]
            ttft = None
            m = getattr(o, "metrics", None)
            if m is not None and getattr(m, "first_token_latency", None):
                ttft = float(m.first_token_latency)
            results.append({"tokens": list(c.token_ids), "logprobs": lps, "batch_seconds": elapsed,
                            "ttft": ttft, "num_cached_tokens": o.num_cached_tokens})
        if job.get("after_batch"):
            pathlib.Path(job["after_batch"].format(n=index + 1)).touch()
    stats = {}
    if kv_cfg is not None and job.get("tp", 1) == 1 and kv_cfg.kv_connector_module_path:
        # In-process worker (single process mode); with TP the workers are other processes.
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()._worker
        stats = dict(worker.stats) if worker is not None else {}
    return {"startup_seconds": startup, "results": results, "connector": stats}


if __name__ == "__main__":
    job = json.load(open(sys.argv[1]))
    out = run(job)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
