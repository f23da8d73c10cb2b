"""Calibration in batches: several sequences per forward give each sequence the KV and rows its
own forward gives (sources of other lengths left-padded, pooled rows per sequence), and a fit in
batches gives the maps of a fit one sequence at a time, on one tokenizer and across two."""

from __future__ import annotations

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache.bridge.recipe import FitConfig
from bridgecache.fitting import fit as fit_module
from bridgecache.fitting import fit_bridge
from bridgecache.fitting.calibration import CalibSequence, calibration_sequences
from bridgecache.fitting.core import row_matrix
from bridgecache.fitting.fit import calibration_batch
from bridgecache.fitting.runner import batches, paired_kv
from bridgecache.models.spec import model_spec

pytestmark = pytest.mark.usefixtures("one_thread")

# Calibration text of our own (the built-in text differs between Python versions): "the" every
# 2nd to 5th word, so a source that reads "the" as one token reads windows of other lengths.
DOCS = [" ".join("the" if j % (i % 4 + 2) == 0 else f"w{j}" for j in range(80)) for i in range(8)]


@pytest.fixture(scope="module")
def pair():
    return tiny_model("qwen2", seed=0), tiny_model("llama", seed=1)


def _seq(n_src: int, n_tgt: int, heldout: bool = False, seed: int = 0) -> CalibSequence:
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(3, 200, (n_src,), generator=g), torch.randint(3, 200, (n_tgt,), generator=g)
    rows = torch.arange(1, min(n_src, n_tgt))
    return CalibSequence(src, tgt, rows.flip(0) % n_src, rows, heldout)  # any pairing of rows


def test_batches_keep_one_split_and_one_target_length_in_order():
    seqs = [_seq(20, 16), _seq(20, 16, True), _seq(22, 16), _seq(20, 12), _seq(21, 16), _seq(20, 16)]
    place = {id(s): i for i, s in enumerate(seqs)}
    assert [[place[id(s)] for s in group] for group in batches(seqs, 2)] == [[0, 2], [4, 5], [1], [3]]
    assert [[place[id(s)] for s in group] for group in batches(seqs, 1)] == [[i] for i in range(6)]


@pytest.mark.parametrize("weights", [False, True])
def test_a_batch_gives_each_sequence_its_own_kv_and_rows(pair, weights):
    source, target = pair
    seqs = [_seq(30, 24, seed=1), _seq(19, 24, seed=2), _seq(26, 24, seed=3)]  # padding 0, 11 and 4
    (batched,) = paired_kv(source, target, seqs, weights, boundaries=6, progress=False, batch=3)
    src_rows, tgt_rows = row_matrix(batched.src_rows), row_matrix(batched.tgt_rows)
    assert src_rows.shape == (3, 23)
    for b, seq in enumerate(seqs):
        (one,) = paired_kv(source, target, [seq], weights, boundaries=6, progress=False)
        n = one.tgt_rows.numel()
        assert torch.equal(tgt_rows[b, :n], one.tgt_rows) and bool((tgt_rows[b, n:] == -1).all())
        assert bool((src_rows[b, n:] == -1).all())
        for got, want in ((batched.source_keys, one.source_keys), (batched.source_values, one.source_values)):
            for layer in range(len(want)):
                a, w = got[layer][b][:, src_rows[b, :n]], want[layer][0][:, one.src_rows]
                torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)
        for got, want in ((batched.target_keys, one.target_keys), (batched.key_weights, one.key_weights)):
            if want is None:
                assert got is None
                continue
            for layer in range(len(want)):
                torch.testing.assert_close(got[layer][b], want[layer][0], atol=1e-5, rtol=1e-4)


def test_rows_of_a_batch_are_padded_with_minus_one(pair):
    source, target = pair
    seqs = [_seq(30, 24, seed=1), _seq(12, 24, seed=2)]  # 23 and 11 pairs
    (batched,) = paired_kv(source, target, seqs, progress=False, batch=2)
    assert batched.num_rows == 23 + 11
    assert bool((batched.src_rows[1, 11:] == -1).all()) and bool((batched.tgt_rows[1, 11:] == -1).all())


def _maps(bridge) -> list[torch.Tensor]:
    return [
        t
        for layer in bridge.layers
        for t in (layer.key_weight, layer.key_bias, layer.value_weight, layer.value_bias)
    ]


