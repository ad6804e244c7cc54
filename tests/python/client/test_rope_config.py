"""hiqcache.rope.rope_of: the RoPE a model's Hugging Face config gives Geometry (what the vLLM
adapter and the fidelity harness send for Codec.INT5_ALLOT), on the real SmolLM2 config and on
configs of the shapes transformers writes (rope_parameters, the older rope_theta attribute,
partial rotary, multimodal sections, GPT-J's interleaved pairs)."""

from __future__ import annotations

import types

import pytest
import transformers

from hiqcache.rope import rope_of
from hiqcache.spec import Geometry
from real_model import model_dir


def test_real_smollm2_config_gives_its_theta_and_rotate_half_pairs():
    cfg = transformers.AutoConfig.from_pretrained(model_dir())
    assert rope_of(cfg, cfg.head_dim) == (100000.0, False)


def ns(**kw):
    return types.SimpleNamespace(**kw)


@pytest.mark.parametrize("cfg, want", [
    (ns(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, model_type="qwen3"),
     (1e6, False)),
    (ns(rope_theta=10000, model_type="llama"), (10000.0, False)),  # older transformers
    (ns(rope_scaling={"rope_type": "llama3", "rope_theta": 5e5}, model_type="llama"),
     (5e5, False)),
    (ns(rope_theta=10000, rotary_dim=64, model_type="gptj"), (0.0, False)),  # partial: no turn
    (ns(rope_theta=10000, rotary_dim=128, model_type="gptj"), (10000.0, True)),
    (ns(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}, model_type="phi"),
     (0.0, False)),
    (ns(rope_parameters={"rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        model_type="qwen2_vl"), (0.0, False)),
    (ns(model_type="gpt2"), (0.0, False)),  # no RoPE
    (ns(rope_theta=float("inf"), model_type="llama"), (0.0, False)),
    (ns(rope_theta=0.5, model_type="llama"), (0.0, False)),
    (ns(rope_theta=True, model_type="llama"), (0.0, False)),
])
def test_config_shapes(cfg, want):
    assert rope_of(cfg, 128) == want
    theta, interleaved = rope_of(cfg, 128)
    # Whatever it answers, Geometry takes it.
    Geometry(num_layers=1, num_kv_heads=1, head_dim=128, rope_theta=theta,
             rope_interleaved=interleaved)


def test_text_config_of_a_multimodal_config_is_read():
    text = ns(rope_parameters={"rope_theta": 1e6}, model_type="qwen3")
    outer = ns(get_text_config=lambda: text, model_type="some_vl")
    assert rope_of(outer, 128) == (1e6, False)
