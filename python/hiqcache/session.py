"""The session socket: how this process proves to hiqcached who it is and hands it memory by fd.

Protocol (common/hiqcache/session_protocol.h, the contract): beside each unix gRPC socket PATH
the daemon listens on PATH + ".session", an AF_UNIX SOCK_SEQPACKET socket. On accept it sends one
packet "HIQ-SESSION 1 token=<32 hex> pid=<pid> uid=<uid> gid=<gid>" (the kernel's SO_PEERCRED of
this connection). The client then sends "FDS" packets carrying 1..16 fds (SCM_RIGHTS), each
answered "OK <id> ..." (one id per fd, in order) or "ERR <why>". Every gRPC call carries the token
as metadata "hiq-session"; RegisterPool names passed fds by id (SharedBuffer.host_fd_id,
EventPool.host_fd_id) and consumes them. The connection closing (close(), or this process exiting
or dying) makes the daemon release every pool registered through it.

The token is a bearer secret: never hand it to a process that is not trusted with this one's
pools. The socket is close-on-exec, and a child made by fork() drops its inherited copy (it must
open its own session: the daemon identified the parent, not it).

The daemon ending a session (it exited, was killed or restarts) is noticed by one watcher thread
per process, which polls every open session's socket for the hang-up and runs the session's
on_daemon_end callback (hiqcache.Client releases the ticket slots of its pools there). It also
runs the delayed calls of call_later. It starts with the first session watched and sleeps in
poll(2) when nothing is due; a forked child starts with none.

Thread-safety: one Session may be shared by any number of threads; send_fds calls are
serialised (each is one request and its answer).
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import pwd
import re
import select
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["DAEMON_UID_ENV", "METADATA_KEY", "MAX_FDS_PER_MESSAGE", "Greeting", "Session",
           "SessionError", "UntrustedDaemon", "call_later", "session_path_for_target",
           "trusted_daemon_uids"]

log = logging.getLogger("hiqcache")

SOCKET_SUFFIX = ".session"
METADATA_KEY = "hiq-session"
GREETING_PREFIX = "HIQ-SESSION 1 "
MAX_FDS_PER_MESSAGE = 16
MAX_MESSAGE_BYTES = 4096

_GREETING = re.compile(r"^token=([0-9a-f]{32}) pid=(\d+) uid=(\d+) gid=(\d+)$")


class SessionError(OSError):
    """The session could not be opened, or the daemon refused or did not answer a message."""


class UntrustedDaemon(SessionError):
    """The listener at the target is not one this process trusts as its daemon; nothing was
    sent to it (see trusted_daemon_uids)."""

    def __init__(self, message: str):
        super().__init__(errno.EPERM, message)


DAEMON_UID_ENV = "HIQ_DAEMON_UID"


def _others_may_write(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _configured_daemon_uid() -> int | None:
    v = os.environ.get(DAEMON_UID_ENV, "")
    if not v:
        return None
    if v.isdigit():
        if len(v) > 10 or int(v) >= 2**32 - 1:
            raise UntrustedDaemon(f"{DAEMON_UID_ENV}={v}: not a uid")
        return int(v)
    try:
        return pwd.getpwnam(v).pw_uid
    except KeyError:
        raise UntrustedDaemon(f"{DAEMON_UID_ENV}={v}: no such user") from None


def trusted_daemon_uids(socket_path: str) -> list[int]:
    """The uids this process accepts as the daemon serving the unix socket `socket_path`, by
    the rule of the contract (common/hiqcache/socket_trust.h, docs/design.md "Sessions: whom a
    client trusts"): the socket's directory must not be writable by group or others, and its
    owner must be root, this process's uid, HIQ_DAEMON_UID, or anyone when the directory's
    parent is root's and not writable by group or others (only root could have made it). The
    trusted uids are then root, this process's, HIQ_DAEMON_UID's and the directory owner's.
    UntrustedDaemon when the rule refuses; SessionError (ENOENT) when the directory is missing."""
    trusted = [0, os.geteuid()]
    configured = _configured_daemon_uid()
    if configured is not None:
        trusted.append(configured)
    directory = os.path.realpath(os.path.dirname(socket_path) or ".")
    try:
        st = os.stat(directory)
    except OSError as err:
        raise SessionError(err.errno, f"socket directory {directory}: {err.strerror}") from err
    if not stat.S_ISDIR(st.st_mode):
        raise SessionError(errno.ENOTDIR, f"socket directory {directory}: not a directory")
    if _others_may_write(st):
        raise UntrustedDaemon(
            f"socket directory {directory} (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}) is writable by group or others, so anyone could "
            "have put the socket there: hiqcached is not trusted with this process's memory")
    if st.st_uid in trusted:
        return trusted
    parent = os.path.dirname(directory) or "/"
    try:
        pst = os.stat(parent)
        if pst.st_uid == 0 and not _others_may_write(pst):
            return [*trusted, st.st_uid]  # only root could have made it and chosen its owner
    except OSError:
        pass
    raise UntrustedDaemon(
        f"socket directory {directory} belongs to uid {st.st_uid}, which is not root, this "
        f"process's uid or {DAEMON_UID_ENV}, and its parent {parent} may be written by others "
        "(anyone could have created it first): hiqcached is not trusted with this process's "
        f"memory; if that is your hiqcached, set {DAEMON_UID_ENV} to its uid")


def _check_socket_owner(path: str, trusted: list[int]) -> None:
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return  # nothing there: connecting fails on its own
    if owner not in trusted:
        raise UntrustedDaemon(
            f"socket {path} belongs to uid {owner}, which is not a trusted hiqcached (root, "
            f"this process's uid, {DAEMON_UID_ENV} or the owner of its directory)")


def _check_peer_uid(sock: socket.socket, trusted: list[int], path: str) -> None:
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", cred)
    if (uid & 0xFFFFFFFF) not in trusted:
        raise UntrustedDaemon(
            f"hiqcached session {path}: the listener runs as uid {uid & 0xFFFFFFFF} (pid {pid}), "
            f"which is not a trusted hiqcached (root, this process's uid, {DAEMON_UID_ENV} or the "
            "owner of the socket's directory)")


def session_path_for_target(target: str) -> str:
    """The session socket of a gRPC target "unix:PATH", "unix://PATH" or "unix:///abs/path";
    "" for any other target (TCP has no session: its callers are anonymous). The same rule as
    SessionSocketPathForTarget in session_protocol.h."""
    if target.startswith("unix://"):
        path = target[len("unix://"):]
    elif target.startswith("unix:"):
        path = target[len("unix:"):]
    else:
        return ""
    return path + SOCKET_SUFFIX if path else ""


@dataclass(frozen=True)
class Greeting:
    """The daemon's first packet: the session's token and the kernel's view of this process."""

    token: str
    pid: int
    uid: int
    gid: int

    @classmethod
    def parse(cls, packet: bytes) -> Greeting:
        """SessionError when the packet is not a version-1 greeting."""
        try:
            text = packet.decode("ascii")
        except UnicodeDecodeError:
            text = ""
        m = _GREETING.match(text[len(GREETING_PREFIX):]) if text.startswith(GREETING_PREFIX) \
            else None
        if m is None:
            raise SessionError(f"not a hiqcached session greeting: {packet[:80]!r}")
        return cls(token=m.group(1), pid=int(m.group(2)), uid=int(m.group(3)),
                   gid=int(m.group(4)))


_HANGUP = select.POLLHUP | select.POLLRDHUP | select.POLLERR


class _Watch:
    """One session's entry in the watcher: the socket's fd while the session holds it open."""

    __slots__ = ("fd", "session", "cancelled")

    def __init__(self, fd: int, session: Session):
        self.fd = fd
        self.session = weakref.ref(session)  # a dropped Session closes itself (__del__)
        self.cancelled = False


class _Watcher:
    """The process's session watcher (see the module docstring).

    A session unwatches itself before it closes its fd, and the watcher acts on an event only
    for an entry still watched, so a number reused by another fd never counts as a hang-up.
    Thread-safety: every method may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}  # by fd
        self._timers: list[tuple[float, int, Callable[[], None]]] = []  # heap by due time
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1

    def watch(self, session: Session, fd: int) -> _Watch:
        w = _Watch(fd, session)
        with self._lock:
            self._watches[fd] = w
            self._start_locked()
        self._wake()
        return w

    def unwatch(self, w: _Watch | None) -> None:
        """Stops watching; once this returns the watcher no longer acts on w's fd."""
        if w is None:
            return
        with self._lock:
            w.cancelled = True
            if self._watches.get(w.fd) is w:
                del self._watches[w.fd]
        self._wake()

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._timers, (time.monotonic() + delay, next(self._order), fn))
            self._start_locked()
        self._wake()

    def _start_locked(self) -> None:
        # REQUIRES: _lock held.
        if self._thread is not None:
            return
        r, w = os.pipe()  # non-inheritable (PEP 446)
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._wake_r, self._wake_w = r, w
        self._thread = threading.Thread(target=self._run, args=(r,),
                                        name="hiqcache-session-watcher", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        fd = self._wake_w
        if fd >= 0:
            try:
                os.write(fd, b"x")
            except OSError:
                pass  # full (a wake-up is pending anyway) or gone with a fork

    def _run(self, wake_r: int) -> None:
        while True:
            with self._lock:
                watched = dict(self._watches)
                timeout_ms = None
                if self._timers:
                    left = self._timers[0][0] - time.monotonic()
                    timeout_ms = max(0, int(left * 1000) + 1)
            poller = select.poll()
            poller.register(wake_r, select.POLLIN)
            for fd in watched:
                poller.register(fd, select.POLLRDHUP)  # POLLHUP and POLLERR always count
            try:
                events = poller.poll(timeout_ms)
            except InterruptedError:
                continue
            ended: list[Session] = []
            due: list[Callable[[], None]] = []
            with self._lock:
                for fd, ev in events:
                    if fd == wake_r:
                        try:
                            while os.read(wake_r, 512):
                                pass
                        except OSError:
                            pass
                        continue
                    w = watched.get(fd)
                    if w is None or w.cancelled or self._watches.get(fd) is not w:
                        continue  # unwatched meanwhile: the fd may be another file by now
                    if ev & select.POLLNVAL:
                        del self._watches[fd]  # closed without unwatching: not a hang-up
                    elif ev & _HANGUP:
                        del self._watches[fd]
                        sess = w.session()
                        if sess is not None:
                            ended.append(sess)
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    due.append(heapq.heappop(self._timers)[2])
            for sess in ended:
                sess._daemon_ended()
            for fn in due:
                _run_callback(fn)

    def _after_fork_in_child(self) -> None:
        # The thread does not exist in the child; the inherited pipe and entries are the
        # parent's.
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._lock = threading.Lock()
        self._watches = {}
        self._timers = []
        self._thread = None
        self._wake_r = self._wake_w = -1


def _run_callback(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # a callback's failure must not stop the watcher
        log.exception("hiqcache: session watcher callback failed")


_watcher = _Watcher()


def call_later(delay: float, fn: Callable[[], None]) -> None:
    """Runs fn() on the session watcher thread about `delay` seconds from now (not in a child
    forked before then). fn must be short and must not raise; an exception is logged."""
    _watcher.call_later(delay, fn)


# Sessions open in this process, so that a forked child drops its copies (see the module doc).
_open_sessions: weakref.WeakSet[Session] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    _watcher._after_fork_in_child()
    for s in list(_open_sessions):
        s._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Session:
    """One open session with hiqcached (see the module docstring)."""

    def __init__(self, path: str, *, timeout: float = 2.0):
        """Connects to the session socket at `path` and reads the greeting, each within
        `timeout` seconds. SessionError (an OSError) when that fails."""
        if timeout <= 0:
            raise ValueError("timeout: must be > 0")
        self.path = path
        self.timeout = timeout
        self._lock = threading.Lock()
        # Guards the three fields below; never held while taking _lock.
        self._state_lock = threading.Lock()
        self._ended_by_daemon = False
        self._on_end: Callable[[], None] | None = None
        self._end_reported = False
        self._watch: _Watch | None = None  # guarded by _lock
        # Nothing (no fd, no token, not even a connect) goes to a listener this process does
        # not trust: the directory and both socket files first, then the connected peer.
        trusted = trusted_daemon_uids(path)
        if path.endswith(SOCKET_SUFFIX):
            _check_socket_owner(path[:-len(SOCKET_SUFFIX)], trusted)
        _check_socket_owner(path, trusted)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            _check_peer_uid(sock, trusted, path)
            packet = sock.recv(MAX_MESSAGE_BYTES)
            if not packet:
                raise SessionError(f"hiqcached session {path}: closed before its greeting")
            self.greeting = Greeting.parse(packet)
        except TimeoutError as err:
            sock.close()
            raise SessionError(f"hiqcached session {path}: no greeting within {timeout} s") \
                from err
        except SessionError:
            sock.close()
            raise
        except OSError as err:
            sock.close()
            raise SessionError(err.errno, f"hiqcached session {path}: {err.strerror or err}") \
                from err
        self._sock: socket.socket | None = sock
        _open_sessions.add(self)

    @classmethod
    def for_target(cls, target: str, *, timeout: float = 2.0) -> Session | None:
        """A session with the daemon at gRPC target `target`; None for a target that has no
        session socket (not unix). SessionError when a unix target's session cannot be opened."""
        path = session_path_for_target(target)
        return cls(path, timeout=timeout) if path else None

    @property
    def token(self) -> str:
        return self.greeting.token

    @property
    def pid(self) -> int:
        return self.greeting.pid

    @property
    def uid(self) -> int:
        return self.greeting.uid

    @property
    def gid(self) -> int:
        return self.greeting.gid

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata that names this session on a call."""
        return ((METADATA_KEY, self.greeting.token),)

    def send_fds(self, fds: Sequence[int], timeout: float | None = None) -> list[int]:
        """Passes `fds` to the daemon (it gets its own copies; the caller keeps and closes its
        fds) and returns the daemon's id for each, in order. At most MAX_FDS_PER_MESSAGE per
        packet, so several packets for more; `timeout` (default: the session's) bounds each
        answer. SessionError when the daemon refuses ("ERR ..."), answers garbage or does not
        answer; then fds of earlier packets stay held by the daemon until the session ends, and a
        session that did not answer is closed (its packets can no longer be paired)."""
        ids: list[int] = []
        if not fds:
            return ids
        with self._lock:
            sock = self._sock
            if sock is None:
                raise SessionError(f"hiqcached session {self.path}: closed")
            sock.settimeout(timeout if timeout is not None else self.timeout)
            for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
                chunk = [int(fd) for fd in fds[start:start + MAX_FDS_PER_MESSAGE]]
                try:
                    socket.send_fds(sock, [b"FDS"], chunk)
                    answer = sock.recv(MAX_MESSAGE_BYTES)
                except OSError as err:
                    if not isinstance(err, socket.timeout):
                        self._daemon_ended()  # EPIPE, ECONNRESET: the daemon's end is gone
                    self._close_locked()
                    raise SessionError(f"hiqcached session {self.path}: passing fds failed: "
                                       f"{err}") from err
                if not answer:
                    self._daemon_ended()
                    self._close_locked()
                    raise SessionError(f"hiqcached session {self.path}: closed by the daemon")
                text = answer.decode("ascii", "replace")
                if text.startswith("ERR"):
                    raise SessionError(f"hiqcached session {self.path}: daemon refused "
                                       f"{len(chunk)} fds: {text[3:].strip()[:200]}")
                parts = text.split(" ")
                if parts[0] != "OK" or len(parts) != len(chunk) + 1 or \
                        not all(p.isdigit() for p in parts[1:]):
                    self._close_locked()
                    raise SessionError(f"hiqcached session {self.path}: unexpected answer "
                                       f"{text[:80]!r} to {len(chunk)} fds")
                ids.extend(int(p) for p in parts[1:])
        return ids

    def alive(self) -> bool:
        """Whether the daemon still holds the session: false once closed here, or when the
        daemon closed it (it exited or restarted: every pool registered through it is gone;
        ended_by_daemon is then true). Non-blocking."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return False
            try:
                p = select.poll()
                p.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
                events = p.poll(0)
                if not events:
                    return True
                ev = events[0][1]
                if ev & select.POLLNVAL:
                    return False
                if ev & _HANGUP:
                    self._daemon_ended()
                    return False
                # Readable: the daemon sends nothing unasked, so this is the end of the stream.
                data = sock.recv(MAX_MESSAGE_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                if not data:
                    self._daemon_ended()
                return bool(data)
            except BlockingIOError:
                return True
            except OSError:
                self._daemon_ended()
                return False

    @property
    def ended_by_daemon(self) -> bool:
        """Whether the daemon was seen ending the session (hang-up or end of stream) while this
        side held it open; false after close() or fork() alone."""
        with self._state_lock:
            return self._ended_by_daemon

    def on_daemon_end(self, callback: Callable[[], None]) -> None:
        """Has callback() run once, on the session watcher thread, when the daemon ends this
        session while it is open here (the daemon exited, was killed or restarts), as seen by
        the watcher, alive() or send_fds; never for a session closed here first, nor in a forked
        child. At most one callback per session (a later call replaces it). The callback must
        be short and must not raise."""
        with self._state_lock:
            self._on_end = callback
            fire = self._ended_by_daemon and not self._end_reported
            if fire:
                self._end_reported = True
        if fire:
            call_later(0, callback)
            return
        with self._lock:
            if self._sock is not None and self._watch is None:
                self._watch = _watcher.watch(self, self._sock.fileno())

    def _daemon_ended(self) -> None:
        # The daemon closed its end while this side held the socket open.
        with self._state_lock:
            if self._end_reported and self._ended_by_daemon:
                return
            self._ended_by_daemon = True
            cb = self._on_end
            if cb is not None:
                self._end_reported = True
        if cb is not None:
            call_later(0, cb)

    def close(self) -> None:
        """Closes the session: the daemon releases every pool registered through it and closes
        the fds it still holds. Idempotent."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._sock is not None:
            _watcher.unwatch(self._watch)  # before the fd number can be reused
            self._watch = None
            try:
                self._sock.close()
            finally:
                self._sock = None
                _open_sessions.discard(self)

    def _forget_after_fork(self) -> None:
        # In a forked child: drop the inherited fd without shutting the connection down (the
        # parent still uses it), and the callback (the daemon serves the parent's session). The
        # locks may have been held by a thread of the parent.
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._on_end = None
        self._end_reported = True
        self._watch = None  # the child's watcher starts empty
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def fileno(self) -> int:
        """The socket's fd, -1 once closed (for poll loops and tests)."""
        sock = self._sock
        return sock.fileno() if sock is not None else -1

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            _watcher.unwatch(getattr(self, "_watch", None))
            try:
                sock.close()
            except OSError:
                pass

    def __repr__(self) -> str:
        g = self.greeting
        return (f"Session({self.path!r}, pid={g.pid}, uid={g.uid}, gid={g.gid}, "
                f"{'open' if self._sock is not None else 'closed'})")
