"""The needle task (RULER's form) and generation scoring: items, exact match, the runner's
generate path on tiny random models, and the whole-word refresh (RefreshConfig.whole_words: the
words themselves, within one tokenization and across an alignment, and the default, which takes
them wherever the context's words are known)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model
from tiny_models import random_bridge as _random_bridge

from bridgecache import BridgedCache, HandoffConfig, RefreshConfig, capture_kv, handoff
from bridgecache.bridge import Bridge
from bridgecache.evaluation import GenerationItem, Variant, evaluate, format_table, summarise
from bridgecache.evaluation.answers import correct, exact_match, found, generation_metrics, partial, wilson
from bridgecache.evaluation.builtin import builtin_items, builtin_task
from bridgecache.evaluation.controls import ControlScores
from bridgecache.evaluation.decoding import reply_ids
from bridgecache.evaluation.items import DataFormatError, read_jsonl
from bridgecache.evaluation.needles import NEEDLE, PREAMBLE, SUBTASKS, needle_item, needle_plan
from bridgecache.evaluation.scoring import native_prefix
from bridgecache.runtime.entry.handoff import tokenize_context
from bridgecache.runtime.selection.rules import GivenScores, SourceAttention
from bridgecache.runtime.selection.words import (
    ContextWords,
    context_words,
    pool_words,
    reach_word_ends,
    word_groups,
)
from bridgecache.text import documents
from tokenalign import TokenSpans, align, token_spans

VOCAB = 258


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", vocab_size=VOCAB, initializer_range=0.3)


# ---------------------------------------------------------------------- items


def test_needle_names_are_generation_tasks():
    assert builtin_task("needle-4096") == "generate"
    assert {builtin_task(f"needle-{s}-8192") for s in SUBTASKS} == {"generate"}
    with pytest.raises(DataFormatError, match="outside 64..32768"):
        builtin_task("needle-65536")
    with pytest.raises(DataFormatError, match="outside 64..8192"):
        builtin_task("facts-choice-16384")  # the other families keep their bound


def test_needle_items_hold_each_needle_once_at_spread_depths(tok):
    items = builtin_items("needle-2048", tok, limit=12)
    assert [item.kind for item in items] == list(SUBTASKS) * 4
    eval_text = "\n\n".join(t for _, t in documents("prose", "eval"))
    for i, item in enumerate(items):
        plan = needle_plan(item.kind, i // 3)
        assert item.context.startswith(PREAMBLE) and item.answers == plan.answers
        for key, value, _ in plan.needles:
            line = NEEDLE.format(key=key, value=value)
            assert item.context.count(value) == 1 and f"\n{line}\n" in f"\n{item.context}\n"
            assert item.context.count(key) == sum(k == key for k, _, _ in plan.needles)
        assert plan.key in item.question
        # The asked needle sits at its depth: that share of the haystack lies before it.
        body = item.context[len(PREAMBLE) + 2 :]
        at = body.find(NEEDLE.format(key=plan.key, value=plan.answers[0]))
        assert abs(at / len(body) - plan.needles[0][2]) < 0.06
        # RULER's length: context + question + the reply's budget = N tokens (a few either way).
        prompt = len(tok(f"\nQuestion: {item.question}\nAnswer:", add_special_tokens=False)["input_ids"])
        total = len(tok(item.context)["input_ids"]) + prompt + item.max_new_tokens
        assert abs(total - 2048) <= 16
        haystack = "\n".join(x for x in body.split("\n") if not x.startswith("One of the special magic"))
        assert haystack[200:320] in eval_text  # (pydoc topics repeat some paragraphs across documents)
    kinds = {k: [it for it in items if it.kind == k] for k in SUBTASKS}
    assert all(len(it.answers) == 1 for it in kinds["single"] + kinds["multikey"])
    for item in kinds["multikey"]:  # three distractor needles of other keys
        assert item.context.count("One of the special magic numbers for") == 4
    for item in kinds["multivalue"]:  # four values of the one asked key
        assert len(item.answers) == 4 and len(set(item.answers)) == 4
    depths = sorted(needle_plan("single", k).needles[0][2] for k in range(12))
    assert depths[0] == 0.0 and depths[-1] > 0.9 and max(b - a for a, b in zip(depths, depths[1:])) < 0.2


def test_needle_items_are_seeded_and_independent_of_the_count(tok):
    few = builtin_items("needle-1024", tok, limit=4)
    many = builtin_items("needle-1024", tok, limit=10)
    assert few == many[:4] == builtin_items("needle-1024", tok, limit=4)
    assert builtin_items("needle-single-1024", tok, limit=3)[1].answers == needle_plan("single", 1).answers


def test_needle_item_refuses_a_haystack_that_already_holds_a_value():
    plan = needle_plan("single", 0)
    with pytest.raises(DataFormatError, match="already holds"):
        needle_item(plan, f"text\nthe value {plan.answers[0]} again\nmore text\n")


def test_generation_items_read_from_jsonl(tmp_path):
    path = tmp_path / "gen.jsonl"
    path.write_text(
        json.dumps({"context": "c", "question": "q?", "answers": ["42"], "max_new_tokens": 8}) + "\n"
    )
    assert read_jsonl(path, "generate") == [GenerationItem("c", "q?", ("42",), 8)]
    path.write_text(json.dumps({"context": "c", "question": "q?", "answers": []}) + "\n")
    with pytest.raises(DataFormatError, match=":1: field 'answers'"):
        read_jsonl(path, "generate")


# ---------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    ("reply", "answer", "right"),
    [
        (" 9163758", "9163758", True),
        ("9163758.\nMore", "9163758", True),
        ("The special magic number for icy-orchard is 9163758.", "9163758", True),
        (" 916375", "9163758", False),  # a digit dropped
        (" 91637580", "9163758", False),  # a digit added
        (" 9163759", "9163758", False),  # the last digit changed
        ("916 3758", "9163758", False),
        ("It is 1234567, not 9163758", "9163758", False),  # the first number is the answer given
        ("", "9163758", False),
        ("Fallowby.", "fallowby", True),
        ('"Fallowby"', "Fallowby", True),
        ("Fallowby and Karsk", "Fallowby", False),
    ],
)
def test_exact_match_takes_whole_numbers_and_first_lines(reply, answer, right):
    assert exact_match(reply, answer) is right


def test_several_answers_need_all_and_earn_partial_credit():
    answers = ("1111111", "2222222", "3333333", "4444444")
    assert correct("1111111, 2222222, 3333333 and 4444444", answers)
    reply = "1111111, 222222, 3333333"  # one near-miss, one missing
    assert not correct(reply, answers) and partial(reply, answers) == 0.5
    assert found("towns: Karsk, Velmora", "velmora") and not found("Velmoran", "Velmora")
    assert partial(" 9163758", ("9163758",)) == 1.0 and partial(" 916375", ("9163758",)) == 0.0


def test_wilson_interval():
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0  # exactly: 10/10 lies in it
    assert all(wilson(n, n)[0] <= 1.0 == wilson(n, n)[1] for n in range(1, 200))
    assert wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-3)
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_generation_metrics_per_condition():
    answers = [("1",), ("2",), ("3", "4")]
    replies = {"native": ["1", "2", "3 4"], "bridged": ["1", "22", "3"], "no_context": ["0", "0", "0"]}
    m = generation_metrics(replies, answers)
    assert (m["acc_native"], m["acc_bridged"], m["acc_no_context"]) == (1.0, pytest.approx(1 / 3), 0.0)
    assert m["partial_bridged"] == 0.5 and m["partial_bridged_n"] == 1
    assert m["retention"] == pytest.approx(1 / 3) and m["correct_bridged"] == 1
    assert m["acc_bridged_ci"] == pytest.approx(list(wilson(1, 3)))


# ---------------------------------------------------------------------- decoding and the runner


def test_greedy_reply_after_a_prefix_is_generate_greedy(llama, tok):
    ids = tok("abc def ghi", return_tensors="pt")["input_ids"]
    prompt = tok("\nQ:", add_special_tokens=False)["input_ids"]
    reply = reply_ids(llama, native_prefix(llama, ids), prompt, 6)
    full = torch.cat([ids, torch.tensor([prompt])], dim=1)
    expected = llama.generate(full, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, full.shape[1] :]
    assert reply == expected.tolist()[: len(reply)] and len(reply) == 6


def _gen_items(model, tok, n=3):
    items = []
    for k in range(n):
        context = f"record {k}: the code is {k}{k + 3}{k + 5} and the town is far away"
        question = "what is the code"
        probe = native_prefix(model, tok(context, return_tensors="pt")["input_ids"])
        prompt = tok(f"\nQuestion: {question}\nAnswer:", add_special_tokens=False)["input_ids"]
        answer = tok.decode(reply_ids(model, probe, prompt, 4)).strip() or "x"
        items.append(GenerationItem(context, question, (answer,), 4, "single"))
    return items


def test_generate_task_through_an_identity_bridge_gives_native_replies(llama, tok, tmp_path):
    items = _gen_items(llama, tok)
    bridge = Bridge.identity(llama)
    words = HandoffConfig(refresh=RefreshConfig(0.3, whole_words=True))
    variants = [
        Variant(bridge, HandoffConfig(refresh=None)),
        Variant(bridge),
        Variant(bridge, words, label="words"),
    ]
    controls = ControlScores(tmp_path / "controls.json")
    ev = evaluate(llama, tok, llama, tok, items, "generate", variants, progress=False, controls=controls)
    for result in ev.items:
        assert {result.replies[f"bridged[{v.name}]"] for v in variants} == {result.replies["native"]}
        assert set(result.cpu_s) >= {"native_prefill", "source_prefill"}
    s = summarise(ev, variants[2])
    assert s["task"] == "generate" and s["n"] == 3 and s["acc_bridged"] == s["acc_native"]
    assert s["retention"] == 1.0 and "acc_no_context_ci" in s and s["handoff_cpu_s"] > 0
    assert "words" in s["variant"]
    table = format_table(s)
    assert "exact match" in table and "95% CI (Wilson)" in table and "(c) no context" in table
    # A second run reads the native and no-context replies from the controls file.
    again = evaluate(
        llama, tok, llama, tok, items, "generate", variants[:1], progress=False, controls=controls
    )
    assert [r.replies["native"] for r in again.items] == [r.replies["native"] for r in ev.items]
    # one entry per item for the native and no-context replies, one per (item, other context)
    assert len(json.loads((tmp_path / "controls.json").read_text())) == 6


def test_generate_task_answers_after_an_unrelated_context(llama, tok):
    """The unrelated-context control: item 0's question asked natively after item 1's context
    (cut to item 0's length); one item alone has none unless `others` names one."""
    from bridgecache.evaluation.prompts import Prompts

    items = _gen_items(llama, tok)
    variant = Variant(Bridge.identity(llama), HandoffConfig(refresh=None))
    run = dict(progress=False)
    ev = evaluate(llama, tok, llama, tok, items[:1], "generate", [variant], others=[items[1]], **run)
    prompts = Prompts(tok, tok)
    cut = prompts.cut(items[1].context, prompts.content_length(items[0].context))
    swapped = GenerationItem(cut, items[0].question, items[0].answers, 4, "single")
    alone = evaluate(llama, tok, llama, tok, [swapped], "generate", [variant], **run)
    assert ev.items[0].replies["other_native"] == alone.items[0].replies["native"]
    assert "other_native" not in alone.items[0].replies
    summary = summarise(ev, variant)
    assert summary["acc_other_native"] in (0.0, 1.0) and "acc_other_native" not in summarise(alone, variant)
    assert "(d) native, unrelated context" in format_table(summary)
    with pytest.raises(ValueError, match="expected one per item"):
        evaluate(llama, tok, llama, tok, items[:2], "generate", [variant], others=items[2:], **run)
    assert ev.items[0].other_index is None  # the caller's item, not one evaluated


def test_the_unrelated_context_is_the_next_item_with_another_text(llama, tok):
    """Several questions on one context: each one's unrelated context is another text."""
    first, _, third = _gen_items(llama, tok)
    shared = GenerationItem(first.context, "what is the town", first.answers, 4, "single")
    variant = Variant(Bridge.identity(llama), HandoffConfig(refresh=None))
    ev = evaluate(llama, tok, llama, tok, [first, shared, third], "generate", [variant], progress=False)
    assert [r.other_index for r in ev.items] == [2, 2, 0]
    assert all("other_native" in r.replies for r in ev.items)


# ---------------------------------------------------------------------- whole words


def test_word_groups_keep_numbers_and_words_whole(tok):
    text = "key icy-orchard is: 9163758."
    ids = tok(text, add_special_tokens=False)["input_ids"]  # one token per byte
    groups = word_groups(text, tok, ids)
    words = {}
    for ch, g in zip(text, groups.tolist()):
        words.setdefault(g, "")
        words[g] += ch
    assert "9163758" in words.values() and "orchard" in words.values() and "icy" in words.values()
    assert " " not in "".join(w for w in words.values() if len(w) > 1)
    _, spans = token_spans(text, tok, ids)
    assert np.array_equal(word_groups(text, spans=spans), groups)  # from spans: no tokenizer call
    assert word_groups("", spans=TokenSpans([], [])).shape == (0,)


def _groups_by_token(text: str, spans) -> list[int]:
    """word_groups' definition, token by token: a token continues the previous token's word when
    it has text, starts inside or at the end of the previous token's text (which has text too),
    and the bytes on both sides of its start are word bytes (ASCII letters, digits, "_", non-ASCII)."""
    data = text.encode("utf-8", "surrogatepass")
    is_word = lambda b: b >= 0x80 or chr(b).isalnum() or b == ord("_")  # noqa: E731
    groups, previous = [], None  # previous: (start, end) of the previous token
    for start, end in zip(spans.start.tolist(), spans.end.tolist()):
        inside = (
            previous is not None and previous[1] > previous[0] and end > start
            and 0 < start <= previous[1] and is_word(data[start - 1]) and is_word(data[start])
        )  # fmt: skip
        groups.append(0 if not groups else groups[-1] + (not inside))
        previous = (start, end)
    return groups


_PIECES = [
    "ab",
    "Z",
    "_x",
    "42",
    "9163758",
    " ",
    "  ",
    "\n",
    ".",
    ",",
    "-",
    ":",
    "é",
    "中文",
    "🙂",
    "ß1",
    "x_2",
]


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_PIECES) for _ in range(rng.randrange(0, 40)))


