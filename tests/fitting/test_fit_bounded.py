"""A fit's memory is bounded by a budget, its time is reported per phase, and nothing finished is
lost: statistics in several passes equal one pass, probes over the budget are refused before the
statistics, a failing held-out scoring leaves a usable bridge, `--out` never writes over a folder
of something else."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import Bridge
from bridgecache.cli import main
from bridgecache.fitting import FitConfig, fit_bridge, heldout
from bridgecache.fitting import fit as fit_module
from bridgecache.fitting.calibration import calibration_sequences
from bridgecache.fitting.core import LayerAccumulator
from bridgecache.fitting.gram import SharedGram
from bridgecache.fitting.phases import PhaseClock
from bridgecache.fitting.support import full_inputs
from bridgecache.models import zoo

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(num_sequences=4, seq_len=20, heldout_every=2, probe_subset=2)


@pytest.fixture(scope="module")
def pair():
    return tiny_model("qwen2", seed=0), tiny_model("llama", seed=1), byte_tokenizer()


def _shared_bytes(pair) -> int:
    """Full-Head's shared statistics of one target layer reading two source layers (2 splits x K, V)."""
    source, target, _ = pair
    width = source.config.num_key_value_heads * source.config.hidden_size // source.config.num_attention_heads
    return 4 * SharedGram.bytes_of(
        {0: [0, 1]}, width, target.config.num_key_value_heads * target.config.head_dim
    )


def _layer_bytes(method_config, pair) -> int:
    """The statistics of one target layer of the fit (fullhead, k source layers)."""
    source, target, _ = pair
    hs, ds = source.config.num_key_value_heads, source.config.hidden_size // source.config.num_attention_heads
    inputs = full_inputs([[0, 1]], hs, target.config.num_key_value_heads)[0]
    acc = LayerAccumulator(0, inputs, hs, ds, target.config.head_dim, False, "meta")
    return sum(t.nbytes for t in acc.buffers())


