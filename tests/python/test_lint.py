"""The Python package, its tests and the benchmarks' Python pass pyflakes (pinned in
python/requirements.lock): no undefined names, unused imports or variables, or redefinitions.
The generated gRPC stubs (python/hiqcache/v1) are not checked."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pyflakes_finds_nothing():
    files = [str(p) for top in ("python/hiqcache", "tests/python", "bench")
             for p in sorted((ROOT / top).rglob("*.py"))
             if "hiqcache/v1" not in p.as_posix()]
    assert len(files) > 20
    r = subprocess.run([sys.executable, "-m", "pyflakes", *files], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