def _random_spans(rng: random.Random, text: str) -> TokenSpans:
    """Spans of a made-up tokenization: pieces of any byte length (mid-character too), some
    shared with the previous token (a split character), some bytes left uncovered, tokens
    without text anywhere."""
    n = len(text.encode("utf-8", "surrogatepass"))
    cuts = sorted({0, n} | {rng.randrange(n + 1) for _ in range(rng.randrange(n + 1))})
    start, end = [], []
    for a, b in zip(cuts, cuts[1:]):
        while rng.random() < 0.15:  # a special: no text
            start.append(0), end.append(0)
        if rng.random() < 0.1:  # uncovered (a skipped space, a normalised character)
            continue
        start.append(a), end.append(b)
        if rng.random() < 0.1:  # the next token shares this one's bytes
            start.append(a), end.append(b)
    if rng.random() < 0.3:
        start.append(0), end.append(0)
    return TokenSpans(start, end)


def test_word_groups_match_the_token_by_token_definition_on_random_texts(tok):
    rng = random.Random(0)
    merging = _merging_tokenizer()
    for trial in range(300):
        text = _random_text(rng)
        spans = _random_spans(rng, text)
        # the definition of a word without its length bound (max_tokens: test_reliability_words.py)
        assert word_groups(text, spans=spans, max_tokens=None).tolist() == _groups_by_token(text, spans), (
            trial,
            text,
        )
        for tokenizer in (tok, merging):  # real spans: offsets, with specials around (rebuilt text)
            ids = [256] + tokenizer(text)["input_ids"] + [257]
            _, spans = token_spans(text, tokenizer, ids)
            groups = word_groups(text, tokenizer, ids, max_tokens=None)
            assert groups.dtype == np.int64 and groups.tolist() == _groups_by_token(text, spans), text


