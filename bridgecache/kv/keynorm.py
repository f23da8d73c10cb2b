"""Mapped keys for targets that normalise their keys (q/k-norm: Gemma 3, Qwen3, ...).

Such a target's attention applies an RMSNorm per head to every key before RoPE, so each key it
ever holds is k = s * n with rms(n) ~ 1 (s: the norm's per-channel scale; exactly
rms(n) = sqrt(ms / (ms + eps)) for a pre-norm mean square ms). A mapped key is a regression
estimate, shrunken towards the mean: its norm is too small and the target's attention over
translated rows is flatter than over its own. `project_to_key_norm` rescales each mapped key (per
head and token, direction kept) back onto rms(n) = 1; keys the target computed itself stay put
where ms >> eps, but small pre-norm keys (random weights) move. So BridgedCache applies it when
the target has a `k_norm` and the bridge is fitted, never through an identity bridge, whose keys
are the target's own.

Knows nothing about bridges or caches.
"""

from __future__ import annotations

import torch

__all__ = ["key_norm_scales", "project_to_key_norm"]

# Channels whose norm scale is below this hold ~0 in every key (Gemma 3 has norm weights of -1,
# i.e. scale 0): their normalised value cannot be read back, so the RMS is estimated from the
# other channels. In key units (the normalised key has rms 1); a cut relative to the largest
# scale also dropped small live channels and did worse on Qwen-0.5B -> Gemma 3.
_DEAD_CHANNEL = 1e-2


def key_norm_scales(model) -> list[torch.Tensor | None] | None:
    """Per decoder layer, the per-channel scale s float32 of its key norm ([head_dim] per head, or
    [kv_heads * head_dim] over the whole projection), on the norm's device (None for a layer
    without one); None when the model normalises no keys."""
    attention, modules, seen = [], [model], set()
    while modules:  # a plain walk: model.modules() builds names for every module (per handoff)
        module = modules.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if "k_proj" in module._modules and hasattr(module, "layer_idx"):
            attention.append(module)
        modules.extend(m for m in module._modules.values() if m is not None)
    attention.sort(key=lambda m: m.layer_idx)
    norms = [getattr(module, "k_norm", None) for module in attention]
    norms = [n if isinstance(n, torch.nn.Module) and hasattr(n, "weight") else None for n in norms]
    scales = []
    for norm in norms:
        if norm is None:
            scales.append(None)
            continue
        with torch.no_grad():  # an RMSNorm of a vector of ones returns its scale (times ~1 - eps/2)
            ones = torch.ones(1, norm.weight.shape[-1], dtype=torch.float32, device=norm.weight.device)
            scales.append(norm(ones)[0].float())
    return scales if any(s is not None for s in scales) else None


def project_to_key_norm(keys: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """keys [batch, heads, tokens, head_dim] (pre-RoPE, float32) rescaled per head and token so
    that rms(keys / scale) = 1 over the live channels; all-zero rows stay zero.

    scale: [head_dim] for a norm per head (Qwen3, Gemma 3), or [heads * head_dim] for a norm over
    the whole projection (OLMo 2: one RMS over every head of a token, so rescaled jointly)."""
    heads, dim = keys.shape[1], keys.shape[-1]
    reduced: tuple[int, ...] = (-1,)
    if scale.shape[-1] != dim:
        if scale.numel() != heads * dim:
            raise ValueError(
                f"key-norm scale of {scale.numel()} channels fits neither a head ({dim}) nor the "
                f"projection ({heads} heads x {dim})"
            )
        scale, reduced = scale.view(heads, 1, dim), (1, 3)
    live = scale.abs() > _DEAD_CHANNEL
    # Masked by multiplication, not by boolean indexing: no device sync on the translation path.
    inverse = torch.where(live, 1.0 / torch.where(live, scale, 1.0), 0.0)
    mean_square = (keys * inverse).pow(2).sum(reduced, keepdim=True) / live.sum()
    return keys * torch.where(mean_square > 0, mean_square.clamp_min(1e-30).rsqrt(), 0.0)
