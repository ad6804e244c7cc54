"""The benchmarks' own bookkeeping, where a checked-in figure depends on it: fidelity.py's
--merge-into (bench/fidelity/merge.py) adds codecs to an earlier run only where the two runs
agree window by window, and compare_lmcache.py's model of the pool's eviction
(bench/vllm/lru_model.py) gives the hit rates an LRU list must give."""

from __future__ import annotations

import copy
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.append(str(ROOT / "bench" / "fidelity"))
sys.path.append(str(ROOT / "bench" / "vllm"))

from lru_model import lru_hit_rate, watermark_hit_rate  # noqa: E402

from merge import merge  # noqa: E402

FIDELITY = ROOT / "bench" / "results" / "fidelity" / "fidelity.json"


@pytest.fixture(scope="module")
def fidelity() -> dict:
    return json.loads(FIDELITY.read_text())


def only(result: dict, keep: list[str]) -> dict:
    """`result` as a run of the codecs in `keep` alone would have written it."""
    out = copy.deepcopy(result)
    for c in [c for c in out["config"]["codecs"] if c not in keep]:
        del out["paths"][c], out["gates"][c]
        for by in out["by_length"].values():
            del by[c]
        for w in out["windows"]:
            del w["paths"][c]
    out["config"]["codecs"] = [c for c in out["config"]["codecs"] if c in keep]
    out.pop("merged_runs", None)
    return out


def test_merge_restores_what_a_full_run_holds(fidelity):
    codecs = fidelity["config"]["codecs"]
    added = "int6_allot"
    into = only(fidelity, [c for c in codecs if c != added])
    run = only(fidelity, ["int8_per_head", added])
    run["config"]["batch"] = 3
    merged = merge(into, run)
    assert merged["paths"][added] == fidelity["paths"][added]
    assert merged["gates"][added] == fidelity["gates"][added]
    assert all(merged["by_length"][p][added] == fidelity["by_length"][p][added]
               for p in fidelity["by_length"])
    assert [w["paths"][added] for w in merged["windows"]] == \
        [w["paths"][added] for w in fidelity["windows"]]
    assert sorted(merged["config"]["codecs"]) == sorted(codecs)
    assert merged["merged_runs"][-1]["codecs"] == [added]
    assert merged["merged_runs"][-1]["checked_identical"] == ["floor", "int8_per_head"]
    assert merged["merged_runs"][-1]["batch"] == 3
    assert added not in into["paths"]  # the earlier run's dict is not changed


@pytest.mark.parametrize("spoil, why", [
    (lambda r: r["config"].update(block_tokens=64), "block_tokens"),
    (lambda r: r["windows"][7].update(offset=r["windows"][7]["offset"] + 1), "offset"),
    (lambda r: r["windows"][3]["paths"]["floor"].update(
        kl=r["windows"][3]["paths"]["floor"]["kl"] * (1 + 1e-12)), "floor's kl"),
    (lambda r: r["windows"][40]["paths"]["int8_per_head"].update(
        top1=r["windows"][40]["paths"]["int8_per_head"]["top1"] - 0.03), "int8_per_head's top1"),
    (lambda r: r["windows"].pop(), "numbers of windows"),
])
def test_merge_refuses_runs_that_differ(fidelity, spoil, why):
    into = only(fidelity, [c for c in fidelity["config"]["codecs"] if c != "int6_allot"])
    run = only(fidelity, ["int8_per_head", "int6_allot"])
    spoil(run)
    with pytest.raises(ValueError, match=why):
        merge(into, run)


def prompts(order: list[int], prefix_blocks: int, bt: int, suffix: int) -> list[list[int]]:
    """One prompt per entry of `order`: group g's prefix of `prefix_blocks` blocks, then a
    suffix of its own shorter than a block."""
    return [[1000 * g + t for t in range(prefix_blocks * bt)] + [-1 - i] * suffix
            for i, g in enumerate(order)]


def test_lru_model_hits_every_warm_prefix_that_fits():
    bt, rounds = 4, [0, 1, 2] * 3
    batches = [[p] for p in prompts(rounds, 2, bt, 3)]
    assert lru_hit_rate(batches, 3, 6, bt) == 1.0


def test_lru_model_misses_a_cycle_one_prefix_too_long():
    # LRU's worst case: three prefixes reused in turn with room for two: each is evicted just
    # before its next use, so no warm request hits.
    bt = 4
    batches = [[p] for p in prompts([0, 1, 2] * 3, 2, bt, 3)]
    assert lru_hit_rate(batches, 3, 5, bt) == 0.0


def test_lru_model_counts_prefix_hits_up_to_the_first_missing_block():
    # Room for 3 blocks: group 0's three blocks, then group 1's first block evicts group 0's
    # first: group 0's next request finds blocks 1 and 2 but not 0, so it hits nothing.
    bt = 2
    batches = [[p] for p in prompts([0, 1, 0], 3, bt, 1)]
    assert lru_hit_rate(batches, 2, 3, bt) == 0.0
    # With room for 4 blocks, group 1's three blocks evict group 0's first two: still nothing;
    # with 6, group 0's repeat hits all three of its blocks.
    assert lru_hit_rate(batches, 2, 4, bt) == 0.0
    assert lru_hit_rate(batches, 2, 6, bt) == 1.0


def test_lru_model_looks_up_a_batch_before_it_stores():
    # Two requests of one group in one batch: the second cannot hit what the first will store.
    bt = 4
    same_batch = [prompts([0, 0], 1, bt, 1)]
    assert lru_hit_rate(same_batch, 1, 8, bt) == 0.0
    assert lru_hit_rate([[p] for p in same_batch[0]], 1, 8, bt) == 1.0


def test_watermark_model_keeps_its_first_chunks_below_the_watermark():
    # Room for 2.5 chunks: two fill 80% of it, so the loop evicts one; with room for 2.6 they
    # fill 77%, nothing is evicted, and the third group is refused every round: the first two
    # groups hit in every warm round, the third never.
    bt = 4
    batches = [[p] for p in prompts([0, 1, 2] * 3, 1, bt, 1)]
    rate, held = watermark_hit_rate(batches, 3, 2.6, bt, bt)
    assert (rate, held) == (pytest.approx(2 / 3), 2)
    # At 2.5 chunks every store past the first crosses the watermark and evicts the oldest:
    # LRU's worst case, no warm hit, one chunk held.
    assert watermark_hit_rate(batches, 3, 2.5, bt, bt) == (0.0, 1)
    # Room for every group below the watermark: every warm request hits.
    assert watermark_hit_rate(batches, 3, 4.0, bt, bt) == (1.0, 3)
