"""hiqcache.Client: what a Python inference engine uses to talk to hiqcached (docs/design.md).

The semantics are the C++ client's (client/include/hiqcache/client.h):

- Fail-open: hiqcached is a cache, and its absence must never stop inference. Every call has a
  deadline. When the daemon is unreachable or answers with an error, lookup reports 0 prefix
  blocks, backup reports every block NOT_STORED and restore 0 restored blocks, each with the
  Status set so the caller can log it; these calls never raise. register_pool, evict and
  get_stats raise HiqError, since their callers need the daemon's answer.
- Sessions (hiqcache.session): for a unix target the client opens the daemon's session socket
  on first use. The kernel's credentials of that connection identify this process to the
  daemon; every call carries the session's token as metadata, pools registered through it are
  this process's own (other callers get NOT_FOUND), and closing it (close(), or the process
  dying) releases them. HOST buffers and event slots reach the daemon as file descriptors over
  the session: a memfd's own fd (SharedBuffer.host_fd), or an fd the client opens by name
  (/dev/shm/NAME, read-write, with this process's rights) and closes after the call; the
  request then names them by host_fd_id, never by name. Without a session (a TCP target, or a
  daemon with no session socket) calls go out anonymous and buffers by name, as before.
- Re-registration: the client keeps every registration's request. A PoolHandle is the client's
  own id and stays valid across daemon restarts: when the session ends (without a session: when
  the connection breaks), or a call answers UNAVAILABLE or NOT_FOUND (the daemon restarted and
  forgot its ids), the client opens a new session, registers the pool again (at most once per
  reregister_interval per pool) and retries the call once. The slots keep their values: a new
  registration's tickets start above the largest ticket in them.
- Ticket slots (docs/design.md "A dead daemon releases the engine"): the client maps the event slots
  of each pool it registers through a session (HostEventPool, torch_kv.CudaTicketSlots: any
  EventPoolSpec naming a memfd or shm object), notes the slots its requests name for the daemon
  to store into (done_event, layer_event_base + l) before it sends them, and keeps the highest
  ticket the daemon answered for the pool in that session. When the daemon ends the session
  without the client having closed it, the client stores H | EVENT_FAILED_BIT in each of those
  slots whose ticket part is below H (HostEventPool.release), before it opens another session,
  and once more a second later: every waiter of the dead daemon is released and sees the failed
  bit. Slots the engine stores into (wait_event) are left alone: a failed value there would
  satisfy a later wait_value before the engine stores it (the daemon compares the ticket part),
  so a restarted daemon could touch rows before they are ready. A client that closes its session
  (close()) or releases a pool writes nothing into its slots.

Thread-safety: one Client may be shared by any number of threads.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar, cast

import grpc

from hiqcache.host import SHM_DIR, SLOT_BYTES, HostEventPool, HostShm, normalize_name
from hiqcache.keys import BlockKey
from hiqcache.session import (
    Session,
    SessionError,
    UntrustedDaemon,
    call_later,
    session_path_for_target,
)
from hiqcache.spec import (
    CODEC_FROM_PB,
    DEVICE_FROM_PB,
    Codec,
    DeviceKind,
    EventPoolSpec,
    NamespaceRef,
    PoolSpec,
    RegisteredPool,
    SharedBuffer,
)
from hiqcache.status import HiqError, Status, StatusCode
from hiqcache.v1 import cache_pb2 as pb
from hiqcache.v1 import cache_pb2_grpc as pb_grpc

log = logging.getLogger("hiqcache")
T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...] | None


class _CacheStub(Protocol):
    """pb_grpc.CacheStub, typed: the generated module has no .pyi."""

    RegisterPool: grpc.UnaryUnaryMultiCallable[pb.RegisterPoolRequest, pb.RegisterPoolResponse]
    ReleasePool: grpc.UnaryUnaryMultiCallable[pb.ReleasePoolRequest, pb.ReleasePoolResponse]
    Lookup: grpc.UnaryUnaryMultiCallable[pb.LookupRequest, pb.LookupResponse]
    Backup: grpc.UnaryUnaryMultiCallable[pb.BackupRequest, pb.BackupResponse]
    Restore: grpc.UnaryUnaryMultiCallable[pb.RestoreRequest, pb.RestoreResponse]
    Evict: grpc.UnaryUnaryMultiCallable[pb.EvictRequest, pb.EvictResponse]
    GetStats: grpc.UnaryUnaryMultiCallable[pb.GetStatsRequest, pb.GetStatsResponse]
    Drain: grpc.UnaryUnaryMultiCallable[pb.DrainRequest, pb.DrainResponse]


class _Ticketed(Protocol):
    """The answer of a request that names slots (Backup, Restore)."""

    @property
    def ticket(self) -> int: ...

# After the first release of a dead daemon's slots, the second one: a store of the daemon's device
# still in flight when it died may land after the first.
SECOND_RELEASE_DELAY_S = 1.0


def _tls_credentials(ca: str | None, cert: str | None, key: str | None
                     ) -> grpc.ChannelCredentials | None:
    """TLS credentials for a TCP target (see Client), or None for a plain channel."""
    def read(path: str | None, env: str) -> bytes | None:
        path = path or os.environ.get(env) or None
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()
    roots = read(ca, "HIQ_TLS_CA_FILE")
    if roots is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=roots,
                                        private_key=read(key, "HIQ_TLS_KEY_FILE"),
                                        certificate_chain=read(cert, "HIQ_TLS_CERT_FILE"))


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/hiqcache/hiqcached.sock, else /tmp/hiqcache-$UID/hiqcached.sock."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return xdg + "/hiqcache/hiqcached.sock"
    return f"/tmp/hiqcache-{os.getuid()}/hiqcached.sock"


def normalize_target(target: str | None) -> str:
    """The gRPC target for "unix:///path", an absolute socket path, or host:port."""
    if not target:
        return "unix://" + default_socket_path()
    if target.startswith("/"):
        return "unix://" + target
    for scheme in ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            if len(target) == len(scheme):
                raise ValueError(f'target "{target}" has no address')
            return target
    colon = target.rfind(":")
    if colon <= 0 or colon + 1 == len(target):
        raise ValueError(f'target "{target}": expected unix:///path/to.sock, /path/to.sock '
                         "or host:port")
    return target


class BlockStatus(enum.IntEnum):
    STORED = 0  # the daemon stored the block
    ALREADY_PRESENT = 1  # the namespace held it already
    REJECTED = 2  # non-finite input, or no room
    NOT_STORED = 3  # client side: the call failed (see BackupResult.status)


@dataclass
class LookupResult:
    prefix_blocks: int = 0  # 0 on any failure
    status: Status = Status.OK


@dataclass
class BackupResult:
    blocks: list[BlockStatus] = field(default_factory=list)  # one per key
    ticket: int = 0
    status: Status = Status.OK

    @property
    def held(self) -> int:
        """Blocks the namespace now holds (stored or already present)."""
        return sum(b in (BlockStatus.STORED, BlockStatus.ALREADY_PRESENT) for b in self.blocks)


@dataclass
class RestoreResult:
    # Leading blocks restored; 0 on failure. After a failed async call the daemon may still write
    # the rows: do not hand them to another request before the call's deadline has passed.
    restored_blocks: int = 0
    ticket: int = 0
    status: Status = Status.OK


@dataclass(frozen=True)
class NamespaceStats:
    namespace_id: str
    model: str
    tenant: str
    codec: Codec | None  # None: a codec this library does not know (a newer daemon's)
    encoded_bytes_per_token: int
    blocks: int
    bytes: int
    hits: int
    misses: int
    backups: int
    restores: int
    evictions: int
    rejected: int
    pools: int
    capacity_blocks: int


@dataclass(frozen=True)
class PoolStats:
    pool_id: int
    namespace_id: str
    model: str
    tenant: str
    device: DeviceKind
    client_pid: int
    backups: int
    restores: int
    peer: str
    uid: int = 0  # the registering process's uid, as the kernel reported it to the daemon
    owned: bool = False  # registered by this process (pool_id is 0 in others' pools)


@dataclass(frozen=True)
class L3Stats:
    """What the daemon's L3 store (Redis Cluster) did since start; enabled is False (and every
    figure 0) when the daemon has none. An L3 error or deadline is a miss, counted in *_errors."""
    enabled: bool = False
    lookup_hits: int = 0  # blocks Lookup found in L3 after the pool's leading run
    lookup_misses: int = 0  # keys Lookup asked L3 for after the run L3 held
    lookup_errors: int = 0
    fetches: int = 0  # restores that fetched from L3
    fetched_blocks: int = 0  # values fetched and verified
    fetch_errors: int = 0
    corrupt_values: int = 0  # fetched values that failed to verify: dropped, a miss
    promoted_blocks: int = 0  # fetched blocks written into the pool
    writes: int = 0  # blocks written to L3
    write_errors: int = 0
    dropped_writes: int = 0  # not queued: the write queue was full
    skipped_writes: int = 0  # queued, but the block left the pool before its turn
    write_queue_bytes: int = 0
    write_queue_blocks: int = 0
    bytes_in: int = 0  # value bytes fetched
    bytes_out: int = 0  # value bytes written
    fetch_latency_samples: int = 0  # the last fetches (at most 1024) the percentiles cover
    fetch_p50_us: int = 0
    fetch_p99_us: int = 0
    write_policy: str = ""  # "write_through" or "on_evict"
    spilled_blocks: int = 0  # on_evict: evicted blocks copied into the write queue
    budget_bytes: int = 0  # l3_budget_bytes; 0 = none
    budget_used_bytes: int = 0  # value bytes this daemon's ledger counts in L3 now
    budget_deletes: int = 0  # blocks deleted from L3 to stay within the budget


@dataclass(frozen=True)
class DaemonStats:
    pool_bytes: int
    used_bytes: int
    capacity_bytes: int
    blocks: int
    clients: int
    uptime_seconds: int
    device: str
    shm_name: str
    namespaces: list[NamespaceStats]
    pools: list[PoolStats]
    namespaces_total: int = 0  # namespaces the daemon has (`namespaces` is one page of them)
    caller_uid: int = 0  # this process as the daemon identified it (0 without a session)
    caller_admin: bool = False
    l3: L3Stats = field(default_factory=L3Stats)


def _status_of(err: grpc.RpcError, target: str) -> Status:
    code = err.code() if hasattr(err, "code") else StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code in (StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED):
        details = f"hiqcached at {target}: {details}"
    return Status(code, details or code.name)


def _is_stale(s: Status) -> bool:
    """Errors after which a pool id may no longer name our registration: the daemon is gone or
    restarted (UNAVAILABLE), does not know the id (NOT_FOUND), or does not know the session the
    call named (UNAUTHENTICATED: it restarted between the session check and the call)."""
    return s.code in (StatusCode.UNAVAILABLE, StatusCode.NOT_FOUND, StatusCode.UNAUTHENTICATED)


def _is_unreachable(s: Status) -> bool:
    return s.code in (StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED)


class _Pool:
    def __init__(self, handle: int, spec: PoolSpec):
        self.handle = handle
        self.spec = spec
        self.request = spec.to_proto(client_pid=os.getpid())
        self.lock = threading.Lock()  # serializes (re)registration; guards the fields below
        self.server_id = 0  # 0 = not registered
        self.epoch = 0
        self.session_gen = 0  # the session it was registered through; 0 = none (anonymous)
        self.info: RegisteredPool | None = None
        self.registered_once = False
        self.attempted = False
        self.last_attempt = 0.0
        self.last_error = Status.OK
        # Guarded by the client's _slots_lock: this client's own mapping of the pool's event
        # slots (None: it has none, or they could not be mapped), the slots requests named for
        # the daemon to store into and, per session generation, the highest ticket the daemon of
        # that session answered for the pool.
        self.slots: HostEventPool | None = None
        self.daemon_slots: set[int] = set()
        self.tickets: dict[int, int] = {}


def _weak_call(obj: Any, method: str, *args: Any) -> Callable[[], Any]:
    """A callable that runs obj.method(*args) while obj is alive (for callbacks held by the
    session watcher, which must not keep a client alive)."""
    ref = weakref.ref(obj)

    def call() -> Any:
        target = ref()
        return getattr(target, method)(*args) if target is not None else None

    return call


def _check_keys(keys: Sequence[BlockKey]) -> Status:
    for i, k in enumerate(keys):
        if len(k) != 16:
            return Status(StatusCode.INVALID_ARGUMENT, f"keys[{i}]: {len(k)} bytes, must be 16")
    return Status.OK


class Client:
    """A fail-open client of one hiqcached (see the module docstring).

    Each client has its own connection (no subchannel shared with other channels in the
    process): a channel backing off after the daemon was unreachable must not fail another
    client's calls once the daemon is back."""

    def __init__(self, target: str | None = None, *, call_timeout: float = 2.0,
                 register_timeout: float = 10.0, reregister_interval: float = 0.5,
                 tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None):
        """Does not wait for the daemon: a daemon that is down makes calls miss.
        ValueError for a malformed target. Timeouts in seconds. A TCP target is reached over
        TLS when tls_ca_file (default: $HIQ_TLS_CA_FILE) names the PEM roots to verify the
        daemon with; tls_cert_file and tls_key_file (default: $HIQ_TLS_CERT_FILE,
        $HIQ_TLS_KEY_FILE) are this client's certificate for a daemon that requires one.
        Without roots a TCP target is plain, which a daemon serves on loopback only. A named
        file that cannot be read is logged and gives a client whose every call fails
        (UNAVAILABLE: a miss), never a plain channel; nothing is raised."""
        if call_timeout <= 0 or register_timeout <= 0:
            raise ValueError("call_timeout and register_timeout must be > 0")
        self.target = normalize_target(target)
        self.call_timeout = call_timeout
        self.register_timeout = register_timeout
        self.reregister_interval = reregister_interval
        options = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            # Each connection attempt's timeout (gRPC takes it from this): 20 s, gRPC's own
            # default, so that a daemon on a loaded machine has time to answer the handshake.
            ("grpc.min_reconnect_backoff_ms", 20000),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.use_local_subchannel_pool", 1),  # see the class docstring
        ]
        credentials, channel_target = None, self.target
        if not self.target.startswith("unix"):
            try:
                credentials = _tls_credentials(tls_ca_file, tls_cert_file, tls_key_file)
            except OSError as err:
                log.error("hiqcache client: cannot read a TLS file (%s); no call goes to %s",
                          err, self.target)
                channel_target = "unix:///nonexistent/hiqcache-tls-file-unreadable"
        self._channel = (grpc.secure_channel(channel_target, credentials, options=options)
                         if credentials is not None
                         else grpc.insecure_channel(channel_target, options=options))
        self._stub: _CacheStub = pb_grpc.CacheStub(self._channel)
        self._lock = threading.Lock()
        self._pools: dict[int, _Pool] = {}
        self._next_handle = 1
        # Counts breaks of the connection: each time the channel leaves READY the daemon may
        # have restarted, and every pool id it handed out may now name someone else's pool.
        # Only for pools registered without a session: a session's end says it exactly.
        self._epoch = 0
        self._state: grpc.ChannelConnectivity | None = None
        # The session ("" path: the target has none). _session_gen counts sessions opened;
        # a pool registered through session n is gone once session n is.
        self._session_path = session_path_for_target(self.target)
        self._session_lock = threading.Lock()  # guards the five fields below
        self._session: Session | None = None
        self._session_gen = 0
        self._session_retry_at = 0.0
        self._session_error = ""
        # Set while the listener at the target is not one this process trusts (UntrustedDaemon):
        # no call goes to it, anonymous ones included, and every lookup is a miss.
        self._untrusted: Status | None = None
        self._closed = False
        # Releasing the slots of pools whose session the daemon ended: _release_lock serialises
        # the first passes and guards _released (generations already released once);
        # _slots_lock guards every pool's slots and tickets.
        self._release_lock = threading.Lock()
        self._released: set[int] = set()
        self._slots_lock = threading.Lock()
        # No connection before the first call: a call opens the session first, so the daemon
        # serves this process's connection on its full server, not the sessionless one.
        self._channel.subscribe(self._on_state, try_to_connect=False)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        if self._state == grpc.ChannelConnectivity.READY and state != self._state:
            self._epoch += 1
            log.debug("hiqcache client: connection to %s broke", self.target)
        self._state = state

    # --- session -----------------------------------------------------------------------------

    def _session_now(self, deadline: float, force: bool = False) -> tuple[Session | None, int]:
        """The open session and its generation, opening one if there is none (or the daemon
        closed the last one); (None, gen) without a session: a target without one, a daemon
        without a session socket or down (after a failed open the next waits
        reregister_interval, unless `force`). Blocks at most min(call_timeout, 2 s)."""
        if not self._session_path or self._closed:
            return None, 0
        with self._session_lock:
            sess = self._session
            if sess is not None:
                if sess.alive():
                    return sess, self._session_gen
                sess.close()
                self._session = None
                log.info("hiqcache client: session with %s ended (daemon restarted?); its pools "
                         "are gone", self.target)
                if sess.ended_by_daemon:
                    # Before a new session can re-register the pools: their tickets then start
                    # above the released slots.
                    self._session_ended(self._session_gen)
            now = time.monotonic()
            if (now < self._session_retry_at and not force) or deadline <= now:
                return None, self._session_gen
            try:
                sess = Session(self._session_path,
                               timeout=max(1e-3, min(deadline - now, self.call_timeout, 2.0)))
            except UntrustedDaemon as err:
                self._session_retry_at = now + self.reregister_interval
                if self._untrusted is None:
                    log.error("hiqcache client: %s; no call goes to %s (every lookup is a miss)",
                              err.strerror, self.target)
                self._untrusted = Status(StatusCode.PERMISSION_DENIED, str(err.strerror))
                return None, self._session_gen
            except (SessionError, OSError) as err:
                self._session_retry_at = now + self.reregister_interval
                if str(err) != self._session_error:
                    log.info("hiqcache client: no session with %s (%s); calls go anonymous, "
                             "buffers by name", self.target, err)
                self._session_error = str(err)
                return None, self._session_gen
            self._session = sess
            self._session_gen += 1
            self._session_error = ""
            self._untrusted = None
            sess.on_daemon_end(_weak_call(self, "_session_ended", self._session_gen))
            log.debug("hiqcache client: %r", sess)
            return sess, self._session_gen

    @property
    def passes_fds(self) -> bool:
        """Whether this target has a session socket, over which memfds and fds are passed (a
        unix socket target; TCP targets have none)."""
        return bool(self._session_path)

    def session(self) -> Session | None:
        """The session with the daemon, opened now if needed; None when there is none (see
        the module docstring). The caller must not close it (close() does)."""
        return self._session_now(time.monotonic() + self.call_timeout)[0]

    # --- plumbing ----------------------------------------------------------------------------

    def _call(self, method: Callable[..., T], request: Any, deadline: float,
              metadata: Metadata = None) -> tuple[T | None, Status]:
        if self._untrusted is not None:
            return None, self._untrusted
        left = deadline - time.monotonic()
        if left <= 0:
            return None, Status(StatusCode.DEADLINE_EXCEEDED,
                                f"hiqcached at {self.target}: call deadline passed")
        try:
            return method(request, timeout=left, metadata=metadata), Status.OK
        except grpc.RpcError as err:
            return None, _status_of(err, self.target)
        except ValueError as err:  # e.g. the channel was closed
            return None, Status(StatusCode.UNAVAILABLE, f"hiqcached at {self.target}: {err}")

    def _call_anywhere(self, method: Callable[..., T], request: Any) -> tuple[T | None, Status]:
        """A call that names no pool, in this process's session when there is one."""
        deadline = time.monotonic() + self.call_timeout
        sess, _ = self._session_now(deadline)
        return self._call(method, request, deadline, sess.metadata() if sess else None)

    def _with_fds(self, pool: _Pool, sess: Session | None, deadline: float
                  ) -> tuple[pb.RegisterPoolRequest | None, list[int], Status]:
        """The pool's RegisterPoolRequest with its host memory objects (HOST buffers; event
        slots of every device kind) passed over `sess` and named by fd id, and the fds opened
        here (the caller closes them after the call). Without a session, the request as it is
        (names)."""
        spec = pool.spec
        if sess is None and self._untrusted is not None:
            return None, [], self._untrusted
        if sess is None:
            # A unix target whose session cannot be opened now is a daemon that is down (or
            # restarting): UNAVAILABLE, so that a pending pool registers once it is back.
            code = StatusCode.UNAVAILABLE if self._session_path else StatusCode.FAILED_PRECONDITION
            for i, b in enumerate(spec.buffers):
                if not b.cuda_ipc_handle and b.host_fd >= 0 and not b.host_shm_name:
                    return None, [], Status(code, (
                        f"buffers[{i}]: passed by fd, which needs a session with hiqcached "
                        f"(unix target); {self.target} has none"
                        + (f" ({self._session_error})" if self._session_error else "")))
            if spec.events.host_fd >= 0 and not spec.events.host_shm_name:
                return None, [], Status(code, (
                    f"events: passed by fd, which needs a session with hiqcached; "
                    f"{self.target} has none"))
            return pool.request, [], Status.OK
        opened: list[int] = []
        fds: list[int] = []
        where: list[int] = []  # buffer index per fd; -1 = the events

        def fd_of(obj: SharedBuffer | EventPoolSpec) -> int:
            if obj.host_fd >= 0:
                return obj.host_fd
            # With this process's own rights: the daemon then needs none of its own. An object
            # that cannot be opened (as shm_open would: no inner "/", no symlink) goes by name,
            # and the daemon's answer names the field.
            name = normalize_name(obj.host_shm_name)
            if "/" in name[1:] or "\0" in name:
                return -1
            try:
                fd = os.open(SHM_DIR + name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                return -1
            opened.append(fd)
            return fd

        for i, b in enumerate(spec.buffers):
            if b.cuda_ipc_handle or (b.host_fd < 0 and not b.host_shm_name):
                continue
            fd = fd_of(b)
            if fd >= 0:
                fds.append(fd)
                where.append(i)
        ev = spec.events
        if ev.count > 0 and (ev.host_fd >= 0 or ev.host_shm_name):
            fd = fd_of(ev)
            if fd >= 0:
                fds.append(fd)
                where.append(-1)
        if not fds:
            return pool.request, opened, Status.OK
        try:
            ids = sess.send_fds(fds, timeout=max(1e-3, min(deadline - time.monotonic(), 2.0)))
        except SessionError as err:
            for fd in opened:
                os.close(fd)
            fd_only = any(not b.cuda_ipc_handle and b.host_fd >= 0 and not b.host_shm_name
                          for b in spec.buffers) or (ev.host_fd >= 0 and not ev.host_shm_name)
            if fd_only:
                return None, [], Status(StatusCode.UNAVAILABLE, str(err))
            log.warning("hiqcache client: cannot pass the fds of pool %d (%s); registering its "
                        "buffers by name", pool.handle, err)
            return pool.request, [], Status.OK
        req = pb.RegisterPoolRequest()
        req.CopyFrom(pool.request)
        for i, fd_id in zip(where, ids):
            if i < 0:
                req.events.host_shm_name = ""
                req.events.host_fd_id = fd_id
            else:
                req.buffers[i].host_fd_id = fd_id  # oneof: clears host_shm_name
        return req, opened, Status.OK

    def _register_locked(self, pool: _Pool, deadline: float) -> Status:
        # REQUIRES: pool.lock held.
        pool.attempted = True
        pool.last_attempt = time.monotonic()
        epoch = self._epoch
        sess, gen = self._session_now(deadline, force=True)
        request, opened, s = self._with_fds(pool, sess, deadline)
        try:
            if s.ok:
                resp, s = self._call(self._stub.RegisterPool, request, deadline,
                                     sess.metadata() if sess else None)
        finally:
            for fd in opened:
                os.close(fd)
        if not s.ok:
            pool.server_id = 0
            pool.last_error = s
            return s
        assert resp is not None
        if pool.registered_once:
            log.info("hiqcache client: pool %d re-registered with %s as pool %d", pool.handle,
                     self.target, resp.pool_id)
        pool.server_id = resp.pool_id
        pool.epoch = epoch
        pool.session_gen = gen if sess is not None else 0
        pool.info = RegisteredPool(
            pool_id=resp.pool_id, namespace_id=resp.namespace_id,
            encoded_bytes_per_token=resp.encoded_bytes_per_token, block_bytes=resp.block_bytes,
            capacity_tokens=resp.capacity_tokens)
        pool.registered_once = True
        pool.last_error = Status.OK
        return Status.OK

    # --- ticket slots of a dead daemon ----------------------------------------------------

    def _map_slots(self, pool: _Pool) -> None:
        """Maps the pool's event slots for _release_slots (see the module docstring)."""
        ev = pool.spec.events
        if ev.count <= 0 or (ev.host_fd < 0 and not ev.host_shm_name):
            return
        min_size = ev.count * SLOT_BYTES
        try:
            shm = (HostShm.from_fd(ev.host_fd, min_size, tag="slots") if ev.host_fd >= 0
                   else HostShm.open(ev.host_shm_name, min_size))
        except (OSError, ValueError) as err:
            log.warning("hiqcache client: cannot map the event slots of pool %d (%s): %s; they "
                        "are not released if the daemon dies", pool.handle,
                        ev.host_shm_name or f"fd {ev.host_fd}", err)
            return
        with self._slots_lock:
            pool.slots = HostEventPool(shm, ev.count)

    def _note_daemon_slots(self, pool: _Pool, done_event: int, layer_event_base: int) -> None:
        """Before a request is sent: the slots it names for the daemon's tickets."""
        with self._slots_lock:
            if pool.slots is None:
                return
            count = pool.slots.count
            if 0 <= done_event < count:
                pool.daemon_slots.add(done_event)
            if layer_event_base >= 0:
                end = min(count, layer_event_base + pool.spec.geometry.num_layers)
                pool.daemon_slots.update(range(layer_event_base, end))

    def _note_ticket(self, pool: _Pool, gen: int, ticket: int) -> None:
        if gen <= 0 or ticket <= 0:
            return
        with self._slots_lock:
            if pool.slots is None:
                return
            if ticket > pool.tickets.get(gen, 0):
                pool.tickets[gen] = ticket
            for old in [g for g in pool.tickets if g < gen - 1]:
                del pool.tickets[old]

    def _session_ended(self, gen: int) -> None:
        """The daemon ended session `gen` (it exited, was killed or restarts) while this client
        held it: releases the slots of the pools registered through it now (once per session,
        whoever notices first: the watcher or a call) and again SECOND_RELEASE_DELAY_S later."""
        with self._release_lock:
            if gen in self._released or self._closed:
                return
            self._released.add(gen)
            for old in [g for g in self._released if g < gen - 8]:
                self._released.discard(old)
            n = self._release_slots(gen)
        if n:
            log.warning("hiqcache client: hiqcached at %s is gone; released %d event slots with "
                        "the failed bit (their work is a miss)", self.target, n)
        call_later(SECOND_RELEASE_DELAY_S, _weak_call(self, "_release_slots", gen))

    def _release_slots(self, gen: int) -> int:
        """Stores H | EVENT_FAILED_BIT in the daemon's slots below H of every pool of this client
        that the daemon of session `gen` answered tickets for, H the highest; how many slots."""
        with self._lock:
            pools = list(self._pools.values())
        n = 0
        with self._slots_lock:
            if self._closed:
                return 0
            for pool in pools:
                highest = pool.tickets.get(gen, 0)
                if highest and pool.slots is not None:
                    n += pool.slots.release(highest, pool.daemon_slots)
        return n

    def _unmap_slots(self, pool: _Pool) -> None:
        with self._slots_lock:
            slots, pool.slots = pool.slots, None
            pool.tickets.clear()
            pool.daemon_slots.clear()
        if slots is not None:
            slots.close()

    def _valid_locked(self, pool: _Pool) -> bool:
        # REQUIRES: pool.lock held. Whether pool.server_id still names this registration.
        if pool.session_gen:
            return pool.session_gen == self._session_gen and self._session is not None
        return pool.epoch == self._epoch

    def _ensure_registered(self, pool: _Pool, deadline: float) -> tuple[int, Status]:
        with pool.lock:
            if pool.server_id != 0:
                if self._valid_locked(pool):
                    return pool.server_id, Status.OK
                pool.server_id = 0  # its session ended or the connection broke: gone or stale
            now = time.monotonic()
            if pool.attempted and now - pool.last_attempt < self.reregister_interval:
                return 0, Status(StatusCode.UNAVAILABLE,
                                 f"pool not registered with hiqcached at {self.target} (next "
                                 f"attempt rate-limited); last error: {pool.last_error}")
            s = self._register_locked(pool, deadline)
            return (pool.server_id, s) if s.ok else (0, s)

    def _invalidate(self, pool: _Pool, stale_id: int, why: Status) -> None:
        with pool.lock:
            if pool.server_id != stale_id:
                return
            if why.code == StatusCode.UNAVAILABLE and pool.session_gen and \
                    self._valid_locked(pool) and self._session is not None and \
                    self._session.alive():
                # The same daemon still holds the session, so the id is still ours (a
                # reconnect, or a draining daemon): keep it.
                return
            log.warning("hiqcache client: pool %d (daemon pool %d) lost: %s; will re-register",
                        pool.handle, stale_id, why)
            pool.server_id = 0
            pool.last_error = why

    def _with_pool(self, handle: int,
                   rpc: Callable[[int, float, Metadata], tuple[T | None, Status]],
                   slots: tuple[int, int] | None = None) -> tuple[T | None, Status]:
        """rpc's answer for the pool, re-registering it once when its id is stale. `slots`:
        the request's (done_event, layer_event_base), and its answer carries `ticket`; the
        client keeps both for _release_slots."""
        with self._lock:
            pool = self._pools.get(handle)
        if pool is None:
            return None, Status(StatusCode.INVALID_ARGUMENT, f"unknown pool handle {handle}")
        ticketed = slots is not None
        if slots is not None:
            self._note_daemon_slots(pool, *slots)
        deadline = time.monotonic() + self.call_timeout
        resp: T | None = None
        s = Status.OK
        for _ in range(2):
            sess, gen = self._session_now(deadline)  # notices an ended session before the call
            server_id, s = self._ensure_registered(pool, deadline)
            if not s.ok:
                return None, s
            resp, s = rpc(server_id, deadline, sess.metadata() if sess else None)
            if ticketed and s.ok and sess is not None:
                self._note_ticket(pool, gen, cast(_Ticketed, resp).ticket)
            if s.ok or not _is_stale(s):
                return resp, s
            self._invalidate(pool, server_id, s)
        return resp, s

    def _block_tokens(self, handle: int) -> int:
        with self._lock:
            pool = self._pools.get(handle)
        return pool.spec.block_tokens if pool else 0

    # --- pools -------------------------------------------------------------------------------

    def register_pool(self, spec: PoolSpec, *, pending_if_unavailable: bool = False) -> int:
        """Registers an engine's KV pool; returns the client's handle (never 0).

        Raises HiqError with the daemon's status (INVALID_ARGUMENT naming the field, ...). When
        the daemon is unreachable and pending_if_unavailable is true, the spec is kept and a
        handle returned anyway: the pool registers on first use once the daemon is back."""
        if spec.block_tokens <= 0:
            raise HiqError(Status(StatusCode.INVALID_ARGUMENT, "block_tokens: must be > 0"))
        with self._lock:
            handle = self._next_handle
            self._next_handle += 1
        pool = _Pool(handle, spec)
        if self._session_path:
            self._map_slots(pool)
        with pool.lock:
            s = self._register_locked(pool, time.monotonic() + self.register_timeout)
        if not s.ok and not (pending_if_unavailable and _is_unreachable(s)):
            self._unmap_slots(pool)
            raise HiqError(s)
        if not s.ok:
            log.warning("hiqcache client: %s; pool kept pending, registers once the daemon is "
                        "back", s)
        with self._lock:
            self._pools[handle] = pool
        return handle

    def pool_info(self, handle: int) -> RegisteredPool | None:
        """The daemon's answer to the pool's current registration; None while unregistered."""
        with self._lock:
            pool = self._pools.get(handle)
        if pool is None:
            return None
        with pool.lock:
            return pool.info if pool.server_id != 0 else None

    def release_pool(self, handle: int) -> Status:
        """Releases the registration on the daemon (best effort) and forgets the handle."""
        with self._lock:
            pool = self._pools.pop(handle, None)
        if pool is None:
            return Status(StatusCode.INVALID_ARGUMENT, f"unknown pool handle {handle}")
        self._unmap_slots(pool)  # the engine may reuse or free its slots once this returns
        deadline = time.monotonic() + self.call_timeout
        sess, _ = self._session_now(deadline)
        with pool.lock:
            server_id = pool.server_id if self._valid_locked(pool) else 0
        if server_id == 0:
            return Status.OK  # never registered, or gone with its session
        _, s = self._call(self._stub.ReleasePool, pb.ReleasePoolRequest(pool_id=server_id),
                          deadline, sess.metadata() if sess else None)
        return s

    # --- data calls (fail-open) --------------------------------------------------------------

    def lookup(self, handle: int, keys: Sequence[BlockKey]) -> LookupResult:
        """Length of the longest leading run of `keys` the pool's namespace holds."""
        s = _check_keys(keys)
        if not s.ok or not keys:
            return LookupResult(0, s)
        resp, s = self._with_pool(handle, lambda pid, dl, md: self._call(
            self._stub.Lookup, pb.LookupRequest(pool_id=pid, keys=list(keys)), dl, md))
        return LookupResult(resp.prefix_blocks if resp is not None and s.ok else 0, s)

    def lookup_group(self, namespaces: Sequence[NamespaceRef],
                     keys: Sequence[BlockKey]) -> LookupResult:
        """Longest leading run of `keys` held in every one of `namespaces` (e.g. one per TP
        rank of an engine): for callers that hold no pool, such as an engine's scheduler."""
        s = _check_keys(keys)
        if s.ok and not namespaces:
            s = Status(StatusCode.INVALID_ARGUMENT, "namespaces: empty")
        if not s.ok or not keys:
            return LookupResult(0, s)
        req = pb.LookupRequest(keys=list(keys), namespaces=[n.to_proto() for n in namespaces])
        resp, s = self._call_anywhere(self._stub.Lookup, req)
        return LookupResult(resp.prefix_blocks if resp is not None and s.ok else 0, s)

    def _fill_blocks(self, req: pb.BackupRequest | pb.RestoreRequest, handle: int,
                     keys: Sequence[BlockKey], rows: Sequence[int]) -> Status:
        """Adds the blocks to req (in place: building them as messages and copying them in cost
        twice as much per call). Rows are ints or have __index__ (numpy, torch scalars).
        INVALID_ARGUMENT, with req left without blocks, for a key that is not 16 bytes or a row
        a uint32 cannot hold."""
        s = _check_keys(keys)
        if not s.ok:
            return s
        bt = self._block_tokens(handle)
        if bt == 0:
            return Status(StatusCode.INVALID_ARGUMENT, f"unknown pool handle {handle}")
        if len(rows) != len(keys) * bt:
            return Status(StatusCode.INVALID_ARGUMENT,
                          f"rows: {len(rows)} entries, need {len(keys)} keys x {bt}")
        i = 0
        try:
            if not isinstance(rows, list):
                rows = list(rows)  # slices of a list; its items are checked by the field
            for i, k in enumerate(keys):
                req.blocks.add(key=k).rows.extend(rows[i * bt:(i + 1) * bt])
        except (TypeError, ValueError) as err:
            del req.blocks[:]
            return Status(StatusCode.INVALID_ARGUMENT,
                          f"blocks[{i}]: {err} (a key is 16 bytes, a row a uint32 slot)")
        return Status.OK

    def backup(self, handle: int, keys: Sequence[BlockKey], rows: Sequence[int], *,
               wait_event: int = -1, wait_value: int = 0, done_event: int = -1,
               sync: bool = True) -> BackupResult:
        """Stores len(keys) blocks; block i is made of rows[i*block_tokens:(i+1)*block_tokens].
        With sync=False the results are provisional (see the proto)."""
        req = pb.BackupRequest(wait_event=wait_event, wait_value=wait_value,
                               done_event=done_event, sync=sync)
        s = self._fill_blocks(req, handle, keys, rows)
        if not s.ok:
            return BackupResult([BlockStatus.NOT_STORED] * len(keys), 0, s)

        def call(pid: int, dl: float, md: Metadata) -> tuple[pb.BackupResponse | None, Status]:
            req.pool_id = pid
            return self._call(self._stub.Backup, req, dl, md)

        resp, s = self._with_pool(handle, call, slots=(done_event, -1))
        if resp is None or not s.ok or len(resp.results) != len(keys):
            if s.ok:
                s = Status(StatusCode.INTERNAL, "backup answered a wrong number of results")
            return BackupResult([BlockStatus.NOT_STORED] * len(keys), 0, s)
        return BackupResult([BlockStatus(r) for r in resp.results], resp.ticket, s)

    def restore(self, handle: int, keys: Sequence[BlockKey], rows: Sequence[int], *,
                wait_event: int = -1, wait_value: int = 0, layer_event_base: int = -1,
                done_event: int = -1, sync: bool = True) -> RestoreResult:
        """Writes the stored blocks into rows laid out as for backup; stops at the first
        missing key."""
        req = pb.RestoreRequest(wait_event=wait_event, wait_value=wait_value,
                                layer_event_base=layer_event_base, done_event=done_event,
                                sync=sync)
        s = self._fill_blocks(req, handle, keys, rows)
        if not s.ok:
            return RestoreResult(0, 0, s)

        def call(pid: int, dl: float, md: Metadata) -> tuple[pb.RestoreResponse | None, Status]:
            req.pool_id = pid
            return self._call(self._stub.Restore, req, dl, md)

        resp, s = self._with_pool(handle, call, slots=(done_event, layer_event_base))
        if resp is None or not s.ok:
            return RestoreResult(0, 0, s)
        return RestoreResult(min(resp.restored_blocks, len(keys)), resp.ticket, s)

    # --- not fail-open -----------------------------------------------------------------------

    def evict(self, handle: int, keys: Sequence[BlockKey]) -> int:
        """Drops blocks from the pool's namespace; returns how many were present."""
        s = _check_keys(keys)
        if not s.ok:
            raise HiqError(s)
        resp, s = self._with_pool(handle, lambda pid, dl, md: self._call(
            self._stub.Evict, pb.EvictRequest(pool_id=pid, keys=list(keys)), dl, md))
        if resp is None or not s.ok:
            raise HiqError(s)
        return resp.evicted

    def get_stats(self, *, namespaces_offset: int = 0, namespaces_limit: int = 0) -> DaemonStats:
        """The daemon's figures, with one page of its namespaces: at most namespaces_limit
        (0 = the daemon's default, 256) from namespaces_offset on, in namespace_id order.
        Other callers' pools are listed with pool_id 0 (unless this process is an admin)."""
        resp, s = self._call_anywhere(self._stub.GetStats, pb.GetStatsRequest(
            namespaces_offset=namespaces_offset, namespaces_limit=namespaces_limit))
        if resp is None or not s.ok:
            raise HiqError(s)
        return DaemonStats(
            pool_bytes=resp.pool_bytes, used_bytes=resp.used_bytes,
            capacity_bytes=resp.capacity_bytes, blocks=resp.blocks, clients=resp.clients,
            uptime_seconds=resp.uptime_seconds, device=resp.device, shm_name=resp.shm_name,
            namespaces=[NamespaceStats(
                namespace_id=n.namespace_id, model=n.model, tenant=n.tenant,
                codec=CODEC_FROM_PB.get(n.codec),
                encoded_bytes_per_token=n.encoded_bytes_per_token, blocks=n.blocks,
                bytes=n.bytes, hits=n.hits, misses=n.misses, backups=n.backups,
                restores=n.restores, evictions=n.evictions, rejected=n.rejected, pools=n.pools,
                capacity_blocks=n.capacity_blocks) for n in resp.namespaces],
            pools=[PoolStats(
                pool_id=p.pool_id, namespace_id=p.namespace_id, model=p.model, tenant=p.tenant,
                device=DEVICE_FROM_PB.get(p.device, DeviceKind.HOST), client_pid=p.client_pid,
                backups=p.backups, restores=p.restores, peer=p.peer, uid=p.uid,
                owned=p.owned) for p in resp.pools],
            namespaces_total=resp.namespaces_total, caller_uid=resp.caller_uid,
            caller_admin=resp.caller_admin,
            l3=L3Stats(**{f.name: getattr(resp.l3, f.name) for f in fields(L3Stats)})
            if resp.HasField("l3") else L3Stats())

    def close(self) -> None:
        """Closes the channel and the session: the daemon releases the pools registered through
        it (without a session they stay until this process exits, unless released first). The
        engine may free its buffers once this returns only if it released its pools first
        (ReleasePool returns after the pool's work has drained)."""
        if not self._closed:
            with self._slots_lock:
                self._closed = True  # no release of slots from here on
            with self._session_lock:
                if self._session is not None:
                    self._session.close()
                    self._session = None
            with self._lock:
                pools = list(self._pools.values())
            for pool in pools:
                self._unmap_slots(pool)
            self._channel.unsubscribe(self._on_state)
            self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

