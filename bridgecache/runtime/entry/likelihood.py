"""Log-likelihoods of continuations after a cached prefix: how a chat or an evaluation scores replies.

A `Prefix` is a target cache holding a context plus the logits that predict the next token.
`score(target, prefix, rows, scored_from)` feeds each row after the prefix (one batch, right
padded) and sums the log-probabilities of its tokens from `scored_from` on; `score_rows` also
says whether each row is the target's greedy choice token by token (lm-evaluation-harness's
`is_greedy`). Both consume the prefix's cache (the forward appends to it): copy a prefix first to
score it twice.

Knows transformers' caches and forward; nothing about tasks, tokenizers or metrics.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs

__all__ = ["Prefix", "RowScore", "score", "score_rows"]


@dataclass
class Prefix:
    """cache: a transformers cache of the first `length` tokens (batch 1);
    last_logits: [1, vocab] float32, predicting token `length`; seconds: time to build both."""

    cache: DynamicCache
    last_logits: torch.Tensor
    length: int
    seconds: float

    def copy(self) -> Prefix:
        """An independent copy (scoring mutates the cache)."""
        return Prefix(copy.deepcopy(self.cache), self.last_logits, self.length, self.seconds)


def _device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


@dataclass(frozen=True)
class RowScore:
    """One scored row: logprob, the sum of log p of its scored tokens; tokens, their count;
    greedy, whether every scored token is the most likely one where it stands."""

    logprob: float
    tokens: int
    greedy: bool


def score(target, prefix: Prefix, rows: list[list[int]], scored_from: int = 0) -> list[tuple[float, int]]:
    """Per row: (sum of log p of tokens rows[r][scored_from:], their count); see `score_rows`."""
    return [(row.logprob, row.tokens) for row in score_rows(target, prefix, rows, scored_from)]


@torch.no_grad()
def score_rows(target, prefix: Prefix, rows: list[list[int]], scored_from: int = 0) -> list[RowScore]:
    """Per row, a `RowScore` of tokens rows[r][scored_from:], each row fed after the prefix.

    rows: token id lists (any lengths, each longer than `scored_from`). Token j of a row is predicted
    by the row's logits at j - 1, or by `prefix.last_logits` for j = 0. The unscored tokens every
    row starts with (a question before its choices) are fed once; the rest of the rows run as one
    batch: right padding never reaches a real token (attention is causal), so no mask is needed.
    A cache holding fewer rows than `prefix.length` (some context positions left out) puts the
    rows at positions `prefix.length` on all the same.
    """
    if any(len(row) <= scored_from for row in rows):
        raise ValueError("every row needs at least one scored token")
    n, cache, device = len(rows), prefix.cache, _device(target)
    shifted = cache.get_seq_length() != prefix.length  # rows sit after the whole context, cached or not
    shared = _shared(rows, scored_from) if n > 1 else 0
    before = prefix.last_logits[0:1]  # predicts the first token fed in the batch
    if shared:
        head = torch.tensor([rows[0][:shared]], device=device)
        positions = _positions(shifted, prefix.length, shared, 1, device)
        out = target(
            input_ids=head, use_cache=True, logits_to_keep=1, **positions, **cache_kwargs(target, cache)
        )
        before = out.logits[0, -1:].float()
    if n > 1:
        cache.batch_repeat_interleave(n)
    width = max(len(row) for row in rows) - shared
    ids = torch.zeros(n, width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row) - shared] = torch.tensor(row[shared:])
    ids = ids.to(device)
    # The last column predicts nothing we score: feed only what predicts a row token.
    logits = None
    if width > 1:
        positions = _positions(shifted, prefix.length + shared, width - 1, n, device)
        logits = target(
            input_ids=ids[:, :-1], use_cache=True, **positions, **cache_kwargs(target, cache)
        ).logits
    results = []
    for r, row in enumerate(rows):
        parts = [before]  # part k predicts token shared + k
        if logits is not None:
            parts.append(logits[r, : len(row) - shared - 1].float())
        logprobs = torch.log_softmax(torch.cat(parts)[scored_from - shared :], dim=-1)
        wanted = ids[r, scored_from - shared : len(row) - shared]
        total = logprobs.gather(-1, wanted[:, None]).sum()
        greedy = bool((logprobs.argmax(-1) == wanted).all())
        results.append(RowScore(float(total), len(row) - scored_from, greedy))
    return results


def _shared(rows: list[list[int]], scored_from: int) -> int:
    """How many leading tokens every row has in common, at most `scored_from` (none is scored)."""
    count = 0
    while count < scored_from and all(row[count] == rows[0][count] for row in rows):
        count += 1
    return count


def _positions(shifted: bool, start: int, length: int, batch: int, device) -> dict:
    """position_ids for `length` new tokens at `start` when the cache's length is not the position."""
    if not shifted:
        return {}
    return {"position_ids": torch.arange(start, start + length, device=device).expand(batch, -1)}
