"""Sessions against the real hiqcached (hiqcache.session, common/hiqcache/session_protocol.h):
the greeting names this process as the kernel sees it, fds pass over it, HOST pools register by
fd (memfds, and named objects the client opens itself), another process (another user, or the
same user) neither sees a pool's id nor uses it, a process's pools go when its session does
(close, death, daemon restart), a client without a session cannot register a buffer it holds
only as an fd, and a daemon killed while its work is pending releases the engine: the client
stores the failed value into the slots of its pools (and writes nothing after closing its own
session or releasing a pool)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hiqcache as hq
from daemon import Daemon, daemon_path
from hiqcache.session import MAX_FDS_PER_MESSAGE, Session, SessionError, session_path_for_target
from kv_util import HostKv, int8_violations
from margins import margin

G = hq.Geometry(num_layers=3, num_kv_heads=2, head_dim=64)
BT = 16
OTHER_UID = 61001  # no such user needs to exist: the kernel only needs the number
PEER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peer.py")


@pytest.fixture
def shared_daemon():
    """A daemon whose sockets other users may connect to (children drop to OTHER_UID)."""
    with Daemon(open_to_all_users=True) as d:
        yield d


def peer_args(*args: str, uid: int | None = None) -> list[str]:
    return [sys.executable, PEER, *(("--uid", str(uid)) if uid is not None else ()), *args]


def run_peer(*args: str, uid: int | None = None) -> dict:
    out = subprocess.run(peer_args(*args, uid=uid), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_holder(target: str, model: str, uid: int | None = None
                 ) -> tuple[subprocess.Popen, dict]:
    """A child that registers a pool and keeps it until killed; its report."""
    proc = subprocess.Popen(peer_args("hold", target, model, uid=uid), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError("holder died: " + proc.stderr.read()[-3000:])
    return proc, json.loads(line)


def keys_for(n_blocks: int, salt: str = "session") -> list[bytes]:
    return hq.compute_block_keys(range(n_blocks * BT), BT, salt=salt)


def pools_of(stats: hq.DaemonStats, model: str) -> list[hq.PoolStats]:
    return [p for p in stats.pools if p.model == model]


def test_session_paths_follow_the_protocol():
    assert session_path_for_target("unix:///run/h.sock") == "/run/h.sock.session"
    assert session_path_for_target("unix:/run/h.sock") == "/run/h.sock.session"
    assert session_path_for_target("unix://rel.sock") == "rel.sock.session"
    for anonymous in ("127.0.0.1:5000", "dns:localhost:5000", "unix-abstract:x", "unix:",
                      "unix://"):
        assert session_path_for_target(anonymous) == ""
    with hq.Client("127.0.0.1:1", call_timeout=0.2) as c:
        assert c.session() is None


class ScriptedListener:
    """A SOCK_SEQPACKET listener that speaks the protocol from a script, for the client side's
    handling of what a real daemon does not normally send."""

    def __init__(self, path: str, greeting: bytes, answer=None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        self.sock.listen(4)
        self.greeting = greeting
        self.answer = answer or (lambda n, i: b"OK " + b" ".join(b"%d" % (i + k + 1)
                                                                  for k in range(n)))
        self.received: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.sendall(self.greeting)
            while True:
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, 4096, 64)
                except OSError:
                    return
                if not msg:
                    return
                for fd in fds:
                    os.close(fd)
                reply = self.answer(len(fds), len(self.received))
                self.received.append(len(fds))
                if reply is None:
                    return  # hang up
                conn.sendall(reply)

    def close(self) -> None:
        self.sock.close()


def test_session_handles_refusals_garbage_and_hang_ups(tmp_path):
    path = str(tmp_path / "s.sock.session")
    tok = "0123456789abcdef0123456789abcdef"
    bad = ScriptedListener(path, b"HIQ-SESSION 2 token=" + tok.encode())
    with pytest.raises(SessionError, match="greeting"):
        Session(path, timeout=2)
    bad.close()
    os.unlink(path)
    answers = iter([b"OK 7", b"ERR too many fds held", b"OK 1 2", None])
    lst = ScriptedListener(path, f"HIQ-SESSION 1 token={tok} pid=1 uid=2 gid=3".encode(),
                           answer=lambda n, i: next(answers))
    fd = os.memfd_create("hiq-test", os.MFD_CLOEXEC)
    try:
        s = Session(path, timeout=2)
        assert (s.token, s.pid, s.uid, s.gid) == (tok, 1, 2, 3)
        assert s.send_fds([fd]) == [7]
        with pytest.raises(SessionError, match="too many fds held"):
            s.send_fds([fd])
        assert s.alive()  # a refusal leaves the session open
        with pytest.raises(SessionError, match="unexpected answer"):
            s.send_fds([fd])  # one fd, two ids: answers can no longer be paired
        assert not s.alive()
        s.close()
    finally:
        os.close(fd)
        lst.close()


def test_greeting_names_this_process_and_calls_carry_its_token(daemon):
    with Session.for_target(daemon.target, timeout=margin(10)) as s:
        assert (s.pid, s.uid, s.gid) == (os.getpid(), os.getuid(), os.getgid())
        assert re.fullmatch(r"[0-9a-f]{32}", s.token)
        assert s.metadata() == (("hiq-session", s.token),)
        assert s.alive()
        assert fcntl.fcntl(s.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    assert not s.alive()
    with pytest.raises(SessionError):
        s.send_fds([0])
    with hq.Client(daemon.target, call_timeout=margin(10)) as c:
        sess = c.session()
        assert sess is not None and sess.pid == os.getpid()
        assert c.session() is sess  # one session per client, kept while alive
        assert c.get_stats().caller_uid == os.getuid()


def test_send_fds_answers_one_id_per_fd_in_several_messages(daemon):
    n = MAX_FDS_PER_MESSAGE + 4
    fds = [os.memfd_create(f"hiq-test-{i}", os.MFD_CLOEXEC) for i in range(n)]
    try:
        with Session.for_target(daemon.target, timeout=margin(10)) as s:
            assert s.send_fds([]) == []
            ids = s.send_fds(fds)
            assert len(ids) == n and len(set(ids)) == n and 0 not in ids
            assert s.alive()
        for fd in fds:
            os.fstat(fd)  # ours stay open: the daemon got copies
    finally:
        for fd in fds:
            os.close(fd)


def test_session_ends_when_the_daemon_stops():
    d = Daemon()
    try:
        d.start()
        s = Session.for_target(d.target, timeout=margin(10))
        assert s.alive()
        assert d.stop() == 0
        deadline = time.monotonic() + margin(3.0)
        while s.alive():
            assert time.monotonic() < deadline, "session still alive 3 s after the daemon exited"
            time.sleep(0.01)
        s.close()
    finally:
        d.close()


def test_memfd_registration_round_trips_raw_bit_exact_and_int8_within_bound(daemon):
    before = set(os.listdir("/dev/shm"))
    kv = HostKv(G, 8 * BT, memfd=True)
    events = hq.HostEventPool.create(8)  # a memfd too
    try:
        assert kv.shm.is_memfd and events.shm.is_memfd
        spec_buf = kv.spec("x", BT).buffers[0]
        assert spec_buf.host_shm_name == "" and spec_buf.host_fd == kv.shm.fd
        # Sealed: nobody (this process included) can shrink it under the daemon's mapping.
        with pytest.raises(PermissionError):
            os.ftruncate(kv.shm.fd, 4096)
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            for codec in (hq.Codec.RAW, hq.Codec.INT8_PER_HEAD):
                pool = c.register_pool(kv.spec(f"memfd-{codec.value}", BT, codec, events=events))
                kv.fill(range(0, 4 * BT), seed=11)
                keys = keys_for(4, salt=codec.value)
                b = c.backup(pool, keys, range(4 * BT), done_event=0, sync=False)
                assert b.status.ok and b.ticket > 0, b.status
                assert events.wait(0, b.ticket, 10).ok
                r = c.restore(pool, keys, range(4 * BT, 8 * BT), layer_event_base=1,
                              done_event=4, sync=False)
                assert r.status.ok and r.restored_blocks == 4, r.status
                assert events.wait(4, r.ticket, 10).ok
                src, dst = kv.data[:, :, :4 * BT], kv.data[:, :, 4 * BT:]
                if codec is hq.Codec.RAW:
                    assert np.array_equal(src, dst)
                else:
                    assert not np.array_equal(src, dst)
                    assert int8_violations(src, dst) == 0
                assert c.release_pool(pool).ok
                events.reset()
        assert set(os.listdir("/dev/shm")) - before == set()  # nothing named was created
    finally:
        events.close()
        kv.close()


def test_named_objects_are_passed_by_fd_the_client_opens(daemon):
    """The client opens a named object itself and sends the fd: the registration still works
    when the name is gone by the time the daemon sees the request."""
    kv = HostKv(G, 4 * BT)
    events = hq.HostEventPool.create(4, name=hq.host.unique_name("test-ev"))
    try:
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            sess = c.session()
            assert sess is not None
            send = sess.send_fds

            def send_then_unlink(fds, timeout=None):
                ids = send(fds, timeout)
                for name in (kv.shm.name, events.name):
                    os.unlink("/dev/shm" + name)
                return ids

            sess.send_fds = send_then_unlink
            pool = c.register_pool(kv.spec("named-by-fd", BT, hq.Codec.RAW, events=events))
            sess.send_fds = send
            assert not os.path.exists("/dev/shm" + kv.shm.name)
            kv.fill(range(2 * BT), seed=12)
            keys = keys_for(2)
            b = c.backup(pool, keys, range(2 * BT), done_event=1, sync=False)
            assert b.status.ok, b.status
            assert events.wait(1, b.ticket, 10).ok  # the event object reached the daemon too
            assert c.restore(pool, keys, range(2 * BT, 4 * BT)).restored_blocks == 2
            assert np.array_equal(kv.data[:, :, :2 * BT], kv.data[:, :, 2 * BT:])
    finally:
        events.close()
        kv.close()


def test_a_buffer_held_only_as_an_fd_needs_a_session():
    kv = HostKv(G, BT, memfd=True)
    try:
        with hq.Client("127.0.0.1:1", call_timeout=0.3, register_timeout=0.3) as c:
            with pytest.raises(hq.HiqError) as err:
                c.register_pool(kv.spec("m", BT))
            assert err.value.status.code == hq.StatusCode.FAILED_PRECONDITION
            assert "buffers[0]" in err.value.status.message
            assert "session" in err.value.status.message
    finally:
        kv.close()


def test_another_user_neither_sees_nor_uses_my_pool(shared_daemon):
    kv = HostKv(G, 4 * BT, memfd=True)
    try:
        with hq.Client(shared_daemon.target, call_timeout=margin(10)) as c:
            pool = c.register_pool(kv.spec("victim", BT, hq.Codec.RAW))
            pool_id = c.pool_info(pool).pool_id
            kv.fill(range(2 * BT), seed=13)
            keys = keys_for(2)
            assert c.backup(pool, keys, range(2 * BT)).held == 2
            before = kv.data.copy()
            for anonymous in (False, True):
                seen = run_peer("probe", shared_daemon.target, str(pool_id),
                                *(("--anonymous",) if anonymous else ()), uid=OTHER_UID)
                if not anonymous:
                    assert seen["session_uid"] == OTHER_UID
                    assert seen["caller_uid"] == OTHER_UID and not seen["caller_admin"]
                # Not even that the pool, its model or its namespace exist: a stranger sees
                # the totals (2 blocks), an anonymous caller nothing else at all.
                assert all(p["pool_id"] != pool_id for p in seen["pools"]), seen
                assert [p for p in seen["pools"] if p["model"] == "victim"] == [], seen
                assert "victim" not in seen["namespaces"], seen
                assert seen["blocks"] >= 2, seen
                if anonymous:
                    assert seen["pools"] == [] and seen["namespaces"] == [], seen
                    assert seen["namespaces_total"] == 0, seen
                # A caller with a session is told the pool does not exist; one without may be
                # refused as anonymous first.
                allowed = {"NOT_FOUND"} | ({"UNAUTHENTICATED", "PERMISSION_DENIED"}
                                           if anonymous else set())
                assert set(seen["codes"]) == {"Lookup", "Backup", "Restore", "Evict",
                                              "ReleasePool"}, seen
                assert set(seen["codes"].values()) <= allowed, seen
            # Nothing they tried touched the pool, its blocks or its memory.
            assert np.array_equal(kv.data, before)
            assert c.pool_info(pool).pool_id == pool_id
            assert c.lookup(pool, keys).prefix_blocks == 2
            mine = pools_of(c.get_stats(), "victim")
            assert [p.pool_id for p in mine] == [pool_id] and mine[0].owned
            assert mine[0].uid == os.getuid() and mine[0].client_pid == os.getpid()
    finally:
        kv.close()


def test_another_process_of_the_same_user_cannot_use_its_pool(shared_daemon):
    holder, held = start_holder(shared_daemon.target, "same-user", uid=OTHER_UID)
    try:
        seen = run_peer("probe", shared_daemon.target, str(held["pool_id"]), uid=OTHER_UID)
        theirs = [p for p in seen["pools"] if p["model"] == "same-user"]
        assert len(theirs) == 1 and theirs[0]["pool_id"] == 0 and not theirs[0]["owned"], seen
        assert theirs[0]["uid"] == OTHER_UID and theirs[0]["client_pid"] == held["pid"]
        assert seen["codes"] == {k: "NOT_FOUND" for k in
                                 ("Lookup", "Backup", "Restore", "Evict", "ReleasePool")}, seen
        assert holder.poll() is None
        # root: the holder's pool is still there
        with hq.Client(shared_daemon.target, call_timeout=margin(10)) as admin:
            assert len(pools_of(admin.get_stats(), "same-user")) == 1
    finally:
        holder.kill()
        holder.wait()


SQUATTER_UID = 61002


def test_a_squatted_default_socket_gets_no_memory_and_no_calls(monkeypatch):
    """Another user creates the victim's fallback default directory first and serves a real
    hiqcached there: the victim's client (default target) refuses it before anything leaves the
    process, so the squatter holds no pool; told HIQ_DAEMON_UID, the same client registers."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    victim_dir = f"/tmp/hiqcache-{OTHER_UID}"
    subprocess.run(["rm", "-rf", victim_dir], check=True)
    shm = f"/hiq-py-squat-{os.getpid()}"
    target = f"unix://{victim_dir}/hiqcached.sock"
    squatter = subprocess.Popen(
        ["/usr/bin/setpriv", f"--reuid={SQUATTER_UID}", f"--regid={SQUATTER_UID}",
         "--clear-groups", "--", daemon_path(), "--listen", target, "--pool-bytes", "16MiB",
         "--shm-name", shm, "--socket-mode", "0666", "--prefault", "false",
         "--log-level", "warn"])
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(victim_dir + "/hiqcached.sock.session"):
            assert squatter.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        assert os.stat(victim_dir).st_uid == SQUATTER_UID
        refused = run_peer("register", "", "victim", uid=OTHER_UID)
        assert refused["register"] == "PERMISSION_DENIED", refused
        assert f"belongs to uid {SQUATTER_UID}" in refused["message"], refused
        # What the squatter's daemon holds, asked as one who trusts it.
        monkeypatch.setenv("HIQ_DAEMON_UID", str(SQUATTER_UID))
        with hq.Client(target, call_timeout=margin(10)) as c:
            assert pools_of(c.get_stats(), "victim") == []
            told = run_peer("register", "", "victim", uid=OTHER_UID)
            assert told["register"] == "OK" and told["lookup"] == "OK" and told["pool_id"], told
    finally:
        squatter.kill()
        squatter.wait()
        subprocess.run(["rm", "-rf", victim_dir], check=True)
        if os.path.exists("/dev/shm" + shm):
            os.unlink("/dev/shm" + shm)