def test_tokenize_context_finds_the_words_of_the_tokenizer_calls_it_made(tok):
    """Words from the spans of tokenize_context's own tokenizer calls equal word_groups' from
    scratch; the alignment and ids equal tokenalign.align's."""
    text = "key icy-orchard: 9163758, café 中文 x_2."
    bridge = Bridge.identity(tiny_model("llama", vocab_size=262))
    for target_tok in (tok, _merging_tokenizer()):
        read = tokenize_context(bridge, text, tok, target_tok, words=True)
        expected = context_words(text, tok, target_tok, read.source_ids, read.target_ids)
        assert torch.equal(read.words.source, expected.source)
        assert torch.equal(read.words.target, expected.target)
        assert tokenize_context(bridge, text, tok, target_tok).words is None
        if target_tok is tok:
            assert read.alignment is None and read.source_ids is read.target_ids
        else:
            aligned = align(text, tok, target_tok)
            assert read.source_ids[0].tolist() == aligned.source_ids
            assert read.target_ids[0].tolist() == aligned.target_ids
            for field in ("source_index", "span_start", "span_end"):
                assert np.array_equal(getattr(read.alignment, field), getattr(aligned.alignment, field))


def test_pool_words_takes_each_words_best_per_row():
    scores = torch.tensor([[0.1, 0.9, 0.2, 0.0], [0.3, 0.1, 0.5, 0.4]])
    groups = ContextWords.rows([[0, 0, 1, 2], [0, 1, 1]], [[0]]).source  # row 1: one padding column
    assert groups.tolist() == [[0, 0, 1, 2], [0, 1, 2, 2]]
    expected = torch.tensor([[0.9, 0.9, 0.2, 0.0], [0.3, 0.1, 0.5, 0.5]])
    assert torch.equal(pool_words(scores, groups), expected)
    with pytest.raises(ValueError, match="one group per scored token"):
        pool_words(scores, groups[:, :3])


