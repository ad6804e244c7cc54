"""A model of hiqcached's pool under a request sequence: one least-recently-used list of blocks,
nothing else. compare_lmcache.py writes its prediction beside each measured hit rate, to tell the
eviction policy's share of a hit rate from anything else in it (bench/README.md, "The LRU
model"). No imports: the tests run it on sequences whose answer is known."""

from __future__ import annotations


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
            n = next((k for k, key in enumerate(blocks) if key not in lru), len(blocks))
            for key in blocks[:n]:
                lru[key] = lru.pop(key)
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
