#!/usr/bin/env python3
"""vLLM through hiqcached, on real weights (SmolLM2-135M-Instruct, vLLM on CPU), same run:

  ttft      time to first token of prompts with a 2,048-token shared prefix: recomputed (no
            cache), restored from hiqcached by a fresh engine (int8_per_head and raw; straight
            into vLLM's tiles, and through staging), and vLLM's own prefix cache hit (the
            floor); medians and ratios, and the load average around it.
  fidelity  greedy agreement and logprob deltas of int8_per_head restores against vLLM's own
            prefix cache over many prompt pairs (prefixes of real text, 200-1,500 tokens).
  layout    the connector's conversion between vLLM's CPU attention tiles and the staging rows
            the daemon reads and writes, for one 2,048-token restore and backup of SmolLM2,
            against a copy of the same bytes (consecutive and fragmented block ids).
  restore   one 2,048-token Restore of SmolLM2 through the real daemon (raw and int8): decoded
            straight into vLLM's tiles (split views; consecutive and fragmented blocks) against
            decoded into staging rows plus the conversion, and a copy of the same bytes.
  workload  the shared-prefix workload of the seed's experiment B at this machine's scale: many
            prefix groups, more prefix tokens than vLLM's own KV cache keeps, requests in
            concurrent batches, hiqcached's pool fixed at one byte budget; vLLM alone vs
            hiqcached raw vs int8: prefix hit rate, TTFT, and prefix tokens held per GiB.

    .venv/bin/python bench/vllm/bench_vllm.py [--only ttft|restore|workload] [--reps 7]
        [--out FILE]

Every engine is its own process (tests/python/vllm_engine.py); the daemon is the real hiqcached
(build/server/hiqcached, or $HIQ_DAEMON_PATH). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import hiqcache as hq  # noqa: E402
from daemon import Daemon  # noqa: E402
from real_model import model_dir  # noqa: E402
from vllm_engine import engine_env  # noqa: E402

BS = 32


def text_ids(model: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return tok(open("/usr/share/common-licenses/GPL-3").read())["input_ids"]


def rotation(ids: list[int], start: int, n: int) -> list[int]:
    """n tokens of the text starting at `start`, wrapping around: distinct starts give prefixes
    that share no block key."""
    out = []
    while len(out) < n:
        out.extend(ids[start:start + n - len(out)])
        start = 0
    return out


def workload_requests(ids: list[int], args: argparse.Namespace
                      ) -> tuple[list[tuple[int, int, list[int]]], list[list[list[int]]]]:
    """The shared-prefix workload (experiment B): `args.groups` prefixes of `args.prefix_tokens`
    tokens, each asked once per round with its own 24-token suffix, `args.rounds` rounds in a
    shuffled order (seed 7). Returns the requests as (round, group, prompt) and the prompts in
    batches of `args.concurrency`."""
    rng = random.Random(7)
    prefixes = [rotation(ids, 613 * g + 5, args.prefix_tokens) for g in range(args.groups)]
    requests: list[tuple[int, int, list[int]]] = []
    for r in range(args.rounds):
        order = list(range(args.groups))
        rng.shuffle(order)
        for g in order:
            requests.append((r, g, prefixes[g] + rotation(ids, 7000 + 17 * len(requests), 24)))
    batches = [[p for _, _, p in requests[i:i + args.concurrency]]
               for i in range(0, len(requests), args.concurrency)]
    return requests, batches


def engine(name: str, job: dict, tmp: pathlib.Path) -> dict:
    jp, op = tmp / f"{name}.job.json", tmp / f"{name}.out.json"
    jp.write_text(json.dumps(job))
    with open(tmp / f"{name}.log", "w") as log:
        rc = subprocess.run([sys.executable, str(ROOT / "tests" / "python" / "vllm_engine.py"),
                             str(jp), str(op)], env=engine_env(), stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"engine {name} failed ({rc}); log: {tmp / (name + '.log')}")
    return json.loads(op.read_text())


def ttft_of(r: dict) -> float:
    return r["ttft"] if r.get("ttft") else r["batch_seconds"]


def bench_ttft(model: str, ids: list[int], reps: int, tmp: pathlib.Path) -> dict:
    prefix_len, tail = 2048, 16
    prefixes = [rotation(ids, 997 * i + 13, prefix_len) for i in range(reps)]
    writes = [p + rotation(ids, 7000 + 31 * i, tail) for i, p in enumerate(prefixes)]
    reads = [p + rotation(ids, 7300 + 29 * i, tail) for i, p in enumerate(prefixes)]
    warm = [rotation(ids, 5000, 64)]  # the first request of an engine pays one-time set-up
    base = {"model": model, "max_tokens": 1, "log_stats": True, "max_model_len": 4096}
    out: dict = {"prefix_tokens": prefix_len, "prompt_tokens": prefix_len + tail, "reps": reps}
    runs = {}
    runs["recompute"] = engine("ttft-recompute", {**base, "connector": None,
                                                  "prefix_caching": False,
                                                  "batches": [warm] + [[p] for p in reads]}, tmp)
    local = engine("ttft-local", {**base, "connector": None, "batches": [warm] + [
        [p] for pair in zip(writes, reads) for p in pair]}, tmp)
    runs["vllm_prefix_cache"] = {"results": [None] + local["results"][2::2]}
    load = [os.getloadavg()[0]]
    with Daemon(pool_bytes="2GiB") as d:
        for codec in ("int8_per_head", "raw"):
            conn = {"target": d.target, "codec": codec}
            engine(f"ttft-write-{codec}", {**base, "connector": conn,
                                           "batches": [[p] for p in writes]}, tmp)
            # Both read engines restore the same stored blocks (a restore evicts nothing).
            for transport in ("tiles", "staging"):
                name = codec if transport == "tiles" else f"{codec}_staging"
                runs[name] = engine(f"ttft-read-{name}", {
                    **base, "connector": {**conn, "cpu_transport": transport},
                    "batches": [warm] + [[p] for p in reads]}, tmp)
                out[f"{name}_connector"] = runs[name]["connector"]
                load.append(os.getloadavg()[0])
    out["load_average_1min"] = load
    for name, run in runs.items():
        res = run["results"][1:]
        t = [ttft_of(r) for r in res]
        out[name] = {"ttft_median_s": statistics.median(t), "ttft_s": t,
                     "cached_tokens": [r["num_cached_tokens"] for r in res]}
    rec = out["recompute"]["ttft_median_s"]
    hit = out["vllm_prefix_cache"]["ttft_median_s"]
    for name in TTFT_RUNS[1:]:
        out[name]["speedup_vs_recompute"] = rec / out[name]["ttft_median_s"]
        out[name]["vs_vllm_prefix_cache"] = out[name]["ttft_median_s"] / hit
    return out


TTFT_RUNS = ("recompute", "int8_per_head", "raw", "int8_per_head_staging", "raw_staging",
             "vllm_prefix_cache")


def minor_faults(d: Daemon) -> int:
    """The daemon's minor page faults so far (all its threads)."""
    assert d.proc is not None
    stat = pathlib.Path(f"/proc/{d.proc.pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[7])


def bench_restore(reps: int) -> dict:
    """One 2,048-token Restore through the real daemon into vLLM's tiles (split views) against
    into staging rows plus the connector's conversion, and a copy of the same bytes."""
    import torch

    from hiqcache.vllm.cpu_worker import TileConverter, tile_plane_view, tile_view_strides

    bs, heads, dim, layers, nb = BS, 3, 64, 30, 64  # SmolLM2-135M, 2,048 tokens
    g = hq.Geometry(num_layers=layers, num_kv_heads=heads, head_dim=dim)
    tc = TileConverter(torch.bfloat16, bs, heads, dim)
    strides = [tile_view_strides(f) for f in tc.factors]
    if any(st is None for st in strides):
        return {"isa": tc.describe(), "skipped": "the tile order has no split view"}
    blocks, tile, es, rows = 2 * nb, 2 * bs * dim, 2, nb * bs
    tiles = hq.HostShm.create_memfd("bench-tiles", layers * blocks * heads * tile * es)
    area = torch.frombuffer(tiles.buf, dtype=torch.bfloat16).view(layers, blocks, heads, tile)
    plane = hq.slot_major_bytes(g, rows)
    stage = hq.HostShm.create_memfd("bench-staging", layers * 2 * plane)
    staging = torch.frombuffer(stage.buf, dtype=torch.bfloat16).view(layers, 2, rows, heads, dim)
    tile_views, stage_views = [], []
    for l in range(layers):
        planes = []
        for p, st in enumerate(strides):
            assert st is not None
            planes.append(tile_plane_view(
                st, es, buffer=0, offset_bytes=(l * blocks * heads * tile + p * bs * dim) * es,
                num_rows=blocks * bs, head_stride_bytes=tile * es, page_rows=bs,
                page_stride_bytes=heads * tile * es))
        tile_views.append(hq.LayerView(k=planes[0], v=planes[1]))
        stage_views.append(hq.LayerView(k=hq.slot_major_view(g, rows, 0, 2 * l * plane),
                                        v=hq.slot_major_view(g, rows, 0, (2 * l + 1) * plane)))
    nbytes = layers * 2 * rows * heads * dim * es
    copy_src = torch.randn(layers, nb, heads, tile).to(torch.bfloat16)

    def median_ms(fn) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1000

    out: dict = {"isa": tc.describe(), "bytes": nbytes, "threads": torch.get_num_threads(),
                 "load_average_1min": [os.getloadavg()[0]]}
    out["memcpy_ms"] = median_ms(lambda: area[:, nb:].copy_(copy_src))
    consecutive = [b * bs + t for b in range(nb) for t in range(bs)]
    fragmented = [b * bs + t for b in range(0, blocks, 2) for t in range(bs)]
    with Daemon(pool_bytes="1GiB") as d, hq.Client(d.target) as c:
        for codec in (hq.Codec.RAW, hq.Codec.INT8_PER_HEAD):
            spec = {"model": f"bench-restore-{codec.value}", "geometry": g, "block_tokens": bs,
                    "codec": codec}
            tp = c.register_pool(hq.PoolSpec(**spec, buffers=(tiles.shared_buffer(),),
                                              layers=tuple(tile_views)))
            sp = c.register_pool(hq.PoolSpec(**spec, buffers=(stage.shared_buffer(),),
                                              layers=tuple(stage_views)))
            staging.copy_(torch.randn(staging.shape).to(torch.bfloat16))
            keys = hq.compute_block_keys(range(rows), bs, salt=codec.value)
            assert c.backup(sp, keys, range(rows)).blocks == [hq.BlockStatus.STORED] * nb

            def restore(pool: int, into: list[int] | range, keys: list = keys) -> None:
                assert c.restore(pool, keys, into).restored_blocks == nb

            def staged(sp: int = sp, restore=restore) -> None:
                restore(sp, range(rows))
                for l in range(layers):
                    tc.to_tiles_into(staging[l, 0], staging[l, 1], area[l, :nb])

            # The first restore through a fresh pool's mapping of the tiles, and the page faults
            # the daemon took for it: the tiles' pages are resident for both codecs (create_memfd
            # populates them), so this measures registration's mapping ahead, not allocation.
            faults = minor_faults(d)
            t0 = time.perf_counter()
            restore(tp, consecutive)
            r: dict = {"tiles_first_ms": (time.perf_counter() - t0) * 1000,
                       "tiles_first_daemon_minor_faults": minor_faults(d) - faults}
            r["staging_decode_ms"] = median_ms(lambda: restore(sp, range(rows)))  # noqa: B023
            r["staging_decode_and_convert_ms"] = median_ms(staged)
            for name, into in (("consecutive", consecutive), ("fragmented", fragmented)):
                r[f"tiles_{name}_ms"] = median_ms(lambda into=into: restore(tp, into))  # noqa: B023
                r[f"tiles_{name}_vs_memcpy"] = out["memcpy_ms"] / r[f"tiles_{name}_ms"]
            r["staging_vs_memcpy"] = out["memcpy_ms"] / r["staging_decode_and_convert_ms"]
            # The tiles hold what the staged path writes.
            restore(tp, consecutive)
            assert torch.equal(area[:, :nb], torch.stack([
                tc.to_tiles(staging[l, 0], staging[l, 1]) for l in range(layers)]))
            out[codec.value] = r
            assert c.release_pool(tp).ok and c.release_pool(sp).ok
    out["load_average_1min"].append(os.getloadavg()[0])
    # The memfds stay mapped (the tensors view them) until the process ends.
    return out


def bench_fidelity(model: str, ids: list[int], pairs: int, tmp: pathlib.Path) -> dict:
    rng = random.Random(11)
    groups = []
    for _ in range(pairs):
        n = rng.randrange(200, 1500)
        prefix = rotation(ids, rng.randrange(len(ids)), n)
        groups.append((prefix + rotation(ids, rng.randrange(len(ids)), 24),
                       prefix + rotation(ids, rng.randrange(len(ids)), 24)))
    base = {"model": model, "max_tokens": 16}
    ref = engine("fid-ref", {**base, "connector": None,
                             "batches": [[p] for pair in groups for p in pair]}, tmp)["results"]
    out: dict = {"pairs": pairs, "max_tokens": 16}
    with Daemon(pool_bytes="2GiB") as d:
        conn = {"target": d.target, "codec": "int8_per_head"}
        engine("fid-write", {**base, "connector": conn, "batches": [[a] for a, _ in groups]}, tmp)
        got = engine("fid-read", {**base, "connector": conn,
                                  "batches": [[b] for _, b in groups]}, tmp)
    first, before, compared, deltas, identical = 0, 0, 0, [], 0
    for i, r in enumerate(got["results"]):
        want = ref[2 * i + 1]
        assert r["num_cached_tokens"] == want["num_cached_tokens"]
        first += r["tokens"][0] == want["tokens"][0]
        identical += r["tokens"] == want["tokens"]
        for a, b, la, lb in zip(r["tokens"], want["tokens"], r["logprobs"], want["logprobs"]):
            compared += 1
            if a != b:
                break
            before += 1
            deltas.append(abs(la - lb))
    deltas.sort()
    out.update({"first_token_agreement": first / pairs, "identical_sequences": identical / pairs,
                "tokens_equal_before_divergence": before, "tokens_compared": compared,
                "logprob_delta_median": statistics.median(deltas),
                "logprob_delta_p90": deltas[int(0.9 * (len(deltas) - 1))],
                "logprob_delta_max": deltas[-1],
                "restored_blocks": got["connector"]["loaded_blocks"]})
    return out


def bench_layout(reps: int) -> dict:
    import torch

    from hiqcache.vllm import CpuWorker, TileConverter

    bs, heads, dim, layers, nb = BS, 3, 64, 30, 64  # SmolLM2-135M, 2,048 tokens
    w = CpuWorker.__new__(CpuWorker)
    w.bs, w.tiles = bs, TileConverter(torch.bfloat16, bs, heads, dim)
    w.layers = [torch.zeros(4 * nb, heads, 2 * bs * dim, dtype=torch.bfloat16)
                for _ in range(layers)]
    w.staging = torch.randn(layers, 2, nb * bs, heads, dim).to(torch.bfloat16)
    nbytes = layers * 2 * nb * bs * heads * dim * 2

    def median_s(fn) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for layer in range(layers):
                fn(layer)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    out: dict = {"isa": w.tiles.describe(), "bytes": nbytes, "threads": torch.get_num_threads()}
    copy = median_s(lambda l: w.layers[l][nb:2 * nb].view(-1).copy_(w.staging[l].view(-1)))
    out["memcpy_ms"] = copy * 1000
    for name, ids in (("consecutive", list(range(nb, 2 * nb))),
                      ("fragmented", list(range(0, 2 * nb, 2)))):
        for op, fn in (("restore", w._rows_to_tiles), ("backup", w._tiles_to_rows)):
            t = median_s(lambda l, fn=fn, ids=ids: fn(l, ids, 0))
            out[f"{op}_{name}_ms"] = t * 1000
            out[f"{op}_{name}_vs_memcpy"] = copy / t
    return out


    return out


def bench_workload(model: str, ids: list[int], args: argparse.Namespace, tmp: pathlib.Path) -> dict:
    requests, batches = workload_requests(ids, args)
    vllm_kv = args.vllm_kv_mib << 20
    base = {"model": model, "max_tokens": 4, "log_stats": True, "kv_cache_bytes": vllm_kv,
            "max_model_len": 2048, "max_num_seqs": args.concurrency, "batches": batches}
    g = hq.Geometry(num_layers=30, num_kv_heads=3, head_dim=64)
    out: dict = {"groups": args.groups, "rounds": args.rounds, "prefix_tokens": args.prefix_tokens,
                 "requests": len(requests), "concurrency": args.concurrency,
                 "vllm_kv_bytes": vllm_kv, "pool_bytes": args.pool_mib << 20,
                 "bf16_bytes_per_token": g.bytes_per_token,
                 "vllm_tokens": vllm_kv // g.bytes_per_token}
    configs = [("vllm_only", None), ("hiqcached_raw", "raw"), ("hiqcached_int8", "int8_per_head")]
    for name, codec in configs:
        conn = None
        with Daemon(pool_bytes=f"{args.pool_mib}MiB") as d:
            if codec:
                conn = {"target": d.target, "codec": codec}
            t = time.monotonic()
            run = engine(f"workload-{name}", {**base, "connector": conn}, tmp)
            wall = time.monotonic() - t
            held = None
            if codec:
                ns = [n for n in hq.Client(d.target).get_stats().namespaces]
                held = {"capacity_tokens": ns[0].capacity_blocks * BS,
                        "encoded_bytes_per_token": ns[0].encoded_bytes_per_token,
                        "tokens_per_gib": ns[0].capacity_blocks * BS / (args.pool_mib / 1024)}
        res = run["results"]
        warm = [i for i, (r, _, _) in enumerate(requests) if r > 0]
        cached = sum(res[i]["num_cached_tokens"] for i in warm)
        shareable = sum((len(requests[i][2]) - 1) // BS * BS for i in warm)
        ttft = [ttft_of(res[i]) for i in warm]
        out[name] = {"hit_rate_warm_rounds": cached / shareable,
                     "ttft_median_s": statistics.median(ttft), "engine_wall_s": wall,
                     "connector": run["connector"], "held": held}
    out["vllm_tokens_per_gib"] = (1 << 30) // g.bytes_per_token
    return out


def run(args: argparse.Namespace, model: str, ids: list[int], tmp: pathlib.Path,
        result: dict) -> None:
    if args.only in (None, "ttft"):
        result["ttft"] = bench_ttft(model, ids, args.reps, tmp)
        t = result["ttft"]
        print(f"TTFT, {t['prompt_tokens']}-token prompts with a {t['prefix_tokens']}-token "
              f"shared prefix, median of {t['reps']}:")
        for name in TTFT_RUNS:
            r = t[name]
            ratio = r.get("speedup_vs_recompute")
            print(f"  {name:22s} {r['ttft_median_s'] * 1000:8.1f} ms" +
                  (f"  {ratio:5.2f}x faster than recompute, "
                   f"{r['vs_vllm_prefix_cache']:.2f}x vLLM's hit" if ratio else ""))
        print(f"  load average (1 min) around the restores: {t['load_average_1min']}")
    if args.only in (None, "fidelity"):
        result["fidelity"] = f = bench_fidelity(model, ids, args.pairs, tmp)
        print(f"int8_per_head vs vLLM's prefix cache, {f['pairs']} prompt pairs, {f['max_tokens']} "
              f"greedy tokens: first token {f['first_token_agreement'] * 100:.1f}% equal, whole "
              f"sequence {f['identical_sequences'] * 100:.1f}%, "
              f"{f['tokens_equal_before_divergence']}"
              f"/{f['tokens_compared']} tokens before divergence; |dlogprob| median "
              f"{f['logprob_delta_median']:.4f}, p90 {f['logprob_delta_p90']:.4f}, max "
              f"{f['logprob_delta_max']:.4f}")
    if args.only in (None, "layout"):
        result["layout"] = lay = bench_layout(max(args.reps, 9))
        print(f"Layout conversion, {lay['bytes'] / 1e6:.1f} MB per 2,048-token transfer, "
              f"{lay['isa']}, {lay['threads']} thread(s): memcpy {lay['memcpy_ms']:.2f} ms")
        for name in ("consecutive", "fragmented"):
            print(f"  {name:12s} restore {lay[f'restore_{name}_ms']:6.2f} ms "
                  f"({lay[f'restore_{name}_vs_memcpy']:.2f}x memcpy)  backup "
                  f"{lay[f'backup_{name}_ms']:6.2f} ms "
                  f"({lay[f'backup_{name}_vs_memcpy']:.2f}x memcpy)")
    if args.only in (None, "restore"):
        result["restore"] = rs = bench_restore(max(args.reps, 9))
        print(f"Restore through hiqcached, {rs['bytes'] / 1e6:.1f} MB per 2,048 tokens, "
              f"{rs['isa']}: memcpy {rs['memcpy_ms']:.2f} ms; load {rs['load_average_1min']}")
        for codec in ("raw", "int8_per_head"):
            r = rs.get(codec)
            if r:
                print(f"  {codec:14s} staging {r['staging_decode_ms']:6.2f} ms + conversion = "
                      f"{r['staging_decode_and_convert_ms']:6.2f} ms "
                      f"({r['staging_vs_memcpy']:.2f}x memcpy); tiles "
                      f"{r['tiles_consecutive_ms']:6.2f} ms "
                      f"({r['tiles_consecutive_vs_memcpy']:.2f}x), fragmented "
                      f"{r['tiles_fragmented_ms']:6.2f} ms "
                      f"({r['tiles_fragmented_vs_memcpy']:.2f}x); first through a fresh pool "
                      f"{r['tiles_first_ms']:6.2f} ms, "
                      f"{r['tiles_first_daemon_minor_faults']} daemon page faults")
    if args.only in (None, "workload"):
        result["workload"] = bench_workload(model, ids, args, tmp)
        w = result["workload"]
        print(f"Workload: {w['groups']} groups x {w['prefix_tokens']}-token prefixes, "
              f"{w['rounds']} rounds shuffled, {w['requests']} requests in batches of "
              f"{w['concurrency']}; vLLM KV {w['vllm_tokens']} tokens, pool "
              f"{w['pool_bytes'] >> 20} MiB")
        for name in ("vllm_only", "hiqcached_raw", "hiqcached_int8"):
            r = w[name]
            held = r["held"]
            print(f"  {name:15s} hit {r['hit_rate_warm_rounds'] * 100:5.1f}%  TTFT median "
                  f"{r['ttft_median_s'] * 1000:7.1f} ms" +
                  (f"  holds {held['tokens_per_gib']:,.0f} tokens/GiB "
                   f"({held['encoded_bytes_per_token']} B/token)" if held else
                   f"  (vLLM holds {w['vllm_tokens_per_gib']:,} tokens/GiB)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("ttft", "fidelity", "layout", "restore", "workload"))
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--vllm-kv-mib", type=int, default=128)
    ap.add_argument("--pool-mib", type=int, default=192)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm" / "vllm.json"))
    args = ap.parse_args()
    model = str(model_dir())
    ids = text_ids(model)
    result: dict = {"machine": os.uname().nodename, "cpus": os.cpu_count()}
    tmp = tempfile.mkdtemp(prefix="hiq-vllm-bench-")  # engine logs: kept if a run fails
    run(args, model, ids, pathlib.Path(tmp), result)
    shutil.rmtree(tmp, ignore_errors=True)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out_path = pathlib.Path(args.out)
    existing = json.loads(out_path.read_text()) if out_path.exists() else {}
    existing.update(result)
    pathlib.Path(args.out).write_text(json.dumps(existing, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
