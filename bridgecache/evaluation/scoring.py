"""Prefixes and log-likelihoods: the model-level primitives of an evaluation.

A `Prefix` is a target cache holding a context plus the logits that predict the next token.
    native_prefix(target, ids)                      the target prefills ids itself
    bridged_prefix(bridge, source_kv, target, ...)  BridgedCache + the forward over the columns it
                                                    leaves to the target (native tail, held-back token)
    chosen_prefix(target, ids, columns)             the target reads only `columns` of ids, at
                                                    their own positions (no other cache rows)
Both are timed up to the first logits after the context, the cost a handoff replaces (only the
last position's logits are computed: a 150K-token vocabulary head over every position would
add ~20% to a prefill that no serving system pays).
`score(target, prefix, rows, scored_from)` (bridgecache.runtime.entry.likelihood) then sums the
log-probabilities of each row's tokens after the prefix.

This module knows nothing about tasks, tokenizers or metrics.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.engine import HandoffEngine
from bridgecache.runtime.entry.likelihood import Prefix, score
from bridgecache.runtime.request import HandoffRequest

# Prefix, score: runtime.entry.likelihood's
__all__ = ["Prefix", "native_prefix", "bridged_prefix", "chosen_prefix", "score"]


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
    bridge,
    source_kv,
    target,
    ids: torch.Tensor,
    alignment=None,
    *,
    config=None,
    source_model=None,
    prompt_ids=None,
    words=None,
    engine=None,
) -> Prefix:
    """The target continues from `source_kv` translated through `bridge` with `config`.

    ids: [1, T] the context in the target's tokenization; source_model, prompt_ids, words: what the
    selection rule reads (BridgedCache). Through the engine's public calls: `engine.cache` (the
    plan and its cache) and `engine.prefill`. Timed: the source's reading, translation of every
    layer, and the target's forward over the native work and columns [P, T) (native tail +
    held-back token) that yields the logits after the context: one forward, which also does the
    cache's native work. engine: the `HandoffEngine` whose plans and graphs to use (None: a private
    one, without CUDA graphs, as a BridgedCache built alone has).
    A config that routes "auto" runs the handoff: this scores the bridge, and the cost gate's speed
    choice (a CPU engine times both routes) must not answer a scored item with the target's prefill.
    """
    config = HandoffConfig() if config is None else config
    if config.route == "auto":
        config = config.replace(route="handoff")
    if engine is None:
        engine = HandoffEngine(bridge, source_model, target, graph_bytes=0)
    ids = ids.to(_device(target))
    start = time.perf_counter()
    request = HandoffRequest.from_kv(source_kv, ids, alignment, words=words, source_prompt=prompt_ids)
    cache = engine.cache(request, config)
    logits = engine.prefill(cache, ids[:, cache.get_seq_length() :]).float()
    return Prefix(cache, logits, ids.shape[1], time.perf_counter() - start)


@torch.no_grad()
def chosen_prefix(target, ids: torch.Tensor, columns: torch.Tensor) -> Prefix:
    """The target reads only the context tokens at `columns` ([n] ascending, the last one the
    context's last column) of ids [1, T], each at its own position: a cache of n rows, the other
    positions never seen. Scoring after it places the rows at positions T on (`score`)."""
    length = ids.shape[1]
    if columns.numel() == 0 or int(columns[-1]) != length - 1 or bool((columns.diff() <= 0).any()):
        raise ValueError(
            f"chosen_prefix: columns {columns.tolist()[:8]}...; expected ascending columns ending at "
            f"the context's last one ({length - 1})"
        )
    device = _device(target)
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    out = target(
        input_ids=ids[:, columns].to(device),
        position_ids=columns[None].to(device),
        use_cache=True,
        logits_to_keep=1,
        **cache_kwargs(target, cache),
    )
    return Prefix(cache, out.logits[:, -1].float(), length, time.perf_counter() - start)