def test_reach_word_ends_scores_the_token_after_each_word_as_the_word():
    scores = torch.tensor([[0.1, 0.9, 0.9, 0.2, 0.3], [0.5, 0.1, 0.7, 0.7, 0.8]])
    groups = torch.tensor([[0, 1, 1, 2, 3], [0, 1, 2, 2, 3]])
    # Row 0: the token after word 1 takes 0.9; row 1: the tokens after words 0 and 1 take 0.5 and
    # 0.7 (the word after a lower one keeps its own score; one token inside a word is no end).
    expected = torch.tensor([[0.1, 0.9, 0.9, 0.9, 0.3], [0.5, 0.5, 0.7, 0.7, 0.8]])
    assert torch.equal(reach_word_ends(scores, groups), expected)
    # A token outside words (group 0, a space) ends in a word of three tokens: all three take its
    # score, and the chain stops there (the token after that word keeps the word's own 0.2).
    spaced = torch.tensor([[0.9, 0.2, 0.2, 0.2, 0.0]])
    entered = reach_word_ends(spaced, torch.tensor([[0, 1, 1, 1, 2]]))
    assert torch.equal(entered, torch.tensor([[0.9, 0.9, 0.9, 0.9, 0.2]]))
    with pytest.raises(ValueError, match="one group per scored token"):
        reach_word_ends(scores, groups[:, :3])


