"""The scheduler half of the vLLM connector: block keys per request, lookups over every TP
rank's namespace, and the step's loads and saves."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hiqcache.client import Client
from hiqcache.keys import BlockKey, chain_block_key, root_block_key
from hiqcache.spec import NamespaceRef
from hiqcache.status import HiqError
from hiqcache.vllm.common import (
    ConnectorOptions,
    HiqCacheConnectorMetadata,
    _engine_geometry,
    _LogOnce,
    _staging_tokens,
    _Transfer,
    model_identity,
    request_salt,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class _Request:
    request: Request
    salt: bytes
    bs: int
    keys: list[BlockKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    local_tokens: int = 0  # vLLM's own prefix-cache hit, as passed to get_num_new_matched_tokens
    daemon_blocks: int = 0  # leading blocks the daemon is known to hold
    saved_blocks: int = 0  # leading blocks saved or known to be held
    load: tuple[int, int] | None = None  # (first block, count) to load in the next step

    def keys_upto(self, n: int) -> list[BlockKey]:
        """The first n block keys, extending the chain over the request's tokens as needed."""
        bs = self.bs
        tokens = self.request.all_token_ids
        while len(self.keys) < n:
            i = len(self.keys)
            prev = self.keys[-1] if self.keys else root_block_key(self.salt)
            self.keys.append(chain_block_key(prev, tokens[i * bs:(i + 1) * bs]))
        return self.keys[:n]


class _Scheduler:
    def __init__(self, vllm_config: VllmConfig, opts: ConnectorOptions):
        self.bs = vllm_config.cache_config.block_size
        self.identity = model_identity(vllm_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.namespaces = [NamespaceRef(model=self.identity, tenant=opts.tenant,
                                        geometry=_engine_geometry(vllm_config, r),
                                        block_tokens=self.bs, codec=opts.codec)
                           for r in range(tp)]
        self.capacity_tokens = _staging_tokens(vllm_config, opts)
        self.client = Client(opts.target, call_timeout=opts.timeout_ms / 1000)
        self.reqs: dict[str, _Request] = {}
        self.promised_tokens = 0  # load tokens promised to the step being scheduled
        self.warn = _LogOnce()
        # A client's first call opens its session and connection and pays gRPC's first-call
        # costs (3-13 ms measured): made now, off the engine's path, not by the first request.
        threading.Thread(target=self._warm_up, name="hiqcache-warm-up", daemon=True).start()

    def _warm_up(self) -> None:
        try:
            self.client.get_stats(namespaces_limit=1)  # reads only
        except HiqError:
            pass  # no daemon yet: the first lookup tries again, and misses meanwhile

    def _state(self, request: Request) -> _Request:
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _Request(request=request, salt=request_salt(self.identity, request), bs=self.bs)
            self.reqs[request.request_id] = st
        return st

    @staticmethod
    def cacheable(request: Request) -> bool:
        return getattr(request, "prompt_embeds", None) is None

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.cacheable(request):
            return 0
        st = self._state(request)  # tracked for its saves even when nothing is looked up
        st.local_tokens = num_computed_tokens
        # vLLM must compute at least the last token itself.
        n_max = (request.num_tokens - 1) // self.bs
        n_local = num_computed_tokens // self.bs
        room = (self.capacity_tokens - self.promised_tokens) // self.bs
        if n_max <= n_local or room <= 0:
            return 0
        res = self.client.lookup_group(self.namespaces, st.keys_upto(n_max))
        if not res.status.ok:
            self.warn("lookup", "lookup failed, serving without the cache: %s", res.status)
            return 0
        st.daemon_blocks = res.prefix_blocks
        hit = min(res.prefix_blocks, n_local + room)
        return max(0, hit - n_local) * self.bs

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        if num_external_tokens > 0:
            first = st.local_tokens // self.bs
            st.load = (first, num_external_tokens // self.bs)
            self.promised_tokens += num_external_tokens

    def _saves(self, st: _Request, computed: int, scheduled: int) -> _Transfer | None:
        """Full blocks whose KV this step completes and that the daemon may not hold yet."""
        if not self.cacheable(st.request):
            return None
        end = min(computed + scheduled, len(st.request.all_token_ids)) // self.bs
        start = max(st.saved_blocks, st.daemon_blocks)
        end = min(end, len(st.block_ids))
        if end <= start:
            return None
        st.saved_blocks = end
        return _Transfer(st.request.request_id, st.keys_upto(end)[start:end],
                         st.block_ids[start:end])

    def build_meta(self, out: SchedulerOutput) -> HiqCacheConnectorMetadata:
        meta = HiqCacheConnectorMetadata()
        self.promised_tokens = 0
        steps: list[tuple[_Request, int, int]] = []
        for new in out.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:
                continue  # never seen by get_num_new_matched_tokens (not cacheable)
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            steps.append((st, new.num_computed_tokens, out.num_scheduled_tokens.get(new.req_id, 0)))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            steps.append((st, cached.num_computed_tokens[i],
                          out.num_scheduled_tokens.get(req_id, 0)))
        for st, computed, scheduled in steps:
            if st.load is not None:
                first, n = st.load
                st.load = None
                if first + n <= len(st.block_ids):
                    meta.loads.append(_Transfer(st.request.request_id,
                                                st.keys_upto(first + n)[first:first + n],
                                                st.block_ids[first:first + n]))
                    st.saved_blocks = max(st.saved_blocks, first + n)
            try:
                save = self._saves(st, computed, scheduled)
            except Exception as err:  # a save is optional: never lose the step's loads over it
                self.warn("save-plan", "planning saves failed (%s: %s)", type(err).__name__, err)
                save = None
            if save is not None:
                meta.saves.append(save)
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        return meta

    def request_finished(self, request: Request) -> None:
        self.reqs.pop(request.request_id, None)
