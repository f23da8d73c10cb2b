"""capture_kv checks its model, ids and mask where they enter, before the model runs (an id past
the vocabulary would be an IndexError inside the embedding, a device-side assert on CUDA)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from bridgecache import capture_kv
from bridgecache.checks import FieldTypeError


def test_capture_refuses_what_is_not_a_model_or_ids():
    model = tiny_model("qwen2")
    calls = []
    model.model.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[1, 2, 3]])
    cases = [
        (lambda: capture_kv(None, ids), FieldTypeError, "model=None; expected a transformers causal LM"),
        (
            lambda: capture_kv(model, [[1, 2]]),
            FieldTypeError,
            r"input_ids=\[\[1, 2\]\]; expected a torch.Tensor",
        ),
        (
            lambda: capture_kv(model, ids.float()),
            ValueError,
            "dtype torch.float32; expected integer token ids",
        ),
        (lambda: capture_kv(model, ids[0]), ValueError, r"shape \(3,\)"),
        (lambda: capture_kv(model, ids + 400), ValueError, "holds the id 403; expected ids in 0..319"),
        (lambda: capture_kv(model, ids, torch.ones(1, 2)), ValueError, r"attention_mask has shape \(1, 2\)"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert not calls
    assert capture_kv(model, ids).num_tokens == 3
