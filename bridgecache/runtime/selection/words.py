"""Whole words for a refresh: a chosen token brings the rest of its word or number with it.

A selection rule scores context tokens one by one. Numbers split into many tokens (Qwen2.5 and
SmolLM2 give each digit its own), so a refresh can stop inside an answer, "916375|8", and the
target then reads the last digit from a translated row. With whole words (`RefreshConfig`'s
whole_words: None, the default, wherever the context's words are known; True always) a token's
score becomes the best score of the word it belongs to, on BOTH sides of an alignment: over the
source's words before the scores cross to the target's columns (`SourceAttention`), then over the
target's words (the plan: `word_ranking`); the selection then takes each word whole, except at
most the last one the budget reaches, and that one by its best tokens. With word ends
(`RefreshConfig.word_ends`, the default) the token after each word then takes the word's score
too, so a refreshed number ends where the context ends it; a word that token opens comes whole,
so an end never splits a word either. Pooling never overrides the selector's ranking: a word
keeps at most MAX_WORD_TOKENS tokens together (a CJK run without spaces or a base64 blob
splits), equal word scores are ordered by word, then by each token's own score.

    word_groups(text, tokenizer, ids)         int64 [tokens] the word each token belongs to
    word_groups(text, spans=spans)            the same from byte spans already made (no tokenizer call)
    ContextWords.rows(source, target)         per-row groups, left-padded like the cache's rows
    ContextWords.of(texts..., ids...)         word_groups of each row on each side, then .rows
    ContextWords.stack(rows)                  one batch from each row's own ContextWords
    context_words(text, s_tok, t_tok, s, t)   ContextWords of one plain-text context (batch 1)
    pool_words(scores, groups)                [batch, tokens] each token scored as its word's best
    reach_word_ends(scores, groups)           [batch, tokens] the token after each word (and the word
                                              it opens) scored as the word
    word_ranking(scores, groups, ends=True)   [batch, tokens] ranking keys the selection sorts by

A word is a maximal run of letters, digits and underscores (any non-ASCII byte counts as a
letter), cut after MAX_WORD_TOKENS tokens; two neighbouring tokens share a word when they touch
and the characters on both sides of the boundary are word characters. Byte spans come from
tokenalign (offsets of fast tokenizers, else the tokenizer's own reconstruction), so
chat-template ids with specials work too.

Knows tokenizers (through tokenalign) and score tensors; nothing about bridges, caches or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "MAX_WORD_TOKENS",
    "ContextWords",
    "word_groups",
    "context_words",
    "pool_words",
    "reach_word_ends",
    "word_ranking",
]

_WORD_BYTES = np.zeros(256, dtype=bool)
for _byte in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_":
    _WORD_BYTES[_byte] = True
_WORD_BYTES[0x80:] = True  # UTF-8 bytes of non-ASCII characters: letters of other scripts
# The most tokens one word keeps together. Without a bound a run of CJK text without spaces,
# or a base64 blob, is one "word" longer than the budget, and whole-word refresh then takes its
# earliest columns instead of the one the selector ranked first. 16 keeps every number a
# tokenizer writes digit by digit up to 16 digits whole (word ends join a longer one's rest).
MAX_WORD_TOKENS = 16


def word_groups(
    text: str, tokenizer=None, ids=None, *, spans=None, max_tokens: int | None = MAX_WORD_TOKENS
) -> np.ndarray:
    """int64 [tokens]: a group id per token of `ids` (a tokenization of `text`, specials allowed),
    non-decreasing from 0, shared by the tokens of one word; a token without text is its own group.
    spans: the tokens' byte spans in `text` (`tokenalign.TokenSpans`) when the caller has them
    (tokenizer and ids are then not needed); else tokenalign computes them (a tokenizer call).
    max_tokens: a word of more tokens splits into runs of that many (None: never); see
    MAX_WORD_TOKENS."""
    if spans is None:
        from tokenalign import token_spans

        _, spans = token_spans(text, tokenizer, ids)
    if len(spans) == 0:
        return np.zeros(0, dtype=np.int64)
    # word[b + 1]: whether byte b of the text is a word byte; word[0] (before the text) is not.
    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    word = np.concatenate([[False], _WORD_BYTES[data]])
    first = np.clip(spans.start[1:], 0, len(data))  # each token's first byte, from the second token
    before, at = word[first], word[np.minimum(first + 1, len(data))]  # bytes first - 1 and first
    # A token continues the previous one's word when it touches it and both sides are word bytes.
    # Tokens without text span (0, 0) (TokenSpans) and nothing precedes byte 0, so a token without
    # text neither continues a word nor is continued.
    opens = np.concatenate([[True], ~((first <= spans.end[:-1]) & before & at)])
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}; expected an int >= 1 or None")
        index = np.arange(len(opens))
        offset = index - np.maximum.accumulate(np.where(opens, index, 0))  # position within the word
        opens |= offset % max_tokens == 0
    return np.cumsum(opens, dtype=np.int64) - 1


@dataclass(frozen=True)
class ContextWords:
    """The context's words on both sides: source [batch, S] int64, one group per row of the
    source's KV (its token axis, left padding included); target [batch, T] int64, one per target
    column. Groups are non-decreasing within a row; each padding token is a group of its own."""

    source: torch.Tensor
    target: torch.Tensor

    @classmethod
    def rows(cls, source: list[np.ndarray], target: list[np.ndarray]) -> ContextWords:
        """From per-row groups (`word_groups` of each row's unpadded tokens), left-padded to the
        longest row on each side as `handoff_batch` pads ids."""
        return cls(_left_padded(source), _left_padded(target))

    def to(self, device) -> ContextWords:
        """Both sides on `device`; to a GPU from pinned memory, so that the copies join the stream
        instead of waiting for the work already queued on it (as copies from pageable memory do)."""
        device = torch.device(device)

        def move(side: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda" and side.device.type == "cpu":
                side = side.pin_memory()
            return side.to(device, non_blocking=True)

        return ContextWords(move(self.source), move(self.target))

    @classmethod
    def stack(cls, rows: list[ContextWords]) -> ContextWords:
        """The ContextWords of a batch from each row's own (batch 1, unpadded), left-padded."""
        return cls.rows([w.source[0].numpy() for w in rows], [w.target[0].numpy() for w in rows])

    @classmethod
    def of(cls, source_texts, target_texts, source_tokenizer, target_tokenizer, source_rows, target_rows):
        """Each row's words on each side: source_texts[b] is what source_rows[b] (unpadded ids,
        [1, n] or [n]) tokenizes (a chat: that side's rendering), likewise for the target. One
        side's words serve both when both sides are the same texts, tokenizer and ids."""

        def ids(rows):
            return [torch.as_tensor(row).reshape(-1).tolist() for row in rows]

        source_ids, target_ids = ids(source_rows), ids(target_rows)
        source = [word_groups(t, source_tokenizer, i) for t, i in zip(source_texts, source_ids, strict=True)]
        same = source_tokenizer is target_tokenizer and list(source_texts) == list(target_texts)
        if same and source_ids == target_ids:
            return cls.rows(source, source)
        target = [word_groups(t, target_tokenizer, i) for t, i in zip(target_texts, target_ids, strict=True)]
        return cls.rows(source, target)


def _left_padded(groups: list[np.ndarray]) -> torch.Tensor:
    width = max(len(g) for g in groups)
    out = torch.empty(len(groups), width, dtype=torch.long)
    for b, g in enumerate(groups):
        pad = width - len(g)
        out[b, :pad] = torch.arange(pad)
        out[b, pad:] = torch.as_tensor(np.asarray(g, dtype=np.int64)) + pad
    return out


def context_words(text: str, source_tokenizer, target_tokenizer, source_ids, target_ids) -> ContextWords:
    """ContextWords of one context `text`; source_ids [1, S], target_ids [1, T]: `text` as each
    model reads it."""
    return ContextWords.of([text], [text], source_tokenizer, target_tokenizer, [source_ids], [target_ids])


def pool_words(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """scores [batch, tokens], groups [batch, tokens] int64 (non-decreasing per row) -> each
    token's score replaced by the maximum over its group (same shape and dtype)."""
    groups = groups.to(scores.device)
    if groups.shape != scores.shape:
        shapes = f"{tuple(groups.shape)} for scores of shape {tuple(scores.shape)}"
        raise ValueError(f"word groups of shape {shapes}; expected one group per scored token")
    best = torch.full_like(scores, float("-inf"))  # a row has at most `tokens` groups
    best = best.scatter_reduce(1, groups, scores, reduce="amax")
    return best.gather(1, groups)


def reach_word_ends(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """scores [batch, tokens] pooled over words (`pool_words`), groups [batch, tokens] int64 ->
    the same with each group's score lent to the token after it when higher (`RefreshConfig`'s
    word_ends), and a word so entered scored whole: a refreshed number then ends where the
    context ends it, and an end never splits the word it enters. A group is a word or number, or
    one token outside words (punctuation, spaces, specials), which then brings its next token
    too: " the year " chosen brings all of "1987", never "1" alone (the target would read "987"
    from translated rows, and prefers a year refreshed whole). The chain stops at the entered
    word: its own end is not added. A column scored -inf (padding, each padding token its own
    group) lends nothing.
    Without ends the token after "8561971" is a translated row, and a model copying the number
    reads on past its end ("85619711"). The stable sort of the selection takes a word before its
    end (earlier column)."""
    groups = groups.to(scores.device)
    if groups.shape != scores.shape:
        shapes = f"{tuple(groups.shape)} for scores of shape {tuple(scores.shape)}"
        raise ValueError(f"word groups of shape {shapes}; expected one group per scored token")
    starts = groups[:, 1:] != groups[:, :-1]  # token t + 1 opens a new group
    lent = torch.where(starts, torch.maximum(scores[:, 1:], scores[:, :-1]), scores[:, 1:])
    return pool_words(torch.cat([scores[:, :1], lent], dim=1), groups)


def word_ranking(
    scores: torch.Tensor, groups: torch.Tensor, *, ends: bool, first_column=None
) -> torch.Tensor:
    """scores [batch, tokens] float (a selector's, checked: -inf ranks last), groups [batch,
    tokens] int64 -> [batch, tokens] float32 ranking keys, higher taken first, that take words
    whole without overriding the selector's ranking:
        1. a word's best score (`pool_words`; with `ends`, also lent to the token after it and
           the word that token opens: `reach_word_ends`), higher first;
        2. equal best scores: the earlier word first (a word, then the word its end enters);
        3. within a word: the token's own score, higher first (a budget that stops inside a
           word keeps the word's best tokens, not its earliest ones);
        4. then the earlier column.
    A column scored -inf keeps -inf (a word never lifts it); so do the columns before each row's
    `first_column` ([batch] int64: left padding), which also lend nothing."""
    scores = scores.float()
    if first_column is not None:
        columns = torch.arange(scores.shape[1], device=scores.device)[None]
        scores = scores.masked_fill(columns < first_column.to(scores.device)[:, None], float("-inf"))
    pooled = pool_words(scores, groups)
    if ends:
        pooled = reach_word_ends(pooled, groups)
    pooled = pooled.masked_fill(scores == float("-inf"), float("-inf"))
    groups = groups.to(scores.device)
    # A lexicographic order by stable sorts, the least significant key first (column order is
    # where each stable sort starts).
    order = scores.argsort(dim=1, descending=True, stable=True)
    order = order.gather(1, groups.gather(1, order).argsort(dim=1, stable=True))
    order = order.gather(1, pooled.gather(1, order).argsort(dim=1, descending=True, stable=True))
    tokens = scores.shape[1]
    places = torch.arange(tokens, 0, -1, device=scores.device, dtype=torch.float32).expand_as(scores)
    rank = torch.empty_like(scores).scatter_(1, order, places)
    return rank.masked_fill(pooled == float("-inf"), float("-inf"))
