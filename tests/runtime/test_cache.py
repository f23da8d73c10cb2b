"""BridgedCache: exact through an identity bridge, lazy, never mutates its source, clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_model
from transformers import DynamicCache

from bridgecache import GivenScores, HandoffConfig, RefreshConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.compat import cache_kwargs
from bridgecache.kv.capture import capture_kv
from bridgecache.kv.files import load_kv, save_kv
from bridgecache.kv.source import KVFileError
from bridgecache.models.spec import SpecMismatchError
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.engine import generate


def _generate(model, ids, cache=None, fused=False, **kwargs):
    """generate() over `cache`: the model's own (the cache's native work in a forward of its own)
    or, fused, the engine's (bridgecache.runtime.engine.generate: in generate()'s first forward)."""
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True) | kwargs
    if fused:
        return generate(model, cache, ids, return_dict_in_generate=True, **kwargs)
    if cache is not None:
        kwargs |= cache_kwargs(model, cache)
    return model.generate(ids, return_dict_in_generate=True, **kwargs)


def _max_logit_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


def test_identity_bridge_is_exact_in_greedy_generate(tiny):
    family, model = tiny
    ids = torch.randint(3, 300, (1, 25))  # longer than gemma3's sliding window of 8
    cache = BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids)
    bridged, native = _generate(model, ids, cache), _generate(model, ids)
    assert torch.equal(bridged.sequences, native.sequences)
    assert _max_logit_diff(bridged, native) < 1e-5


def test_identity_bridge_is_exact_with_beam_search_and_several_return_sequences(tiny):
    family, model = tiny
    ids = torch.randint(3, 300, (1, 19))
    cache = BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids)
    kwargs = dict(num_beams=3, num_return_sequences=2, output_logits=False)
    assert torch.equal(
        _generate(model, ids, cache, **kwargs).sequences, _generate(model, ids, **kwargs).sequences
    )


def test_identity_bridge_is_exact_for_a_left_padded_batch(tiny):
    family, model = tiny
    ids = torch.randint(3, 300, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, :6], ids[0, :6] = 0, 0
    cache = BridgedCache(
        Bridge.identity(model), capture_kv(model, ids, attention_mask=mask), model, ids,
        target_attention_mask=mask, source_attention_mask=mask,
    )  # fmt: skip
    bridged = _generate(model, ids, cache, attention_mask=mask)
    native = _generate(model, ids, attention_mask=mask)
    assert torch.equal(bridged.sequences, native.sequences)
    assert _max_logit_diff(bridged, native) < 1e-5


@pytest.mark.parametrize("native_head,native_tail", [(0, 0), (3, 0), (1, 4)])
def test_native_anchors_keep_exactness_and_set_the_prefix_length(native_head, native_tail):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 16))
    cache = BridgedCache(
        Bridge.identity(model),
        capture_kv(model, ids),
        model,
        ids,
        config=HandoffConfig(native_head=native_head, native_tail=native_tail),
    )
    assert cache.get_seq_length() == 16 - 1 - native_tail
    assert cache.translated_positions == range(native_head, 16 - 1 - native_tail)
    assert torch.equal(_generate(model, ids, cache).sequences, _generate(model, ids).sequences)


def test_several_generate_calls_in_a_row_continue_the_same_cache():
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (1, 14))
    cache = BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids)
    first = _generate(model, ids, cache).sequences
    follow_up = torch.cat([first, torch.randint(3, 300, (1, 3))], dim=1)
    assert torch.equal(_generate(model, follow_up, cache).sequences, _generate(model, follow_up).sequences)


def test_layers_materialise_lazily_one_at_a_time_each_once():
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 12))
    cache = BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids)
    assert cache.materialized_layers == [] and cache.get_seq_length() == 11
    calls, seen_at_layer = [], []
    original = cache.translator.translate  # what the first forward reads, layer by layer
    cache.translator.translate = lambda idx, *a, **k: calls.append(idx) or original(idx, *a, **k)
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: seen_at_layer.append((i, list(calls))))
    _generate(model, ids, cache, fused=True)
    assert calls == [0, 1, 2]  # each once, in order
    first_pass = seen_at_layer[:3]
    assert first_pass == [(0, []), (1, [0]), (2, [0, 1])]  # layer i is translated when layer i runs
    assert cache.materialized_layers == [0, 1, 2]


def test_the_source_cache_is_never_mutated_and_one_bridge_serves_many_caches():
    model = tiny_model("qwen2")
    bridge = Bridge.identity(model)
    ids_a, ids_b = torch.randint(3, 300, (1, 10)), torch.randint(3, 300, (1, 13))
    source_a = DynamicCache()
    model(ids_a, **cache_kwargs(model, source_a))
    snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in source_a.layers]
    cache_a = BridgedCache(bridge, source_a, model, ids_a, config=HandoffConfig(refresh=None))
    cache_b = BridgedCache(bridge, capture_kv(model, ids_b), model, ids_b, config=HandoffConfig(refresh=None))
    out_a, out_b = _generate(model, ids_a, cache_a), _generate(model, ids_b, cache_b)
    for layer, (k, v) in zip(source_a.layers, snapshot):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert torch.equal(out_a.sequences, _generate(model, ids_a).sequences)
    assert torch.equal(out_b.sequences, _generate(model, ids_b).sequences)


def test_materialize_translates_every_layer_in_the_target_dtype():
    model = tiny_model("gemma3").to(torch.bfloat16)
    ids = torch.randint(3, 300, (1, 20))
    cache = BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids).materialize()
    assert cache.materialized_layers == [0, 1, 2, 3]
    for layer, layer_type in zip(cache.layers, model.config.layer_types):
        kept = 7 if layer_type == "sliding_attention" else 19  # window - 1, or the whole prefix
        assert layer.keys.shape == (1, 1, kept, 32) and layer.keys.dtype == torch.bfloat16


def test_crop_after_generation_rolls_back():
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 12))
    cache = BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids)
    _generate(model, ids, cache)
    length = cache.get_seq_length()
    cache.crop(-3)
    assert cache.get_seq_length() == length - 3


def test_kv_files_carry_a_context_between_processes(tmp_path):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 15))
    path = save_kv(tmp_path / "context.safetensors", capture_kv(model, ids), note="tiny-qwen2")
    cache = BridgedCache(Bridge.identity(model), load_kv(path), model, ids)
    assert torch.equal(_generate(model, ids, cache).sequences, _generate(model, ids).sequences)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(KVFileError, match="truncated or corrupted"):
        load_kv(corrupt)
    with pytest.raises(KVFileError, match="no KV file"):
        load_kv(tmp_path / "missing.safetensors")


def test_bad_inputs_get_errors_that_name_what_is_wrong():
    model = tiny_model("qwen2")
    other = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 10))
    captured = capture_kv(model, ids)
    bridge = Bridge.identity(model)
    with pytest.raises(SpecMismatchError, match="model_type: expected 'qwen2', got 'llama'"):
        BridgedCache(bridge, captured, other, ids, config=HandoffConfig(refresh=None))
    with pytest.raises(ValueError, match="source KV has 2 layers; the bridge's source model has 3"):
        BridgedCache(
            bridge,
            list(zip(captured.keys, captured.values))[:2],
            model,
            ids,
            config=HandoffConfig(refresh=None),
        )
    with pytest.raises(ValueError, match=r"expected \[batch=1, kv_heads=2, tokens, head_dim=16\]"):
        BridgedCache(
            bridge,
            [(k[:, :1], v[:, :1]) for k, v in zip(captured.keys, captured.values)],
            model,
            ids,
            config=HandoffConfig(refresh=None),
        )
    with pytest.raises(ValueError, match=r"expected \[batch=1, tokens\]"):
        BridgedCache(bridge, captured, model, ids.expand(2, -1), config=HandoffConfig(refresh=None))
    with pytest.raises(ValueError, match="pass an alignment"):
        BridgedCache(bridge, captured, model, ids[:, :7], config=HandoffConfig(refresh=None))
    long_ids = torch.randint(3, 300, (1, 600))  # max_position_embeddings is 512
    with pytest.raises(ValueError, match="600 target tokens; the target model allows 512"):
        BridgedCache(
            bridge, capture_kv(model, long_ids[:, :10]), model, long_ids, config=HandoffConfig(refresh=None)
        )
    with pytest.raises(TypeError, match="cannot read source KV from int"):
        BridgedCache(bridge, 42, model, ids, config=HandoffConfig(refresh=None))


@pytest.mark.real_model
def test_identity_handoff_is_exact_on_real_smollm2(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("Bridges carry traffic over rivers, valleys and roads. The longest", return_tensors="pt")[
        "input_ids"
    ]
    cache = BridgedCache(Bridge.identity(model, tokenizer), capture_kv(model, ids), model, ids)
    bridged, native = _generate(model, ids, cache, max_new_tokens=8), _generate(model, ids, max_new_tokens=8)
    assert torch.equal(bridged.sequences, native.sequences)
    assert _max_logit_diff(bridged, native) < 1e-3  # logits of magnitude ~20: float32 rounding


@pytest.mark.real_model
def test_refreshing_every_token_is_exact_on_real_smollm2_through_a_wrong_bridge(smollm2):
    """A deliberately wrong bridge (noise on every map) translates nothing right; a refresh of
    every token recomputes it all in the one forward: the target's own tokens and logits."""
    model, tokenizer = smollm2
    text = "Bridges carry traffic over rivers, valleys and roads. The longest bridge in the town of"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    bridge = Bridge.identity(model, tokenizer)
    generator = torch.Generator().manual_seed(0)
    for layer in bridge.layers:
        for name in ("key_weight", "value_weight"):
            getattr(layer, name).add_(0.5 * torch.randn(getattr(layer, name).shape, generator=generator))
    bridge.method = "fullhead"
    native = _generate(model, ids, max_new_tokens=8)
    runs = {}
    for refresh in (None, RefreshConfig(1.0, GivenScores(torch.rand(1, ids.shape[1])))):
        config = HandoffConfig(refresh=refresh, route="handoff")
        cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config)
        runs[refresh is None] = _generate(model, ids, cache, max_new_tokens=8)
    full, translated = runs[False], runs[True]
    assert torch.equal(full.sequences, native.sequences)
    assert _max_logit_diff(full, native) < 1e-3
    assert _max_logit_diff(translated, native) > 1.0  # the bridge alone is far off


