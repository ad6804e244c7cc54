"""What both halves of the vLLM connector share: the extra-config options, the model's
identity and key salts, the engine's geometry, staging sizes and the step's metadata."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hiqcache.host import HUGE_PAGES, HostEventPool
from hiqcache.keys import BlockKey
from hiqcache.options import ExtraConfig
from hiqcache.rope import rope_of
from hiqcache.spec import Codec, DType, Geometry
from hiqcache.status import StatusCode

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("hiqcache.vllm")

_EXTRA_KEYS = ("target", "codec", "tenant", "timeout_ms", "staging_tokens", "cuda_transport",
               "cpu_transport", "huge_pages")
CUDA_TRANSPORTS = ("auto", "ipc", "host")
CPU_TRANSPORTS = ("auto", "tiles", "staging")
# Keyed by vLLM's model_config.dtype: a torch.dtype once vLLM resolved it (typed with its
# string spellings too).
_TORCH_DTYPES: dict[torch.dtype | str, DType] = {torch.bfloat16: DType.BF16,
                                                 torch.float16: DType.FP16}


@dataclass(frozen=True)
class ConnectorOptions:
    target: str = ""
    codec: Codec = Codec.INT8_PER_HEAD
    tenant: str = ""
    timeout_ms: int = 1000
    staging_tokens: int = 0  # 0 = derived from the scheduler limits
    cuda_transport: str = "auto"  # vLLM on CUDA: one of CUDA_TRANSPORTS (cuda_worker.py)
    cpu_transport: str = "auto"  # vLLM on CPU: one of CPU_TRANSPORTS (cpu_worker.py)
    huge_pages: str = "auto"  # vLLM on CPU: the shared memfd's pages, one of host.HUGE_PAGES

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorOptions:
        """Validates kv_connector_extra_config; ValueError naming the offending key."""
        opts = ExtraConfig(extra, "kv_connector_extra_config", _EXTRA_KEYS)
        return cls(target=opts.target(), codec=opts.codec(), tenant=opts.text("tenant"),
                   timeout_ms=opts.integer("timeout_ms", 1000, 1, 600_000),
                   staging_tokens=opts.integer("staging_tokens", 0, 0, 1 << 24),
                   cuda_transport=opts.choice("cuda_transport", "auto", CUDA_TRANSPORTS),
                   cpu_transport=opts.choice("cpu_transport", "auto", CPU_TRANSPORTS),
                   huge_pages=opts.choice("huge_pages", "auto", HUGE_PAGES))


def model_identity(vllm_config: VllmConfig) -> str:
    """Everything about the model that changes its KV, as one string (the namespace's model)."""
    m = vllm_config.model_config
    parts = [f"{m.model}@{m.revision or 'main'}", f"dtype={str(m.dtype).removeprefix('torch.')}",
             f"quant={m.quantization or 'none'}",
             f"kv={vllm_config.cache_config.cache_dtype}"]
    return "|".join(parts)


def request_salt(identity: str, request: Request) -> bytes:
    """The key chain's salt for one request: model identity, LoRA, multimodal inputs, cache salt."""
    parts = [identity]
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}:{getattr(lora, 'lora_path', '')}")
    for f in getattr(request, "mm_features", None) or ():
        parts.append(f"mm={f.identifier}")
    if getattr(request, "cache_salt", None):
        parts.append(f"salt={request.cache_salt}")
    return "\x1f".join(parts).encode()


def _engine_geometry(vllm_config: VllmConfig, tp_rank: int) -> Geometry:
    m, p = vllm_config.model_config, vllm_config.parallel_config
    dtype = _TORCH_DTYPES.get(m.dtype)
    if dtype is None:
        raise ValueError(f"hiqcache: model dtype {m.dtype} is not supported (bf16 or fp16)")
    if vllm_config.cache_config.cache_dtype not in ("auto", "bfloat16", "float16"):
        raise ValueError(f"hiqcache: kv cache dtype {vllm_config.cache_config.cache_dtype!r} is "
                         "not supported (use 'auto')")
    if m.use_mla:
        raise ValueError("hiqcache: MLA models are not supported by the vLLM connector yet")
    theta, interleaved = rope_of(m.hf_text_config, m.get_head_size())
    return Geometry(num_layers=m.get_num_layers(p), num_kv_heads=m.get_num_kv_heads(p),
                    head_dim=m.get_head_size(), dtype=dtype, tp_rank=tp_rank,
                    tp_size=p.tensor_parallel_size, rope_theta=theta,
                    rope_interleaved=interleaved)


def _staging_tokens(vllm_config: VllmConfig, opts: ConnectorOptions) -> int:
    """Rows of each staging area: one step's loads (the scheduler never promises more) and one
    step's saves (at most the step's token budget plus one partial block per request)."""
    if opts.staging_tokens:
        return opts.staging_tokens
    s = vllm_config.scheduler_config
    bs = vllm_config.cache_config.block_size
    rows = max(s.max_num_batched_tokens + s.max_num_seqs * bs,
               min(vllm_config.model_config.max_model_len, 8192))
    return -(-rows // bs) * bs


class _LogOnce:
    """Logs a failure once per kind and period, so a daemon that is down does not flood logs."""

    def __init__(self, period: float = 30.0):
        self.period = period
        self.last: dict[str, float] = {}

    def __call__(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -1e9) >= self.period:
            self.last[kind] = now
            log.warning("hiqcache: " + msg, *args)


# --- metadata --------------------------------------------------------------------------------


@dataclass
class _Transfer:
    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]


