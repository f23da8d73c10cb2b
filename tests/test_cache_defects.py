"""BridgedCache regressions: layer types, stale native heads, reset, padding, tiny contexts, bad anchors."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from bridgecache.bridge import Bridge, LayerMap
from bridgecache.cache import BridgedCache
from bridgecache.capture import capture_kv
from bridgecache.compat import cache_kwargs
from bridgecache.modelinfo import model_spec


def _generate(model, ids, cache=None, **kwargs):
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True) | kwargs
    if cache is not None:
        kwargs |= cache_kwargs(model, cache)
    return model.generate(ids, return_dict_in_generate=True, **kwargs)


def _max_logit_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


def _layerwise_bridge(source, target) -> Bridge:
    """Target layer t reads source layer min(t, last) head for head, with identity maps."""
    src, tgt = model_spec(source), model_spec(target)
    heads, dim = tgt.num_kv_heads, tgt.head_dim
    eye = torch.eye(dim).expand(heads, dim, dim).contiguous()
    layers = []
    for t in range(tgt.num_layers):
        s = min(t, src.num_layers - 1)
        inputs = torch.stack([torch.full((heads,), s), torch.arange(heads)], dim=-1).unsqueeze(1).long()
        zeros = torch.zeros(heads, dim)
        layers.append(LayerMap([s], inputs, eye.clone(), zeros.clone(), eye.clone(), zeros.clone()))
    return Bridge(src, tgt, "identity", "identity", layers)


def test_a_target_without_layer_types_deeper_than_its_source_gets_all_its_layers():
    source = tiny_model("qwen2", num_hidden_layers=2, layer_types=["full_attention"] * 2)
    target = tiny_model("llama")  # 3 layers, no layer_types in its config
    ids = torch.randint(3, 300, (1, 12))
    cache = BridgedCache(_layerwise_bridge(source, target), capture_kv(source, ids), target, ids)
    assert len(cache.layers) == 3
    out = _generate(target, ids, cache)
    assert out.sequences.shape == (1, 17)
    assert cache.materialized_layers == [0, 1, 2]


def test_a_target_layer_type_the_cache_cannot_bridge_is_refused_by_name():
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 10))
    captured = capture_kv(model, ids)
    model.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(
        ValueError, match="target layer 1 is a LinearAttentionLayer cache layer; BridgedCache supports"
    ):
        BridgedCache(Bridge.identity(model), captured, model, ids)


def test_native_head_is_recomputed_after_the_target_weights_change_in_place():
    model = tiny_model("qwen2")
    bridge = Bridge.identity(model)
    ids = torch.randint(3, 300, (1, 12))
    BridgedCache(bridge, capture_kv(model, ids), model, ids)  # memoises the native head of ids[:, :1]
    with torch.no_grad():  # a fine-tuning step or a LoRA merge: same tensors, new values
        for p in model.parameters():
            p.mul_(1.5)
    cache = BridgedCache(bridge, capture_kv(model, ids), model, ids)
    bridged, native = _generate(model, ids, cache), _generate(model, ids)
    assert torch.equal(bridged.sequences, native.sequences)
    assert _max_logit_diff(bridged, native) < 1e-5
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    cache = BridgedCache(bridge, capture_kv(model, ids), model, ids)
    assert _max_logit_diff(_generate(model, ids, cache), _generate(model, ids)) < 1e-5


def test_reset_empties_every_layer_translated_or_not():
    model = tiny_model("gemma3")  # sliding and full layers
    ids = torch.randint(3, 300, (1, 14))
    cache = BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids)
    cache.layers[0]._materialize()  # translate one layer only
    assert cache.materialized_layers == [0]
    cache.reset()
    assert [layer.get_seq_length() for layer in cache.layers] == [0, 0, 0, 0]
    assert cache.get_seq_length() == 0
    # Reused from empty, it is an ordinary cache: generation matches the target's own.
    assert torch.equal(_generate(model, ids, cache).sequences, _generate(model, ids).sequences)
    assert cache.layers[2].get_seq_length() == 14 + 4  # the full-attention layer holds every token
