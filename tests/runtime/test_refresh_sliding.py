"""Token refresh on targets with sliding-window layers (Gemma 3: full and sliding layers mixed).

The tiny Gemma 3 has a window of 8 (sliding layers 0, 1, 3; full layer 2); every context here is
longer than that, so a sliding layer of the cache keeps only its last 7 columns while refreshed
tokens sit anywhere in the context.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from transformers import DynamicCache

from bridgecache import GivenScores, HandoffConfig, RefreshConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.compat import cache_kwargs
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache

WINDOW = 8


def _noisy_bridge(model, scale: float = 0.5) -> Bridge:
    """An identity bridge with noise on every map: deliberately wrong, like a poor fit."""
    bridge = Bridge.identity(model)
    generator = torch.Generator().manual_seed(0)
    for layer in bridge.layers:
        for name in ("key_weight", "value_weight"):
            weight = getattr(layer, name)
            weight += scale * torch.randn(weight.shape, generator=generator)
    bridge.method = "fullhead"
    return bridge


def _generate(model, ids, cache=None, mask=None):
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True)
    if cache is not None:
        kwargs |= cache_kwargs(model, cache)
    if mask is not None:
        kwargs["attention_mask"] = mask
    out = model.generate(ids, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _cache(model, bridge, ids, mask=None, refresh=None, refresh_by="deviation"):
    source = capture_kv(model, ids, attention_mask=mask)
    masks = {} if mask is None else dict(target_attention_mask=mask, source_attention_mask=mask)
    by = GivenScores(refresh_by) if isinstance(refresh_by, torch.Tensor) else refresh_by
    config = HandoffConfig(refresh=None if refresh is None else RefreshConfig(refresh, by), route="handoff")
    return BridgedCache(bridge, source, model, ids, **masks, config=config)


def _sliding(model) -> list[int]:
    return [i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_refreshing_every_token_reproduces_native_prefill_with_sliding_layers(attn):
    model = tiny_model("gemma3", attn_implementation=attn)
    assert _sliding(model) == [0, 1, 3] and model.config.sliding_window == WINDOW
    ids = torch.randint(3, 300, (1, 30))  # 28 translated columns, more than three windows
    bridge = _noisy_bridge(model)
    native_seq, native_logits = _generate(model, ids)
    _, poor_logits = _generate(model, ids, _cache(model, bridge, ids))
    assert (poor_logits - native_logits).abs().max() > 1e-2  # the noisy bridge is really wrong
    for refresh_by in ("deviation", torch.rand(1, 30)):
        cache = _cache(model, bridge, ids, refresh=1.0, refresh_by=refresh_by)
        assert cache.report().tokens_refreshed == 28  # all but the native sink and the held-back token
        seq, logits = _generate(model, ids, cache)
        assert torch.equal(seq, native_seq)
        assert (logits - native_logits).abs().max() < 1e-4


def test_partial_refresh_rewrites_only_the_chosen_rows_of_every_layer():
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (1, 30))
    prefix, kept = 29, 29 - (WINDOW - 1)  # sliding layers keep columns 22..28
    chosen = [3, 10, 22, 27]
    scores = torch.zeros(1, 30)
    scores[0, chosen] = 1.0
    bridge = _noisy_bridge(model)
    plain = _cache(model, bridge, ids).materialize()
    cache = _cache(model, bridge, ids, refresh=len(chosen), refresh_by=scores)
    assert cache.refreshed_columns.tolist() == [chosen]
    cache.materialize()
    for layer in range(4):
        new, old = cache.layers[layer], plain.layers[layer]
        first = kept if layer in _sliding(model) else 0
        assert new.keys.shape == old.keys.shape == (1, 1, prefix - first, 32)
        rows = [c - first for c in chosen if c >= first]  # rows this layer keeps
        others = [r for r in range(prefix - first) if r not in rows and r + first != 0]  # 0: the sink
        assert rows == ([0, 5] if first else chosen)
        for tensor in ("keys", "values"):
            a, b = getattr(new, tensor), getattr(old, tensor)
            assert torch.equal(a[:, :, others], b[:, :, others])  # bit-identical
            assert not torch.allclose(a[:, :, rows], b[:, :, rows])
    assert all(cache.layers[i].cumulative_length == prefix for i in _sliding(model))


def test_refreshed_rows_see_exactly_their_window():
    # Through an identity bridge every translated row is the target's own, so a refreshed row is
    # the target's own only if its attention saw exactly the keys the target's own prefill shows
    # it: on a sliding layer, columns c - 7 .. c, for columns 5 and 13 all before the rows the
    # layer keeps (22..28). A window one column too wide moves the deeper rows by ~1.
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (1, 30))
    chosen = [5, 13, 21, 24]
    scores = torch.zeros(1, 30)
    scores[0, chosen] = 1.0
    own = DynamicCache(config=model.config)  # the target's own prefill, sliding layers as generate's
    model(input_ids=ids[:, :29], use_cache=True, **cache_kwargs(model, own))
    cache = _cache(model, Bridge.identity(model), ids, refresh=len(chosen), refresh_by=scores).materialize()
    for layer in range(4):
        new, native = cache.layers[layer], own.layers[layer]
        assert new.keys.shape == native.keys.shape
        first = 29 - native.keys.shape[2]
        rows = [c - first for c in chosen if c >= first]
        assert len(rows) == (4 if layer == 2 else 1)
        assert torch.allclose(new.keys[:, :, rows], native.keys[:, :, rows], atol=1e-4)
        assert torch.allclose(new.values[:, :, rows], native.values[:, :, rows], atol=1e-4)


def test_refresh_of_a_left_padded_batch_reproduces_native_generate():
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (2, 26))
    mask = torch.ones_like(ids)
    mask[0, :7], ids[0, :7] = 0, 0  # row 0: 19 real tokens, row 1: 26
    bridge = _noisy_bridge(model)
    native_seq, native_logits = _generate(model, ids, mask=mask)
    cache = _cache(model, bridge, ids, mask, refresh=1.0, refresh_by=torch.rand(2, 26))
    seq, logits = _generate(model, ids, cache, mask=mask)
    assert torch.equal(seq, native_seq)
    assert (logits - native_logits).abs().max() < 1e-4
    # partial: pad columns are never chosen, and the untouched rows stay translated
    plain = _cache(model, bridge, ids, mask).materialize()
    part = _cache(model, bridge, ids, mask, refresh=4, refresh_by=torch.rand(2, 26)).materialize()
    columns = part.refreshed_columns
    assert bool((columns[0] >= 7).all())
    keys, old = part.layers[2].keys, plain.layers[2].keys  # the full layer: every column
    for row, sink in enumerate((7, 0)):
        others = [c for c in range(25) if c not in columns[row].tolist() and c != sink]
        assert torch.equal(keys[row][:, others], old[row][:, others])
        assert not torch.allclose(keys[row][:, columns[row]], old[row][:, columns[row]])


def test_refresh_keeps_the_source_cache_untouched():
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (1, 24))
    source = capture_kv(model, ids)
    before = [(k.clone(), v.clone()) for k, v in zip(source.keys, source.values)]
    BridgedCache(
        _noisy_bridge(model),
        source,
        model,
        ids,
        config=HandoffConfig(refresh=RefreshConfig(0.5, "deviation")),
    ).materialize()
    assert all(
        torch.equal(k, a) and torch.equal(v, b) for (k, v), a, b in zip(before, source.keys, source.values)
    )


def test_source_attention_scores_follow_a_sliding_source_window():
    from bridgecache.runtime.selection.reading import attention_scores

    model = tiny_model("gemma3")  # eager attention: output_attentions is the reference
    context, prompt = torch.randint(3, 300, (1, 20)), torch.randint(3, 300, (1, 4))
    kv = capture_kv(model, context)
    first = torch.zeros(1, dtype=torch.long)
    scores = attention_scores(model, kv.keys, kv.values, kv.position_ids, first, prompt, 20, reduce="sum")
    out = model(input_ids=torch.cat([context, prompt], 1), output_attentions=True)
    expected = sum(a[0, :, 20:, :20].sum((0, 1)) for a in out.attentions)
    assert torch.allclose(scores[0], expected, atol=1e-4)
    # the sliding layers see only the last 8 columns: the early context is scored by layer 2 alone
    assert torch.allclose(scores[0, :13], out.attentions[2][0, :, 20:, :13].sum((0, 1)), atol=1e-4)


def test_handoff_refreshes_a_sliding_window_target_by_default():
    from tiny_models import byte_tokenizer

    from bridgecache.runtime.entry.handoff import handoff

    model, tok = tiny_model("gemma3"), byte_tokenizer()
    bridge = _noisy_bridge(model)
    context, prompt = "The key to the red door is under the third stone.", " Where is it?"
    kwargs = dict(source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=5, do_sample=False)
    result = handoff(bridge, model, model, context, prompt, **kwargs)
    report = result.cache.report()
    translated = len(tok(context)["input_ids"]) - 2  # the native sink and the held-back token
    assert report.tokens_refreshed == round(0.2 * translated) > 0
    assert report.refresh_by == "source attention"
    # refreshing everything is the target reading the context itself
    exact = handoff(
        bridge,
        model,
        model,
        context,
        prompt,
        **kwargs,
        config=HandoffConfig(refresh=RefreshConfig(1.0, "source"), route="handoff"),
    )
    ids = tok(context + prompt, return_tensors="pt")["input_ids"]
    native = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert torch.equal(exact.output_ids, native[:, ids.shape[1] :])


def test_the_pass_reads_the_columns_a_sliding_layer_dropped():
    """Column 3's window (columns 0..3) lies before the rows a sliding layer keeps (22..28): the
    pass reads them translated, computes column 3 over them, and the layer keeps only 22..28."""
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (1, 30))
    scores = torch.zeros(1, 30)
    scores[0, 3] = 1.0
    cache = _cache(model, Bridge.identity(model), ids, refresh=1, refresh_by=scores)
    assert cache.materialized_layers == []  # nothing is read before the pass
    own = DynamicCache()  # every column, every layer: the target's own prefill
    model(input_ids=ids[:, :29], use_cache=True, **cache_kwargs(model, own))
    cache.materialize()
    assert cache.materialized_layers == [0, 1, 2, 3]
    full = cache.layers[2]  # the full-attention layer keeps column 3: exactly the target's own
    assert torch.allclose(full.keys[:, :, 3], own.layers[2].keys[:, :, 3], atol=1e-4)
    assert all(cache.layers[i].keys.shape[2] == WINDOW - 1 for i in _sliding(model))


def test_handoff_across_tokenizers_with_full_refresh_is_the_targets_own_generate(byte_bpe, sp_bpe):
    from bridgecache.runtime.entry.handoff import handoff

    model = tiny_model("gemma3")
    context, prompt = "hello world the world, the hello of the world: hello there, world", " the"
    kwargs = dict(source_tokenizer=byte_bpe, target_tokenizer=sp_bpe, max_new_tokens=5, do_sample=False)
    result = handoff(
        _noisy_bridge(model),
        model,
        model,
        context,
        prompt,
        **kwargs,
        config=HandoffConfig(refresh=RefreshConfig(1.0, "source"), route="handoff"),
    )
    ids = torch.cat(
        [
            sp_bpe(context, return_tensors="pt").input_ids,
            sp_bpe(prompt, add_special_tokens=False, return_tensors="pt").input_ids,
        ],
        dim=1,
    )
    assert ids.shape[1] > 2 * WINDOW
    native = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert result.cache.report().tokens_refreshed == len(result.cache.translated_positions)
    assert torch.equal(result.output_ids, native[:, ids.shape[1] :])