def test_word_ends_refresh_the_token_that_ends_a_number(llama, tok):
    """With word_ends (the default) a chosen number brings the token after it ("9163758" and the
    space after it) within the same budget; labels and recipes tell the two apart; token by token
    it changes nothing."""
    text = "the magic number is 9163758 ok"
    ids = tok(text, return_tensors="pt")["input_ids"]  # one token per byte
    bridge, kv = _random_bridge(llama, seed=1), capture_kv(llama, ids)
    start = text.index("9163758")
    scores = torch.zeros(1, ids.shape[1])
    scores[0, start + 3] = 1.0
    words = context_words(text, tok, tok, ids, ids)

    def refreshed(**options) -> list[int]:
        refresh = RefreshConfig(8, by=GivenScores(scores), **options)
        cache = BridgedCache(bridge, kv, llama, ids, config=HandoffConfig(refresh=refresh), words=words)
        return cache.refreshed_columns[0].tolist()

    number = list(range(start, start + 7))
    assert refreshed(word_ends=True) == [*number, start + 7]  # the space that ends it
    assert start + 7 not in refreshed(word_ends=False) and set(number) <= set(refreshed(word_ends=False))
    assert refreshed(word_ends=True, whole_words=False) == refreshed(whole_words=False)
    assert RefreshConfig(word_ends=True).label == f"{RefreshConfig().amount}:source+whole-ends"
    assert RefreshConfig(whole_words=False, word_ends=True).label.endswith(":no-words")
    assert RefreshConfig().word_ends  # the default: pages made without ends never answer for it
    assert HandoffConfig(refresh=RefreshConfig(word_ends=False)).kv_recipe != HandoffConfig().kv_recipe
    with pytest.raises(ValueError, match="word_ends='yes'; expected True or False"):
        RefreshConfig(word_ends="yes")


