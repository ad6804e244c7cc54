"""PyTorch tensors as hiqcached buffers and views (imports torch; `import hiqcache` does not).

  paged_view(t, buffer, offset)  the TensorView of a [blocks, block_size, heads, head_dim] tensor
                                 view with any strides whose head_dim is contiguous (vLLM's
                                 FlashAttention pages [2][blocks][block_size][heads][dim], K|V
                                 packed pages, SGLang's [slots][heads][dim] with blocks = 1 ...)
  shm_tensor(shm, dtype, shape)  a tensor over a HostShm (HOST device: the daemon reads and
                                 writes the engine's KV in place)
  memfd_tensor(dtype, shape)     a new sealed memfd (HostShm.create_memfd) and a tensor over it:
                                 the preferred HOST buffer, registered by fd (shm.shared_buffer())
  cuda_export(t)                 CUDA device: the cudaIpcMemHandle_t of the allocation holding t
                                 (the base of PyTorch's caching-allocator segment), the byte
                                 offset of t's first element from that base, and the bytes from
                                 the base to the end of t's storage
  CudaTicketSlots                ticket slots for a CUDA pool: host memory page-locked for the
                                 GPU, which this process's streams wait on and store into

Completion on CUDA (docs/design.md "Completion: ticket slots"): the engine stores a request's
wait_value into its wait_event slot from the stream that wrote (or last reads) the rows
(CudaTicketSlots.write_on_stream) before or after sending the request; the daemon starts the
work once it sees the value from the host. With an asynchronous reply's ticket T the engine makes
the stream that reads the rows wait for slot >= T (wait_on_stream) or waits from the host (wait).
The CUDA parts need a GPU and are written against the CUDA driver API's documentation.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import threading

import torch

from hiqcache.host import SLOT_BYTES, HostEventPool, HostShm
from hiqcache.spec import TensorView
from hiqcache.torch_ipc import EXPANDABLE_SEGMENTS_MESSAGE, parse_torch_ipc_handle

log = logging.getLogger("hiqcache")


def paged_view(t: torch.Tensor, buffer: int, offset_bytes: int) -> TensorView:
    """TensorView of `t` = [blocks, block_size, heads, head_dim] (row = block * block_size +
    token), whose first element lies offset_bytes from the start of buffer `buffer`.
    ValueError for a layout TensorView cannot express (head_dim not contiguous, negative or
    zero strides)."""
    if t.dim() != 4:
        raise ValueError("paged_view: need [blocks, block_size, heads, head_dim], "
                         f"got {tuple(t.shape)}")
    if t.element_size() != 2:
        raise ValueError(f"paged_view: need a 2-byte dtype (bf16/fp16), got {t.dtype}")
    blocks, bs, heads, dim = t.shape
    sb, st, sh, sd = t.stride()
    if sd != 1 and dim > 1:
        raise ValueError(f"paged_view: head_dim must be contiguous (stride {sd})")
    if min(sb, st, sh) <= 0:
        raise ValueError(f"paged_view: strides must be positive, got {t.stride()}")
    es = t.element_size()
    return TensorView(buffer=buffer, offset_bytes=offset_bytes, row_stride_bytes=st * es,
                      num_rows=blocks * bs, head_stride_bytes=sh * es, page_rows=bs,
                      page_stride_bytes=sb * es)


def shm_tensor(shm: HostShm, dtype: torch.dtype, shape: tuple[int, ...],
               offset_bytes: int = 0) -> torch.Tensor:
    """A tensor viewing shm's bytes from offset_bytes on (no copy); shm may be a memfd or a
    named object."""
    count = 1
    for n in shape:
        count *= n
    return torch.frombuffer(shm.buf, dtype=dtype, count=count,
                            offset=offset_bytes).view(shape)


def memfd_tensor(dtype: torch.dtype, shape: tuple[int, ...], tag: str = "torch-kv",
                 huge_pages: str = "off") -> tuple[HostShm, torch.Tensor]:
    """A zeroed tensor of `shape` in a new memfd sealed against shrinking (HostShm.create_memfd,
    on huge pages as `huge_pages` asks: its shm.huge_pages says what it got), and that HostShm:
    register it as shm.shared_buffer() (by fd, over the client's session), keep it open while the
    pool is registered, close it after release_pool."""
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    shm = HostShm.create_memfd(tag, max(nbytes, 1), huge_pages=huge_pages)
    try:
        return shm, shm_tensor(shm, dtype, shape)
    except BaseException:
        shm.close()
        raise


_EXPANDABLE = re.compile(r"(?:^|,)expandable_segments:(True|False)(?=,|$)")


def _expandable_setting(conf: str) -> bool | None:
    """The expandable_segments value a PyTorch allocator settings string sets; None if none."""
    found = _EXPANDABLE.findall("".join(conf.split()))
    return found[-1] == "True" if found else None


def expandable_segments_enabled() -> bool:
    """Whether PyTorch's CUDA caching allocator uses expandable segments, whose memory CUDA IPC
    cannot share. Never raises.

    Read from torch._C._accelerator_getAllocatorSettings() where this torch has it: the
    settings last applied, i.e. the string of the last
    torch.cuda.memory._set_allocator_settings / torch._C._accelerator_setAllocatorSettings
    call, else the environment's at start-up. That string decides when it names
    expandable_segments. Otherwise (a string that does not name it, or an older torch) the
    first variable set of those PyTorch reads decides: PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF,
    PYTORCH_HIP_ALLOC_CONF where the getter exists (c10's AcceleratorAllocatorConfig), else
    PYTORCH_CUDA_ALLOC_CONF first (older torch). A setting made at run time by a string that an
    even later call replaced is not seen; cuda_export's handle check still catches such
    memory."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
    if getter is not None:
        names = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
        try:
            setting = _expandable_setting(str(getter()))
        except Exception:  # a torch whose getter fails: the environment decides
            setting = None
        if setting is not None:
            return setting
    for name in names:
        conf = os.environ.get(name)
        if conf is not None:
            return bool(_expandable_setting(conf))
    return False


def cuda_export(t: torch.Tensor) -> tuple[bytes, int, int]:
    """(cudaIpcMemHandle_t of the allocation base, offset of t's first element from it, bytes
    from the base to the end of t's storage). The handle names the allocation, not t: hiqcached
    opens it once and addresses t through the offset (docs/design.md SharedBuffer).

    ValueError for a tensor not on a GPU, for memory in PyTorch's expandable segments (set
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False) and for a PyTorch handle this module does
    not know (hiqcache.torch_ipc)."""
    if not t.is_cuda:
        raise ValueError("cuda_export: not a CUDA tensor")
    if expandable_segments_enabled():
        raise ValueError(f"cuda_export: {EXPANDABLE_SEGMENTS_MESSAGE}")
    storage = t.untyped_storage()
    # (device, handle, storage bytes, storage offset from the allocation base, ...)
    shared = storage._share_cuda_()  # type: ignore[no-untyped-call]  # unannotated in torch
    try:
        handle = parse_torch_ipc_handle(shared[1])
    except ValueError as err:
        raise ValueError(f"cuda_export: {err}") from None
    size, base_offset = int(shared[2]), int(shared[3])
    offset = base_offset + int(t.storage_offset()) * t.element_size()
    return handle, offset, base_offset + size


def cuda_device_uuid(device: int) -> str:
    """"GPU-xxxxxxxx-..." as hiqcached and nvidia-smi name the device."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


# cuda.h / cuda_runtime_api.h values.
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
_CUDA_HOST_REGISTER_PORTABLE = 0x1
_CUDA_HOST_REGISTER_MAPPED = 0x2


class _CudaDriver:
    """The few CUDA driver calls CudaTicketSlots needs, from libcuda.so.1 through ctypes."""

    _instance: _CudaDriver | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> _CudaDriver:
        """The process's instance; RuntimeError when libcuda.so.1 or a symbol is missing."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            # CUresult cuStreamWaitValue32_v2(CUstream, CUdeviceptr, cuuint32_t, unsigned int)
            self._wait32 = lib.cuStreamWaitValue32_v2
            # CUresult cuStreamWriteValue64_v2(CUstream, CUdeviceptr, cuuint64_t, unsigned int)
            self._write64 = lib.cuStreamWriteValue64_v2
            # CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr*, void*, unsigned int)
            self._host_device_pointer = lib.cuMemHostGetDevicePointer_v2
            # CUresult cuGetErrorName(CUresult, const char**)
            self._error_name = lib.cuGetErrorName
        except (OSError, AttributeError) as err:
            raise RuntimeError(f"CudaTicketSlots: the CUDA driver's stream memory operations "
                               f"are not available (libcuda.so.1, CUDA >= 11.7): {err}") from err
        self._wait32.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait32.restype = ctypes.c_int
        self._write64.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        self._write64.restype = ctypes.c_int
        self._host_device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                              ctypes.c_uint]
        self._host_device_pointer.restype = ctypes.c_int
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._error_name.restype = ctypes.c_int

    def _check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        name = ctypes.c_char_p()
        text = ""
        if self._error_name(rc, ctypes.byref(name)) == 0 and name.value:
            text = " " + name.value.decode("ascii", "replace")
        raise RuntimeError(f"{what}: CUDA driver error {rc}{text}")

    def host_device_pointer(self, host_ptr: int) -> int:
        """The device address of page-locked, mapped host memory (REQUIRES: a current
        context)."""
        out = ctypes.c_uint64()
        self._check(self._host_device_pointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0),
                    "cuMemHostGetDevicePointer")
        return out.value

    def wait_value32(self, stream: int, dev_ptr: int, value: int, flags: int) -> None:
        self._check(self._wait32(ctypes.c_void_p(stream), dev_ptr, value, flags),
                    "cuStreamWaitValue32")

    def write_value64(self, stream: int, dev_ptr: int, value: int, flags: int) -> None:
        self._check(self._write64(ctypes.c_void_p(stream), dev_ptr, value, flags),
                    "cuStreamWriteValue64")


