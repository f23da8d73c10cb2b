"""The native-work pass leaves room after the context for the tokens generate() appends: each
full-attention layer writes them in place (no concatenation copying the whole layer per step,
no second copy of the cache while the layers move out of the pass's buffers), with the same
tokens and logits as transformers' own concatenation; past the room, or after a batch operation,
decoding concatenates as before."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_bridge, tiny_model

from bridgecache import BridgedCache, GivenScores, HandoffConfig, RefreshConfig, capture_kv
from bridgecache.runtime.engine import generate
from bridgecache.runtime.native_work import generation as forward_module


def _cache(model, bridge, ids, scores) -> BridgedCache:
    config = HandoffConfig(one_launch=True, route="handoff", refresh=RefreshConfig(5, GivenScores(scores)))
    return BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config)


def _run(model, cache, ids, **kwargs):
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True) | kwargs
    return generate(model, cache, ids, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])  # gemma3: sliding layers keep concatenating
def test_decoding_in_the_room_equals_concatenation(family, monkeypatch):
    model = tiny_model(family)
    bridge = random_bridge(model)
    torch.manual_seed(0)
    ids, scores = torch.randint(3, 300, (2, 20)), torch.rand(2, 20)
    roomy = _cache(model, bridge, ids, scores)
    out = _run(model, roomy, ids)
    rooms = {
        layer._room[0].shape[-2] for layer in roomy.layers if getattr(layer, "sliding_window", None) is None
    }
    assert rooms == {20 + 1 + 5}  # the pass's columns, then max_new_tokens - 1 (the pass gives the first)
    monkeypatch.setattr(forward_module, "MAX_DECODE_ROOM", 0)
    tight = _cache(model, bridge, ids, scores)
    reference = _run(model, tight, ids)
    assert torch.equal(out.sequences, reference.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, reference.logits)) < 1e-5
    full = [i for i, layer in enumerate(roomy.layers) if getattr(layer, "sliding_window", None) is None]
    assert full, "every family here has full-attention layers"
    for i, layer in enumerate(roomy.layers):
        assert torch.equal(layer.keys, tight.layers[i].keys) and torch.equal(
            layer.values, tight.layers[i].values
        )
        if i in full:  # written in place: still the first columns of the pass's buffers
            assert layer.keys.data_ptr() == layer._room[0].data_ptr() and layer._room[0].shape[-2] > 20
        assert getattr(tight.layers[i], "_room", None) is None  # no room: concatenated, as transformers does


def test_past_the_room_and_after_beams_decoding_concatenates(monkeypatch):
    model = tiny_model("qwen2")
    bridge = random_bridge(model)
    torch.manual_seed(1)
    ids, scores = torch.randint(3, 300, (1, 20)), torch.rand(1, 20)
    monkeypatch.setattr(forward_module, "MAX_DECODE_ROOM", 2)  # 6 new tokens: the room runs out
    short = _cache(model, bridge, ids, scores)
    out = _run(model, short, ids)
    assert all(getattr(layer, "_room", None) is None for layer in short.layers)  # given up, then cat
    monkeypatch.setattr(forward_module, "MAX_DECODE_ROOM", 0)
    reference = _run(model, _cache(model, bridge, ids, scores), ids)
    assert torch.equal(out.sequences, reference.sequences)
    beams = dict(num_beams=2, output_logits=False)
    monkeypatch.setattr(forward_module, "MAX_DECODE_ROOM", 512)
    with_room = _run(model, _cache(model, bridge, ids, scores), ids, **beams).sequences
    monkeypatch.setattr(forward_module, "MAX_DECODE_ROOM", 0)
    assert torch.equal(with_room, _run(model, _cache(model, bridge, ids, scores), ids, **beams).sequences)
