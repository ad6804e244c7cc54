"""Fixtures of the engine tests that run vLLM engines on the real model."""

from __future__ import annotations

import pytest

from real_model import model_dir
from vllm_jobs import gpl_prompts


@pytest.fixture(scope="module")
def model():
    return str(model_dir())


@pytest.fixture(scope="module")
def prompts(model):
    """vllm_jobs.gpl_prompts: GROUPS groups of a shared prefix and two prompts."""
    return gpl_prompts(model)
