"""KV capture: run a model over token ids and keep every layer's keys and values.

`capture_kv(model, input_ids)` returns a `SourceKV` holding, per layer, keys and values of
shape [batch, kv_heads, tokens, head_dim] exactly as the model caches them (keys after q/k-norm
and RoPE), plus the attention mask, the position ids and the model's rotary tables, so
`unrotated_keys(layer)` can remove RoPE, and what they belong to: the token ids and the model's
spec and weight fingerprint (so a bridge or a later `as_source`/`load_kv` can refuse KV of another
model or document). Only the model's decoder runs: no logits are computed. Sliding-window layers
keep ALL tokens here (a plain, config-less DynamicCache is used), because a bridge may need rows
that a sliding cache would already have dropped; the model's masks still apply its window, so
the values are exactly those of a normal forward.

This module knows nothing about bridges or tokenizers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

import bridgecache.checks as checks
from bridgecache.compat import cache_kwargs
from bridgecache.kv.rope import RopeTables
from bridgecache.kv.source import SourceKV, position_ids_from_mask
from bridgecache.models.code import decoder_of
from bridgecache.models.fingerprint import weight_fingerprint
from bridgecache.models.spec import model_spec

__all__ = ["capture_kv", "cache_to_layers", "position_ids_from_mask"]


@torch.no_grad()
def capture_kv(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    fingerprint: str | None = None,
) -> SourceKV:
    """Run `model` over `input_ids` [batch, tokens] and return every layer's KV.

    With left padding, pass `attention_mask` [batch, tokens] (0 on the padding): it travels with
    the KV, and positions follow generate()'s. An empty context (0 tokens) gives 0-row KV.
    fingerprint: `weight_fingerprint(model)` where the caller holds it (a handoff engine takes it
    once and checks per request that the weights did not change); None: taken here.
    """
    checks.model(model, "model")
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    checks.ids(input_ids, "input_ids", vocab=vocab)
    checks.mask(attention_mask, "attention_mask", input_ids)
    spec = model_spec(model)  # before any work: refuses an architecture a bridge cannot translate
    device = model.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device=device, dtype=torch.long)
    position_ids = position_ids_from_mask(attention_mask)
    if input_ids.shape[-1] == 0:  # nothing to run: the model's forward rejects empty inputs
        keys, values = _empty_layers(model, input_ids.shape[0])
    else:
        cache = DynamicCache()  # no config: every layer keeps every token
        decoder = _decoder(model)  # the KV without the logits: no [batch, tokens, vocab] tensor
        decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **cache_kwargs(decoder, cache),
        )
        keys, values = cache_to_layers(cache)
    return SourceKV(
        keys,
        values,
        attention_mask=attention_mask,
        position_ids=position_ids,
        first_token=(0,) * len(keys),
        rope=RopeTables.from_model(model),
        input_ids=input_ids.detach().cpu(),
        model=spec,
        fingerprint=weight_fingerprint(model) if fingerprint is None else fingerprint,
    )


def _decoder(model):
    """The model's decoder (a causal LM's base model), or the model itself."""
    return decoder_of(model) or model


def _empty_layers(model, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, keys and values [batch, kv_heads, 0, head_dim] in the model's dtype and device."""
    spec = model_spec(model)
    weight = model.get_input_embeddings().weight
    empty = [weight.new_zeros(batch, spec.num_kv_heads, 0, spec.head_dim) for _ in range(spec.num_layers)]
    return empty, [t.clone() for t in empty]


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
