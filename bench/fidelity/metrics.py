"""Fidelity metrics of one window, their aggregation over windows, and the quality gates.

A window's unit of evidence is its mean over its continued positions; standard errors are over
windows (positions of one window are correlated), SE = stdev / sqrt(n).
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F


def logit_metrics(ref: torch.Tensor, x: torch.Tensor, targets: torch.Tensor) -> dict:
    """ref, x: [C, vocab] logits at the same C positions; targets: [C] next tokens.
    KL(ref || x) per position (nats), argmax agreement, and x's NLL of the targets."""
    lr = F.log_softmax(ref.double(), -1)
    lx = F.log_softmax(x.double(), -1)
    kl = (lr.exp() * (lr - lx)).sum(-1)
    return {
        "kl": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1": (ref.argmax(-1) == x.argmax(-1)).double().mean().item(),
        "nll": -lx.gather(-1, targets[:, None]).mean().item(),
    }


def nll(x: torch.Tensor, targets: torch.Tensor) -> float:
    return -F.log_softmax(x.double(), -1).gather(-1, targets[:, None]).mean().item()


def cosines(ref: torch.Tensor, x: torch.Tensor) -> list[float]:
    """ref, x: [layers, C, hidden]: per layer, the mean over positions of cos(ref, x)."""
    return F.cosine_similarity(ref.double(), x.double(), dim=-1).mean(-1).tolist()


def rel_errors(exact: list[tuple[torch.Tensor, torch.Tensor]],
               got: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], list[float]]:
    """Per layer ||x̂ - x|| / ||x|| over the whole prefix, for K and for V."""
    ks, vs = [], []
    for (k, v), (k2, v2) in zip(exact, got):
        ks.append(((k2.double() - k.double()).norm() / k.double().norm()).item())
        vs.append(((v2.double() - v.double()).norm() / v.double().norm()).item())
    return ks, vs


def summary(values: list[float]) -> dict:
    n = len(values)
    mean = statistics.fmean(values) if n else math.nan
    se = statistics.stdev(values) / math.sqrt(n) if n > 1 else math.nan
    return {"mean": mean, "se": se, "median": statistics.median(values) if n else math.nan,
            "n": n}


def ppl_summary(nlls: list[float]) -> dict:
    """Perplexity over all positions, exp(mean NLL) (every window has the same number of
    positions), with the delta-method SE ppl * SE(mean NLL)."""
    s = summary(nlls)
    ppl = math.exp(s["mean"])
    return {"ppl": ppl, "se": ppl * s["se"], "nll_mean": s["mean"], "nll_se": s["se"]}


def ppl_delta_se(floor_nlls: list[float], nlls: list[float]) -> float:
    """SE of ppl - floor ppl, paired by window: floor ppl * SE(mean of per-window NLL deltas)
    (delta method). The windows' own spread in difficulty, common to both paths, cancels."""
    d = summary([x - f for x, f in zip(nlls, floor_nlls)])
    return math.exp(statistics.fmean(floor_nlls)) * d["se"]


def paired_vs(base: list[dict], other: list[dict]) -> dict:
    """One path against another, window by window (each a per-window record with kl, top1 and
    nll): the mean difference of KL and top-1 with their SEs, and other ppl - base ppl with its
    paired SE (ppl_delta_se with base in the floor's place)."""
    base_nlls, nlls = [b["nll"] for b in base], [o["nll"] for o in other]
    return {"kl": summary([o["kl"] - b["kl"] for b, o in zip(base, other)]),
            "top1": summary([o["top1"] - b["top1"] for b, o in zip(base, other)]),
            "ppl_delta": math.exp(statistics.fmean(nlls)) - math.exp(statistics.fmean(base_nlls)),
            "ppl_delta_se": ppl_delta_se(base_nlls, nlls)}


def columnwise(rows: list[list[float]]) -> list[float]:
    """Mean over windows of per-layer lists."""
    return [statistics.fmean(col) for col in zip(*rows)] if rows else []


