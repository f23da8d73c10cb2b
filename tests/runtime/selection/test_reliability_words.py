"""The refresh's ranking is the selector's: whole words never override it (a word longer than
MAX_WORD_TOKENS splits, equal word scores never beat a token's higher own score), and what a
selector returns is checked before anything ranks it (shape, dtype, NaN, +inf); -inf ranks
last and never pulls a native or padded column into the budget; the report counts what was
refreshed."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from tiny_models import byte_tokenizer, random_bridge, tiny_model

from bridgecache import BridgedCache, HandoffConfig, RefreshConfig, capture_kv
from bridgecache.runtime.native_work.pending import ranked
from bridgecache.runtime.selection.rules import GivenScores, Selector, checked_scores
from bridgecache.runtime.selection.words import MAX_WORD_TOKENS, context_words, word_groups, word_ranking

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", vocab_size=258, initializer_range=0.3)


def _refreshed(llama, tok, text, scores, amount, **options):
    """The columns a whole-word refresh of `amount` tokens by `scores` picks, and the cache."""
    ids = tok(text, return_tensors="pt")["input_ids"]  # one token per byte
    bridge, kv = random_bridge(llama, seed=1), capture_kv(llama, ids)
    refresh = RefreshConfig(
        amount, by=scores if isinstance(scores, Selector) else GivenScores(scores), **options
    )
    words = context_words(text, tok, tok, ids, ids)
    cache = BridgedCache(bridge, kv, llama, ids, config=HandoffConfig(refresh=refresh), words=words)
    return cache.refreshed_columns[0].tolist(), cache


@pytest.mark.parametrize("word_ends", [True, False])
def test_a_cjk_run_without_spaces_refreshes_the_column_ranked_first(llama, tok, word_ends):
    text = "東京都の天気は晴れです明日の会議は午後三時に始まりますので遅れないでください"
    target = len(text[: text.index("三")].encode())  # the byte (token) of 三
    assert target > 3 * MAX_WORD_TOKENS  # far past the budget from the run's start
    for amount in (1, 3, MAX_WORD_TOKENS + 5):
        scores = torch.rand(1, len(text.encode()), generator=torch.Generator().manual_seed(amount)) * 0.1
        scores[0, target] = 1.0
        chosen, cache = _refreshed(llama, tok, text, scores, amount, word_ends=word_ends)
        assert target in chosen, (amount, chosen)
        assert len(set(chosen)) == amount == cache.report().tokens_refreshed


def test_a_long_base64_token_in_english_refreshes_the_column_ranked_first(llama, tok):
    blob = base64.b64encode(bytes(range(60))).decode()  # 80 word characters: one unbounded "word"
    text = f"the key is {blob} and nothing else"
    target = text.index(blob) + 50
    scores = torch.zeros(1, len(text))
    scores[0, target] = 1.0
    chosen, _ = _refreshed(llama, tok, text, scores, 4)
    assert chosen[0] <= target <= chosen[-1] and target in chosen


def test_a_budget_that_stops_inside_a_word_keeps_the_words_best_tokens(llama, tok):
    text = "see 918273645 now"
    start = text.index("9")
    scores = torch.zeros(1, len(text))
    scores[0, start + 6] = 0.9  # the word's best
    scores[0, start + 7] = 0.5
    scores[0, start + 2] = 0.3
    chosen, _ = _refreshed(llama, tok, text, scores, 3, word_ends=False)
    assert chosen == sorted([start + 2, start + 6, start + 7])  # not the number's first three digits


def test_word_ranking_orders_by_word_then_word_then_own_score():
    scores = torch.tensor([[0.0, 0.2, 0.9, 0.1, 0.9, 0.3, float("-inf"), 0.0]])
    groups = torch.tensor([[0, 1, 1, 1, 2, 2, 2, 3]])
    keys = word_ranking(scores, groups, ends=False)
    order = keys.argsort(dim=1, descending=True, stable=True)[0].tolist()
    # word 1 (best 0.9, the earlier word), its tokens by own score; then word 2; -inf last
    assert order[:6] == [2, 1, 3, 4, 5, 0] and order[-1] == 6
    assert keys[0, 6] == float("-inf")  # never lifted by its word
    ends = word_ranking(scores, groups, ends=True).argsort(dim=1, descending=True, stable=True)[0]
    assert ends[:3].tolist() == [2, 1, 3]  # the word first, then what its end enters
    padded = word_ranking(scores, groups, ends=True, first_column=torch.tensor([3]))
    assert bool((padded[0, :3] == float("-inf")).all())


def test_word_groups_split_words_longer_than_the_bound():
    text = "x" * 40 + " y"
    offsets = [(i, i + 1) for i in range(len(text))]
    from tokenalign import TokenSpans

    spans = TokenSpans([a for a, _ in offsets], [b for _, b in offsets])
    groups = word_groups(text, spans=spans)
    sizes = np.bincount(groups).tolist()
    assert sizes[:3] == [MAX_WORD_TOKENS, MAX_WORD_TOKENS, 40 - 2 * MAX_WORD_TOKENS]
    assert np.bincount(word_groups(text, spans=spans, max_tokens=None)).tolist()[0] == 40
    assert np.all(np.diff(groups) >= 0)
    with pytest.raises(ValueError, match="max_tokens=0"):
        word_groups(text, spans=spans, max_tokens=0)


class _Returns(Selector):
    """A custom rule that returns what it is given (the request decides the prefix)."""

    name = "returns"

    def __init__(self, make):
        self.make = make

    def scores(self, request):
        return self.make(request.prefix_length)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: torch.ones(1, 1), r"shape \(1, 1\).*expected \[batch=1, prefix="),  # broadcast before
        (lambda p: torch.ones(p), r"shape \(\d+,\)"),
        (lambda p: torch.ones(2, p), r"shape \(2, "),
        (lambda p: torch.ones(1, p, dtype=torch.long), "dtype torch.int64"),
        (lambda p: torch.full((1, p), float("nan")), "NaN or \\+inf"),
        (lambda p: torch.full((1, p), float("inf")), "NaN or \\+inf"),
        (lambda p: [[1.0] * p], "returned a list"),
    ],
)
def test_a_custom_selectors_scores_are_checked_before_ranking(llama, tok, make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _refreshed(llama, tok, "a few words of context here", _Returns(make), 3)


def test_given_scores_refuse_nan_and_non_tensors_when_built():
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        GivenScores(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ValueError, match="shape \\(3,\\)"):
        GivenScores(torch.ones(3))
    with pytest.raises(TypeError, match="GivenScores.values"):
        GivenScores("high")
    assert GivenScores([[1.0, 2.0]]).values.shape == (1, 2)  # a nested list is a tensor


def test_minus_inf_ranks_last_and_never_takes_a_native_column(llama, tok):
    text = "a few words of context here"
    scores = torch.full((1, len(text)), float("-inf"))
    scores[0, 10] = 1.0
    chosen, cache = _refreshed(llama, tok, text, _Returns(lambda p: scores[:, :p]), 6, whole_words=False)
    head = int(cache.translator.head_end[0])
    assert head >= 1 and chosen[0] >= head and 10 in chosen  # column 0 (native) is not "refreshed"
    assert len(set(chosen)) == 6 == cache.report().tokens_refreshed


def test_ranked_puts_eligible_columns_first_and_nan_last():
    scores = torch.tensor([[float("nan"), float("-inf"), 2.0, float("-inf"), 1.0]])
    eligible = torch.tensor([[True, True, False, True, True]])
    assert ranked(scores, eligible)[0].tolist() == [4, 0, 1, 3, 2]
    assert checked_scores(torch.tensor([[1.0, float("-inf")]]), 1, 2, _Returns(None)).dtype == torch.float32
