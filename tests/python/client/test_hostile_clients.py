"""Hostile local clients against the real daemon (README "Isolation between clients"). Victims
and attackers are separate processes of separate uids (the test runs as root and starts them
with user=), each a hostile_actor.py speaking raw gRPC plus the session socket.

What must hold: a pool belongs to the process and uid that registered it (others get NOT_FOUND,
and GetStats does not list it); blocks never flow between uids; Drain needs an admin; memory
comes with proof of access (a name of another uid's object, or of the daemon's own pool, is
refused); a call without a session, or with a forged token, owns nothing; a client's death
(its session socket closing) releases its pools within a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from daemon import Daemon
from margins import margin

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/python: the helpers
VICTIM_UID = 61001
ATTACKER_UID = 61002

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other uids")


class Proc:
    """One hostile_actor.py process of uid `uid`."""

    def __init__(self, target: str, uid: int):
        self.p = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "hostile_actor.py"), target],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
            user=uid, group=uid, extra_groups=[], env={**os.environ, "HOME": "/"})

    def __call__(self, **cmd) -> dict:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"actor died (exit {self.p.poll()})"
        reply = json.loads(line)
        assert reply.get("code") != "EXCEPTION", reply
        return reply

    @property
    def pid(self) -> int:
        return self.p.pid

    def kill(self) -> None:
        self.p.kill()
        self.p.wait()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()  # type: ignore[union-attr]
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def daemon():
    d = Daemon(extra=("--socket-mode", "0666"))
    os.chmod(d.dir, 0o755)  # other uids reach the sockets
    d.start()
    yield d
    d.close()


@pytest.fixture
def actors(daemon):
    made: list[Proc] = []

    def make(uid: int) -> Proc:
        p = Proc(daemon.target, uid)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def keys(n: int, tag: str) -> list[str]:
    return [uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}-{i}").bytes.hex() for i in range(n)]


def registered(actor: Proc, seed: int, **kw) -> int:
    assert actor(op="memory", name=kw.pop("name", None))["ok"]
    assert actor(op="fill", seed=seed)["ok"]
    out = actor(op="register", **kw)
    assert out["ok"], out
    return out["pool_id"]


def test_session_greeting_is_the_kernels_view(actors):
    a = actors(ATTACKER_UID)
    s = a(op="session")
    assert s["ok"] and s["uid"] == ATTACKER_UID and s["pid"] == a.pid


def test_pools_belong_to_their_process_and_uid(actors):
    victim = actors(VICTIM_UID)
    attacker = actors(ATTACKER_UID)
    same_uid = actors(VICTIM_UID)  # another process of the victim's user
    vk = keys(2, "victim")
    vpool = registered(victim, seed=1)
    rows = list(range(32))
    original = victim(op="digest", rows=rows)["digest"]
    assert victim(op="backup", pool_id=vpool, keys=vk)["results"] == [0, 0]  # BLOCK_STORED

    apool = registered(attacker, seed=2)  # same model and geometry as the victim's
    stats = attacker(op="stats")
    assert stats["ok"]
    assert stats["caller_uid"] == ATTACKER_UID and not stats["caller_admin"]
    theirs = [p for p in stats["pools"] if p["uid"] == VICTIM_UID]
    mine = [p for p in stats["pools"] if p["uid"] == ATTACKER_UID]
    assert theirs == []  # another uid's pools are not listed at all, not even without ids
    assert [p["pool_id"] for p in mine] == [apool] and mine[0]["owned"]

    # Even knowing the victim's pool id, nothing works on it: it does not exist for them.
    for who in (attacker, same_uid):
        assert who(op="restore", pool_id=vpool, keys=vk)["code"] == "NOT_FOUND"
        assert who(op="backup", pool_id=vpool, keys=keys(1, "forged"))["code"] == "NOT_FOUND"
        assert who(op="lookup", pool_id=vpool, keys=vk)["code"] == "NOT_FOUND"
        assert who(op="evict", pool_id=vpool, keys=vk)["code"] == "NOT_FOUND"
        assert who(op="release", pool_id=vpool)["code"] == "NOT_FOUND"
    # Blocks never flow between uids: the attacker's pool of the same model sees none of them.
    assert attacker(op="lookup", pool_id=apool, keys=vk)["prefix"] == 0
    assert attacker(op="restore", pool_id=apool, keys=vk)["restored"] == 0
    # Drain is for admins; the daemon keeps accepting registrations.
    assert attacker(op="drain")["code"] == "PERMISSION_DENIED"
    assert registered(actors(ATTACKER_UID), seed=4) != 0

    # An admin (the node's operator, here root) sees every id and may evict a tenant's blocks.
    admin = actors(0)
    assert any(p["pool_id"] == vpool for p in admin(op="stats")["pools"])
    extra = keys(1, "victim-extra")
    assert victim(op="backup", pool_id=vpool, keys=extra)["results"] == [0]
    assert admin(op="evict", pool_id=vpool, keys=extra)["evicted"] == 1
    assert victim(op="lookup", pool_id=vpool, keys=extra)["prefix"] == 0

    # The victim's cache and buffer are intact: overwrite the buffer, restore, compare.
    assert victim(op="fill", seed=3)["ok"]
    assert victim(op="restore", pool_id=vpool, keys=vk)["restored"] == 2
    assert victim(op="digest", rows=rows)["digest"] == original
    assert victim(op="release", pool_id=vpool)["ok"]


def test_memory_needs_proof_of_access(daemon, actors):
    victim = actors(VICTIM_UID)
    attacker = actors(ATTACKER_UID)
    name = f"hiq-victim-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        registered(victim, seed=1, name=name)  # victim's objects: mode 0600, owner 61001
        assert attacker(op="memory")["ok"]
        # The victim's KV object and event object, by name: not the attacker's to map.
        out = attacker(op="register", buffer_name="/" + name)
        assert out["code"] == "PERMISSION_DENIED", out
        assert "buffers[0]" in out["details"]
        out = attacker(op="register", events_name="/" + name + "-ev")
        assert out["code"] == "PERMISSION_DENIED", out
        assert "events" in out["details"]
        # The daemon's own pool: refused to everyone, admins included.
        pool = attacker(op="stats")["shm_name"]
        for who in (attacker, actors(0)):
            if who is not attacker:
                assert who(op="memory")["ok"]
            out = who(op="register", buffer_name=pool, size=64 << 20)
            assert out["code"] == "PERMISSION_DENIED", out
    finally:
        for suffix in ("", "-ev"):
            try:
                os.unlink("/dev/shm/" + name + suffix)
            except FileNotFoundError:
                pass


def test_callers_without_a_session_own_nothing(actors):
    victim = actors(VICTIM_UID)
    vpool = registered(victim, seed=1)
    attacker = actors(ATTACKER_UID)
    assert attacker(op="memory")["ok"]
    for how in ("none", "forged"):
        out = attacker(op="register", auth=how, buffer_name="/does-not-matter")
        assert out["code"] == "UNAUTHENTICATED", out
        assert attacker(op="restore", auth=how, pool_id=vpool, keys=keys(1, "x"))["code"] == \
            "UNAUTHENTICATED"
    anon = attacker(op="stats", auth="none")
    assert anon["ok"] and anon["pools"] == []  # a caller without a session: the totals only
    assert attacker(op="stats", auth="forged")["code"] == "UNAUTHENTICATED"


def test_client_death_releases_its_pools_within_a_second(actors):
    victim = actors(VICTIM_UID)
    vpool = registered(victim, seed=1)
    admin = actors(0)
    assert any(p["pool_id"] == vpool for p in admin(op="stats")["pools"])  # admins see ids
    victim.kill()
    t0 = time.monotonic()
    # The contract's 1 s, asserted with the margin of a loaded machine.
    while any(p["pool_id"] == vpool for p in admin(op="stats")["pools"]):
        assert time.monotonic() - t0 < margin(3.0), (
            "the dead client's pool is still registered (contract: within 1 s)")
        time.sleep(0.02)


def test_calls_without_a_session_get_a_small_message_limit(actors):
    """A process holding no session when it connects is served by the daemon's sessionless gRPC
    server (sessionless_message_bytes, 1 MiB by default), whose connections gRPC ends gracefully
    after about 5 s: a process that opened its session since reaches the full server
    (max_message_bytes) on its next connection, without a failed call."""
    stranger = actors(ATTACKER_UID)
    assert stranger(op="big", auth="none", bytes=4096)["ok"]  # small calls are served
    out = stranger(op="big", auth="none", bytes=2 << 20)
    assert out["code"] == "RESOURCE_EXHAUSTED", out
    assert "larger than max" in out["details"], out
    # The same process opens a session; its connection made before moves within the age and
    # grace (10 s, with gRPC's jitter), and no call fails on the way.
    assert stranger(op="stats")["ok"]  # opens the session (Actor.md)
    t0 = time.monotonic()
    while True:
        small = stranger(op="stats")
        assert small["ok"], small  # the connection's end is graceful: never UNAVAILABLE
        out = stranger(op="big", auth="session", bytes=2 << 20)
        if out["ok"]:
            break
        assert out["code"] == "RESOURCE_EXHAUSTED", out
        assert time.monotonic() - t0 < margin(30), (
            "the connection made before the session never moved")
        time.sleep(0.25)
    # A fresh process that opens its session first is on the full server from its first call.
    other = actors(VICTIM_UID)
    assert other(op="stats")["ok"]
    assert other(op="big", auth="session", bytes=2 << 20)["ok"]
