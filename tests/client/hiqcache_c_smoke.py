#!/usr/bin/env python3
"""Smoke test of libhiqcache.so (hiqcache/hiqcache_c.h) from Python through ctypes, as a Python
engine would use it today: start the real hiqcached (HOST device), register a HOST pool the
library creates, back up blocks, look them up, restore them into other rows, and check every
element against the INT8 error bound; then register a second pool from a flat description over
shared memory Python created itself (same namespace) and restore into it. No numpy.

Environment: HIQ_C_LIB (path of libhiqcache.so), HIQ_DAEMON_PATH (path of hiqcached).
Exit 0 on success; prints the first failure otherwise. Runs in well under 10 s.
"""
import array
import ctypes as C
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

HIQ_OK, HIQ_INVALID_ARGUMENT = 0, 3
HIQ_LAYOUT_SGLANG = 0


from hiqcache_c_abi import Buffer, Geometry, LayerView, PoolDesc, PoolInfo, Stats  # noqa: E402


def load(path):
    lib = C.CDLL(path)
    u8p, u32p, u64p = C.POINTER(C.c_uint8), C.POINTER(C.c_uint32), C.POINTER(C.c_uint64)
    sig = {
        "hiq_abi_version": (C.c_int, []),
        "hiq_last_error": (C.c_char_p, []),
        "hiq_connect": (C.c_int, [C.c_char_p, C.c_int64, C.POINTER(C.c_void_p)]),
        "hiq_close": (None, [C.c_void_p]),
        "hiq_host_pool_create": (C.c_int, [C.POINTER(Geometry), C.c_uint32, C.c_uint32,
                                           C.c_uint32, C.c_uint32, C.POINTER(C.c_void_p)]),
        "hiq_host_pool_destroy": (None, [C.c_void_p]),
        "hiq_host_pool_data": (C.c_void_p, [C.c_void_p, u64p]),
        "hiq_host_pool_head_offset": (C.c_uint64, [C.c_void_p] + [C.c_uint32] * 4),
        "hiq_host_pool_wait": (C.c_int, [C.c_void_p, C.c_uint32, C.c_uint64, C.c_int64]),
        "hiq_register_host_pool": (C.c_int, [C.c_void_p, C.c_char_p, C.c_char_p, C.c_uint32,
                                             C.c_uint32, C.c_void_p, u64p, C.POINTER(PoolInfo)]),
        "hiq_register_pool": (C.c_int, [C.c_void_p, C.POINTER(PoolDesc), C.c_int, u64p,
                                        C.POINTER(PoolInfo)]),
        "hiq_release_pool": (C.c_int, [C.c_void_p, C.c_uint64]),
        "hiq_compute_block_keys": (C.c_int, [u32p, C.c_uint64, C.c_uint32, C.c_char_p,
                                             C.c_uint64, u8p, C.c_uint64, u64p]),
        "hiq_lookup": (C.c_int, [C.c_void_p, C.c_uint64, u8p, C.c_uint32, u32p]),
        "hiq_backup": (C.c_int, [C.c_void_p, C.c_uint64, u8p, C.c_uint32, u32p, C.c_uint64,
                                 C.c_int32, C.c_uint64, C.c_int32, C.c_int, u8p, u64p]),
        "hiq_restore": (C.c_int, [C.c_void_p, C.c_uint64, u8p, C.c_uint32, u32p, C.c_uint64,
                                  C.c_int32, C.c_uint64, C.c_int32, C.c_int32, C.c_int, u32p,
                                  u64p]),
        "hiq_get_stats": (C.c_int, [C.c_void_p, C.POINTER(Stats)]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def bf16(x):
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF
    return u >> 16


def from_bf16(b):
    return struct.unpack("<f", struct.pack("<I", b << 16))[0]


def wait_for_socket(path, proc, timeout=20.0, kind=socket.SOCK_STREAM):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hiqcached exited with {proc.returncode}")
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
    raise RuntimeError(f"hiqcached did not listen on {path}")


def main():
    lib = load(os.environ["HIQ_C_LIB"])
    daemon = os.environ["HIQ_DAEMON_PATH"]
    assert lib.hiq_abi_version() == 4

    tmp = tempfile.mkdtemp(prefix="hiq-py-")
    sock = os.path.join(tmp, "hiqcached.sock")
    pool_shm = f"/hiq-py-pool-{os.getpid()}"
    proc = subprocess.Popen([daemon, "--listen", "unix://" + sock, "--pool-bytes", "64MiB",
                             "--shm-name", pool_shm, "--device", "host", "--log-level", "warn"])
    own_shm = None
    try:
        # The session socket listens once the daemon serves.
        wait_for_socket(sock + ".session", proc, kind=socket.SOCK_SEQPACKET)
        client = C.c_void_p()
        assert lib.hiq_connect(("unix://" + sock).encode(), 5000, C.byref(client)) == HIQ_OK

        L, H, D, rows, bt, nblocks = 4, 2, 64, 64, 8, 3
        g = Geometry(L, H, D, 0, 0, 0, 1)
        pool = C.c_void_p()
        rc = lib.hiq_host_pool_create(C.byref(g), HIQ_LAYOUT_SGLANG, rows, 0, L + 2,
                                      C.byref(pool))
        assert rc == HIQ_OK, lib.hiq_last_error()
        size = C.c_uint64()
        base = lib.hiq_host_pool_data(pool, C.byref(size))

        def head(l, p, r, h):
            off = lib.hiq_host_pool_head_offset(pool, l, p, r, h)
            assert off + 2 * D <= size.value
            return (C.c_uint16 * D).from_address(base + off)

        rng = random.Random(5)
        src = list(range(5, 5 + nblocks * bt))
        dst = list(range(40, 40 + nblocks * bt))
        original = {}
        for l in range(L):
            for p in range(2):
                for r in src:
                    for h in range(H):
                        vals = array.array("H", (bf16(rng.gauss(0, 1) * (h + 1)) for _ in range(D)))
                        head(l, p, r, h)[:] = vals.tolist()
                        original[(l, p, r, h)] = vals

        handle, info = C.c_uint64(), PoolInfo()
        rc = lib.hiq_register_host_pool(client, b"py-ctypes-smoke", None, bt, 0, pool,
                                        C.byref(handle), C.byref(info))
        assert rc == HIQ_OK, lib.hiq_last_error()
        assert info.encoded_bytes_per_token == L * 2 * (H * D + 2 * H)

        tokens = (C.c_uint32 * (nblocks * bt))(*range(1000, 1000 + nblocks * bt))
        keys = (C.c_uint8 * (16 * nblocks))()
        nkeys = C.c_uint64()
        assert lib.hiq_compute_block_keys(tokens, len(tokens), bt, b"", 0, keys, nblocks,
                                          C.byref(nkeys)) == HIQ_OK
        assert nkeys.value == nblocks

        src_rows = (C.c_uint32 * len(src))(*src)
        dst_rows = (C.c_uint32 * len(dst))(*dst)
        status = (C.c_uint8 * nblocks)()
        ticket = C.c_uint64()
        rc = lib.hiq_backup(client, handle, keys, nblocks, src_rows, len(src) - 1, -1, 0, -1, 1,
                            status, C.byref(ticket))
        assert rc == HIQ_INVALID_ARGUMENT and b"rows" in lib.hiq_last_error(), rc
        rc = lib.hiq_backup(client, handle, keys, nblocks, src_rows, len(src), -1, 0, -1, 1,
                            status, C.byref(ticket))
        assert rc == HIQ_OK, lib.hiq_last_error()
        assert list(status) == [0] * nblocks, list(status)

        prefix = C.c_uint32()
        assert lib.hiq_lookup(client, handle, keys, nblocks, C.byref(prefix)) == HIQ_OK
        assert prefix.value == nblocks, prefix.value

        restored = C.c_uint32()
        rc = lib.hiq_restore(client, handle, keys, nblocks, dst_rows, len(dst), -1, 0, 1, 0, 0,
                             C.byref(restored), C.byref(ticket))
        assert rc == HIQ_OK, lib.hiq_last_error()
        assert restored.value == nblocks
        assert lib.hiq_host_pool_wait(pool, 0, ticket.value, 5000) == HIQ_OK
        for l in range(L):
            assert lib.hiq_host_pool_wait(pool, 1 + l, ticket.value, 0) == HIQ_OK

        def check(read_head):
            bad = checked = 0
            for (l, p, r, h), x in original.items():
                y = read_head(l, p, dst[src.index(r)], h)
                amax = max(abs(from_bf16(v)) for v in x)
                s = from_bf16(bf16(max(amax, 2.0 ** -112) / 127.0))
                for xv, yv in zip(x, y):
                    xf, yf = from_bf16(xv), from_bf16(yv)
                    checked += 1
                    if not abs(yf - xf) <= (0.5 + 2 ** -8) * s + 2 ** -8 * abs(yf):
                        bad += 1
            assert checked == L * 2 * len(src) * H * D
            assert bad == 0, f"{bad} of {checked} elements break the bound"
            return checked

        n = check(lambda l, p, r, h: list(head(l, p, r, h)))

        # A second pool in the same namespace, described flat over shm that Python created.
        from multiprocessing import shared_memory
        plane = rows * H * D * 2
        own_shm = shared_memory.SharedMemory(create=True, size=L * 2 * plane)
        shm_name = own_shm.name if own_shm.name.startswith("/") else "/" + own_shm.name
        bufs = (Buffer * 1)(Buffer(shm_name.encode(), None, 0, 0, own_shm.size))
        layers = (LayerView * L)()
        for l in range(L):
            for p, view in ((0, layers[l].k), (1, layers[l].v)):
                view.buffer, view.num_rows = 0, rows
                view.offset_bytes = (2 * l + p) * plane
                view.row_stride_bytes = H * D * 2
            layers[l].has_v = 1
        desc = PoolDesc(model=b"py-ctypes-smoke", geometry=g, block_tokens=bt, codec=0,
                        device_kind=0, num_buffers=1, buffers=bufs, layers=layers)
        handle2 = C.c_uint64()
        rc = lib.hiq_register_pool(client, C.byref(desc), 0, C.byref(handle2), None)
        assert rc == HIQ_OK, lib.hiq_last_error()
        rc = lib.hiq_restore(client, handle2, keys, nblocks, dst_rows, len(dst), -1, 0, -1, -1, 1,
                             C.byref(restored), None)
        assert rc == HIQ_OK and restored.value == nblocks, (rc, lib.hiq_last_error())
        def own_head(l, p, r, h):
            off = (2 * l + p) * plane + (r * H + h) * D * 2
            return struct.unpack_from(f"<{D}H", own_shm.buf, off)

        n += check(own_head)

        stats = Stats()
        assert lib.hiq_get_stats(client, C.byref(stats)) == HIQ_OK
        assert stats.blocks == nblocks and stats.num_pools == 2, (stats.blocks, stats.num_pools)
        assert lib.hiq_release_pool(client, handle2) == HIQ_OK
        assert lib.hiq_release_pool(client, handle) == HIQ_OK
        lib.hiq_host_pool_destroy(pool)
        lib.hiq_close(client)
        print(f"hiqcache C ABI from Python: {n} elements restored within the bound")
    finally:
        if own_shm is not None:
            own_shm.close()
            own_shm.unlink()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        try:
            os.unlink("/dev/shm" + pool_shm)
        except OSError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.remove(sock)
            os.rmdir(tmp)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