@pytest.mark.parametrize("method", ["fullhead", "cachebridge"])
@pytest.mark.parametrize("across", [False, True])
def test_a_fit_in_batches_equals_a_fit_one_sequence_at_a_time(pair, method, across):
    source, target = pair
    target_tok = byte_tokenizer()
    tok = byte_tokenizer(extra="the") if across else target_tok  # "the" one token: sources of other lengths
    config = FitConfig(
        method=method, num_sequences=8, seq_len=40, heldout_every=4, probe_subset=4, text=DOCS
    )  # fmt: skip
    one = fit_bridge(source, target, tok, target_tok, config.replace(batch_sequences=1), progress=False)
    many = fit_bridge(source, target, tok, target_tok, config.replace(batch_sequences=3), progress=False)
    assert one.calibration["batch_sequences"] == 1 and many.calibration["batch_sequences"] == 3
    assert one.calibration["rows"] == many.calibration["rows"]
    if across:
        seqs, _ = calibration_sequences(tok, target_tok, 8, 40, heldout_every=4, text=config.text)
        assert len({int(s.source_ids.numel()) for s in seqs}) > 1  # the batches were padded
    assert [m.source_layers for m in one.layers] == [m.source_layers for m in many.layers]
    for a, b in zip(_maps(one), _maps(many)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    assert "batch_sequences" not in one.calibration["recipe"]  # changes no map: not recorded


def test_mean_policy_pools_each_sequence_of_a_batch(pair):
    source, target = pair
    tok, target_tok = byte_tokenizer(extra="the"), byte_tokenizer()
    text = FitConfig(text=DOCS).text
    seqs, policy = calibration_sequences(tok, target_tok, 4, 40, policy="mean", heldout_every=8, text=text)
    assert policy == "mean" and len({int(s.source_ids.numel()) for s in seqs}) > 1
    length = seqs[0].target_ids.numel()
    same_length = [s for s in seqs if not s.heldout and s.target_ids.numel() == length]
    assert len({int(s.source_ids.numel()) for s in same_length}) > 1
    (batched,) = paired_kv(source, target, same_length, progress=False, batch=len(same_length))
    for b, seq in enumerate(same_length):
        (one,) = paired_kv(source, target, [seq], progress=False)
        torch.testing.assert_close(batched.source_values[1][b], one.source_values[1][0], atol=1e-5, rtol=1e-4)


def test_the_default_batch_holds_about_8k_tokens_within_3_gib():
    spec = model_spec(tiny_model("qwen2", seed=0))
    assert calibration_batch(FitConfig(seq_len=1024), spec, spec) == 8
    assert calibration_batch(FitConfig(seq_len=9000), spec, spec) == 1
    assert calibration_batch(FitConfig(batch_sequences=5), spec, spec) == 5
    wide = spec.__class__(**{**spec.__dict__, "num_layers": 32, "num_kv_heads": 8, "head_dim": 128})
    # 32 layers x 8 heads x 128 on each side: 1,024 tokens of KV take 1.34 GB at 10 bytes a value
    assert calibration_batch(FitConfig(seq_len=1024), wide, wide) == 2
    # a source that reads three times the target's tokens holds twice the KV counted above
    assert calibration_batch(FitConfig(seq_len=1024), wide, wide, source_tokens=3072) == 1
    # more room for the KV (a quarter of a GPU's free memory): more sequences, never past 8K tokens
    assert calibration_batch(FitConfig(seq_len=1024), wide, wide, kv_bytes=8 * 2**30) == 6
    assert calibration_batch(FitConfig(seq_len=1024), wide, wide, kv_bytes=64 * 2**30) == 8
    assert fit_module.batch_kv_bytes("cpu") == 3 * 2**30
    assert fit_module.memory_budget(FitConfig(), "cpu") is None


def test_on_cuda_the_batch_and_the_budget_share_the_free_memory(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(fit_module, "_free_bytes", lambda device: 40 * gib)
    assert fit_module.batch_kv_bytes("cuda") == 10 * gib  # a quarter of 40
    assert fit_module.memory_budget(FitConfig(), "cuda") == int(0.9 * 40 * gib) - 11 * gib
    monkeypatch.setattr(fit_module, "_free_bytes", lambda device: 8 * gib)
    assert fit_module.batch_kv_bytes("cuda") == 3 * gib  # never below 3 GiB
    assert fit_module.memory_budget(FitConfig(), "cuda") == 4 * gib  # at least half of what is free
    assert fit_module.memory_budget(FitConfig(memory_budget_gb=2), "cuda") == 2 * gib
