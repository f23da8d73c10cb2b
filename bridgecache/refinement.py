"""Trained refinement of a bridge: a low-rank residual per target layer and KV head.

The closed-form map of target head h reads x, the source rows it names (keys un-rotated), and
predicts x W_h + b_h. A refinement adds

    r_h(x) = gelu(x A_h + a_h) B_h        A_h [n_in * src_dim, rank], a_h [rank], B_h [rank, tgt_dim]

to the predicted keys (before RoPE is re-applied and before a key-norm projection) and values.
B starts at zero, so an untrained refinement is exactly the closed form. Training lives in
`bridgecache.fitting.refine`; `bridgecache.runtime.translate` applies it (on the PyTorch path: the fused
kernels do not know it).

Knows tensors only: nothing about models, tokenizers, caches or files.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from bridgecache.kv.rope import rotate_half

__all__ = ["REFINE_FIELDS", "LayerRefinement", "gather_inputs", "refinement_shapes"]

REFINE_FIELDS = ("key_down", "key_down_bias", "key_up", "value_down", "value_down_bias", "value_up")


def refinement_shapes(heads: int, inputs: int, rank: int, dim: int) -> dict[str, tuple[int, ...]]:
    """The shape of each refinement tensor of a layer with `heads` target KV heads reading
    `inputs` = n_in * src_dim input features, at `rank`, for target head size `dim`."""
    shapes = {}
    for kind in ("key", "value"):
        shapes[f"{kind}_down"] = (heads, inputs, rank)
        shapes[f"{kind}_down_bias"] = (heads, rank)
        shapes[f"{kind}_up"] = (heads, rank, dim)
    return shapes


@dataclass
class LayerRefinement:
    """The residuals of one target layer, keys and values, every head.

    key_down, value_down: float32 [tgt_heads, n_in * src_dim, rank] (A).
    key_down_bias, value_down_bias: float32 [tgt_heads, rank] (a).
    key_up, value_up: float32 [tgt_heads, rank, tgt_dim] (B; zero = no change).
    """

    key_down: torch.Tensor
    key_down_bias: torch.Tensor
    key_up: torch.Tensor
    value_down: torch.Tensor
    value_down_bias: torch.Tensor
    value_up: torch.Tensor

    @property
    def rank(self) -> int:
        return self.key_down.shape[-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> LayerRefinement:
        return LayerRefinement(**{k: v.to(device=device, dtype=dtype) for k, v in self.tensors().items()})

    def residual(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """r(x) for "key" or "value": x [batch, tgt_heads or 1, tokens, n_in * src_dim] (1: every
        head reads the same inputs) -> [batch, tgt_heads, tokens, tgt_dim] float32."""
        down, bias, up = (getattr(self, f"{kind}_{part}") for part in ("down", "down_bias", "up"))
        hidden = torch.nn.functional.gelu(x.float() @ down + bias[:, None, :])  # [B, Ht, T, rank]
        return hidden @ up


def gather_inputs(
    src: list[torch.Tensor],
    rows: torch.Tensor,
    heads: torch.Tensor,
    src_cos: torch.Tensor | None = None,
    src_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inputs x a closed-form map reads, as `bridgecache.kernels.map_heads` gathers them.

    Args:
        src: source layers [batch, src_heads, src_tokens, src_dim] (keys post-RoPE), addressed as
            one stack of heads (virtual head = position in the list * src_heads + head).
        rows: [batch, tgt_tokens] int64 source token of each target position (-1: none; its
            inputs are zero, and callers mask what is computed from them).
        heads: [tgt_heads, n_in] int64 virtual source heads of each target head.
        src_cos, src_sin: source rope tables [batch, src_tokens, src_dim] or
            [batch, virtual heads, src_tokens, src_dim] to un-rotate keys; None for values.
    Returns:
        [batch, tgt_heads or 1, tgt_tokens, n_in * src_dim] float32 (1 when all heads share inputs).
    """
    b, t = rows.shape
    hs, ds = src[0].shape[1], src[0].shape[-1]
    valid = (rows >= 0)[:, None, :, None]
    idx = rows.clamp(min=0)
    index = idx[:, None, :, None].expand(b, hs, t, ds)
    x = torch.cat([layer.gather(2, index) for layer in src], dim=1).float()  # [B, Hv, T, Ds]
    if src_cos is not None:
        if src_cos.dim() == 3:  # shared by every head
            table_index = idx[:, :, None].expand(b, t, ds)
            cos, sin = src_cos.gather(1, table_index)[:, None], src_sin.gather(1, table_index)[:, None]
        else:
            table_index = idx[:, None, :, None].expand(b, src_cos.shape[1], t, ds)
            cos, sin = src_cos.gather(2, table_index), src_sin.gather(2, table_index)
        cos, sin = cos.float(), sin.float()
        x = (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)
    x = x * valid
    n_heads, n = heads.shape
    if bool((heads == heads[:1]).all()):  # full-head maps: one input block for every head
        return x[:, heads[0]].permute(0, 2, 1, 3).reshape(b, 1, t, n * ds)
    x = x[:, heads.reshape(-1)].view(b, n_heads, n, t, ds)
    return x.permute(0, 1, 3, 2, 4).reshape(b, n_heads, t, n * ds)