def test_an_end_that_enters_a_number_brings_the_whole_number(llama, tok):
    """A chosen space before a number (a token outside words) brings the number whole through its
    end, never its first digit alone with the rest translated (a year split so lost the drift's
    items 25 and 43 to a distractor year refreshed whole)."""
    text = "in the year 1987 it rained"
    ids = tok(text, return_tensors="pt")["input_ids"]  # one token per byte
    bridge, kv = _random_bridge(llama, seed=2), capture_kv(llama, ids)
    space = text.index("1987") - 1
    scores = torch.zeros(1, ids.shape[1])
    scores[0, space] = 1.0
    refresh = RefreshConfig(5, by=GivenScores(scores))
    words = context_words(text, tok, tok, ids, ids)
    cache = BridgedCache(bridge, kv, llama, ids, config=HandoffConfig(refresh=refresh), words=words)
    assert cache.refreshed_columns[0].tolist() == list(range(space, space + 5))  # " 1987"


def test_word_ends_in_a_padded_batch_pick_what_each_row_picks_alone(llama, tok):
    """Padding lends the first real column nothing, even when it scores highest and that column
    is eligible (no native head)."""
    texts = ["the magic number is 9163758 ok", "a 42 b"]
    rows = [tok(t, return_tensors="pt")["input_ids"][0] for t in texts]
    width, pad = len(rows[0]), len(rows[0]) - len(rows[1])
    ids = torch.stack([rows[0], torch.cat([torch.zeros(pad, dtype=torch.long), rows[1]])])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    groups = [word_groups(t, tok, r.tolist()) for t, r in zip(texts, rows, strict=True)]
    scores = torch.zeros(2, width)
    scores[1, :pad] = 10.0  # padding: whatever a rule gives it
    scores[1, pad + 2] = 1.0  # the "4" of "42"
    bridge = _random_bridge(llama, seed=1)

    def refresh(given: torch.Tensor) -> HandoffConfig:
        return HandoffConfig(native_head=0, refresh=RefreshConfig(3, GivenScores(given)))

    batch = BridgedCache(
        bridge, capture_kv(llama, ids, attention_mask=mask), llama, ids, config=refresh(scores),
        target_attention_mask=mask, source_attention_mask=mask, words=ContextWords.rows(groups, groups),
    )  # fmt: skip
    alone = BridgedCache(
        bridge, capture_kv(llama, rows[1][None]), llama, rows[1][None], config=refresh(scores[1:, pad:]),
        words=context_words(texts[1], tok, tok, rows[1][None], rows[1][None]),
    )  # fmt: skip
    assert alone.refreshed_columns[0].tolist() == [2, 3, 4]  # "42" and the space after it
    assert (batch.refreshed_columns[1] - pad).tolist() == alone.refreshed_columns[0].tolist()


def test_whole_words_refresh_takes_the_number_a_digit_was_chosen_in(llama, tok):
    """One digit inside the number scores highest: whole words refresh the whole number; token by
    token, that digit and the earliest columns (ties). The default (whole_words=None) takes whole
    words when the cache is given them and refreshes token by token from ids alone; True without
    words raises."""
    text = "the magic number is 9163758 ok"
    ids = tok(text, return_tensors="pt")["input_ids"]  # one token per byte
    bridge, kv = _random_bridge(llama, seed=1), capture_kv(llama, ids)
    digit = text.index("1637") + 2  # the "6", inside the number
    scores = torch.zeros(1, ids.shape[1])
    scores[0, digit] = 1.0
    number = list(range(text.index("9163758"), text.index("9163758") + 7))

    known = context_words(text, tok, tok, ids, ids)

    def cache(whole_words: bool | None, words=known) -> BridgedCache:
        refresh = RefreshConfig(7, by=GivenScores(scores), whole_words=whole_words)
        return BridgedCache(bridge, kv, llama, ids, config=HandoffConfig(refresh=refresh), words=words)

    def refreshed(whole_words: bool | None, **words) -> list[int]:
        return cache(whole_words, **words).refreshed_columns[0].tolist()

    assert refreshed(True) == number
    assert refreshed(False) != number and digit in refreshed(False)
    assert refreshed(None) == number  # the default, words given
    assert refreshed(None, words=None) == refreshed(False)  # the default from ids alone
    assert refreshed(False, words=None) == refreshed(False)
    # The cache records what it did.
    assert cache(None).handoff_config.refresh.whole_words is True
    assert cache(None, words=None).handoff_config.refresh.whole_words is False
    default = BridgedCache(bridge, kv, llama, ids, source_model=llama).handoff_config
    assert default == HandoffConfig(refresh=RefreshConfig(whole_words=False))
    with pytest.raises(ValueError, match="whole_words=True. needs the context's words"):
        cache(True, words=None)


