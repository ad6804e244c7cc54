"""tests/python/vllm_engine.py for an engine with LMCache's connector, bench only.

    python lmcache_engine.py JOB.json OUT.json

LMCache's connector imports numba, which imports llvmlite.binding. At worker start-up vLLM's CPU
platform registers its Triton kernel overrides (vllm/triton_utils/dispatcher.py), which scans the
namespace of every loaded module and reads `vars(value)` of every value that has a `__dict__`.
llvmlite's `ffi.lib` (a `_lib_wrapper` with `__slots__`) answers any attribute, `__dict__`
included, with a wrapped ctypes symbol lookup, so the scan gets a `_lib_fn_wrapper` instead of a
dict and vLLM's start-up fails. vLLM has no setting that skips the scan on CPU (it runs whenever
Triton is not installed). The shim: `_lib_wrapper` answers AttributeError for dunder names (the
library exports only LLVMPY_* symbols, so no llvmlite call changes), then the engine runs as
vllm_engine.py runs it.
"""

from __future__ import annotations

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"))


def shim_llvmlite() -> None:
    from llvmlite.binding import ffi

    lookup = ffi._lib_wrapper.__getattr__

    def no_dunder(self: object, name: str) -> object:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    ffi._lib_wrapper.__getattr__ = no_dunder


if __name__ == "__main__":
    shim_llvmlite()
    from vllm_engine import run

    out = run(json.load(open(sys.argv[1])))
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
