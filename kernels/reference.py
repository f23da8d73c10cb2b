"""PyTorch references of the kernels (`gathered_affine`, `launch_stats`, `column_attention`): RoPE
on the pairs of a rotary layout (`bridgecache.kernels.rotary`) and the rotary-table layouts the
kernels accept.

    affine_reference     the function of bridgecache.kernels.affine, in float32 arithmetic
    attention_reference  the function of bridgecache.kernels.attention: sdpa per block of
                         queries over only the keys the block can see
    stats_reference      the moments of bridgecache.kernels.stats, X materialised (float32)
    unrope_pairs / rope_pairs     undo / apply RoPE on a layout's pairs from the first half of the tables
    source_tables / target_tables   the public table layouts as the views the kernels read

Knows tensors only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .rotary import pair_channels

__all__ = [
    "affine_reference",
    "attention_reference",
    "rope_pairs",
    "source_tables",
    "stats_reference",
    "target_tables",
    "unrope_pairs",
]


def unrope_pairs(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rotary=None) -> torch.Tensor:
    """Undo RoPE. x: [..., D]; c, s: [..., D/2] (per pair: the first half of the tables),
    broadcastable; rotary: (kind, rotary_dim) or None (half-split, whole head)."""
    a, b = pair_channels(rotary, x.shape[-1], x.device)
    x1, x2 = x[..., a], x[..., b]
    r = c * c + s * s
    out = torch.empty_like(x)
    out[..., a], out[..., b] = (x1 * c + x2 * s) / r, (x2 * c - x1 * s) / r
    return out


def rope_pairs(z: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rotary=None) -> torch.Tensor:
    """Apply RoPE. z: [..., D]; c, s: [..., D/2] (per pair), broadcastable; rotary as in unrope_pairs."""
    a, b = pair_channels(rotary, z.shape[-1], z.device)
    z1, z2 = z[..., a], z[..., b]
    out = torch.empty_like(z)
    out[..., a], out[..., b] = z1 * c - z2 * s, z2 * c + z1 * s
    return out


def _gather_table(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[B, Ls, Hs, S, D] table -> its first half at rows idx [B, T]: [B, Ls*Hs or 1, T, D/2] float32."""
    b, ls, hs, s, d = table.shape
    half = d // 2
    if table.stride(1) == 0 and table.stride(2) == 0:  # shared by every head: gather once
        table = table[:, 0, :1]
    else:
        table = table.reshape(b, ls * hs, s, d)
    table = table[..., :half].float()
    index = idx[:, None, :, None].expand(b, table.shape[1], idx.shape[1], half)
    return table.gather(2, index)


def affine_reference(
    src: Sequence[torch.Tensor],
    rows: torch.Tensor,
    heads: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    src_cos: torch.Tensor | None,
    src_sin: torch.Tensor | None,
    tgt_cos: torch.Tensor | None,
    tgt_sin: torch.Tensor | None,
    out: torch.Tensor,
    src_rotary=None,
    tgt_rotary=None,
) -> None:
    """Write the function of the module docstring into `out`; arguments as in `gathered_affine`."""
    b, t = rows.shape
    n_layers, n_heads, n = heads.shape
    ds = src[0].shape[-1]
    valid = rows >= 0
    idx = rows.clamp(min=0)
    index = idx[:, None, :, None].expand(b, src[0].shape[1], t, ds)
    x = torch.cat([layer.gather(2, index) for layer in src], dim=1).float()  # [B, Hv, T, Ds]
    if src_cos is not None:
        x = unrope_pairs(x, _gather_table(src_cos, idx), _gather_table(src_sin, idx), src_rotary)
    shared = heads.stride(1) == 0  # every target head reads the same inputs: one GEMM
    for layer in range(n_layers):
        w = weight[layer].float()  # [Ht, n * Ds, Dt]
        if shared:
            xl = x[:, heads[layer, 0]].permute(0, 2, 1, 3).reshape(b, t, n * ds)
            z = torch.einsum("btk,hkd->bhtd", xl, w)
        else:
            xl = x[:, heads[layer].reshape(-1)].view(b, n_heads, n, t, ds)
            z = torch.einsum("bhjtk,hjkd->bhtd", xl, w.view(n_heads, n, ds, -1))
        z = z + bias[layer].float()[None, :, None, :]
        if tgt_cos is not None:
            half = z.shape[-1] // 2
            cs, sn = tgt_cos[layer, ..., :half].float()[:, None], tgt_sin[layer, ..., :half].float()[:, None]
            z = rope_pairs(z, cs, sn, tgt_rotary)
        out[layer].copy_(z.masked_fill(~valid[:, None, :, None], 0.0))


def source_tables(cos, sin, bsz, n_layers, hs, s, ds):
    """Public source-table layouts ([B, S, Ds], [B, Ls*Hs, S, Ds] or [B, Ls, Hs, S, Ds]) as
    [B, Ls, Hs, S, Ds] views."""
    if cos is None or sin is None:
        return cos, sin
    return _as_source5(cos, bsz, n_layers, hs, s, ds), _as_source5(sin, bsz, n_layers, hs, s, ds)


def _as_source5(tab, bsz, n_layers, hs, s, ds):
    if tab.dim() == 3:  # [B, S, Ds] shared by every head
        return tab[:, None, None].expand(bsz, n_layers, hs, s, ds)
    if tab.dim() == 4:  # [B, Ls*Hs, S, Ds]: splitting one axis is always a view
        if tab.shape[1] != n_layers * hs:
            raise ValueError(f"source tables have {tab.shape[1]} heads, the source {n_layers * hs}")
        return tab.unflatten(1, (n_layers, hs))
    return tab


