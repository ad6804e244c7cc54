"""Candidate 4-bit formats for CODEC_INT4_KIVI, modelled in torch, through fidelity.py's windows,
decode and metrics beside the daemon's INT8 and INT4: how the format was chosen
(bench/fidelity/README.md, "INT4 KIVI: candidates"). Exploration only: a candidate's KV here is
computed by this file, not by hiqcached, so its figures are not a codec's verdict; the verdicts
are fidelity.py's, through the real daemon.

    .venv/bin/python bench/fidelity/candidates.py --quick --no-gates --no-plot \\
        --out /tmp/candidates.json
    HIQ_CANDIDATES=ABK .venv/bin/python bench/fidelity/candidates.py ...  # a subset (letters below)

Each candidate quantizes keys per channel over each block of `--block-tokens` tokens (or of its
own token group), symmetric (one BF16 scale, levels -7..7) or asymmetric (zero point min and BF16
scale (max - min) / 15, levels 0..15), and values per token in groups of g elements, likewise;
None keeps that side exact (bf16). Rotated candidates (k_rot / v_rot) apply the orthonormal
Hadamard transform over head_dim before quantizing and again after (it is its own inverse); keys
may then be grouped per token (k_group) instead of per channel. Mixed candidates store some of
the KV at INT8 per head: a prefix's first blocks or tokens (int8_blocks, int8_tokens), whole
layers (int8_layers), or per block the tokens of largest amax (outlier_tokens); a token stored
so is left out of its block's key groups. Toward fewer key parameters (README, "Toward 42,000
B/token"): centred keys (the block's channel means out, then per-token groups), keys turned back
by RoPE's angle for their offset in the block (k_unrope), values per channel (v_chan),
ranges clipped to their least squared error (k_clip, v_clip), and keys' bits allotted per
channel and block by the channel's range (k_alloc; README, "Bits where the key ranges are").
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fidelity as fid  # noqa: E402
import hiqcache as hq  # noqa: E402
import kv_roundtrip  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Candidate:
    value: str
    k_sym: bool | None  # None: exact keys
    v_group: int | None  # None: exact values
    v_sym: bool = True
    k_tokens: int = 0  # key group in tokens; 0 = the block
    k_rot: bool = False  # keys rotated by the head_dim Hadamard transform before quantizing
    v_rot: bool = False  # values likewise
    k_group: int = 0  # keys per token in groups of k_group (sym) instead of per channel
    int8_blocks: int = 0  # the prefix's first int8_blocks blocks stored as INT8 per head instead
    int8_layers: tuple[int, ...] = ()  # layers stored as INT8 per head instead
    v_nf4: bool = False  # values: 16 normal-quantile levels times the group's amax (sym only)
    k_bits: int = 4  # code bits of keys and of values
    v_bits: int = 4
    int8_tokens: int = 0  # the prefix's first int8_tokens tokens stored as INT8 per head
    outlier_tokens: int = 0  # per block and plane, the tokens of largest amax as INT8 per head
    int8_token_planes: str = "kv"  # the planes int8_tokens / outlier_tokens apply to
    token_g32: bool = False  # those tokens at 4 bits per token in sym groups of 32, not INT8
    block_first_tokens: bool = False  # int8_tokens counts from every block's start
    # Centred keys: per block, channel by channel, the mean of the block's tokens is stored
    # ("bf16", or "int8": INT8 with a BF16 scale per head and block)
    # and subtracted before the rotation and the per-token groups (k_group); the restore adds it
    # back. Only the rounding of the residual is an error: a coarse mean widens the residual.
    k_center: str = ""
    # Keys turned back by RoPE's angle for their offset in the block (theta; 0 = off): the
    # block's tokens then share one rotation, so a channel's values stay alike over the block.
    k_unrope: float = 0.0
    v_chan: bool = False  # values per channel over the block (as keys), not per token
    # Asymmetric groups clipped: each group's [lo, hi] shrunk about its middle by the factor
    # of CLIPS that gives the least squared error over the group (the encoder's search).
    k_clip: bool = False
    v_clip: bool = False
    # Keys' bits allotted per channel and block (asymmetric per-channel groups only): k_alloc bits
    # per element on average, each channel's width (k_alloc_bits) chosen from its range over the
    # block so that the sum of range^2 * 4^-bits is least; the widths cost 3 bits per channel
    # and block. 0 = every channel at k_bits.
    k_alloc: float = 0.0
    k_alloc_pow: float = 2.0  # the gain of a bit weighs a channel's range to this power
    k_alloc_bits: tuple[int, int] = (2, 8)  # the least and most bits of a channel (0: its middle)
    # The channels' minimum and maximum stored as INT8 steps of one BF16 scale per head and
    # block (the minimum rounded down, the maximum up), not as a BF16 minimum and scale.
    k_param_int8: bool = False
    k_alloc_heads: bool = False  # the widths allotted over all heads' channels of the block


def like(base: Candidate, value: str, **changes: Any) -> Candidate:
    """base with another name and the fields in changes."""
    return dataclasses.replace(base, value=value, **changes)


# The bases of the E-J candidates: D7 (keys turned back by RoPE in the block and rotated, every
# block's first token at INT8, values rotated in one asymmetric group per head), the same with
# keys not rotated (G3), then their keys' bits allotted per channel (G2) over all heads (G7).
_D7 = Candidate("unrope_n_v_g128", False, 128, False, 0, True, True, int8_tokens=1,
                block_first_tokens=True, k_unrope=1e5)
_G3 = like(_D7, "unrope_n_k_norot_v_g128", k_rot=False)
_G2 = like(_G3, "unrope_n_k_norot_v_g128_kalloc4.1875", k_alloc=4.1875)
_G7 = like(_G2, "G2_heads_pooled", k_alloc_heads=True)

CANDIDATES = {
    "A": Candidate("k_sym_chan_v_g32_sym", True, 32),
    "B": Candidate("k_asym_chan_v_g32_sym", False, 32),  # the chosen format
    "C": Candidate("k_asym_chan_v_g64_sym", False, 64),
    "D": Candidate("k_sym_chan_v_g64_sym", True, 64),
    "E": Candidate("k_asym_chan_v_g32_asym", False, 32, False),
    "G": Candidate("k_asym_chan_v_g64_asym", False, 64, False),
    "H": Candidate("k_asym_chan_v_g16_sym", False, 16),
    "I": Candidate("k_asym_chan8_v_g32_sym", False, 32, True, 8),
    "K": Candidate("k_asym_chan_v_exact", False, None),
    "V": Candidate("k_exact_v_g32_sym", None, 32),
    "W": Candidate("k_exact_v_g32_asym", None, 32, False),
    # Rotated: an orthonormal Hadamard transform over head_dim spreads a channel's outliers over
    # every channel before quantizing, and the restore applies it again (it is its own inverse).
    "R": Candidate("hadamard_k_asym_chan_v_g32_sym", False, 32, True, 0, True, True),
    "S": Candidate("hadamard_k_g32_sym_v_g32_sym", True, 32, True, 0, True, True, 32),
    "T": Candidate("k_asym_chan_hadamard_v_g32_sym", False, 32, True, 0, False, True),
    "U": Candidate("hadamard_k_g32_asym_v_g32_asym", False, 32, False, 0, True, True, 32),
    # Mixed: B with the prefix's first block (its attention-sink tokens) as INT8, or with some
    # layers as INT8.
    "X": Candidate("b_first_block_int8", False, 32, int8_blocks=1),
    "Y": Candidate("r_first_block_int8", False, 32, True, 0, True, True, int8_blocks=1),
    "L": Candidate("b_layers_0_1_int8", False, 32, int8_layers=(0, 1)),
    "M": Candidate("b_last_2_layers_int8", False, 32, int8_layers=(-2, -1)),
    "N": Candidate("r_first_block_int8_v_nf4", False, 32, True, 0, True, True, int8_blocks=1,
                   v_nf4=True),
    # Bits moved from keys to values: 3-bit per-channel keys, 5-bit per-token values.
    "F": Candidate("k3_asym_chan_v5_g64_sym", False, 64, k_bits=3, v_bits=5),
    "J": Candidate("k3_asym_chan_v5_g32_sym", False, 32, k_bits=3, v_bits=5),
    "P": Candidate("r_first_block_int8_k3_v5_g64", False, 64, True, 0, True, True, int8_blocks=1,
                   k_bits=3, v_bits=5),
    "Z": Candidate("b_first_block_int8_v_nf4", False, 32, int8_blocks=1, v_nf4=True),
    "Q": Candidate("r_first_2_blocks_int8", False, 32, True, 0, True, True, int8_blocks=2),
    "O": Candidate("r_first_block_int8_v_asym", False, 32, False, 0, True, True, int8_blocks=1),
    "a": Candidate("r_first_block_int8_v_g16", False, 16, True, 0, True, True, int8_blocks=1),
    "b": Candidate("r_first_block_int8_k8tok", False, 32, True, 8, True, True, int8_blocks=1),
    # Data-chosen: per block and plane, the token of largest amax stored as INT8 (an index byte
    # and an INT8 row), left out of the block's key groups; or the prefix's first token so.
    "c": Candidate("b_outlier_token_int8", False, 32, outlier_tokens=1),
    "d": Candidate("r_outlier_token_int8", False, 32, True, 0, True, True, outlier_tokens=1),
    "e": Candidate("b_first_token_int8", False, 32, int8_tokens=1),
    "f": Candidate("r_first_token_int8", False, 32, True, 0, True, True, int8_tokens=1),
    "g": Candidate("r_outlier_2_tokens_int8", False, 32, True, 0, True, True, outlier_tokens=2),
    "h": Candidate("r_first_token_int8_v_asym", False, 32, False, 0, True, True, int8_tokens=1),
    "i": Candidate("r_first_token_int8_k_only_v_asym", False, 32, False, 0, True, True,
                   int8_tokens=1, int8_token_planes="k"),
    "j": Candidate("r_first_token_int8_v_only_v_asym", False, 32, False, 0, True, True,
                   int8_tokens=1, int8_token_planes="v"),
    "k": Candidate("r_outlier_token_int8_v_asym", False, 32, False, 0, True, True,
                   outlier_tokens=1),
    # Token 0's keys out of block 0's key groups but still 4-bit (per token, sym g32): the
    # record then needs no INT8 row, only the flag and a few scales.
    "l": Candidate("r_first_token_k_g32_v_asym", False, 32, False, 0, True, True,
                   int8_tokens=1, int8_token_planes="k", token_g32=True),
    # Every block's first token's keys at INT8, out of the block's key groups: a fixed record
    # (no position needed from the engine) that covers the prefix's token 0 as block 0's.
    "m": Candidate("r_block_first_token_k_int8_v_asym", False, 32, False, 0, True, True,
                   int8_tokens=1, int8_token_planes="k", block_first_tokens=True),
    "n": Candidate("r_block_first_token_int8_v_asym", False, 32, False, 0, True, True,
                   int8_tokens=1, block_first_tokens=True),
    # Keys turned back by RoPE within the block (SmolLM2's theta 1e5), else as n (D4: as B).
    "D1": Candidate("unrope_n", False, 32, False, 0, True, True, int8_tokens=1,
                    block_first_tokens=True, k_unrope=1e5),
    "D2": Candidate("unrope_no_rot_k_n", False, 32, False, 0, False, True, int8_tokens=1,
                    block_first_tokens=True, k_unrope=1e5),
    "D3": Candidate("unrope_hadamard_no_int8_v_asym", False, 32, False, 0, True, True,
                    k_unrope=1e5),
    "D5": Candidate("unrope_n_v_chan", False, 32, False, 0, True, True, int8_tokens=1,
                    block_first_tokens=True, k_unrope=1e5, v_chan=True),
    "D6": Candidate("unrope_n_v_g64", False, 64, False, 0, True, True, int8_tokens=1,
                    block_first_tokens=True, k_unrope=1e5),
    "D7": Candidate("unrope_n_v_g128", False, 128, False, 0, True, True, int8_tokens=1,
                    block_first_tokens=True, k_unrope=1e5),
    "D8": Candidate("unrope_n_v_g128_kclip", False, 128, False, 0, True, True, int8_tokens=1,
                    block_first_tokens=True, k_unrope=1e5, k_clip=True),
    "D9": Candidate("unrope_n_v_g128_kvclip", False, 128, False, 0, True, True, int8_tokens=1,
                    block_first_tokens=True, k_unrope=1e5, k_clip=True, v_clip=True),
    "D10": Candidate("n_v_g128", False, 128, False, 0, True, True, int8_tokens=1,
                     block_first_tokens=True),
    "D4": Candidate("unrope_B", False, 32, k_unrope=1e5),
    # Where D7's error is at 64-token blocks (exact values / exact keys), and bits moved from
    # values to keys at D7's bytes: 5-bit keys, 3-bit values.
    "E1": like(_D7, "unrope_n_v_g128_k5_v3", k_bits=5, v_bits=3),
    "E2": like(_D7, "unrope_n_v_exact", v_group=None, int8_token_planes="k"),
    "E3": like(_D7, "n_k_exact_v_g128", k_sym=None, k_unrope=0.0, int8_token_planes="v"),
    "E4": like(_D7, "unrope_n_v_g128_k5", k_bits=5),
    "E5": like(_D7, "n_v_g128_k5_v3", k_unrope=0.0, k_bits=5, v_bits=3),
    # Keys' bits allotted per channel by its range over the block (k_alloc): D7 / D10 (F), and
    # keys not rotated (G3 and after).
    "F1": like(_D7, "unrope_n_v_g128_kalloc4.25", k_alloc=4.25),
    "F2": like(_D7, "unrope_n_v_g128_kalloc4.5", k_alloc=4.5),
    "F3": like(_D7, "n_v_g128_kalloc4.25", k_unrope=0.0, k_alloc=4.25),
    "F4": like(_G3, "unrope_n_k_norot_v_g128_kalloc4.25", k_alloc=4.25),
    "F5": like(_D7, "unrope_n_v_g128_kalloc4", k_alloc=4.0),
    "G1": like(_G3, "unrope_n_k_norot_v_g128_kalloc4", k_alloc=4.0),
    "G2": _G2,
    "G3": _G3,
    "G4": like(_G3, "unrope_n_k_norot_v_g128_kalloc4.5", k_alloc=4.5),
    "G5": like(_G2, "n_k_norot_v_g128_kalloc4.1875 (no RoPE turn)", k_unrope=0.0),
    "G6": like(_G2, "G2_int8_params_kalloc4.4375", k_alloc=4.4375, k_param_int8=True),
    "G7": _G7,
    "G8": like(_G7, "G7_bits1_8", k_alloc_bits=(1, 8)),
    "G9": like(_G7, "G7_without_the_RoPE_turn", k_unrope=0.0),
    "G10": like(_G7, "G7_int8_params_kalloc4.4375", k_alloc=4.4375, k_param_int8=True),
    # G2's allotment varied: the gain's power, the widths' bounds, no INT8 first tokens.
    "H1": like(_G2, "G2_pow3", k_alloc_pow=3),
    "H2": like(_G2, "G2_pow4", k_alloc_pow=4),
    "H3": like(_G2, "G2_no_int8_first_kalloc4.3125", int8_tokens=0, block_first_tokens=False,
               k_alloc=4.3125),
    "H4": like(_G2, "G2_pow1.5", k_alloc_pow=1.5),
    "H5": like(_G2, "G2_pow1", k_alloc_pow=1),
    "H6": like(_G2, "G2_bits0_7", k_alloc_bits=(0, 7)),
    "H7": like(_G2, "G2_bits1_8", k_alloc_bits=(1, 8)),
    "H8": like(_G2, "G2_bits3_6", k_alloc_bits=(3, 6)),
    # Toward INT8's gate: G7 with more bits.
    "J1": like(_G7, "G7_k5_v5", k_alloc=5.0, v_bits=5),
    "J2": like(_G7, "G7_k4.5_v5", k_alloc=4.5, v_bits=5),
    "J3": like(_G7, "G7_k5_v4", k_alloc=5.0),
    "J4": like(_G7, "G9_k4.5_v5 (J2 without the RoPE turn)", k_unrope=0.0, k_alloc=4.5,
               v_bits=5),
    "J5": like(_G7, "G7_k5_v5_int8_params", k_alloc=5.0, v_bits=5, k_param_int8=True),
    "J6": like(_G7, "G7_k5.25_v5_int8_params", k_alloc=5.25, v_bits=5, k_param_int8=True),
    # Centred keys (k_center): the block's channel means out, then the rotation and per-token
    # groups of k_group (sym or asym); values rotated, asym groups of v_group.
    "C1": Candidate("centre_bf16_had_k_g128_sym_v_g32_asym", True, 32, False, 0, True, True,
                    128, k_center="bf16"),
    "C2": Candidate("centre_int8_had_k_g128_sym_v_g32_asym", True, 32, False, 0, True, True,
                    128, k_center="int8"),
    "C3": Candidate("centre_bf16_had_k_g32_sym_v_g32_asym", True, 32, False, 0, True, True,
                    32, k_center="bf16"),
    "C4": Candidate("centre_bf16_had_k_g128_asym_v_g32_asym", False, 32, False, 0, True, True,
                    128, k_center="bf16"),
    "C5": Candidate("centre_int8_had_k_g128_sym_v_g128_asym", True, 128, False, 0, True, True,
                    128, k_center="int8"),
    "C6": Candidate("centre_bf16_k_g32_sym_v_g32_asym (no rotation of keys)", True, 32, False,
                    0, False, True, 32, k_center="bf16"),
}


def hadamard(d: int) -> torch.Tensor:
    """The orthonormal d x d Hadamard matrix (d a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def q_sym(x: torch.Tensor, amax: torch.Tensor, bits: int = 4) -> torch.Tensor:
    top = 2 ** (bits - 1) - 1
    s = bf16(torch.clamp(amax, min=2.0 ** -112) / top)
    return bf16(torch.clamp(torch.round(x / s), -top, top) * s)


def q_asym(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           bits: int | torch.Tensor = 4) -> torch.Tensor:
    top = 2 ** bits - 1
    s = bf16(torch.clamp(hi - lo, min=2.0 ** -112) / top)
    q = torch.round((x - lo) / s)
    q = torch.minimum(torch.clamp(q, min=0), torch.as_tensor(top, dtype=q.dtype))
    return bf16(q * s + lo)


def allot_bits(rng: torch.Tensor, avg: float, power: float = 2.0,
               widths: tuple[int, int] = (2, 8)) -> torch.Tensor:
    """rng: [..., 1, d] ranges of d channels -> their bit widths in `widths`, avg on average
    over d: the (avg - lowest) * d increments of largest gain, an increment from b to b + 1 bits
    of a channel gaining rng^power * 4^-b (power 2: its squared error's share)."""
    b0, b1 = widths
    d = rng.shape[-1]
    n = round((avg - b0) * d)
    steps = torch.arange(b1 - b0, dtype=torch.float32)
    gain = (rng.float() ** power).unsqueeze(-1) * 4.0 ** -(b0 + steps)  # [..., 1, d, steps]
    flat = gain.flatten(-2)
    top = flat.topk(n, dim=-1).indices
    taken = torch.zeros_like(flat).scatter_(-1, top, 1.0).reshape(gain.shape)
    return b0 + taken.sum(dim=-1)


CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def q_asym_clipped(g: torch.Tensor, axis: int, bits: int) -> torch.Tensor:
    lo, hi = g.amin(dim=axis, keepdim=True), g.amax(dim=axis, keepdim=True)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best, best_err = None, None
    for f in CLIPS:
        q = q_asym(torch.clamp(g, mid - f * half, mid + f * half), mid - f * half,
                   mid + f * half, bits)
        err = ((q - g) ** 2).sum(dim=axis, keepdim=True)
        if best is None:
            best, best_err = q, err
        else:
            take = err < best_err
            best = torch.where(take, q, best)
            best_err = torch.where(take, err, best_err)
    return best


def nf4_levels() -> torch.Tensor:
    """16 levels in [-1, 1] with an exact 0: 8 positive and 7 negative normal quantiles,
    each side scaled to reach 1 (the NF4 construction of QLoRA, Dettmers et al., 2023)."""
    normal = torch.distributions.Normal(0.0, 1.0)
    offset = 0.5 * (1 / 32 + 1 / 30)
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64))[:-1]
    neg = normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64))[:-1]
    pos = -pos.flip(0) / -pos[0]
    neg = neg / -neg[0]
    return torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).float()


