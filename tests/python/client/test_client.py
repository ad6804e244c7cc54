"""hiqcache.Client against the real hiqcached: round trips, prefix semantics, TP-group lookup,
events, bad input, fail-open and re-registration after a restart."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import socket
import time

import numpy as np
import pytest

import hiqcache as hq
from daemon import ROOT, Daemon, start_or_skip_without_l3
from hiqcache.v1 import cache_pb2 as pb
from kv_util import (
    HostKv,
    fp8_violations,
    from_bf16_bits,
    int4_violations,
    int8_violations,
    kivi_k_violations,
    to_bf16_bits,
)
from margins import margin

G = hq.Geometry(num_layers=3, num_kv_heads=2, head_dim=64)
BT = 16


@pytest.fixture
def kv():
    k = HostKv(G, 8 * BT)
    yield k
    k.close()


def keys_for(tokens, salt="test"):
    return hq.compute_block_keys(tokens, BT, salt=salt)


def test_raw_round_trip_is_bit_exact_and_int8_within_bound(daemon, kv):
    with hq.Client(daemon.target, call_timeout=margin(10)) as c:
        for codec in (hq.Codec.RAW, hq.Codec.INT8_PER_HEAD):
            pool = c.register_pool(kv.spec(f"m-{codec.value}", BT, codec))
            kv.fill(range(0, 4 * BT), seed=1)
            keys = keys_for(range(4 * BT))
            res = c.backup(pool, keys, range(0, 4 * BT))
            assert res.status.ok, res.status
            assert res.blocks == [hq.BlockStatus.STORED] * 4
            again = c.backup(pool, keys[:2], range(0, 2 * BT))
            assert again.blocks == [hq.BlockStatus.ALREADY_PRESENT] * 2
            r = c.restore(pool, keys, range(4 * BT, 8 * BT))
            assert r.status.ok and r.restored_blocks == 4
            src, dst = kv.data[:, :, :4 * BT], kv.data[:, :, 4 * BT:]
            if codec is hq.Codec.RAW:
                assert np.array_equal(src, dst)
            else:
                assert not np.array_equal(src, dst)  # it really went through the codec
                assert int8_violations(src, dst) == 0
            info = c.pool_info(pool)
            per_token = G.num_layers * 2 * (G.num_kv_heads * G.head_dim +
                                            (2 * G.num_kv_heads if codec is hq.Codec.INT8_PER_HEAD
                                             else G.num_kv_heads * G.head_dim))
            assert info.encoded_bytes_per_token == per_token
            assert c.release_pool(pool).ok


def test_fp8_round_trip_within_bound_and_in_stats(daemon, kv):
    """CODEC_FP8_E4M3_PER_HEAD: INT8's bytes per token, every element within its bound, its own
    namespace (no blocks shared with INT8), reported by GetStats with its codec and capacity."""
    with hq.Client(daemon.target, call_timeout=margin(10)) as c:
        fp8 = c.register_pool(kv.spec("m-fp8", BT, hq.Codec.FP8_E4M3_PER_HEAD))
        int8 = c.register_pool(kv.spec("m-fp8", BT, hq.Codec.INT8_PER_HEAD))
        kv.fill(range(0, 4 * BT), seed=11)
        kv.data[0, 0, 3, 1, :] = 0  # an all-zero head restores exact zeros
        kv.data[1, 1, 5, 0, :7] = to_bf16_bits(np.array([1e-30, -2e-35, 0, 900, -1e3, 3e-4, 5]))
        keys = keys_for(range(4 * BT), salt="fp8")
        res = c.backup(fp8, keys, range(0, 4 * BT))
        assert res.status.ok and res.blocks == [hq.BlockStatus.STORED] * 4, res
        assert c.lookup(int8, keys).prefix_blocks == 0  # codecs never share blocks
        r = c.restore(fp8, keys, range(4 * BT, 8 * BT))
        assert r.status.ok and r.restored_blocks == 4
        src, dst = kv.data[:, :, :4 * BT], kv.data[:, :, 4 * BT:]
        assert not np.array_equal(src, dst)
        assert fp8_violations(src, dst) == 0
        assert int8_violations(src, dst) > 0  # really FP8: its error is relative, not INT8's
        assert np.array_equal(dst[0, 0, 3, 1], np.zeros(G.head_dim, np.uint16))
        info, int8_info = c.pool_info(fp8), c.pool_info(int8)
        assert info.encoded_bytes_per_token == int8_info.encoded_bytes_per_token == \
            G.num_layers * 2 * (G.num_kv_heads * G.head_dim + 2 * G.num_kv_heads)
        assert info.capacity_tokens == int8_info.capacity_tokens > 0
        ns = {n.codec: n for n in c.get_stats().namespaces if n.model == "m-fp8"}
        assert set(ns) == {hq.Codec.FP8_E4M3_PER_HEAD, hq.Codec.INT8_PER_HEAD}
        assert ns[hq.Codec.FP8_E4M3_PER_HEAD].blocks == 4
        assert ns[hq.Codec.FP8_E4M3_PER_HEAD].encoded_bytes_per_token == \
            info.encoded_bytes_per_token
        assert ns[hq.Codec.FP8_E4M3_PER_HEAD].capacity_blocks == \
            ns[hq.Codec.INT8_PER_HEAD].capacity_blocks > 0
        # A row holding Inf is rejected, not stored.
        kv.data[2, 0, 4 * BT + 1, 0, 0] = 0x7F80
        bad = c.backup(fp8, keys_for(range(BT), salt="fp8-inf"), range(4 * BT, 5 * BT))
        assert bad.blocks == [hq.BlockStatus.REJECTED]
        assert c.release_pool(fp8).ok and c.release_pool(int8).ok
    assert hq.Codec.parse("fp8_e4m3_per_head") is hq.Codec.FP8_E4M3_PER_HEAD


def test_int4_kivi_round_trip_within_bound_bytes_per_token_and_capacity(daemon, kv):
    """CODEC_INT4_KIVI: K per channel over each block, V as INT4 rows; every element within its
    bound, an outlier channel of K confined to itself (INT4's group holding it is coarse), its
    own namespace, bytes/token and capacity in GetStats, NaN/Inf rejected with nothing stored."""
    with hq.Client(daemon.target) as c:
        kivi = c.register_pool(kv.spec("m-kivi", BT, hq.Codec.INT4_KIVI))
        int4 = c.register_pool(kv.spec("m-kivi", BT, hq.Codec.INT4_G32_PER_HEAD))
        int8 = c.register_pool(kv.spec("m-kivi", BT, hq.Codec.INT8_PER_HEAD))
        kv.fill(range(0, 4 * BT), seed=21)
        # K channel 5 of head 1, layer 0: an outlier channel (offset 60 on every token).
        x = kv.data[0, 0, :4 * BT, 1, 5].astype(np.uint32) << 16
        kv.data[0, 0, :4 * BT, 1, 5] = to_bf16_bits(x.view(np.float32) + 60.0)
        keys = keys_for(range(4 * BT), salt="kivi")
        for pool in (kivi, int4):
            res = c.backup(pool, keys, range(0, 4 * BT))
            assert res.status.ok and res.blocks == [hq.BlockStatus.STORED] * 4, res
        assert c.lookup(int8, keys).prefix_blocks == 0  # codecs never share blocks
        src = kv.data[:, :, :4 * BT].copy()
        restored = {}
        for pool in (kivi, int4):
            r = c.restore(pool, keys, range(4 * BT, 8 * BT))
            assert r.status.ok and r.restored_blocks == 4
            restored[pool] = kv.data[:, :, 4 * BT:].copy()
        dst = restored[kivi]
        assert kivi_k_violations(src[:, 0], dst[:, 0], BT) == 0
        assert int4_violations(src[:, 1], dst[:, 1]) == 0  # V rows are INT4's
        assert np.array_equal(dst[:, 1], restored[int4][:, 1])  # byte for byte
        assert int8_violations(src, dst) > 0  # really 4 bits

        def k_err(y: np.ndarray) -> float:  # channels 0..31 of that head but 5
            a = (src[0, 0, :, 1, :32].astype(np.uint32) << 16).view(np.float32)
            b = (y[0, 0, :, 1, :32].astype(np.uint32) << 16).view(np.float32)
            return float(np.abs(np.delete(a - b, 5, axis=-1)).max())
        # INT4's group scale follows the outlier (about 64 / 7); KIVI's channels keep their own.
        assert k_err(dst) < k_err(restored[int4]) / 4
        info, int8_info = c.pool_info(kivi), c.pool_info(int8)
        hd = G.num_kv_heads * G.head_dim
        per_token = G.num_layers * (hd // 2 + 4 * hd // BT + hd // 2 + 2 * hd // 32)
        assert info.encoded_bytes_per_token == per_token == 504
        assert info.capacity_tokens > 1.4 * int8_info.capacity_tokens > 0
        ns = {n.codec: n for n in c.get_stats().namespaces if n.model == "m-kivi"}
        assert set(ns) == {hq.Codec.INT4_KIVI, hq.Codec.INT4_G32_PER_HEAD,
                           hq.Codec.INT8_PER_HEAD}
        assert ns[hq.Codec.INT4_KIVI].blocks == 4
        assert ns[hq.Codec.INT4_KIVI].encoded_bytes_per_token == 504
        assert ns[hq.Codec.INT4_KIVI].capacity_blocks > 0
        # Inf in a K plane and NaN in a V row: rejected, nothing stored.
        for plane, bits, salt in ((0, 0x7F80, "kivi-inf"), (1, 0x7FC1, "kivi-nan")):
            kv.fill(range(4 * BT, 5 * BT), seed=22)
            kv.data[2, plane, 4 * BT + 3, 0, 17] = bits
            bad_keys = keys_for(range(BT), salt=salt)
            bad = c.backup(kivi, bad_keys, range(4 * BT, 5 * BT))
            assert bad.blocks == [hq.BlockStatus.REJECTED]
            assert c.lookup(kivi, bad_keys).prefix_blocks == 0
        assert ns[hq.Codec.INT4_KIVI].blocks == 4
        assert c.release_pool(kivi).ok and c.release_pool(int4).ok and c.release_pool(int8).ok
    assert hq.Codec.parse("int4_kivi") is hq.Codec.INT4_KIVI


def test_int4_hadamard_round_trip_bytes_per_token_and_capacity(daemon, kv):
    """CODEC_INT4_HADAMARD: each block's first token restored as INT8 restores it, the other
    tokens close at 4 bits (their elementwise bound is checked in tests/kernels), its own
    namespace, bytes/token and capacity in GetStats, Inf and NaN rejected with nothing stored."""
    with hq.Client(daemon.target, call_timeout=margin(10)) as c:
        had = c.register_pool(kv.spec("m-hadamard", BT, hq.Codec.INT4_HADAMARD))
        int8 = c.register_pool(kv.spec("m-hadamard", BT, hq.Codec.INT8_PER_HEAD))
        kv.fill(range(0, 4 * BT), seed=23)
        keys = keys_for(range(4 * BT), salt="hadamard")
        res = c.backup(had, keys, range(0, 4 * BT))
        assert res.status.ok and res.blocks == [hq.BlockStatus.STORED] * 4, res
        assert c.lookup(int8, keys).prefix_blocks == 0  # codecs never share blocks
        assert c.backup(int8, keys, range(0, 4 * BT)).held == 4
        src = kv.data[:, :, :4 * BT].copy()
        restored = {}
        for pool in (had, int8):
            r = c.restore(pool, keys, range(4 * BT, 8 * BT))
            assert r.status.ok and r.restored_blocks == 4
            restored[pool] = kv.data[:, :, 4 * BT:].copy()
        dst = restored[had]
        # Token 0 of each block (both planes) is an INT8 row: INT8's bound, INT8's bytes.
        assert int8_violations(src[:, :, ::BT], dst[:, :, ::BT]) == 0
        assert np.array_equal(dst[:, :, ::BT], restored[int8][:, :, ::BT])
        rest = np.ones(4 * BT, bool)
        rest[::BT] = False
        assert int8_violations(src[:, :, rest], dst[:, :, rest]) > 0  # really 4 bits
        x = from_bf16_bits(src[:, :, rest]).astype(np.float64)
        y = from_bf16_bits(dst[:, :, rest]).astype(np.float64)
        for plane in (0, 1):  # relative error of the 4-bit tokens; a zero restore's is 1
            err = np.linalg.norm(y[:, plane] - x[:, plane]) / np.linalg.norm(x[:, plane])
            assert err < 0.2, (plane, err)
        info, int8_info = c.pool_info(had), c.pool_info(int8)
        hd, heads = G.num_kv_heads * G.head_dim, G.num_kv_heads
        k_plane = hd + 2 * heads + (BT - 1) * hd // 2 + 4 * hd  # + channel parameters
        v_plane = hd + 2 * heads + (BT - 1) * (hd // 2 + 4 * hd // 32)  # + group parameters
        per_token = -(-G.num_layers * (k_plane + v_plane) // BT)  # rounded up
        assert info.encoded_bytes_per_token == per_token == 551
        assert int8_info.encoded_bytes_per_token == 792
        assert info.capacity_tokens > 1.3 * int8_info.capacity_tokens > 0
        ns = {n.codec: n for n in c.get_stats().namespaces if n.model == "m-hadamard"}
        assert set(ns) == {hq.Codec.INT4_HADAMARD, hq.Codec.INT8_PER_HEAD}
        assert ns[hq.Codec.INT4_HADAMARD].blocks == 4
        assert ns[hq.Codec.INT4_HADAMARD].encoded_bytes_per_token == 551
        assert ns[hq.Codec.INT4_HADAMARD].capacity_blocks > \
            1.3 * ns[hq.Codec.INT8_PER_HEAD].capacity_blocks > 0
        # Inf in a 4-bit K row and NaN in a V plane's INT8 row: rejected, nothing stored.
        for plane, row, bits, salt in ((0, 3, 0x7F80, "had-inf"), (1, 0, 0x7FC1, "had-nan")):
            kv.fill(range(4 * BT, 5 * BT), seed=24)
            kv.data[2, plane, 4 * BT + row, 0, 17] = bits
            bad_keys = keys_for(range(BT), salt=salt)
            bad = c.backup(had, bad_keys, range(4 * BT, 5 * BT))
            assert bad.blocks == [hq.BlockStatus.REJECTED]
            assert c.lookup(had, bad_keys).prefix_blocks == 0
        assert c.release_pool(had).ok and c.release_pool(int8).ok
    assert hq.Codec.parse("int4_hadamard") is hq.Codec.INT4_HADAMARD


def allot_bytes_per_token(layers: int, heads: int, head_dim: int, bt: int, key_x16: int = 84,
                          value_bits: int = 5) -> int:
    """CODEC_INT5_ALLOT's (key_x16 84, value_bits 5), CODEC_INT6_ALLOT's (84, 6) and
    CODEC_INT4_ALLOT's (71, 4) stored bytes per token: per (block, layer), K = an INT8 first row,
    bt - 1 rows of key_x16/16 bits per element down to whole bytes and (for bt > 1) 2H + 2*H*D
    bytes of channel parameters; V = an INT8 first row and bt - 1 rows of value_bits-bit codes + a
    zero point and a scale per head."""
    hd = heads * head_dim
    k_plane = (hd + 2 * heads + (bt - 1) * (key_x16 * hd // 128)
               + (2 * heads + 2 * hd if bt > 1 else 0))
    v_plane = hd + 2 * heads + (bt - 1) * (value_bits * hd // 8 + 4 * heads)
    return -(-layers * (k_plane + v_plane) // bt)  # rounded up


def rope_keys(shape: tuple[int, ...], theta: float, seed: int) -> np.ndarray:
    """Keys as a model holds them, [layers, rows, heads, head_dim] in fp32: a base vector per
    (layer, head) (plus a little noise per token) rotated by RoPE at the row's position, pairs
    (i, i + head_dim/2) as Llama and Qwen rotate them."""
    layers, rows, heads, dim = shape
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((layers, 1, heads, dim)) * 3
    base[..., :4] *= 8  # a few large channels, as real keys have
    x = base + rng.standard_normal((layers, rows, heads, dim)) * 0.05
    freq = theta ** (-2.0 * np.arange(dim // 2) / dim)
    ang = np.arange(rows)[:, None] * freq[None, :]  # [rows, dim/2]
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_int5_allot_round_trip_turns_keys_by_the_pools_rope(daemon):
    """CODEC_INT5_ALLOT through the real daemon, rope_theta 1e5 (SmolLM2's): each block's first
    token restored byte for byte as an INT8 pool restores it, every element within a tenth of
    its head's largest magnitude, keys that RoPE rotated restored far closer than INT4_HADAMARD
    (and than the same codec without the rope: the rope reaches the codec), its own namespace per
    rope, bytes/token by the format's formula, Inf rejected with nothing stored. CODEC_INT6_ALLOT
    beside it: values about half INT5 allot's error, the same keys, its own namespace and
    bytes/token; CODEC_INT4_ALLOT: values about twice INT5 allot's error, keys farther, its own
    namespace and bytes/token."""
    g = hq.Geometry(num_layers=3, num_kv_heads=3, head_dim=64, rope_theta=1e5)
    bt = 16
    kv5 = HostKv(g, 8 * bt)
    try:
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            allot = c.register_pool(kv5.spec("m-allot", bt, hq.Codec.INT5_ALLOT))
            unturned = c.register_pool(dataclasses.replace(
                kv5.spec("m-allot", bt, hq.Codec.INT5_ALLOT),
                geometry=dataclasses.replace(g, rope_theta=0.0)))
            had = c.register_pool(kv5.spec("m-allot", bt, hq.Codec.INT4_HADAMARD))
            int8 = c.register_pool(kv5.spec("m-allot", bt, hq.Codec.INT8_PER_HEAD))
            six = c.register_pool(kv5.spec("m-allot", bt, hq.Codec.INT6_ALLOT))
            four = c.register_pool(kv5.spec("m-allot", bt, hq.Codec.INT4_ALLOT))
            kv5.fill(range(0, 4 * bt), seed=31)  # V: independent normal values
            k = rope_keys((g.num_layers, 4 * bt, g.num_kv_heads, g.head_dim), 1e5, seed=32)
            kv5.data[:, 0, :4 * bt] = to_bf16_bits(k)
            keys = keys_for(range(4 * bt), salt="allot")
            pools = (allot, unturned, had, int8, six, four)
            for pool in pools:
                res = c.backup(pool, keys, range(0, 4 * bt))
                assert res.status.ok and res.blocks == [hq.BlockStatus.STORED] * 4, res
            src = kv5.data[:, :, :4 * bt].copy()
            restored = {}
            for pool in pools:
                r = c.restore(pool, keys, range(4 * bt, 8 * bt))
                assert r.status.ok and r.restored_blocks == 4
                restored[pool] = kv5.data[:, :, 4 * bt:].copy()
            dst = restored[allot]
            # Token 0 of each block (both planes) is an INT8 row: INT8's bytes.
            assert np.array_equal(dst[:, :, ::bt], restored[int8][:, :, ::bt])
            x = from_bf16_bits(src).astype(np.float64)
            y = from_bf16_bits(dst).astype(np.float64)
            head_max = np.abs(x).max(axis=-1, keepdims=True)
            assert (np.abs(y - x) <= 0.1 * head_max).all(), float((np.abs(y - x) / head_max).max())
            rest = np.ones(4 * bt, bool)
            rest[::bt] = False
            assert not np.array_equal(src[:, :, rest], dst[:, :, rest])  # through the codec

            def mean_err(pool, plane: int) -> float:
                z = from_bf16_bits(restored[pool][:, plane, rest]).astype(np.float64)
                return float(np.abs(z - x[:, plane, rest]).mean())
            k5, k4, k0 = mean_err(allot, 0), mean_err(had, 0), mean_err(unturned, 0)
            assert k5 < k4 / 4, (k5, k4)
            assert k5 < k0 / 2, (k5, k0)  # the turn is the pool's rope's
            assert mean_err(allot, 1) < mean_err(had, 1), (mean_err(allot, 1), mean_err(had, 1))
            v5, v6 = mean_err(allot, 1), mean_err(six, 1)
            assert 0.3 * v5 < v6 < 0.7 * v5, (v5, v6)  # a bit more per value: half the step
            assert np.array_equal(restored[six][:, 0], restored[allot][:, 0])  # INT5 allot's keys
            assert np.array_equal(restored[six][:, :, ::bt], restored[int8][:, :, ::bt])
            v4, k4a = mean_err(four, 1), mean_err(four, 0)
            assert 1.5 * v5 < v4 < 2.6 * v5, (v5, v4)  # a bit less per value: twice the step
            assert k5 < k4a < k4, (k5, k4a, k4)  # fewer key bits, still the turn's
            assert np.array_equal(restored[four][:, :, ::bt], restored[int8][:, :, ::bt])

            # The rope is part of the namespace: a block stored under one rope is not another's.
            only = keys_for(range(bt), salt="allot-only")
            assert c.backup(allot, only, range(0, bt)).blocks == [hq.BlockStatus.STORED]
            assert c.lookup(allot, only).prefix_blocks == 1
            assert c.lookup(unturned, only).prefix_blocks == 0
            info, int8_info = c.pool_info(allot), c.pool_info(int8)
            assert len({c.pool_info(p).namespace_id for p in pools}) == 6
            per_token = allot_bytes_per_token(g.num_layers, g.num_kv_heads, g.head_dim, bt)
            assert info.encoded_bytes_per_token == per_token == 873
            assert allot_bytes_per_token(36, 8, 128, 32) == 51534  # Qwen3-8B
            six_per_token = allot_bytes_per_token(g.num_layers, g.num_kv_heads, g.head_dim, bt,
                                                  84, 6)
            assert c.pool_info(six).encoded_bytes_per_token == six_per_token == 941
            assert allot_bytes_per_token(36, 8, 128, 32, 84, 6) == 55998  # Qwen3-8B
            four_per_token = allot_bytes_per_token(g.num_layers, g.num_kv_heads, g.head_dim, bt,
                                                   71, 4)
            assert c.pool_info(four).encoded_bytes_per_token == four_per_token
            assert allot_bytes_per_token(36, 8, 128, 64, 71, 4) == 41738  # Qwen3-8B
            assert info.capacity_tokens > 1.2 * int8_info.capacity_tokens > 0
            ns = {(n.codec, n.namespace_id): n for n in c.get_stats().namespaces
                  if n.model == "m-allot"}
            assert ns[(hq.Codec.INT5_ALLOT, info.namespace_id)].blocks == 5
            assert ns[(hq.Codec.INT5_ALLOT, info.namespace_id)].encoded_bytes_per_token == 873
            assert ns[(hq.Codec.INT6_ALLOT, c.pool_info(six).namespace_id)].blocks == 4
            # Inf in a turned K row and NaN in a V row: rejected, nothing stored.
            for plane, row, bits, salt in ((0, 3, 0x7F80, "allot-inf"),
                                           (1, 5, 0x7FC1, "allot-nan")):
                kv5.fill(range(4 * bt, 5 * bt), seed=33)
                kv5.data[2, plane, 4 * bt + row, 0, 17] = bits
                bad_keys = keys_for(range(bt), salt=salt)
                bad = c.backup(allot, bad_keys, range(4 * bt, 5 * bt))
                assert bad.blocks == [hq.BlockStatus.REJECTED]
                assert c.lookup(allot, bad_keys).prefix_blocks == 0
            for pool in pools:
                assert c.release_pool(pool).ok
    finally:
        kv5.close()
    assert hq.Codec.parse("int5_allot") is hq.Codec.INT5_ALLOT
    assert hq.Codec.parse("int6_allot") is hq.Codec.INT6_ALLOT
    assert hq.Codec.parse("int4_allot") is hq.Codec.INT4_ALLOT


def test_geometry_rope_theta_is_checked_and_sent():
    """Geometry.rope_theta: 0 or a model's base in [1, 1e12], finite; sent as geometry.rope only
    when set, in RegisterPool and in a NamespaceRef alike."""
    for bad in (float("nan"), float("inf"), -1.0, 0.5, 2e12, True, "1e6"):
        with pytest.raises(ValueError, match="geometry.rope_theta"):
            hq.Geometry(num_layers=1, num_kv_heads=1, head_dim=64, rope_theta=bad)
    with pytest.raises(ValueError, match="geometry.rope_interleaved"):
        hq.Geometry(num_layers=1, num_kv_heads=1, head_dim=64, rope_interleaved=1)
    assert not G.to_proto().HasField("rope")
    g = hq.Geometry(num_layers=1, num_kv_heads=1, head_dim=64, rope_theta=1e6,
                    rope_interleaved=True)
    msg = g.to_proto()
    assert msg.rope.theta == 1e6 and msg.rope.interleaved
    ref = hq.NamespaceRef(model="m", geometry=g, block_tokens=16, codec=hq.Codec.INT5_ALLOT)
    assert ref.to_proto().geometry.rope.theta == 1e6
    assert ref.to_proto().codec == pb.CODEC_INT5_ALLOT



def test_codecs_are_the_wire_codecs_one_to_one():
    """Every hiqcache.Codec has its wire value and every wire value its Codec, by name; a value
    this library does not know reads as None, not as another codec."""
    from hiqcache.spec import CODEC_FROM_PB
    wire = dict(pb.Codec.items())
    assert len(wire) == len(hq.Codec) and sorted(wire.values()) == list(range(len(wire)))
    for c in hq.Codec:
        ref = hq.NamespaceRef(model="m", geometry=G, block_tokens=BT, codec=c)
        assert pb.Codec.Name(ref.to_proto().codec) == "CODEC_" + c.value.upper()
        assert CODEC_FROM_PB[wire["CODEC_" + c.value.upper()]] is c
    assert CODEC_FROM_PB.get(len(wire)) is None

def test_int4_round_trip_within_bound_bytes_per_token_and_capacity(daemon, kv):
    """CODEC_INT4_G32_PER_HEAD: H*D/2 + 2*H*D/32 bytes per row (0.55x INT8's), every element
    within its group's bound, its own namespace, GetStats with its codec, more capacity than INT8
    in the same pool bytes; zero groups exact, Inf rejected, head_dim % 32 != 0 refused."""
    with hq.Client(daemon.target, call_timeout=margin(10)) as c:
        int4 = c.register_pool(kv.spec("m-int4", BT, hq.Codec.INT4_G32_PER_HEAD))
        int8 = c.register_pool(kv.spec("m-int4", BT, hq.Codec.INT8_PER_HEAD))
        kv.fill(range(0, 4 * BT), seed=12)
        kv.data[0, 0, 3, 1, :32] = 0  # an all-zero group (its neighbour is not) restores zeros
        kv.data[1, 1, 5, 0, 40] = to_bf16_bits(np.array([500.0]))[0]  # an outlier in group 1
        keys = keys_for(range(4 * BT), salt="int4")
        res = c.backup(int4, keys, range(0, 4 * BT))
        assert res.status.ok and res.blocks == [hq.BlockStatus.STORED] * 4, res
        assert c.lookup(int8, keys).prefix_blocks == 0  # codecs never share blocks
        r = c.restore(int4, keys, range(4 * BT, 8 * BT))
        assert r.status.ok and r.restored_blocks == 4
        src, dst = kv.data[:, :, :4 * BT], kv.data[:, :, 4 * BT:]
        assert int4_violations(src, dst) == 0
        assert int8_violations(src, dst) > 0  # really 4 bits
        assert np.array_equal(dst[0, 0, 3, 1, :32], np.zeros(32, np.uint16))
        assert not np.array_equal(dst[0, 0, 3, 1, 32:], np.zeros(32, np.uint16))
        # The outlier sets only its own group's scale: group 0 of that head stays fine-grained.
        x0 = src[1, 1, 5, 0, :32].astype(np.uint32) << 16
        y0 = dst[1, 1, 5, 0, :32].astype(np.uint32) << 16
        # Below even per-head INT8's half step next to this outlier (500 / 127 / 2).
        assert np.abs(y0.view(np.float32) - x0.view(np.float32)).max() < 500 / 254
        info, int8_info = c.pool_info(int4), c.pool_info(int8)
        per_row = G.num_kv_heads * G.head_dim // 2 + 2 * G.num_kv_heads * G.head_dim // 32
        assert info.encoded_bytes_per_token == G.num_layers * 2 * per_row == 432
        assert int8_info.encoded_bytes_per_token == 792
        assert info.capacity_tokens > 1.5 * int8_info.capacity_tokens > 0
        ns = {n.codec: n for n in c.get_stats().namespaces if n.model == "m-int4"}
        assert set(ns) == {hq.Codec.INT4_G32_PER_HEAD, hq.Codec.INT8_PER_HEAD}
        assert ns[hq.Codec.INT4_G32_PER_HEAD].blocks == 4
        assert ns[hq.Codec.INT4_G32_PER_HEAD].encoded_bytes_per_token == 432
        assert ns[hq.Codec.INT4_G32_PER_HEAD].capacity_blocks > \
            1.5 * ns[hq.Codec.INT8_PER_HEAD].capacity_blocks > 0
        # A row holding Inf (in its last group) is rejected, not stored.
        kv.data[2, 0, 4 * BT + 1, 1, 63] = 0x7F80
        bad = c.backup(int4, keys_for(range(BT), salt="int4-inf"), range(4 * BT, 5 * BT))
        assert bad.blocks == [hq.BlockStatus.REJECTED]
        assert c.release_pool(int4).ok and c.release_pool(int8).ok
        g48 = hq.Geometry(num_layers=1, num_kv_heads=2, head_dim=48)
        kv48 = HostKv(g48, 2 * BT)
        try:
            with pytest.raises(hq.HiqError) as err:
                c.register_pool(kv48.spec("m-int4-48", BT, hq.Codec.INT4_G32_PER_HEAD))
            assert err.value.status.code == hq.StatusCode.INVALID_ARGUMENT
            assert "geometry.head_dim" in err.value.status.message
            assert c.release_pool(c.register_pool(kv48.spec("m-int4-48", BT))).ok  # INT8 is fine
        finally:
            kv48.close()
    assert hq.Codec.parse("int4_g32_per_head") is hq.Codec.INT4_G32_PER_HEAD


def test_prefix_semantics_and_restore_stops_at_first_missing(daemon, kv):
    with hq.Client(daemon.target, call_timeout=margin(10)) as c:
        pool = c.register_pool(kv.spec("m", BT))
        kv.fill(range(0, 4 * BT), seed=2)
        keys = keys_for(range(4 * BT))
        assert c.backup(pool, [keys[0], keys[1], keys[3]],
                        [*range(0, 2 * BT), *range(3 * BT, 4 * BT)]).held == 3
        assert c.lookup(pool, keys).prefix_blocks == 2
        before = kv.data[:, :, 4 * BT:].copy()
        r = c.restore(pool, keys, range(4 * BT, 8 * BT))
        assert r.restored_blocks == 2
        # Rows of blocks that were not restored are untouched.
        assert np.array_equal(kv.data[:, :, 6 * BT:], before[:, :, 2 * BT:])
        assert c.evict(pool, [keys[0]]) == 1
        assert c.lookup(pool, keys).prefix_blocks == 0
        stats = c.get_stats()
        ns = [n for n in stats.namespaces if n.model == "m"]
        assert len(ns) == 1 and ns[0].blocks == 2 and ns[0].evictions == 1
        assert stats.l3 == hq.L3Stats() and not stats.l3.enabled  # this daemon has no L3


def test_stats_show_l3_when_the_daemon_has_it():
    # L3 on, its cluster absent (a port nothing listens on): lookups and restores are L2 misses
    # that count as L3 errors; the figures come through get_stats().l3.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = Daemon(extra=("--l3-seeds", f"127.0.0.1:{port}", "--prefault", "false"))
    kv = HostKv(hq.Geometry(num_layers=2, num_kv_heads=2, head_dim=64), 4 * BT)
    try:
        start_or_skip_without_l3(d)
        with hq.Client(d.target, call_timeout=margin(10)) as c:
            pool = c.register_pool(kv.spec("m-l3", BT))
            keys = keys_for(range(2 * BT))
            assert c.lookup(pool, keys).prefix_blocks == 0
            assert c.restore(pool, keys, range(2 * BT)).restored_blocks == 0
            l3 = c.get_stats().l3
            assert l3.enabled
            assert l3.lookup_errors >= 1 and l3.lookup_misses == 2 and l3.lookup_hits == 0
            assert l3.fetches == 1 and l3.fetch_errors == 1 and l3.fetched_blocks == 0
            assert l3.fetch_latency_samples == 1
            assert l3.promoted_blocks == 0 and l3.corrupt_values == 0
            assert l3.write_policy == "write_through" and l3.budget_bytes == 0
    finally:
        kv.close()
        d.close()


def test_lookup_group_answers_what_every_rank_holds(daemon):
    geoms = [hq.Geometry(num_layers=2, num_kv_heads=2, head_dim=64, tp_rank=r, tp_size=2)
             for r in range(2)]
    kvs = [HostKv(g, 4 * BT) for g in geoms]
    try:
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            pools = [c.register_pool(k.spec("tp-model", BT)) for k in kvs]
            keys = keys_for(range(4 * BT))
            for k in kvs:
                k.fill(range(4 * BT), seed=3)
            assert c.backup(pools[0], keys, range(4 * BT)).held == 4
            assert c.backup(pools[1], keys[:2], range(2 * BT)).held == 2
            refs = [hq.NamespaceRef(model="tp-model", geometry=g, block_tokens=BT) for g in geoms]
            assert c.lookup_group(refs, keys).prefix_blocks == 2
            assert c.lookup_group(refs[:1], keys).prefix_blocks == 4
            other = hq.NamespaceRef(model="another-model", geometry=geoms[0], block_tokens=BT)
            assert c.lookup_group([other], keys).prefix_blocks == 0
            raw = hq.NamespaceRef(model="tp-model", geometry=geoms[0], block_tokens=BT,
                                  codec=hq.Codec.RAW)
            assert c.lookup_group([raw], keys).prefix_blocks == 0  # codecs never share blocks
            bad = hq.NamespaceRef(model="tp-model", block_tokens=BT,
                                  geometry=hq.Geometry(num_layers=2, num_kv_heads=0, head_dim=64))
            res = c.lookup_group([refs[0], bad], keys)
            assert res.prefix_blocks == 0
            assert res.status.code == hq.StatusCode.INVALID_ARGUMENT
            assert "namespaces[1].geometry.num_kv_heads" in res.status.message
    finally:
        for k in kvs:
            k.close()


def test_async_restore_signals_layers_and_done(daemon, kv):
    events = hq.HostEventPool.create(8)
    try:
        with hq.Client(daemon.target, call_timeout=margin(10)) as c:
            pool = c.register_pool(kv.spec("m", BT, events=events))
            kv.fill(range(0, 2 * BT), seed=4)
            keys = keys_for(range(2 * BT))
            b = c.backup(pool, keys, range(2 * BT), done_event=0, sync=False)
            assert b.status.ok and b.ticket > 0
            assert events.wait(0, b.ticket, 10).ok
            # The restore waits for slot 1 to reach 7 before it starts.
            r = c.restore(pool, keys, range(2 * BT, 4 * BT), wait_event=1, wait_value=7,
                          layer_event_base=2, done_event=5, sync=False)
            assert r.status.ok and r.restored_blocks == 2
            time.sleep(0.2)
            assert events.read(5) < r.ticket and events.read(2) < r.ticket
            events.store(1, 7)
            for layer in range(G.num_layers):
                assert events.wait(2 + layer, r.ticket, 10).ok
            assert events.wait(5, r.ticket, 10).ok
            assert int8_violations(kv.data[:, :, :2 * BT], kv.data[:, :, 2 * BT:4 * BT]) == 0
    finally:
        events.close()


def test_bad_input_is_refused_and_changes_nothing(daemon, kv):
    with hq.Client(daemon.target, call_timeout=margin(10)) as c:
        with pytest.raises(hq.HiqError) as err:
            c.register_pool(hq.PoolSpec(model="m", geometry=G, block_tokens=BT,
                                        buffers=kv.spec("m", BT).buffers, layers=kv.layers[:2]))
        assert err.value.status.code == hq.StatusCode.INVALID_ARGUMENT
        assert "layers" in err.value.status.message
        pool = c.register_pool(kv.spec("m", BT))
        keys = keys_for(range(2 * BT))
        res = c.backup(pool, keys, range(BT))  # one block's rows for two keys
        assert res.status.code == hq.StatusCode.INVALID_ARGUMENT
        assert res.blocks == [hq.BlockStatus.NOT_STORED] * 2
        res = c.backup(pool, keys, [*range(BT), *range(8 * BT, 9 * BT)])  # row out of range
        assert res.status.code == hq.StatusCode.INVALID_ARGUMENT and "rows" in res.status.message
        assert c.lookup(pool, keys).prefix_blocks == 0  # the rejected request stored nothing
        # Rows no uint32 holds, and keys of the wrong type, are a status, never an exception.
        for bad in (-1, 2**32, 1.5, "7"):
            rows = [*range(BT), *range(BT, 2 * BT - 1), bad]
            for res in (c.backup(pool, keys, rows), c.restore(pool, keys, rows)):
                assert res.status.code == hq.StatusCode.INVALID_ARGUMENT, bad
                assert "blocks[1]" in res.status.message, res.status.message
        for rows in (np.arange(2 * BT, dtype=np.float32), np.arange(2 * BT) - 1):
            res = c.restore(pool, keys, rows)  # not ints, or a negative row, in an array
            assert res.status.code == hq.StatusCode.INVALID_ARGUMENT
            assert "blocks[0]" in res.status.message
        res = c.backup(pool, ["x" * 16, keys[1]], range(2 * BT))
        assert res.status.code == hq.StatusCode.INVALID_ARGUMENT
        assert "blocks[0]" in res.status.message
        assert c.lookup(pool, [b"short"]).status.code == hq.StatusCode.INVALID_ARGUMENT
        assert c.get_stats().blocks == 0
    with pytest.raises(ValueError):
        hq.Client("nonsense")


def test_fail_open_without_daemon_then_reregisters_after_restart(kv):
    d = Daemon()
    try:
        c = hq.Client(d.target, call_timeout=0.5, reregister_interval=0.05)
        # Daemon absent: a pending registration and misses, within the deadline, no raise.
        pool = c.register_pool(kv.spec("m", BT), pending_if_unavailable=True)
        keys = keys_for(range(2 * BT))
        t0 = time.monotonic()
        assert c.lookup(pool, keys).prefix_blocks == 0
        b = c.backup(pool, keys, range(2 * BT))
        assert b.blocks == [hq.BlockStatus.NOT_STORED] * 2 and not b.status.ok
        assert c.restore(pool, keys, range(2 * BT)).restored_blocks == 0
        assert time.monotonic() - t0 < margin(3)  # 3 x the 0.5 s deadline where idle
        with pytest.raises(hq.HiqError):
            c.get_stats()
        # Daemon up: the pending pool registers on first use.
        d.start()
        kv.fill(range(2 * BT), seed=5)
        deadline = time.monotonic() + 10
        while not c.backup(pool, keys, range(2 * BT)).status.ok:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        first_id = c.pool_info(pool).pool_id
        assert c.lookup(pool, keys).prefix_blocks == 2
        # Restart (same pool shm: warm): the handle keeps working under a new registration.
        assert d.stop() == 0
        assert c.lookup(pool, keys).prefix_blocks == 0
        d.start()
        deadline = time.monotonic() + 10
        while c.lookup(pool, keys).prefix_blocks != 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert c.pool_info(pool).pool_id != first_id
        assert c.restore(pool, keys, range(2 * BT, 4 * BT)).restored_blocks == 2
        c.close()
    finally:
        d.close()


def test_block_keys_match_the_cpp_client():
    lib_path = os.environ.get("HIQ_C_LIB") or str(ROOT / "build" / "client" / "libhiqcache.so")
    if not pathlib.Path(lib_path).exists():
        pytest.fail(f"libhiqcache.so not found at {lib_path}")
    lib = ctypes.CDLL(lib_path)
    tokens = list(range(1000, 1000 + 5 * BT + 3)) + [2**31 + 5]
    arr = (ctypes.c_uint32 * len(tokens))(*[t & 0xFFFFFFFF for t in tokens])
    out = (ctypes.c_uint8 * (16 * 8))()
    n = ctypes.c_uint64(0)
    for salt in (b"", b"model|lora=x"):
        rc = lib.hiq_compute_block_keys(arr, ctypes.c_uint64(len(tokens)), ctypes.c_uint32(BT),
                                        ctypes.c_char_p(salt), ctypes.c_uint64(len(salt)), out,
                                        ctypes.c_uint64(8), ctypes.byref(n))
        assert rc == 0
        want = [bytes(out[16 * i:16 * (i + 1)]) for i in range(n.value)]
        assert len(want) == 5
        assert hq.compute_block_keys(tokens, BT, salt=salt) == want
    # Chained one block at a time, the same keys.
    k = hq.root_block_key(b"s")
    chained = []
    for i in range(3):
        k = hq.chain_block_key(k, tokens[i * BT:(i + 1) * BT])
        chained.append(k)
    assert chained == hq.compute_block_keys(tokens, BT, salt=b"s")[:3]


def test_a_new_client_is_not_held_back_by_another_clients_reconnect_backoff(kv):
    """Each client has its own connection: one whose channel backs off after failing to reach
    an absent daemon must not make a client created once the daemon is up fail (gRPC shares
    subchannels between channels unless told otherwise)."""
    d = Daemon()
    try:
        early = hq.Client(d.target, call_timeout=0.3)
        assert not early.lookup_group([hq.NamespaceRef(model="m", geometry=G, block_tokens=BT)],
                                      keys_for(range(BT))).status.ok
        d.start()
        with hq.Client(d.target, call_timeout=margin(10)) as late:
            late.register_pool(kv.spec("m", BT))  # raises if it shared the backed-off connection
        early.close()
    finally:
        d.close()


def test_shm_objects_of_dead_processes_are_reaped_and_live_ones_kept():
    """An engine killed before it unlinks its staging objects leaves them in /dev/shm; the next
    engine removes those of dead processes (its own user's, its own tags) and nothing else."""
    import subprocess
    import sys

    from hiqcache.host import reap_stale, unique_name

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = f"/hiq-{dead_pid}-1-0123abcd-reaptest"
    other_tag = f"/hiq-{dead_pid}-2-0123abcd-othertag"
    mine = hq.HostShm.create(unique_name("reaptest"), 4096)  # this live process
    created = [hq.HostShm.create(n, 4096) for n in (stale, other_tag)]
    try:
        reaped = reap_stale(("reaptest",))
        assert reaped == [stale]
        assert not os.path.exists("/dev/shm" + stale)
        assert os.path.exists("/dev/shm" + other_tag)
        assert os.path.exists("/dev/shm" + mine.name)
    finally:
        for s in (mine, *created):
            s.close()
