"""Full-head mapping of source KV into one target layer: `map_fullhead`, the baseline.

Every target head reads ALL the source heads given (Hs of one layer, or k layers' heads stacked,
n = k * Hs): one shared X [B*T, n*Ds] (gathered rows, keys un-rotated) times W [n*Ds, Ht*Dt],
plus bias, re-rotated at target positions. It is the GEMM-shaped case of
`bridgecache.kernels.affine`: one Triton program computes a [tokens, several heads * Dt] tile and
un-rotates each gathered X tile once for all of those heads. Same rope convention, dispatch and
arithmetic as `map_heads`.

Knows nothing about models, tokenizers, bridges or caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .affine import gathered_affine
from .reference import source_tables, target_tables

__all__ = ["map_fullhead"]


def map_fullhead(
    src: torch.Tensor | Sequence[torch.Tensor],
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    src_cos: torch.Tensor | None = None,
    src_sin: torch.Tensor | None = None,
    tgt_cos: torch.Tensor | None = None,
    tgt_sin: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    backend: str | None = None,
    out: torch.Tensor | None = None,
    src_rotary: tuple[str, int] | None = None,
    tgt_rotary: tuple[str, int] | None = None,
) -> torch.Tensor:
    """Map all source heads into every head of one target layer.

    Args:
        src: [B, Hs, S, Ds] float32/bfloat16/float16, any strides (source K or V as cached), or a
            list of k such layers stacked on the head axis without a copy (n = k * Hs inputs,
            layer-major: the heads of `torch.cat(src, dim=1)`).
        rows: [B, T] int64: source token feeding each target position; -1: output row is zero.
        weight: [Ht, n*Ds, Dt] float32, any strides: input rows j*Ds:(j+1)*Ds belong to stacked
            head j. On CUDA an input-axis-contiguous layout (`w.transpose(-1, -2).contiguous()
            .transpose(-1, -2)`, cached by the caller) skips a copy per call.
        bias: [Ht, Dt] float32.
        src_cos, src_sin: [B, n, S, Ds] float32 (stride-0 expand allowed) or [B, S, Ds] shared;
            None for values.
        tgt_cos, tgt_sin: [B, T, Dt] float32; None for values.
        out_dtype: dtype of the result (float32/bfloat16/float16); default src's dtype.
        backend: "triton" | "torch" | None (auto: Triton on CUDA).
        out: optional [B, Ht, T, Dt] tensor (last axis contiguous) to write into and return.
        src_rotary, tgt_rotary: rotary layouts (kind "half" | "interleaved", rotary_dim) of the
            source and target keys (kernels.rotary); None: the half-split over the whole head.
    Returns:
        [B, Ht, T, Dt] in out_dtype (keys post-RoPE), accumulated in float32.
    """
    layers = [src] if isinstance(src, torch.Tensor) else list(src)
    bsz, hs, s, ds = layers[0].shape
    n = len(layers) * hs
    n_heads, dt = bias.shape
    t = rows.shape[1]
    if out is None:
        out = torch.empty(bsz, n_heads, t, dt, dtype=out_dtype or layers[0].dtype, device=layers[0].device)
    heads = torch.arange(n, device=rows.device)[None, None].expand(1, n_heads, n)  # shared: stride 0 over Ht
    gathered_affine(
        layers, rows, heads, weight[None], bias[None],
        *source_tables(src_cos, src_sin, bsz, len(layers), hs, s, ds),
        *target_tables(tgt_cos, tgt_sin, 1, bsz, t, dt),
        out[None], backend=backend, src_rotary=src_rotary, tgt_rotary=tgt_rotary,
    )  # fmt: skip
    return out
