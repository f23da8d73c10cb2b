"""The evidence arms on tiny random models: each arm feeds the target what it says, and the controls
catch a map that ignores its input.

The bridge is the identity presented as fitted (method "fullhead"), so the default refresh runs and
translation only is exact: every arm's difference from native is then the arm's own doing.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from eval_items import VOCAB, choice_items, ppl_items
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import HandoffConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.cli import main
from bridgecache.evaluation import Variant, evaluate, summarise
from bridgecache.evaluation.arms import check_arms, chosen_columns, random_map, wrong_source_ids
from bridgecache.evaluation.metrics import arm_metrics, map_uses_input
from bridgecache.evaluation.prompts import Prompts
from bridgecache.evaluation.scoring import bridged_prefix, chosen_prefix, native_prefix, score
from bridgecache.kv.capture import capture_kv
from bridgecache.models.spec import model_spec

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", vocab_size=VOCAB, initializer_range=0.3)


def _fitted_identity(model):
    """The exact identity maps under a fitted method's name: the refresh and its rules run."""
    return dataclasses.replace(Bridge.identity(model), method="fullhead")


def _evaluate(model, tok, items, task, bridge=None, arms="all", config=None):
    variant = Variant(bridge or _fitted_identity(model), config or HandoffConfig(route="handoff"))
    ev = evaluate(model, tok, model, tok, items, task, [variant], progress=False, arms=arms)
    return ev, variant, summarise(ev, variant)


def test_every_arm_is_scored_and_the_exact_ones_equal_native(llama, tok):
    items = ppl_items(llama, tok, n=3)
    ev, variant, s = _evaluate(llama, tok, items, "ppl")
    assert s["arms"] == ["source_alone", "translation", "chosen_only", "wrong_document", "random_map"]
    for record in s["items"]:
        # the source alone is the target itself here; the identity translation is exact
        assert record["nll_source_alone"] == pytest.approx(record["nll_native"], abs=1e-4)
        assert record["nll_translation"] == pytest.approx(record["nll_native"], abs=1e-4)
        # a random map of the same shape is not the translation
        assert abs(record["nll_random_map"] - record["nll_translation"]) > 1e-2
        assert abs(record["nll_wrong_document"] - record["nll_translation"]) > 1e-2
    assert 0 < s["chosen_share"] < 1


def test_random_map_has_the_bridges_shape_and_statistics_but_other_weights(llama):
    bridge = _fitted_identity(llama)
    before = [layer.key_weight.clone() for layer in bridge.layers]
    drawn = random_map(bridge, seed=3)
    for old, new, kept in zip(bridge.layers, drawn.layers, before):
        assert new.key_weight.shape == old.key_weight.shape and torch.equal(new.inputs, old.inputs)
        assert torch.equal(new.key_bias, old.key_bias) and torch.equal(old.key_weight, kept)
        assert not torch.allclose(new.key_weight, old.key_weight)
        assert float(new.key_weight.std()) == pytest.approx(float(old.key_weight.std()), rel=0.1)
    assert torch.equal(random_map(bridge, seed=3).layers[0].value_weight, drawn.layers[0].value_weight)
    assert drawn.source == bridge.source and drawn.method == "fullhead"


def test_wrong_document_feeds_the_map_another_items_source_kv(llama, tok):
    items = choice_items(llama, tok, n=3)
    ev, variant, s = _evaluate(llama, tok, items, "choice", arms=["wrong_document"])
    result = ev.items[0]
    assert result.other_index == 1
    # rebuild it by hand: item 1's source ids, cut to item 0's length, translated only
    prompts = Prompts(tok, tok)
    own = prompts.context(items[0].context, variant.bridge)
    other = prompts.context(items[1].context, variant.bridge).source_ids
    wrong = wrong_source_ids(own.source_ids.shape[1], other)
    assert torch.equal(wrong[0, :5], other[0, :5]) and not torch.equal(wrong, own.source_ids)
    config = variant.config.replace(refresh=None, route="handoff")
    prefix = bridged_prefix(variant.bridge, capture_kv(llama, wrong), llama, own.target_ids, config=config)
    prompt = prompts.prompt(items[0])
    rows = [prompt + c for c in prompts.scored(items[0])]
    expected = score(llama, prefix, rows, len(prompt))
    for (got, n), (want, m) in zip(result.scores[f"wrong_document[{variant.name}]"], expected):
        assert got == pytest.approx(want, abs=1e-4) and n == m
    assert "acc_wrong_document" in s and "diff_translation_wrong_document" not in s  # no translation arm