def q_nf4(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    s = bf16(torch.clamp(amax, min=2.0 ** -112))
    lv = nf4_levels()
    idx = ((x / s).unsqueeze(-1) - lv).abs().argmin(dim=-1)
    return bf16(lv[idx] * s)


def q_int8(x: torch.Tensor) -> torch.Tensor:
    """INT8 per head (docs/design.md's CODEC_INT8_PER_HEAD): x [..., dim], one scale per row."""
    s = bf16(torch.clamp(x.float().abs().amax(dim=-1, keepdim=True), min=2.0 ** -112) / 127)
    return bf16(torch.clamp(torch.round(x.float() / s), -127, 127) * s).to(x.dtype)


def quantize(x: torch.Tensor, c: Candidate, keys: bool, bt: int, layer: int = 0,
             layers: int = 1) -> torch.Tensor:
    """x: [1, heads, P, dim] bf16 -> the candidate's restored KV, same shape."""
    if keys and c.k_unrope:
        inner = dataclasses.replace(c, k_unrope=0.0)
        y = rope_in_block(x.float(), c.k_unrope, bt, -1).to(torch.bfloat16)
        out = quantize(y, inner, keys, bt, layer, layers)
        return rope_in_block(out.float(), c.k_unrope, bt, 1).to(torch.bfloat16).contiguous()
    if layer in c.int8_layers or layer - layers in c.int8_layers:
        return q_int8(x).contiguous()
    if c.int8_blocks:
        n = min(x.shape[2], c.int8_blocks * bt)
        rest = dataclasses.replace(c, int8_blocks=0)
        head = q_int8(x[:, :, :n])
        if n == x.shape[2]:
            return head.contiguous()
        return torch.cat([head, quantize(x[:, :, n:], rest, keys, bt)], dim=2).contiguous()
    if (c.int8_tokens or c.outlier_tokens) and ("k" if keys else "v") in c.int8_token_planes:
        return quantize_with_int8_tokens(x, c, keys, bt)
    sym = c.k_sym if keys else c.v_sym
    bits = c.k_bits if keys else c.v_bits
    if keys and (c.k_alloc or c.k_param_int8 or c.k_alloc_heads) and (
            not c.k_alloc or c.k_sym is not False or c.k_group or c.k_clip or c.k_center
            or c.k_tokens not in (0, bt)):
        raise ValueError(f"{c.value}: k_param_int8 and k_alloc_heads need k_alloc, and k_alloc "
                         "asymmetric key groups per channel over the block (no k_sym, k_group, "
                         "k_clip, k_center or k_tokens)")
    if keys and c.k_sym is None or not keys and c.v_group is None:
        return x.contiguous()
    f = x.float()[0]
    h, p, d = f.shape
    rot = hadamard(d) if (c.k_rot if keys else c.v_rot) else None
    centre = None
    if keys and c.k_center:
        blocks = f.reshape(h, p // bt, bt, d)
        centre = quantize_centre(blocks.mean(dim=2, keepdim=True), c.k_center)
        f = (blocks - centre).reshape(h, p, d)
    if rot is not None:
        f = bf16(f @ rot)  # stored as BF16 before quantizing, as the input is
    if keys and c.k_group:
        kg = min(c.k_group, d)
        g = f.reshape(h, p, d // kg, kg)
        axis = 3
    elif keys or c.v_chan:
        t = c.k_tokens or bt
        g = f.reshape(h, p // t, t, d)
        axis = 2
    else:
        gs = min(c.v_group or d, d)
        g = f.reshape(h, p, d // gs, gs)
        axis = 3
    if not keys and c.v_nf4:
        out = q_nf4(g, g.abs().amax(dim=axis, keepdim=True))
    elif sym:
        out = q_sym(g, g.abs().amax(dim=axis, keepdim=True), bits)
    elif keys and c.k_alloc and axis == 2:
        lo, hi = g.amin(dim=axis, keepdim=True), g.amax(dim=axis, keepdim=True)
        if c.k_param_int8:
            m = torch.maximum(lo.abs(), hi.abs()).amax(dim=-1, keepdim=True)
            # m / 126: the BF16 rounding (2^-9 at most) keeps every step within +-127
            ps = bf16(torch.clamp(m, min=2.0 ** -112) / 126)
            lo, hi = torch.floor(lo / ps) * ps, torch.ceil(hi / ps) * ps
        if c.k_alloc_heads:  # [h, nb, 1, d] -> [nb, 1, h * d] and back
            rng = (hi - lo).permute(1, 2, 0, 3).reshape(p // bt, 1, h * d)
            bits_c = allot_bits(rng, c.k_alloc, c.k_alloc_pow, c.k_alloc_bits)
            bits_c = bits_c.reshape(p // bt, 1, h, d).permute(2, 0, 1, 3)
        else:
            bits_c = allot_bits(hi - lo, c.k_alloc, c.k_alloc_pow, c.k_alloc_bits)
        out = torch.where(bits_c > 0, q_asym(g, lo, hi, torch.clamp(bits_c, min=1)),
                          bf16((lo + hi) / 2))
    elif c.k_clip if keys else c.v_clip:
        out = q_asym_clipped(g, axis, bits)
    else:
        out = q_asym(g, g.amin(dim=axis, keepdim=True), g.amax(dim=axis, keepdim=True), bits)
    if rot is not None:
        out = out.reshape(h, p, d) @ rot
    if centre is not None:
        out = out.reshape(h, p // bt, bt, d) + centre
    return out.reshape(h, p, d).to(torch.bfloat16).unsqueeze(0).contiguous()


def rope_in_block(x: torch.Tensor, theta: float, bt: int, sign: int) -> torch.Tensor:
    """RoPE (rotate-half pairs i, i + d/2) by sign x (the token's offset in its block) x the
    pair's frequency, in fp32."""
    d = x.shape[-1]
    j = (torch.arange(x.shape[2]) % bt).double()
    inv = theta ** (-torch.arange(0, d, 2).double() / d)
    ang = (j[:, None] * inv[None, :]) * sign
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def quantize_centre(m: torch.Tensor, fmt: str) -> torch.Tensor:
    """m: [heads, blocks, 1, dim] fp32 means -> as stored (scales per head and block)."""
    if fmt == "bf16":
        return bf16(m)
    amax = m.abs().amax(dim=-1, keepdim=True)
    if fmt == "int8":
        s = bf16(torch.clamp(amax, min=2.0 ** -112) / 127)
        return torch.clamp(torch.round(m / s), -127, 127) * s
    raise ValueError(fmt)


def quantize_with_int8_tokens(x: torch.Tensor, c: Candidate, keys: bool, bt: int
                              ) -> torch.Tensor:
    """c's int8_tokens / outlier_tokens: those tokens at INT8 per head, the rest as c without
    them. A token left out of a key group is replaced there by its block's first other token
    (so that it moves no group's range), and its own result is the INT8 one."""
    rest = dataclasses.replace(c, int8_tokens=0, outlier_tokens=0)
    p = x.shape[2]
    chosen = torch.zeros(p, dtype=torch.bool)
    chosen[:min(c.int8_tokens, p)] = True
    if c.block_first_tokens:
        for b0 in range(0, p, bt):
            chosen[b0:min(p, b0 + c.int8_tokens)] = True
    if c.outlier_tokens:
        score = x.float()[0].abs().amax(dim=(0, 2))  # [P]: the token's amax over heads, dims
        for b0 in range(0, p, bt):
            top = score[b0:b0 + bt].topk(min(c.outlier_tokens, min(bt, p - b0))).indices
            chosen[b0 + top] = True
    filled = x.clone()
    for b0 in range(0, p, bt):
        blk = chosen[b0:b0 + bt]
        if blk.all() or not blk.any():
            continue
        other = b0 + int((~blk).nonzero()[0])
        idx = b0 + blk.nonzero()[:, 0]
        filled[:, :, idx] = x[:, :, other:other + 1]
    out = quantize(filled, rest, keys, bt)
    if c.token_g32:
        alone = x[:, :, chosen].float()
        rot = hadamard(x.shape[3]) if (c.k_rot if keys else c.v_rot) else None
        if rot is not None:
            alone = bf16(alone @ rot)
        g = alone.reshape(*alone.shape[:3], -1, 32)
        q = q_sym(g, g.abs().amax(dim=-1, keepdim=True)).reshape(alone.shape)
        out[:, :, chosen] = (q @ rot if rot is not None else q).to(x.dtype)
    else:
        out[:, :, chosen] = q_int8(x[:, :, chosen])
    return out.contiguous()


def bytes_per_token(c: Candidate, hd: int, layers: int, bt: int, head_dim: int) -> int:
    """Stored bytes per token: codes plus BF16 parameters (2 per asymmetric group, amortised over
    the block where a group spans its tokens); INT8 layers at INT8's row (codes and a BF16 scale
    per head), and so a block's first token where block_first_tokens stores it so. A prefix's
    first blocks or tokens at INT8 (int8_blocks, int8_tokens alone) are left out: they add
    (INT8 - this) bytes per token they cover, once per prefix."""
    int8 = hd + 2 * hd / head_dim

    def side(bits: float, sym: bool | None, per_token_group: int, channel_groups: float,
             extra_per_block: float, plane: str) -> float:
        """per_token_group: elements per group of one token (0: none); channel_groups: groups
        per channel in a block (each spanning tokens; 0: none)."""
        if sym is None:
            return 2 * hd
        n_par = 1 if sym else 2
        per_token = hd * bits / 8 + (2 * n_par * hd / per_token_group if per_token_group else 0)
        per_block = 2 * n_par * hd * channel_groups + extra_per_block
        out = per_token + per_block / bt
        if c.block_first_tokens and c.int8_tokens and plane in c.int8_token_planes:
            out += (int8 - per_token) / bt
        return out

    k_extra = 0.0  # K bytes per block beyond the codes and BF16 parameters
    if c.k_center:
        k_extra = 2 * hd if c.k_center == "bf16" else hd + 2 * hd / head_dim
    if c.k_alloc:
        k_extra += 3 * hd / 8  # the widths
    if c.k_param_int8:
        k_extra += -2 * hd + 2 * hd / head_dim  # INT8 minimum and maximum, a scale per head
    k = side(c.k_alloc or c.k_bits, c.k_sym, min(c.k_group, head_dim) if c.k_group else 0,
             0 if c.k_group else bt / (c.k_tokens or bt), k_extra, "k")
    v = (2 * hd if c.v_group is None else
         side(c.v_bits, c.v_sym, 0 if c.v_chan else c.v_group, 1 if c.v_chan else 0, 0.0, "v"))
    n8 = len(c.int8_layers)
    return round((layers - n8) * (k + v) + n8 * 2 * int8)


def main() -> int:
    names = os.environ.get("HIQ_CANDIDATES", "ABCDEG")
    chosen = [CANDIDATES[k] for k in (names.split(",") if "," in names else names)]
    base = kv_roundtrip.DaemonKv
    exact: dict[int, Any] = {}

    class CandidateKv(base):  # type: ignore[misc, valid-type]
        def register(self, codec: Any) -> Any:
            if not isinstance(codec, Candidate):
                return super().register(codec)
            hd = self.g.num_kv_heads * self.g.head_dim
            acc = kv_roundtrip.Accepted(codec, -1,  # type: ignore[arg-type]
                                        bytes_per_token(codec, hd, self.g.num_layers, self.bt,
                                                        self.g.head_dim))
            self.encoded_bytes[codec] = acc.encoded_bytes_per_token
            return acc, ""

        def put(self, kv: Any) -> None:
            exact[id(self)] = kv
            super().put(kv)

        def round_trip(self, codec: Any, tokens: list[int], window: int) -> Any:
            if not isinstance(codec, Candidate):
                return super().round_trip(codec, tokens, window)
            p = len(tokens)
            n = len(exact[id(self)])
            out = [(quantize(k[:, :, :p], codec, True, self.bt, i, n),
                    quantize(v[:, :, :p], codec, False, self.bt, i, n))
                   for i, (k, v) in enumerate(exact[id(self)])]
            lo = self.max_tokens  # where restored_bits reads
            for layer, (k, v) in enumerate(out):
                for plane, x in ((0, k), (1, v)):
                    rows = x[0].transpose(0, 1).contiguous().view(torch.int16).numpy()
                    self.data[layer, plane, lo:lo + p] = rows
            return out

    fid.DaemonKv = CandidateKv
    fid.pick_codecs = lambda spec: [hq.Codec.INT8_PER_HEAD, hq.Codec.INT4_G32_PER_HEAD, *chosen]
    for c in chosen:
        print(f"{c.value}: Qwen3-8B B/token {bytes_per_token(c, 1024, 36, 16, 128)} at 16-token "
              f"blocks, {bytes_per_token(c, 1024, 36, 64, 128)} at 64"
              + (f" (+ the first {c.int8_blocks} block(s) of a prefix at INT8)"
                 if c.int8_blocks else ""))
    return int(fid.main())


if __name__ == "__main__":
    sys.exit(main())