def test_a_sliding_window_source_cache_that_lacks_rows_gets_a_clear_error():
    model = tiny_model("gemma3")  # window 8: its sliding cache layers keep only the last 7 tokens
    ids = torch.randint(3, 300, (1, 25))
    source = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(model, source))
    cache = BridgedCache(Bridge.identity(model), source, model, ids)
    with pytest.raises(
        ValueError, match="keep only tokens >= 18 .* capture the source with bridgecache.capture_kv"
    ):
        cache.materialize()


@pytest.mark.parametrize("policy", ["last", "first", "mean"])
def test_alignment_policies_read_the_source_rows_they_name(policy):
    import dataclasses

    from bridgecache.kv.rope import RopeTables, rotate
    from tokenalign import NATIVE, Alignment

    model = tiny_model("llama")
    source_ids = torch.randint(3, 300, (1, 12))
    target_ids = torch.randint(3, 300, (1, 7))
    # target token t covers source tokens [2t - 1, 2t + 1); target token 0 has no source text
    start = torch.tensor([0, 1, 3, 5, 7, 9, 10])
    end = torch.tensor([0, 3, 5, 7, 9, 10, 12])
    index = torch.where(end > 0, end - 1, NATIVE)
    alignment = Alignment(index.numpy(), start.numpy(), end.numpy(), num_source=12, policy=policy)
    bridge = dataclasses.replace(Bridge.identity(model), alignment_policy=policy)
    captured = capture_kv(model, source_ids)
    cache = BridgedCache(
        bridge,
        captured,
        model,
        target_ids,
        alignment=alignment,
        config=HandoffConfig(native_head=0, refresh=None),
    )
    assert cache.translator.head_end.tolist() == [1]  # the leading NATIVE token is computed by the target
    keys, values = cache.plan.layer(1)
    tables = RopeTables.from_model(model)
    for t in range(1, 6):  # translated positions 1..5 (position 6 is the held-back token)
        lo, hi = int(start[t]), int(end[t])
        span = {"last": slice(hi - 1, hi), "first": slice(lo, lo + 1), "mean": slice(lo, hi)}[policy]
        want_v = captured.values[1][:, :, span].mean(dim=2)
        want_k = captured.unrotated_keys(1)[:, :, span].mean(dim=2, keepdim=True)
        cos, sin = tables.cos_sin(1, torch.tensor([[t]]))
        want_k = rotate(want_k, cos, sin)[:, :, 0]
        assert torch.allclose(values[:, :, t], want_v, atol=1e-5)
        assert torch.allclose(keys[:, :, t], want_k, atol=1e-5)


def test_the_native_work_joins_the_first_forward_of_generate():
    """Construction runs no target forward; generate() runs as many as without a cache: the native
    head and the refreshed tokens ride along with its first forward."""
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 14))
    captured = capture_kv(model, ids)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    config = HandoffConfig(refresh=RefreshConfig(4, GivenScores(torch.rand(1, 14))))
    for bridge in (Bridge.identity(model), dataclasses.replace(Bridge.identity(model), method="fullhead")):
        cache = BridgedCache(bridge, captured, model, ids, config=config)
        assert forwards == []
        bridged = _generate(model, ids, cache).sequences
        assert len(forwards) == 6  # _generate's max_new_tokens
        forwards.clear()
        assert torch.equal(bridged, _generate(model, ids).sequences)
        forwards.clear()
