"""vLLM KV connector (v1, out of tree): vLLM engines back up and restore KV through hiqcached.

    kv_transfer_config = {
        "kv_connector": "HiqCacheConnector",
        "kv_connector_module_path": "hiqcache.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"target": "unix:///run/hiqcache/hiqcached.sock",
                                      "codec": "int8_per_head", "tenant": ""},
    }

Names are a contract (docs/design.md "Engine adapters"). Optional extra-config keys beyond the
contract: `timeout_ms` (deadline of every daemon call, default 1000), `staging_tokens` (token
rows of each staging area), `cuda_transport` (vLLM on CUDA: auto, ipc or host; see
cuda_worker.py), `cpu_transport` (vLLM on CPU: auto, tiles or staging; see cpu_worker.py) and
`huge_pages` (vLLM on CPU: auto, off or require, the pages of the memfd shared with the daemon,
which holds vLLM's KV itself under tiles; hiqcache.host.HostShm.create_memfd). An
unknown key or a bad value fails engine start-up with a
message that names it; after start-up the connector never raises into vLLM: any failure is a miss
(the scheduler's lookup answers 0, a failed restore reports its blocks through
get_block_ids_with_load_errors so vLLM recomputes exactly those tokens, a failed backup is
dropped).

Scheduler half: keys are XXH3-128 chains (hiqcache.keys) over the request's token ids, salted
with the model's identity (name, revision, dtype, quantization, KV cache dtype) and the request's
LoRA adapter, multimodal inputs and cache salt, so every engine process on the node derives the
same keys without PYTHONHASHSEED and two models never share blocks. It has no KV buffers, so
get_num_new_matched_tokens asks the daemon how many leading full blocks every TP rank of this
engine holds (Lookup over the ranks' namespaces); build_connector_meta tells the workers which
stored blocks to load into which vLLM blocks and which newly computed full blocks to save.

Worker half, chosen by the device of vLLM's KV caches at register_kv_caches: cpu_worker.CpuWorker
for vLLM on CPU (the daemon reads and writes vLLM's attention tiles in place, or converts them
through shared-memory staging where it cannot describe their order), and
cuda_worker.CudaWorker for vLLM on CUDA (the daemon reads and writes vLLM's blocks in place
through CUDA IPC, or page-locked staging where it cannot). Modules: common (options, identity,
metadata), scheduler, cpu_worker, cuda_worker.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from hiqcache.vllm.common import (
    ConnectorOptions,
    HiqCacheConnectorMetadata,
    _engine_geometry,
    _LogOnce,
    model_identity,
    request_salt,
)
from hiqcache.vllm.cpu_worker import CpuWorker, TileConverter, probe_tile_order
from hiqcache.vllm.cuda_worker import CudaWorker
from hiqcache.vllm.scheduler import _Scheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorOptions", "CpuWorker", "CudaWorker", "HiqCacheConnector",
           "HiqCacheConnectorMetadata", "TileConverter", "model_identity", "probe_tile_order",
           "request_salt"]

log = logging.getLogger("hiqcache.vllm")

# --- the connector ---------------------------------------------------------------------------


class HiqCacheConnector(KVConnectorBase_V1):
    """hiqcached as vLLM's KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        # vLLM passes kv_cache_config; the base class only keeps it.
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._opts = ConnectorOptions.parse(extra)
        bs = vllm_config.cache_config.block_size
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("hiqcache: models with several KV cache groups (hybrid or sliding-"
                             "window attention) are not supported yet")
        _engine_geometry(vllm_config, 0)  # fails start-up for unsupported models
        if bs <= 0:
            raise ValueError("hiqcache: block_size must be > 0")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A block the daemon promised can be evicted before the load: that must be a miss.
            log.info("hiqcache: kv_load_failure_policy set to 'recompute' (was %r): a block "
                     "hiqcached cannot deliver is recomputed",
                     self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self._scheduler = (_Scheduler(vllm_config, self._opts)
                           if role == KVConnectorRole.SCHEDULER else None)
        self._vllm_config = vllm_config
        self._worker: CpuWorker | CudaWorker | None = None  # chosen by the KV caches' device
        self._is_worker = role == KVConnectorRole.WORKER
        self._warn = _LogOnce()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    def _guard(self, what: str, fn: Any, default: Any = None) -> Any:
        try:
            return fn()
        except Exception as err:  # never raise into vLLM
            self._warn(what, "%s failed (%s: %s); treated as a miss", what, type(err).__name__, err)
            return default

    # -- worker --

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._is_worker and self._worker is None
        if not kv_caches:
            raise ValueError("hiqcache: no KV cache tensors to register")
        device = next(iter(kv_caches.values())).device
        if device.type == "cpu":
            worker: CpuWorker | CudaWorker = CpuWorker(self._vllm_config, self._opts)
        elif device.type == "cuda":
            worker = CudaWorker(self._vllm_config, self._opts)
        else:
            raise ValueError(f"hiqcache: KV cache on {device}: vLLM on CPU or CUDA is served")
        worker.register(kv_caches)  # start-up: a layout not understood fails loudly
        self._worker = worker

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiqCacheConnectorMetadata)

        try:
            self._worker.start_load(meta)
        except Exception as err:
            self._warn("start_load_kv", "start_load_kv failed (%s); recomputing", err)
            self._worker.fail_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is None:
            return
        try:
            self._worker.wait_layer(layer_name)
        except Exception as err:
            self._warn("wait_for_layer_load", "loading %s failed (%s); recomputing", layer_name,
                       err)
            self._worker.layer_failed(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return  # saved in wait_for_save, once every layer of the step is written

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        # Made by build_connector_meta: always ours.
        meta = cast(HiqCacheConnectorMetadata, self._get_connector_metadata())
        self._guard("wait_for_save", lambda: self._worker.save(meta))

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._guard("shutdown", self._worker.shutdown)
        if self._scheduler is not None:
            self._guard("shutdown", self._scheduler.client.close)

    # -- scheduler --

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        n = self._guard("lookup", lambda: self._scheduler.num_new_matched_tokens(
            request, num_computed_tokens), 0)
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._guard("update_state_after_alloc", lambda: self._scheduler.update_state_after_alloc(
            request, blocks, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._guard("build_connector_meta",
                           lambda: self._scheduler.build_meta(scheduler_output))
        return meta if meta is not None else HiqCacheConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._guard("request_finished", lambda: self._scheduler.request_finished(request))
        return False, None  # saves copy out of vLLM's blocks at once: free them now
