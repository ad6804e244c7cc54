"""Engine jobs of the vLLM connector tests: each engine is its own process of
tests/python/vllm_engine.py, given a job file (model, connector, batches of prompts) and writing
its results as JSON; and the prompts they share."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

from vllm_engine import engine_env

HERE = pathlib.Path(__file__).resolve().parent  # tests/python: the helpers
BS = 32
GROUPS = 8


def run_engine(name: str, job: dict, tmp: pathlib.Path, timeout: float = 600,
               env: dict[str, str] | None = None) -> dict:
    proc = start_engine(name, job, tmp, env)
    return finish_engine(name, proc, tmp, timeout)


def start_engine(name: str, job: dict, tmp: pathlib.Path,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    (tmp / f"{name}.job.json").write_text(json.dumps(job))
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, str(HERE / "vllm_engine.py"),
                             str(tmp / f"{name}.job.json"), str(tmp / f"{name}.out.json")],
                            env={**engine_env(), **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT)


def finish_engine(name: str, proc: subprocess.Popen, tmp: pathlib.Path,
                  timeout: float = 600) -> dict:
    rc = proc.wait(timeout)
    if rc != 0:
        raise AssertionError(f"engine {name} exited {rc}:\n" +
                             (tmp / f"{name}.log").read_text()[-6000:])
    return json.loads((tmp / f"{name}.out.json").read_text())


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def full_blocks(prompt_len: int, shared: int) -> int:
    """Blocks of the shared prefix a second prompt can take from a cache."""
    return min(shared // BS, (prompt_len - 1) // BS)


def gpl_prompts(model: str) -> list[tuple[list[int], list[int], int]]:
    """GROUPS prefix groups of real English text (the GPL, on every Debian system): each group
    has a shared prefix of 300-1000 tokens and two prompts with different tails."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(open("/usr/share/common-licenses/GPL-3").read())["input_ids"]
    assert len(ids) > 7500
    groups = []
    for i in range(GROUPS):
        length = 300 + (i * 97) % 700
        prefix = ids[i * 800:i * 800 + length]
        t1 = ids[6700 + 40 * i:6700 + 40 * i + 20 + i]
        t2 = ids[7150 + 40 * i:7150 + 40 * i + 25 - i]
        groups.append((prefix + t1, prefix + t2, length))
    return groups
