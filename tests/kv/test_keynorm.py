"""Key-norm projection: mapped keys of q/k-normed targets (Gemma 3) go back onto what k_norm makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_architecture, tiny_architecture_config, tiny_model

from bridgecache import Bridge, BridgedCache, HandoffConfig, capture_kv
from bridgecache.compat import cache_kwargs
from bridgecache.kv.keynorm import key_norm_scales, project_to_key_norm
from bridgecache.kv.rope import RopeTables, unrotate
from bridgecache.runtime.identity import ModelIdentity
from bridgecache.runtime.state import EngineState


def _normed_keys(scale: torch.Tensor, shape=(2, 3, 7), seed=0) -> torch.Tensor:
    """Keys as a k_norm produces them: scale * n with rms(n) = 1 per row."""
    n = torch.randn(*shape, scale.numel(), generator=torch.Generator().manual_seed(seed))
    return scale * n / n.pow(2).mean(-1, keepdim=True).sqrt()


def test_projection_keeps_normed_keys_and_undoes_shrinkage():
    g = torch.Generator().manual_seed(1)
    scale = torch.rand(16, generator=g) * 2 + 0.2
    keys = _normed_keys(scale)
    assert torch.allclose(project_to_key_norm(keys, scale), keys, atol=1e-6)
    factors = torch.rand(2, 3, 7, 1, generator=g) * 0.8 + 0.2  # a different shrinkage per row
    assert torch.allclose(project_to_key_norm(keys * factors, scale), keys, atol=1e-5)
    zero_rows = keys.clone()
    zero_rows[:, :, 2] = 0  # rows the target computes itself come out of the map as zeros
    assert torch.equal(project_to_key_norm(zero_rows * 0.5, scale)[:, :, 2], zero_rows[:, :, 2])


def test_dead_channels_are_ignored_when_reading_the_norm():
    scale = torch.linspace(0.5, 2.0, 16)
    scale[[3, 9]] = 0.0  # Gemma 3 has channels whose norm weight is -1: they are always 0
    keys = _normed_keys(scale)
    noisy = keys * 0.6
    noisy[..., [3, 9]] = 1e-3  # a regression leaves small values there; dividing by 0 must not happen
    out = project_to_key_norm(noisy, scale)
    live = scale != 0
    assert torch.isfinite(out).all()
    assert torch.allclose((out[..., live] / scale[live]).pow(2).mean(-1), torch.ones(2, 3, 7), atol=1e-5)


def test_scales_are_read_from_the_model_and_absent_without_k_norm():
    model = tiny_model("gemma3")
    for layer in model.model.layers:
        layer.self_attn.k_norm.weight.data.normal_()
    scales = key_norm_scales(model)
    assert len(scales) == 4
    for layer, scale in zip(model.model.layers, scales):
        assert torch.allclose(scale, 1 + layer.self_attn.k_norm.weight.detach(), atol=1e-5)
    assert key_norm_scales(tiny_model("llama")) is None and key_norm_scales(tiny_model("qwen2")) is None
    state = EngineState(Bridge.identity(model), None, model, graph_bytes=0)
    identity = ModelIdentity(Bridge.identity(model), None, model)  # what an engine checks per request
    assert state.key_norm_scales() is state.key_norm_scales()  # an engine's: no forward per cache
    with torch.no_grad():
        model.model.layers[1].self_attn.k_norm.weight.add_(1.0)  # an edited weight is noticed
    with pytest.raises(RuntimeError, match="weights changed after this handoff engine was built"):
        identity.check()
    assert torch.allclose(key_norm_scales(model)[1], scales[1] + 1, atol=1e-5)


def test_bridged_cache_restores_shrunken_keys_of_a_gemma_target():
    model = tiny_model("gemma3")
    for layer in model.model.layers:
        layer.self_attn.k_norm.weight.data.uniform_(-0.5, 1.0)
    ids = torch.randint(3, 300, (1, 12))
    native = capture_kv(model, ids)
    shrunken = dataclasses.replace(Bridge.identity(model), method="fullhead")  # fitted: projected
    for layer_map in shrunken.layers:
        layer_map.key_weight.mul_(0.7)  # a map whose keys are 30% too short, as ridge maps are
    projected = BridgedCache(shrunken, native, model, ids, config=HandoffConfig(refresh=None)).materialize()
    plain = BridgedCache(
        shrunken, native, model, ids, config=HandoffConfig(key_norm=False, refresh=None)
    ).materialize()
    rope = RopeTables.from_model(model)
    cached = ids.shape[1] - 1  # the last token is held back
    for idx in (0, 2):  # a sliding layer (keeps its window) and the full one: different rope bases
        kept = projected.layers[idx].keys.shape[2]
        want = native.keys[idx][:, :, cached - kept : cached]
        positions = torch.arange(cached - kept, cached)[None]
        assert torch.allclose(projected.layers[idx].keys, want, rtol=1e-4, atol=1e-5)  # k_norm eps
        assert not torch.allclose(plain.layers[idx].keys, want, atol=1e-2)
        cos, sin = rope.cos_sin(idx, positions)
        mapped = slice(1 if kept == cached else 0, None)  # position 0 is the native head: not mapped
        plain_keys = unrotate(plain.layers[idx].keys, cos, sin)[:, :, mapped]
        assert torch.allclose(plain_keys, 0.7 * unrotate(want, cos, sin)[:, :, mapped], atol=1e-5)


def _small_key_olmo2():
    """OLMo 2 at transformers' initializer_range (0.02): pre-norm keys small enough that k_norm's
    epsilon keeps the model's own keys below unit RMS (its norm is over the whole projection)."""
    config = tiny_architecture_config("olmo2")
    config.initializer_range = 0.02
    return tiny_architecture("olmo2", config=config)


def test_an_identity_bridge_skips_the_projection_and_a_fitted_one_keeps_it():
    model = _small_key_olmo2()
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True)

    def generated(cache=None):
        kwargs = options if cache is None else options | cache_kwargs(model, cache)
        out = model.generate(ids, return_dict_in_generate=True, **kwargs)
        return out.sequences, torch.stack(out.logits)

    def bridged(bridge, config):
        cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config)
        sequences, logits = generated(cache)
        return cache, (logits - native).abs().max().item(), torch.equal(sequences, native_ids)

    native_ids, native = generated()
    identity = Bridge.identity(model)
    cache, error, same = bridged(identity, HandoffConfig())  # the defaults: key_norm=True
    assert error < 1e-4 and same and cache.translator.key_norm_scales is None
    assert "no key-norm projection: an identity bridge's keys are the target's own" in cache.report().notes
    # The same maps marked fitted are projected: the model's own small keys move to unit RMS.
    fitted = dataclasses.replace(identity, method="fullhead")
    cache, error, _ = bridged(fitted, HandoffConfig(refresh=None))
    assert cache.translator.key_norm_scales is not None and error > 1e-3
    assert bridged(fitted, HandoffConfig(refresh=None, key_norm=False))[1] < 1e-4  # the projection's share
