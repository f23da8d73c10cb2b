"""BridgedCache construction memos (one walk of the target per cache): key-norm scales and the
native head follow the target's weights when they are edited in place or replaced."""

from __future__ import annotations

import torch
from tiny_models import random_bridge, tiny_model

from bridgecache import HandoffConfig
from bridgecache.kv.capture import capture_kv
from bridgecache.kv.keynorm import key_norm_scales
from bridgecache.runtime.cache import BridgedCache


def _cache(model, ids):
    # a fitted bridge: an identity bridge is never key-norm projected (no scales to read)
    config = HandoffConfig(refresh=None)
    return BridgedCache(random_bridge(model), capture_kv(model, ids), model, ids, config=config)


def test_key_norm_scales_follow_an_edited_and_a_replaced_norm_weight():
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (1, 12))
    before = _cache(model, ids).translator.key_norm_scales
    attention = model.model.layers[2].self_attn
    with torch.no_grad():
        attention.k_norm.weight.add_(1.0)  # in place: the version counter moves
    edited = _cache(model, ids).translator.key_norm_scales
    assert not torch.equal(edited[2], before[2])
    assert all(torch.equal(a, b) for a, b in zip(edited, key_norm_scales(model)))
    attention.k_norm.weight = torch.nn.Parameter(torch.full_like(attention.k_norm.weight, 0.25))
    replaced = _cache(model, ids).translator.key_norm_scales
    assert torch.equal(replaced[2], key_norm_scales(model)[2])
    assert not torch.equal(replaced[2], edited[2])