@pytest.mark.parametrize(
    "method,precision", [("fullhead", "tf32x3"), ("fullhead", "tf32"), ("cachebridge", "tf32x3")]
)  # fullhead at tf32x3: the shared blocks (bridgecache.fitting.gram); else the per-layer accumulators
def test_statistics_in_several_passes_equal_one_pass(pair, method, precision):
    source, target, tok = pair
    base = FitConfig(method=method, layers_k=2, stats_precision=precision, **SMALL)
    one = fit_bridge(source, target, tok, tok, base, progress=False)
    if method == "cachebridge":
        per_layer = 4096
    else:
        per_layer = _shared_bytes(pair) if precision == "tf32x3" else _layer_bytes(base, pair)
    clock = PhaseClock()
    slack = 0 if precision == "tf32x3" and method == "fullhead" else 200_000  # shared blocks: add little
    budget = dict(memory_budget_gb=(1.3 * per_layer + slack) / 2**30)  # about one layer a pass
    several = fit_bridge(source, target, tok, tok, base.replace(**budget), progress=False, clock=clock)
    assert one.calibration["statistics_passes"] == 1
    assert (
        several.calibration["statistics_passes"] > 1
        and clock.passes == 1 + several.calibration["statistics_passes"]
    )
    assert "memory_budget_gb" not in several.calibration["recipe"]  # it changes no map
    for a, b in zip(one.layers, several.layers):
        for name in ("key_weight", "key_bias", "value_weight", "value_bias"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    report = clock.report()
    for phase in ("forwards", "probes", "statistics", "solve", "scoring"):
        assert report[phase]["s"] > 0, phase
    assert report["forwards"]["tokens_per_s"] > 0


def test_probes_over_the_budget_are_refused_before_the_statistics(pair, monkeypatch):
    source, target, tok = pair
    accumulated = []
    monkeypatch.setattr(LayerAccumulator, "add", lambda self, seq: accumulated.append(seq))
    with pytest.raises(MemoryError, match=r"layer probes: \d+ rows so far need .* over the memory budget"):
        fit_bridge(source, target, tok, tok, FitConfig(memory_budget_gb=1e-6, **SMALL), progress=False)
    assert accumulated == []
    with pytest.raises(MemoryError, match=r"target layer 0's statistics need .* raise memory_budget_gb"):
        fit_bridge(
            source, target, tok, tok,
            FitConfig(memory_budget_gb=1e-6, layer_support="depth", **SMALL), progress=False,
        )  # fmt: skip


def test_a_failing_held_out_scoring_leaves_a_usable_bridge(pair, monkeypatch, tmp_path):
    source, target, tok = pair

    def broken(*args, **kwargs):
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(heldout, "attention_cosine", broken)
    with pytest.warns(RuntimeWarning, match=r"the bridge is fitted, but its held-out scoring failed"):
        bridge = fit_bridge(source, target, tok, tok, FitConfig(**SMALL), progress=False)
    assert "heldout_scores" not in bridge.calibration
    assert "same device" in bridge.calibration["heldout_scores_error"]
    bridge.save_pretrained(tmp_path / "b")
    loaded = Bridge.from_pretrained(tmp_path / "b")
    assert torch.equal(loaded.layers[0].key_weight, bridge.layers[0].key_weight)


def test_the_held_out_scores_come_from_the_fits_own_sequences(pair):
    source, target, tok = pair
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bridge = fit_bridge(source, target, tok, tok, FitConfig(**SMALL), progress=False)
    scores = bridge.calibration["heldout_scores"]
    assert scores["sequences"] == 2 and len(scores["attention_cosine"]) == target.config.num_hidden_layers
    assert heldout.score_bridge(bridge, source, target, tok, tok, progress=False) == scores  # from the recipe


def test_the_scoring_reads_score_sequences_spread_over_the_held_out_ones(pair, monkeypatch, tmp_path):
    source, target, tok = pair
    read = []
    original = heldout.attention_cosine

    def recording(bridge, source, target, contexts, **kwargs):
        read.extend(ids.tolist() for _, ids, _ in contexts)
        return original(bridge, source, target, contexts, **kwargs)

    monkeypatch.setattr(heldout, "attention_cosine", recording)
    config = FitConfig(**{**SMALL, "num_sequences": 12}, score_sequences=2)  # 6 held out
    bridge = fit_bridge(source, target, tok, tok, config, progress=False)
    scores = bridge.calibration["heldout_scores"]
    assert (scores["sequences"], scores["heldout_sequences"]) == (2, 6)
    assert "score_sequences" not in bridge.calibration["recipe"]  # changes no map
    # of the 6 held-out sequences, the first and the fourth
    seqs, _ = calibration_sequences(tok, tok, 12, SMALL["seq_len"], heldout_every=2)
    held = [s.target_ids.tolist() for s in seqs if s.heldout]
    assert read == [[held[0]], [held[3]]]
    bridge.save_pretrained(tmp_path / "b")
    assert Bridge.from_pretrained(tmp_path / "b").calibration["heldout_scores"] == scores
    assert heldout.spread(62, 16)[:3] == [0, 4, 8] and len(heldout.spread(62, 16)) == 16
    assert heldout.spread(3, 16) == [0, 1, 2] and heldout.spread(5, None) == [0, 1, 2, 3, 4]


def test_seq_len_beyond_the_window_is_refused_before_any_forward(pair, monkeypatch):
    source, target, tok = pair

    def no_forward(*args, **kwargs):
        raise AssertionError("a model ran although seq_len is beyond its window")

    monkeypatch.setattr(fit_module, "paired_kv", no_forward)
    with pytest.raises(ValueError, match=r"seq_len is 513; expected at most .*context window of 512 tokens"):
        fit_bridge(source, target, tok, tok, FitConfig(num_sequences=2, seq_len=513))


@pytest.mark.parametrize("other", ["README.md", "config.json"])
def test_out_holding_something_else_is_refused(tmp_path, capsys, monkeypatch, other):
    monkeypatch.setattr(zoo, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    out = tmp_path / "folder"
    out.mkdir()
    (out / other).write_text("the user's own file")
    argv = ["fit", "--source", "smollm2-135m", "--target", "smollm2-135m", "--out", str(out)]
    assert main(argv) == 2
    assert f"--out: {out} holds other files ({other}), not a bridge" in capsys.readouterr().err
    assert (out / other).read_text() == "the user's own file"
