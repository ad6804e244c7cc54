"""HOST-backend helpers: shared memory an engine shares with hiqcached (docs/design.md "HOST").

  HostShm        shared memory, mapped: a memfd (HostShm.create_memfd, preferred: sealed against
                 shrinking, no name, gone when its last fd and mapping are; on huge pages where
                 asked and the machine offers them), a POSIX shm object created here (unlinked
                 again by close()) or one opened by name.
  HostEventPool  ticket slots (docs/design.md "Completion: ticket slots"; slot i = little-endian
                 uint64 at byte 64*i): the daemon stores ticket T with release order when work
                 T completes, T | 2^63 when it failed. hiqcache.torch_kv.CudaTicketSlots is the
                 same object page-locked for a GPU.

hiqcache.Client hands the daemon these objects as file descriptors over its session
(hiqcache.session): a memfd's own fd, or an fd it opens by name with this process's rights, so the
daemon never opens a client's memory with its own. Names are still what other processes use to
open an object (tests, tools) and what a client without a session sends.

Linux names POSIX shm objects by files under /dev/shm, which is what shm_open(3) opens; this
module uses those paths directly so that it needs no compiled code. Thread-safety: reads and
stores of event slots are single aligned 8-byte accesses and safe from any thread; callers
synchronise their own writes to KV data.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from hiqcache.status import Status, StatusCode

if TYPE_CHECKING:
    from hiqcache.spec import EventPoolSpec, SharedBuffer

SHM_DIR = "/dev/shm"
SLOT_BYTES = 64
EVENT_FAILED_BIT = 1 << 63
TICKET_MASK = EVENT_FAILED_BIT - 1  # bits 0..62 of a slot: the ticket

_names = itertools.count(1)


def normalize_name(name: str) -> str:
    """The name with its leading "/", as shm_open takes it."""
    return name if name.startswith("/") else "/" + name


def unique_name(tag: str) -> str:
    """"/hiq-<pid>-<n>-<nonce>-<tag>": unique in this process, unlikely to collide elsewhere."""
    return f"/hiq-{os.getpid()}-{next(_names)}-{os.urandom(4).hex()}-{tag}"


_UNIQUE = re.compile(r"^hiq-(\d+)-\d+-[0-9a-f]{8}-[A-Za-z0-9_.-]+$")


def reap_stale(tags: tuple[str, ...]) -> list[str]:
    """Unlinks this user's shm objects named by unique_name(tag) for one of `tags` whose
    process is gone (an engine killed before it could unlink its own). Returns their names.
    Objects of live processes, other users' objects and other names are left alone."""
    reaped: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return reaped
    for entry in entries:
        m = _UNIQUE.match(entry)
        if m is None or not entry.endswith(tuple("-" + t for t in tags)):
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, entry)).st_uid != os.getuid():
                continue
            os.kill(pid, 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except OSError:
            continue  # not ours to judge (EPERM: alive under another user)
        try:
            os.unlink(os.path.join(SHM_DIR, entry))
            reaped.append("/" + entry)
        except OSError:
            pass
    return reaped


MEMFD_PREFIX = "memfd:"

# create_memfd's huge_pages (hiqcache::HugePages): "off" = a plain memfd; "auto" = MFD_HUGETLB
# when the hugetlb pool holds the object, else a plain memfd advised MADV_HUGEPAGE (transparent
# huge pages where the kernel's shmem_enabled honours it), else a plain memfd; "require" = as auto,
# but ValueError when neither is there.
HUGE_PAGES = ("off", "auto", "require")
# HostShm.huge_pages, what backs the pages: 4 KiB pages, shmem THP, the hugetlb pool.
HUGE_PAGE_BACKINGS = ("none", "thp", "hugetlb")
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_thp_setting() -> str:
    """The selected value of /sys/kernel/mm/transparent_hugepage/shmem_enabled ("never",
    "advise", ...); "" when it cannot be read."""
    try:
        with open(SHMEM_THP) as f:
            words = f.read().split()
    except OSError:
        return ""
    return next((w[1:-1] for w in words if w.startswith("[") and w.endswith("]")), "")


def _shmem_thp_honours_advice() -> bool:
    return shmem_thp_setting() in ("advise", "within_size", "always", "force")


def check_huge_pages(value: object, field: str = "huge_pages") -> str:
    """`value` when it is one of HUGE_PAGES, else ValueError naming `field`."""
    if not isinstance(value, str) or value not in HUGE_PAGES:
        raise ValueError(f"{field}: must be one of {', '.join(HUGE_PAGES)}, got {value!r}")
    return value


class HostShm:
    """Mapped shared memory. `buf` is a writable memoryview of the whole object.

    `fd` is the object's fd for as long as this handle is open when it keeps one (a memfd, whose
    fd is the only way to name it; HostShm.from_fd), else -1 (a named object: hiqcache.Client
    opens it by name). `name` is the shm name of a named object, "memfd:<tag>" for a memfd.
    `huge_pages` is what create_memfd got for its pages (one of HUGE_PAGE_BACKINGS); "none" for
    objects made or opened otherwise, whatever backs them."""

    def __init__(self, name: str, size: int, fd: int, owner: bool, keep_fd: bool = False,
                 populate: bool = False):
        self.name = name if keep_fd else normalize_name(name)
        self.size = size
        self.owner = owner  # created here: close() unlinks a named object
        self.huge_pages = "none"
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags,
                                                     mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if keep_fd:
            self.fd = fd
        else:
            os.close(fd)
            self.fd = -1
        self.buf = memoryview(self._mmap)

    @property
    def is_memfd(self) -> bool:
        return self.name.startswith(MEMFD_PREFIX)

    @classmethod
    def create(cls, name: str, size: int, populate: bool = True) -> HostShm:
        """A new zero-filled named object of `size` bytes, mode 0600. FileExistsError if taken.
        Prefer create_memfd unless another process must open the object by name.

        With `populate` (the default) its pages are allocated now, on this process's account
        (MAP_POPULATE): hiqcached charges pages of lent memory that it has to fault in itself to
        the client's max_faulted_bytes_per_client, and refuses the work beyond it."""
        if size <= 0:
            raise ValueError(f"size: must be > 0, got {size}")
        name = normalize_name(name)
        path = SHM_DIR + name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(name, size, fd, owner=True, populate=populate)

    @classmethod
    def create_memfd(cls, tag: str, size: int, populate: bool = True,
                     huge_pages: str = "off") -> HostShm:
        """A new zero-filled memfd of `size` bytes (close-on-exec), sealed with F_SEAL_SHRINK so
        that no process can shrink it under the daemon's mapping, and with F_SEAL_GROW: its size
        is final (then the daemon can tell from one fstat that none of its pages is missing,
        instead of asking per layer and block). It has no name: nothing is left behind when this
        process dies, and only processes given its fd can map it.
        `populate`: as for create.

        `huge_pages` (HUGE_PAGES): "auto" and "require" try MFD_HUGETLB first, its size rounded
        up to whole huge pages (`size` reports the rounded size), and fall back to a plain memfd
        when the hugetlb pool cannot reserve it; a plain memfd is then advised MADV_HUGEPAGE.
        `huge_pages` of the result says what it got; "require" raises ValueError, naming both
        reasons, when it got neither. hiqcached maps a hugetlb memfd only while every page of it
        is allocated (it never allocates hugetlb pages for a client): lend one made with
        `populate=False` only once every page was written."""
        check_huge_pages(huge_pages)
        if size <= 0:
            raise ValueError(f"size: must be > 0, got {size}")
        label = f"hiq-{tag}"
        hugetlb_error = ""
        if huge_pages != "off":
            try:
                return cls._memfd(label, size, populate, hugetlb=True)
            except OSError as err:  # no hugetlb pool to reserve from, or no hugetlbfs
                hugetlb_error = str(err)
        shm = cls._memfd(label, size, populate, hugetlb=False)
        if huge_pages == "off":
            return shm
        assert shm._mmap is not None
        advised = ""
        try:
            shm._mmap.madvise(mmap.MADV_HUGEPAGE)
        except OSError as err:
            advised = str(err)
        if not advised and _shmem_thp_honours_advice():
            shm.huge_pages = "thp"
        elif huge_pages == "require":
            shm.close()
            thp = shmem_thp_setting() or "unreadable"
            raise ValueError(
                f"huge_pages=require: memfd {label} of {size} bytes got no huge pages: hugetlb: "
                f"{hugetlb_error}; transparent huge pages: "
                + (f"madvise(MADV_HUGEPAGE): {advised}" if advised else
                   f"{SHMEM_THP} is {thp!r} (advise, within_size, always or force would honour "
                   "MADV_HUGEPAGE)")
                + " (reserve hugetlb pages with vm.nr_hugepages, or set shmem_enabled to advise, "
                "or ask for huge_pages=auto)")
        return shm

    @classmethod
    def _memfd(cls, label: str, size: int, populate: bool, hugetlb: bool) -> HostShm:
        """One create_memfd attempt; OSError when it fails (ENOMEM from mmap: the hugetlb pool
        cannot reserve the object)."""
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugetlb else 0)
        fd = os.memfd_create(label, flags)
        try:
            if hugetlb:
                # A hugetlbfs file holds whole huge pages: ftruncate and munmap take nothing else.
                page = os.fstat(fd).st_blksize
                size = -(-size // page) * page
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        except BaseException:
            os.close(fd)
            raise
        # For MFD_HUGETLB the mmap reserves the object's pages in the hugetlb pool (ENOMEM when
        # it cannot); __init__ closes the fd when it fails.
        shm = cls(MEMFD_PREFIX + label, size, fd, owner=True, keep_fd=True, populate=populate)
        shm.huge_pages = "hugetlb" if hugetlb else "none"
        return shm

    @classmethod
    def open(cls, name: str, min_size: int = 0) -> HostShm:
        """Maps an existing object (its whole size); ValueError when smaller than min_size."""
        name = normalize_name(name)
        fd = os.open(SHM_DIR + name, os.O_RDWR | os.O_CLOEXEC)
        size = os.fstat(fd).st_size
        if size < max(min_size, 1):
            os.close(fd)
            raise ValueError(f"shm object {name} holds {size} bytes, need {min_size}")
        return cls(name, size, fd, owner=False)

    @classmethod
    def from_fd(cls, fd: int, min_size: int = 0, tag: str = "fd") -> HostShm:
        """Maps the object behind `fd` (a memfd or shm fd, open read-write; its whole size),
        keeping a duplicate of the fd (the caller's stays the caller's). ValueError when smaller
        than min_size."""
        own = os.dup(fd)
        os.set_inheritable(own, False)
        size = os.fstat(own).st_size
        if size < max(min_size, 1):
            os.close(own)
            raise ValueError(f"fd {fd} holds {size} bytes, need {min_size}")
        return cls(MEMFD_PREFIX + tag, size, own, owner=False, keep_fd=True)

    def shared_buffer(self) -> SharedBuffer:
        """This object as a registered buffer: by fd when this handle keeps one, else by name."""
        from hiqcache.spec import SharedBuffer

        if self.fd >= 0:
            return SharedBuffer(size_bytes=self.size, host_fd=self.fd)
        return SharedBuffer(size_bytes=self.size, host_shm_name=self.name)

    def array(self, dtype: npt.DTypeLike = np.uint8) -> np.ndarray:
        """The whole object as a flat numpy array (no copy). ValueError once closed."""
        if self._mmap is None:
            raise ValueError(f"HostShm {self.name}: closed")
        return np.frombuffer(self._mmap, dtype=dtype)

    def close(self) -> None:
        """Unmaps and closes the fd it keeps; unlinks too when this handle created a named
        object. Idempotent. A memfd's memory is freed once no fd or mapping is left (the
        daemon's go with its registration)."""
        if self._mmap is None:
            return
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            # numpy arrays or tensors still view the mapping: it stays until they are gone.
            pass
        self._mmap = None
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        if self.owner and not self.is_memfd:
            try:
                os.unlink(SHM_DIR + self.name)
            except FileNotFoundError:
                pass

    def __enter__(self) -> HostShm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostEventPool:
    """`count` 64-byte ticket slots in a shm object (a memfd unless created by name)."""

    def __init__(self, shm: HostShm, count: int):
        if shm.size < count * SLOT_BYTES:
            raise ValueError(f"{shm.name} holds {shm.size} bytes, {count} slots need "
                             f"{count * SLOT_BYTES}")
        self.shm = shm
        self.count = count
        self._slots: np.ndarray | None = (
            shm.array(np.uint64)[: count * (SLOT_BYTES // 8)].reshape(count, -1))

    @classmethod
    def create(cls, count: int, name: str = "") -> HostEventPool:
        """`count` zeroed slots: in a memfd (HostShm.create_memfd) unless a shm `name` is given
        (for another process that must open them by name)."""
        if count <= 0:
            raise ValueError(f"count: must be > 0, got {count}")
        if name:
            return cls(HostShm.create(name, count * SLOT_BYTES), count)
        return cls(HostShm.create_memfd("ev", count * SLOT_BYTES), count)

    @property
    def name(self) -> str:
        return self.shm.name

    def spec(self) -> EventPoolSpec:
        from hiqcache.spec import EventPoolSpec

        if self.shm.fd >= 0:
            return EventPoolSpec(host_fd=self.shm.fd, count=self.count)
        return EventPoolSpec(host_shm_name=self.name, count=self.count)

    def _words(self) -> np.ndarray:
        """The slots as [count, 8] uint64 words (a slot's ticket is its first). ValueError once
        closed."""
        if self._slots is None:
            raise ValueError(f"HostEventPool {self.shm.name}: closed")
        return self._slots

    def read(self, slot: int) -> int:
        return int(self._words()[slot, 0])

    def store(self, slot: int, value: int) -> None:
        """E.g. to tell the daemon that a request's wait_event is satisfied."""
        self._words()[slot, 0] = value

    def reset(self) -> None:
        """Zeroes every slot. Only while no daemon holds them: a registered slot never moves
        backwards."""
        self._words()[:, 0] = 0

    def release(self, highest: int, slots: Iterable[int] | None = None) -> int:
        """Stores highest | EVENT_FAILED_BIT in each of `slots` (default: every slot) whose
        ticket part is below `highest` and returns how many: what a client does for the slots a
        daemon whose session ended was to store tickets into (docs/design.md "A dead daemon releases
        the engine"). A slot never moves backwards; indices out of range are ignored.

        Python has no compare-and-swap on shared memory, so each slot is read, then stored only
        when its ticket part is below: a daemon store between the two cannot occur, since the
        daemon that held the slots is gone (a store of its device still in flight is what the
        second pass a second later covers)."""
        if highest <= 0:
            return 0
        marked = (highest & TICKET_MASK) | EVENT_FAILED_BIT
        words = self._words()
        n = 0
        for i in range(self.count) if slots is None else slots:
            if 0 <= i < self.count and (int(words[i, 0]) & TICKET_MASK) < highest:
                words[i, 0] = marked
                n += 1
        return n

    def wait(self, slot: int, ticket: int, timeout: float) -> Status:
        """Waits until the slot holds a value >= ticket: spins briefly, then sleeps with growing
        backoff (up to 1 ms). OK; ABORTED when the slot reached `ticket` with the failed bit set
        (the daemon failed the work, or the client released the slots of a daemon that is gone:
        treat its rows as a miss); DEADLINE_EXCEEDED after `timeout` seconds."""
        if not 0 <= slot < self.count:
            return Status(StatusCode.INVALID_ARGUMENT,
                          f"slot {slot} out of range [0, {self.count})")
        deadline = time.monotonic() + timeout
        sleep = 0.0
        spins = 0
        while True:
            value = int(self._words()[slot, 0])
            done = value & TICKET_MASK
            if done >= ticket:
                if value & EVENT_FAILED_BIT:
                    return Status(StatusCode.ABORTED, f"slot {slot} holds {done} with the failed "
                                  f"bit: work {ticket} may not have written its rows (treat as "
                                  "a miss)")
                return Status.OK
            if time.monotonic() >= deadline:
                return Status(StatusCode.DEADLINE_EXCEEDED,
                              f"slot {slot} holds {value}, waited {timeout:.3f} s for {ticket}")
            spins += 1
            if spins > 64:
                sleep = min(max(sleep * 2, 20e-6), 1e-3)
                time.sleep(sleep)

    def close(self) -> None:
        """Unmaps the slots (and closes their fd). Idempotent."""
        self._slots = None
        self.shm.close()