def _merging_tokenizer():
    """Byte-level BPE that merges "916", "37" and "58": another tokenization of the same text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("9", "1"), ("91", "6"), ("3", "7"), ("5", "8")]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<s>": 256, "</s>": 257, "91": 258, "916": 259, "37": 260, "58": 261}
    model = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>")


def test_whole_words_cross_an_alignment_through_handoff(tok, monkeypatch):
    """Source: one token per byte; target: "916" "37" "58". The source's attention picks the
    digit "6" alone: with whole words the source's number (7 rows) and then the target's (3
    columns) are refreshed whole; without, only the target column that reads that digit's row.
    handoff() knows the text: the default (whole_words=None) is whole words, to the tokens
    generated."""
    import bridgecache.runtime.selection.rules as selection

    model = tiny_model("llama", vocab_size=262, initializer_range=0.3)
    target_tok = _merging_tokenizer()
    text = "the magic number is 9163758 ok"
    target_ids = target_tok(text)["input_ids"]
    assert [target_tok.decode([i]) for i in target_ids[20:23]] == ["916", "37", "58"]
    assert len(tok(text)["input_ids"]) == len(target_ids) + 4  # two tokenizations: an alignment
    digit = text.index("6")
    picked = torch.zeros(1, len(text))
    picked[0, digit] = 1.0
    monkeypatch.setattr(selection.SelectionRequest, "read_source", lambda *args, **kwargs: picked.clone())
    bridge = _random_bridge(model, seed=2)

    def run(whole_words: bool | None):
        rule = RefreshConfig(3, by=SourceAttention(after=0), whole_words=whole_words)
        return handoff(
            bridge, model, model, text, " which?", source_tokenizer=tok, target_tokenizer=target_tok,
            config=HandoffConfig(refresh=rule), max_new_tokens=4, do_sample=False,
        )  # fmt: skip

    def refreshed(out) -> list[str]:
        return [target_tok.decode([target_ids[c]]) for c in out.cache.refreshed_columns[0].tolist()]

    words, tokens, default = run(True), run(False), run(None)
    assert refreshed(words) == ["916", "37", "58"]
    assert "916" in refreshed(tokens) and refreshed(tokens) != ["916", "37", "58"]
    assert refreshed(default) == refreshed(words)
    assert torch.equal(default.output_ids, words.output_ids)
    assert default.cache.handoff_config == words.cache.handoff_config


def test_whole_words_in_the_runner_refresh_whole_words(llama, tok):
    """Under True and under the default (the runner knows the text) the same whole words; under
    False, words cut."""
    items = _gen_items(llama, tok)
    bridge = _random_bridge(llama)
    configs = {
        w: HandoffConfig(refresh=RefreshConfig(4, by="deviation", whole_words=w)) for w in (True, None, False)
    }
    variants = {w: Variant(bridge, config) for w, config in configs.items()}
    ev = evaluate(llama, tok, llama, tok, items, "generate", list(variants.values()), progress=False)
    cut_by = {w: 0 for w in variants}
    for result, item in zip(ev.items, items):
        chosen = {w: result.refreshed[v.name] for w, v in variants.items()}
        assert chosen[None] == chosen[True]
        groups = word_groups(item.context, tok, tok(item.context)["input_ids"])
        for w in variants:
            cut = {
                g
                for g in groups[chosen[w]].tolist()
                if not set(np.flatnonzero(groups == g)) <= set(chosen[w])
            }
            cut_by[w] += len(cut)
            if w is not False:
                assert len(cut) <= 1, (item.context, chosen)  # only the last word the budget reaches
    assert cut_by[False] > cut_by[True]


def test_long_context_variants_are_handoff_configs():
    from tiny_models import script

    long_context = script("benchmarks/long_context.py")
    assert long_context.variant_config("plain") == HandoffConfig(refresh=None)
    # Explicit both ways: refresh=F is token by token whatever the library's default.
    assert long_context.variant_config("refresh=0.2") == HandoffConfig(
        refresh=RefreshConfig(whole_words=False)
    )
    words = long_context.variant_config("refresh=64,words")
    assert (
        words.refresh == RefreshConfig(64, "source", whole_words=True, word_ends=False) and words.wants_words
    )
    ends = long_context.variant_config("refresh=0.2,words,ends").refresh
    assert ends == RefreshConfig(0.2, "source", whole_words=True, word_ends=True)
    assert long_context.variant_config("refresh=0.2,words").refresh.word_ends is False
    with pytest.raises(SystemExit, match="bad variant"):
        long_context.variant_config("refresh=0.2,spread=2")
    with pytest.raises(SystemExit, match="ends only with words"):
        long_context.variant_config("refresh=0.2,ends")
    assert long_context.variant_config("refresh=0.2,ends,words").refresh == ends
    # Records of word ends before an end brought the word it enters whole stay apart in the report.
    made = {"spec": "refresh=0.2,words,ends", "variant": "fullhead " + HandoffConfig(refresh=ends).label}
    assert long_context.row_name(made) == "refresh=0.2,words,ends"
    earlier = {**made, "variant": "fullhead refresh=0.2:source:words+ends"}
    assert long_context.row_name(earlier) == "refresh=0.2,words,ends [earlier ends]"


def test_long_context_cells_keep_what_other_machines_measured():
    """`report --cells`: counts round-trip into the intervals the plot draws; a cell measured again
    replaces its rows by name and a control only by one counted over as many items or more."""
    from tiny_models import script

    long_context = script("benchmarks/long_context.py")

    def cell(rows: dict, native: tuple[int, int]) -> dict:
        def acc(k, n):
            return {"acc": k / n, "acc_ci": long_context._wilson(k, n), "n": n}

        made = {"dates": ["2026-12-02"], "commits": ["abc1234"]}
        return {
            "controls": {"native": acc(*native), "cpu_native": 12.5},
            "rows": {spec: acc(k, n) | made for spec, (k, n) in rows.items()},
            "threads": [1],
        }

    kept = long_context.cell_counts(
        {("p", "needle-4096"): cell({"plain": (0, 30), "refresh=0.2,words,ends": (26, 30)}, (28, 30))}
    )
    assert kept[0]["controls"] == {"native": {"k": 28, "n": 30}}  # counts only: CPU seconds stay out
    drawn = long_context.cells_from_counts(kept)[("p", "needle-4096")]
    assert drawn["rows"]["refresh=0.2,words,ends"]["acc_ci"] == long_context._wilson(26, 30)
    assert drawn["rows"]["refresh=0.2,words,ends"]["acc"] == pytest.approx(26 / 30)
    before = json.dumps(kept)
    measured = long_context.cell_counts(
        {
            ("p", "needle-4096"): cell({"refresh=0.2,words,ends": (5, 6)}, (6, 6)),
            ("p", "needle-8192"): cell({"plain": (0, 6)}, (5, 6)),
        }
    )
    merged = {(c["pair"], c["task"]): c for c in long_context.merge_counts(kept, measured)}
    assert json.dumps(kept) == before  # the kept counts are not edited in place
    four = merged[("p", "needle-4096")]
    assert four["rows"]["refresh=0.2,words,ends"]["k"] == 5 and four["rows"]["plain"]["n"] == 30
    assert four["controls"]["native"] == {"k": 28, "n": 30}  # 6 items do not replace 30
    assert merged[("p", "needle-8192")]["rows"] == measured[1]["rows"]
    again = long_context.merge_counts(list(merged.values()), measured)
    assert again == list(merged.values())  # merging the same records twice changes nothing
