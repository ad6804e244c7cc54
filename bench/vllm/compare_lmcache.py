#!/usr/bin/env python3
"""LMCache beside hiqcached under real vLLM engines (CPU, SmolLM2-135M-Instruct), one run:

  ttft      time to first token of 2,064-token prompts whose 2,048-token prefix is in the tier:
            the same engine process that stored it (vLLM's own prefix cache off, so the prefix
            comes from the tier) and a fresh engine process (vLLM's prefix cache on and empty);
            vLLM alone gives the baselines (a fresh process recomputes; the same process hits
            its own prefix cache).
  workload  the seed's experiment B at the scale of this machine (12 groups of 256-token
            prefixes, 4 shuffled rounds, 48 requests in batches of 4), vLLM's own KV cache
            capped below the prefixes in play and every tier given the same byte budget:
            warm-round prefix hit rate, TTFT, and tokens each tier holds per GiB.

Arms: vLLM alone; LMCache 0.5.6 (its multi-process server, `lmcache server`, with vLLM's
LMCacheMPConnector; L1 in DRAM, BF16); hiqcached `raw`, `int8_per_head` and the codecs named by
--codec4, comma-separated (each skipped with a message when this hiqcache or the daemon does not
know it).

    bash bench/vllm/setup-lmcache-venv.sh       # once: .venv-lmcache/ (bench only)
    .venv-lmcache/bin/python bench/vllm/compare_lmcache.py [--only ttft|workload] [--reps 5]
        [--codec4 NAME[,NAME...]]

Runs under .venv-lmcache's python (every engine is its own process of that python; LMCache's
engines through lmcache_engine.py). Writes bench/results/vllm/vllm_lmcache.json, .dat and .png
(gnuplot, bench/vllm/plot_lmcache.gp), and prints the table with the load average around each part.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "python"))  # this checkout's hiqcache, not the venv's copy
sys.path.insert(0, str(HERE))

from bench_vllm import BS, rotation, text_ids, ttft_of, workload_requests  # noqa: E402
from lru_model import lru_hit_rate, watermark_hit_rate  # noqa: E402

import hiqcache as hq  # noqa: E402
from daemon import Daemon  # noqa: E402
from kv_util import HostKv  # noqa: E402
from machine import describe  # noqa: E402
from real_model import model_dir  # noqa: E402
from vllm_engine import engine_env  # noqa: E402

GEOMETRY = hq.Geometry(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M


def loadavg() -> float:
    return os.getloadavg()[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LMCacheServer:
    """LMCache's multi-process cache server (`lmcache server`) with an L1 of `l1_bytes` in DRAM
    and both transfer modes (vLLM's CPU connector moves KV through the engine-driven one)."""

    def __init__(self, l1_bytes: int, log: pathlib.Path):
        self.port, self.http_port = free_port(), free_port()
        self.l1_bytes = l1_bytes
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LMCacheServer:
        exe = pathlib.Path(sys.executable).parent / "lmcache"
        args = [str(exe), "server", "--host", "localhost", "--port", str(self.port),
                "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                "--l1-size-gb", repr(self.l1_bytes / (1 << 30)), "--eviction-policy", "LRU",
                "--supported-transfer-mode", "auto", "--disable-observability"]
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"lmcache server exited ({self.proc.returncode}); log: {self.log}")
            try:
                self.status()
                return self
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"lmcache server did not answer in 120 s; log: {self.log}")

    def status(self) -> dict:
        url = f"http://127.0.0.1:{self.http_port}/status"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())

    def connector(self) -> dict:
        return {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port}

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def engine(name: str, job: dict, tmp: pathlib.Path, lmcache: bool = False) -> dict:
    """One engine process; LMCache's through lmcache_engine.py (vllm_engine.py plus its shim)."""
    jp, op = tmp / f"{name}.job.json", tmp / f"{name}.out.json"
    jp.write_text(json.dumps(job))
    script = HERE / "lmcache_engine.py" if lmcache else ROOT / "tests" / "python" / "vllm_engine.py"
    env = engine_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"),
                                                   env.get("PYTHONPATH")) if p)
    with open(tmp / f"{name}.log", "w") as log:
        rc = subprocess.run([sys.executable, str(script), str(jp), str(op)], env=env, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"engine {name} failed ({rc}); log: {tmp / (name + '.log')}")
    return json.loads(op.read_text())


