"""`bridgecache eval` on tiny random models: exact through an identity bridge, scored like a plain
forward pass, sensitive to a damaged bridge, honest about long items, and the CLI end to end.

Data are made so that the context matters even to a random model: each continuation (or right
answer) is the model's own greedy continuation of its context, so native prefill gives it a high
likelihood and no context / another context a lower one; the gain ratios are then defined.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from eval_items import VOCAB, choice_items, contexts, greedy, ppl_items
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import HandoffConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.cli import main
from bridgecache.evaluation import EvaluationError, PplItem, Variant, evaluate, summarise
from bridgecache.evaluation.builtin import CONTINUATION_TOKENS, builtin_items
from bridgecache.evaluation.prompts import Prompts
from bridgecache.models.spec import model_spec
from bridgecache.text import documents

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


# Larger initial weights than the default 0.02 make the random models' predictions peaked, so
# their own greedy continuation depends clearly on the context (NLL gaps of ~1-4 nats, not ~0.1).
@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", vocab_size=VOCAB, initializer_range=0.3)


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3", vocab_size=VOCAB, initializer_range=0.3)  # sliding window 8 < contexts


def _run(model, tok, items, task, bridge=None, **kwargs):
    variant = Variant(bridge or Bridge.identity(model), HandoffConfig(native_head=1, refresh=None))
    ev = evaluate(model, tok, model, tok, items, task, [variant], progress=False, **kwargs)
    return ev, summarise(ev, variant)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_identity_bridge_recovers_all_of_the_gain(family, tok, request):
    model = request.getfixturevalue(family)
    items = ppl_items(model, tok)
    ev, s = _run(model, tok, items, "ppl")
    for record in s["items"]:
        assert record["nll_bridged"] == pytest.approx(record["nll_native"], abs=1e-4)
        assert record["nll_other_bridged"] == pytest.approx(record["nll_other_native"], abs=1e-4)
    # The data make the context matter, so both ratios are defined, and an exact bridge gets 1.
    assert s["nll_no_context"] > s["nll_native"] + 0.1 and s["nll_other_native"] > s["nll_native"] + 0.1
    assert s["context_gain_recovered"] == pytest.approx(1.0, abs=1e-3)
    assert s["content_gain_recovered"] == pytest.approx(1.0, abs=1e-3)
    assert s["n"] == 3 and s["skipped"] == 0 and s["handoff_s"] > 0 and s["native_prefill_s"] > 0
    assert [r["other_index"] for r in s["items"]] == [1, 2, 0]


def test_native_nll_equals_one_plain_forward_pass(llama, tok):
    items = ppl_items(llama, tok, n=2)
    _, s = _run(llama, tok, items, "ppl")
    for item, record in zip(items, s["items"]):
        ctx = tok(item.context)["input_ids"]
        cont = tok(item.continuation, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logprobs = torch.log_softmax(llama(ids).logits[0].float(), -1)
        expected = -sum(float(logprobs[len(ctx) - 1 + t, c]) for t, c in enumerate(cont))
        assert record["nll_native"] == pytest.approx(expected, abs=1e-3)
        assert record["tokens"] == len(cont)
        bare = torch.tensor([[tok.bos_token_id] + cont])  # no context: BOS, then the continuation
        with torch.no_grad():
            logprobs = torch.log_softmax(llama(bare).logits[0].float(), -1)
        expected = -sum(float(logprobs[t, c]) for t, c in enumerate(cont))
        assert record["nll_no_context"] == pytest.approx(expected, abs=1e-3)


def test_a_damaged_bridge_loses_gain_and_the_metrics_say_so(llama, tok):
    bridge = Bridge.identity(llama)
    for layer in bridge.layers:
        layer.value_weight.mul_(0.0)  # values carry nothing
    _, s = _run(llama, tok, ppl_items(llama, tok), "ppl", bridge=bridge)
    assert s["nll_bridged"] > s["nll_native"] + 0.05
    assert s["context_gain_recovered"] < 0.95 and s["content_gain_recovered"] < 0.95


def test_key_norm_variants_are_scored_apart_and_the_projection_repairs_short_keys(gemma, tok):
    bridge = dataclasses.replace(Bridge.identity(gemma), method="fullhead")  # fitted: projected
    for layer in bridge.layers:
        layer.key_weight.mul_(0.1)  # keys 10x too short: flatter attention over the context
    config = HandoffConfig(native_head=1, refresh=None)
    variants = [Variant(bridge, config), Variant(bridge, config.replace(key_norm=False))]
    ev = evaluate(gemma, tok, gemma, tok, ppl_items(gemma, tok), "ppl", variants, progress=False)
    projected, plain = (summarise(ev, v) for v in variants)
    assert "key_norm=False" in variants[1].name and (projected["key_norm"], plain["key_norm"]) == (
        True,
        False,
    )
    exact_error = abs(projected["nll_bridged"] - projected["nll_native"])  # Gemma 3's k_norm undoes it
    plain_error = abs(plain["nll_bridged"] - plain["nll_native"])
    assert exact_error < 1e-5 and plain_error > 10 * exact_error


def test_choice_through_an_identity_bridge_keeps_every_pick(gemma, tok):
    items = choice_items(gemma, tok)
    ev, s = _run(gemma, tok, items, "choice")
    for result in ev.items:
        native, bridged = result.scores["native"], result.scores[f"bridged[{ev.variants[0].name}]"]
        assert [n for _, n in native] == [n for _, n in bridged]
        assert [x for x, _ in bridged] == pytest.approx([x for x, _ in native], abs=1e-3)
    assert s["acc_native"] > 0.5 and s["acc_bridged"] == s["acc_native"] and s["retention"] == 1.0
    assert s["chance"] == pytest.approx(1 / 3)


def test_choice_records_name_the_refreshed_columns_of_each_arm(llama, tok):
    from tiny_models import random_bridge

    from bridgecache import RefreshConfig

    items = choice_items(llama, tok)
    bridge = random_bridge(llama)
    fixed = Variant(bridge, HandoffConfig(refresh=RefreshConfig(3, "deviation", whole_words=False)))
    sized = Variant(
        bridge,
        HandoffConfig(
            refresh=RefreshConfig(0.9, "deviation", whole_words=False, mass=0.01, floor=2), route="handoff"
        ),
    )  # the handoff: FLOPs at a 90% cap would route to the target's own prefill
    ev = evaluate(llama, tok, llama, tok, items, "choice", [fixed, sized], progress=False)
    for record in summarise(ev, fixed)["items"]:
        assert len(set(record["refreshed"])) == 3
    for record in summarise(ev, sized)["items"]:  # 1% of the mass: its floor
        assert len(set(record["refreshed"])) == 2


def test_chat_mode_reads_each_part_through_the_template_and_stays_exact(llama):
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    items = [PplItem(c, " " + greedy(llama, tok, c, 8)) for c in contexts(3, 30)]
    prompts = Prompts(tok, tok, chat=True)
    context = prompts.context(items[0].context, Bridge.identity(llama))
    assert tok.decode(context.target_ids[0]) == f"<s>user: {items[0].context}</s>\n"
    assert tok.decode(prompts.prompt(items[0])) == "<s>user: Continue the text.</s>\n<s>assistant: "
    assert tok.decode(prompts.bare(items[0])) == "<s>user: Continue the text.</s>\n<s>assistant: "
    assert tok.decode(prompts.scored(items[0])[0]) == items[0].continuation.lstrip()
    _, s = _run(llama, tok, items, "ppl", chat=True)
    assert s["nll_bridged"] == pytest.approx(s["nll_native"], abs=1e-4)
    assert s["nll_other_bridged"] == pytest.approx(s["nll_other_native"], abs=1e-4)


def test_items_longer_than_a_window_are_skipped_and_counted(llama, tok):
    items = ppl_items(llama, tok, n=3)
    items.insert(1, PplItem("x" * 600, " tail"))  # 601 tokens > the tiny model's 512 positions
    messages = []
    ev, s = _run(llama, tok, items, "ppl", log=messages.append)
    assert s["n"] == 3 and s["skipped"] == 1 and [r.index for r in ev.items] == [0, 2, 3]
    assert "item 1" in messages[0] and "window of 512" in messages[0]
    assert ev.items[0].other_index == 2  # the control skips the skipped item too
    with pytest.raises(EvaluationError, match="0 of 2 items fit"):
        _run(llama, tok, [items[1], items[1]], "ppl")


def test_the_unrelated_context_is_cut_to_the_same_target_length(tok):
    prompts = Prompts(tok, tok)
    text = "one two three four five six"
    cut = prompts.cut(text, 7)
    assert cut == "one two" and prompts.content_length(cut) == 7
    assert prompts.cut(text, 100) == text


# ---------------------------------------------------------------------- built-in tasks


def test_builtin_ppl_windows_are_sized_disjoint_and_from_the_eval_split(tok):
    items = builtin_items("prose-ppl-256", tok, limit=6)
    assert len(items) == 6
    for item in items:
        assert len(tok(item.context)["input_ids"]) == 256
        assert len(tok(item.continuation, add_special_tokens=False)["input_ids"]) == CONTINUATION_TOKENS
    for a in items:  # no continuation can be read off another item's context
        assert all(a.continuation[:60] not in b.context for b in items)
    eval_text = "\n\n".join(t for _, t in documents("prose", "eval"))
    calib_text = "\n\n".join(t for _, t in documents("prose", "calib"))
    probe = items[2].context[:120]
    assert probe in eval_text and probe not in calib_text
    assert builtin_items("prose-ppl-256", tok, limit=6) == items  # seeded


def test_builtin_fact_questions_are_answerable_only_from_their_context(tok):
    items = builtin_items("facts-choice-512", tok, limit=6)
    assert items == builtin_items("facts-choice-512", tok, limit=6)
    for item in items:
        assert len(item.choices) == 5 and len(set(item.choices)) == 5
        answer = item.choices[item.answer]
        fact = [line for line in item.context.split("\n") if answer in line and line.endswith(".")]
        assert fact, "the answer is stated in the context"
        in_context = [c for c in item.choices if c in item.context]
        assert len(in_context) >= 3  # distractors of the same kind are stated too (about others)
        assert abs(len(tok(item.context)["input_ids"]) - 512) < 40
    assert len({item.question for item in items}) == 6


# ---------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def saved(tmp_path_factory, llama, tok):
    """A tiny model + tokenizer directory, its identity bridge, and a ppl data file."""
    root = tmp_path_factory.mktemp("eval_cli")
    model_dir = root / "tiny-llama"
    llama.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    bridge = Bridge.identity(model_spec(llama, tok, name=str(model_dir)))
    bridge.save_pretrained(root / "bridge")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(vars(item)) + "\n" for item in ppl_items(llama, tok)))
    return root


def test_cli_end_to_end_writes_the_json_and_prints_the_table(saved, capsys):
    out = saved / "result.json"
    argv = ["eval", "--bridge", str(saved / "bridge"), "--data", str(saved / "data.jsonl"), "--task", "ppl"]
    assert main([*argv, "--json", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "(e) bridged, unrelated context" in printed and "pays only when the source has read" in printed
    result = json.loads(out.read_text())
    for key in (
        "task",
        "n",
        "source",
        "target",
        "method",
        "native_prefill_s",
        "handoff_s",
        "source_prefill_s",
    ):
        assert key in result
    for c in ("native", "bridged", "no_context", "other_native", "other_bridged"):
        assert result[f"ppl_{c}"] == pytest.approx(math.exp(result[f"nll_{c}"]))
    assert result["task"] == "ppl" and result["n"] == 3 and result["method"] == "identity"
    assert result["source"] == result["target"] == "tiny-llama"
    assert result["nll_bridged"] == pytest.approx(result["nll_native"], abs=1e-4)
    assert result["context_gain_recovered"] == pytest.approx(1.0, abs=1e-3)


def test_cli_runs_a_builtin_task_with_native_anchor_options(saved, capsys):
    out = saved / "facts.json"
    argv = ["eval", "--bridge", str(saved / "bridge"), "--data", "builtin:facts-choice-256", "--limit", "3"]
    assert main([*argv, "--native-head", "2", "--native-tail", "3", "--json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["task"] == "choice" and result["n"] == 3
    assert result["native_head"] == 2 and result["native_tail"] == 3
    assert result["acc_bridged"] == result["acc_native"]
    assert "retention" in capsys.readouterr().out


def test_cli_reports_data_errors_in_one_line(saved, capsys):
    bad = saved / "bad.jsonl"
    bad.write_text('{"context": "a", "continuation": "b"}\n{"context": "a"}\n')
    argv = ["eval", "--bridge", str(saved / "bridge"), "--data", str(bad), "--task", "ppl"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2: field 'continuation' is missing" in err and "Traceback" not in err
    assert main(["eval", "--bridge", str(saved / "nowhere"), "--data", str(bad), "--task", "ppl"]) == 2
    assert "no bridge metadata" in capsys.readouterr().err
    assert (
        main(["eval", "--bridge", str(saved / "bridge"), "--data", "builtin:facts-choice", "--task", "ppl"])
        == 2
    )


def test_the_eval_command_is_registered(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "--native-tail" in capsys.readouterr().out


def test_control_scores_are_remembered_per_target_and_ids(tmp_path):
    import os

    from tiny_models import tiny_model

    from bridgecache.evaluation.controls import ControlScores

    model, other = tiny_model("qwen2"), tiny_model("qwen2", seed=1)
    path = tmp_path / "controls.json"
    controls = ControlScores(path)
    key = controls.key(model, torch.tensor([[1, 2, 3]]), [[4, 5]])
    assert controls.get(key) is None
    controls.put(key, {"native": [[-1.5, 2]], "native_prefill_s": 0.1})
    again = ControlScores(path)  # a later run reads the file
    assert again.get(again.key(model, torch.tensor([[1, 2, 3]]), [[4, 5]]))["native"] == [[-1.5, 2]]
    assert again.get(again.key(other, torch.tensor([[1, 2, 3]]), [[4, 5]])) is None  # other weights
    assert again.get(again.key(model, torch.tensor([[1, 2, 4]]), [[4, 5]])) is None  # other ids
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask
    path.write_text("{not json")  # not ours (a user's file?): refused, never read or overwritten
    with pytest.raises(ValueError, match="is not a bridgecache controls file"):
        ControlScores(path)


def test_a_second_run_reads_the_controls_and_scores_the_same(llama, tok, tmp_path):
    from bridgecache.evaluation.runner import ControlScores, Variant

    bridge = Bridge.identity(llama)
    items = choice_items(llama, tok)
    plain = HandoffConfig(refresh=None)
    variants = [Variant(bridge, plain), Variant(bridge, plain.replace(native_layers=1))]
    path = tmp_path / "controls.json"
    first = evaluate(
        llama, tok, llama, tok, items, "choice", variants, progress=False, controls=ControlScores(path)
    )
    stored = ControlScores(path)
    again = evaluate(llama, tok, llama, tok, items, "choice", variants, progress=False, controls=stored)
    assert len(stored.entries) == len(items)
    for a, b in zip(first.items, again.items):
        assert a.scores == b.scores  # controls read back; bridged scores recomputed alike
        assert a.native_cost[variants[1].name] > a.native_cost[variants[0].name]
