"""KV capture and RoPE: un-rotated keys re-rotate to exactly what the model cached."""

from __future__ import annotations

import pytest
import torch

from bridgecache.kv.capture import capture_kv
from bridgecache.kv.rope import RopeTables, rotate, unrotate
from bridgecache.models.spec import model_spec


def _roundtrip_error(model, ids, mask=None) -> float:
    captured = capture_kv(model, ids, attention_mask=mask)
    worst = 0.0
    for layer in range(captured.num_layers):
        cos, sin = captured.rope.cos_sin(layer, captured.position_ids)
        again = rotate(captured.unrotated_keys(layer), cos, sin)
        worst = max(worst, (again - captured.keys[layer]).abs().max().item())
    return worst


def test_capture_shapes_and_full_length_for_sliding_layers(tiny):
    family, model = tiny
    ids = torch.randint(0, 320, (2, 21))  # longer than gemma3's window of 8
    captured = capture_kv(model, ids)
    spec = model_spec(model)
    assert captured.num_layers == spec.num_layers
    for keys, values in zip(captured.keys, captured.values):
        assert keys.shape == (2, spec.num_kv_heads, 21, spec.head_dim)
        assert values.shape == keys.shape


def test_unrotated_keys_rerotate_to_cached_keys(tiny):
    family, model = tiny
    ids = torch.randint(0, 320, (2, 21))
    assert _roundtrip_error(model, ids) < 2e-6


def test_roundtrip_with_left_padding(tiny):
    family, model = tiny
    ids = torch.randint(0, 320, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    assert _roundtrip_error(model, ids, mask) < 2e-6


def test_gemma_uses_the_base_of_each_layer_type():
    from tiny_models import tiny_model

    model = tiny_model("gemma3")
    tables = RopeTables.from_model(model)
    positions = torch.arange(16)[None]
    sliding, _ = tables.cos_sin(0, positions)  # layer 0 is sliding (base 1e4)
    full, _ = tables.cos_sin(2, positions)  # layer 2 is full (base 1e6)
    assert not torch.allclose(sliding, full)
    # Un-rotating a full layer with the sliding base must NOT reproduce the un-rotated keys.
    captured = capture_kv(model, torch.randint(0, 320, (1, 16)))
    wrong = unrotate(captured.keys[2].float(), sliding, _)
    assert (wrong - captured.unrotated_keys(2)).abs().max() > 1e-3


def test_tables_from_spec_match_the_model(tiny):
    family, model = tiny
    from_model = RopeTables.from_model(model)
    from_spec = RopeTables.from_spec(model_spec(model))
    positions = torch.arange(40)[None]
    for layer in range(model.config.num_hidden_layers):
        a, b = from_model.cos_sin(layer, positions), from_spec.cos_sin(layer, positions)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_unrotate_inverts_attention_scaled_rope():
    # yarn-style rope scales cos and sin by an attention factor; un-rotation must still invert.
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    angles = torch.rand(1, 5, 4, dtype=torch.float64) * 6
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = 1.3 * emb.cos(), 1.3 * emb.sin()
    assert torch.allclose(unrotate(rotate(x, cos, sin), cos, sin), x, atol=1e-12)


@pytest.mark.real_model
def test_roundtrip_on_real_smollm2(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt")["input_ids"]
    assert _roundtrip_error(model, ids) < 1e-4  # real keys reach ~1e1: this is float32 rounding
