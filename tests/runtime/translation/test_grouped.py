"""Grouped translation (one launch per group of target layers): exact through an identity bridge,
equal to the per-layer path for a random bridge, still lazy per layer, off where it cannot apply."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_bridge, tiny_model
from transformers import DynamicCache

from bridgecache import GivenScores, HandoffConfig, RefreshConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.compat import cache_kwargs
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.engine import generate


def _generate(model, ids, cache=None, fused=False, **kwargs):
    """generate() over `cache`: the model's own (the cache's native work in a forward of its own)
    or, fused, the engine's (bridgecache.runtime.engine.generate: in generate()'s first forward)."""
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True) | kwargs
    if fused:
        return generate(model, cache, ids, return_dict_in_generate=True, **kwargs)
    if cache is not None:
        kwargs |= cache_kwargs(model, cache)
    return model.generate(ids, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_identity_bridge_is_exact_in_one_launch(family):
    model = tiny_model(family)
    ids = torch.randint(3, 300, (2, 25))  # longer than gemma3's sliding window of 8
    mask = torch.ones_like(ids)
    mask[1, :5], ids[1, :5] = 0, 0  # a left-padded row
    source = capture_kv(model, ids, attention_mask=mask)
    config = HandoffConfig(key_norm=False, one_launch=True)
    cache = BridgedCache(
        Bridge.identity(model),
        source,
        model,
        ids,
        target_attention_mask=mask,
        source_attention_mask=mask,
        config=config,
    )
    assert cache.plan.groups is not None
    bridged = _generate(model, ids, cache, attention_mask=mask)
    native = _generate(model, ids, attention_mask=mask)
    assert torch.equal(bridged.sequences, native.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(bridged.logits, native.logits)) < 1e-5
    # gemma3: sliding layers and the full layer are two groups, each translated once
    assert cache.plan.groups.translations == (2 if family == "gemma3" else 1)
    assert cache.plan.groups._done == {}  # buffers released once every layer took its view


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernel)")


@pytest.mark.parametrize(
    "family, device",
    [("qwen2", "cpu"), ("gemma3", "cpu"), pytest.param("gemma3", "cuda", marks=CUDA)],  # gemma3: head dim 32
)
def test_one_launch_equals_the_per_layer_path_for_arandom_bridge(family, device):
    model = tiny_model(family).to(device)
    bridge = random_bridge(model)
    ids = torch.randint(3, 300, (2, 21), device=device)
    source = capture_kv(model, ids)
    grouped = BridgedCache(
        bridge, source, model, ids, config=HandoffConfig(key_norm=False, one_launch=True, refresh=None)
    ).materialize()
    per_layer = BridgedCache(
        bridge, source, model, ids, config=HandoffConfig(key_norm=False, one_launch=False, refresh=None)
    ).materialize()
    assert grouped.plan.groups is not None and per_layer.plan.groups is None
    for a, b in zip(grouped.layers, per_layer.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_the_group_translates_into_the_pass_buffers_when_the_first_layer_reads():
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 12))
    cache = BridgedCache(
        Bridge.identity(model), capture_kv(model, ids), model, ids, config=HandoffConfig(one_launch=True)
    )
    calls, seen_at_layer = [], []
    groups = cache.plan.groups  # the first forward translates when layer 0's attention runs
    original = groups.translate_into
    groups.translate_into = lambda idx, *a: calls.append(idx) or original(idx, *a)
    groups._translate = lambda *a: pytest.fail("the pass's buffers take the translation: no group buffer")
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: seen_at_layer.append((i, list(calls))))
    assert torch.equal(_generate(model, ids, cache, fused=True).sequences, _generate(model, ids).sequences)
    assert seen_at_layer[:3] == [(0, []), (1, [0]), (2, [0])]  # nothing before the forward, then once
    assert groups.translations == 1  # one launch pair for the whole group


def test_one_launch_is_off_where_it_cannot_apply():
    model = tiny_model("gemma3")  # a k_norm target: a fitted bridge's keys are rescaled per layer
    ids = torch.randint(3, 300, (1, 12))
    source = capture_kv(model, ids)
    fitted = random_bridge(model)
    one_launch = HandoffConfig(one_launch=True, refresh=None)
    assert BridgedCache(fitted, source, model, ids, config=one_launch).plan.groups is None
    # without the rescale it applies: key_norm off, or an identity bridge (never projected)
    plain = one_launch.replace(key_norm=False)
    assert BridgedCache(fitted, source, model, ids, config=plain).plan.groups is not None
    identity = Bridge.identity(model)
    assert BridgedCache(identity, source, model, ids, config=one_launch).plan.groups is not None
    # on CPU the default is per layer
    assert (
        BridgedCache(
            Bridge.identity(model), source, model, ids, config=HandoffConfig(key_norm=False)
        ).plan.groups
        is None
    )
    # a sliding-window source cache (layers keep different rows) goes per layer
    window_source = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(model, window_source))
    cache = BridgedCache(
        Bridge.identity(model),
        window_source,
        model,
        ids,
        config=HandoffConfig(key_norm=False, one_launch=True),
    )
    assert cache.plan.groups is None


def _fullhead_bridge(model, seed: int = 0) -> Bridge:
    """Every target head reads the same source heads (Full-Head's shape), its own weights."""
    bridge = random_bridge(model, seed=seed)
    for layer in bridge.layers:
        layer.inputs[:] = layer.inputs[:1].clone()
        layer.used = sorted({int(x) for x in layer.inputs[..., 0].unique()})
    return bridge


@pytest.mark.parametrize("one_launch", [False, True])
def test_shared_inputs_take_one_gemm_and_translate_as_per_head_inputs(one_launch, monkeypatch):
    """Full-Head maps: the plans' heads are a stride-0 view (one GEMM for every head in the
    reference, heads tiled together in the kernel), and translate as the same maps read per head."""
    import copy

    from bridgecache.runtime.translation import layers as translate

    model = tiny_model("qwen2")
    bridge = _fullhead_bridge(model)
    ids = torch.randint(3, 300, (2, 19))
    source = capture_kv(model, ids)
    config = HandoffConfig(key_norm=False, one_launch=one_launch, refresh=None)
    shared = BridgedCache(bridge, source, model, ids, config=config).materialize()
    cpu, every = torch.device("cpu"), tuple(range(len(bridge.layers)))
    plans = (
        [shared.state.stacked_plan(every, cpu)] if one_launch else [shared.state.plan(i, cpu) for i in every]
    )
    assert all(plan.heads.stride(-2) == 0 for plan in plans)
    monkeypatch.setattr(translate, "_shared_if_equal", lambda heads, device: heads.to(device))
    per_head = BridgedCache(copy.deepcopy(bridge), source, model, ids, config=config).materialize()
    for a, b in zip(shared.layers, per_head.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "family, device", [("qwen2", "cpu"), ("gemma3", "cpu"), pytest.param("qwen2", "cuda", marks=CUDA)]
)
@pytest.mark.parametrize("beams", [1, 2])  # 2: generate() expands the rows, which are copied
def test_a_refresh_over_groups_translated_into_its_buffers_equals_the_per_layer_path(family, device, beams):
    """The native-work pass takes a group's translation straight into its buffers (no buffer of the
    group's own: one copy of the cache, not two) and answers as the per-layer path does."""
    model = tiny_model(family).to(device)
    torch.manual_seed(3)
    ids = torch.randint(3, 300, (2, 25), device=device)
    mask = torch.ones_like(ids)
    mask[1, :4], ids[1, :4] = 0, 0  # a left-padded row
    bridge, scores = random_bridge(model), torch.rand(2, 25)
    results, written = [], []
    for one_launch in (True, False):
        config = HandoffConfig(
            key_norm=False, one_launch=one_launch, refresh=RefreshConfig(6, GivenScores(scores))
        )
        cache = BridgedCache(
            bridge,
            capture_kv(model, ids, attention_mask=mask),
            model,
            ids,
            target_attention_mask=mask,
            source_attention_mask=mask,
            config=config,
        )
        if one_launch:
            original = cache.plan.groups.translate_into
            cache.plan.groups.translate_into = lambda *a, original=original: (
                written.append(original(*a)) or written[-1]
            )
        results.append(_generate(model, ids, cache, fused=True, attention_mask=mask, num_beams=beams))
    grouped, per_layer = results
    assert torch.equal(grouped.sequences, per_layer.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(grouped.logits, per_layer.logits)) < 1e-4
    taken = {idx for layers in written for idx in layers}
    if beams == 1:  # every evenly spaced group went straight into the buffers
        # gemma3's sliding layers (0, 1, 3) are no view of the buffers: their group's buffer is copied
        assert taken == ({2} if family == "gemma3" else set(range(len(model.model.layers))))
    else:
        assert not written  # expanded rows: the groups' own buffers, copied row by row
