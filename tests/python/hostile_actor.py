"""One client of hiqcached driven line by line over stdin/stdout (JSON), so that a test can run
victims and attackers as separate processes of separate uids against one real daemon.

It talks raw gRPC (hiqcache.v1 stubs) with the session of hiqcache.session, as a hostile client
would: it sends whatever the test tells it to, ids and names it was never given included. Its KV
buffer is a memfd (registered by fd) or a POSIX shm object it creates (registered by name).

Geometry: 1 layer, 1 KV head, head_dim 64, BF16, block_tokens 16, CODEC_RAW: one row is 128 B;
K rows 0..63 at offset 0, V rows at offset 8 KiB; 8 event slots.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys

import grpc

from hiqcache.session import Session
from hiqcache.v1 import cache_pb2 as pb
from hiqcache.v1 import cache_pb2_grpc as pbg
from margins import margin

ROWS = 64
ROW_BYTES = 128
KV_BYTES = 2 * ROWS * ROW_BYTES
EVENT_SLOTS = 8
BLOCK_TOKENS = 16


class Actor:
    def __init__(self, target: str):
        self.target = target
        self.channel = grpc.insecure_channel(target)
        self.stub = pbg.CacheStub(self.channel)
        self.session: Session | None = None
        self.kv_fd = -1
        self.kv: mmap.mmap | None = None
        self.ev_fd = -1

    # --- memory -------------------------------------------------------------------------------
    def make_memory(self, name: str | None) -> None:
        if name:
            path = "/dev/shm/" + name.lstrip("/")
            self.kv_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            self.ev_fd = os.open(path + "-ev", os.O_RDWR | os.O_CREAT, 0o600)
        else:
            self.kv_fd = os.memfd_create("hiq-actor-kv", os.MFD_CLOEXEC)
            self.ev_fd = os.memfd_create("hiq-actor-ev", os.MFD_CLOEXEC)
        os.ftruncate(self.kv_fd, KV_BYTES)
        os.ftruncate(self.ev_fd, 64 * EVENT_SLOTS)
        self.kv = mmap.mmap(self.kv_fd, KV_BYTES)

    def fill(self, seed: int) -> None:
        assert self.kv is not None
        # Finite BF16 values that differ per seed and row: (seed, row, i) -> 0x3f00 | low byte.
        data = bytearray(KV_BYTES)
        for row in range(2 * ROWS):
            for i in range(ROW_BYTES // 2):
                v = 0x3F00 | ((seed * 31 + row * 7 + i) & 0x7F)
                data[row * ROW_BYTES + 2 * i:row * ROW_BYTES + 2 * i + 2] = v.to_bytes(2, "little")
        self.kv[:] = bytes(data)

    def digest(self, rows: list[int]) -> str:
        assert self.kv is not None
        h = hashlib.sha256()
        for r in rows:
            h.update(self.kv[r * ROW_BYTES:(r + 1) * ROW_BYTES])  # K
            h.update(self.kv[(ROWS + r) * ROW_BYTES:(ROWS + r + 1) * ROW_BYTES])  # V
        return h.hexdigest()

    # --- calls --------------------------------------------------------------------------------
    def md(self, how: str = "session"):
        if how == "none":
            return ()
        if how == "forged":
            return (("hiq-session", "0" * 32),)
        if self.session is None:
            self.session = Session.for_target(self.target, timeout=margin(10))
        return self.session.metadata() if self.session is not None else ()

    def call(self, method, request, how: str = "session"):
        try:
            return {"ok": True, "reply": method(request, metadata=self.md(how), timeout=10)}
        except grpc.RpcError as e:
            return {"ok": False, "code": e.code().name, "details": e.details() or ""}

    def register(self, cmd: dict) -> dict:
        how = cmd.get("auth", "session")
        buffers, events = [], pb.EventPool()  # no events unless ours or a name is given
        own_ids: list[int] = []
        if cmd.get("buffer_name") is None:  # our own memory, by fd
            if how == "session" and self.session is None:
                self.session = Session.for_target(self.target, timeout=margin(10))
            if how != "session" or self.session is None:
                return {"ok": False, "code": "NO_SESSION", "details": ""}
            own_ids = self.session.send_fds([self.kv_fd, self.ev_fd])
        if cmd.get("buffer_name") is not None:  # a name chosen by the test (maybe not ours)
            buffers.append(pb.SharedBuffer(host_shm_name=cmd["buffer_name"],
                                           size_bytes=cmd.get("size", KV_BYTES)))
        else:
            buffers.append(pb.SharedBuffer(host_fd_id=own_ids[0], size_bytes=KV_BYTES))
            if cmd.get("events_name") is None:
                events = pb.EventPool(host_fd_id=own_ids[1], count=EVENT_SLOTS)
        if cmd.get("events_name") is not None:
            events = pb.EventPool(host_shm_name=cmd["events_name"], count=EVENT_SLOTS)
        req = pb.RegisterPoolRequest(
            model=cmd.get("model", "hostile-test-model"), tenant=cmd.get("tenant", ""),
            geometry=pb.Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype=pb.DTYPE_BF16,
                                 attention=pb.ATTENTION_MHA, tp_rank=0, tp_size=1),
            block_tokens=BLOCK_TOKENS, codec=pb.CODEC_RAW,
            device=pb.Device(kind=pb.DEVICE_KIND_HOST), buffers=buffers,
            layers=[pb.LayerView(
                k=pb.TensorView(buffer=0, offset_bytes=0, row_stride_bytes=ROW_BYTES,
                                num_rows=ROWS),
                v=pb.TensorView(buffer=0, offset_bytes=ROWS * ROW_BYTES,
                                row_stride_bytes=ROW_BYTES, num_rows=ROWS))],
            events=events, client_pid=os.getpid())
        out = self.call(self.stub.RegisterPool, req, how)
        if out["ok"]:
            out["pool_id"] = out.pop("reply").pool_id
        return out

    @staticmethod
    def blocks(cmd: dict):
        keys = [bytes.fromhex(k) for k in cmd["keys"]]
        rows = cmd.get("rows") or list(range(len(keys) * BLOCK_TOKENS))
        return [pb.Block(key=k, rows=rows[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
                for i, k in enumerate(keys)]

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        how = cmd.get("auth", "session")
        if op == "memory":
            self.make_memory(cmd.get("name"))
            return {"ok": True}
        if op == "fill":
            self.fill(cmd["seed"])
            return {"ok": True}
        if op == "digest":
            return {"ok": True, "digest": self.digest(cmd["rows"])}
        if op == "session":
            s = Session.for_target(self.target, timeout=margin(10))
            return {"ok": s is not None, "pid": s.pid if s else 0, "uid": s.uid if s else -1}
        if op == "register":
            return self.register(cmd)
        if op == "backup":
            out = self.call(self.stub.Backup, pb.BackupRequest(
                pool_id=cmd["pool_id"], blocks=self.blocks(cmd), wait_event=-1, done_event=-1,
                sync=True), how)
            if out["ok"]:
                out["results"] = list(out.pop("reply").results)
            return out
        if op == "restore":
            out = self.call(self.stub.Restore, pb.RestoreRequest(
                pool_id=cmd["pool_id"], blocks=self.blocks(cmd), wait_event=-1,
                layer_event_base=-1, done_event=-1, sync=True), how)
            if out["ok"]:
                out["restored"] = out.pop("reply").restored_blocks
            return out
        if op == "lookup":
            out = self.call(self.stub.Lookup, pb.LookupRequest(
                pool_id=cmd["pool_id"], keys=[bytes.fromhex(k) for k in cmd["keys"]]), how)
            if out["ok"]:
                out["prefix"] = out.pop("reply").prefix_blocks
            return out
        if op == "evict":
            out = self.call(self.stub.Evict, pb.EvictRequest(
                pool_id=cmd["pool_id"], keys=[bytes.fromhex(k) for k in cmd["keys"]]), how)
            if out["ok"]:
                out["evicted"] = out.pop("reply").evicted
            return out
        if op == "release":
            out = self.call(self.stub.ReleasePool, pb.ReleasePoolRequest(pool_id=cmd["pool_id"]),
                            how)
            out.pop("reply", None)
            return out
        if op == "drain":
            out = self.call(self.stub.Drain, pb.DrainRequest(), how)
            out.pop("reply", None)
            return out
        if op == "stats":
            out = self.call(self.stub.GetStats, pb.GetStatsRequest(), how)
            if out["ok"]:
                r = out.pop("reply")
                out["shm_name"] = r.shm_name
                out["caller_uid"] = r.caller_uid
                out["caller_admin"] = r.caller_admin
                out["pools"] = [{"pool_id": p.pool_id, "uid": p.uid, "owned": p.owned,
                                 "model": p.model} for p in r.pools]
            return out
        if op == "big":
            # A GetStats request of `bytes` bytes: its one field is unknown to the daemon (15,
            # length-delimited), so the message parses and only its size can refuse it.
            n = cmd["bytes"]
            body = bytearray(b"\x7a")
            v = n
            while True:
                body.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
                v >>= 7
                if not v:
                    break
            body += bytes(n)
            call = self.channel.unary_unary("/hiqcache.v1.Cache/GetStats",
                                            request_serializer=lambda b: b,
                                            response_deserializer=lambda b: b)
            out = self.call(call, bytes(body), how)
            out.pop("reply", None)
            return out
        return {"ok": False, "code": "BAD_OP", "details": op}


def main() -> None:
    actor = Actor(sys.argv[1])
    for line in sys.stdin:
        try:
            reply = actor.handle(json.loads(line))
        except Exception as e:  # reported to the test, which fails on it
            reply = {"ok": False, "code": "EXCEPTION", "details": repr(e)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
