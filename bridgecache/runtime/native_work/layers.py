"""Exact target KV for chosen layers of a context: the target's own forward, stopped early.

    native_layer_kv(target, ids, mask, layers={0, 1})   -> {layer: (keys, values)}

The target runs over the context and the forward is stopped right after the cache update of the
deepest requested layer: layers above it are never computed, and the deepest layer costs only its
key/value projections (no attention, no MLP). Layer 0's keys and values depend on each token
alone (embedding, norm, projections, RoPE), so `{0}` costs a small fraction of one layer.
Layers in between that were not asked for are computed (they feed the deeper ones) but dropped.

This module knows nothing about bridges or tokenizers.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs
from bridgecache.kv.capture import position_ids_from_mask
from bridgecache.kv.rope import kept_rotary
from bridgecache.runtime.config import resolve_native_layers  # re-exported: its home is the config's

__all__ = ["native_layer_kv", "resolve_native_layers"]


class _StopForward(Exception):
    """Raised from the cache once the deepest wanted layer has stored its keys and values."""


class _StoppingCache(DynamicCache):
    """A config-less DynamicCache (every layer keeps every token) that ends the forward early."""

    def __init__(self, stop_after: int):
        super().__init__()
        self.stop_after = stop_after

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx >= self.stop_after:
            raise _StopForward
        return out


@torch.no_grad()
def native_layer_kv(
    target, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The target's own keys/values of `layers` over `input_ids`.

    Args:
        input_ids: [batch, tokens] the context columns to compute (left-padded for batch > 1).
        attention_mask: [batch, tokens] 0/1.
        layers: target layer indices (any order; empty: nothing is computed).
    Returns:
        {layer: (keys, values)} each [batch, kv_heads, tokens, head_dim], keys post-RoPE, exactly
        as the target's own prefill of these tokens caches them (a rope type whose tables depend
        on the forward's length is moved to the pass's length there: `Translator.retable`).
    """
    layers = sorted(set(layers))
    if not layers or input_ids.shape[1] == 0:
        return {}
    device = target.get_input_embeddings().weight.device
    mask = attention_mask.to(device)
    cache = _StoppingCache(stop_after=layers[-1])
    # the forward ends at the deepest wanted layer; the model's rotary module is left as it was
    with kept_rotary(target), contextlib.suppress(_StopForward):
        target(
            input_ids=input_ids.to(device),
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(target, cache),
        )
    return {i: (cache.layers[i].keys, cache.layers[i].values) for i in layers}