def codec_refusal(name: str) -> str | None:
    """Why hiqcached cannot serve codec `name` (this hiqcache or the daemon does not know it);
    None when a pool with it registers."""
    try:
        codec = hq.Codec.parse(name)
    except ValueError as e:
        return f"this hiqcache has no codec {name!r}: {e}"
    kv = HostKv(GEOMETRY, rows=2 * BS)
    try:
        with Daemon(pool_bytes="64MiB") as d, hq.Client(d.target) as c:
            c.release_pool(c.register_pool(kv.spec("codec-probe", BS, codec)))
    except hq.HiqError as e:
        return f"hiqcached refuses codec {name!r}: {e}"
    finally:
        kv.close()
    return None


def tier_arms(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(arm, hiqcached codec or None for LMCache): the extra codec arms (--codec4, comma-separated)
    only where they can run; the refused ones are kept, with why, in args.skipped_codec4."""
    arms: list[tuple[str, str | None]] = [("lmcache", None), ("hiqcached_raw", "raw"),
                                          ("hiqcached_int8", "int8_per_head")]
    for name in filter(None, (n.strip() for n in args.codec4.split(","))):
        why = codec_refusal(name)
        if why:
            print(f"skipping the {name} arm: {why}")
            args.skipped_codec4[name] = why
        elif name not in (codec for _, codec in arms):
            arms.append((f"hiqcached_{name}", name))
    return arms


class Tier:
    """A fresh tier for one arm: hiqcached with `codec`, or LMCache's server (codec None)."""

    def __init__(self, codec: str | None, nbytes: int, log: pathlib.Path):
        self.codec = codec
        self.daemon = Daemon(pool_bytes=f"{nbytes >> 20}MiB") if codec else None
        self.lmcache = None if codec else LMCacheServer(nbytes, log)

    def __enter__(self) -> Tier:
        if self.daemon:
            self.daemon.start()
        elif self.lmcache:
            self.lmcache.__enter__()
        return self

    def job(self) -> dict:
        if self.daemon:
            return {"connector": {"target": self.daemon.target, "codec": self.codec}}
        assert self.lmcache
        return {"connector": self.lmcache.connector(), "kv_connector": "LMCacheMPConnector"}

    def held(self, budget: int) -> dict:
        """What the tier stores per token and how many tokens a GiB of it holds."""
        if self.daemon:
            ns = list(hq.Client(self.daemon.target).get_stats().namespaces)
            cap = ns[0].capacity_blocks * BS
            return {"capacity_tokens": cap, "bytes_per_token": ns[0].encoded_bytes_per_token,
                    "tokens_per_gib": cap / (budget / (1 << 30))}
        assert self.lmcache
        s = self.lmcache.status()
        l1 = s["storage_manager"]["l1_manager"]
        objects, used, total = l1["total_object_count"], l1["memory_used_bytes"], \
            l1["memory_total_bytes"]
        out = {"objects": objects, "chunk_tokens": s["chunk_size"], "memory_used_bytes": used,
               "memory_total_bytes": total,
               "eviction_watermark":
                   s["storage_manager"]["l1_eviction_controller"]["trigger_watermark"]}
        if objects:
            per_token = used / (objects * s["chunk_size"])
            out.update({"bytes_per_token": per_token,
                        "capacity_tokens": int(total / per_token),
                        "tokens_per_gib": int(total / per_token) / (total / (1 << 30))})
        return out

    def __exit__(self, *exc: object) -> None:
        if self.daemon:
            self.daemon.close()
        elif self.lmcache:
            self.lmcache.__exit__()


def summary(results: list[dict]) -> dict:
    t = [ttft_of(r) for r in results]
    return {"ttft_median_s": statistics.median(t), "ttft_s": t,
            "cached_tokens": [r["num_cached_tokens"] for r in results]}


def bench_ttft(model: str, ids: list[int], args: argparse.Namespace,
               arms: list[tuple[str, str | None]], tmp: pathlib.Path) -> dict:
    prefix_len, tail, reps = 2048, 16, args.reps
    prefixes = [rotation(ids, 997 * i + 13, prefix_len) for i in range(reps)]
    writes = [p + rotation(ids, 7000 + 31 * i, tail) for i, p in enumerate(prefixes)]
    reads = [p + rotation(ids, 7300 + 29 * i, tail) for i, p in enumerate(prefixes)]
    fresh = [p + rotation(ids, 7600 + 23 * i, tail) for i, p in enumerate(prefixes)]
    warm = [rotation(ids, 5000, 64)]  # the first request of an engine pays one-time set-up
    pairs = [[p] for pair in zip(writes, reads) for p in pair]
    # Each batch waits pause_s first, so the tier holds all the previous batch stored: what is
    # timed is a restore of the whole prefix, not a race with its backup.
    base = {"model": model, "max_tokens": 1, "log_stats": True, "max_model_len": 4096,
            "pause_s": args.pause_s}
    budget = args.ttft_tier_mib << 20
    out: dict = {"prefix_tokens": prefix_len, "prompt_tokens": prefix_len + tail, "reps": reps,
                 "tier_bytes": budget, "pause_s": args.pause_s, "load_start": loadavg()}
    run = engine("ttft-vllm", {**base, "connector": None, "batches": [warm] + pairs}, tmp)
    out["vllm_only"] = {"fresh": summary(run["results"][1::2]),
                        "same": summary(run["results"][2::2])}
    for arm, codec in arms:
        with Tier(codec, budget, tmp / f"ttft-{arm}.server.log") as tier:
            same = engine(f"ttft-{arm}-same", {**base, **tier.job(), "prefix_caching": False,
                                               "batches": [warm] + pairs}, tmp, codec is None)
            new = engine(f"ttft-{arm}-fresh", {**base, **tier.job(),
                                                "batches": [warm] + [[p] for p in fresh]},
                         tmp, codec is None)
        out[arm] = {"store": summary(same["results"][1::2]),
                    "same": summary(same["results"][2::2]),
                    "fresh": summary(new["results"][1:])}
    out["load_end"] = loadavg()
    rec = out["vllm_only"]["fresh"]["ttft_median_s"]
    for arm in ["vllm_only"] + [a for a, _ in arms]:
        for kind in ("same", "fresh"):
            r = out[arm][kind]
            r["speedup_vs_recompute"] = rec / r["ttft_median_s"]
    return out


def bench_workload(model: str, ids: list[int], args: argparse.Namespace,
                   arms: list[tuple[str, str | None]], tmp: pathlib.Path) -> dict:
    requests, batches = workload_requests(ids, args)
    vllm_kv, budget = args.vllm_kv_mib << 20, args.tier_mib << 20
    base = {"model": model, "max_tokens": 4, "log_stats": True, "kv_cache_bytes": vllm_kv,
            "max_model_len": 1024, "max_num_seqs": args.concurrency, "batches": batches}
    out: dict = {"groups": args.groups, "rounds": args.rounds, "prefix_tokens": args.prefix_tokens,
                 "requests": len(requests), "concurrency": args.concurrency,
                 "vllm_kv_bytes": vllm_kv, "tier_bytes": budget,
                 "bf16_bytes_per_token": GEOMETRY.bytes_per_token,
                 "vllm_tokens": vllm_kv // GEOMETRY.bytes_per_token,
                 "vllm_tokens_per_gib": (1 << 30) // GEOMETRY.bytes_per_token}
    warm = [i for i, (r, _, _) in enumerate(requests) if r > 0]
    shareable = sum((len(requests[i][2]) - 1) // BS * BS for i in warm)
    for arm, codec in [("vllm_only", "")] + arms:
        load = loadavg()
        t = time.monotonic()
        if arm == "vllm_only":
            run, held = engine("workload-vllm", {**base, "connector": None}, tmp), None
        else:
            with Tier(codec, budget, tmp / f"workload-{arm}.server.log") as tier:
                run = engine(f"workload-{arm}", {**base, **tier.job()}, tmp, codec is None)
                held = tier.held(budget)
        res = run["results"]
        if codec and held:  # hiqcached's pool, against the model of its eviction
            held["lru_model_hit_rate"] = lru_hit_rate(batches, warm[0],
                                                      held["capacity_tokens"] // BS, BS)
        elif codec is None and held and "bytes_per_token" in held:  # LMCache's L1, likewise
            chunk = held["chunk_tokens"]
            held["watermark_model_hit_rate"], held["watermark_model_chunks"] = \
                watermark_hit_rate(batches, warm[0], held["memory_total_bytes"]
                                   / (chunk * held["bytes_per_token"]), chunk, BS,
                                   held["eviction_watermark"])
        out[arm] = {"hit_rate_warm_rounds": sum(res[i]["num_cached_tokens"] for i in warm)
                    / shareable,
                    "ttft_median_s": statistics.median(ttft_of(res[i]) for i in warm),
                    "engine_wall_s": time.monotonic() - t, "held": held,
                    "load_start": load, "load_end": loadavg(), "connector": run["connector"]}
    return out


LABELS = {"vllm_only": "vLLM alone", "lmcache": "LMCache 0.5.6", "hiqcached_raw": "hiqcached raw",
          "hiqcached_int8": "hiqcached int8"}


def label(arm: str) -> str:
    return LABELS.get(arm, arm.replace("hiqcached_", "hiqcached "))


def report(result: dict, arms: list[str]) -> None:
    if "ttft" in result:
        t = result["ttft"]
        print(f"TTFT, {t['prompt_tokens']}-token prompts, {t['prefix_tokens']}-token prefix in the "
              f"tier, median of {t['reps']} (load {t['load_start']:.2f} -> {t['load_end']:.2f}):")
        for arm in ["vllm_only"] + arms:
            r = t[arm]
            print(f"  {label(arm):22s} same process {r['same']['ttft_median_s'] * 1000:8.1f} ms "
                  f"({r['same']['speedup_vs_recompute']:5.2f}x)  fresh process "
                  f"{r['fresh']['ttft_median_s'] * 1000:8.1f} ms "
                  f"({r['fresh']['speedup_vs_recompute']:5.2f}x)  cached "
                  f"{statistics.median(r['fresh']['cached_tokens'])}")
    if "workload" in result:
        w = result["workload"]
        print(f"Workload: {w['groups']} groups x {w['prefix_tokens']}-token prefixes, "
              f"{w['rounds']} rounds, {w['requests']} requests in batches of {w['concurrency']}; "
              f"vLLM KV {w['vllm_tokens']} tokens, each tier {w['tier_bytes'] >> 20} MiB")
        for arm in ["vllm_only"] + arms:
            r = w[arm]
            held = r["held"]
            per_gib = held.get("tokens_per_gib") if held else w["vllm_tokens_per_gib"]
            lru = (held or {}).get("lru_model_hit_rate")
            wm = (held or {}).get("watermark_model_hit_rate")
            model = (f" (LRU model {lru * 100:5.1f}%)" if lru is not None
                     else f" (L1 model  {wm * 100:5.1f}%)" if wm is not None else " " * 19)
            print(f"  {label(arm):22s} hit {r['hit_rate_warm_rounds'] * 100:5.1f}%" + model
                  + f"  TTFT median {r['ttft_median_s'] * 1000:7.1f} ms  "
                  + (f"{per_gib:,.0f} tokens/GiB" if per_gib else "tokens/GiB unknown")
                  + f"  (load {r['load_start']:.2f} -> {r['load_end']:.2f})")


def plot(result: dict, arms: list[str], out: pathlib.Path) -> None:
    """One .dat row per arm, then gnuplot (bench/vllm/plot_lmcache.gp) renders the PNG."""
    t, w = result.get("ttft"), result.get("workload")
    rows = ["# arm ttft_same_ms ttft_fresh_ms hit_rate_pct workload_ttft_ms tokens_per_gib"]
    for arm in ["vllm_only"] + arms:
        def ms(r: dict | None) -> str:
            return f"{r['ttft_median_s'] * 1000:.1f}" if r else "NaN"
        held = w[arm]["held"] if w else None
        per_gib = (held or {}).get("tokens_per_gib") if held else (
            w["vllm_tokens_per_gib"] if w else None)
        rows.append(" ".join([
            f'"{label(arm)}"', ms(t[arm]["same"] if t else None),
            ms(t[arm]["fresh"] if t else None),
            f"{w[arm]['hit_rate_warm_rounds'] * 100:.1f}" if w else "NaN",
            ms(w[arm] if w else None), f"{per_gib:.0f}" if per_gib else "NaN"]))
    dat, png = out.with_suffix(".dat"), out.with_suffix(".png")
    dat.write_text("\n".join(rows) + "\n")
    load = [x for x in ((t or {}).get("load_start"), (t or {}).get("load_end")) if x is not None]
    load += [w[a][k] for a in ["vllm_only"] + arms for k in ("load_start", "load_end")] if w else []
    subtitle = (f"SmolLM2-135M on vLLM-CPU, {os.cpu_count()} cores, load average "
                f"{min(load):.1f}-{max(load):.1f}")
    gnuplot = shutil.which("gnuplot") is not None
    if not gnuplot or not (t and w):
        print(f"wrote {dat}; no plot ({'a run with both parts' if gnuplot else 'gnuplot'} "
              "draws it)")
        return
    subprocess.run(["gnuplot", "-e", f"datafile='{dat}'; outfile='{png}'; subtitle='{subtitle}'",
                    str(HERE / "plot_lmcache.gp")], check=True)
    print(f"wrote {dat} and {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("ttft", "workload"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--codec4", default="int4_hadamard",
                    help="hiqcached codecs of further arms, comma-separated ('' for none)")
    ap.add_argument("--ttft-tier-mib", type=int, default=512)
    ap.add_argument("--pause-s", type=float, default=2.0,
                    help="idle seconds before each TTFT request (the tier finishes storing)")
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--vllm-kv-mib", type=int, default=32)
    ap.add_argument("--tier-mib", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm" / "vllm_lmcache.json"))
    args = ap.parse_args()
    args.skipped_codec4 = {}
    try:
        import lmcache  # noqa: F401
    except ImportError:
        raise SystemExit("LMCache is not installed in this python: run "
                         "bench/vllm/setup-lmcache-venv.sh and .venv-lmcache/bin/python") from None
    model = str(model_dir())
    ids = text_ids(model)
    arms = tier_arms(args)
    result: dict = {"machine": describe(), "cpus": os.cpu_count(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "arms": ["vllm_only"] + [a for a, _ in arms],
                    "codec4": args.codec4, "skipped_codec4": args.skipped_codec4}
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hiq-lmcache-bench-"))  # logs: kept on failure
    if args.only in (None, "ttft"):
        result["ttft"] = bench_ttft(model, ids, args, arms, tmp)
    if args.only in (None, "workload"):
        result["workload"] = bench_workload(model, ids, args, arms, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    names = [a for a, _ in arms]
    report(result, names)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    plot(result, names, out)


if __name__ == "__main__":
    main()
