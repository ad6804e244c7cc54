"""Another local client of hiqcached, run as a child process by test_session.py (optionally as
another user). Prints one JSON line per report on stdout.

  peer.py [--uid UID] probe TARGET POOL_ID [--anonymous]
      GetStats, then Lookup, Backup, Restore, Evict and ReleasePool naming POOL_ID (a pool of
      another process), with this process's own session (none with --anonymous); reports the
      pool ids it saw and each call's status code.
  peer.py [--uid UID] hold TARGET MODEL
      Registers a HOST pool (memfd buffer and events) under MODEL, reports its pid and pool id,
      then sleeps until killed.
  peer.py [--uid UID] register TARGET MODEL
      The same registration (TARGET "" = the default target), then a Lookup; reports the
      status of each (as gRPC code names) and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time

from margins import margin


def drop_to(uid: int) -> None:
    # Before grpc starts any thread: a process-wide change.
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def report(**kv: object) -> None:
    print(json.dumps(kv), flush=True)


def probe(target: str, pool_id: int, anonymous: bool) -> None:
    import grpc

    from hiqcache.session import Session
    from hiqcache.v1 import cache_pb2 as pb
    from hiqcache.v1 import cache_pb2_grpc as pb_grpc

    sess = None if anonymous else Session.for_target(target, timeout=margin(10))
    md = sess.metadata() if sess else None
    stub = pb_grpc.CacheStub(grpc.insecure_channel(target))
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=margin(10), metadata=md)
    codes = {}
    block = pb.Block(key=b"k" * 16, rows=list(range(16)))
    calls = {
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(pool_id=pool_id, keys=[b"k" * 16]),
                                      timeout=margin(10), metadata=md),
        "Backup": lambda: stub.Backup(pb.BackupRequest(pool_id=pool_id, blocks=[block],
                                                       wait_event=-1, done_event=-1, sync=True),
                                      timeout=margin(10), metadata=md),
        "Restore": lambda: stub.Restore(pb.RestoreRequest(
            pool_id=pool_id, blocks=[block], wait_event=-1, layer_event_base=-1,
            done_event=-1, sync=True), timeout=margin(10), metadata=md),
        "Evict": lambda: stub.Evict(pb.EvictRequest(pool_id=pool_id, keys=[b"k" * 16]),
                                    timeout=margin(10), metadata=md),
        "ReleasePool": lambda: stub.ReleasePool(pb.ReleasePoolRequest(pool_id=pool_id),
                                                timeout=margin(10), metadata=md),
    }
    for name, call in calls.items():
        try:
            call()
            codes[name] = "OK"
        except grpc.RpcError as err:
            codes[name] = err.code().name
    report(uid=os.getuid(), session_uid=sess.uid if sess else None,
           caller_uid=stats.caller_uid, caller_admin=stats.caller_admin,
           pools=[{"pool_id": p.pool_id, "client_pid": p.client_pid, "uid": p.uid,
                   "owned": p.owned, "model": p.model} for p in stats.pools],
           namespaces=[n.model for n in stats.namespaces],
           namespaces_total=stats.namespaces_total, blocks=stats.blocks,
           codes=codes)


def _register(target: str, model: str):
    import hiqcache as hq

    g = hq.Geometry(num_layers=2, num_kv_heads=2, head_dim=64)
    rows = 64
    plane = hq.slot_major_bytes(g, rows)
    shm = hq.HostShm.create_memfd("peer-kv", g.num_layers * 2 * plane)
    events = hq.HostEventPool.create(4)
    layers = tuple(hq.LayerView(k=hq.slot_major_view(g, rows, 0, 2 * l * plane),
                                v=hq.slot_major_view(g, rows, 0, (2 * l + 1) * plane))
                   for l in range(g.num_layers))
    c = hq.Client(target or None, call_timeout=margin(10))
    pool = c.register_pool(hq.PoolSpec(model=model, geometry=g, block_tokens=16,
                                       buffers=(shm.shared_buffer(),), layers=layers,
                                       events=events.spec()))
    return c, pool, (shm, events)


def hold(target: str, model: str) -> None:
    c, pool, _ = _register(target, model)
    report(pid=os.getpid(), pool_id=c.pool_info(pool).pool_id)
    while True:
        time.sleep(60)


def register(target: str, model: str) -> None:
    import hiqcache as hq

    try:
        c, pool, _ = _register(target, model)
    except hq.HiqError as err:
        report(register=err.status.code.name, message=err.status.message)
        return
    found = c.lookup(pool, hq.compute_block_keys(range(32), 16))
    report(register="OK", pool_id=c.pool_info(pool).pool_id, lookup=found.status.code.name)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--uid"]:
        drop_to(int(argv[1]))
        argv = argv[2:]
    cmd = argv[0]
    if cmd == "probe":
        probe(argv[1], int(argv[2]), "--anonymous" in argv[3:])
    elif cmd == "hold":
        hold(argv[1], argv[2])
    elif cmd == "register":
        register(argv[1], argv[2])
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
