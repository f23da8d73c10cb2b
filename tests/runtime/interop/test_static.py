"""Static-cache handoffs (bridgecache.runtime.interop.static): an identity bridge copied into a transformers
StaticCache gives the target's own greedy tokens, eager and through a traced (torch.compile)
forward; a refill keeps the buffers' addresses; wrong shapes and sliding-window targets are refused."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from transformers import StaticCache

from bridgecache import HandoffConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache

NEW = 6


def _bridged(model, ids, **config):
    return BridgedCache(
        Bridge.identity(model),
        capture_kv(model, ids),
        model,
        ids,
        config=HandoffConfig(key_norm=False, **config),
    )


def _generate(model, ids, **kwargs):
    out = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
        output_logits=True, **kwargs,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("native_tail", [0, 3])
def test_identity_bridge_in_a_static_cache_gives_the_native_tokens(family, native_tail):
    model = tiny_model(family)
    ids = torch.randint(3, 300, (2, 23))
    native, native_logits = _generate(model, ids, cache_implementation="static")
    cache = _bridged(model, ids, native_tail=native_tail)
    static = cache.to_static(max_cache_len=ids.shape[1] + NEW)
    assert isinstance(static, StaticCache)
    assert int(static.get_seq_length()) == cache.translator.prefix_length == ids.shape[1] - 1 - native_tail
    bridged, bridged_logits = _generate(model, ids, past_key_values=static)
    assert torch.equal(bridged, native)
    assert (bridged_logits - native_logits).abs().max().item() < 1e-5


def test_refill_keeps_the_buffers_and_gives_the_new_contexts_tokens():
    model = tiny_model("qwen2")
    first, second = torch.randint(3, 300, (1, 19)), torch.randint(3, 300, (1, 19))
    static = _bridged(model, first).to_static(max_cache_len=19 + NEW)
    _generate(model, first, past_key_values=static)  # decoding writes past the context
    pointers = [layer.keys.data_ptr() for layer in static.layers]
    refilled = _bridged(model, second).to_static(max_cache_len=19 + NEW, into=static)
    assert refilled is static
    assert [layer.keys.data_ptr() for layer in static.layers] == pointers
    assert int(static.get_seq_length()) == 18
    bridged, _ = _generate(model, second, past_key_values=static)
    native, _ = _generate(model, second, cache_implementation="static")
    assert torch.equal(bridged, native)


def test_a_traced_forward_over_the_static_cache_gives_the_native_tokens():
    # torch.compile's graph capture (dynamo, fullgraph: no graph break) over the filled static
    # cache; the "aot_eager" backend skips code generation, so this runs in seconds on the CPU.
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 17))
    native, _ = _generate(model, ids, cache_implementation="static")
    static = _bridged(model, ids).to_static(max_cache_len=ids.shape[1] + NEW)
    eager_forward = model.forward
    torch._dynamo.reset()
    model.forward = torch.compile(eager_forward, backend="aot_eager", fullgraph=True)
    try:
        bridged, _ = _generate(model, ids, past_key_values=static, disable_compile=True)
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
    assert torch.equal(bridged, native)


def test_the_source_is_not_mutated_and_the_dynamic_cache_still_works():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 15))
    source = capture_kv(model, ids)
    before = [(k.clone(), v.clone()) for k, v in zip(source.keys, source.values)]
    cache = BridgedCache(Bridge.identity(model), source, model, ids, config=HandoffConfig(key_norm=False))
    static = cache.to_static(max_cache_len=32)
    for (k, v), k2, v2 in zip(before, source.keys, source.values):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert static.layers[0].keys.data_ptr() != cache.layers[0].keys.data_ptr()  # a copy, not a view
    dynamic, _ = _generate(model, ids, past_key_values=cache)
    native, _ = _generate(model, ids)
    assert torch.equal(dynamic, native)


def test_an_empty_context_gives_an_empty_static_cache():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 1))
    static = _bridged(model, ids).to_static(max_cache_len=1 + NEW)
    assert int(static.get_seq_length()) == 0
    bridged, _ = _generate(model, ids, past_key_values=static)
    native, _ = _generate(model, ids, cache_implementation="static")
    assert torch.equal(bridged, native)


def test_bad_requests_are_refused_by_name():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 15))
    cache = _bridged(model, ids)
    with pytest.raises(ValueError, match="max_cache_len=14, but the cache already holds 14 tokens"):
        cache.to_static(max_cache_len=14)
    small = cache.to_static(max_cache_len=20)
    with pytest.raises(ValueError, match=r"expected \(1, 2, 30, 16\).*make a new StaticCache"):
        _bridged(model, ids).to_static(max_cache_len=30, into=small)
    gemma = tiny_model("gemma3")
    gemma_ids = torch.randint(3, 300, (1, 12))
    with pytest.raises(ValueError, match="sliding-window layers"):
        _bridged(gemma, gemma_ids).to_static(max_cache_len=20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor + CUDA graphs)")
def test_compiled_forward_over_a_refilled_static_cache_gives_the_native_tokens_on_cuda():
    model = tiny_model("llama", head_dim=32).cuda()
    bridge = Bridge.identity(model)
    eager_forward = model.forward
    torch._dynamo.reset()
    compiled = torch.compile(eager_forward, mode="reduce-overhead")
    static = None
    try:
        for _ in range(3):  # new contexts into the same buffers: the compiled graph is reused
            ids = torch.randint(3, 300, (1, 30), device="cuda")
            cache = BridgedCache(
                bridge,
                capture_kv(model, ids),
                model,
                ids,
                config=HandoffConfig(key_norm=False, refresh=None),
            )
            static = cache.to_static(max_cache_len=48, into=static)
            model.forward = compiled
            bridged, _ = _generate(model, ids, past_key_values=static, disable_compile=True)
            model.forward = eager_forward
            native, _ = _generate(model, ids, cache_implementation="static", disable_compile=True)
            assert torch.equal(bridged, native)
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
