"""The Python package, every Python file under tests/ and the benchmarks' Python pass ruff, and
the package passes mypy --strict: both pinned in python/requirements.lock and configured in
python/pyproject.toml ([tool.ruff], [tool.mypy]), both run from python/ as a developer runs them
there. The generated gRPC stubs (python/hiqcache/v1) are not linted; mypy reads their .pyi. mypy
keeps its cache in .cache/mypy at the repository root: a first run reads torch and vLLM (about
25 s of CPU), a later one a few seconds."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
PYTHON = ROOT / "python"
RUFF = [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", "pyproject.toml",
        "hiqcache", "../tests", "../bench"]


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=PYTHON, capture_output=True, text=True, timeout=timeout)


def test_ruff_finds_nothing():
    listed = run([*RUFF, "--show-files"], 60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    files = [pathlib.Path(line).resolve() for line in listed.stdout.splitlines()]
    assert len(files) > 20
    assert PYTHON / "hiqcache" / "vllm" / "__init__.py" in files
    assert ROOT / "tests" / "python" / "package" / "test_lint.py" in files
    assert ROOT / "tests" / "client" / "hiqcache_c_smoke.py" in files
    assert ROOT / "bench" / "vllm" / "bench_vllm.py" in files
    assert not [f for f in files if "hiqcache/v1" in f.as_posix()]
    r = run(RUFF, 120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_finds_nothing():
    r = run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"], 600)
    assert r.returncode == 0, r.stdout + r.stderr
    # The package itself was checked, not an empty file list.
    assert "Success: no issues found in" in r.stdout, r.stdout + r.stderr
    assert int(r.stdout.split(" in ")[1].split()[0]) >= 15, r.stdout