# --- gates ----------------------------------------------------------------------------------------

STRICT = {"kl_ratio": 1.5, "top1_points": 1.0, "ppl_se": 2.0}
LOOSE = {"kl_ratio": 3.0, "top1_points": 3.0}


def gate_kind(codec_name: str) -> str:
    if codec_name == "raw":
        return "exact"
    if codec_name.startswith(("int8", "fp8")):
        return "strict"
    # Below INT8's bytes, held to INT8's gate (the verdict says whether the 3x one holds).
    if codec_name in ("int4_kivi", "int4_hadamard", "int5_allot", "int6_allot", "int4_allot"):
        return "kivi"
    if codec_name.startswith("int4"):
        return "int4"
    return "none"


def check_gate(name: str, agg: dict, floor: dict, raw_exact: bool | None) -> dict:
    """The verdict for one codec. agg/floor: aggregated figures ({"kl": summary, "top1": summary,
    "ppl": ppl_summary}). raw_exact: for raw, whether every window's KV came back bit-exact and
    its logits equal the floor's. Returns kind, verdict ("pass", "FAIL", "not recommended",
    "no gate"), whether it fails the run, and the checks with their numbers."""
    kind = gate_kind(name)
    checks = []
    if kind == "exact":
        checks.append({"check": "KV bit-exact and logits identical to the floor on every window",
                       "ok": bool(raw_exact)})
        for key in ("kl", "top1"):
            checks.append({"check": f"{key} mean equals the floor's",
                           "ok": agg[key]["mean"] == floor[key]["mean"],
                           "value": agg[key]["mean"], "limit": floor[key]["mean"]})
        checks.append({"check": "ppl equals the floor's", "ok": agg["ppl"]["ppl"] ==
                       floor["ppl"]["ppl"], "value": agg["ppl"]["ppl"],
                       "limit": floor["ppl"]["ppl"]})
    elif kind == "kivi":
        # Held to INT8's gate; its verdict also says whether the loose (INT4) one holds.
        strict = check_gate("int8", agg, floor, raw_exact)
        loose = check_gate("int4", agg, floor, raw_exact)
        verdict = ("pass" if strict["verdict"] == "pass" else
                   "not recommended (passes the 3x gate only)" if loose["verdict"] == "pass"
                   else "not recommended")
        return {"kind": kind, "verdict": verdict, "fails_run": False,
                "checks": strict["checks"] + loose["checks"]}
    elif kind in ("strict", "int4"):
        lim = STRICT if kind == "strict" else LOOSE
        kl_lim = lim["kl_ratio"] * floor["kl"]["mean"]
        checks.append({"check": f"mean KL <= {lim['kl_ratio']}x floor",
                       "ok": agg["kl"]["mean"] <= kl_lim, "value": agg["kl"]["mean"],
                       "limit": kl_lim})
        top1_lim = 100 * floor["top1"]["mean"] - lim["top1_points"]
        checks.append({"check": f"top-1 >= floor - {lim['top1_points']:g} points",
                       "ok": 100 * agg["top1"]["mean"] >= top1_lim,
                       "value": 100 * agg["top1"]["mean"], "limit": top1_lim})
        if kind == "strict":
            d = agg["ppl"]["ppl"] - floor["ppl"]["ppl"]
            ppl_lim = lim["ppl_se"] * agg["ppl_delta_se"]
            checks.append({"check": "|ppl - floor ppl| <= 2 SE of that change (paired)",
                           "ok": abs(d) <= ppl_lim, "value": d, "limit": ppl_lim})
    ok = all(c["ok"] for c in checks)
    if kind == "none":
        verdict, fails = "no gate", False
    elif kind == "int4":
        verdict, fails = ("pass" if ok else "not recommended"), False
    else:
        verdict, fails = ("pass" if ok else "FAIL"), not ok
    return {"kind": kind, "verdict": verdict, "fails_run": fails, "checks": checks}
