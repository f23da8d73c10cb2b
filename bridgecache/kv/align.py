"""The seam between tokenalign and bridgecache: read source KV rows through an `Alignment`.

    gather_rows(x, alignment)   x [..., src_tokens, d] -> [..., tgt_tokens, d], one row per target
                                token under the alignment's policy; NATIVE rows are zeros
    pair_rows(alignment)        (source row, target row) index pairs to regress, NATIVE excluded
    target_rows(alignment)      the target rows that have source text (any policy)

Policies (tokenalign.POLICIES): `last` reads `source_index`, `first` reads `span_start`, `mean`
averages `[span_start, span_end)` as a segment mean over a cumulative sum (no loop over tokens).
This module knows nothing about models, bridges or tokenizers: rows in, rows out.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenalign import Alignment

__all__ = ["gather_rows", "pair_rows", "target_rows"]


def gather_rows(x: torch.Tensor, alignment: Alignment, policy: str | None = None) -> torch.Tensor:
    """The source rows that feed each target token.

    Args:
        x: [batch, heads, src_tokens, d] (any leading dims) source keys or values, un-rotated.
        alignment: of one text, `alignment.num_source == src_tokens`.
        policy: "last", "first" or "mean"; the alignment's own policy when None.
    Returns:
        [batch, heads, tgt_tokens, d] in x's dtype and device; rows of NATIVE target tokens are
        zeros (the target computes them itself).
    """
    policy = policy or alignment.policy
    if x.shape[-2] != alignment.num_source:
        raise ValueError(f"x has {x.shape[-2]} source rows; the alignment expects {alignment.num_source}")
    native = torch.as_tensor(alignment.native_mask(), device=x.device)[:, None]
    if policy == "mean":
        return _segment_mean(x, alignment).masked_fill(native, 0)
    index = _row_index(alignment, policy).clamp_min(0).to(x.device)
    return x.index_select(-2, index).masked_fill(native, 0)


def _segment_mean(x: torch.Tensor, alignment: Alignment) -> torch.Tensor:
    """Mean of x over [span_start, span_end) per target token; 0 for empty spans."""
    # Accumulate in float64: a running sum over thousands of rows loses digits in float32.
    acc = torch.float32 if x.device.type == "mps" else torch.float64
    total = torch.nn.functional.pad(x.to(acc).cumsum(-2), (0, 0, 1, 0))  # [..., src_tokens + 1, d]
    start = torch.as_tensor(alignment.span_start, device=x.device)
    end = torch.as_tensor(alignment.span_end, device=x.device)
    count = (end - start).clamp_min(1).to(acc)[:, None]
    return ((total.index_select(-2, end) - total.index_select(-2, start)) / count).to(x.dtype)


def pair_rows(alignment: Alignment, policy: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(src_idx, tgt_idx) int64 [n]: target row tgt_idx[i] is regressed on source row src_idx[i].

    One pair per target token with source text (NATIVE excluded), under `policy` ("last" or
    "first"; the alignment's own when None). `mean` pools several source rows per target row and
    has no single pair: regress `gather_rows(x, alignment)[..., target_rows(alignment), :]` instead.
    """
    policy = policy or alignment.policy
    if policy == "mean":
        raise ValueError(
            "policy 'mean' reads several source rows per target row; use "
            "gather_rows(x, alignment)[..., target_rows(alignment), :] as the regression input"
        )
    tgt_idx = target_rows(alignment)
    return _row_index(alignment, policy)[tgt_idx], tgt_idx


def target_rows(alignment: Alignment) -> torch.Tensor:
    """int64 [n]: indices of the target tokens that have source text (not NATIVE)."""
    return torch.from_numpy(np.flatnonzero(~alignment.native_mask()))


def _row_index(alignment: Alignment, policy: str) -> torch.Tensor:
    """int64 [tgt_tokens]: the one source row each target token reads (NATIVE: -1 or 0)."""
    if policy == "last":
        return torch.from_numpy(alignment.source_index)
    if policy == "first":
        return torch.from_numpy(alignment.span_start)
    raise ValueError(f"unknown row policy {policy!r}; expected 'last', 'first' or 'mean'")
