"""Native layers, token refresh and the quality gate: the dial from translated to exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_model
from transformers import DynamicCache

from bridgecache import GivenScores, HandoffConfig, QualityPolicy, RefreshConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.compat import cache_kwargs
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.engine import generate
from bridgecache.runtime.native_work.layers import native_layer_kv, resolve_native_layers
from bridgecache.runtime.native_work.pending import pending_columns, refresh_budget
from bridgecache.runtime.native_work.plan import selection_request
from bridgecache.runtime.report import prefill_flops
from bridgecache.runtime.selection.reading import attention_scores
from bridgecache.runtime.selection.rules import SourceAttention


def _noisy_bridge(model, scale: float = 0.5, seed: int = 0) -> Bridge:
    """An identity bridge with noise added to every map: deliberately wrong, like a poor fit."""
    bridge = Bridge.identity(model)
    generator = torch.Generator().manual_seed(seed)
    for i, layer in enumerate(bridge.layers):
        for name in ("key_weight", "value_weight"):
            weight = getattr(layer, name)
            weight += scale * torch.randn(weight.shape, generator=generator)
        layer.r2_key = layer.r2_value = 0.9 - 0.2 * i  # a made-up held-out score per layer
    bridge.method = "fullhead"
    return bridge


def _logits(model, ids, cache=None):
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True)
    if cache is not None:
        kwargs |= cache_kwargs(model, cache)
    out = model.generate(ids, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _native_kv(model, ids):
    cache = DynamicCache()
    model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    return cache


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_refreshing_every_token_reproduces_native_prefill(family):
    model = tiny_model(family)
    ids = torch.randint(3, 300, (1, 24))
    bridge = _noisy_bridge(model)
    native_seq, native_logits = _logits(model, ids)
    poor_seq, poor_logits = _logits(
        model,
        ids,
        BridgedCache(bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(refresh=None)),
    )
    assert (poor_logits - native_logits).abs().max() > 1e-2  # the noisy bridge is really wrong
    for refresh_by in ("deviation", GivenScores(torch.rand(1, 24))):
        cache = BridgedCache(
            bridge,
            capture_kv(model, ids),
            model,
            ids,
            config=HandoffConfig(refresh=RefreshConfig(1.0, refresh_by), route="handoff"),
        )
        assert cache.report().tokens_refreshed == 22  # all but the native sink and the held-back token
        seq, logits = _logits(model, ids, cache)
        assert torch.equal(seq, native_seq)
        assert (logits - native_logits).abs().max() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_all_native_layers_is_exact(family):
    model = tiny_model(family)
    ids = torch.randint(3, 300, (1, 21))  # beyond gemma3's sliding window of 8
    cache = BridgedCache(
        _noisy_bridge(model),
        capture_kv(model, ids),
        model,
        ids,
        config=HandoffConfig(native_layers="all", refresh=None),
    )
    seq, logits = _logits(model, ids, cache)
    native_seq, native_logits = _logits(model, ids)
    assert torch.equal(seq, native_seq)
    assert (logits - native_logits).abs().max() < 1e-5
    assert cache.report().layers_translated == []


def test_first_native_layers_hold_the_targets_own_kv_and_the_rest_stay_translated():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 18))
    bridge = _noisy_bridge(model)
    plain = BridgedCache(
        bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(refresh=None)
    ).materialize()
    cache = BridgedCache(
        bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(native_layers=2, refresh=None)
    ).materialize()
    native = _native_kv(model, ids[:, :17])
    for layer in (0, 1):
        assert torch.allclose(cache.layers[layer].keys, native.layers[layer].keys, atol=1e-6)
        assert torch.allclose(cache.layers[layer].values, native.layers[layer].values, atol=1e-6)
    assert torch.equal(cache.layers[2].keys, plain.layers[2].keys)
    assert cache.report().layers_native == [0, 1]


def test_native_layer_kv_stops_after_the_deepest_layer():
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 12))
    calls = []
    handle = model.model.layers[1].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        kv = native_layer_kv(model, ids, torch.ones_like(ids), {0})
    finally:
        handle.remove()
    assert calls == []  # layer 1 never ran: layer 0's KV need no attention
    native = _native_kv(model, ids)
    assert torch.allclose(kv[0][0], native.layers[0].keys, atol=1e-6)


def test_partial_refresh_rewrites_only_the_chosen_rows():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 20))
    bridge = _noisy_bridge(model)
    scores = torch.zeros(1, 20)
    scores[0, [4, 9, 13]] = 1.0
    plain = BridgedCache(
        bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(refresh=None)
    ).materialize()
    cache = BridgedCache(
        bridge,
        capture_kv(model, ids),
        model,
        ids,
        config=HandoffConfig(refresh=RefreshConfig(3, GivenScores(scores))),
    )
    assert cache.refreshed_columns.tolist() == [[4, 9, 13]]
    cache.materialize()
    native = _native_kv(model, ids[:, :19])
    chosen = torch.tensor([4, 9, 13])
    others = torch.tensor([c for c in range(1, 19) if c not in (4, 9, 13)])  # 0: the native sink
    for layer in range(3):
        new, old = cache.layers[layer].keys, plain.layers[layer].keys
        assert torch.equal(new[:, :, others], old[:, :, others])
        assert torch.allclose(new[:, :, 0], old[:, :, 0], atol=1e-6)
        assert not torch.allclose(new[:, :, chosen], old[:, :, chosen])
    # layer 0 depends on each token alone: a refreshed row there is the target's own
    assert torch.allclose(cache.layers[0].keys[:, :, chosen], native.layers[0].keys[:, :, chosen], atol=1e-6)


def test_identity_bridge_stays_exact_with_refresh():
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 22))
    cache = BridgedCache(
        Bridge.identity(model),
        capture_kv(model, ids),
        model,
        ids,
        config=HandoffConfig(refresh=RefreshConfig(0.3, "deviation")),
    )
    seq, logits = _logits(model, ids, cache)
    native_seq, native_logits = _logits(model, ids)
    assert torch.equal(seq, native_seq)
    assert (logits - native_logits).abs().max() < 1e-5


def test_gate_sends_shallow_low_layers_native_and_falls_back_when_a_deep_one_fails():
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 16))
    bridge = _noisy_bridge(model)
    for layer, score in zip(bridge.layers, (0.5, 0.9, 0.8)):
        layer.r2_value = score
    cache = BridgedCache(
        bridge,
        capture_kv(model, ids),
        model,
        ids,
        config=HandoffConfig(refresh=None, quality=QualityPolicy(0.6)),
    )
    report = cache.report()
    assert report.layers_native == [0] and report.fallback is None
    assert report.estimated_quality == pytest.approx(0.85)

    cache = BridgedCache(
        bridge,
        capture_kv(model, ids),
        model,
        ids,
        config=HandoffConfig(refresh=None, quality=QualityPolicy(0.85)),
    )
    report = cache.report()
    assert report.fallback and "deepest at layer 2" in report.fallback
    assert report.layers_translated == []
    assert "FALLBACK" in str(report)
    seq, logits = _logits(model, ids, cache)
    native_seq, native_logits = _logits(model, ids)
    assert torch.equal(seq, native_seq) and (logits - native_logits).abs().max() < 1e-5


def test_gate_falls_back_on_poor_alignment_coverage():
    policy = QualityPolicy(min_quality=0.1, min_coverage=0.9)
    assert policy.decide([1.0, 1.0], coverage=0.5).fallback.startswith("only 50%")
    assert policy.decide([1.0, 1.0], coverage=0.95).fallback is None
    assert QualityPolicy(min_quality=0.5).decide(None, 1.0).fallback  # nothing to gate on: exact


def test_report_counts_native_work_against_the_targets_own_prefill():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 40))
    bridge = _noisy_bridge(model)
    plain = BridgedCache(
        bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(refresh=None)
    ).report()
    refreshed = BridgedCache(
        bridge,
        capture_kv(model, ids),
        model,
        ids,
        config=HandoffConfig(refresh=RefreshConfig(0.25, "deviation")),
    ).report()
    everything = BridgedCache(
        bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(native_layers="all", refresh=None)
    ).report()
    assert 0 < plain.native_cost_fraction < 0.1  # the sink and the held-back token
    assert plain.native_cost_fraction < refreshed.native_cost_fraction < 1.0
    # all 3 layers native: 2 full layers + the last one's k/v projections (its attention and MLP
    # feed only logits nobody reads) + the held-back token
    assert 2 / 3 < everything.native_cost_fraction < 0.8
    assert prefill_flops(model.config, 40) > prefill_flops(model.config, 20) * 2  # attention is quadratic


def test_source_attention_scores_match_the_models_own_attention():
    model = tiny_model("llama")  # eager attention: output_attentions is the reference
    context, prompt = torch.randint(3, 300, (1, 15)), torch.randint(3, 300, (1, 4))
    kv = capture_kv(model, context)
    before = [k.clone() for k in kv.keys]
    first = torch.zeros(1, dtype=torch.long)

    def read(**options):
        return attention_scores(model, kv.keys, kv.values, kv.position_ids, first, prompt, 15, **options)

    out = model(input_ids=torch.cat([context, prompt], 1), output_attentions=True)
    expected = sum(a[0, :, 15:, :15].sum((0, 1)) for a in out.attentions)
    assert torch.allclose(read(reduce="sum")[0], expected, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(before, kv.keys))  # the source cache is untouched
    expected_last = sum(a[0, :, 17:, :15].sum((0, 1)) for a in out.attentions)
    assert torch.allclose(read(reduce="sum", counted=2)[0], expected_last, atol=1e-4)
    expected_peak = torch.stack([a[0, :, 15:, :15].amax((0, 1)) for a in out.attentions]).amax(0)
    assert torch.allclose(read()[0], expected_peak, atol=1e-5)  # "max" by default
    with pytest.raises(ValueError, match="reduce='mean'"):
        read(reduce="mean")


def test_reading_with_the_first_layers_stops_the_forward_there():
    model = tiny_model("llama")  # eager attention: output_attentions is the reference
    context, prompt = torch.randint(3, 300, (1, 15)), torch.randint(3, 300, (1, 4))
    kv = capture_kv(model, context)
    first = torch.zeros(1, dtype=torch.long)
    out = model(input_ids=torch.cat([context, prompt], 1), output_attentions=True)
    peaks = torch.stack([a[0, :, 15:, :15].amax((0, 1)) for a in out.attentions])  # [layers, 15]
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda *_: ran.append(1)) for layer in model.model.layers]
    layers = len(model.model.layers)
    for count in range(1, layers + 2):
        ran.clear()
        scores = attention_scores(model, kv.keys, kv.values, kv.position_ids, first, prompt, 15, layers=count)
        assert torch.allclose(scores[0], peaks[:count].amax(0), atol=1e-5)
        assert len(ran) == min(count, layers)  # the forward stopped after them
    for hook in hooks:
        hook.remove()
    assert len(model.model.layers) == layers  # the decoder has all its layers back
    request = _request(model, context, prompt)
    whole, first_one = SourceAttention(), SourceAttention(layers=1)
    assert first_one.reading_flops(request) == pytest.approx(whole.reading_flops(request) / layers)
    assert not torch.allclose(first_one.scores(request), whole.scores(request))
    assert "layers=1" in HandoffConfig(refresh=RefreshConfig(0.2, first_one)).label
    half = SourceAttention(layers=0.5)  # a share of the source's layers, rounded up
    assert half.layer_count(model) == 2 and SourceAttention(layers=1.0).layer_count(model) == layers
    assert torch.equal(half.scores(request), SourceAttention(layers=2).scores(request))
    bad_values = ((0, ValueError), (-2, ValueError), (1.5, ValueError), (0.0, ValueError), ("2", TypeError))
    for bad, error in bad_values + ((True, TypeError),):
        with pytest.raises(error, match="layers is"):
            SourceAttention(layers=bad)


def test_source_attention_reads_left_padded_rows_like_single_ones():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    prompt = torch.randint(3, 300, (2, 3))
    kv = capture_kv(model, ids, attention_mask=mask)
    batched = attention_scores(model, kv.keys, kv.values, kv.position_ids, kv.padding, prompt, 12)
    alone = capture_kv(model, ids[1:, 4:])
    first = torch.zeros(1, dtype=torch.long)
    single = attention_scores(model, alone.keys, alone.values, alone.position_ids, first, prompt[1:], 8)
    assert torch.allclose(batched[1, 4:], single[0], atol=1e-5)
    assert torch.equal(batched[1, :4], torch.zeros(4))  # padding gets no attention


def _request(model, context, prompt):
    """A SelectionRequest over a translate-only cache of `context`."""
    translate_only = HandoffConfig(refresh=None)
    cache = BridgedCache(
        _noisy_bridge(model), capture_kv(model, context), model, context, config=translate_only
    )
    return selection_request(cache.translator, model, context, model, prompt, native_kv=cache.plan.native_kv)


def test_source_attention_defaults_to_the_measured_rule_per_case():
    model = tiny_model("llama")
    context, prompt = torch.randint(3, 300, (1, 20)), torch.randint(3, 300, (1, 3))
    request = _request(model, context, prompt)
    kv = request.source_kv
    first = torch.zeros(1, dtype=torch.long)
    # with a prompt: the largest attention any layer, head and prompt token gives a token, reaching
    # the 4 tokens after it; the 19 cached columns read the source rows they are planned from
    peak = attention_scores(model, kv.keys, kv.values, kv.position_ids, first, prompt, 20)
    reach = torch.stack([peak[0, max(0, c - 4) : c + 1].max() for c in range(20)])
    assert torch.allclose(SourceAttention().scores(request)[0], reach[:19])
    assert torch.allclose(SourceAttention(after=0).scores(request)[0], peak[0, :19])
    # without one: the context's last 16 tokens read the 4 before them (summed), and score highest
    unprompted = SourceAttention().scores(dataclasses.replace(request, prompt_ids=None))[0]
    summed = attention_scores(
        model, kv.keys, kv.values, kv.position_ids, first, context[:, 4:], 4, reduce="sum"
    )
    assert torch.allclose(unprompted[:4], summed[0])
    assert bool((unprompted[4:] > unprompted[:4].max()).all())
    assert SourceAttention().reading_flops(request) > 0


def test_budget_and_selection_arguments():
    assert refresh_budget(None, 10) == 0 and refresh_budget(0.25, 10) == 2 and refresh_budget(50, 10) == 10
    for bad in (-1, 1.5, 0.0, "all", True, 0):
        with pytest.raises(ValueError, match="RefreshConfig.amount"):
            RefreshConfig(bad)
    with pytest.raises(ValueError, match="refresh by 'attention'"):
        RefreshConfig(0.2, "attention")
    always = torch.tensor([[True, False, False, False], [False, False, False, False]])
    eligible = ~always
    scores = torch.tensor([[9.0, 1.0, 3.0, 2.0], [0.0, 5.0, 1.0, 4.0]])
    columns, valid = pending_columns(always, scores, eligible, [2, 1])
    # row 0: its native column 0, then its 2 best; row 1: its best, then repeats of its last
    assert columns.tolist() == [[0, 2, 3], [1, 1, 1]] and valid is None
    columns, valid = pending_columns(always, scores, eligible, [1, 0])
    assert columns[0].tolist() == [0, 2] and valid.tolist() == [[True, True], [False, False]]
    assert resolve_native_layers([2, 0, 2], 3) == (0, 2) and resolve_native_layers("all", 2) == (0, 1)
    with pytest.raises(ValueError, match="not target layers"):
        resolve_native_layers([5], 3)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_heldout_attention_cosine_is_one_for_identity_and_lower_for_a_poor_bridge(family):
    from bridgecache.fitting.heldout import attention_cosine

    model = tiny_model(family)
    contexts = [(ids, ids, None) for ids in torch.randint(3, 300, (2, 1, 20))]
    exact = attention_cosine(Bridge.identity(model), model, model, contexts)
    poor = attention_cosine(_noisy_bridge(model, scale=2.0), model, model, contexts)
    assert len(exact) == len(model.model.layers)
    assert all(abs(c - 1.0) < 1e-4 for c in exact)
    assert all(c < 0.999 for c in poor)


def test_handoff_guided_refresh_of_every_token_answers_like_the_target():
    from tiny_models import byte_tokenizer

    from bridgecache.runtime.entry.handoff import handoff

    model, tok = tiny_model("qwen2"), byte_tokenizer()
    context, prompt = "the hello world of the bridged cache", " said"
    kwargs = dict(source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=4, do_sample=False)
    everything = HandoffConfig(refresh=RefreshConfig(1.0), route="handoff")
    result = handoff(_noisy_bridge(model), model, model, context, prompt, config=everything, **kwargs)
    ids = tok(context + prompt, return_tensors="pt")["input_ids"]
    native = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    assert torch.equal(result.output_ids, native[:, ids.shape[1] :])
    assert result.cache.report().refresh_by == "source attention"
    assert result.cache.report().guide_cost_fraction > 0  # the reading that chose the tokens is counted
    source_kv = result.cache.translator.source
    with pytest.raises(ValueError, match="needs the source model"):
        handoff(_noisy_bridge(model), None, model, context, prompt, source_kv=source_kv, **kwargs)


def test_refresh_reads_grouped_translation_like_per_layer_translation():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 20))
    bridge, scores = _noisy_bridge(model), torch.rand(1, 20)
    config = HandoffConfig(refresh=RefreshConfig(0.3, GivenScores(scores)))
    grouped = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config.replace(one_launch=True))
    per_layer = BridgedCache(
        bridge, capture_kv(model, ids), model, ids, config=config.replace(one_launch=False)
    )
    assert grouped.plan.groups is not None and per_layer.plan.groups is None
    assert torch.equal(grouped.refreshed_columns, per_layer.refreshed_columns)
    for a, b in zip(grouped.materialize().layers, per_layer.materialize().layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_native_work_in_generates_first_forward_equals_its_own_forward(family):
    """The one-forward path (native head + refreshed tokens + held-back token + prompt in
    generate()'s first forward) against the separate path (the native work in a forward of its
    own, then generate()): the same tokens, the same logits at every step, one forward fewer."""
    model = tiny_model(family)
    torch.manual_seed(1)
    ids = torch.randint(3, 300, (1, 24))
    prompt = torch.randint(3, 300, (1, 5))
    full = torch.cat([ids, prompt], dim=1)
    config = HandoffConfig(refresh=RefreshConfig(6, GivenScores(torch.rand(1, 24))))
    bridge = _noisy_bridge(model)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    runs = {}
    for name in ("joined", "separate"):
        cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config)
        forwards.clear()
        if name == "separate":
            cache.run_pending()
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True)
        out = generate(model, cache, full, return_dict_in_generate=True, **kwargs)
        runs[name] = (out, len(forwards), cache.refreshed_columns)
    hook.remove()
    (joined, joined_forwards, joined_cols), (separate, separate_forwards, separate_cols) = runs.values()
    assert torch.equal(joined_cols, separate_cols) and joined_cols.numel() == 6
    assert torch.equal(joined.sequences, separate.sequences)
    for a, b in zip(joined.logits, separate.logits):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    # the native work runs through the cache's view of the model (not counted here): joined, it is
    # generate()'s first forward (the user's model runs the 3 decoding ones); separate, it runs on
    # its own and the user's model runs all 4
    assert (joined_forwards, separate_forwards) == (3, 4)
    # and the refresh matters: without it this bridge answers differently
    plain = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(refresh=None))
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True)
    untouched = model.generate(full, return_dict_in_generate=True, **kwargs, **cache_kwargs(model, plain))
    assert not torch.allclose(untouched.logits[0], joined.logits[0], atol=1e-3)
