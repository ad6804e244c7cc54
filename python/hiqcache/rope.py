"""The RoPE of a model, as Geometry.rope_theta / rope_interleaved take it, from its Hugging Face
config (what vLLM's model_config.hf_text_config and transformers' AutoConfig hold).

Only codecs that turn keys back by RoPE read it (Codec.INT4_ALLOT, INT5_ALLOT, INT6_ALLOT); a wrong
value costs their quality, never correctness (the daemon undoes the turn it did). Pure
functions."""

from __future__ import annotations

import math
from typing import Any

# model_type values whose RoPE pairs adjacent dims (2i, 2i + 1), as GPT-J; every other model
# pairs (i, i + head_dim / 2) (rotate-half: Llama, Qwen, Mistral, NeoX, ...).
INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen"})


def rope_of(config: Any, head_dim: int) -> tuple[float, bool]:
    """(theta, interleaved) of a model config; (0.0, False), no turn, where the model has no
    RoPE over its whole head (none, partial rotary dims, multimodal sections) or its base is
    not a finite number in [1, 1e12]."""
    get_text = getattr(config, "get_text_config", None)
    cfg = get_text() if callable(get_text) else config
    params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict):
        params = getattr(cfg, "rope_scaling", None)
    params = params if isinstance(params, dict) else {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    rotary_dim = getattr(cfg, "rotary_dim", None)
    if (isinstance(theta, bool) or not isinstance(theta, (int, float))
            or not math.isfinite(theta) or not 1 <= theta <= 1e12):
        return 0.0, False
    if partial not in (None, 1, 1.0) or rotary_dim not in (None, head_dim):
        return 0.0, False
    if params.get("mrope_section") or params.get("rope_type") in ("mrope",):
        return 0.0, False
    return float(theta), getattr(cfg, "model_type", "") in INTERLEAVED_MODEL_TYPES
