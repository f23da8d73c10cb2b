"""The architectures users serve, one tiny random model each (tests/tiny_models.py ARCHITECTURES):
each is exact through a bridge, or refused by name before any model runs.

Exact: the identity bridge and a full refresh of a deliberately wrong bridge reproduce the target's
own generate (tokens, and logits within 1e-4 in float32) over a context longer than the window
(8), un-rotated keys are position-free (also on SmolLM3's layer without RoPE), and a fit and a
handoff run both ways with a tiny Qwen2. Refused: `model_spec`, `capture_kv`,
`Bridge.identity`, `BridgedCache` and `fit_bridge` (either side) raise an
UnsupportedArchitectureError naming the feature, and no forward of the model has run.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from tiny_models import (
    ARCHITECTURES,
    byte_tokenizer,
    noisy_bridge,
    script,
    tiny_architecture,
    tiny_architecture_config,
    tiny_model,
)
from transformers import AttentionInterface, DynamicCache

from bridgecache import FitConfig, HandoffConfig, RefreshConfig, fit_bridge
from bridgecache.bridge.maps import Bridge
from bridgecache.compat import cache_kwargs
from bridgecache.fitting.attention import QueryRecorder, boundary_rows
from bridgecache.kv.capture import capture_kv
from bridgecache.kv.files import load_kv, save_kv
from bridgecache.kv.keynorm import key_norm_scales, project_to_key_norm
from bridgecache.kv.rope import RopeTables
from bridgecache.models.layout import UnsupportedArchitectureError
from bridgecache.models.spec import ModelSpec, model_spec, spec_from_untrusted
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.entry.handoff import handoff
from bridgecache.runtime.selection.reading import attention_scores

REFUSED = {
    "gpt2 (learned positions)": "no rotary position embeddings",
    "deepseek_v3 (MLA)": "latent attention",
    "qwen3_next (hybrid)": "linear_attention",
}
EXACT = [name for name in ARCHITECTURES if name not in REFUSED]
FIT = FitConfig(
    method="fullhead", layer_support="depth", layers_k=1, num_sequences=2, seq_len=32, heldout_every=2
)
CONTEXT = "The key to the red door is under the third stone of the garden path."


def _generate(model, ids, cache=None, mask=None):
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True)
    if cache is not None:
        kwargs |= cache_kwargs(model, cache)
    if mask is not None:
        kwargs["attention_mask"] = mask
    out = model.generate(ids, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("name", EXACT)
def test_identity_and_full_refresh_reproduce_the_targets_own_generate(name):
    model = tiny_architecture(name)
    spec = model_spec(model)
    # the spec's layout is the one the target's own cache keeps
    kept = [getattr(layer, "sliding_window", None) for layer in DynamicCache(config=model.config).layers]
    assert [spec.sliding_window if t == "sliding_attention" else None for t in spec.layer_types] == kept
    # layer 0's keys depend on the token alone: un-rotated, a token's keys are the same anywhere
    half = torch.randint(3, 300, (1, 15), generator=torch.Generator().manual_seed(2))
    keys = capture_kv(model, torch.cat([half, half], 1)).unrotated_keys(0).float()
    assert (keys[:, :, :15] - keys[:, :, 15:]).abs().max() < 1e-5 * keys.abs().max()
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(1))  # > window 8
    native_seq, native_logits = _generate(model, ids)
    seq, logits = _generate(
        model, ids, BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids)
    )
    assert torch.equal(seq, native_seq)
    assert (logits - native_logits).abs().max() < 1e-4
    bridge = noisy_bridge(model)
    plain = HandoffConfig(refresh=None)
    _, poor = _generate(model, ids, BridgedCache(bridge, capture_kv(model, ids), model, ids, config=plain))
    assert (poor - native_logits).abs().max() > 1e-2  # the noisy bridge is really wrong
    refresh = HandoffConfig(refresh=RefreshConfig(1.0, "deviation"), route="handoff")
    cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=refresh)
    seq, logits = _generate(model, ids, cache)
    assert cache.report().tokens_refreshed == 28  # all but the native sink and the held-back token
    assert torch.equal(seq, native_seq)
    assert (logits - native_logits).abs().max() < 1e-4


@pytest.mark.parametrize("name", EXACT)
def test_every_layers_unrotated_keys_stay_put_when_every_position_shifts(name):
    # attention sees relative positions only, so shifting them all leaves every hidden state, and
    # so every layer's un-rotated keys, as they were: each layer's tables, pairing and RoPE flag
    # as a bridge rebuilds them from the spec (benchmarks/architecture_probe.py's check)
    assert script("benchmarks/architecture_probe.py").shifted_unrotation(tiny_architecture(name)) < 1e-4


@pytest.mark.parametrize(
    "name",
    [
        "gpt_oss (sinks)",
        "gemma2 (soft-capping)",
        "llama4_text (chunked, NoPE)",
        "llama4_text (chunked, RoPE, qk-norm)",
    ],
)
def test_the_sources_reading_is_the_models_own_attention(name):
    # the reading scores context tokens by the model's own probabilities: GPT-OSS's sinks take
    # their share, windows hold (a 20-token context, windows of 8), as transformers' eager attention
    model = tiny_architecture(name)
    context, prompt = torch.randint(3, 300, (1, 20)), torch.randint(3, 300, (1, 4))
    kv = capture_kv(model, context)
    first = torch.zeros(1, dtype=torch.long)
    out = model(input_ids=torch.cat([context, prompt], 1), output_attentions=True)
    expected = sum(a[0, :, 20:, :20].sum((0, 1)) for a in out.attentions)
    scores = attention_scores(model, kv.keys, kv.values, kv.position_ids, first, prompt, 20, reduce="sum")
    assert torch.allclose(scores[0], expected, atol=1e-5)


@pytest.mark.parametrize(
    "name",
    ["gpt_oss (sinks)", "llama4_text (chunked, NoPE)", "llama4_text (chunked, RoPE, qk-norm)", "gemma3"],
)
def test_a_prompt_read_in_the_pass_after_an_identity_context_is_the_targets_own(name):
    # the prompt's queries sit at columns past the context, not at 0..n-1: windows, chunks, sinks
    # and Llama 4's query temperature (floor_scale 4: it changes every 4 columns) must follow them
    model, tok = tiny_architecture(name), byte_tokenizer()
    result = handoff(
        Bridge.identity(model), model, model, CONTEXT, " Where?", source_tokenizer=tok, target_tokenizer=tok,
        max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True,
        config=HandoffConfig(route="handoff"),
    )  # fmt: skip
    ids = tok(CONTEXT + " Where?", return_tensors="pt").input_ids
    native_seq, native_logits = _generate(model, ids)
    assert torch.equal(result.output_ids, native_seq[:, ids.shape[1] : ids.shape[1] + 4])
    logits = torch.stack(result.generation.logits)
    assert (logits - native_logits[:4]).abs().max() < 1e-4


@pytest.mark.parametrize(
    "name, attention",
    [
        ("mistral (sliding window)", "sdpa"),
        ("phi3 (sliding window)", "sdpa"),
        ("starcoder2", "sdpa"),
        ("gpt_oss (sinks)", "eager"),  # transformers runs its sinks in eager attention only
        ("llama4_text (chunked, NoPE)", "sdpa"),  # chunks count from each row's first real token
        ("llama4_text (chunked, RoPE, qk-norm)", "sdpa"),
    ],
)
def test_a_left_padded_batch_keeps_windows_chunks_and_sinks(name, attention):
    # Mistral, Phi-3 and StarCoder2 hand their window to the attention function as a keyword only
    config = tiny_architecture_config(name)
    config._attn_implementation = attention
    model = tiny_architecture(name, config=config)
    ids = torch.randint(3, 300, (2, 26), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :7], ids[0, :7] = 0, 0  # row 0: 19 real tokens, both rows longer than the window
    masks = dict(target_attention_mask=mask, source_attention_mask=mask)
    native_seq, native_logits = _generate(model, ids, mask=mask)
    refresh = HandoffConfig(refresh=RefreshConfig(1.0, "deviation"), route="handoff")
    for bridge, config in ((Bridge.identity(model), HandoffConfig()), (noisy_bridge(model), refresh)):
        source = capture_kv(model, ids, attention_mask=mask)
        seq, logits = _generate(
            model, ids, BridgedCache(bridge, source, model, ids, **masks, config=config), mask
        )
        assert torch.equal(seq, native_seq)
        assert (logits - native_logits).abs().max() < 1e-4


@pytest.mark.parametrize("name", EXACT)
def test_the_fits_boundary_queries_are_the_ones_the_models_attention_receives(name):
    # the fit recomputes queries at boundary rows (q_proj, q-norms, RoPE in the model's layout, Llama
    # 4's qk-norm after it and its NoPE layers' temperature); in the same forward, the attention
    # function the model calls receives its own
    seen = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = query.detach().float()
        eager = importlib.import_module(type(module).__module__).eager_attention_forward  # the model's own
        return eager(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("bridgecache-test-recording", recording)
    config = tiny_architecture_config(name)
    config._attn_implementation = "bridgecache-test-recording"
    model = tiny_architecture(name, config=config)
    ids = torch.randint(3, 300, (2, 21), generator=torch.Generator().manual_seed(4))
    rows = boundary_rows(21, 6, first=1)
    with QueryRecorder(model, rows) as recorder, torch.no_grad():
        model(input_ids=ids)
    assert sorted(recorder.queries) == sorted(seen) == list(range(config.num_hidden_layers))
    for layer, queries in recorder.queries.items():
        own = seen[layer][:, :, rows]
        assert queries.shape == own.shape
        assert (queries - own).abs().max() <= 1e-5 * own.abs().max(), layer


@pytest.mark.parametrize("name", EXACT)
def test_fit_and_handoff_run_both_ways_with_qwen2(name):
    model, qwen, tok = tiny_architecture(name), tiny_model("qwen2"), byte_tokenizer()
    for source, target in ((model, qwen), (qwen, model)):
        bridge = fit_bridge(source, target, tok, tok, FIT, progress=False, source_name="s", target_name="t")
        scores = bridge.calibration["heldout_scores"]["attention_cosine"]
        assert len(scores) == model_spec(target).num_layers and all(math.isfinite(s) for s in scores)
        result = handoff(
            bridge, source, target, CONTEXT, " Where?", source_tokenizer=tok, target_tokenizer=tok,
            max_new_tokens=3, do_sample=False,
        )  # fmt: skip
        assert result.output_ids.shape[-1] > 0 and result.cache.get_seq_length() > 0


def test_a_bridge_file_keeps_the_layout_of_a_sliding_window_model(tmp_path):
    model = tiny_architecture("mistral (sliding window)")
    bridge = Bridge.identity(model)
    loaded = Bridge.from_pretrained(bridge.save_pretrained(tmp_path / "bridge"))
    assert loaded.target == bridge.target and loaded.target.layer_types == ("sliding_attention",) * 4
    assert loaded.target.sliding_window == 8
    full = model_spec(tiny_architecture("mistral"))
    assert "layer_types" in " ".join(loaded.target.mismatches(full))  # the window is part of the identity


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_by_name_at_every_entry_before_any_model_runs(name):
    model, qwen, tok = tiny_architecture(name), tiny_model("qwen2"), byte_tokenizer()
    ran = []
    hooks = [m.register_forward_pre_hook(lambda *a: ran.append(1)) for m in (model, model.get_decoder())]
    ids = torch.randint(3, 300, (1, 12))
    entries = {
        "model_spec": lambda: model_spec(model),
        "model_spec(config)": lambda: model_spec(model.config),
        "capture_kv": lambda: capture_kv(model, ids),
        "Bridge.identity": lambda: Bridge.identity(model),
        "BridgedCache": lambda: BridgedCache(Bridge.identity(qwen), capture_kv(qwen, ids), model, ids),
        "fit_bridge (source)": lambda: fit_bridge(model, qwen, tok, tok, FIT, progress=False),
        "fit_bridge (target)": lambda: fit_bridge(qwen, model, tok, tok, FIT, progress=False),
        "handoff (target)": lambda: handoff(
            Bridge.identity(qwen), qwen, model, CONTEXT, source_tokenizer=tok, target_tokenizer=tok
        ),
    }
    for entry, call in entries.items():
        with pytest.raises(UnsupportedArchitectureError, match=REFUSED[name]) as caught:
            call()
        assert "bridgecache supports" in str(caught.value), entry
    for hook in hooks:
        hook.remove()
    assert ran == []


def test_the_layers_without_rope_round_trip_through_a_bridge_file_and_old_files_still_load(tmp_path):
    model = tiny_architecture("smollm3 (no-RoPE layers)")
    spec = model_spec(model)
    assert spec.no_rope_layers == (0,)
    # EXAONE 4 skips RoPE on its layers without a window by a rule of its code, not a config field
    assert model_spec(tiny_architecture("exaone4 (no RoPE on full layers)")).no_rope_layers == (1, 3)
    loaded = Bridge.from_pretrained(Bridge.identity(model).save_pretrained(tmp_path / "bridge"))
    assert loaded.target == spec
    # the source's tables re-derived from the spec alone (as a bridge does) leave layer 0 as it is
    tables = RopeTables.from_spec(loaded.source)
    cos, sin = tables.cos_sin(0, torch.arange(6))
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
    assert not torch.equal(tables.cos_sin(1, torch.arange(6))[1], sin)
    ids = torch.randint(3, 300, (1, 10))
    save_kv(tmp_path / "context.kv", capture_kv(model, ids))
    assert load_kv(tmp_path / "context.kv", model=model, input_ids=ids).model == spec  # a KV file too
    old = model_spec(tiny_model("qwen2")).to_dict()
    del old["no_rope_layers"]  # a file written before the field
    assert ModelSpec.from_dict(old).no_rope_layers == ()
    assert spec_from_untrusted(old).no_rope_layers == ()
    for bad in ([5], [1, 0], "0", [True]):
        with pytest.raises(ValueError, match="no_rope_layers"):
            spec_from_untrusted(old | {"no_rope_layers": bad})


def test_a_key_norm_over_the_whole_projection_is_restored_jointly_over_the_heads():
    # OLMo 2 normalises k_proj's output over all its heads at once: one RMS per token
    model = tiny_architecture("olmo2")
    scales = key_norm_scales(model)
    assert all(s.shape == (2 * 16,) for s in scales)
    keys = capture_kv(model, torch.randint(3, 300, (1, 12))).unrotated_keys(1).float()  # [1, 2, 12, 16]
    projected = project_to_key_norm(keys, scales[1])
    assert torch.allclose(projected, keys, atol=1e-3 * keys.abs().max())  # its own keys stay put
    shrunk = keys * torch.tensor([0.5, 2.0])[None, :, None, None]  # one head shrunk, one grown
    restored = project_to_key_norm(shrunk, scales[1])
    joint = keys.norm(dim=(1, 3), keepdim=True) / shrunk.norm(dim=(1, 3), keepdim=True)  # [1, 1, 12, 1]
    assert torch.allclose(restored, shrunk * joint, rtol=1e-4)
    assert not torch.allclose(restored, keys, atol=1e-2)  # per token, not per head: the ratio stays
    with pytest.raises(ValueError, match="fits neither a head"):
        project_to_key_norm(keys, torch.ones(24))
