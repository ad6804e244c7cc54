"""hiqcache: the Python client of hiqcached, the per-node compressed CPU tier for LLM KV cache.

`import hiqcache` pulls neither torch nor an engine; the engine adapters (`hiqcache.vllm`) import
their engine themselves.
"""

from hiqcache._version import __version__
from hiqcache.client import (
    BackupResult,
    BlockStatus,
    Client,
    DaemonStats,
    L3Stats,
    LookupResult,
    NamespaceStats,
    PoolStats,
    RestoreResult,
    default_socket_path,
    normalize_target,
)
from hiqcache.host import EVENT_FAILED_BIT, HostEventPool, HostShm
from hiqcache.keys import BlockKey, chain_block_key, compute_block_keys, root_block_key
from hiqcache.session import Session, SessionError
from hiqcache.spec import (
    Attention,
    Codec,
    DeviceKind,
    DType,
    EventPoolSpec,
    Geometry,
    LayerView,
    NamespaceRef,
    PoolSpec,
    RegisteredPool,
    SharedBuffer,
    TensorView,
    slot_major_bytes,
    slot_major_view,
)
from hiqcache.status import HiqError, Status, StatusCode

__all__ = [
    "Attention", "BackupResult", "BlockKey", "BlockStatus", "Client", "Codec", "DType",
    "DaemonStats", "DeviceKind", "EVENT_FAILED_BIT", "EventPoolSpec", "Geometry", "HiqError",
    "HostEventPool", "HostShm", "L3Stats", "LayerView", "LookupResult", "NamespaceRef",
    "NamespaceStats", "PoolSpec", "PoolStats", "RegisteredPool", "RestoreResult", "Session",
    "SessionError", "SharedBuffer", "Status", "StatusCode", "TensorView", "chain_block_key",
    "compute_block_keys", "default_socket_path", "normalize_target", "root_block_key",
    "slot_major_bytes", "slot_major_view", "__version__",
]