def test_a_killed_process_loses_its_pools_within_1s(daemon):
    holder, held = start_holder(daemon.target, "doomed")
    try:
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            assert [p.client_pid for p in pools_of(c.get_stats(), "doomed")] == [held["pid"]]
            t0 = time.monotonic()
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            while pools_of(c.get_stats(), "doomed"):
                # The contract's 1 s, asserted with the margin of a loaded machine.
                assert time.monotonic() - t0 < margin(3.0), (
                    "pool still registered after SIGKILL (contract: within 1 s)")
                time.sleep(0.01)
    finally:
        holder.kill()
        holder.wait()


def test_closing_the_client_releases_its_pools(daemon):
    kv = HostKv(G, BT, memfd=True)
    try:
        with hq.Client(daemon.target, call_timeout=margin(10)) as watcher:
            c = hq.Client(daemon.target, call_timeout=margin(10))
            c.register_pool(kv.spec("closing", BT))
            assert len(pools_of(watcher.get_stats(), "closing")) == 1
            c.close()
            deadline = time.monotonic() + margin(3.0)
            while pools_of(watcher.get_stats(), "closing"):
                assert time.monotonic() < deadline, "pool still registered 3 s after close()"
                time.sleep(0.01)
    finally:
        kv.close()


def test_reregisters_through_a_new_session_after_a_restart():
    d = Daemon()
    kv = HostKv(G, 4 * BT, memfd=True)
    events = hq.HostEventPool.create(4)
    try:
        d.start()
        c = hq.Client(d.target, call_timeout=margin(5), reregister_interval=0.05)
        pool = c.register_pool(kv.spec("restart", BT, hq.Codec.RAW, events=events))
        token = c.session().token
        kv.fill(range(2 * BT), seed=14)
        keys = keys_for(2)
        b = c.backup(pool, keys, range(2 * BT), done_event=0, sync=False)
        assert b.status.ok and events.wait(0, b.ticket, 10).ok
        assert d.stop() == 0
        d.start()  # same pool shm: warm
        deadline = time.monotonic() + margin(20)
        while c.lookup(pool, keys).prefix_blocks != 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.session().token != token
        # The slots keep their values (no request named slots 1..3 for the daemon, so the
        # client released none); the new registration's tickets start above them.
        assert [events.read(i) for i in range(4)] == [b.ticket, 0, 0, 0]
        r = c.restore(pool, keys, range(2 * BT, 4 * BT), done_event=1, sync=False)
        assert r.ticket > b.ticket
        assert r.restored_blocks == 2 and events.wait(1, r.ticket, 10).ok
        assert np.array_equal(kv.data[:, :, :2 * BT], kv.data[:, :, 2 * BT:])
        assert [p.owned for p in pools_of(c.get_stats(), "restart")] == [True]
        c.close()
    finally:
        events.close()
        kv.close()
        d.close()