def target_tables(cos, sin, n_layers, bsz, t, dt):
    """Public target-table layouts ([B, T, Dt] shared, or [Lt, B, T, Dt]) as [Lt, B, T, Dt] views."""
    if cos is None or sin is None:
        return cos, sin
    if cos.dim() == 3:
        cos, sin = cos[None].expand(n_layers, bsz, t, dt), sin[None].expand(n_layers, bsz, t, dt)
    return cos, sin


# Queries per block of the reference: its masks and scores are [_REF_CHUNK, visible keys].
_REF_CHUNK = 256


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_columns: torch.Tensor,
    key_columns: torch.Tensor,
    first_column: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    out: torch.Tensor,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Write the function of the module docstring into `out` [B, Nq, Hq, D]; shapes as in
    `column_attention`. Reads the block bounds on the host (one transfer per call on CUDA)."""
    bsz, hq, n_q, _ = query.shape
    group = hq // key.shape[1]
    first = first_column[:, None].expand(bsz, n_q)
    low = first if window is None else torch.maximum(first, query_columns - window + 1)
    if chunk is not None:  # the start of each query's chunk, counted from its row's first column
        low = torch.maximum(low, first + (query_columns - first).clamp_min(0) // chunk * chunk)
    lo = torch.searchsorted(key_columns, low.contiguous()).tolist()  # first visible key per query
    hi = torch.searchsorted(key_columns, query_columns.contiguous(), right=True).tolist()
    explicit = softcap is not None or sinks is not None
    block = _REF_CHUNK // 4 if explicit else _REF_CHUNK  # float32 scores per head
    for b in range(bsz):
        for s in range(0, n_q, block):
            e = min(s + block, n_q)
            k0, k1 = lo[b][s], max(hi[b][e - 1], lo[b][s])  # columns ascend: the block's key range
            if k1 == k0:
                out[b, s:e].zero_()
                continue
            cols = query_columns[b, s:e, None]
            keys = key_columns[k0:k1]
            seen = (keys <= cols) & (keys >= low[b, s:e, None])
            q, k, v = query[b : b + 1, :, s:e], key[b : b + 1, :, k0:k1], value[b : b + 1, :, k0:k1]
            if explicit:
                o = _explicit(q, k, v, seen, scale, softcap, sinks, group)
            else:
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=seen, scale=scale, enable_gqa=group > 1
                )
            o = o[0].transpose(0, 1)  # [block, Hq, D]
            out[b, s:e] = torch.where(seen.any(-1)[:, None, None], o, 0.0)


def _explicit(q, k, v, seen, scale, softcap, sinks, group) -> torch.Tensor:
    """Masked attention with capped logits and / or a sink logit per head (a softmax column with no
    value), float32 arithmetic: q [1, Hq, M, D], k / v [1, Hkv, N, D], sinks [Hq] or None."""
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    logits = (q.float() @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*logits.shape[:-1], 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = logits.softmax(-1).nan_to_num(0.0)
    return (probs @ v).to(q.dtype)


def stats_reference(
    src: Sequence[torch.Tensor],
    rows: torch.Tensor,
    heads: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor | None,
    src_cos: torch.Tensor | None,
    src_sin: torch.Tensor | None,
    xtx: torch.Tensor,
    xty: torch.Tensor,
    sum_x: torch.Tensor,
    sum_y: torch.Tensor,
    sum_yy: torch.Tensor,
    sum_w: torch.Tensor,
    src_rotary=None,
) -> None:
    """Materialise X [Ht, B*T, p] in float32 and add its moments; arguments as the operator's
    (src: list of layers; src_cos/src_sin: [B, Ls, Hs, S, Ds] or None; src_rotary: (kind,
    rotary_dim) or None)."""
    b, t = rows.shape
    n_heads, n = heads.shape
    ds = src[0].shape[-1]
    valid = rows >= 0
    idx = rows.clamp(min=0)
    index = idx[:, None, :, None].expand(b, src[0].shape[1], t, ds)
    x = torch.cat([layer.gather(2, index) for layer in src], dim=1).float()  # [B, Hv, T, Ds]
    if src_cos is not None:
        x = unrope_pairs(x, _table_rows(src_cos, idx), _table_rows(src_sin, idx), src_rotary)
    x = (
        x[:, heads.reshape(-1)]
        .view(b, n_heads, n, t, ds)
        .permute(1, 0, 3, 2, 4)
        .reshape(n_heads, b * t, n * ds)
    )
    w = torch.ones(b, n_heads, t, device=x.device) if weights is None else weights.float()
    w = (w * valid[:, None]).permute(1, 0, 2).reshape(n_heads, b * t)
    yy = torch.where(valid[:, None, :, None], y.float(), 0.0).permute(1, 0, 2, 3).reshape(n_heads, b * t, -1)
    g = xtx.shape[0]
    xw = x * w[..., None]
    xtx += (xw[:g].transpose(1, 2) @ x[:g]).to(xtx.dtype)
    sum_x += xw[:g].sum(1).to(sum_x.dtype)
    sum_w += w[:g].sum(1).to(sum_w.dtype)
    xty += (xw.transpose(1, 2) @ yy).to(xty.dtype)
    sum_y += (w[..., None] * yy).sum(1).to(sum_y.dtype)
    sum_yy += (w[..., None] * yy * yy).sum(1).to(sum_yy.dtype)


def _table_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[B, Ls, Hs, S, D] -> first half at rows idx [B, T]: [B, Ls*Hs, T, D/2] float32."""
    b, ls, hs, s, d = table.shape
    table = table.reshape(b, ls * hs, s, d)[..., : d // 2].float()
    return table.gather(2, idx[:, None, :, None].expand(b, ls * hs, idx.shape[1], d // 2))
