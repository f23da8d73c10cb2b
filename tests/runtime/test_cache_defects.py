"""BridgedCache regressions: layer types, stale native heads, reset, padding, tiny contexts, bad anchors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import HandoffConfig
from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.compat import cache_kwargs
from bridgecache.kv.capture import capture_kv
from bridgecache.models.spec import model_spec
from bridgecache.runtime.cache import BridgedCache


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
    cache = BridgedCache(
        _layerwise_bridge(source, target),
        capture_kv(source, ids),
        target,
        ids,
        config=HandoffConfig(refresh=None),
    )
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
        ValueError, match="layer 1 has layer type 'linear_attention' .*; bridgecache supports"
    ):
        BridgedCache(Bridge.identity(model), captured, model, ids)


def test_native_head_is_recomputed_after_the_target_weights_change_in_place():
    model = tiny_model("qwen2")
    bridge = Bridge.identity(model)
    ids = torch.randint(3, 300, (1, 12))
    BridgedCache(
        bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(refresh=None)
    )  # memoises the native head of ids[:, :1]
    with torch.no_grad():  # a fine-tuning step or a LoRA merge: same tensors, new values
        for p in model.parameters():
            p.mul_(1.5)
    cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(refresh=None))
    bridged, native = _generate(model, ids, cache), _generate(model, ids)
    assert torch.equal(bridged.sequences, native.sequences)
    assert _max_logit_diff(bridged, native) < 1e-5
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(refresh=None))
    assert _max_logit_diff(_generate(model, ids, cache), _generate(model, ids)) < 1e-5


def test_reset_empties_every_layer_translated_or_not():
    model = tiny_model("gemma3")  # sliding and full layers
    ids = torch.randint(3, 300, (1, 14))
    # No native head: nothing is pending, so a layer can be translated on its own.
    cache = BridgedCache(
        Bridge.identity(model), capture_kv(model, ids), model, ids, config=HandoffConfig(native_head=0)
    )
    cache.layers[0]._materialize()  # translate one layer only
    assert cache.materialized_layers == [0]
    cache.reset()
    assert [layer.get_seq_length() for layer in cache.layers] == [0, 0, 0, 0]
    assert cache.get_seq_length() == 0
    # Reused from empty, it is an ordinary cache: generation matches the target's own.
    assert torch.equal(_generate(model, ids, cache).sequences, _generate(model, ids).sequences)
    assert cache.layers[2].get_seq_length() == 14 + 4  # the full-attention layer holds every token


def _padded_batch(model, pad: int = 5, tokens: int = 16):
    ids = torch.randint(3, 300, (2, tokens))
    mask = torch.ones_like(ids)
    mask[0, :pad], ids[0, :pad] = 0, 0
    return ids, mask


def _positions_with_pads_at_one(mask):
    """Positions as transformers 4.x generate() made them: padding at position 1, not 0."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def test_padding_is_read_from_the_captured_mask_not_inferred_from_positions():
    model = tiny_model("llama")
    ids, mask = _padded_batch(model)
    captured = dataclasses.replace(
        capture_kv(model, ids, attention_mask=mask), position_ids=_positions_with_pads_at_one(mask)
    )
    # No source_attention_mask: the captured KV carry their own.
    cache = BridgedCache(Bridge.identity(model), captured, model, ids, target_attention_mask=mask)
    bridged = _generate(model, ids, cache, attention_mask=mask)
    native = _generate(model, ids, attention_mask=mask)
    assert torch.equal(bridged.sequences, native.sequences)
    assert _max_logit_diff(bridged, native) < 1e-5


def test_an_aligned_padded_row_reads_its_own_source_tokens():
    from tokenalign import NATIVE, Alignment

    model = tiny_model("qwen2")
    source_ids, source_mask = _padded_batch(model, pad=4, tokens=12)  # row 0 has 8 real tokens
    target_ids = torch.randint(3, 300, (2, 9))
    target_mask = torch.ones_like(target_ids)
    target_mask[0, :4] = 0  # row 0: 5 real target tokens, row 1: 9
    alignments = []
    for n_source, n_target in ((8, 5), (12, 9)):
        index = torch.arange(n_target) + (n_source - n_target)  # the last n_target source tokens
        index[0] = NATIVE
        start, end = index.clamp(min=0), (index + 1).clamp(min=0)
        alignments.append(
            Alignment(index.numpy(), start.numpy(), end.numpy(), num_source=n_source, policy="last")
        )
    bridge = dataclasses.replace(Bridge.identity(model), alignment_policy="last")
    for positions in (None, _positions_with_pads_at_one(source_mask)):
        captured = capture_kv(model, source_ids, attention_mask=source_mask)
        if positions is not None:
            captured = dataclasses.replace(captured, position_ids=positions)
        cache = BridgedCache(
            bridge,
            captured,
            model,
            target_ids,
            target_attention_mask=target_mask,
            alignment=alignments,
            config=HandoffConfig(refresh=None),
        )
        rows = cache.translator.rows
        assert rows[0, 5:8].tolist() == [4 + 4, 4 + 5, 4 + 6]  # 4 pads, then source tokens 4..6
        assert rows[1, 1:8].tolist() == list(range(4, 11))


