"""Client KV memfds on huge pages (HostShm.create_memfd's huge_pages) against the real hiqcached:
what a memfd gets is what the machine offers, judged here from the kernel's own counters; the
fallback when the hugetlb pool cannot hold it; "require" refused clearly without huge pages;
hugetlb memfds registered, restored bit-exact, unmapped again on release; hostile hugetlb
clients (a registered size beyond the object, pages reserved but never written, a shrink under
the daemon) get a clear error and leave the daemon serving. The hugetlb tests skip when no
hugetlb pages are free (CI: its vm.nr_hugepages is 0); no test changes a kernel setting."""

from __future__ import annotations

import dataclasses
import mmap
import os

import numpy as np
import pytest

import hiqcache as hq
from kv_util import HostKv
from margins import margin

G = hq.Geometry(num_layers=3, num_kv_heads=2, head_dim=64)
BT = 16
ROWS = 8 * BT


def meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name == field:
                return int(rest.split()[0])
    return 0


def huge_page_bytes() -> int:
    return meminfo("Hugepagesize") * 1024


def hugetlb_available_bytes() -> int:
    """Free, unreserved default-size hugetlb pages, in bytes (another process may take them)."""
    return max(0, meminfo("HugePages_Free") - meminfo("HugePages_Rsvd")) * huge_page_bytes()


def shmem_thp_honours_advice() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            words = f.read().split()
    except OSError:
        return False
    return any(w in ("[advise]", "[within_size]", "[always]", "[force]") for w in words)


needs_hugetlb = pytest.mark.skipif(
    huge_page_bytes() == 0 or hugetlb_available_bytes() < 4 * huge_page_bytes(),
    reason=f"no free hugetlb pages (vm.nr_hugepages is {meminfo('HugePages_Total')}): "
           "reserve some to run this")


def round_trip(c: hq.Client, kv: HostKv, model: str, seed: int,
               buffer: hq.SharedBuffer | None = None) -> None:
    """CODEC_RAW backup of rows [0, 64), restore into [64, 128): bit-exact."""
    spec = kv.spec(model, BT, hq.Codec.RAW)
    if buffer is not None:
        spec = hq.PoolSpec(model=spec.model, geometry=spec.geometry, block_tokens=BT,
                           codec=spec.codec, buffers=(buffer,), layers=spec.layers)
    pool = c.register_pool(spec)
    kv.fill(range(0, 4 * BT), seed=seed)
    keys = hq.compute_block_keys(range(4 * BT), BT, salt=model)
    b = c.backup(pool, keys, range(4 * BT))
    assert b.status.ok and b.blocks == [hq.BlockStatus.STORED] * 4, b.status
    r = c.restore(pool, keys, range(4 * BT, 8 * BT))
    assert r.status.ok and r.restored_blocks == 4, r.status
    assert np.array_equal(kv.data[:, :, :4 * BT], kv.data[:, :, 4 * BT:])
    assert c.release_pool(pool).ok


def daemon_mappings_of(daemon, fd: int) -> int:
    """Mappings in the daemon's address space of the object behind our `fd` (by inode)."""
    inode = os.fstat(fd).st_ino
    with open(f"/proc/{daemon.proc.pid}/maps") as f:
        return sum(1 for line in f if len(line.split()) > 5 and int(line.split()[4]) == inode)


def test_huge_pages_values_are_checked():
    for bad in ("on", "", 1, None):
        with pytest.raises(ValueError, match="huge_pages"):
            hq.HostShm.create_memfd("bad", 4096, huge_pages=bad)  # type: ignore[arg-type]


