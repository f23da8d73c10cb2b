"""Compiled decoding over a handed-over context: the KV of a cache copied into a transformers
`StaticCache`, whose fixed buffers `torch.compile` and CUDA graphs need.

    static = bridged.to_static(max_cache_len=ids.shape[1] + 64)   # BridgedCache -> StaticCache
    target.forward = torch.compile(target.forward, mode="reduce-overhead")
    out = target.generate(ids, past_key_values=static, max_new_tokens=64, disable_compile=True)

(`cache=static` on transformers >= 5.24; `disable_compile=True` because the forward is compiled
already: without it, generate() compiles its own copy for the decoding steps on CUDA.)

generate() sees a cache that already holds the context's prefix and feeds only the rest (the
held-back last token, the native tail, a prompt), exactly as with the dynamic cache: the same
greedy tokens. With the forward compiled, the held-back token's forward and every decoding step
run as one compiled graph of fixed shapes ([batch, 1] tokens over [batch, heads, max_cache_len,
head_dim] buffers), so they stop being bound by kernel launches. A serving loop keeps one
StaticCache per shape and refills it for each handoff (`into=`): its buffers keep their
addresses, so the compiled graph is reused instead of recorded again.

Full-attention target layers only: transformers' static sliding-window layers keep a rolling
buffer whose position bookkeeping differs between releases, so targets with sliding-window layers
(Gemma 3) are refused by name.

Knows nothing about bridges or how the KV were made: it copies per-layer tensors.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

__all__ = ["fill_static"]


def fill_static(
    layers_kv: list[tuple[torch.Tensor, torch.Tensor]],
    config,
    max_cache_len: int,
    *,
    into: StaticCache | None = None,
) -> StaticCache:
    """A StaticCache holding `layers_kv` at positions [0, tokens).

    Args:
        layers_kv: per target layer (keys, values) [batch, kv_heads, tokens, head_dim], one
            token count, dtype and device for every layer (read only); (None, None) for every
            layer of an empty cache.
        config: the target model's config (its layer types pick the static layer classes).
        max_cache_len: tokens the static buffers hold: the context plus everything generate()
            will add (prompt, held-back token, new tokens).
        into: a StaticCache made earlier for the same model, batch and max_cache_len, refilled in
            place (its buffers keep their addresses, so a compiled forward is not recorded
            again); None makes a new one.
    Returns:
        the StaticCache (`into` when given) with `get_seq_length() == tokens`.
    """
    if not layers_kv:
        raise ValueError("layers_kv is empty: expected one (keys, values) per target layer")
    if any(keys is None for keys, _ in layers_kv):  # an empty cache (a context of 0-1 tokens)
        static = into if into is not None else StaticCache(config=config, max_cache_len=max_cache_len)
        static.reset()
        return static
    tokens = layers_kv[0][0].shape[2]
    if max_cache_len <= tokens:
        raise ValueError(
            f"max_cache_len={max_cache_len}, but the cache already holds {tokens} tokens: expected "
            f"more than {tokens} (room for the held-back token and what generate() adds)"
        )
    static = into if into is not None else StaticCache(config=config, max_cache_len=max_cache_len)
    if len(static.layers) != len(layers_kv):
        raise ValueError(f"the StaticCache has {len(static.layers)} layers; the cache {len(layers_kv)}")
    destinations, sources = [], []
    for i, (layer, (keys, values)) in enumerate(zip(static.layers, layers_kv)):
        if type(layer) is not StaticLayer:
            raise ValueError(
                f"target layer {i} is a {type(layer).__name__}; static handoffs support full-attention "
                "layers only (StaticLayer): keep the dynamic BridgedCache for sliding-window targets"
            )
        if keys.shape[2] != tokens or values.shape[2] != tokens:
            raise ValueError(f"layer {i} holds {keys.shape[2]} tokens; layer 0 holds {tokens}")
        if not layer.is_initialized:  # allocates [batch, heads, max_cache_len, dim] where keys live
            layer.lazy_initialization(keys, values)
        _check_fits(layer, keys, values, i, max_cache_len)
        destinations += [layer.keys[:, :, :tokens], layer.values[:, :, :tokens]]
        sources += [keys, values]
    # Rows past `tokens` keep what an earlier handoff left: the mask hides every position >= the
    # sequence length, so they are never read (and zeroing them would cost a full pass).
    torch._foreach_copy_(destinations, sources)
    lengths = [layer.cumulative_length for layer in static.layers]
    torch._foreach_mul_(lengths, 0)
    torch._foreach_add_(lengths, tokens)
    return static


def _check_fits(layer: StaticLayer, keys: torch.Tensor, values: torch.Tensor, idx: int, max_cache_len: int):
    """An `into` cache must match the new KV exactly: shapes, dtype and device."""
    want = (keys.shape[0], keys.shape[1], max_cache_len, keys.shape[3])
    if tuple(layer.keys.shape) != want or layer.values.shape[-1] != values.shape[-1]:
        raise ValueError(
            f"StaticCache layer {idx} holds keys {tuple(layer.keys.shape)}; expected {want} "
            "[batch, kv_heads, max_cache_len, head_dim]: make a new StaticCache for this shape"
        )
    if layer.keys.dtype != keys.dtype or layer.keys.device != keys.device:
        raise ValueError(
            f"StaticCache layer {idx} is {layer.keys.dtype} on {layer.keys.device}; the KV are "
            f"{keys.dtype} on {keys.device}"
        )
