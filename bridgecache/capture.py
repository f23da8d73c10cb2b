"""KV capture: run a model over token ids and keep every layer's keys and values.

`capture_kv(model, input_ids)` returns a `CapturedKV` holding, per layer, keys and values of
shape [batch, kv_heads, tokens, head_dim] exactly as the model caches them (keys after q/k-norm
and RoPE), plus the position ids, so `unrotated_keys(layer)` can remove RoPE with the model's
own tables. Sliding-window layers keep ALL tokens here (a plain, config-less DynamicCache is
used), because a bridge may need rows that a sliding cache would already have dropped; the
model's masks still apply its window, so the values are exactly those of a normal forward.

This module knows nothing about bridges or tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs
from bridgecache.rope import RopeTables, unrotate

__all__ = ["CapturedKV", "capture_kv", "cache_to_layers", "position_ids_from_mask"]


@dataclass
class CapturedKV:
    """Per-layer KV of one forward pass.

    keys[l], values[l]: [batch, kv_heads, tokens, head_dim] as cached (keys post-RoPE).
    position_ids: [batch, tokens] int64, the positions RoPE was applied at.
    rope: the model's rotary tables (None for tensors captured elsewhere).
    logits: [batch, tokens, vocab] of the same forward when asked for, else None.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    position_ids: torch.Tensor
    rope: RopeTables | None = None
    logits: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[-2]

    def unrotated_keys(self, layer: int) -> torch.Tensor:
        """Keys of `layer` with RoPE removed: [batch, kv_heads, tokens, head_dim], float32."""
        if self.rope is None:
            raise ValueError("this capture has no rope tables; pass the model to capture_kv")
        cos, sin = self.rope.cos_sin(layer, self.position_ids)
        keys = self.keys[layer].float()
        return unrotate(keys, cos.to(keys.device), sin.to(keys.device))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch, tokens] 0/1 mask (left padding) -> [batch, tokens] positions, as generate() does."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)


@torch.no_grad()
def capture_kv(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    keep_logits: bool = False,
) -> CapturedKV:
    """Run `model` over `input_ids` [batch, tokens] and return every layer's KV.

    With left padding, pass `attention_mask`; positions then follow generate()'s convention.
    """
    device = model.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device)
    position_ids = position_ids_from_mask(attention_mask)
    cache = DynamicCache()  # no config: every layer keeps every token
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **cache_kwargs(model, cache),
    )
    keys, values = cache_to_layers(cache)
    return CapturedKV(
        keys=keys,
        values=values,
        position_ids=position_ids,
        rope=RopeTables.from_model(model),
        logits=out.logits if keep_logits else None,
    )


def cache_to_layers(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer (keys, values) of a transformers cache, without copying."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"expected a transformers Cache with .layers, got {type(cache).__name__}")
    keys = [layer.keys for layer in layers]
    values = [layer.values for layer in layers]
    missing = [i for i, k in enumerate(keys) if k is None]
    if missing:
        raise ValueError(f"cache layers {missing} were never filled (did the forward pass run?)")
    return keys, values