def test_masks_that_are_not_left_padding_or_of_the_wrong_shape_are_refused():
    model = tiny_model("qwen2")
    ids, mask = _padded_batch(model)
    bridge = Bridge.identity(model)
    captured = capture_kv(model, ids, attention_mask=mask)
    with pytest.raises(ValueError, match=r"target_attention_mask has shape \(2, 15\); expected \(2, 16\)"):
        BridgedCache(
            bridge,
            captured,
            model,
            ids,
            target_attention_mask=mask[:, 1:],
            config=HandoffConfig(refresh=None),
        )
    right_padded = mask.flip(-1)
    with pytest.raises(ValueError, match="target_attention_mask row 0 is not left padding"):
        BridgedCache(
            bridge,
            captured,
            model,
            ids,
            target_attention_mask=right_padded,
            config=HandoffConfig(refresh=None),
        )
    with pytest.raises(ValueError, match="source attention_mask row 0 is not left padding"):
        capture_kv(model, ids, attention_mask=right_padded)
    with pytest.raises(ValueError, match="differs from the attention mask the source KV were captured with"):
        BridgedCache(
            bridge,
            captured,
            model,
            ids,
            target_attention_mask=mask,
            source_attention_mask=torch.ones_like(mask),
            config=HandoffConfig(refresh=None),
        )


@pytest.mark.parametrize("tokens", [0, 1])
def test_a_context_of_0_or_1_tokens_has_nothing_to_translate_and_the_target_computes_it(tokens):
    model = tiny_model("gemma3")
    context = torch.randint(3, 300, (1, tokens))
    prompt = torch.randint(3, 300, (1, 3))
    cache = BridgedCache(
        Bridge.identity(model),
        capture_kv(model, context),
        model,
        context,
        config=HandoffConfig(native_tail=4),
    )
    assert cache.get_seq_length() == 0 and len(cache.translated_positions) == 0
    ids = torch.cat([context, prompt], dim=1)
    bridged, native = _generate(model, ids, cache), _generate(model, ids)
    assert torch.equal(bridged.sequences, native.sequences)
    assert _max_logit_diff(bridged, native) < 1e-5


def test_eval_scoring_works_on_a_one_token_context():
    from bridgecache.evaluation.scoring import bridged_prefix, native_prefix

    model = tiny_model("llama")
    ids = torch.randint(3, 300, (1, 1))
    bridged = bridged_prefix(
        Bridge.identity(model), capture_kv(model, ids), model, ids, config=HandoffConfig(native_tail=32)
    )
    native = native_prefix(model, ids)
    assert torch.allclose(bridged.last_logits, native.last_logits, atol=1e-5)


def test_handoff_of_an_empty_or_one_token_context_continues_like_the_target():
    from bridgecache.runtime.entry.handoff import handoff

    model, tok = tiny_model("qwen2"), byte_tokenizer()
    bridge = Bridge.identity(model)
    for context in ("", "H"):
        result = handoff(
            bridge, model, model, context, " said", source_tokenizer=tok, target_tokenizer=tok,
            max_new_tokens=4, do_sample=False,
        )  # fmt: skip
        ids = tok(context + " said", return_tensors="pt")["input_ids"]
        native = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
        assert torch.equal(result.output_ids, native[:, ids.shape[1] :])
    with pytest.raises(ValueError, match="context and prompt are both empty"):
        handoff(bridge, model, model, "", "", source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=2)


def test_anchor_counts_out_of_range_get_errors_naming_value_and_range():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 6))
    bridge, captured = Bridge.identity(model), capture_kv(model, ids)
    for head in (6, 7):
        with pytest.raises(ValueError, match=rf"native_head={head}, .* expected 0 <= native_head <= 5"):
            BridgedCache(bridge, captured, model, ids, config=HandoffConfig(native_head=head, refresh=None))
    with pytest.raises(ValueError, match="native_head=-1; expected a count of context tokens >= 0"):
        BridgedCache(bridge, captured, model, ids, config=HandoffConfig(native_head=-1, refresh=None))
    with pytest.raises(ValueError, match="native_tail=-2; expected a count of context tokens >= 0"):
        BridgedCache(bridge, captured, model, ids, config=HandoffConfig(native_tail=-2, refresh=None))
    # The largest native head is exact: everything before the held-back token is computed natively.
    cache = BridgedCache(bridge, captured, model, ids, config=HandoffConfig(native_head=5, refresh=None))
    assert cache.get_seq_length() == 5 and len(cache.translated_positions) == 0
    assert _max_logit_diff(_generate(model, ids, cache), _generate(model, ids)) < 1e-5
    # A native tail longer than the context leaves only the native head in the cache.
    assert (
        BridgedCache(
            bridge, captured, model, ids, config=HandoffConfig(native_tail=50, refresh=None)
        ).get_seq_length()
        == 1
    )