def _device_index(device: int | str | torch.device | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"CudaTicketSlots: device {device!r} is not a CUDA device")
    return d.index if d.index is not None else torch.cuda.current_device()


class CudaTicketSlots(HostEventPool):
    """`count` ticket slots (docs/design.md "Completion: ticket slots") for a CUDA pool: a memfd
    sealed against shrinking, page-locked and mapped for the GPUs (cudaHostRegister, portable |
    mapped), so that this process's streams wait on and store into the slots the daemon maps.
    Register spec() as the pool's events (by fd, like HostEventPool's); hiqcache.Client
    releases these slots like a HostEventPool's when the daemon's session ends.

    From the host: read, store, wait (HostEventPool's). On a stream: wait_on_stream and
    write_on_stream. close() unregisters and unmaps; the pool must be released first.
    Thread-safety: as HostEventPool's; the stream methods only enqueue."""

    def __init__(self, count: int, device: int | str | torch.device | None = None):
        """RuntimeError when torch has no usable GPU, the CUDA driver lacks stream memory
        operations, or page-locking fails; ValueError for count <= 0 or a device that is not
        a GPU."""
        if count <= 0:
            raise ValueError(f"count: must be > 0, got {count}")
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTicketSlots: torch.cuda is not available (no GPU, or a torch "
                               "built without CUDA); a HOST pool uses HostEventPool")
        self.device = _device_index(device)
        self._driver = _CudaDriver.get()
        self._registered = False
        self._host_ptr = 0
        self.dev_ptr = 0  # the slots' device address (slot i at +64*i)
        # Whole pages: page-locking works on pages, and none is shared with other memory.
        size = -(-count * SLOT_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE
        super().__init__(HostShm.create_memfd("cuda-slots", size), count)
        try:
            self._host_ptr = self._words().ctypes.data
            with torch.cuda.device(self.device):
                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
                err = cudart.cudaHostRegister(
                    self._host_ptr, size, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED)
                if err != cudart.cudaError.success:
                    raise RuntimeError(f"CudaTicketSlots: cudaHostRegister of {size} bytes "
                                       f"failed: {cudart.cudaGetErrorString(err)}")
                self._registered = True
                self.dev_ptr = self._driver.host_device_pointer(self._host_ptr)
        except BaseException:
            self.close()
            raise

    def _slot_address(self, slot: int) -> int:
        if not 0 <= slot < self.count:
            raise IndexError(f"slot {slot} out of range [0, {self.count})")
        if not self._registered:
            raise ValueError("CudaTicketSlots: closed")
        return self.dev_ptr + slot * SLOT_BYTES

    def _stream(self, stream: torch.cuda.Stream | None) -> int:
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        return s.cuda_stream

    def wait_on_stream(self, slot: int, ticket: int,
                       stream: torch.cuda.Stream | None = None) -> None:
        """Makes later work on `stream` (default: the device's current stream) wait until the
        slot holds ticket `ticket` or a later one, failed or not.

        A 64-bit CU_STREAM_WAIT_VALUE_GEQ compares cyclically, (int64)(slot - ticket) >= 0, and
        never accepts a value with the failed bit (T | 2^63 is 2^63 or more past any ticket
        <= T), so a stream would stay blocked on a failed slot. This waits with
        cuStreamWaitValue32 GEQ (cyclic) on the slot's low 32-bit word, its first 4 bytes: the
        slot's ticket part must stay within 2^31 of `ticket`. The stream cannot tell a failed
        value from a completed one: read the slot (read, wait) before the rows are trusted.
        RuntimeError for a driver error."""
        if not 0 < ticket < 1 << 63:
            raise ValueError(f"ticket {ticket}: must be in [1, 2^63)")
        addr = self._slot_address(slot)  # little-endian: the low word is at the slot's start
        with torch.cuda.device(self.device):
            self._driver.wait_value32(self._stream(stream), addr, ticket & 0xFFFFFFFF,
                                      CU_STREAM_WAIT_VALUE_GEQ)

    def write_on_stream(self, slot: int, value: int,
                        stream: torch.cuda.Stream | None = None) -> None:
        """Has `stream` (default: the device's current stream) store `value` into the slot once
        the work enqueued on it before has completed, its memory writes included
        (cuStreamWriteValue64): how an engine tells the daemon that a request's rows are ready
        (the request's wait_event and wait_value). RuntimeError for a driver error."""
        if not 0 <= value < 1 << 64:
            raise ValueError(f"value {value}: must be in [0, 2^64)")
        addr = self._slot_address(slot)
        with torch.cuda.device(self.device):
            self._driver.write_value64(self._stream(stream), addr, value,
                                       CU_STREAM_WRITE_VALUE_DEFAULT)

    def close(self) -> None:
        """Unregisters the page-locked slots and unmaps them. Idempotent; never raises (an
        unregister failure is logged). No stream may still use the slots."""
        if self._registered:
            self._registered = False
            try:
                with torch.cuda.device(self.device):
                    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # unannotated in torch
                    err = cudart.cudaHostUnregister(self._host_ptr)
                    if err != cudart.cudaError.success:
                        log.warning("hiqcache: cudaHostUnregister of ticket slots failed: %s",
                                    cudart.cudaGetErrorString(err))
            except Exception as err:
                log.warning("hiqcache: cudaHostUnregister of ticket slots failed: %s", err)
        self.dev_ptr = 0
        if self._slots is not None:
            super().close()