@dataclass
class _Load(_Transfer):
    """A restore in flight on a worker."""

    reported: bool = False  # its outcome went into the step's loaded or failed blocks


@dataclass
class HiqCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[_Transfer] = field(default_factory=list)
    saves: list[_Transfer] = field(default_factory=list)


class _LoadSteps:
    """What both workers keep of a step: the last backup's ticket and the restores in flight, as
    (transfer, first staging row, ticket, done slot), the layers the forward pass waited for, and
    the blocks vLLM must recompute. A worker sets `load_slots` (the HostEventPool its done slots
    are in), `geometry`, `opts`, `stats`, `warn` and `layer_index`."""

    geometry: Geometry
    opts: ConnectorOptions
    stats: dict[str, Any]
    warn: _LogOnce
    layer_index: dict[str, int]

    if TYPE_CHECKING:
        @property
        def load_slots(self) -> HostEventPool | None: ...

    def _saves_that_fit(self, meta: HiqCacheConnectorMetadata, room_blocks: int
                        ) -> tuple[list[BlockKey], list[int]]:
        """The step's saves, in order, up to `room_blocks` blocks; the rest counted as dropped."""
        keys: list[BlockKey] = []
        ids: list[int] = []
        for tr in meta.saves:
            take = min(room_blocks - len(ids), len(tr.keys))
            keys.extend(tr.keys[:take])
            ids.extend(tr.block_ids[:take])
            self.stats["dropped_saves"] += len(tr.keys) - take
        return keys, ids

    def _drop_saves(self, meta: HiqCacheConnectorMetadata) -> None:
        self.warn("save", "previous backup still running; dropping this step's saves")
        self.stats["dropped_saves"] += sum(len(t.keys) for t in meta.saves)

    def _backup_sent(self, res: Any) -> None:
        """Notes an asynchronous Backup's answer: the ticket its done slot will reach."""
        if not res.status.ok:
            self.warn("backup", "backup failed (blocks stay uncached): %s", res.status)
            self.backup_ticket = 0
        else:
            self.backup_ticket = res.ticket
            self.stats["saved_blocks"] += res.held

    def _init_loads(self) -> None:
        self.backup_ticket = 0
        self.loads: list[tuple[_Load, int, int, int]] = []
        self.load_ticket = 0  # last Restore ticket of this step (the layer slots reach it)
        self.layers_done: set[int] = set()
        self.layers_failed = False  # a layer of this step's restores failed: stop waiting
        self.load_errors: set[int] = set()

    def _fail(self, block_ids: list[int]) -> None:
        self.load_errors.update(block_ids)
        self.stats["failed_blocks"] += len(block_ids)

    def _finish_loads(self, timeout: float) -> bool:
        """Ends the step's restores: waits (up to `timeout`) for each one's done slot and turns
        every failure, and every layer the forward pass did not wait for, into load errors of
        this step. Restores still running stay listed (their rows are not reused); true when
        none is left."""
        assert self.load_slots is not None
        pending = []
        deadline = time.monotonic() + timeout
        for tr, first_row, ticket, slot in self.loads:
            s = self.load_slots.wait(slot, ticket, max(0.0, deadline - time.monotonic()))
            if not tr.reported:
                ok = s.ok and len(self.layers_done) == self.geometry.num_layers
                if s.ok and not ok:
                    self.warn("layers", "the forward pass skipped layers of a restore; recomputing")
                if ok:
                    self.stats["loaded_blocks"] += len(tr.block_ids)
                else:
                    self._fail(tr.block_ids)
                tr.reported = True
            if s.code is StatusCode.DEADLINE_EXCEEDED:
                pending.append((tr, first_row, ticket, slot))
        self.loads = pending
        self.layers_done = set()
        self.layers_failed = False
        return not pending

    def fail_loads(self, meta: HiqCacheConnectorMetadata) -> None:
        """start_load raised: every block of the step's loads is recomputed and no layer waits.
        Restores already sent stay listed: their rows are not reused until done."""
        self.load_errors.update(b for t in meta.loads for b in t.block_ids)
        self.layers_failed = True

    def layer_failed(self, layer_name: str) -> None:
        """wait_layer raised: the layer counts as not loaded (its restores become load errors)."""
        self.layers_done.discard(self.layer_index.get(layer_name, -1))

    def take_load_errors(self) -> set[int]:
        """This step's failed loads; called by vLLM after the forward pass."""
        if self.loads:
            self._finish_loads(self.opts.timeout_ms / 1000)
        errors, self.load_errors = self.load_errors, set()
        return errors
