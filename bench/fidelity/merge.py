"""fidelity.py --merge-into: one run's codecs added to an earlier run's results, where the two
runs agree on everything else (bench/fidelity/README.md, "Adding a codec to an earlier run").
No imports beyond the standard library: the tests run it on the checked-in results."""

from __future__ import annotations

import copy

# The configuration that fixes the windows and every path's figures but the batch (a codec's
# figures do not move with the batch's composition here: the floor and INT8 came out identical,
# window for window, in runs of 4 and 9 rows; merge() checks that for the floor and every codec
# the two runs share, so it refuses where they would).
SAME_CONFIG = ("model", "text", "lengths", "windows", "chat_windows", "continued_tokens", "decode",
               "block_tokens")
SAME_WINDOW = ("window", "length", "offset", "kind", "ref_nll")
SAME_FIGURES = ("kl", "kl_max", "top1", "nll")


def merge(into: dict, run: dict) -> dict:
    """`into` with `run`'s codecs added: the plot of an earlier run gains a codec without running
    every codec again. ValueError when the two runs differ in anything but their codecs."""
    a, b = into["config"], run["config"]
    for k in SAME_CONFIG:
        if a.get(k) != b.get(k):
            raise ValueError(f"config {k!r} differs: {a.get(k)!r} against {b.get(k)!r}")
    if len(into["windows"]) != len(run["windows"]):
        raise ValueError("the runs hold different numbers of windows")
    shared = ["floor"] + [c for c in b["codecs"] if c in a["codecs"]]
    for wa, wb in zip(into["windows"], run["windows"]):
        for k in SAME_WINDOW:
            if wa[k] != wb[k]:
                raise ValueError(f"window {wa['window']}: {k} differs ({wa[k]!r}, {wb[k]!r})")
        for name in shared:
            for k in SAME_FIGURES:
                if wa["paths"][name][k] != wb["paths"][name][k]:
                    raise ValueError(f"window {wa['window']}: {name}'s {k} differs "
                                     f"({wa['paths'][name][k]!r}, {wb['paths'][name][k]!r})")
    added = [c for c in b["codecs"] if c not in a["codecs"]]
    out = copy.deepcopy(into)
    for c in added:
        out["paths"][c] = run["paths"][c]
        out["gates"][c] = run["gates"][c]
        for p, d in run["by_length"].items():
            out["by_length"][p][c] = d[c]
        for wo, wb in zip(out["windows"], run["windows"]):
            wo["paths"][c] = wb["paths"][c]
    out["config"]["codecs"] += added
    out["config"]["skipped_codecs"] = {k: v for k, v in
                                       (a["skipped_codecs"] | b["skipped_codecs"]).items()
                                       if k not in out["config"]["codecs"]}
    out["floor_rows_identical_all_windows"] &= run["floor_rows_identical_all_windows"]
    out.setdefault("merged_runs", []).append(
        {"codecs": added, "checked_identical": shared, "batch": b["batch"], "run": run["run"]})
    return out
