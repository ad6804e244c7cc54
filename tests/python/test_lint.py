"""The Python package, its tests and the benchmarks' Python pass ruff, pinned in
python/requirements.lock and configured in python/pyproject.toml ([tool.ruff]), run from python/
as a developer runs it there. The generated gRPC stubs (python/hiqcache/v1) are not linted."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYTHON = ROOT / "python"
RUFF = [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", "pyproject.toml",
        "hiqcache", "../tests/python", "../bench"]


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=PYTHON, capture_output=True, text=True, timeout=timeout)


def test_ruff_finds_nothing():
    listed = run([*RUFF, "--show-files"], 60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    files = [pathlib.Path(line).resolve() for line in listed.stdout.splitlines()]
    assert len(files) > 20
    assert PYTHON / "hiqcache" / "vllm" / "__init__.py" in files
    assert ROOT / "tests" / "python" / "test_lint.py" in files
    assert ROOT / "bench" / "vllm" / "bench_vllm.py" in files
    assert not [f for f in files if "hiqcache/v1" in f.as_posix()]
    r = run(RUFF, 120)
    assert r.returncode == 0, r.stdout + r.stderr

