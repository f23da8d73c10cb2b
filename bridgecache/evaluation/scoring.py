"""Prefixes and log-likelihoods: the model-level primitives of an evaluation.

A `Prefix` is a target cache holding a context plus the logits that predict the next token.
    native_prefix(target, ids)                      the target prefills ids itself
    bridged_prefix(bridge, source_kv, target, ...)  BridgedCache + the forward over the columns it
                                                    leaves to the target (native tail, held-back token)
Both are timed up to the first logits after the context, the cost a handoff replaces (only the
last position's logits are computed: a 150K-token vocabulary head over every position would
add ~20% to a prefill that no serving system pays).
`score(target, prefix, rows, scored_from)` then feeds each row after the prefix (one batch, right
padded) and sums the log-probabilities of its tokens from `scored_from` on. It consumes the
prefix's cache (the forward appends to it): copy a prefix first to score it twice.

This module knows nothing about tasks, tokenizers or metrics.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs
from bridgecache.runtime.cache import BridgedCache

__all__ = ["Prefix", "native_prefix", "bridged_prefix", "score"]


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


@torch.no_grad()
def native_prefix(target, ids: torch.Tensor) -> Prefix:
    """The target prefills ids [1, T] itself (a cache honouring its sliding windows, as generate's)."""
    ids = ids.to(_device(target))
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    out = target(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(target, cache))
    logits = out.logits[:, -1].float()
    return Prefix(cache, logits, ids.shape[1], time.perf_counter() - start)


@torch.no_grad()
def bridged_prefix(
    bridge, source_kv, target, ids: torch.Tensor, alignment=None, *, guide=None, **cache_options
) -> Prefix:
    """The target continues from `source_kv` translated through `bridge`.

    ids: [1, T] the context in the target's tokenization. cache_options: BridgedCache's keywords
    (native_head, native_tail, key_norm, native_layers, refresh, refresh_by, min_quality).
    guide: a callable returning refresh scores [1, T] (the source reading the prompt), timed as
    part of the handoff. Timed: scores, translation of every layer, the native work, and the
    forward over columns [P, T) (native tail + held-back token) that yields the logits after the
    context.
    """
    ids = ids.to(_device(target))
    start = time.perf_counter()
    if guide is not None:
        cache_options["refresh_by"] = guide()
    cache = BridgedCache(bridge, source_kv, target, ids, alignment=alignment, **cache_options)
    first = cache.get_seq_length()
    out = target(input_ids=ids[:, first:], use_cache=True, logits_to_keep=1, **cache_kwargs(target, cache))
    logits = out.logits[:, -1].float()
    return Prefix(cache, logits, ids.shape[1], time.perf_counter() - start)


@torch.no_grad()
def score(target, prefix: Prefix, rows: list[list[int]], scored_from: int = 0) -> list[tuple[float, int]]:
    """Per row: (sum of log p of tokens rows[r][scored_from:], their count), each row fed after the prefix.

    rows: token id lists (any lengths, each longer than `scored_from`). Token j of a row is predicted
    by the row's logits at j - 1, or by `prefix.last_logits` for j = 0. Rows run as one batch:
    right padding never reaches a real token (attention is causal), so no mask is needed.
    """
    if any(len(row) <= scored_from for row in rows):
        raise ValueError("every row needs at least one scored token")
    n, width = len(rows), max(len(row) for row in rows)
    cache = prefix.cache
    if n > 1:
        cache.batch_repeat_interleave(n)
    ids = torch.zeros(n, width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
    ids = ids.to(_device(target))
    # The last column predicts nothing we score: feed only what predicts a row token.
    logits = (
        target(input_ids=ids[:, :-1], use_cache=True, **cache_kwargs(target, cache)).logits
        if width > 1
        else None
    )
    results = []
    for r, row in enumerate(rows):
        parts = [prefix.last_logits[0:1]]
        if logits is not None:
            parts.append(logits[r, : len(row) - 1].float())
        logprobs = torch.log_softmax(torch.cat(parts)[scored_from:], dim=-1)
        wanted = ids[r, scored_from : len(row)]
        total = logprobs.gather(-1, wanted[:, None]).sum()
        results.append((float(total), len(row) - scored_from))
    return results
