"""Head-local mapping of source KV into target KV: `map_heads` (one target layer) and
`map_layers` (every target layer of a cache in one launch).

Target head h of a target layer reads n source heads (CacheBridge: the matched head of each of k
source layers, n = k; identity: n = 1), gathers the source rows the alignment names, un-rotates
keys at their source positions, applies its own affine map W_h [n*Ds, Dt] + b_h, re-rotates at
the target positions and casts to the target dtype: one read of the used source rows, one write
of the target. The arithmetic and its rope convention are those of `bridgecache.kernels.affine`
(RoPE on the pairs of each side's rotary layout; cos/sin tables indexed by pair, only their first
half is read).

Several source layers are given as a list and addressed as one stack of heads without a copy:
virtual source head v = layer * Hs + head, i.e. the heads of `torch.cat(src, dim=1)`.

Dispatch: the fused Triton kernel on CUDA tensors, the PyTorch reference elsewhere; `backend=`
("triton" | "torch") or the environment variable BRIDGECACHE_KERNELS overrides.

Knows nothing about models, tokenizers, bridges or caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .affine import gathered_affine
from .reference import source_tables, target_tables

__all__ = ["map_heads", "map_layers"]


def map_heads(
    src: torch.Tensor | Sequence[torch.Tensor],
    rows: torch.Tensor,
    heads: torch.Tensor,
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
    """Map source keys or values into one target layer, head by head.

    Args:
        src: [B, Hs, S, Ds] float32/bfloat16/float16, any strides: source K or V as cached (keys
            post-RoPE); or a list of such layers, stacked on the head axis without a copy.
        rows: [B, T] int64: source token feeding each target position; -1: output row is zero.
        heads: [Ht, n] int64: the (stacked) source heads feeding target head h, in input order.
        weight: [Ht, n*Ds, Dt] float32, any strides: input slot j of head h uses rows j*Ds:(j+1)*Ds.
            On CUDA an input-axis-contiguous layout (`w.transpose(-1, -2).contiguous()
            .transpose(-1, -2)`, cached by the caller) skips a copy per call.
        bias: [Ht, Dt] float32.
        src_cos, src_sin: [B, Hs_total, S, Ds] float32 (stride-0 expand allowed) or [B, S, Ds]
            shared by every head; None for values. Un-rotates each gathered row at its own source
            position.
        tgt_cos, tgt_sin: [B, T, Dt] float32; None for values. Re-rotates the mapped rows.
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
    n_heads, _ = heads.shape
    t, dt = rows.shape[1], weight.shape[-1]
    if out is None:
        dtype = out_dtype or layers[0].dtype
        out = torch.empty(bsz, n_heads, t, dt, dtype=dtype, device=layers[0].device)
    gathered_affine(
        layers, rows, heads[None], weight[None], bias[None],
        *source_tables(src_cos, src_sin, bsz, len(layers), hs, s, ds),
        *target_tables(tgt_cos, tgt_sin, 1, bsz, t, dt),
        out[None], backend=backend, src_rotary=src_rotary, tgt_rotary=tgt_rotary,
    )  # fmt: skip
    return out


def map_layers(
    src: Sequence[torch.Tensor],
    rows: torch.Tensor,
    heads: torch.Tensor,
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
    """Map source keys or values into every target layer at once (one Triton launch).

    Args:
        src: Ls source layers, each [B, Hs, S, Ds] float32/bfloat16/float16 (one shape, dtype
            and device), as cached. Virtual head v = layer * Hs + head.
        rows: [B, T] int64: source token feeding each target position; -1: output row is zero.
        heads: [Lt, Ht, n] int64: virtual source heads feeding target head h of target layer l.
        weight: [Lt, Ht, n*Ds, Dt] float32, any strides. On CUDA an input-axis-contiguous layout
            (`w.transpose(-1, -2).contiguous().transpose(-1, -2)`, cached by the caller) skips a
            copy per call.
        bias: [Lt, Ht, Dt] float32.
        src_cos, src_sin: float32 source tables, None for values: [B, S, Ds] shared by all
            layers, [B, Ls, Hs, S, Ds] (per layer type, say; stride 0 over heads), or
            [B, Ls*Hs, S, Ds] per virtual head.
        tgt_cos, tgt_sin: float32 target tables, None for values: [B, T, Dt] shared by all
            target layers, or [Lt, B, T, Dt].
        out_dtype: dtype of the result (float32/bfloat16/float16); default src's dtype.
        backend: "triton" | "torch" | None (auto: Triton on CUDA).
        out: optional [Lt, B, Ht, T, Dt] tensor (last axis contiguous) to write into and return.
        src_rotary, tgt_rotary: rotary layouts (kind "half" | "interleaved", rotary_dim) of the
            source and target keys (kernels.rotary); None: the half-split over the whole head.
    Returns:
        [Lt, B, Ht, T, Dt] in out_dtype; out[l] is target layer l's keys (post-RoPE) or values.
    """
    layers = list(src)
    bsz, hs, s, ds = layers[0].shape
    n_layers, n_heads, _ = heads.shape
    t, dt = rows.shape[1], weight.shape[-1]
    if out is None:
        dtype = out_dtype or layers[0].dtype
        out = torch.empty(n_layers, bsz, n_heads, t, dt, dtype=dtype, device=layers[0].device)
    gathered_affine(
        layers, rows, heads, weight, bias,
        *source_tables(src_cos, src_sin, bsz, len(layers), hs, s, ds),
        *target_tables(tgt_cos, tgt_sin, n_layers, bsz, t, dt),
        out, backend=backend, src_rotary=src_rotary, tgt_rotary=tgt_rotary,
    )  # fmt: skip
    return out
