"""Both fitting methods on synthetic KV with a known affine map, and on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from bridgecache.fitting import FitConfig, PairedKV, fit_bridge, fit_layer_maps
from bridgecache.fitting.calibration import CalibSequence, calibration_sequences
from bridgecache.fitting.runner import paired_kv
from tokenalign import NATIVE, Alignment

LAYER_OF = [3, 0, 2]  # target layer t is generated from source layer LAYER_OF[t]


def _synthetic(src_shape, tgt_shape, head_of, n_seq=12, tokens=80, noise=0.02, seed=0, offset=1.0):
    """PairedKV sequences where target (t, h) = source (LAYER_OF[t], head_of[h]) @ W + b + noise."""
    (ls, hs, ds), (lt, ht, dt) = src_shape, tgt_shape
    g = torch.Generator().manual_seed(seed)
    truth = {
        kind: (torch.randn(lt, ht, ds, dt, generator=g), torch.randn(lt, ht, dt, generator=g))
        for kind in "kv"
    }
    seqs = []
    for i in range(n_seq):
        src = {
            kind: [torch.randn(1, hs, tokens, ds, generator=g) * 2 + offset for _ in range(ls)]
            for kind in "kv"
        }
        tgt = {kind: [] for kind in "kv"}
        for kind in "kv":
            w, b = truth[kind]
            for t in range(lt):
                heads = [src[kind][LAYER_OF[t]][0, head_of[h]] @ w[t, h] + b[t, h] for h in range(ht)]
                y = torch.stack(heads)[None]
                tgt[kind].append(y + noise * torch.randn(y.shape, generator=g))
        weights = [torch.rand(1, ht, tokens, generator=g) ** 2 for _ in range(lt)]
        rows = torch.arange(1, tokens)
        seqs.append(
            PairedKV(src["k"], src["v"], tgt["k"], tgt["v"], rows, rows, heldout=i % 4 == 3,
                     key_weights=weights, value_weights=weights)
        )  # fmt: skip
    return seqs, truth


CASES = [  # (source (L, H, D), target (L, H, D), true source head of each target head)
    ((4, 2, 8), (3, 2, 8), [0, 1]),  # matched counts: by index
    ((4, 3, 8), (3, 2, 8), [2, 0]),  # 3x64 -> 2x64 analogue: data-driven
    ((4, 2, 16), (3, 2, 8), [0, 1]),  # 2x128 -> 2x64 analogue
    ((4, 3, 8), (3, 1, 32), [1]),  # anything -> 1x256 analogue
]


@pytest.mark.parametrize("src_shape,tgt_shape,head_of", CASES)
def test_cachebridge_recovers_known_head_local_map(src_shape, tgt_shape, head_of):
    seqs, truth = _synthetic(src_shape, tgt_shape, head_of)
    layers, info = fit_layer_maps(
        lambda w: seqs, src_shape, tgt_shape, FitConfig(method="cachebridge", layers_k=1, lam=1e-5)
    )
    assert info["weighting"] == "attention" and "alpha" in info
    for t, layer in enumerate(layers):
        assert layer.source_layers == [LAYER_OF[t]]
        assert layer.inputs[:, 0, 1].tolist() == head_of  # the matched source heads
        torch.testing.assert_close(layer.key_weight, truth["k"][0][t], atol=0.02, rtol=0)
        torch.testing.assert_close(layer.value_bias, truth["v"][1][t], atol=0.05, rtol=0)
        assert layer.r2_key > 0.999 and layer.r2_value > 0.999


@pytest.mark.parametrize("src_shape,tgt_shape,head_of", CASES[:2])
def test_fullhead_recovers_known_map_and_zeroes_other_heads(src_shape, tgt_shape, head_of):
    seqs, truth = _synthetic(src_shape, tgt_shape, head_of)
    layers, info = fit_layer_maps(
        lambda w: seqs, src_shape, tgt_shape, FitConfig(method="fullhead", layers_k=1, lam=1e-5)
    )
    hs, ds = src_shape[1], src_shape[2]
    for t, layer in enumerate(layers):
        assert layer.inputs.shape == (tgt_shape[1], hs, 2)
        assert layer.inputs[0, :, 1].tolist() == list(range(hs))
        for h, true_head in enumerate(head_of):
            blocks = layer.value_weight[h].reshape(hs, ds, -1)
            torch.testing.assert_close(blocks[true_head], truth["v"][0][t, h], atol=0.02, rtol=0)
            others = [blocks[j] for j in range(hs) if j != true_head]
            assert all(o.abs().max() < 0.02 for o in others)
        assert layer.r2_key > 0.999


@pytest.mark.parametrize("precision,bias_atol", [("tf32x3", 2e-2), ("bf16-gemm", 1.0)])
def test_data_far_from_zero_keeps_full_precision(precision, bias_atol):
    # KV with a large constant offset (keys carry big biases): raw float32 moments would cancel,
    # and bfloat16 rows would round away 300 * 2^-9 of a spread of 2. The rows are shifted first,
    # so noise-free data is fitted to R^2 1 - 1e-5 either way. What bfloat16 rows leave in the
    # bias (300 x the weights' error) is below what noise of 1% of the spread leaves at float64
    # (about 1.1 here).
    seqs, truth = _synthetic((4, 2, 8), (3, 2, 8), [0, 1], offset=300.0, noise=0.0)
    config = FitConfig(method="fullhead", layers_k=1, lam=1e-7, stats_precision=precision)
    layers, _ = fit_layer_maps(lambda w: seqs, (4, 2, 8), (3, 2, 8), config)
    for t, layer in enumerate(layers):
        assert layer.r2_key > 0.99999
        torch.testing.assert_close(layer.key_bias, truth["k"][1][t], atol=bias_atol, rtol=0)


def test_fullhead_top_k_picks_the_generating_layer_first():
    seqs, _ = _synthetic((4, 2, 8), (3, 2, 8), [0, 1])
    layers, info = fit_layer_maps(
        lambda w: seqs, (4, 2, 8), (3, 2, 8), FitConfig(method="fullhead", layers_k=2)
    )
    scores = torch.tensor(info["layer_scores"])  # [source layer, target layer]
    assert scores.argmax(0).tolist() == LAYER_OF
    for t, layer in enumerate(layers):
        assert LAYER_OF[t] in layer.source_layers and len(layer.source_layers) == 2


def test_head_probes_are_scored_only_for_head_matching(monkeypatch):
    """The single-head probes (hs solves per source layer) only serve CacheBridge's head matching
    across head counts; without them the layer scores are the same numbers."""
    from bridgecache.fitting import fit as fit_module
    from bridgecache.fitting import support

    asked = []

    def recording(*args, heads=True, **kwargs):
        asked.append(heads)
        return support.score_probes(*args, heads=heads, **kwargs)

    monkeypatch.setattr(fit_module, "score_probes", recording)
    scores = {}
    runs = (("fullhead", CASES[1]), ("cachebridge", CASES[1]), ("cachebridge", CASES[0]))
    for method, (src, tgt, head_of) in runs:
        seqs, _ = _synthetic(src, tgt, head_of, n_seq=8)
        _, info = fit_layer_maps(lambda w, seqs=seqs: seqs, src, tgt, FitConfig(method=method, layers_k=1))
        scores[(method, src)] = info["layer_scores"]
    assert asked == [False, True, False]  # heads matched only for 3 source heads -> 2 target heads
    assert scores[("fullhead", CASES[1][0])] == scores[("cachebridge", CASES[1][0])]


def test_depth_support_skips_probes_when_heads_match():
    seqs, _ = _synthetic((4, 2, 8), (3, 2, 8), [0, 1], n_seq=4)
    calls = []

    def source(with_weights):
        calls.append(with_weights)
        return seqs

    layers, info = fit_layer_maps(
        source, (4, 2, 8), (3, 2, 8), FitConfig(method="cachebridge", layers_k=1, layer_support="depth")
    )
    assert calls == [True]  # one pass, with attention weights
    assert [layer.source_layers for layer in layers] == [[0], [1], [3]]  # depth 0, 1.5 (tie: lower), 3


class ByteTokenizer:
    """A byte-level tokenizer with the few methods bridgecache calls (ids < 256)."""

    all_special_tokens: list[str] = []

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids = list(text.encode("utf-8"))
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(ids))]
        return out

    def get_vocab(self):
        return {f"<{i}>": i for i in range(256)}


@pytest.mark.parametrize("method", ["fullhead", "cachebridge"])
def test_model_regressed_on_itself_is_near_identity(method):
    model, tok = tiny_model("qwen2"), ByteTokenizer()
    config = FitConfig(method=method, num_sequences=8, seq_len=48, layers_k=1, identity_if_same=False)
    bridge = fit_bridge(model, model, tok, tok, config, progress=False)
    assert bridge.method == method and bridge.alignment_policy == "identity"
    for t, layer in enumerate(bridge.layers):
        assert layer.source_layers == [t]
        assert layer.r2_key >= 0.99 and layer.r2_value >= 0.99


def test_same_model_gives_exact_identity_without_regression():
    model, tok = tiny_model("llama"), ByteTokenizer()
    twin = tiny_model("llama")  # same seed: bit-identical weights, another object
    for other in (model, twin):
        bridge = fit_bridge(model, other, tok, tok, FitConfig(method="cachebridge"), progress=False)
        assert bridge.method == "identity"
        assert all(
            torch.equal(layer.key_weight[h], torch.eye(16)) for layer in bridge.layers for h in range(2)
        )


def test_cross_family_fit_end_to_end_excludes_native_head():
    src, tgt, tok = tiny_model("llama", seed=1), tiny_model("gemma3", seed=2), ByteTokenizer()
    seqs, policy = calibration_sequences(tok, tok, 4, 40, native_head=2, heldout_every=2)
    assert policy == "identity" and [s.heldout for s in seqs] == [False, True, False, True]
    assert all(int(s.tgt_rows.min()) == 2 and int(s.src_rows.min()) == 2 for s in seqs)
    config = FitConfig(method="cachebridge", num_sequences=4, seq_len=40, native_head=2, heldout_every=2)
    bridge = fit_bridge(src, tgt, tok, tok, config, progress=False)
    assert bridge.native_head == 2 and bridge.calibration["rows"] == {"train": 76, "heldout": 76}
    layer = bridge.layers[0]
    assert layer.inputs.shape == (1, 2, 2)  # gemma3 target: one KV head, k=2 matched source heads
    assert layer.key_weight.shape == (1, 2 * 16, 32)


@pytest.mark.real_model
def test_real_model_self_fit_and_identity(smollm2, tmp_path):
    from bridgecache.bridge.maps import Bridge

    model, tok = smollm2
    assert fit_bridge(model, model, tok, tok, progress=False).method == "identity"
    config = FitConfig(
        method="cachebridge", num_sequences=6, seq_len=64, layers_k=1, layer_support="depth",
        heldout_every=3, identity_if_same=False,
    )  # fmt: skip
    bridge = fit_bridge(model, model, tok, tok, config, progress=False)
    assert [layer.source_layers for layer in bridge.layers] == [[t] for t in range(30)]
    assert min(layer.r2_key for layer in bridge.layers) >= 0.99
    assert min(layer.r2_value for layer in bridge.layers) >= 0.99
    bridge.save_pretrained(tmp_path)
    Bridge.from_pretrained(tmp_path).check(model, model)


def test_cross_tokenizer_pairing_reaches_the_core():
    # Target row t reads source row PAIR[t] (as pair_rows gives across tokenizers); rows 0 and 5
    # of the target have no source text (NATIVE) and are absent from the pairing.
    seqs, truth = _synthetic((4, 2, 8), (3, 2, 8), [0, 1], tokens=80)
    g = torch.Generator().manual_seed(5)
    tgt_rows = torch.tensor([t for t in range(1, 60) if t != 5])
    src_rows = (tgt_rows * 4) // 3  # the source tokenizer makes more tokens
    for seq in seqs:
        for kind, layers in (("k", seq.target_keys), ("v", seq.target_values)):
            w, b = truth[kind]
            src = seq.source_keys if kind == "k" else seq.source_values
            for t, y in enumerate(layers):
                y.normal_(generator=g)  # rows outside the pairing are unrelated noise
                for h in range(2):
                    y[0, h, tgt_rows] = src[LAYER_OF[t]][0, h, src_rows] @ w[t, h] + b[t, h]
        seq.src_rows, seq.tgt_rows = src_rows, tgt_rows
    # noise-free rows recovered to 1e-3 need float64 rows (bfloat16 rows err by 2^-9 of each)
    config = FitConfig(method="cachebridge", layers_k=1, lam=1e-6, stats_precision="tf32x3")
    layers, _ = fit_layer_maps(lambda w: seqs, (4, 2, 8), (3, 2, 8), config)
    for t, layer in enumerate(layers):
        assert layer.source_layers == [LAYER_OF[t]] and layer.r2_key > 0.9999
        torch.testing.assert_close(layer.key_weight, truth["k"][0][t], atol=1e-3, rtol=0)


def test_mean_policy_pools_source_rows_per_target_token():
    src, tgt = tiny_model("llama", seed=1), tiny_model("qwen2", seed=2)
    start = np.array([0, 0, 2, 3, 3, 6])
    end = np.array([0, 2, 3, 6, 6, 9])
    index = np.where(end > start, end - 1, NATIVE)
    pool = Alignment(index, start, end, num_source=9, policy="mean")
    rows = torch.tensor([1, 2, 3, 4, 5])
    seq = CalibSequence(torch.arange(9) + 10, torch.arange(6) + 20, rows, rows, False, pool)
    (paired,) = paired_kv(src, tgt, [seq], progress=False)
    raw = paired_kv(
        src, src, [CalibSequence(seq.source_ids, seq.source_ids, rows, rows, False)], progress=False
    )
    plain = next(iter(raw)).source_values[1]  # the source's own rows, unpooled
    assert paired.source_values[1].shape[2] == 6  # one pooled row per target token
    torch.testing.assert_close(paired.source_values[1][:, :, 3], plain[:, :, 3:6].mean(2))
    torch.testing.assert_close(paired.source_values[1][:, :, 2], plain[:, :, 2])


@pytest.mark.parametrize("method", ["fullhead", "cachebridge"])
def test_key_scale_stretches_only_the_keys_and_records_the_factor(method):
    shapes = ((4, 2, 8), (3, 2, 8))
    seqs, _ = _synthetic(*shapes, [0, 1], noise=6.0)  # noisy targets: shrunken ridge predictions
    config = FitConfig(method=method, layers_k=1, lam=1e-2)
    plain, _ = fit_layer_maps(lambda w: seqs, *shapes, config.replace(key_scale="none"))
    scaled, info = fit_layer_maps(lambda w: seqs, *shapes, config.replace(key_scale="variance"))
    assert info["key_scale"] == "variance" and len(info["key_alpha"]) == 3
    for p, s, alphas, r2_ridge in zip(plain, scaled, info["key_alpha"], info["r2_key_ridge"]):
        alpha = torch.tensor(alphas)[:, None, None]
        assert bool((alpha > 1).all())
        assert torch.allclose(s.key_weight, p.key_weight * alpha, rtol=1e-3, atol=1e-6)
        assert torch.equal(s.value_weight, p.value_weight) and torch.equal(s.value_bias, p.value_bias)
        assert r2_ridge == pytest.approx(p.r2_key, abs=1e-4)
        if method == "fullhead":  # uniform weights: the ridge map minimises the (held-out) MSE
            assert s.r2_key < p.r2_key
    with pytest.raises(ValueError, match="key_scale"):
        fit_layer_maps(lambda w: seqs, *shapes, FitConfig(method=method, key_scale="double"))
