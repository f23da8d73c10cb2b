"""Multi-turn use: a handoff mid-conversation, then several turns on the same cache.

Tiny random models with byte-level tokenizers that carry chat templates (built offline): the
source and target render chats with different templates (and the target has one more token), so
the handoff goes through tokenalign's chat alignment. An identity bridge must reproduce the
target's own conversation; the example script and the drift benchmark run end to end.
"""

from __future__ import annotations

import math
import re

import pytest
from tiny_models import CHATML, ZEPHYR, chat_tokenizer, script, tiny_model

from bridgecache import Bridge, load_model
from bridgecache.fitting import FitConfig, fit_bridge
from bridgecache.runtime.entry.conversation import Conversation

EARLIER = [
    {"role": "user", "content": "The Alder lost its mast near the rocks; the Heron towed it in at dawn."},
    {"role": "assistant", "content": "Noted: the Alder lost its mast."},
]
GEN = dict(max_new_tokens=5, do_sample=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny source (llama, Zephyr-style template) and target (qwen2, ChatML, one more token) saved as
    model directories, and a bridge between them fitted on the tokenizers as loaded from there."""
    root = tmp_path_factory.mktemp("multi_turn")
    pairs = (("source", "llama", ZEPHYR, None), ("target", "qwen2", CHATML, "<extra>"))
    for role, family, template, extra in pairs:
        tiny_model(family, seed=3, initializer_range=0.2, max_position_embeddings=4096).save_pretrained(
            root / role
        )
        chat_tokenizer(template, extra).save_pretrained(root / role)
    (source, source_tok), (target, target_tok) = (load_model(str(root / r)) for r in ("source", "target"))
    config = FitConfig(method="fullhead", num_sequences=4, seq_len=48, heldout_every=2)
    bridge = fit_bridge(source, target, source_tok, target_tok, config, progress=False)
    bridge.save_pretrained(root / "bridge")
    return root


def test_identity_handoff_continues_the_conversation_like_the_target_itself():
    model, tok = (
        tiny_model("qwen2", seed=4, initializer_range=0.2, max_position_embeddings=4096),
        chat_tokenizer(CHATML),
    )
    bridged = Conversation.handoff(
        Bridge.identity(model), model, model, EARLIER, source_tokenizer=tok, target_tokenizer=tok
    )
    native = Conversation.native(model, tok, EARLIER)
    assert bridged.cache is None  # built by the first question (the source reads it to choose)
    handed = bridged.ids.shape[1] - 1  # all but the held-back last token
    for k, question in enumerate(["Which ship?", "Who towed it?", "When?"]):
        a, b = bridged.ask(question, **GEN), native.ask(question, **GEN)
        assert a.answer == b.answer and a.new_tokens == b.new_tokens
        if k == 0:
            assert a.reused == handed and b.reused == 0  # the translated turns are never recomputed
        assert a.reused + a.fed == bridged.cache.get_seq_length() - a.new_tokens + 1
    assert bridged.messages == native.messages and len(bridged.messages) == 2 + 2 * 3
    before = bridged.cache.get_seq_length()
    choices = ["the Alder", "the Heron", "the Marigold"]
    got, want = (
        bridged.score("Which ship lost its mast?", choices),
        native.score("Which ship lost its mast?", choices),
    )
    assert got == pytest.approx(want, abs=1e-4) and all(math.isfinite(x) for x in got)
    # Scoring adds nothing to the chat; it may only drop cached tokens of a reply that the template
    # re-renders differently (random bytes here), which the next turn would not reuse anyway.
    assert bridged.cache.get_seq_length() <= before and len(bridged.messages) == 2 + 2 * 3
    assert bridged.ask("Anything else?", **GEN).answer == native.ask("Anything else?", **GEN).answer


def test_cross_template_handoff_reuses_the_translated_turns(saved):
    (source, source_tok), (target, target_tok) = (load_model(str(saved / r)) for r in ("source", "target"))
    bridge = Bridge.from_pretrained(saved / "bridge")
    assert bridge.alignment_policy == "last"  # different vocabularies: tokenalign pairs the tokens
    chat = Conversation.handoff(
        bridge, source, target, EARLIER, source_tokenizer=source_tok, target_tokenizer=target_tok
    )
    rendered = target_tok.apply_chat_template(EARLIER, tokenize=False)
    assert chat.ids.shape[1] == len(target_tok(rendered, add_special_tokens=False)["input_ids"])
    handed = chat.ids.shape[1] - 1
    assert chat.cache is None  # nothing translated before the first question
    previous_prompt = 0
    for question in ["Which ship?", "Who towed it?", "When?"]:
        turn = chat.ask(question, **GEN)
        assert turn.reused >= max(handed, previous_prompt)  # earlier turns stay cached
        previous_prompt = turn.reused + turn.fed
        assert chat.messages[-1] == {"role": "assistant", "content": turn.answer}
    assert all(layer.is_materialized for layer in chat.cache.layers)


def test_multi_turn_example_runs(saved, capsys):
    args = [
        "--source",
        str(saved / "source"),
        "--target",
        str(saved / "target"),
        "--bridge",
        str(saved / "bridge"),
    ]
    got = script("examples/multi_turn.py").main([*args, "--turns", "3", "--max-new-tokens", "4"])
    printed = capsys.readouterr().out
    assert len(got["turns"]) == len(got["native"]) == 3 and len(got["messages"]) == 2 + 2 * 3
    assert got["turns"][0]["reused"] == got["handed_over"] > 0
    assert got["cached"] == got["tokens"] - 1  # the last generated token is never fed
    assert "user   : Who towed it into the harbour?" in printed
    assert f"bridged: {got['turns'][2]['answer']!r}" in printed and "cached tokens reused" in printed


def _drift_args(saved, *more: str) -> list[str]:
    """multi_turn_drift's arguments for the saved tiny pair, two items of facts-choice-256."""
    models = ["--source", str(saved / "source"), "--target", str(saved / "target")]
    return [*models, "--bridge", str(saved / "bridge"), "--task", "facts-choice-256", "--limit", "2", *more]


def test_multi_turn_drift_benchmark_on_tiny_models(saved, tmp_path, capsys):
    drift = script("benchmarks/multi_turn_drift.py")
    args = _drift_args(saved, "--turns", "0", "1", "2", "--max-new-tokens", "3")
    records = tmp_path / "drift.jsonl"
    got = drift.main([*args, "--json", str(tmp_path / "drift.json"), "--records", str(records)])
    assert got["n"] == got["item_count"] == len(got["items"]) == 2
    assert set(got["accuracy"]) == {"native", "bridged", "no-context", "unrelated"}
    for by_k in got["accuracy"].values():
        assert set(by_k) == {"0", "1", "2"} and all(x in (0.0, 0.5, 1.0) for x in by_k.values())
    assert "further turns" in capsys.readouterr().out and (tmp_path / "drift.json").exists()

    # Killed after its first item: started again, it resumes from the records and agrees.
    lines = records.read_text().splitlines()
    assert len(lines) == 2
    records.write_text(lines[0] + "\n")
    again = drift.main([*args, "--records", str(records)])
    assert "resuming: 1 items finished" in capsys.readouterr().out
    assert again["items"] == got["items"] and again["accuracy"] == got["accuracy"]
    assert len(records.read_text().splitlines()) == 2
    # Other settings never reuse those lines; --no-controls leaves the controls out.
    fewer = drift.main([*args, "--records", str(records), "--no-controls"])
    assert "2 lines of other settings ignored" in capsys.readouterr().out
    assert set(fewer["accuracy"]) == {"native", "bridged"} and not fewer["controls"]
    assert fewer["items"] == [{k: r[k] for k in ("bridged", "native")} for r in got["items"]]


def test_drift_reuse_runs_only_the_bridged_conversations(saved, tmp_path, capsys, monkeypatch):
    """--reuse takes native's and the controls' answers from an earlier run whose bridged configs
    differ (a new default): none of those conversations runs again, the bridged ones do."""
    from bridgecache.runtime.entry.conversation import Conversation

    drift = script("benchmarks/multi_turn_drift.py")
    args = _drift_args(saved, "--turns", "0", "1", "--max-new-tokens", "2")
    earlier = tmp_path / "earlier.jsonl"
    got = drift.main([*args, "--records", str(earlier)])

    def never(*args, **kwargs):
        raise AssertionError("a native conversation ran again")

    monkeypatch.setattr(Conversation, "native", never)
    later = tmp_path / "later.jsonl"
    again = drift.main([*args, "--refresh", "0.5", "--records", str(later), "--reuse", str(earlier)])
    assert "reusing native and the controls of 2 items" in capsys.readouterr().out
    kept = ("bridged", "native", "no-context", "unrelated")
    assert [{k: r[k] for k in kept} for r in again["items"]] == got["items"]
    assert all(set(r) == {*kept, "refreshed"} for r in again["items"])
    # The --json result (a report's raw file) serves as well; one of other settings is refused.
    result = tmp_path / "earlier.json"
    drift.main([*args, "--records", str(earlier), "--json", str(result)])
    from_json = drift.main([*args, "--refresh", "0.5", "--reuse", str(result)])
    assert from_json["items"] == again["items"]
    with pytest.raises(
        SystemExit, match=r"other settings \(turns: \[0, 1\] there, \[0\] here\); expected all but"
    ):
        drift.main([*_drift_args(saved, "--turns", "0", "--max-new-tokens", "2"), "--reuse", str(result)])


def test_drift_with_an_identity_bridge_matches_the_native_conversation():
    from bridgecache.evaluation.builtin import builtin_items

    drift = script("benchmarks/multi_turn_drift.py")
    model, tok = (
        tiny_model("qwen2", seed=5, initializer_range=0.2, max_position_embeddings=4096),
        chat_tokenizer(CHATML),
    )
    items = builtin_items("facts-choice-256", tok, limit=3)
    got = drift.drift(model, model, Bridge.identity(model), items, [0, 1], source_tokenizer=tok,
                      target_tokenizer=tok, max_new_tokens=3)  # fmt: skip
    assert got["bridged"] == got["native"]
    assert sum(got["native"].values()) <= 2 * len(items)


def test_drift_controls_read_no_document_and_another_items_document(monkeypatch):
    """The no-context control opens with a greeting, the unrelated one with the next item's
    context; the native and bridged conversations read the item's own."""
    from bridgecache.evaluation.builtin import builtin_items
    from bridgecache.runtime.entry.conversation import Conversation

    drift = script("benchmarks/multi_turn_drift.py")
    model, tok = (
        tiny_model("qwen2", seed=5, initializer_range=0.2, max_position_embeddings=4096),
        chat_tokenizer(CHATML),
    )
    items = builtin_items("facts-choice-256", tok, limit=3)
    read = []
    native = Conversation.native.__func__
    monkeypatch.setattr(
        Conversation,
        "native",
        classmethod(lambda cls, t, tk, m: read.append(m[0]["content"]) or native(cls, t, tk, m)),
    )
    records = []
    got = drift.drift(model, model, Bridge.identity(model), items, [0], source_tokenizer=tok,
                      target_tokenizer=tok, max_new_tokens=2, controls=True, records=records)  # fmt: skip
    assert set(got) == {"bridged", "native", "no-context", "unrelated"}
    # per item: native (its own context), no-context (a greeting), unrelated (the next item's)
    expected = [(items[i].context, "Hello.", items[(i + 1) % 3].context) for i in range(3)]
    assert read == [text for triple in expected for text in triple]
    assert got["bridged"] == got["native"] and len(records) == 3
    assert all(items[i].context != items[(i + 1) % 3].context for i in range(3))


@pytest.mark.real_model
def test_multi_turn_example_on_smollm2_reproduces_its_own_conversation(capsys):
    # The same model on both sides: fit_bridge returns the exact identity, so every bridged turn
    # (SmolLM2's real chat template, three turns on one cache) must match the native one.
    args = ["--source", "smollm2-135m", "--target", "smollm2-135m", "--turns", "3", "--max-new-tokens", "8"]
    got = script("examples/multi_turn.py").main(args)
    assert [turn["answer"] for turn in got["turns"]] == got["native"]
    assert all(turn["new_tokens"] >= 1 for turn in got["turns"])
    assert got["turns"][0]["reused"] == got["handed_over"]
    assert "fitting a bridge smollm2-135m->smollm2-135m" in capsys.readouterr().out


def test_drift_with_a_refreshed_conversation_records_each_condition_per_item():
    """The benchmark's configs reach Conversation.handoff: an identity bridge (exact, no refresh)
    matches native under any config; a random bridge with whole words runs and records every
    condition; the intervals name each condition and its difference from native."""
    from tiny_models import random_bridge as _random_bridge

    from bridgecache import HandoffConfig, RefreshConfig
    from bridgecache.evaluation.builtin import builtin_items

    drift = script("benchmarks/multi_turn_drift.py")
    model, tok = (
        tiny_model("qwen2", seed=5, initializer_range=0.2, max_position_embeddings=4096),
        chat_tokenizer(CHATML),
    )
    items = builtin_items("facts-choice-256", tok, limit=2)
    configs = {
        "bridged": HandoffConfig(),
        "refreshed": HandoffConfig(refresh=RefreshConfig(0.3, whole_words=True)),
    }
    records = []
    got = drift.drift(model, model, Bridge.identity(model), items, [0, 1], source_tokenizer=tok,
                      target_tokenizer=tok, max_new_tokens=3, configs=configs, records=records)  # fmt: skip
    assert got["refreshed"] == got["bridged"] == got["native"]
    assert len(records) == 2 and set(records[0]) == {"native", "bridged", "refreshed"}
    assert set(drift._intervals(records, [0, 1])) >= {"native@0", "refreshed-native@1", "bridged-native@0"}
    records = []
    got = drift.drift(model, model, _random_bridge(model, seed=1), items[:1], [0], source_tokenizer=tok,
                      target_tokenizer=tok, max_new_tokens=2, configs=configs, records=records)  # fmt: skip
    assert set(got) == {"bridged", "refreshed", "native"} and set(records[0]["refreshed"]) == {0}


def test_drift_explain_counts_the_refreshed_tokens_of_each_choice(saved):
    """--explain's counts: every token of every choice in the chat refreshed under a full refresh,
    none under translation only; the answer is in the shared context, so it is always found."""
    from bridgecache import HandoffConfig, RefreshConfig
    from bridgecache.evaluation.builtin import builtin_items

    drift = script("benchmarks/multi_turn_drift.py")
    (source, source_tok), (target, target_tok) = (load_model(str(saved / r)) for r in ("source", "target"))
    bridge = Bridge.from_pretrained(str(saved / "bridge"))
    item = builtin_items("facts-choice-256", target_tok, limit=2)[1]
    tokenizers = dict(source_tokenizer=source_tok, target_tokenizer=target_tok)

    def counts(config):
        why = drift.explain(source, target, bridge, item, **tokenizers, config=config)
        assert why["answer"] == item.answer
        assert {why["bridged"], why["native"]} <= set(range(len(item.choices)))
        assert [c["text"] for c in why["choices"]] == list(item.choices)
        assert why["choices"][item.answer]["occurrences"], "the answer is in the shared context"
        pairs = [tuple(map(int, o.split("/"))) for c in why["choices"] for o in c["occurrences"]]
        for c in why["choices"]:  # each occurrence's tokens and their neighbours, marked R or t
            assert len(c["around"]) == len(c["occurrences"])
            for marked, occurrence in zip(c["around"], c["occurrences"], strict=True):
                marks = re.findall(r"['\"]([Rt])(?= |$)", marked)
                assert len(marks) >= int(occurrence.split("/")[1])
                assert marks.count("R") >= int(occurrence.split("/")[0])
        return why, pairs

    full, pairs = counts(HandoffConfig(refresh=RefreshConfig(1.0), route="handoff"))
    assert all(k == n > 0 for k, n in pairs) and 0 < full["refreshed"] < full["tokens"]
    none, pairs = counts(HandoffConfig(refresh=None))
    assert all(k == 0 < n for k, n in pairs) and none["refreshed"] == 0
    assert none["native"] == full["native"]  # the target's own conversation does not depend on it