def test_a_forked_child_drops_the_inherited_session(daemon):
    s = Session.for_target(daemon.target, timeout=margin(10))
    try:
        pid = os.fork()
        if pid == 0:  # the child: no token, no connection inherited
            os._exit(0 if s.fileno() == -1 and not s.alive() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert s.alive()  # the parent's session is untouched
    finally:
        s.close()


FAILED = hq.EVENT_FAILED_BIT


def test_release_stores_the_failed_value_only_below_the_ticket():
    events = hq.HostEventPool.create(6)
    try:
        t = 40
        before = [0, t - 1, t, t + 1, (t - 1) | FAILED, (t + 3) | FAILED]
        for i, v in enumerate(before):
            events.store(i, v)
        assert events.release(t) == 3
        assert [events.read(i) for i in range(6)] == [
            t | FAILED, t | FAILED, t, t + 1, t | FAILED, (t + 3) | FAILED]
        assert events.release(t) == 0  # never backwards, nothing twice
        events.store(0, 1)
        events.store(1, 2)
        assert events.release(t + 1, [1, 99, -1]) == 1  # only the slots named, in range
        assert events.read(0) == 1 and events.read(1) == (t + 1) | FAILED
        events.store(0, t | FAILED)
        assert events.wait(0, t, 0).code == hq.StatusCode.ABORTED
        assert events.wait(0, t - 5, 0).code == hq.StatusCode.ABORTED  # an earlier waiter too
        assert events.wait(2, t, 0).ok
        assert events.wait(5, t, 0).code == hq.StatusCode.ABORTED
        assert events.wait(0, t + 1, 0).code == hq.StatusCode.DEADLINE_EXCEEDED
    finally:
        events.close()


def test_a_killed_daemon_releases_the_slots_of_its_pools():
    """Work T waits on a slot the engine never writes; the daemon is killed (SIGKILL). With no
    call of its own the client notices the session end and stores T | failed in every slot that
    requests named for the daemon (done_event, layer_event_base + l) below T, and again a
    second later; slots past T, the wait slot and slots no request named are left alone."""
    d = Daemon()
    kv = HostKv(G, 4 * BT, memfd=True)
    events = hq.HostEventPool.create(10)
    c = None
    try:
        d.start()
        c = hq.Client(d.target, call_timeout=margin(10))
        pool = c.register_pool(kv.spec("killed", BT, hq.Codec.RAW, events=events))
        kv.fill(range(2 * BT), seed=15)
        keys = keys_for(2, salt="killed")
        # Daemon slots 2 (done) and 3 (done), then 5..7 (a restore's layers) and 8 (its done).
        for done in (2, 3):
            b = c.backup(pool, keys, range(2 * BT), done_event=done, sync=False)
            assert b.status.ok and events.wait(done, b.ticket, 10).ok, b.status
        r = c.restore(pool, keys, range(2 * BT, 4 * BT), layer_event_base=5, done_event=8,
                      sync=False)
        assert r.restored_blocks == 2 and events.wait(8, r.ticket, 10).ok, r.status
        b = c.backup(pool, keys_for(2, salt="killed-2"), range(2 * BT), wait_event=1,
                     wait_value=1, done_event=0, sync=False)
        assert b.status.ok and b.ticket > r.ticket, b.status
        t = b.ticket
        events.store(3, t + 5)  # a daemon slot already past T: the client must leave it alone
        events.store(9, 4)  # a slot no request named
        time.sleep(0.2)
        assert events.read(0) == 0  # the work still waits for slot 1
        d.kill()
        t0 = time.monotonic()
        s = events.wait(0, t, 3 * margin(3.0))  # a waiter not woken waits out 3 margins
        assert s.code == hq.StatusCode.ABORTED, s
        assert time.monotonic() - t0 < margin(3.0)
        assert events.wait(6, t, 0).code == hq.StatusCode.ABORTED  # a layer slot
        released = [0, 2, 5, 6, 7, 8]
        assert [events.read(i) for i in released] == [t | FAILED] * len(released)
        assert events.read(1) == 0 and events.read(3) == t + 5 and events.read(9) == 4
        assert events.read(4) == 0
        # A store of the dead daemon still in flight that lands after the first pass moves a slot
        # back; the second pass, about a second later, releases it again.
        events.store(2, t - 1)
        deadline = time.monotonic() + margin(5.0)
        while events.read(2) != t | FAILED:
            assert time.monotonic() < deadline, "slot 2 not released again"
            time.sleep(0.02)
        assert events.read(1) == 0 and events.read(3) == t + 5
    finally:
        if c is not None:
            c.close()
        events.close()
        kv.close()
        d.close()


def test_a_client_that_closes_or_releases_writes_nothing_into_its_slots():
    """One client closes (its session with it), another releases one of its two pools; then the
    daemon is killed. Only the pool still registered gets the failed values."""
    d = Daemon()
    kv = HostKv(G, 4 * BT, memfd=True)
    closed, released, kept = (hq.HostEventPool.create(4) for _ in range(3))
    others = None
    try:
        d.start()
        keys = keys_for(2, salt="quiet")
        kv.fill(range(2 * BT), seed=16)

        def backups(client: hq.Client, pool: int, events: hq.HostEventPool) -> int:
            """Slot 1 gets an earlier ticket than slot 0: both below the highest but one."""
            for done in (1, 0):
                b = client.backup(pool, keys, range(2 * BT), done_event=done, sync=False)
                assert b.status.ok and events.wait(done, b.ticket, 10).ok, b.status
            return b.ticket

        c = hq.Client(d.target, call_timeout=margin(10))
        backups(c, c.register_pool(kv.spec("quiet-closed", BT, hq.Codec.RAW, events=closed)),
                closed)
        c.close()
        others = hq.Client(d.target, call_timeout=margin(10))
        gone = others.register_pool(kv.spec("quiet-released", BT, hq.Codec.RAW, events=released))
        stays = others.register_pool(kv.spec("quiet-kept", BT, hq.Codec.RAW, events=kept))
        backups(others, gone, released)
        t = backups(others, stays, kept)
        assert others.release_pool(gone).ok
        before = {name: [e.read(i) for i in range(4)]
                  for name, e in (("closed", closed), ("released", released))}
        d.kill()
        deadline = time.monotonic() + margin(5.0)
        while kept.read(1) != t | FAILED:  # the kill was noticed
            assert time.monotonic() < deadline, "the kept pool's slots were not released"
            time.sleep(0.02)
        time.sleep(1.5)  # past the second pass
        assert [kept.read(i) for i in range(4)] == [t, t | FAILED, 0, 0]
        assert before["closed"] == [closed.read(i) for i in range(4)]
        assert before["released"] == [released.read(i) for i in range(4)]
        assert all(0 < v < FAILED for name in before for v in before[name][:2])
    finally:
        if others is not None:
            others.close()
        for e in (closed, released, kept):
            e.close()
        kv.close()
        d.close()
