"""Evaluation metrics on hand-made numbers, and clear errors for malformed data files."""

from __future__ import annotations

import json
import math

import pytest

from bridgecache.evaluation.data import data_task, load_items
from bridgecache.evaluation.items import ChoiceItem, DataFormatError, PplItem, read_jsonl
from bridgecache.evaluation.metrics import (
    bootstrap_ci,
    choice_metrics,
    gain_recovered,
    mean_nll,
    pick_choice,
    ppl_metrics,
)


def test_mean_nll_pools_tokens_across_items():
    # pooled over tokens, not a mean of per-item means (1.0 and 1.0 -> 1.0; 1.0 and 3.0 -> 2.0)
    assert mean_nll([10.0, 30.0], [10, 30]) == pytest.approx(1.0)
    assert mean_nll([10.0, 30.0], [10, 10]) == pytest.approx(2.0)
    assert math.isnan(mean_nll([], []))


def test_gain_recovered_signs_and_undefined_cases():
    assert gain_recovered(4.0, 3.0, 2.0) == pytest.approx(0.5)
    assert gain_recovered(4.0, 2.0, 2.0) == pytest.approx(1.0)
    assert gain_recovered(4.0, 1.5, 2.0) == pytest.approx(1.25)  # bridged beat native
    assert gain_recovered(4.0, 5.0, 2.0) == pytest.approx(-0.5)  # bridged hurt
    assert math.isnan(gain_recovered(2.0, 1.0, 2.0))  # the context did not help natively
    assert math.isnan(gain_recovered(1.0, 1.0, 2.0))


def test_ppl_metrics_on_hand_made_numbers():
    tokens = [10, 10]
    nll = {
        "native": [20.0, 20.0],  # 2.0 per token
        "bridged": [25.0, 25.0],  # 2.5
        "no_context": [40.0, 40.0],  # 4.0
        "other_native": [30.0, 30.0],  # 3.0
        "other_bridged": [35.0, 35.0],  # 3.5
    }
    m = ppl_metrics(nll, tokens)
    assert m["nll_native"] == pytest.approx(2.0) and m["ppl_native"] == pytest.approx(math.exp(2.0))
    assert m["ppl_other_bridged"] == pytest.approx(math.exp(3.5))
    assert m["context_gain_recovered"] == pytest.approx((4.0 - 2.5) / (4.0 - 2.0))
    assert m["content_gain_recovered"] == pytest.approx((3.0 - 2.5) / (3.0 - 2.0))
    lo, hi = m["context_gain_recovered_ci"]
    assert lo == pytest.approx(0.75) and hi == pytest.approx(0.75)  # identical items: no spread


def test_gain_is_a_ratio_of_log_likelihoods_not_of_perplexities():
    m = ppl_metrics({"native": [10.0], "bridged": [20.0], "no_context": [40.0], "other_native": [30.0]}, [10])
    ppl_ratio = (m["ppl_no_context"] - m["ppl_bridged"]) / (m["ppl_no_context"] - m["ppl_native"])
    assert m["context_gain_recovered"] == pytest.approx(2 / 3)
    assert ppl_ratio > 0.9  # the perplexity ratio would flatter the same bridge


def test_choice_rule_is_length_normalised_with_ties_to_the_lowest_index():
    assert pick_choice([-6.0, -4.0], [3, 1]) == 0  # means -2 vs -4; raw sums would pick 1
    assert pick_choice([-2.0, -4.0, -1.0], [2, 4, 1]) == 0  # -1, -1, -1: a three-way tie
    assert pick_choice([-3.0, -1.0], [1, 1]) == 1


def test_choice_metrics_on_hand_made_picks():
    answers = [0, 1, 2, 0]
    picks = {
        "native": [0, 1, 2, 1],  # 3/4
        "bridged": [0, 1, 0, 1],  # 2/4
        "no_context": [1, 1, 1, 1],  # 1/4
        "other_native": [2, 2, 2, 2],  # 1/4
    }
    m = choice_metrics(picks, answers, [4, 4, 4, 4])
    assert m["acc_native"] == 0.75 and m["acc_bridged"] == 0.5 and m["acc_no_context"] == 0.25
    assert m["retention"] == pytest.approx(2 / 3)
    assert m["chance"] == pytest.approx(0.25)
    assert m["retention_above_chance"] == pytest.approx((0.5 - 0.25) / (0.75 - 0.25))
    lo, hi = m["retention_ci"]
    assert lo <= m["retention"] <= hi


