#!/usr/bin/env python3
"""SGLang's HiCache L3 path through hiqcached: batch_set_v1 / batch_get_v1 of
hiqcache.sglang.HiqCacheStorage on SGLang's real host pool, against memcpy of the same bytes.

For each geometry x codec x host layout: SGLang's real MHA device pool and host pool (shm
allocator, on this CPU), the backend built by SGLang's StorageBackendFactory, a fresh real
hiqcached. Each repetition backs up one 128-page batch (SGLang's STORAGE_BATCH_SIZE) under fresh
page hashes with batch_set_v1 (slots A), restores it with batch_get_v1 into other slots (B) and
checks it (raw: every page bit-exact; int8: sample pages within the codec bound; the other codecs:
sample pages within 0.25 relative error, not exact), then times, single-threaded in this process,
a copy of the same pages A -> B (the same gathered page layout) and a contiguous memcpy of the
same byte count. Medians over --reps after one warm-up rep.
With --baseline-daemon a second daemon (another build) serves a second backend on the same host
pool, and each rep runs both, in alternating order: a same-run A/B ("vs baseline" = baseline
median / this median).

    .venv/bin/python bench/sglang/bench_sglang.py [--reps 5] [--geometries smollm2-135m qwen3-8b]
        [--codecs int8_per_head raw] [--layouts page_first] [--page-size 64] [--out FILE]
        [--daemon-arg=--transfer-chunk-bytes=1GiB ...] [--baseline-daemon OTHER/hiqcached]

--codecs takes any hiqcache.Codec value (default: int8_per_head and raw).
Rates count BF16-equivalent bytes (pages x page_size x BF16 bytes per token), decimal GB.
Prints a table and writes JSON (bench/results/sglang/sglang.json).

This process's OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE unless the environment
sets it): torch's default lets them spin for a while after each parallel op (the zeroing of
slots B before a get), and on a machine with as few cores as the daemon has codec threads the
spinning thread takes a core from the daemon during the timed call. --omp-wait-policy unset
measures that case (OpenMP's default).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import os
import pathlib
import statistics
import sys
import time
import zlib
from typing import Any


def _omp_wait_policy() -> str:
    """OMP_WAIT_POLICY for this process, set before torch loads OpenMP: --omp-wait-policy
    (`unset`: OpenMP's default), else the environment's, else PASSIVE (module docstring)."""
    for i, a in enumerate(sys.argv):
        v = sys.argv[i + 1] if a == "--omp-wait-policy" and i + 1 < len(sys.argv) else (
            a.split("=", 1)[1] if a.startswith("--omp-wait-policy=") else None)
        if v == "unset":
            os.environ.pop("OMP_WAIT_POLICY", None)
            return v
        if v is not None:
            os.environ["OMP_WAIT_POLICY"] = v
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


OMP_WAIT_POLICY = _omp_wait_policy()
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "python"))  # this checkout's hiqcache, not the venv's copy

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE  # noqa: E402

import hiqcache  # noqa: E402
from daemon import Daemon  # noqa: E402
from kv_util import int8_violations  # noqa: E402
from machine import describe  # noqa: E402
from sglang_kv import (  # noqa: E402
    MHA_LAYOUTS,
    Engine,
    KvShape,
    bf16_bits,
    extra_config,
    make_backend,
    page_hashes,
)

GEOMETRIES = {  # layers, KV heads, head_dim (MHA, BF16)
    "smollm2-135m": (30, 3, 64),
    "qwen3-8b": (36, 8, 128),
}
CODECS = tuple(c.value for c in hiqcache.Codec)
DEFAULT_CODECS = ("int8_per_head", "raw")
DEVICE_PAGES = 16  # SGLang's device pool: kept small, it is not used here


def machine() -> dict:
    return describe() | {"torch": torch.__version__}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, all threads (clock ticks: 10 ms resolution)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def fill_random(engine: Engine, firsts: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for s in firsts:
        page = engine.host.get_data_page(s, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))


def run_case(geom: str, codec: str, layout: str, args: argparse.Namespace, reps: int) -> dict:
    layers, heads, dim = GEOMETRIES[geom]
    ps, batch = args.page_size, args.batch_pages
    shape = KvShape(layers=layers, heads=heads, dim=dim, page_size=ps)
    bpt = shape.page_bytes // ps  # BF16 bytes per token
    nbytes = batch * ps * bpt  # one batch, BF16-equivalent
    # SGLang sizes the host pool as int(device_tokens * ratio) rounded down to pages, + 1 page.
    device_tokens = DEVICE_PAGES * ps
    ratio = 2 * batch * ps / device_tokens
    engine = Engine(shape, layout, device_tokens=device_tokens, host_ratio=ratio)
    if engine.host.page_num < 2 * batch:
        raise SystemExit(f"host pool has {engine.host.page_num} pages, need {2 * batch}")
    pool_bytes = args.pool_bytes or f"{(2 * nbytes + (256 << 20)) >> 20}MiB"
    out: dict = {"geometry": geom, "codec": codec, "layout": layout, "layers": layers,
                 "kv_heads": heads, "head_dim": dim, "page_size": ps, "batch_pages": batch,
                 "bf16_bytes_per_token": bpt, "batch_bf16_bytes": nbytes,
                 "host_pool_pages": engine.host.page_num, "device_pool_tokens": device_tokens,
                 "daemon_pool_bytes": pool_bytes, "reps": reps, "warmup_reps": 1}
    out["daemon_args"] = list(args.daemon_arg)
    arms = [("", None)]
    if args.baseline_daemon:
        arms.append(("baseline_", args.baseline_daemon))
        out["baseline_daemon"] = args.baseline_daemon
    with contextlib.ExitStack() as stack:
        runs = []
        for prefix, binary in arms:
            d = stack.enter_context(Daemon(pool_bytes=pool_bytes, extra=tuple(args.daemon_arg),
                                           binary=binary))
            backend = make_backend(engine, extra_config(d.target, codec),
                                   model=f"bench-{geom}", metrics=False)
            stack.callback(backend.close)
            handle = backend._handle()
            if not handle:
                raise SystemExit(f"{geom}/{codec}/{layout}: the {prefix or 'main '}daemon "
                                 "refused the host pool")
            info = backend.client.pool_info(handle)
            out["encoded_bytes_per_token"] = info.encoded_bytes_per_token
            out["daemon_capacity_tokens"] = info.capacity_tokens
            if info.capacity_tokens < batch * ps:
                raise SystemExit(f"daemon pool {pool_bytes} holds {info.capacity_tokens} tokens, "
                                 f"less than one batch ({batch * ps})")
            runs.append(Arm(prefix, d, backend))
        slots_a, slots_b = engine.alloc_pages(batch), engine.alloc_pages(batch)
        first_a = slots_a[::ps].tolist()
        first_b = slots_b[::ps].tolist()
        fill_random(engine, first_a, seed=zlib.crc32(f"{geom}/{layout}".encode()))
        pages_a = [engine.host.get_data_page(s, flat=False) for s in first_a]
        pages_b = [engine.host.get_data_page(s, flat=False) for s in first_b]
        flat = engine.host.kv_buffer.view(-1).view(torch.uint8)
        src = flat[:nbytes]
        dst = torch.empty(nbytes, dtype=torch.uint8)
        threads = torch.get_num_threads()
        t_gather, t_contig = [], []
        for r in range(reps + 1):
            # Arms alternate which goes first, so that neither always follows the memcpys.
            for arm in runs if r % 2 == 0 else runs[::-1]:
                arm.rep(f"bench/{geom}/{codec}/{layout}/rep{r}", slots_a, slots_b, pages_a,
                        pages_b, first_a, first_b, codec, engine, batch, warmup=r == 0)
            torch.set_num_threads(1)
            try:
                t = time.perf_counter()
                for a, b in zip(pages_a, pages_b):
                    b.copy_(a)
                dt_gather = time.perf_counter() - t
                t = time.perf_counter()
                dst.copy_(src)
                dt_contig = time.perf_counter() - t
            finally:
                torch.set_num_threads(threads)
            if r == 0:
                continue  # warm-up
            t_gather.append(dt_gather)
            t_contig.append(dt_contig)
        for arm in runs:
            stats = arm.backend.client.get_stats()
            ns = [n for n in stats.namespaces if n.model == arm.backend.model]
            if ns:
                out[f"{arm.prefix}daemon_namespace"] = {
                    "blocks": ns[0].blocks, "backups": ns[0].backups,
                    "restores": ns[0].restores, "evictions": ns[0].evictions,
                    "capacity_blocks": ns[0].capacity_blocks}
        del src, dst, flat, pages_a, pages_b
    for arm in runs:
        arm.backend = arm.daemon = None  # the backends hold the host pool
    del engine
    gc.collect()

    mg, mc = med(t_gather), med(t_contig)
    timed = [("memcpy_gathered_pages", t_gather), ("memcpy_contiguous", t_contig)]
    for arm in runs:
        timed += [(f"{arm.prefix}batch_set_v1", arm.t_set),
                  (f"{arm.prefix}batch_get_v1", arm.t_get)]
    for name, times in timed:
        m = med(times)
        out[name] = {"median_s": m, "times_s": times, "pages_per_s": batch / m,
                     "gb_per_s": nbytes / m / 1e9, "vs_memcpy_gathered": mg / m,
                     "vs_memcpy_contiguous": mc / m}
    for arm in runs:
        for op, cpu in (("batch_set_v1", arm.cpu_set), ("batch_get_v1", arm.cpu_get)):
            r = out[arm.prefix + op]
            r["daemon_cpu_s"] = cpu
            r["daemon_cores_busy"] = sum(cpu) / sum(r["times_s"])
            if arm.prefix:
                out[op]["vs_baseline"] = r["median_s"] / out[op]["median_s"]
    return out


class Arm:
    """One daemon and its backend on the shared host pool, with its timings."""

    def __init__(self, prefix: str, daemon: Daemon | None, backend: Any):
        self.prefix, self.daemon, self.backend = prefix, daemon, backend
        self.t_set: list[float] = []
        self.t_get: list[float] = []
        self.cpu_set: list[float] = []
        self.cpu_get: list[float] = []

    def rep(self, tag: str, slots_a, slots_b, pages_a, pages_b, first_a, first_b, codec: str,
            engine: Engine, batch: int, warmup: bool) -> None:
        assert self.daemon is not None and self.daemon.proc is not None
        backend, pid, what = self.backend, self.daemon.proc.pid, f"{self.prefix}{tag}"
        keys = page_hashes(tag, batch)
        if backend.batch_exists(keys) != 0:
            raise SystemExit("fresh keys already held: the daemon would not store them")
        c, t = proc_cpu_s(pid), time.perf_counter()
        stored = backend.batch_set_v1(keys, slots_a)
        dt_set = time.perf_counter() - t
        dc_set = proc_cpu_s(pid) - c
        if not all(stored):
            raise SystemExit(f"{what}: batch_set_v1 stored {sum(stored)}/{batch} pages")
        for p in pages_b:
            p.zero_()
        c, t = proc_cpu_s(pid), time.perf_counter()
        got = backend.batch_get_v1(keys, slots_b)
        dt_get = time.perf_counter() - t
        dc_get = proc_cpu_s(pid) - c
        if not all(got):
            raise SystemExit(f"{what}: batch_get_v1 restored {sum(got)}/{batch} pages")
        if codec == "raw":
            bad = [i for i, (a, b) in enumerate(zip(pages_a, pages_b)) if not torch.equal(a, b)]
            if bad:
                raise SystemExit(f"{what}: raw restore differs in pages {bad[:8]}")
        elif codec == "int8_per_head":
            for i in (0, batch // 2, batch - 1):
                a, b = engine.page(first_a[i]), engine.page(first_b[i])
                v = int8_violations(bf16_bits(a), bf16_bits(b))
                if v or torch.equal(a, b):
                    raise SystemExit(f"{what}: int8 restore of page {i}: {v} elements outside "
                                     f"the bound, exact={torch.equal(a, b)}")
        else:  # FP8, 4-bit: close, not exact (their elementwise bounds are tests/kernels')
            for i in (0, batch // 2, batch - 1):
                a, b = engine.page(first_a[i]).float(), engine.page(first_b[i]).float()
                err = float((b - a).norm() / a.norm())
                if not err < 0.25 or torch.equal(a, b):
                    raise SystemExit(f"{what}: {codec} restore of page {i}: relative error "
                                     f"{err:.3f}, exact={torch.equal(a, b)}")
        if warmup:
            return
        self.t_set.append(dt_set)
        self.t_get.append(dt_get)
        self.cpu_set.append(dc_set)
        self.cpu_get.append(dc_get)


def print_case(c: dict) -> None:
    print(f"{c['geometry']} {c['codec']} {c['layout']}: {c['batch_pages']} pages x "
          f"{c['page_size']} tokens = {c['batch_bf16_bytes'] / 1e6:.1f} MB BF16, "
          f"{c['encoded_bytes_per_token']:,} encoded B/token "
          f"({c['bf16_bytes_per_token']:,} BF16), median of {c['reps']}"
          + (f", daemon evictions {c['daemon_namespace']['evictions']}"
             if "daemon_namespace" in c else "")
          + (f", daemon {' '.join(c['daemon_args'])}" if c["daemon_args"] else ""))
    for name in ("batch_set_v1", "batch_get_v1", "baseline_batch_set_v1", "baseline_batch_get_v1",
                 "memcpy_gathered_pages", "memcpy_contiguous"):
        if name not in c:
            continue
        r = c[name]
        print(f"  {name:22s} {r['median_s'] * 1e3:8.1f} ms {r['pages_per_s']:8.0f} pages/s "
              f"{r['gb_per_s']:6.2f} GB/s  {r['vs_memcpy_gathered']:5.2f}x gathered "
              f"{r['vs_memcpy_contiguous']:5.2f}x contiguous"
              + (f"  daemon {r['daemon_cores_busy']:.2f} cores" if "daemon_cores_busy" in r
                 else "")
              + (f"  {r['vs_baseline']:.2f}x baseline" if "vs_baseline" in r else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometries", nargs="+", choices=tuple(GEOMETRIES),
                    default=list(GEOMETRIES))
    ap.add_argument("--codecs", nargs="+", choices=CODECS, default=list(DEFAULT_CODECS))
    ap.add_argument("--layouts", nargs="+", choices=MHA_LAYOUTS, default=["page_first"])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--batch-pages", type=int, default=STORAGE_BATCH_SIZE)
    ap.add_argument("--reps", type=int, default=5, help="timed reps (after one warm-up)")
    ap.add_argument("--reps-qwen3-8b", type=int, default=None,
                    help="timed reps for qwen3-8b (default: --reps)")
    ap.add_argument("--pool-bytes", default=None,
                    help="daemon pool (default: 2 BF16 batches + 256 MiB)")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="extra hiqcached argument (repeatable), e.g. --daemon-arg="
                    "--transfer-chunk-bytes=1GiB")
    ap.add_argument("--baseline-daemon", default=None, metavar="HIQCACHED",
                    help="another hiqcached binary, run beside this one on the same host pool "
                    "with its reps interleaved (a same-run A/B)")
    ap.add_argument("--omp-wait-policy", choices=("PASSIVE", "ACTIVE", "unset"),
                    default=OMP_WAIT_POLICY,
                    help="how this process's idle OpenMP threads wait (read before torch loads; "
                    "default: the environment's OMP_WAIT_POLICY, else PASSIVE; unset: "
                    "OpenMP's default)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sglang" / "sglang.json"))
    args = ap.parse_args()
    logging.getLogger("hiqcache").setLevel(logging.WARNING)
    logging.getLogger("sglang").setLevel(logging.ERROR)

    result: dict = {"machine": machine(), "date": datetime.date.today().isoformat(),
                    "args": vars(args), "loadavg_start": os.getloadavg(),
                    "torch_threads": torch.get_num_threads(),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
                    "baseline_threads": 1, "hiqcache": hiqcache.__file__, "results": []}
    t0 = time.monotonic()
    for geom in args.geometries:
        reps = args.reps_qwen3_8b if geom == "qwen3-8b" and args.reps_qwen3_8b else args.reps
        for layout in args.layouts:
            for codec in args.codecs:
                c = run_case(geom, codec, layout, args, reps)
                c["loadavg_after"] = os.getloadavg()
                result["results"].append(c)
                print_case(c)
                sys.stdout.flush()
    result["loadavg_end"] = os.getloadavg()
    result["wall_s"] = time.monotonic() - t0
    print(f"load average start {result['loadavg_start'][0]:.2f}, end "
          f"{result['loadavg_end'][0]:.2f}; {result['wall_s']:.0f} s")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
