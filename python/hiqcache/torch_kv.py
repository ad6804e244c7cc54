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
  CudaEventPool                  interprocess CUDA events for EventPoolSpec

CUDA event rules (DESIGN.md "CUDA completion and event rules"): the engine records wait_event on
its stream before it sends a request and does not record it again before the reply; once an
asynchronous reply has arrived, it makes its streams wait on the layer and done events (a stream
wait captures the event's most recent record) before it sends another request naming them.
The CUDA parts need a GPU; they are written against PyTorch's documented IPC semantics and have
not run on one yet.
"""

from __future__ import annotations

import os
import re

import torch

from hiqcache.host import HostShm
from hiqcache.spec import EventPoolSpec, TensorView
from hiqcache.torch_ipc import EXPANDABLE_SEGMENTS_MESSAGE, parse_torch_ipc_handle


def paged_view(t: torch.Tensor, buffer: int, offset_bytes: int) -> TensorView:
    """TensorView of `t` = [blocks, block_size, heads, head_dim] (row = block * block_size +
    token), whose first element lies offset_bytes from the start of buffer `buffer`.
    ValueError for a layout TensorView cannot express (head_dim not contiguous, negative or
    zero strides)."""
    if t.dim() != 4:
        raise ValueError(f"paged_view: need [blocks, block_size, heads, head_dim], got {tuple(t.shape)}")
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


def memfd_tensor(dtype: torch.dtype, shape: tuple[int, ...], tag: str = "torch-kv"
                 ) -> tuple[HostShm, torch.Tensor]:
    """A zeroed tensor of `shape` in a new memfd sealed against shrinking (HostShm.create_memfd),
    and that HostShm: register it as shm.shared_buffer() (by fd, over the client's session), keep
    it open while the pool is registered, close it after release_pool."""
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    shm = HostShm.create_memfd(tag, max(nbytes, 1))
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
    opens it once and addresses t through the offset (DESIGN.md SharedBuffer).

    ValueError for a tensor not on a GPU, for memory in PyTorch's expandable segments (set
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False) and for a PyTorch handle this module does
    not know (hiqcache.torch_ipc)."""
    if not t.is_cuda:
        raise ValueError("cuda_export: not a CUDA tensor")
    if expandable_segments_enabled():
        raise ValueError(f"cuda_export: {EXPANDABLE_SEGMENTS_MESSAGE}")
    storage = t.untyped_storage()
    # (device, handle, storage bytes, storage offset from the allocation base, ...)
    shared = storage._share_cuda_()
    try:
        handle = parse_torch_ipc_handle(shared[1])
    except ValueError as err:
        raise ValueError(f"cuda_export: {err}") from None
    size, base_offset = int(shared[2]), int(shared[3])
    return handle, base_offset + t.storage_offset() * t.element_size(), base_offset + size


def cuda_device_uuid(device: int) -> str:
    """"GPU-xxxxxxxx-..." as hiqcached and nvidia-smi name the device."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


class CudaEventPool:
    """`count` interprocess events (no timing) on `device`, owned here; the daemon's opened
    copies stay valid until it releases the registration."""

    def __init__(self, count: int, device: int):
        with torch.cuda.device(device):
            self.events = [torch.cuda.Event(enable_timing=False, interprocess=True)
                           for _ in range(count)]
            for e in self.events:
                e.record()  # creates the event on this device
        self.device = device

    def spec(self) -> EventPoolSpec:
        return EventPoolSpec(cuda_ipc_event_handles=tuple(bytes(e.ipc_handle())
                                                          for e in self.events))

    def record(self, i: int, stream: "torch.cuda.Stream | None" = None) -> None:
        """Records event i, e.g. as a request's wait_event, on `stream` (default: current)."""
        self.events[i].record(stream)

    def wait(self, i: int, stream: "torch.cuda.Stream | None" = None) -> None:
        """Makes later work on `stream` wait for event i's most recent record: call it after the
        daemon's reply to the request that records it."""
        (stream or torch.cuda.current_stream(self.device)).wait_event(self.events[i])
