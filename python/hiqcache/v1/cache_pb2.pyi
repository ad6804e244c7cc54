from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_FP16: _ClassVar[DType]

class Attention(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTENTION_UNSPECIFIED: _ClassVar[Attention]
    ATTENTION_MHA: _ClassVar[Attention]
    ATTENTION_MLA: _ClassVar[Attention]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_INT8_PER_HEAD: _ClassVar[Codec]
    CODEC_RAW: _ClassVar[Codec]
    CODEC_FP8_E4M3_PER_HEAD: _ClassVar[Codec]
    CODEC_INT4_G32_PER_HEAD: _ClassVar[Codec]
    CODEC_INT4_KIVI: _ClassVar[Codec]
    CODEC_INT4_HADAMARD: _ClassVar[Codec]
    CODEC_INT5_ALLOT: _ClassVar[Codec]
    CODEC_INT6_ALLOT: _ClassVar[Codec]
    CODEC_INT4_ALLOT: _ClassVar[Codec]

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_KIND_UNSPECIFIED: _ClassVar[DeviceKind]
    DEVICE_KIND_HOST: _ClassVar[DeviceKind]
    DEVICE_KIND_CUDA: _ClassVar[DeviceKind]

class BlockStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STORED: _ClassVar[BlockStatus]
    BLOCK_ALREADY_PRESENT: _ClassVar[BlockStatus]
    BLOCK_REJECTED: _ClassVar[BlockStatus]
DTYPE_UNSPECIFIED: DType
DTYPE_BF16: DType
DTYPE_FP16: DType
ATTENTION_UNSPECIFIED: Attention
ATTENTION_MHA: Attention
ATTENTION_MLA: Attention
CODEC_INT8_PER_HEAD: Codec
CODEC_RAW: Codec
CODEC_FP8_E4M3_PER_HEAD: Codec
CODEC_INT4_G32_PER_HEAD: Codec
CODEC_INT4_KIVI: Codec
CODEC_INT4_HADAMARD: Codec
CODEC_INT5_ALLOT: Codec
CODEC_INT6_ALLOT: Codec
CODEC_INT4_ALLOT: Codec
DEVICE_KIND_UNSPECIFIED: DeviceKind
DEVICE_KIND_HOST: DeviceKind
DEVICE_KIND_CUDA: DeviceKind
BLOCK_STORED: BlockStatus
BLOCK_ALREADY_PRESENT: BlockStatus
BLOCK_REJECTED: BlockStatus

class Geometry(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "attention", "tp_rank", "tp_size", "rope")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    attention: Attention
    tp_rank: int
    tp_size: int
    rope: Rope
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., attention: _Optional[_Union[Attention, str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., rope: _Optional[_Union[Rope, _Mapping]] = ...) -> None: ...

class Rope(_message.Message):
    __slots__ = ("theta", "interleaved")
    THETA_FIELD_NUMBER: _ClassVar[int]
    INTERLEAVED_FIELD_NUMBER: _ClassVar[int]
    theta: float
    interleaved: bool
    def __init__(self, theta: _Optional[float] = ..., interleaved: _Optional[bool] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("kind", "cuda_device_uuid")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    kind: DeviceKind
    cuda_device_uuid: str
    def __init__(self, kind: _Optional[_Union[DeviceKind, str]] = ..., cuda_device_uuid: _Optional[str] = ...) -> None: ...

class SharedBuffer(_message.Message):
    __slots__ = ("host_shm_name", "cuda_ipc_handle", "host_fd_id", "size_bytes")
    HOST_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    HOST_FD_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    host_shm_name: str
    cuda_ipc_handle: bytes
    host_fd_id: int
    size_bytes: int
    def __init__(self, host_shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., host_fd_id: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class TensorView(_message.Message):
    __slots__ = ("buffer", "offset_bytes", "row_stride_bytes", "num_rows", "head_stride_bytes", "page_rows", "page_stride_bytes", "row_group", "row_group_stride_bytes", "dim_run", "dim_run_stride_bytes", "dim_stride_bytes")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    HEAD_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_ROWS_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_GROUP_FIELD_NUMBER: _ClassVar[int]
    ROW_GROUP_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIM_RUN_FIELD_NUMBER: _ClassVar[int]
    DIM_RUN_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIM_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    buffer: int
    offset_bytes: int
    row_stride_bytes: int
    num_rows: int
    head_stride_bytes: int
    page_rows: int
    page_stride_bytes: int
    row_group: int
    row_group_stride_bytes: int
    dim_run: int
    dim_run_stride_bytes: int
    dim_stride_bytes: int
    def __init__(self, buffer: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., row_stride_bytes: _Optional[int] = ..., num_rows: _Optional[int] = ..., head_stride_bytes: _Optional[int] = ..., page_rows: _Optional[int] = ..., page_stride_bytes: _Optional[int] = ..., row_group: _Optional[int] = ..., row_group_stride_bytes: _Optional[int] = ..., dim_run: _Optional[int] = ..., dim_run_stride_bytes: _Optional[int] = ..., dim_stride_bytes: _Optional[int] = ...) -> None: ...

class LayerView(_message.Message):
    __slots__ = ("k", "v")
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    k: TensorView
    v: TensorView
    def __init__(self, k: _Optional[_Union[TensorView, _Mapping]] = ..., v: _Optional[_Union[TensorView, _Mapping]] = ...) -> None: ...

class EventPool(_message.Message):
    __slots__ = ("host_shm_name", "count", "cuda_ipc_event_handles", "host_fd_id")
    HOST_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    HOST_FD_ID_FIELD_NUMBER: _ClassVar[int]
    host_shm_name: str
    count: int
    cuda_ipc_event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    host_fd_id: int
    def __init__(self, host_shm_name: _Optional[str] = ..., count: _Optional[int] = ..., cuda_ipc_event_handles: _Optional[_Iterable[bytes]] = ..., host_fd_id: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("model", "tenant", "geometry", "block_tokens", "codec", "device", "buffers", "layers", "events", "client_pid")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_FIELD_NUMBER: _ClassVar[int]
    model: str
    tenant: str
    geometry: Geometry
    block_tokens: int
    codec: Codec
    device: Device
    buffers: _containers.RepeatedCompositeFieldContainer[SharedBuffer]
    layers: _containers.RepeatedCompositeFieldContainer[LayerView]
    events: EventPool
    client_pid: int
    def __init__(self, model: _Optional[str] = ..., tenant: _Optional[str] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., block_tokens: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., device: _Optional[_Union[Device, _Mapping]] = ..., buffers: _Optional[_Iterable[_Union[SharedBuffer, _Mapping]]] = ..., layers: _Optional[_Iterable[_Union[LayerView, _Mapping]]] = ..., events: _Optional[_Union[EventPool, _Mapping]] = ..., client_pid: _Optional[int] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "namespace_id", "encoded_bytes_per_token", "block_bytes", "capacity_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    namespace_id: str
    encoded_bytes_per_token: int
    block_bytes: int
    capacity_tokens: int
    def __init__(self, pool_id: _Optional[int] = ..., namespace_id: _Optional[str] = ..., encoded_bytes_per_token: _Optional[int] = ..., block_bytes: _Optional[int] = ..., capacity_tokens: _Optional[int] = ...) -> None: ...

class ReleasePoolRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    def __init__(self, pool_id: _Optional[int] = ...) -> None: ...

class ReleasePoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Block(_message.Message):
    __slots__ = ("key", "rows")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class BackupRequest(_message.Message):
    __slots__ = ("pool_id", "blocks", "wait_event", "done_event", "sync", "wait_value")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    WAIT_VALUE_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    wait_event: int
    done_event: int
    sync: bool
    wait_value: int
    def __init__(self, pool_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., wait_event: _Optional[int] = ..., done_event: _Optional[int] = ..., sync: _Optional[bool] = ..., wait_value: _Optional[int] = ...) -> None: ...

class BackupResponse(_message.Message):
    __slots__ = ("results", "ticket")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedScalarFieldContainer[BlockStatus]
    ticket: int
    def __init__(self, results: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., ticket: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("pool_id", "blocks", "wait_event", "layer_event_base", "done_event", "sync", "wait_value")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_FIELD_NUMBER: _ClassVar[int]
    LAYER_EVENT_BASE_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    WAIT_VALUE_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    wait_event: int
    layer_event_base: int
    done_event: int
    sync: bool
    wait_value: int
    def __init__(self, pool_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., wait_event: _Optional[int] = ..., layer_event_base: _Optional[int] = ..., done_event: _Optional[int] = ..., sync: _Optional[bool] = ..., wait_value: _Optional[int] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("restored_blocks", "ticket")
    RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    restored_blocks: int
    ticket: int
    def __init__(self, restored_blocks: _Optional[int] = ..., ticket: _Optional[int] = ...) -> None: ...

class NamespaceRef(_message.Message):
    __slots__ = ("model", "tenant", "geometry", "block_tokens", "codec")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    model: str
    tenant: str
    geometry: Geometry
    block_tokens: int
    codec: Codec
    def __init__(self, model: _Optional[str] = ..., tenant: _Optional[str] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., block_tokens: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pool_id", "keys", "namespaces")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceRef]
    def __init__(self, pool_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceRef, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_blocks",)
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    def __init__(self, prefix_blocks: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("pool_id", "keys")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    def __init__(self, evicted: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("namespaces_offset", "namespaces_limit")
    NAMESPACES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    namespaces_offset: int
    namespaces_limit: int
    def __init__(self, namespaces_offset: _Optional[int] = ..., namespaces_limit: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("pending_tasks",)
    PENDING_TASKS_FIELD_NUMBER: _ClassVar[int]
    pending_tasks: int
    def __init__(self, pending_tasks: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "model", "codec", "encoded_bytes_per_token", "blocks", "bytes", "hits", "misses", "backups", "restores", "evictions", "tenant", "rejected", "pools", "capacity_blocks", "corrupt")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    model: str
    codec: Codec
    encoded_bytes_per_token: int
    blocks: int
    bytes: int
    hits: int
    misses: int
    backups: int
    restores: int
    evictions: int
    tenant: str
    rejected: int
    pools: int
    capacity_blocks: int
    corrupt: int
    def __init__(self, namespace_id: _Optional[str] = ..., model: _Optional[str] = ..., codec: _Optional[_Union[Codec, str]] = ..., encoded_bytes_per_token: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., backups: _Optional[int] = ..., restores: _Optional[int] = ..., evictions: _Optional[int] = ..., tenant: _Optional[str] = ..., rejected: _Optional[int] = ..., pools: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., corrupt: _Optional[int] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool_id", "namespace_id", "model", "tenant", "device", "client_pid", "backups", "restores", "peer", "uid", "owned")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    namespace_id: str
    model: str
    tenant: str
    device: DeviceKind
    client_pid: int
    backups: int
    restores: int
    peer: str
    uid: int
    owned: bool
    def __init__(self, pool_id: _Optional[int] = ..., namespace_id: _Optional[str] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., device: _Optional[_Union[DeviceKind, str]] = ..., client_pid: _Optional[int] = ..., backups: _Optional[int] = ..., restores: _Optional[int] = ..., peer: _Optional[str] = ..., uid: _Optional[int] = ..., owned: _Optional[bool] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("pool_bytes", "used_bytes", "blocks", "clients", "uptime_seconds", "namespaces", "pools", "device", "shm_name", "capacity_bytes", "cuda_staging_bytes", "namespaces_total", "caller_uid", "caller_admin", "corrupt_blocks", "l3")
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CALLER_UID_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADMIN_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    L3_FIELD_NUMBER: _ClassVar[int]
    pool_bytes: int
    used_bytes: int
    blocks: int
    clients: int
    uptime_seconds: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    device: str
    shm_name: str
    capacity_bytes: int
    cuda_staging_bytes: int
    namespaces_total: int
    caller_uid: int
    caller_admin: bool
    corrupt_blocks: int
    l3: L3Stats
    def __init__(self, pool_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., clients: _Optional[int] = ..., uptime_seconds: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ..., device: _Optional[str] = ..., shm_name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., cuda_staging_bytes: _Optional[int] = ..., namespaces_total: _Optional[int] = ..., caller_uid: _Optional[int] = ..., caller_admin: _Optional[bool] = ..., corrupt_blocks: _Optional[int] = ..., l3: _Optional[_Union[L3Stats, _Mapping]] = ...) -> None: ...

class L3Stats(_message.Message):
    __slots__ = ("enabled", "lookup_hits", "lookup_misses", "lookup_errors", "fetches", "fetched_blocks", "fetch_errors", "corrupt_values", "promoted_blocks", "writes", "write_errors", "dropped_writes", "skipped_writes", "write_queue_bytes", "write_queue_blocks", "bytes_in", "bytes_out", "fetch_latency_samples", "fetch_p50_us", "fetch_p99_us", "write_policy", "spilled_blocks", "budget_bytes", "budget_used_bytes", "budget_deletes")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ERRORS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    WRITE_QUEUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_QUEUE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    FETCH_LATENCY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FETCH_P50_US_FIELD_NUMBER: _ClassVar[int]
    FETCH_P99_US_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    SPILLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_DELETES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    lookup_hits: int
    lookup_misses: int
    lookup_errors: int
    fetches: int
    fetched_blocks: int
    fetch_errors: int
    corrupt_values: int
    promoted_blocks: int
    writes: int
    write_errors: int
    dropped_writes: int
    skipped_writes: int
    write_queue_bytes: int
    write_queue_blocks: int
    bytes_in: int
    bytes_out: int
    fetch_latency_samples: int
    fetch_p50_us: int
    fetch_p99_us: int
    write_policy: str
    spilled_blocks: int
    budget_bytes: int
    budget_used_bytes: int
    budget_deletes: int
    def __init__(self, enabled: _Optional[bool] = ..., lookup_hits: _Optional[int] = ..., lookup_misses: _Optional[int] = ..., lookup_errors: _Optional[int] = ..., fetches: _Optional[int] = ..., fetched_blocks: _Optional[int] = ..., fetch_errors: _Optional[int] = ..., corrupt_values: _Optional[int] = ..., promoted_blocks: _Optional[int] = ..., writes: _Optional[int] = ..., write_errors: _Optional[int] = ..., dropped_writes: _Optional[int] = ..., skipped_writes: _Optional[int] = ..., write_queue_bytes: _Optional[int] = ..., write_queue_blocks: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., fetch_latency_samples: _Optional[int] = ..., fetch_p50_us: _Optional[int] = ..., fetch_p99_us: _Optional[int] = ..., write_policy: _Optional[str] = ..., spilled_blocks: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., budget_used_bytes: _Optional[int] = ..., budget_deletes: _Optional[int] = ...) -> None: ...