def test_wrong_source_ids_repeat_a_short_document_and_cut_a_long_one():
    other = torch.tensor([[5, 6, 7]])
    assert wrong_source_ids(7, other).tolist() == [[5, 6, 7, 5, 6, 7, 5]]
    assert wrong_source_ids(2, other).tolist() == [[5, 6]]


def test_chosen_tokens_alone_compute_only_the_chosen_positions(llama, tok):
    ids = tok("the mast broke near the rocks and the crew rowed home", return_tensors="pt")["input_ids"]
    columns = torch.tensor([0, 4, 5, 9, ids.shape[1] - 1])
    lengths = []
    hook = llama.register_forward_pre_hook(
        lambda _, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        prefix = chosen_prefix(llama, ids, columns)
    finally:
        hook.remove()
    assert lengths == [5] and prefix.cache.get_seq_length() == 5 and prefix.length == ids.shape[1]
    # the same as one forward of those tokens at their own positions
    with torch.no_grad():
        logits = llama(input_ids=ids[:, columns], position_ids=columns[None]).logits[:, -1]
    assert torch.allclose(prefix.last_logits, logits.float(), atol=1e-5)
    # what follows sits after the whole context: at position T, not at the cache's length
    row = tok(" and slept", add_special_tokens=False)["input_ids"]
    got = score(llama, prefix, [row])[0][0]
    with torch.no_grad():
        positions = torch.cat([columns, torch.arange(ids.shape[1], ids.shape[1] + len(row) - 1)])
        full = torch.cat([ids[:, columns], torch.tensor([row[:-1]])], dim=1)
        logprobs = torch.log_softmax(
            llama(input_ids=full, position_ids=positions[None]).logits[0].float(), -1
        )
    want = sum(float(logprobs[len(columns) - 1 + t, c]) for t, c in enumerate(row))
    assert got == pytest.approx(want, abs=1e-4)
    # every column: the native prefix itself
    everything = chosen_prefix(llama, ids, torch.arange(ids.shape[1]))
    assert torch.allclose(everything.last_logits, native_prefix(llama, ids).last_logits, atol=1e-5)


def test_chosen_columns_are_the_defaults_own_work(llama, tok):
    bridge = _fitted_identity(llama)
    ids = tok("the mast broke near the rocks and the crew rowed home", return_tensors="pt")["input_ids"]
    prompt = torch.tensor([tok(" what broke", add_special_tokens=False)["input_ids"]])
    config = HandoffConfig(route="handoff", native_tail=2)
    prefix = bridged_prefix(
        bridge, capture_kv(llama, ids), llama, ids, config=config, source_model=llama, prompt_ids=prompt
    )
    columns = chosen_columns(prefix.cache, ids.shape[1]).tolist()
    refreshed = prefix.cache.refreshed_columns[0].tolist()
    translated = prefix.cache.translated_positions
    T = ids.shape[1]
    assert 0 in columns and T - 1 in columns and T - 2 in columns and T - 3 in columns  # head, tail, last
    assert set(refreshed) <= set(columns) and len(refreshed) > 0
    assert set(columns) == set(refreshed) | {c for c in range(T) if c not in translated}


def test_a_map_that_ignores_its_input_fails_the_controls(llama, tok):
    items = ppl_items(llama, tok, n=6)
    _, _, good = _evaluate(llama, tok, items, "ppl", arms=["translation", "wrong_document", "random_map"])
    assert good["map_uses_input"] is True  # the exact map reads its document
    assert good["diff_translation_wrong_document_ci"][0] > 0
    ignoring = _fitted_identity(llama)
    for layer in ignoring.layers:  # only the biases are left: the same cache whatever it reads
        layer.key_weight.zero_()
        layer.value_weight.zero_()
    _, _, bad = _evaluate(
        llama, tok, items, "ppl", bridge=ignoring, arms=["translation", "wrong_document", "random_map"]
    )
    assert bad["map_uses_input"] is False
    assert bad["diff_translation_wrong_document"] == pytest.approx(0.0, abs=1e-6)


def test_gap_recovered_and_paired_differences():
    right = {
        "native": [1, 1, 1, 1, 0, 1, 1, 1],
        "source_alone": [0, 0, 1, 0, 0, 0, 1, 0],
        "bridged": [1, 0, 1, 1, 0, 1, 1, 0],
        "chosen_only": [0, 0, 1, 0, 0, 1, 1, 0],
    }
    out = arm_metrics(lambda arm, ix: sum(right[arm][i] for i in ix) / len(ix), list(right), 8)
    # native 7/8, source 2/8, handoff 5/8: (5 - 2) / (7 - 2)
    assert out["gap_recovered"] == pytest.approx(0.6)
    lo, hi = out["gap_recovered_ci"]
    assert lo <= 0.6 <= hi
    assert out["diff_bridged_chosen_only"] == pytest.approx(2 / 8)
    assert "diff_translation_random_map" not in out
    weaker = dict(right, native=right["source_alone"])  # no gap: nothing to recover
    assert math.isnan(
        arm_metrics(lambda a, ix: sum(weaker[a][i] for i in ix) / len(ix), list(weaker), 8)["gap_recovered"]
    )
    assert map_uses_input({}) is None
    assert (
        map_uses_input(
            {"diff_translation_wrong_document_ci": [0.1, 0.3], "diff_translation_random_map_ci": [0.0, 0.2]}
        )
        is False
    )


def test_choice_task_reports_the_arms_in_the_summary_and_table(llama, tok):
    from bridgecache.evaluation import format_table

    items = choice_items(llama, tok, n=3)
    _, _, s = _evaluate(llama, tok, items, "choice")
    for arm in ("source_alone", "translation", "chosen_only", "wrong_document", "random_map"):
        assert f"acc_{arm}" in s and all(f"pick_{arm}" in r for r in s["items"])
    assert s["acc_source_alone"] == s["acc_native"] and s["acc_translation"] == s["acc_native"]
    table = format_table(s)
    assert "(s) source alone" in table and "(k) chosen tokens alone" in table
    assert "translation - wrong_document" in table


def test_arms_are_checked_before_any_model_runs():
    with pytest.raises(ValueError, match="unknown arm 'sauce'"):
        check_arms(["sauce"], "choice", True, False)
    with pytest.raises(ValueError, match="generation"):
        check_arms(["translation"], "generate", True, False)
    with pytest.raises(ValueError, match="one tokenizer"):
        check_arms(["source_alone"], "ppl", False, False)
    assert check_arms("all", "ppl", False, False) == (
        "translation",
        "chosen_only",
        "wrong_document",
        "random_map",
    )
    assert check_arms(None, "generate", True, False) == ()


def test_cli_arms_flag(tmp_path, llama, tok, capsys):
    import json

    model_dir = tmp_path / "tiny-llama"
    llama.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    bridge = dataclasses.replace(
        Bridge.identity(model_spec(llama, tok, name=str(model_dir))), method="fullhead"
    )
    bridge.save_pretrained(tmp_path / "bridge")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(vars(item)) + "\n" for item in choice_items(llama, tok, n=3)))
    argv = [
        "eval",
        "--bridge",
        str(tmp_path / "bridge"),
        "--data",
        str(data),
        "--task",
        "choice",
        "--no-progress",
    ]
    assert main([*argv, "--arms", "translation", "chosen_only", "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["arms"] == ["translation", "chosen_only"] and "acc_chosen_only" in result
    assert main([*argv, "--arms", "sauce"]) == 2
    assert "unknown arm 'sauce'" in capsys.readouterr().err


def test_rows_sharing_a_question_score_as_each_row_alone(llama, tok):
    ids = tok("the mast broke near the rocks", return_tensors="pt")["input_ids"]
    question = tok("\nQuestion: what broke\nAnswer:", add_special_tokens=False)["input_ids"]
    rows = [
        question + tok(c, add_special_tokens=False)["input_ids"] for c in (" the mast", " a sail", " oar")
    ]
    together = score(llama, native_prefix(llama, ids), rows, len(question))
    alone = [score(llama, native_prefix(llama, ids), [row], len(question))[0] for row in rows]
    for (a, n), (b, m) in zip(together, alone):
        assert a == pytest.approx(b, abs=1e-4) and n == m
    # and after a cache that left positions out (the chosen-tokens arm)
    columns = torch.tensor([0, 3, ids.shape[1] - 1])
    together = score(llama, chosen_prefix(llama, ids, columns), rows, len(question))
    alone = [score(llama, chosen_prefix(llama, ids, columns), [row], len(question))[0] for row in rows]
    for (a, _), (b, _) in zip(together, alone):
        assert a == pytest.approx(b, abs=1e-4)
