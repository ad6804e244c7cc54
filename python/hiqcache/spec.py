"""What an engine tells hiqcached about its KV pool (docs/design.md "Wire contract").

Plain Python mirrors of RegisterPoolRequest's pieces, so that engine code never builds protobuf
messages itself; `hiqcache.client` converts them. Value types, safe to share between threads.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import cast

from hiqcache.v1 import cache_pb2 as pb

ELEMENT_BYTES = 2  # BF16 and FP16


class DType(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"


class Attention(enum.Enum):
    MHA = "mha"  # K and V rows per token and layer
    MLA = "mla"  # one latent row per token and layer, no V


class Codec(enum.Enum):
    """Codecs by their contract names: the lower-case enum name without `CODEC_`."""

    INT8_PER_HEAD = "int8_per_head"
    RAW = "raw"
    FP8_E4M3_PER_HEAD = "fp8_e4m3_per_head"  # E4M3 codes + a BF16 scale per head: INT8's size
    # int4 codes + a BF16 scale per 32 elements of a head (head_dim % 32 == 0): 0.55x INT8's size
    INT4_G32_PER_HEAD = "int4_g32_per_head"
    # int4, KIVI-style: K per channel (zero point + BF16 scale over a block's tokens), V as
    # INT4_G32_PER_HEAD (head_dim % 32 == 0)
    INT4_KIVI = "int4_kivi"
    # int4 after a per-head Walsh-Hadamard rotation, each block's first token as an INT8 row: K per
    # channel over the block's other tokens, V per group of 32, each a zero point + BF16 scale
    # (head_dim % 32 == 0)
    INT4_HADAMARD = "int4_hadamard"
    # Keys turned back by RoPE within the block (Geometry.rope_theta) at 2-8 bits per channel
    # allotted by range (5.25 on average), values Hadamard-rotated at 5 bits per head, each block's
    # first token as an INT8 row (head_dim % 32 == 0; K and V planes, not MLA; CUDA pools take
    # head_dim up to 256)
    INT5_ALLOT = "int5_allot"
    # INT5_ALLOT's format with values at 6 bits (its keys at 5.25 bits on average)
    INT6_ALLOT = "int6_allot"
    # INT5_ALLOT's format with keys at 4.4375 bits on average and values at 4 bits
    INT4_ALLOT = "int4_allot"

    @classmethod
    def parse(cls, name: str) -> Codec:
        """The codec called `name`; ValueError naming the accepted names otherwise."""
        for c in cls:
            if c.value == name:
                return c
        accepted = ", ".join(repr(c.value) for c in cls)
        raise ValueError(f"unknown codec {name!r}: expected one of {accepted}")


class DeviceKind(enum.Enum):
    HOST = "host"
    CUDA = "cuda"


_DTYPE_PB = {DType.BF16: pb.DTYPE_BF16, DType.FP16: pb.DTYPE_FP16}
_ATTENTION_PB = {Attention.MHA: pb.ATTENTION_MHA, Attention.MLA: pb.ATTENTION_MLA}
# A codec's wire name is its value, upper case, after "CODEC_" (int8_per_head:
# CODEC_INT8_PER_HEAD); a Codec the proto lacks fails here, at import.
_CODEC_PB = {c: cast("pb.Codec", pb.Codec.Value("CODEC_" + c.value.upper())) for c in Codec}
_DEVICE_PB = {DeviceKind.HOST: pb.DEVICE_KIND_HOST, DeviceKind.CUDA: pb.DEVICE_KIND_CUDA}
CODEC_FROM_PB = {v: k for k, v in _CODEC_PB.items()}
DEVICE_FROM_PB = {v: k for k, v in _DEVICE_PB.items()}


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_kv_heads: int  # heads local to this rank
    head_dim: int
    dtype: DType = DType.BF16
    attention: Attention = Attention.MHA
    tp_rank: int = 0
    tp_size: int = 1
    # The model's rotary embedding (Geometry.rope), used only by codecs that turn keys
    # (Codec.INT4_ALLOT, INT5_ALLOT, INT6_ALLOT) and then part of the namespace: rope_theta is the
    # model's RoPE base (its config's rope_theta: 1e6 for Qwen3, 1e5 for SmolLM2), 0 = none or
    # unknown (no turn); rope_interleaved pairs (2i, 2i+1) as GPT-J, else rotate-half pairs
    # (i, i + head_dim/2) as Llama, Qwen and NeoX.
    rope_theta: float = 0.0
    rope_interleaved: bool = False

    def __post_init__(self) -> None:
        theta = self.rope_theta
        if (isinstance(theta, bool) or not isinstance(theta, (int, float))
                or not math.isfinite(theta) or (theta != 0 and not 1 <= theta <= 1e12)):
            raise ValueError("geometry.rope_theta: must be 0 (no rotary embedding) or in "
                             f"[1, 1e12], got {theta!r}")
        if not isinstance(self.rope_interleaved, bool):
            raise ValueError(
                f"geometry.rope_interleaved: must be a bool, got {self.rope_interleaved!r}")

    @property
    def head_bytes(self) -> int:
        return self.head_dim * ELEMENT_BYTES

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    @property
    def planes(self) -> int:
        return 1 if self.attention is Attention.MLA else 2

    @property
    def bytes_per_token(self) -> int:
        """Engine-side (BF16/FP16) bytes of one token across all layers."""
        return self.num_layers * self.planes * self.row_bytes

    def to_proto(self) -> pb.Geometry:
        out = pb.Geometry(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            dtype=_DTYPE_PB[self.dtype], attention=_ATTENTION_PB[self.attention],
            tp_rank=self.tp_rank, tp_size=self.tp_size)
        if self.rope_theta != 0 or self.rope_interleaved:  # unset otherwise, as before
            out.rope.theta = float(self.rope_theta)
            out.rope.interleaved = self.rope_interleaved
        return out


@dataclass(frozen=True)
class TensorView:
    """A strided view of one K, V or latent tensor (docs/design.md TensorView).

    Row r is page p = r // page_rows, t = r % page_rows when paged (page_rows > 0), else p = 0,
    t = r; head h of row r starts at base(buffer) + offset_bytes + p * page_stride_bytes +
    t * row_stride_bytes + h * head_stride_bytes (0 = head_dim elements) and holds head_dim
    contiguous elements. Split addressing (HOST pools; 0 = not split): with row_group > 0, slot
    t is at (t // row_group) * row_group_stride_bytes + (t % row_group) * row_stride_bytes; with
    dim_run > 0 (a divisor of head_dim) the head is head_dim // dim_run runs of dim_run
    elements, run j at j * dim_run_stride_bytes from the head's start; with dim_stride_bytes > 0
    element i of a run is at i * dim_stride_bytes from the run's start (0: 2 bytes, contiguous).
    """

    buffer: int
    offset_bytes: int
    row_stride_bytes: int
    num_rows: int
    head_stride_bytes: int = 0
    page_rows: int = 0
    page_stride_bytes: int = 0
    row_group: int = 0
    row_group_stride_bytes: int = 0
    dim_run: int = 0
    dim_run_stride_bytes: int = 0
    dim_stride_bytes: int = 0

    def to_proto(self) -> pb.TensorView:
        return pb.TensorView(
            buffer=self.buffer, offset_bytes=self.offset_bytes,
            row_stride_bytes=self.row_stride_bytes, num_rows=self.num_rows,
            head_stride_bytes=self.head_stride_bytes, page_rows=self.page_rows,
            page_stride_bytes=self.page_stride_bytes, row_group=self.row_group,
            row_group_stride_bytes=self.row_group_stride_bytes, dim_run=self.dim_run,
            dim_run_stride_bytes=self.dim_run_stride_bytes, dim_stride_bytes=self.dim_stride_bytes)


@dataclass(frozen=True)
class LayerView:
    k: TensorView
    v: TensorView | None = None  # None for MLA

    def to_proto(self) -> pb.LayerView:
        out = pb.LayerView(k=self.k.to_proto())
        if self.v is not None:
            out.v.CopyFrom(self.v.to_proto())
        return out


@dataclass(frozen=True)
class SharedBuffer:
    """One registered memory object. HOST: a file descriptor this process holds (`host_fd`, e.g.
    a memfd: preferred, see HostShm.shared_buffer) or a POSIX shm name; CUDA: an IPC handle
    (64 bytes).

    hiqcache.Client passes HOST objects to the daemon as fds over its session: `host_fd` as is
    (borrowed: it must stay open while the pool may re-register, i.e. until release_pool), a
    name by an fd it opens with this process's rights and closes after the call. Without a
    session (a TCP target) it sends the name; a buffer with only an fd then cannot register."""

    size_bytes: int
    host_shm_name: str = ""
    cuda_ipc_handle: bytes = b""
    host_fd: int = -1

    def to_proto(self) -> pb.SharedBuffer:
        """The name form; the client replaces HOST handles by the fd ids of its session."""
        if self.cuda_ipc_handle:
            return pb.SharedBuffer(cuda_ipc_handle=self.cuda_ipc_handle, size_bytes=self.size_bytes)
        return pb.SharedBuffer(host_shm_name=self.host_shm_name, size_bytes=self.size_bytes)


@dataclass(frozen=True)
class EventPoolSpec:
    """`count` 64-byte ticket slots, for every device kind, in an object named like
    SharedBuffer's (`host_fd` preferred, or `host_shm_name`): HostEventPool.spec(),
    torch_kv.CudaTicketSlots.spec(). The daemon refuses `cuda_ipc_event_handles`
    (docs/design.md "Completion: ticket slots")."""

    host_shm_name: str = ""
    count: int = 0
    cuda_ipc_event_handles: tuple[bytes, ...] = ()
    host_fd: int = -1

    def to_proto(self) -> pb.EventPool:
        return pb.EventPool(host_shm_name=self.host_shm_name, count=self.count,
                            cuda_ipc_event_handles=list(self.cuda_ipc_event_handles))


@dataclass(frozen=True)
class PoolSpec:
    """Everything RegisterPool sends; the client adds client_pid."""

    model: str  # model name + revision (+ anything else that changes the KV)
    geometry: Geometry
    block_tokens: int
    buffers: tuple[SharedBuffer, ...]
    layers: tuple[LayerView, ...]  # one per geometry.num_layers
    tenant: str = ""
    codec: Codec = Codec.INT8_PER_HEAD
    device: DeviceKind = DeviceKind.HOST
    cuda_device_uuid: str = ""
    events: EventPoolSpec = field(default_factory=EventPoolSpec)

    def namespace(self) -> NamespaceRef:
        return NamespaceRef(model=self.model, tenant=self.tenant, geometry=self.geometry,
                            block_tokens=self.block_tokens, codec=self.codec)

    def to_proto(self, client_pid: int) -> pb.RegisterPoolRequest:
        return pb.RegisterPoolRequest(
            model=self.model, tenant=self.tenant, geometry=self.geometry.to_proto(),
            block_tokens=self.block_tokens, codec=_CODEC_PB[self.codec],
            device=pb.Device(kind=_DEVICE_PB[self.device], cuda_device_uuid=self.cuda_device_uuid),
            buffers=[b.to_proto() for b in self.buffers],
            layers=[v.to_proto() for v in self.layers],
            events=self.events.to_proto(), client_pid=client_pid)


@dataclass(frozen=True)
class NamespaceRef:
    """A namespace named by its parts, for callers that hold no pool (an engine's scheduler)."""

    model: str
    geometry: Geometry
    block_tokens: int
    codec: Codec = Codec.INT8_PER_HEAD
    tenant: str = ""

    def to_proto(self) -> pb.NamespaceRef:
        return pb.NamespaceRef(model=self.model, tenant=self.tenant,
                               geometry=self.geometry.to_proto(),
                               block_tokens=self.block_tokens, codec=_CODEC_PB[self.codec])


@dataclass(frozen=True)
class RegisteredPool:
    """The daemon's answer to RegisterPool."""

    pool_id: int  # the daemon's id; changes when the client re-registers
    namespace_id: str
    encoded_bytes_per_token: int
    block_bytes: int
    capacity_tokens: int


# --- Layouts (the C++ client's layouts.h) ---------------------------------------------------------


def slot_major_view(g: Geometry, num_slots: int, buffer: int, offset_bytes: int) -> TensorView:
    """SGLang-style [num_slots, heads, head_dim]."""
    return TensorView(buffer=buffer, offset_bytes=offset_bytes, row_stride_bytes=g.row_bytes,
                      num_rows=num_slots)


def slot_major_bytes(g: Geometry, num_slots: int) -> int:
    return g.row_bytes * num_slots

