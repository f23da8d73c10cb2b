"""The native route's prefill from a CUDA graph (bridgecache.runtime.native_work.prefill).

A right-padded prefill computes, for the real tokens, what the eager prefill of those tokens
computes; the forwards generate() sends on the native route are the ones a graph may replay, and
nothing else is. On the CPU the same buffers run eagerly (`captured=False`); the capture and its
replay through an engine run on CUDA machines only.
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_models import byte_tokenizer, random_bridge, tiny_model
from transformers import DynamicCache

from bridgecache import BridgedCache, HandoffConfig, HandoffEngine, capture_kv
from bridgecache.compat import cache_kwargs
from bridgecache.runtime.interop.views import generate_view
from bridgecache.runtime.native_work import prefill
from bridgecache.runtime.native_work.forward import forward_with_pass

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_right_padded_prefill_computes_what_the_exact_prefill_computes(family):
    model = tiny_model(family)
    graph = prefill.PrefillGraph(model, batch=2, length=64, captured=False)
    for m in (37, 64, 5):  # a later, shorter run over the same buffers: nothing stale leaks in
        ids = torch.randint(3, 300, (2, m))
        exact = model(ids, use_cache=True, **cache_kwargs(model, DynamicCache(config=model.config)))
        logits, layers = graph.run(ids)
        assert logits.shape == (2, 1, model.config.vocab_size)
        assert torch.allclose(logits[:, 0], exact.logits[:, -1], atol=1e-5)
        assert len(layers) == model.config.num_hidden_layers
        for (keys, values), own in zip(layers, exact.past_key_values.layers):
            assert keys.shape == own.keys.shape and values.shape == own.values.shape
            assert torch.allclose(keys, own.keys, atol=1e-5) and torch.allclose(values, own.values, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])
def test_a_captured_prefill_runs_sdpa_causal_without_a_mask_where_the_decoder_takes_a_mapping(
    family, monkeypatch
):
    """While a stream captures, transformers up to at least 5.17 builds a [batch, 1, length,
    length] mask for sdpa even without padding (its `is_tracing()` counts stream capture; later
    releases skip it when no mask is given); capture is emulated here on the CPU. A decoder that
    takes a prepared mask mapping (qwen2) is given none and runs sdpa causal under any release,
    as an eager forward does; one that takes no mapping (llama) or has other layer types (gemma3:
    sliding) builds its own, as before."""
    import transformers.utils.import_utils as import_utils

    model = tiny_model(family, _attn_implementation="sdpa")
    graph = prefill.PrefillGraph(model, batch=1, length=48, captured=False)
    assert graph.masks == (prefill.no_mask() if family == "qwen2" else None)
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def recording(*args, attn_mask=None, is_causal=False, **kwargs):
        seen.append((attn_mask is None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    ids = torch.randint(3, 300, (1, 48))
    logits, _ = graph.run(ids)  # not capturing: no mask either way
    eager = set(seen)
    seen.clear()
    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)
    captured_logits, _ = graph.run(ids)
    if family == "qwen2":
        assert set(seen) == eager == {(True, True)}  # no mask, causal: sdpa may pick flash / cuDNN
    assert torch.allclose(captured_logits, logits, atol=1e-5)


def _first_forward(model, cache, full, **gen):
    """The keywords generate() gives the first forward over `cache` (the installed transformers)."""
    seen = []

    def record(*args, **kwargs):
        if not seen:
            seen.append(dict(kwargs))
        return forward_with_pass(model, *args, **kwargs)

    record = functools.update_wrapper(record, model.forward)  # as the engine's: the model's signature
    generate_view(model, record).generate(input_ids=full, **cache_kwargs(model, cache), **gen)
    kwargs = dict(seen[0])
    ids = kwargs.pop("input_ids")
    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    return ids, kwargs


def _cache(model, ids, **config):
    kv, config = capture_kv(model, ids), HandoffConfig(**config)
    return BridgedCache(random_bridge(model), kv, model, ids, config=config, source_model=model)


def test_generate_s_first_forward_on_the_native_route_is_one_a_graph_replays():
    model = tiny_model("qwen2", _attn_implementation="sdpa")
    ids = torch.randint(3, 300, (1, 40))
    full = torch.cat([ids, torch.randint(3, 300, (1, 4))], 1)
    cache = _cache(model, ids, route="native")
    first, kwargs = _first_forward(model, cache, full, attention_mask=torch.ones_like(full), **GREEDY)
    assert first.shape == full.shape
    fresh = _cache(model, ids, route="native")
    assert prefill.replays(fresh, model, first, kwargs)  # else the graph would never run under generate()


def test_no_other_forward_is_replayed():
    model = tiny_model("qwen2", _attn_implementation="sdpa")
    ids = torch.randint(3, 300, (2, 40))
    full = torch.cat([ids, torch.randint(3, 300, (2, 4))], 1)
    plain = {"attention_mask": torch.ones_like(full), "logits_to_keep": 1, "use_cache": True}

    def replays(model=model, route="native", **changes):
        cache = _cache(model, ids, route=route, **changes.pop("config", {}))
        return prefill.replays(cache, model, full, plain | changes)

    assert replays()
    padded = torch.ones_like(full)
    padded[1, :3] = 0  # a left-padded row: its positions start later
    assert not replays(attention_mask=padded)
    assert not replays(position_ids=torch.arange(full.shape[1])[None] + 1)
    assert not replays(logits_to_keep=0)
    assert not replays(output_attentions=True)
    assert not replays(config={"cuda_graphs": False})
    assert not replays(route="handoff")  # not empty: translated
    assert not replays(tiny_model("gemma3", _attn_implementation="sdpa"))  # a sliding layer keeps the tail
    assert not replays(tiny_model("qwen2"))  # eager attention builds its mask from a host scalar: no capture


def test_generate_is_launched_early_only_where_its_first_forward_is_a_prefill_a_graph_replays():
    model = tiny_model("qwen2", _attn_implementation="sdpa")
    ids = torch.randint(3, 300, (2, 40))
    full = torch.cat([ids, torch.randint(3, 300, (2, 4))], 1)

    def launches(mask=None, route="native", model=model, **generate_kwargs):
        cache = _cache(model, ids, route=route)
        return prefill.launches(cache, model, full, mask, dict(GREEDY) | generate_kwargs)

    assert launches() and launches(torch.ones_like(full))
    assert launches(output_logits=True, return_dict_in_generate=True)
    padded = torch.ones_like(full)
    padded[1, :3] = 0
    assert not launches(padded)
    assert not launches(route="handoff")
    assert not launches(num_beams=2) and not launches(num_return_sequences=2)
    assert not launches(output_attentions=True) and not launches(output_hidden_states=True)
    assert not launches(model=tiny_model("qwen2"))  # eager attention: no capture


def test_a_launched_prefill_serves_the_forward_that_reads_its_ids_and_no_other(monkeypatch):
    """`run` takes the result `launch` left on the cache when the forward reads the same ids (here
    an equal copy), and replays the forward's own ids otherwise. On the CPU a PrefillGraph run
    eagerly stands in for the replay."""
    model = tiny_model("qwen2", _attn_implementation="sdpa")
    replayed = []

    def eager_replay(cache, target, input_ids):
        replayed.append(input_ids)
        logits, layers = prefill.PrefillGraph(target, 1, 64, captured=False).run(input_ids)
        return logits, [t.clone() for pair in layers for t in pair]

    monkeypatch.setattr(prefill, "_replay", eager_replay)
    ids, other = torch.randint(3, 300, (1, 44)), torch.randint(3, 300, (1, 44))
    for forward_ids, replays in ((ids.clone(), 1), (other, 2)):
        replayed.clear()
        cache = _cache(model, ids[:, :40], route="native")
        launched = prefill.Launched(ids, eager_replay(cache, model, ids))
        out = prefill.run(cache, model, forward_ids, launched)
        assert len(replayed) == replays
        own = model(forward_ids, use_cache=True, **cache_kwargs(model, DynamicCache(config=model.config)))
        assert torch.allclose(out.logits[:, 0], own.logits[:, -1], atol=1e-5)
        assert cache.get_seq_length() == 44
        assert torch.allclose(cache.layers[0].keys, own.past_key_values.layers[0].keys, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_the_native_route_replays_its_prefill_and_generates_the_targets_own_tokens_on_cuda():
    model = tiny_model("qwen2", head_dim=32, max_position_embeddings=4096, _attn_implementation="sdpa").cuda()
    bridge, tok = random_bridge(model), byte_tokenizer()
    gen = dict(GREEDY, output_logits=True, return_dict_in_generate=True)
    replays = []
    replay = prefill._replay

    def counted(*args):
        replays.append(1)
        return replay(*args)

    with (
        HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as engine,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(prefill, "_replay", counted)
        for m in (300, 290, 300, 600):  # 300 and 290 share a bucket: captured on its second request
            ids = torch.randint(3, 300, (1, m), device="cuda")
            full = torch.cat([ids, torch.randint(3, 300, (1, 4), device="cuda")], 1)
            own = model.generate(full, **gen)
            config = HandoffConfig(route="native")
            cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config, engine=engine)
            out = engine.generate(cache, full, torch.ones_like(full), **gen)
            assert torch.equal(out.sequences, own.sequences)
            assert float((out.logits[0] - own.logits[0]).abs().max()) < 1e-4
            exact = model(full, use_cache=True).past_key_values
            for layer, mine in zip(exact.layers, cache.layers):  # the cache holds the context too
                assert torch.allclose(layer.keys, mine.keys[:, :, : layer.keys.shape[2]], atol=1e-4)
        assert len(replays) == 4  # once per request: generate()'s forward replayed nothing again
        graphs = engine.state.graphs._graphs
        assert ("prefill", 1, 304) in graphs  # 304 and 294 tokens with the prompt: one bucket, replayed
        assert ("prefill", 1, 608) not in graphs  # requested once: eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_a_capture_that_fails_runs_eagerly_from_then_on():
    from bridgecache.runtime.state import GraphStore

    store, calls = GraphStore(1 << 30), []

    def make():
        calls.append(1)
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    assert store.get("shape", make, 1) is None  # seen once: eager
    with pytest.warns(RuntimeWarning, match="capture of shape failed, running it eagerly"):
        assert store.get("shape", make, 1) is None
    assert store.get("shape", make, 1) is None and calls == [1]  # not tried again
    assert len(store) == 0
