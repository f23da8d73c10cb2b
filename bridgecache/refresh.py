"""Selective token refresh: recompute a few context tokens through every target layer.

A bridged cache is approximate for every translated token. Refresh picks a budget of context
columns, runs the target over those tokens alone at their true positions, attending to the whole
cache (native head + translated rows + the refreshed rows of this very pass), and writes the fresh
keys/values over the translated rows of every layer. Refreshing every translated column
reproduces the target's own prefill (each layer's rows are overwritten before its attention
reads them), so the budget is a dial from "translated" to "exact".

Which columns (scores per target column; higher = refresh first):
    deviation_scores       how far translated keys are from the target's own keys at a cheap
                           check layer (CacheBlend's criterion; LMCache recomputes by it)
    source_attention_scores + scores_on_target
                           the source has read the context: let it read the prompt (or the
                           context's last tokens) over its own cache and take the context tokens
                           its attention picks out (CacheClip's helper-model criterion)

This module knows nothing about bridges or tokenizers (an alignment is read as index arrays).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs
from bridgecache.fitting.attention import QueryRecorder, attention_modules

__all__ = [
    "refresh_budget",
    "select_columns",
    "refresh_columns",
    "deviation_scores",
    "source_attention_scores",
    "scores_on_target",
    "source_guided_scores",
]


def refresh_budget(refresh, eligible: int) -> int:
    """Tokens to refresh: `refresh` is a fraction in [0, 1] of the `eligible` (translated)
    tokens, or an int token count (capped at `eligible`)."""
    if refresh is None:
        return 0
    if isinstance(refresh, bool) or not isinstance(refresh, (int, float)):
        raise ValueError(f"refresh={refresh!r}; expected a fraction in [0, 1] or a token count")
    if isinstance(refresh, float):
        if not 0.0 <= refresh <= 1.0:
            raise ValueError(f"refresh={refresh}; a fraction must lie in [0, 1] (an int is a token count)")
        return min(eligible, round(refresh * eligible))
    if refresh < 0:
        raise ValueError(f"refresh={refresh}; expected a token count >= 0")
    return min(eligible, refresh)


def select_columns(scores: torch.Tensor, eligible: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` highest-scoring eligible columns of each row, in ascending column order.

    scores: [batch, tokens] float; eligible: [batch, tokens] bool. Returns [batch, budget] int64.
    """
    if budget == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    masked = torch.where(eligible, scores.float(), float("-inf"))
    top = masked.topk(budget, dim=1).indices
    return top.sort(dim=1).values


class _ScatterCache(DynamicCache):
    """Writes each layer's new keys/values over given columns of another cache's layers.

    The refresh forward's tokens sit INSIDE the cached prefix, not after it: `update` replaces
    rows `columns` of the shared layer and hands the attention the whole layer, so the refreshed
    tokens attend to each other's fresh rows of this very layer (never mutating tensors in place:
    translated tensors may be shared with memos).

    A sliding-window layer keeps only context columns [kept, prefix), but a refreshed token's
    window may reach back to column `start` < kept: the attention then sees columns
    [start, prefix) (the dropped ones read through `read_columns`), and the layer keeps only its
    own rows afterwards (a refreshed column before `kept` is seen by the other refreshed tokens
    of this pass, never stored)."""

    def __init__(self, layers, columns: torch.Tensor, spans, read_columns):
        super().__init__()
        self.layers = layers
        self.columns = columns  # [batch, n] on the cache's device
        self.spans = spans  # per layer: (start, kept) context columns, as above (0, 0: every column)
        self.read_columns = read_columns

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        start, kept = self.spans[layer_idx]
        # Read the dropped columns first: reading the layer may consume what they come from.
        earlier = self.read_columns(layer_idx, start, kept) if start < kept else None
        keys, values = layer.keys, layer.values  # materialises a lazy layer: columns [kept, prefix)
        if earlier is not None:
            keys = torch.cat([earlier[0].to(keys.device, keys.dtype), keys], dim=2)
            values = torch.cat([earlier[1].to(values.device, values.dtype), values], dim=2)
        index = (self.columns.to(keys.device) - start)[:, None, :, None]
        keys = keys.scatter(2, index.expand(-1, keys.shape[1], -1, keys.shape[3]), key_states.to(keys.dtype))
        values = values.scatter(
            2, index.expand(-1, values.shape[1], -1, values.shape[3]), value_states.to(values.dtype)
        )
        layer.keys, layer.values = keys[:, :, kept - start :], values[:, :, kept - start :]
        return keys, values


