"""Row planning: which source row feeds each target context column of a BridgedCache.

    plan_rows(source, target_mask, alignment, policy)   [batch, target tokens] source row or -1
    leading_native(rows, target_pad)                     [batch] leading target tokens without source
    pool_source(source, alignment, target_mask, rope)    source KV pooled per target column ('mean')

Padding (left only) comes from the attention masks the source KV and the target ids carry,
never from position ids. Works on the CPU (small integer work); `bridgecache.kv.align` does the
per-alignment row arithmetic. Knows nothing about bridges, models or transformers caches.
"""

from __future__ import annotations

import torch

from bridgecache.kv.align import gather_rows
from bridgecache.kv.rope import RopeTables, unrotate
from bridgecache.kv.source import SourceKV, position_ids_from_mask

__all__ = ["plan_rows", "leading_native", "pool_source"]


def _alignments(alignment, batch: int) -> list:
    alignments = list(alignment) if isinstance(alignment, (list, tuple)) else [alignment]
    if len(alignments) != batch:
        raise ValueError(f"got {len(alignments)} alignments for a batch of {batch}")
    return alignments


def _check_alignment(b: int, alignment, source_tokens: int | None, target_tokens: int) -> None:
    if len(alignment.source_index) != target_tokens:
        raise ValueError(
            f"alignment of row {b} covers {len(alignment.source_index)} target tokens; the target "
            f"context has {target_tokens}"
        )
    if source_tokens is not None and alignment.num_source != source_tokens:
        raise ValueError(
            f"alignment of row {b} reads {alignment.num_source} source tokens; the source context has "
            f"{source_tokens}"
        )


def pool_source(source: SourceKV, alignment, target_mask: torch.Tensor, tables: RopeTables) -> SourceKV:
    """Source KV re-indexed by TARGET column: row c = mean of the un-rotated source rows that
    overlap target token c (policy `mean`); keys come back un-rotated, NATIVE rows zero.

    target_mask: [batch, target tokens] 0/1 (left padding). Returns keys/values
    [batch, kv_heads, target tokens, head_dim] float32 with the target's mask and positions.
    """
    batch, total = target_mask.shape
    source_pad = source.padding.tolist()
    target_pad = (target_mask == 0).sum(1).tolist()
    if any(source.first_token):
        raise ValueError(
            "policy 'mean' needs every source row: capture the source with bridgecache.capture_kv"
        )
    alignments = _alignments(alignment, batch)
    for b, al in enumerate(alignments):
        _check_alignment(b, al, source.num_tokens - source_pad[b], total - target_pad[b])
    keys, values = [], []
    for layer in range(source.num_layers):
        cos, sin = tables.cos_sin(layer, source.position_ids)
        device = source.keys[layer].device
        unrotated = unrotate(source.keys[layer].float(), cos.to(device), sin.to(device), tables.layout)
        pooled_k, pooled_v = [], []
        for b, al in enumerate(alignments):
            pad = (0, 0, target_pad[b], 0)  # left-pad the target columns back
            rows_k = gather_rows(unrotated[b : b + 1, :, source_pad[b] :], al, "mean")
            rows_v = gather_rows(source.values[layer][b : b + 1, :, source_pad[b] :].float(), al, "mean")
            pooled_k.append(torch.nn.functional.pad(rows_k, pad))
            pooled_v.append(torch.nn.functional.pad(rows_v, pad))
        keys.append(torch.cat(pooled_k))
        values.append(torch.cat(pooled_v))
    mask = target_mask.long().to(source.position_ids.device)
    return SourceKV(
        keys,
        values,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        first_token=(0,) * source.num_layers,
    )


def plan_rows(source: SourceKV, target_mask: torch.Tensor, alignment, policy: str) -> torch.Tensor:
    """[batch, target tokens] int64: the source column feeding each target column (-1: native).

    With an alignment, policy `last` reads the source token covering the target token's last
    character, `first` the one covering its first; `mean` sources are already pooled per target
    column (see `pool_source`), so they are read one to one. Without one, the i-th real target
    token reads the i-th real source token (same tokenization).
    """
    batch, total = target_mask.shape
    source_pad = source.padding
    target_pad = (target_mask == 0).sum(1).cpu()
    if alignment is None:
        n_source = source.num_tokens - source_pad
        n_target = total - target_pad
        if not torch.equal(n_source, n_target):
            raise ValueError(
                f"source and target contexts have {n_source.tolist()} and {n_target.tolist()} tokens: "
                "pass an alignment (tokenalign.align) when the tokenizations differ"
            )
        rows = torch.arange(total).expand(batch, total) - target_pad[:, None] + source_pad[:, None]
        return torch.where(torch.arange(total)[None] < target_pad[:, None], -1, rows)
    rows = torch.full((batch, total), -1, dtype=torch.long)
    for b, al in enumerate(_alignments(alignment, batch)):
        index = torch.as_tensor(al.source_index, dtype=torch.long)
        if policy == "first":
            index = torch.where(index >= 0, torch.as_tensor(al.span_start, dtype=torch.long), -1)
        elif policy == "mean":
            index = torch.where(index >= 0, torch.arange(len(index)), -1)  # pooled: target column order
        pad = int(target_pad[b])
        # A pooled ('mean') source was checked against the alignment before pooling.
        real_source = None if policy == "mean" else source.num_tokens - int(source_pad[b])
        _check_alignment(b, al, real_source, total - pad)
        rows[b, pad:] = torch.where(index >= 0, index + source_pad[b], -1)
    return rows


def leading_native(rows: torch.Tensor, target_pad: torch.Tensor) -> torch.Tensor:
    """[batch] number of leading real target tokens without a source row (template markers, BOS)."""
    counts = []
    for b in range(rows.shape[0]):
        real = rows[b, int(target_pad[b]) :]
        mapped = (real >= 0).nonzero()
        counts.append(int(mapped[0]) if len(mapped) else len(real))
    return torch.tensor(counts, dtype=torch.long)
