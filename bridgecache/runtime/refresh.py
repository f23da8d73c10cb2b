"""Selective token refresh: recompute a few context tokens through every target layer.

A bridged cache is approximate for every translated token. Refresh picks a budget of context
columns, runs the target over those tokens alone at their true positions, attending to the whole
cache (native head + translated rows + the refreshed rows of this very pass), and writes the fresh
keys/values over the translated rows of every layer. Refreshing every translated column
reproduces the target's own prefill (each layer's rows are overwritten before its attention
reads them), so the budget is a dial from "translated" to "exact".

Which columns: scores per target column, higher first (bridgecache.runtime.guides makes them);
`select_columns` takes the budget's best.

This module knows nothing about bridges or tokenizers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs

__all__ = ["refresh_budget", "select_columns", "refresh_columns"]


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