def _refresh_mask(columns: torch.Tensor, real: torch.Tensor, start: int, window, dtype) -> torch.Tensor:
    """Additive mask [batch, 1, n, prefix - start]: query i (column c_i) sees key column j of
    [start, prefix) iff j is a real token, j <= c_i and, in a sliding-window layer,
    c_i - window < j (transformers' sliding window)."""
    keys = torch.arange(start, real.shape[1], device=columns.device)[None, None, :]
    allowed = (keys <= columns[:, :, None]) & real.bool()[:, None, start:]
    if window is not None:
        allowed &= columns[:, :, None] - keys < window
    additive = torch.zeros(allowed.shape, dtype=dtype, device=columns.device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def _refresh_masks(config, windows, spans, columns, real, dtype):
    """The refresh forward's `attention_mask`: one 4D mask when every layer attends alike, else
    transformers' mapping {layer type: 4D mask} (Gemma 3's full and sliding layers). Either form
    is used as is by the model (transformers 5.17 and 5.24), never rebuilt from the cache."""
    masks = {}  # window -> mask (layers of one window share their span)
    for window, (start, _) in zip(windows, spans):
        if window not in masks:
            masks[window] = _refresh_mask(columns, real, start, window, dtype)
    if len(masks) == 1:
        return next(iter(masks.values()))
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None)
    by_type = {}
    for i, window in enumerate(windows):
        kind = layer_types[i] if layer_types else None
        if by_type.setdefault(kind, window) != window:
            raise ValueError(
                f"target layers of type {kind!r} use different sliding windows; token refresh needs one "
                "window per layer type"
            )
    return {kind: masks[window] for kind, window in by_type.items()}


@torch.no_grad()
def refresh_columns(
    target,
    layers,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    columns: torch.Tensor,
    *,
    read_columns=None,
) -> None:
    """Recompute the KV of `columns` through every target layer, in place of the cached rows.

    Args:
        layers: the target cache's layers, each holding context columns [0, prefix), or, a
            sliding-window layer (`sliding_window` w), only the columns its window keeps,
            [max(0, prefix - w + 1), prefix): those rows are rewritten, refreshed columns
            before them are not stored there.
        input_ids, attention_mask: [batch, prefix] the cached context columns (left padding: 0).
        columns: [batch, n] int64 columns to refresh, ascending, all inside [0, prefix).
        read_columns: (layer, start, stop) -> (keys, values) [batch, kv_heads, stop - start,
            head_dim], the cache's KV of context columns [start, stop) that a sliding layer no
            longer keeps; needed when a refreshed column's window reaches before a sliding
            layer's rows.
    """
    if columns.shape[1] == 0:
        return
    device = target.get_input_embeddings().weight.device
    dtype = target.get_input_embeddings().weight.dtype
    mask = attention_mask.to(device)
    columns = columns.to(device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    prefix = input_ids.shape[1]
    first = int(columns.min())
    windows = [getattr(layer, "sliding_window", None) for layer in layers]
    spans = []  # per layer (start, kept): the refresh attends to columns [start, prefix)
    for window in windows:
        if window is None:
            spans.append((0, 0))
        else:  # transformers' sliding layer keeps the last window - 1 columns
            kept = max(0, prefix - (window - 1))
            spans.append((min(kept, max(0, first - (window - 1))), kept))
    if read_columns is None and any(start < kept for start, kept in spans):
        raise ValueError(
            f"refreshing column {first} reads columns that a sliding-window layer no longer keeps; "
            "pass read_columns= (BridgedCache does)"
        )
    target(
        input_ids=input_ids.to(device).gather(1, columns),
        attention_mask=_refresh_masks(target.config, windows, spans, columns, mask, dtype),
        position_ids=positions.gather(1, columns),
        use_cache=True,
        logits_to_keep=1,
        **cache_kwargs(target, _ScatterCache(layers, columns, spans, read_columns)),
    )


def deviation_scores(translated_keys: torch.Tensor, native_keys: torch.Tensor) -> torch.Tensor:
    """[batch, tokens] squared distance between translated and native keys of one layer, summed
    over heads and dimensions. Both [batch, kv_heads, tokens, head_dim] (post-RoPE: RoPE is a
    rotation, so the distance is that of the un-rotated keys)."""
    return (translated_keys.float() - native_keys.float()).pow(2).sum(dim=(1, 3))


@torch.no_grad()
def source_attention_scores(
    source,
    keys,
    values,
    positions: torch.Tensor,
    query_ids: torch.Tensor,
    context_tokens: int,
    last_queries: int | None = None,
) -> torch.Tensor:
    """How much the source's attention from `query_ids` falls on each context token.

    The source reads `query_ids` [batch, q] right after the first `context_tokens` rows of its own
    cache (keys/values per layer [batch, kv_heads, >= context_tokens, head_dim], positions
    [batch, >= context_tokens]); the caller's tensors are never modified (a fresh cache holds
    views). last_queries: count only the last this many query tokens (None: all). Returns
    [batch, context_tokens] float32: attention probabilities summed over layers, query heads
    and the counted queries.
    """
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[:, :, :context_tokens], v[:, :, :context_tokens], layer)
    device = source.get_input_embeddings().weight.device
    q = query_ids.shape[1]
    start = positions[:, context_tokens - 1 : context_tokens].to(device) + 1
    query_positions = start + torch.arange(q, device=device)[None]
    rows = torch.arange(q)
    with QueryRecorder(source, rows) as recorder:
        source(
            input_ids=query_ids.to(device),
            position_ids=query_positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(source, cache),
        )
    total = torch.zeros(query_ids.shape[0], context_tokens, device=device)
    for module in attention_modules(source):
        queries = recorder.queries[module.layer_idx]  # [batch, q_heads, q, d]
        k = cache.layers[module.layer_idx].keys.float()  # [batch, kv_heads, context + q, d]
        group = queries.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        logits = (queries @ k.transpose(-1, -2)) * module.scaling
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        # Query j sits at column context_tokens + j: causal over the prompt's own keys.
        key_col = torch.arange(k.shape[2], device=device)[None, :]
        allowed = key_col <= context_tokens + torch.arange(q, device=device)[:, None]
        window = getattr(module, "sliding_window", None)
        if window:
            allowed &= (context_tokens + torch.arange(q, device=device)[:, None]) - key_col < window
        attn = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        counted = attn if last_queries is None else attn[:, :, -last_queries:]
        total += counted[..., :context_tokens].sum(dim=(1, 2))
    return total


