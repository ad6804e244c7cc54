"""The Python package builds as a wheel (offline, with the venv's setuptools) whose metadata names
it and carries the project's version, and every part reports that one version: the wheel's
METADATA, hiqcache.__version__, `hiqcached --version`, `hiqctl --version` and libhiqcache.so's
hiq_version(). The version is written once, in python/hiqcache/_version.py (CMake reads it for
the binaries and the library, setuptools for the wheel)."""

from __future__ import annotations

import ctypes
import email.parser
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import hiqcache

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _daemon_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("HIQ_DAEMON_PATH")
                        or ROOT / "build" / "server" / "hiqcached")


def _version_of(program: pathlib.Path, name: str) -> str:
    if not program.exists():
        pytest.fail(f"{program} not found (build it, or set HIQ_DAEMON_PATH)")
    r = subprocess.run([str(program), "--version"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.fullmatch(name + r" (\S+)\n", r.stdout)
    assert m, f"{program} --version printed {r.stdout!r}"
    return m.group(1)


def _build_wheel(tmp_path: pathlib.Path) -> pathlib.Path:
    # From a copy, so that setuptools' build/ and *.egg-info stay out of the checkout.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "python", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--no-index", "--quiet", "-w", str(dist), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wheels = sorted(dist.glob("hiqcache-*.whl"))
    assert len(wheels) == 1, [p.name for p in dist.iterdir()]
    return wheels[0]


def test_wheel_and_binaries_report_one_version(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = [n for n in names if re.fullmatch(r"hiqcache-[^/]+\.dist-info/METADATA", n)]
        assert len(meta) == 1, names
        metadata = email.parser.Parser().parsestr(z.read(meta[0]).decode())
        assert "hiqcache/__init__.py" in names and "hiqcache/_version.py" in names, names
        assert "hiqcache/v1/cache_pb2.py" in names, "the generated gRPC stubs are not in the wheel"
    assert metadata["Name"] == "hiqcache"
    version = metadata["Version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert wheel.name.startswith(f"hiqcache-{version}-"), wheel.name

    daemon = _daemon_path()
    hiqctl = pathlib.Path(os.environ.get("HIQ_HIQCTL_PATH")
                          or daemon.parent.parent / "client" / "hiqctl")
    c_lib = os.environ.get("HIQ_C_LIB") or str(ROOT / "build" / "client" / "libhiqcache.so")
    if not os.path.exists(c_lib):
        pytest.fail(f"libhiqcache.so not found at {c_lib} (build it, or set HIQ_C_LIB)")
    lib = ctypes.CDLL(c_lib)
    lib.hiq_version.restype = ctypes.c_char_p
    lib.hiq_version.argtypes = []

    reported = {
        "wheel METADATA": version,
        "hiqcache.__version__": hiqcache.__version__,
        "hiqcached --version": _version_of(daemon, "hiqcached"),
        "hiqctl --version": _version_of(hiqctl, "hiqctl"),
        "hiq_version()": lib.hiq_version().decode(),
    }
    assert set(reported.values()) == {version}, reported