def test_retention_is_undefined_when_native_never_answers():
    m = choice_metrics(
        {c: [1, 1] for c in ("native", "bridged", "no_context", "other_native")}, [0, 0], [2, 2]
    )
    assert math.isnan(m["retention"]) and math.isnan(m["retention_above_chance"])


def test_bootstrap_is_seeded_and_brackets_the_mean():
    values = [0.1, 0.9, 0.4, 0.6, 0.5, 0.3]
    mean = lambda ix: sum(values[i] for i in ix) / len(ix)  # noqa: E731
    first, second = bootstrap_ci(len(values), mean), bootstrap_ci(len(values), mean)
    assert first == second
    assert first[0] < sum(values) / len(values) < first[1]
    assert all(math.isnan(x) for x in bootstrap_ci(1, mean))


# ---------------------------------------------------------------------- data files


def _write(tmp_path, lines, name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_valid_files_read_into_items(tmp_path):
    ppl = _write(
        tmp_path,
        [{"context": "a b", "continuation": " c", "extra": 1}, "", {"context": "d", "continuation": "e"}],
    )
    assert read_jsonl(ppl, "ppl") == [PplItem("a b", " c"), PplItem("d", "e")]
    choice = _write(
        tmp_path, [{"context": "x", "question": "q?", "choices": ["a", "b"], "answer": 1}], "c.jsonl"
    )
    assert read_jsonl(choice, "choice") == [ChoiceItem("x", "q?", ("a", "b"), 1)]
    assert load_items(ppl, "ppl", limit=1) == ("ppl", [PplItem("a b", " c")])


@pytest.mark.parametrize(
    "lines,task,message",
    [
        (['{"context": "a", "continuation": "b"}', "{not json"], "ppl", ":2: not valid JSON"),
        ([{"context": "a"}], "ppl", "field 'continuation' is missing"),
        ([{"context": "", "continuation": "b"}], "ppl", "field 'context' must be a non-empty string"),
        ([[1, 2]], "ppl", "expected a JSON object, got list"),
        ([{"context": "a", "question": "q", "choices": ["x"], "answer": 0}], "choice", "at least 2"),
        ([{"context": "a", "question": "q", "choices": ["x", "y"], "answer": 2}], "choice", "'answer' is 2"),
        (
            [{"context": "a", "question": "q", "choices": ["x", "y"], "answer": True}],
            "choice",
            "integer index",
        ),
        (
            [{"context": "a", "question": "q", "choices": ["x", "x"], "answer": 0}],
            "choice",
            "same string twice",
        ),
        ([{"context": "a", "question": "q", "choices": ["x", 3], "answer": 0}], "choice", "choices[1]"),
        ([""], "ppl", "no items"),
    ],
)
def test_malformed_files_name_the_line_and_field(tmp_path, lines, task, message):
    path = _write(tmp_path, lines)
    with pytest.raises(DataFormatError, match="data.jsonl") as err:
        read_jsonl(path, task)
    assert message in str(err.value)


def test_task_and_builtin_names_are_checked(tmp_path):
    assert data_task("builtin:facts-choice-1024", None) == "choice"
    assert data_task("builtin:code-ppl", "ppl") == "ppl"
    with pytest.raises(DataFormatError, match="is a 'choice' task"):
        data_task("builtin:facts-choice", "ppl")
    with pytest.raises(DataFormatError, match="unknown built-in task"):
        data_task("builtin:poems-ppl", None)
    with pytest.raises(DataFormatError, match="outside 64..8192"):
        data_task("builtin:prose-ppl-10", None)
    with pytest.raises(DataFormatError, match="--task"):
        data_task(str(tmp_path / "x.jsonl"), None)
    with pytest.raises(DataFormatError, match="no data file"):
        read_jsonl(tmp_path / "missing.jsonl", "ppl")