def scores_on_target(source_scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Source-token scores [batch, S] carried to target columns: [batch, T] where rows [batch, T]
    names the source token read by each target column (-1: none, score 0)."""
    gathered = source_scores.gather(1, rows.clamp(min=0).to(source_scores.device))
    return torch.where(rows.to(source_scores.device) >= 0, gathered, 0.0)


def source_guided_scores(
    source,
    source_kv,
    source_rows: torch.Tensor,
    *,
    query_ids: torch.Tensor | None = None,
    context_ids: torch.Tensor | None = None,
    recent: int = 16,
    spread: int = 0,
    last_queries: int | None = None,
) -> torch.Tensor:
    """Scores per TARGET column from the source's attention (for `BridgedCache(refresh_by=...)`).

    Args:
        source: the source model; source_kv: its `SourceKV` of the context (every row kept).
        source_rows: [batch, target tokens] the source token each target column reads (-1: none).
        query_ids: [batch, q] what the source reads after the context (the prompt, in the source's
            tokens). Without it, the source's last `recent` context tokens (`context_ids`
            [1, source tokens]) read the context before them, and those recent tokens score
            highest themselves (a continuation depends on them most).
        spread: each token's score also reaches its `spread` neighbours on either side (a running
            max), so a refresh picks whole spans around what the source attended to.
        last_queries: count the attention of only the prompt's last this many tokens (where an
            answer is read out, e.g. "Answer:"); None: every prompt token.
    Returns:
        [batch, target tokens] float32 on the CPU.
    """
    if any(source_kv.first_token):
        raise ValueError("source-guided refresh needs every source row: capture the source with capture_kv")
    tokens = source_kv.num_tokens
    if query_ids is not None and query_ids.shape[1] > 0:
        scores = source_attention_scores(
            source, source_kv.keys, source_kv.values, source_kv.position_ids, query_ids, tokens, last_queries
        )
    else:
        if context_ids is None or context_ids.shape != (1, tokens):
            raise ValueError(
                "source-guided refresh without a prompt needs the source's context ids [1, source tokens]"
            )
        recent = min(recent, tokens - 1)
        if recent <= 0:
            return torch.zeros(source_rows.shape)
        scores = source_attention_scores(
            source,
            source_kv.keys,
            source_kv.values,
            source_kv.position_ids,
            query_ids=context_ids[:, tokens - recent :],
            context_tokens=tokens - recent,
        )
        top = float(scores.max()) + 1.0
        scores = torch.nn.functional.pad(scores, (0, recent), value=top)
    scores = scores_on_target(scores.float().cpu(), source_rows.cpu())
    if spread > 0:
        scores = torch.nn.functional.max_pool1d(scores[:, None], 2 * spread + 1, stride=1, padding=spread)[
            :, 0
        ]
    return scores
