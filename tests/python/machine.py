"""What a benchmark ran on, read off the machine at run time, for its result file to record.

    from machine import describe, summary
    describe()  # {"cpu": "AMD EPYC", "nproc": 2, "mem_bytes": ..., "simd": "AVX2", ...}
    summary()   # "2-core AMD EPYC (AVX2, no AVX-512), 24 GiB, no GPU"
"""

from __future__ import annotations

import os


def _proc_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def describe() -> dict:
    cpu, flags = "unknown", set()
    for line in _proc_lines("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        if key.strip() == "model name" and cpu == "unknown":
            cpu = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    mem = 0
    for line in _proc_lines("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else \
        "NEON" if "asimd" in flags else "unknown" if not flags else "SSE"
    return {"cpu": cpu, "nproc": os.cpu_count(), "mem_bytes": mem, "simd": simd,
            "kernel": os.uname().release, "gpu": os.path.exists("/dev/nvidia0")}


def summary(d: dict | None = None) -> str:
    d = d or describe()
    simd = d["simd"] + (", no AVX-512" if d["simd"] == "AVX2" else "")
    return (f"{d['nproc']}-core {d['cpu']} ({simd}), {round(d['mem_bytes'] / 2**30)} GiB, "
            f"{'a GPU' if d['gpu'] else 'no GPU'}")
