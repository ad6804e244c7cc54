"""Models of a tier under a request sequence, to tell the eviction policy's share of a measured
hit rate from anything else in it (bench/README.md, "The LRU model"): hiqcached's pool as one
least-recently-used list of blocks (lru_hit_rate), and LMCache 0.5.6's L1 as its code describes
it (watermark_hit_rate). compare_lmcache.py writes each beside the measured rate. No imports: the
tests run them on sequences whose answer is known."""

from __future__ import annotations


def _look_up(keys: list[tuple[int, ...]], held: dict[tuple[int, ...], None]) -> int:
    """How many of a prompt's leading keys `held` has (a prefix hit ends at the first missing
    one); those become the most recent (`held`'s insertion order is its recency, oldest first)."""
    n = next((k for k, key in enumerate(keys) if key not in held), len(keys))
    for key in keys[:n]:
        held[key] = held.pop(key)
    return n


def lru_hit_rate(batches: list[list[list[int]]], warm_from: int, capacity_blocks: int,
                 block_tokens: int) -> float:
    """The warm-round hit rate of a tier that is nothing but one least-recently-used list of
    `capacity_blocks` blocks, for the workload's batches: each batch's prompts look up their
    full blocks first (a prefix hit ends at the first missing block; the hits become the most
    recent), then every prompt stores its full blocks in key order (each the most recent when
    stored). vLLM's own cache is left out. `warm_from`: index of the first request counted."""
    bt = block_tokens
    lru: dict[tuple[int, ...], None] = {}  # insertion order = recency, oldest first
    hits = shareable = 0
    i = 0
    for batch in batches:
        # A prompt's full blocks (its last token is always computed), each keyed by its prefix.
        keys = [[tuple(p[:(b + 1) * bt]) for b in range((len(p) - 1) // bt)] for p in batch]
        for blocks in keys:
            n = _look_up(blocks, lru)
            if i >= warm_from:
                hits, shareable = hits + n * bt, shareable + len(blocks) * bt
            i += 1
        for blocks in keys:
            for key in blocks:
                lru.pop(key, None)
                lru[key] = None
                while len(lru) > capacity_blocks:
                    del lru[next(iter(lru))]
    return hits / shareable


def watermark_hit_rate(batches: list[list[list[int]]], warm_from: int, capacity_chunks: float,
                       chunk_tokens: int, block_tokens: int, watermark: float = 0.8,
                       evict_fraction: float = 0.2) -> tuple[float, int]:
    """The warm-round hit rate of LMCache 0.5.6's L1 as its code describes it, and the chunks it
    holds at the end: full chunks of `chunk_tokens`; a store that does not fit is refused (no
    eviction to make room); an eviction loop removes the least recently used
    max(1, int(evict_fraction * held)) chunks while the used share is at least `watermark` (its
    loop runs once a second; here after each batch's stores, a batch taking seconds). Lookups as
    lru_hit_rate's; hits in chunks, shareable tokens in vLLM's blocks of `block_tokens`.
    `capacity_chunks`: the L1's bytes over a chunk's, fractional. vLLM's own cache is left out.

    Where the last chunk that fits leaves the L1 below the watermark, nothing is ever evicted:
    the L1 keeps the first chunks it stored and refuses every later one."""
    ct = chunk_tokens
    held: dict[tuple[int, ...], None] = {}  # insertion order = recency, oldest first
    hits = shareable = 0
    i = 0
    for batch in batches:
        keys = [[tuple(p[:(c + 1) * ct]) for c in range(len(p) // ct)] for p in batch]
        for p, chunks in zip(batch, keys):
            n = _look_up(chunks, held)
            if i >= warm_from:
                hits += n * ct
                shareable += (len(p) - 1) // block_tokens * block_tokens
            i += 1
        for chunks in keys:
            for key in chunks:
                if key not in held and len(held) + 1 <= capacity_chunks:
                    held[key] = None
        while held and len(held) >= watermark * capacity_chunks:
            for _ in range(max(1, int(evict_fraction * len(held)))):
                del held[next(iter(held))]
    return hits / shareable, len(held)