def test_auto_gets_what_the_machine_offers_and_round_trips(daemon):
    size_needed = G.num_layers * 2 * hq.slot_major_bytes(G, ROWS)
    page = huge_page_bytes()
    expected = ("hugetlb" if page and hugetlb_available_bytes() >= -(-size_needed // page) * page
                else "thp" if shmem_thp_honours_advice() else "none")
    kv = HostKv(G, ROWS, memfd=True, huge_pages="auto")
    try:
        assert kv.shm.huge_pages == expected
        plain = HostKv(G, ROWS, memfd=True)
        assert plain.shm.huge_pages == "none"  # the default asks for nothing
        plain.close()
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            round_trip(c, kv, "huge-auto", seed=3)
    finally:
        kv.close()


def test_auto_falls_back_when_the_hugetlb_pool_cannot_hold_it(daemon):
    """CI has no hugetlb pages; elsewhere this test first holds every free one itself."""
    hold = None
    if hugetlb_available_bytes() > 0:
        hold = hq.HostShm.create_memfd("hold", hugetlb_available_bytes(), populate=False,
                                       huge_pages="auto")
        assert hold.huge_pages == "hugetlb"
    try:
        kv = HostKv(G, ROWS, memfd=True, huge_pages="auto")
        try:
            assert kv.shm.huge_pages == ("thp" if shmem_thp_honours_advice() else "none")
            assert kv.shm.size == G.num_layers * 2 * hq.slot_major_bytes(G, ROWS)
            with hq.Client(daemon.target, call_timeout=margin(10)) as c:
                round_trip(c, kv, "huge-fallback", seed=4)
        finally:
            kv.close()
        if shmem_thp_honours_advice():
            assert hq.HostShm.create_memfd("req", 1 << 20, huge_pages="require").huge_pages == "thp"
        else:
            with pytest.raises(ValueError, match=r"huge_pages=require: .* hugetlb: .*"
                                                 r"shmem_enabled is '\w+'"):
                hq.HostShm.create_memfd("req", 1 << 20, huge_pages="require")
    finally:
        if hold is not None:
            hold.close()


@needs_hugetlb
def test_hugetlb_memfd_with_a_ragged_registered_size_round_trips_and_is_unmapped(daemon):
    """The registered size is the KV's, no whole number of huge pages: the daemon maps and
    unmaps the object in whole pages."""
    kv = HostKv(G, ROWS, memfd=True, huge_pages="require")
    try:
        assert kv.shm.huge_pages == "hugetlb"
        assert kv.shm.size % huge_page_bytes() == 0
        exact = G.num_layers * 2 * hq.slot_major_bytes(G, ROWS)
        assert exact % huge_page_bytes() != 0
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            round_trip(c, kv, "huge-ragged", seed=5,
                       buffer=hq.SharedBuffer(size_bytes=exact, host_fd=kv.shm.fd))
            round_trip(c, kv, "huge-whole", seed=6)
            assert daemon_mappings_of(daemon, kv.shm.fd) == 0  # both released
    finally:
        kv.close()


@needs_hugetlb
def test_hostile_hugetlb_clients_get_clear_errors_and_the_daemon_serves_on(daemon):
    size = G.num_layers * 2 * hq.slot_major_bytes(G, ROWS)
    page = huge_page_bytes()
    fd = os.memfd_create("hiq-hostile", os.MFD_CLOEXEC | os.MFD_HUGETLB)  # no seals
    try:
        os.ftruncate(fd, page)
        m = mmap.mmap(fd, page)
        m[:size] = b"\x11" * size
        kv = HostKv(G, ROWS, memfd=True)
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            layers = kv.spec("h", BT).layers

            def spec(model: str, size_bytes: int) -> hq.PoolSpec:
                return hq.PoolSpec(model=model, geometry=G, block_tokens=BT, codec=hq.Codec.RAW,
                                   buffers=(hq.SharedBuffer(size_bytes=size_bytes, host_fd=fd),),
                                   layers=layers)

            # A registered size beyond the object.
            with pytest.raises(hq.HiqError) as err:
                c.register_pool(spec("hostile-lie", page + 4096))
            assert err.value.status.code == hq.StatusCode.INVALID_ARGUMENT
            assert "buffers[0]" in err.value.status.message

            # An object with a page it reserved but never wrote: the daemon would allocate that
            # hugetlb page on its own account; refused, and nothing allocated.
            fd2 = os.memfd_create("hiq-hostile-unwritten", os.MFD_CLOEXEC | os.MFD_HUGETLB)
            try:
                os.ftruncate(fd2, 2 * page)
                m2 = mmap.mmap(fd2, 2 * page)  # reserves both pages
                m2[:size] = b"\x22" * size  # allocates the first
                assert os.fstat(fd2).st_blocks * 512 == page
                spec2 = dataclasses.replace(
                    spec("hostile-unwritten", 2 * page),
                    buffers=(hq.SharedBuffer(size_bytes=2 * page, host_fd=fd2),))
                with pytest.raises(hq.HiqError) as err:
                    c.register_pool(spec2)
                assert err.value.status.code == hq.StatusCode.FAILED_PRECONDITION
                assert (f"buffers[0].host_fd_id: the fd (hugetlbfs) has {page} of its {2 * page}"
                        " bytes in pages that are not allocated") in err.value.status.message
                assert os.fstat(fd2).st_blocks * 512 == page
                m2.close()
            finally:
                os.close(fd2)

            # A shrink under the daemon: the pool fails, naming the buffer.
            pool = c.register_pool(spec("hostile-shrink", size))
            keys = hq.compute_block_keys(range(4 * BT), BT, salt="hostile")
            assert c.backup(pool, keys[:1], range(BT)).status.ok
            m.close()
            os.ftruncate(fd, 0)
            b = c.backup(pool, keys[1:], range(BT, 4 * BT))
            assert b.status.code == hq.StatusCode.FAILED_PRECONDITION, b.status
            assert "buffers[0]: the client's shared memory shrank" in b.status.message
            c.release_pool(pool)

            # The daemon serves everyone else as before.
            assert daemon.running
            round_trip(c, kv, "after-hostile", seed=7)
        kv.close()
    finally:
        os.close(fd)
