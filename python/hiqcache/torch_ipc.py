"""PyTorch's CUDA IPC storage handles, read without torch (hiqcache.torch_kv.cuda_export uses it).

`storage._share_cuda_()[1]` is the string c10's CUDACachingAllocator::shareIpcHandle writes:

    [version: 1 byte][type: 1 byte][payload]

version is SHAREABLE_HANDLE_VERSION (2 up to torch 2.12, 3 from torch 2.13; the 'c' payload is
the same in every version known here). type 'c' is a block of cudaMalloc memory, and its payload
the 64-byte cudaIpcMemHandle_t that hiqcached opens with cudaIpcOpenMemHandle; type 'e' is an
expandable segment (virtual memory from cuMemCreate), whose payload is no cudaIpcMemHandle_t and
which CUDA IPC cannot open.
"""

from __future__ import annotations

__all__ = ["CUDA_IPC_HANDLE_BYTES", "KNOWN_HANDLE_VERSIONS", "parse_torch_ipc_handle"]

CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
KNOWN_HANDLE_VERSIONS = (1, 2, 3)
_HEADER_BYTES = 2
_CUDA_MALLOC = ord("c")
_EXPANDABLE_SEGMENT = ord("e")

EXPANDABLE_SEGMENTS_MESSAGE = (
    "PyTorch's expandable segments (VMM memory) cannot be shared by CUDA IPC; set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")


def parse_torch_ipc_handle(raw: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside a handle from `storage._share_cuda_()[1]`.

    ValueError, naming what was expected, for: a string of the wrong length (a 'c' handle is
    exactly 2 + 64 bytes; a bare 64-byte cudaIpcMemHandle_t is not a PyTorch handle), a version
    other than KNOWN_HANDLE_VERSIONS (a newer torch), an expandable segment ('e'), or another
    type."""
    raw = bytes(raw)
    want = _HEADER_BYTES + CUDA_IPC_HANDLE_BYTES
    layout = (f"{want} bytes: a version byte, type 'c', the {CUDA_IPC_HANDLE_BYTES}-byte "
              "cudaIpcMemHandle_t")
    if len(raw) == CUDA_IPC_HANDLE_BYTES:
        raise ValueError(f"PyTorch CUDA IPC handle: {len(raw)} bytes, the size of a bare "
                         f"cudaIpcMemHandle_t; expected PyTorch's handle of {layout}")
    if len(raw) < _HEADER_BYTES:
        raise ValueError(f"PyTorch CUDA IPC handle: {len(raw)} bytes, expected {layout}")
    version, kind = raw[0], raw[1]
    if version not in KNOWN_HANDLE_VERSIONS:
        known = ", ".join(str(v) for v in KNOWN_HANDLE_VERSIONS)
        raise ValueError(f"PyTorch CUDA IPC handle: version {version}, known versions are "
                         f"{known} (a newer torch than this hiqcache knows)")
    if kind == _EXPANDABLE_SEGMENT:
        raise ValueError(f"PyTorch CUDA IPC handle of an expandable segment: "
                         f"{EXPANDABLE_SEGMENTS_MESSAGE}")
    if kind != _CUDA_MALLOC:
        raise ValueError(f"PyTorch CUDA IPC handle: type byte {kind:#04x}, expected "
                         f"{_CUDA_MALLOC:#04x} ('c', a cudaMalloc block)")
    if len(raw) != want:
        raise ValueError(f"PyTorch CUDA IPC handle: {len(raw)} bytes, expected {layout}")
    return raw[_HEADER_BYTES:]
