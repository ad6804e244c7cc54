"""A real Redis Cluster on loopback for Python tests: `masters` redis-server processes (no
replicas) in cluster mode on free ports, joined with redis-cli --cluster create, in a temporary
directory; stopped (SIGKILL) and removed by close(). The C++ tests' 3+3 cluster with failover is
tests/l3/redis_test_cluster.h; this one only needs to hold values."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def _free_port() -> int:
    """A free client port whose bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a redis-server")


class RedisCluster:
    def __init__(self, masters: int = 3):
        self.dir = tempfile.mkdtemp(prefix="hiq-py-redis-")
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen] = []
        self.masters = masters

    @property
    def seeds(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def cli(self, port: int, *args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                              text=True, timeout=30).stdout

    def start(self, timeout: float = 30.0) -> RedisCluster:
        deadline = time.monotonic() + timeout
        for _ in range(self.masters):
            # A port free when probed may be taken before redis-server binds it: that server
            # exits at once, and the next free port is tried.
            for _attempt in range(5):
                port = _free_port()
                d = os.path.join(self.dir, str(port))
                os.makedirs(d, exist_ok=True)
                proc = subprocess.Popen(
                    ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                     "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "1000", "--appendonly", "no", "--save", "",
                     "--dir", d, "--logfile", os.path.join(d, "redis.log")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                while proc.poll() is None and self.cli(port, "PING").strip() != "PONG":
                    if time.monotonic() > deadline:
                        proc.kill()
                        proc.wait()
                        raise TimeoutError(f"redis-server on {port} did not start")
                    time.sleep(0.05)
                if proc.poll() is None:
                    self.ports.append(port)
                    self.procs.append(proc)
                    break
            else:
                raise RuntimeError("no redis-server could bind a free port")
        subprocess.run(["redis-cli", "--cluster", "create",
                        *[f"127.0.0.1:{p}" for p in self.ports], "--cluster-replicas", "0",
                        "--cluster-yes"], capture_output=True, check=True, timeout=60)
        for port in self.ports:
            while "cluster_state:ok" not in self.cli(port, "CLUSTER", "INFO"):
                if time.monotonic() > deadline:
                    raise TimeoutError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        return self

    def keys(self) -> int:
        """Keys held by all masters."""
        return sum(int(self.cli(p, "DBSIZE").strip() or 0) for p in self.ports)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
