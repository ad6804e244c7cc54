"""The real hiqcached binary for Python tests and benchmarks: started on a temporary unix socket
with its own pool name, stopped (SIGTERM, then SIGKILL) and cleaned up by close()."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def daemon_path() -> str:
    path = os.environ.get("HIQ_DAEMON_PATH") or str(ROOT / "build" / "server" / "hiqcached")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"hiqcached not found at {path} (set HIQ_DAEMON_PATH or build)")
    return path


class Daemon:
    def __init__(self, pool_bytes: str = "256MiB", extra: tuple[str, ...] = (),
                 shm_name: str | None = None, open_to_all_users: bool = False,
                 binary: str | None = None):
        """open_to_all_users: sockets mode 0666 in a directory others may traverse, for tests
        whose children drop to other uids. binary: the hiqcached to run (default:
        daemon_path())."""
        self.dir = tempfile.mkdtemp(prefix="hiq-py-")
        if open_to_all_users:
            os.chmod(self.dir, 0o711)
            extra = (*extra, "--socket-mode", "0666")
        self.socket_path = os.path.join(self.dir, "hiqcached.sock")
        self.target = "unix://" + self.socket_path
        self.shm_name = shm_name or f"/hiq-py-pool-{os.getpid()}-{os.urandom(3).hex()}"
        self.pool_bytes = pool_bytes
        self.extra = tuple(extra)
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(self.dir, "daemon.log")

    def start(self, timeout: float = 30.0) -> Daemon:
        args = [self.binary or daemon_path(), "--listen", self.target, "--pool-bytes",
                self.pool_bytes, "--shm-name", self.shm_name, "--log-level", "warn", *self.extra]
        # The daemon gets SIGTERM when the process that started it dies (a test or benchmark
        # killed before its cleanup ran), instead of living on with its pool: setpriv sets the
        # death signal and execs it, so the pid is the daemon's. The signal comes when the
        # *thread* that started it ends: start daemons from a thread that outlives them.
        setpriv = shutil.which("setpriv")
        if setpriv:
            args = [setpriv, "--pdeathsig", "TERM", *args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hiqcached exited with {self.proc.returncode}: "
                                   + open(self.log).read()[-2000:])
            if self.serving():
                return self
            time.sleep(0.02)
        raise TimeoutError("hiqcached did not start listening")

    def serving(self) -> bool:
        """The session socket accepts connections: it listens once the daemon serves (the gRPC
        socket listens earlier, while the pool is pre-faulted)."""
        return self.connectable(self.socket_path + ".session", socket.SOCK_SEQPACKET)

    def connectable(self, path: str | None = None, kind: int = socket.SOCK_STREAM) -> bool:
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            s.connect(path or self.socket_path)
            return True
        except OSError:
            return False
        finally:
            s.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; the exit status."""
        if self.proc is None:
            return -1
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -1
        finally:
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.kill()
        try:
            os.unlink("/dev/shm" + self.shm_name)
        except FileNotFoundError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_or_skip_without_l3(d: Daemon) -> Daemon:
    """d.start() for a daemon given l3 flags; a hiqcached built without hiredis refuses
    l3_seeds, and the calling test is skipped."""
    try:
        return d.start()
    except RuntimeError as e:
        if "without the L3 store" in str(e):
            import pytest
            pytest.skip("hiqcached was built without the L3 store")
        raise
