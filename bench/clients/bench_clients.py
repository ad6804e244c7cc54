#!/usr/bin/env python3
"""The two clients side by side against one real hiqcached (HOST device): Lookup latency through
hiqcache.Client (Python, gRPC + its own session code) and through libhiqcache.so via ctypes, same
keys, same namespace, calls interleaved so that machine load hits both alike; a Backup+Restore
round trip of a small HOST pool both ways; and the install size of each (the Python package with
its pip dependencies as installed; libhiqcache.so with the shared libraries ldd names, by their
Debian packages' Installed-Size).

Environment as for tests/python: HIQ_DAEMON_PATH, HIQ_C_LIB. Runs in about 20 s on 2 cores.
  python bench/clients/bench_clients.py [--calls 300]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import hiqcache as hq  # noqa: E402
from c_client import CClient, lib_path  # noqa: E402
from daemon import Daemon  # noqa: E402
from kv_util import HostKv  # noqa: E402

G = hq.Geometry(num_layers=4, num_kv_heads=2, head_dim=64)
BT = 16
CODEC_INT8 = 0


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e6, q))


def summary(name: str, xs: list[float]) -> str:
    return f"{name:34s} median {pct(xs, 50):8.1f} us   p99 {pct(xs, 99):8.1f} us"


def latency(calls: int, d: Daemon, kv: HostKv) -> None:
    py = hq.Client(d.target, call_timeout=10.0, register_timeout=10.0)
    c = CClient(d.target, timeout_ms=10000)
    try:
        ph = py.register_pool(kv.spec("bench-clients", BT))
        ch = c.register_host(kv.shm.name, kv.shm.size, G, kv.layers, "bench-clients", BT,
                             CODEC_INT8)
        keys = hq.compute_block_keys(range(64 * BT), BT, salt="bench")
        kv.fill(range(4 * BT), seed=1)
        for i in range(0, 64, 4):  # the namespace holds all 64 keys
            assert py.backup(ph, keys[i:i + 4], range(4 * BT)).status.ok
        for n in (1, 64):
            ks = keys[:n]
            assert py.lookup(ph, ks).prefix_blocks == n and c.lookup(ch, ks)[0] == n
            tp, tc = [], []
            for i in range(calls):
                for first in ((0, 1) if i % 2 == 0 else (1, 0)):
                    t0 = time.perf_counter()
                    if first == 0:
                        r = py.lookup(ph, ks).prefix_blocks
                        tp.append(time.perf_counter() - t0)
                    else:
                        r = c.lookup(ch, ks)[0]
                        tc.append(time.perf_counter() - t0)
                    assert r == n
            print(summary(f"lookup {n:2d} keys, hiqcache.Client", tp))
            print(summary(f"lookup {n:2d} keys, libhiqcache ctypes", tc))
            print(f"{'':34s} ratio python/C median {np.median(tp) / np.median(tc):.2f}")
        # Backup + Restore of 4 blocks (64 tokens) through INT8, fresh keys each round.
        tp, tc = [], []
        for i in range(calls // 3):
            for who in ((0, 1) if i % 2 == 0 else (1, 0)):
                ks = hq.compute_block_keys(range(4 * BT), BT, salt=f"rt-{who}-{i}")
                t0 = time.perf_counter()
                if who == 0:
                    b = py.backup(ph, ks, range(4 * BT))
                    r = py.restore(ph, ks, range(4 * BT, 8 * BT)).restored_blocks
                    ok = b.status.ok
                else:
                    st, rc, _ = c.backup(ch, ks, range(4 * BT))
                    r = c.restore(ch, ks, range(4 * BT, 8 * BT))[0]
                    ok = rc == 0
                (tp if who == 0 else tc).append(time.perf_counter() - t0)
                assert ok and r == 4
        print(summary("backup+restore 4x16 tok, Python", tp))
        print(summary("backup+restore 4x16 tok, ctypes", tc))
        print(f"{'':34s} ratio python/C median {np.median(tp) / np.median(tc):.2f}")
    finally:
        c.close()
        py.close()


def dist_bytes(name: str) -> int:
    dist = metadata.distribution(name)
    total = 0
    for f in dist.files or ():
        p = pathlib.Path(dist.locate_file(f))
        if p.is_file():
            total += p.stat().st_size
    return total


def sizes() -> None:
    mib = 1 << 20
    total = 0
    for name in ("hiqcache", "grpcio", "protobuf", "numpy", "xxhash"):
        b = dist_bytes(name)
        total += b
        print(f"pip {name:10s} {metadata.version(name):10s} {b / mib:7.1f} MiB")
    print(f"pip total (Python client)        {total / mib:7.1f} MiB")
    lib = os.path.realpath(lib_path())
    own = os.path.getsize(lib)
    print(f"libhiqcache.so (as built)        {own / mib:7.1f} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        stripped = os.path.join(tmp, "lib.so")
        if subprocess.run(["strip", "-o", stripped, lib]).returncode == 0:
            print(f"libhiqcache.so (stripped)        {os.path.getsize(stripped) / mib:7.1f} MiB")
    ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
    paths = [ln.split("=>")[1].split("(")[0].strip() for ln in ldd.splitlines() if "=>" in ln]
    libs = sum(os.path.getsize(os.path.realpath(p)) for p in paths if p)
    print(f"its {len(paths)} shared libraries (files)  {libs / mib:7.1f} MiB")
    pkgs = set()
    for p in paths:
        out = subprocess.run(["dpkg", "-S", os.path.realpath(p)], capture_output=True, text=True)
        if out.returncode != 0:
            out = subprocess.run(["dpkg", "-S", p], capture_output=True, text=True)
        if out.returncode == 0:
            pkgs.add(out.stdout.split(":")[0])
    base = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libssl3"}  # in every Debian image
    kib = 0
    kib_extra = 0
    for pkg in sorted(pkgs):
        q = subprocess.run(["dpkg-query", "-W", "-f", "${Installed-Size}", pkg],
                           capture_output=True, text=True).stdout.strip()
        kib += int(q or 0)
        if pkg not in base:
            kib_extra += int(q or 0)
    print(f"their {len(pkgs)} Debian packages, Installed-Size {kib / 1024:7.1f} MiB "
          f"({kib_extra / 1024:.1f} MiB without libc6, libstdc++6, libgcc-s1, zlib1g, libssl3)")
    print("packages:", " ".join(sorted(pkgs)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    d = Daemon()
    kv = HostKv(G, 8 * BT)
    try:
        d.start()
        latency(args.calls, d, kv)
    finally:
        kv.close()
        d.close()
    sizes()
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
