"""One real `vllm serve` process (vLLM's OpenAI-compatible HTTP server) on CPU, optionally with
hiqcache's KV connector, listening on a unix socket of its own (no TCP port to pick).

    server = VllmServer(model, workdir, connector={"target": ..., "codec": "raw"}).start()
    reply = server.complete("a prompt", max_tokens=8)  # greedy; text, logprobs, TTFT, usage
    server.metrics()                                    # vLLM's Prometheus counters
    server.stop()

`command()` is the exact command line; `serve_env()` the environment (engine_env, as the
offline engines of vllm_engine.py, with vLLM's own KV cache sized by --kv-cache-memory-bytes).
Used by tests/python/engines/test_vllm_serve.py and the demo (bench/vllm/demo_vllm.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from vllm_engine import engine_env

CONNECTOR = {"kv_connector": "HiqCacheConnector", "kv_connector_module_path": "hiqcache.vllm",
             "kv_role": "kv_both"}


def vllm_command() -> str:
    """The `vllm` command of the Python running this (the project venv)."""
    return str(pathlib.Path(sys.executable).with_name("vllm"))


def serve_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """engine_env() for a server: vLLM's own KV size comes from --kv-cache-memory-bytes (the CPU
    platform's VLLM_CPU_KVCACHE_SPACE would override it), and the engine core runs in its own
    process as `vllm serve` always does."""
    env = engine_env(base)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


@dataclass
class Completion:
    text: str
    token_logprobs: list[float]
    ttft_s: float  # request sent -> first streamed token
    total_s: float
    prompt_tokens: int
    cached_tokens: int  # prompt tokens vLLM did not compute: its prefix cache or the connector
    raw_usage: dict = field(default_factory=dict)


class VllmServer:
    def __init__(self, model: str, workdir: pathlib.Path | str, connector: dict | None = None,
                 kv_cache_bytes: int = 128 << 20, max_model_len: int = 2048,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        """connector: kv_connector_extra_config of hiqcache's connector, or None for vLLM alone."""
        self.model = model
        self.dir = pathlib.Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket_path = str(self.dir / "vllm.sock")
        self.log_path = self.dir / "vllm-serve.log"
        self.connector = connector
        self.kv_cache_bytes = kv_cache_bytes
        self.max_model_len = max_model_len
        self.extra_args = tuple(extra_args)
        self.env = serve_env({**os.environ, **(env or {})})
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._client = None

    def command(self) -> list[str]:
        args = [vllm_command(), "serve", self.model, "--uds", self.socket_path,
                "--dtype", "bfloat16", "--block-size", "32", "--enforce-eager", "--seed", "0",
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", "4",
                "--max-num-batched-tokens", str(self.max_model_len),
                "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--distributed-executor-backend", "uni"]
        if self.connector is not None:
            cfg = {**CONNECTOR, "kv_connector_extra_config": self.connector}
            args += ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]
        return args + list(self.extra_args)

    def command_line(self) -> str:
        return shlex.join(self.command())

    def start(self, timeout: float = 300.0) -> VllmServer:
        """Starts the server and waits until GET /health answers 200; the log is in workdir."""
        import importlib.metadata

        import httpx

        try:
            importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError("the `vllm` command cannot run in this venv: it looks up the "
                               "distribution `vllm` (vllm-cpu installs none); "
                               "deploy/setup-venv.sh installs its alias") from None
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            # Its own process group: stop() reaches the engine core process too.
            self.proc = subprocess.Popen(self.command(), env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self._client = httpx.Client(transport=httpx.HTTPTransport(uds=self.socket_path),
                                    base_url="http://vllm", timeout=600)
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            if os.path.exists(self.socket_path):
                try:
                    if self._client.get("/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vllm serve did not answer /health in {timeout:.0f} s:\n"
                                   + self.log_tail())
            time.sleep(0.25)
        self.startup_s = time.monotonic() - t0
        return self

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def complete(self, prompt: str | list[int], max_tokens: int = 8,
                 cache_salt: str | None = None) -> Completion:
        """One greedy completion (temperature 0) of a text or of token ids, streamed: the time
        to its first token is measured here, at the client. cache_salt: vLLM's per-request salt
        of its prefix cache, which the connector's block keys include too."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "logprobs": 1, "stream": True,
                "stream_options": {"include_usage": True}}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        text, logprobs, usage, ttft = [], [], {}, None
        t0 = time.monotonic()
        with self._client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"completion failed: HTTP {r.status_code} {r.read()!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk.get("choices") or ():
                    if choice.get("text") and ttft is None:
                        ttft = time.monotonic() - t0
                    text.append(choice.get("text") or "")
                    lp = choice.get("logprobs") or {}
                    logprobs.extend(lp.get("token_logprobs") or ())
                if chunk.get("usage"):
                    usage = chunk["usage"]
        total = time.monotonic() - t0
        details = usage.get("prompt_tokens_details") or {}
        return Completion(text="".join(text), token_logprobs=logprobs,
                          ttft_s=ttft if ttft is not None else total, total_s=total,
                          prompt_tokens=usage.get("prompt_tokens", 0),
                          cached_tokens=details.get("cached_tokens") or 0, raw_usage=usage)

    def tokenize(self, prompt: str) -> list[int]:
        r = self._client.post("/tokenize", json={"model": self.model, "prompt": prompt})
        r.raise_for_status()
        return r.json()["tokens"]

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters, summed over labels, by name (vllm:..._total)."""
        out: dict[str, float] = {}
        for line in self._client.get("/metrics").text.splitlines():
            if line.startswith("#") or not line.startswith("vllm:"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            labels = name_labels[len(name):]
            if 'source="' in labels:  # prompt_tokens_by_source: keep the source apart
                name += "{" + labels.split('source="', 1)[1].split('"', 1)[0] + "}"
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                pass
        return out

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (vLLM shuts its engine core down), then SIGKILL of the process group."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is None:
            return -1
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = -1
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of this server left behind
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        return rc

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
