"""`TokenSpans`: the byte range of a text that each token of one tokenization covers.

`token_spans(text, tokenizer)` tokenizes `text` and returns, per token, a half-open range of UTF-8
byte offsets into `text`. Spans are in bytes, not characters, because byte-level tokenizers split
one character over several tokens: within a character the tokens are ordered by their own byte
lengths, so a token holding the first bytes of an emoji ends before the token completing it.

Rules every `TokenSpans` obeys (the matcher in match.py relies on them):
- a token has text iff end > start; control tokens (BOS, chat markers) have none, and (0, 0);
- over tokens with text, start, end and reach never decrease (spans may overlap where tokens share
  a character whose bytes could not be divided among them);
- `reach` >= end adds the text no token covers that follows the token (a combining mark folded
  away by NFC, spaces a word-level tokenizer drops) up to the next token, text or control. As a
  SOURCE the token is read for that text too (its reader has seen everything before it, so reading
  it stays causal); as a TARGET a token claims only [start, end), so it never reads a source token
  for text it has not seen. Text before the first token or after the last belongs to none.

Spans come from a fast tokenizer's character offsets where they exist and describe the given ids;
otherwise from the tokenizer's own reconstruction of its text (vocab.py), carried onto `text` by a
`TextMap`. Knows nothing about alignment policies, KV caches or models.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from .textmap import TextMap
from .vocab import Vocab

__all__ = ["TokenSpans", "as_ids", "token_spans"]


@dataclass(frozen=True, eq=False)
class TokenSpans:
    """Per token, the byte range `[start, end)` of the text it covers and its `reach`; int64 `[tokens]`."""

    start: np.ndarray
    end: np.ndarray
    reach: np.ndarray | None = None  # defaults to end

    def __post_init__(self):
        as_int = partial(np.asarray, dtype=np.int64)
        reach = self.end if self.reach is None else self.reach
        start, end, reach = _tidy(as_int(self.start), as_int(self.end), as_int(reach))
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        object.__setattr__(self, "reach", reach)

    def __len__(self) -> int:
        return len(self.start)

    def has_text(self) -> np.ndarray:
        """bool `[tokens]`."""
        return self.end > self.start

    def project(self, textmap: TextMap) -> TokenSpans:
        """These spans (of text `a`) as spans of text `b` of `textmap`; tokens with no text keep none."""
        has = self.has_text()
        return TokenSpans(*(np.where(has, x, 0) for x in textmap.project(self.start, self.end, self.reach)))


def _tidy(start: np.ndarray, end: np.ndarray, reach: np.ndarray) -> tuple[np.ndarray, ...]:
    """Enforce the module rules: monotone over text tokens, (0, 0, 0) for the others."""
    has = end > start
    start, end, reach = (np.where(has, x, 0) for x in (start, end, reach))
    if has.any():
        idx = np.flatnonzero(has)
        start[idx] = np.maximum.accumulate(start[idx])
        end[idx] = np.maximum(np.maximum.accumulate(end[idx]), start[idx] + 1)
        reach[idx] = np.maximum(np.maximum.accumulate(reach[idx]), end[idx])
    return start, end, reach


def token_spans(
    text: str, tokenizer, ids: list[int] | None = None, *, add_special_tokens: bool = True
) -> tuple[list[int], TokenSpans]:
    """Tokenize `text` (or take `ids`, a tokenization of it) and give each token its byte span.

    Args:
        text: the text.
        tokenizer: a transformers tokenizer (fast or slow).
        ids: token ids the caller already has (may add or drop specials, or come from a chat
            template); when None, `tokenizer(text, add_special_tokens=...)` makes them.
        add_special_tokens: passed to the tokenizer when it makes the ids.
    Returns:
        (ids, spans): ids as a list of ints, spans of `len(ids)` tokens in bytes of `text`.
    """
    vocab = Vocab.of(tokenizer)
    ids = None if ids is None else as_ids(ids)
    encoded = _encode_with_offsets(tokenizer, text, add_special_tokens)
    if encoded is not None and (ids is None or ids == encoded[0]):
        made, offsets = encoded
        return made, _from_offsets(text, made, offsets, vocab)
    if ids is None:
        ids = as_ids(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    own_text, start, end = vocab.reconstruct(ids)
    return ids, TokenSpans(start, end).project(TextMap.diff(own_text, text.encode("utf-8", "surrogatepass")))


def as_ids(ids) -> list[int]:
    """One id sequence (list, numpy array, CPU tensor) as a list of ints."""
    array = np.asarray(ids, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"expected one sequence of token ids (1-D); got shape {array.shape}")
    return array.tolist()


def _encode_with_offsets(tokenizer, text: str, add_special_tokens: bool):
    """(ids, offsets [tokens, 2] in characters), or None for tokenizers without offsets."""
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return None
    offsets = enc.get("offset_mapping") if hasattr(enc, "get") else None
    if offsets is None:
        return None
    return as_ids(enc["input_ids"]), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


def _from_offsets(text: str, ids: list[int], offsets: np.ndarray, vocab: Vocab) -> TokenSpans:
    """Spans from character offsets: to bytes, divide shared characters, reach over uncovered text."""
    char_start = np.clip(offsets[:, 0], 0, len(text))
    char_end = np.clip(offsets[:, 1], char_start, len(text))
    byte_at = _byte_offsets(text)
    start, end = byte_at[char_start], byte_at[char_end]
    covers = char_end > char_start
    is_text = covers & ~vocab.control_mask(ids)
    _divide_shared_characters(ids, char_start, char_end, is_text, start, end, vocab)
    # A token reaches over uncovered text up to the next token that covers anything (text or control).
    covering = np.flatnonzero(covers)
    following = np.full(len(ids), -1, dtype=np.int64)
    following[covering[:-1]] = start[covering[1:]]
    return TokenSpans(*(np.where(is_text, x, 0) for x in (start, end, np.maximum(end, following))))


def _byte_offsets(text: str) -> np.ndarray:
    """int64 `[len(text) + 1]`: UTF-8 byte offset of each character position."""
    code = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    width = 1 + (code >= 0x80) + (code >= 0x800) + (code >= 0x10000)
    return np.concatenate([[0], np.cumsum(width, dtype=np.int64)])


def _divide_shared_characters(ids, char_start, char_end, is_text, start, end, vocab: Vocab) -> None:
    """In place: where consecutive text tokens share a character (a byte-level split), lay their
    pieces' bytes end to end from the group's first byte, if the pieces add up to exactly the
    group's bytes (they do not when normalisation changed the text; the spans then stay shared)."""
    tokens = np.flatnonzero(is_text)
    if len(tokens) < 2:
        return
    shares = char_start[tokens[1:]] < char_end[tokens[:-1]]  # token k shares with token k + 1
    if not shares.any():
        return
    edges = np.diff(np.concatenate([[0], shares.astype(np.int8), [0]]))
    for first, last in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
        group = tokens[first : last + 1]
        pieces = [vocab.piece(int(ids[k])) for k in group]
        if any(p is None for p in pieces):
            continue
        cut = start[group[0]] + np.cumsum([0] + [len(p) for p in pieces])
        if cut[-1] == end[group].max():
            start[group], end[group] = cut[:-1], cut[1:]
