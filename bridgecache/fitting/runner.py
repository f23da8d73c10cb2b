"""Run the source and target models over calibration sequences and yield `PairedKV`s.

A few sequences at a time (`batch` per forward; memory grows with the batch, never with the
number of sequences): capture both models' KV, un-rotate keys with each model's own rotary tables
and, when asked, compute the target's attention-aligned token weights from the same target
forward pass. A batch holds sequences of one split (training or held-out) and one target length;
sources of different lengths are left-padded (the padding is masked, so each sequence's KV are
those of its own forward) and their rows shifted past the padding.

Knows models and KV capture; nothing about statistics or tokenizers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from bridgecache.fitting.attention import QueryRecorder, boundary_rows, layer_weights
from bridgecache.fitting.calibration import CalibSequence
from bridgecache.fitting.core import PairedKV
from bridgecache.kv.capture import capture_kv

__all__ = ["paired_kv", "batches"]


@torch.no_grad()
def paired_kv(
    source_model,
    target_model,
    sequences: list[CalibSequence],
    with_weights: bool = False,
    boundaries: int = 32,
    native_head: int = 1,
    progress: bool = True,
    desc: str = "calibration",
    batch: int = 1,
) -> Iterator[PairedKV]:
    """Yield one PairedKV per batch of up to `batch` calibration sequences (see
    `bridgecache.fitting.core.PairedKV`; a batch of one has rows [n], a larger one [batch, n])."""
    same = source_model is target_model
    tokens = sum(int(seq.target_ids.numel()) for seq in sequences)
    bar = tqdm(total=tokens, desc=desc, unit="tok", unit_scale=True, disable=not progress)
    for group in batches(sequences, batch):
        bar.update(sum(int(seq.target_ids.numel()) for seq in group))  # tokens/s: forwards and what follows
        yield _paired(source_model, target_model, group, same, with_weights, boundaries, native_head)
    bar.close()


def batches(sequences: list[CalibSequence], size: int) -> Iterator[list[CalibSequence]]:
    """Runs of up to `size` sequences sharing a split and a target length, in order of their
    first sequence (a batch of one for `size` 1: the sequences as given)."""
    open_groups: dict[tuple[bool, int], list[CalibSequence]] = {}
    for seq in sequences:
        key = (seq.heldout, int(seq.target_ids.numel()))
        group = open_groups.setdefault(key, [])
        group.append(seq)
        if len(group) == size:
            yield open_groups.pop(key)
    yield from open_groups.values()


def _paired(source_model, target_model, group, same, with_weights, boundaries, native_head) -> PairedKV:
    heldout = group[0].heldout
    tgt_ids = torch.stack([seq.target_ids for seq in group])  # one target length per batch
    weights = (None, None)
    if with_weights and not heldout:  # held-out rows are scored unweighted
        rows = boundary_rows(tgt_ids.shape[1], boundaries, native_head)
        with QueryRecorder(target_model, rows) as recorder:
            tgt = capture_kv(target_model, tgt_ids)
        weights = layer_weights(target_model, recorder, tgt.keys, tgt.values)
    else:
        tgt = capture_kv(target_model, tgt_ids)
    if same and all(torch.equal(seq.source_ids, seq.target_ids) for seq in group):
        src, pads = tgt, [0] * len(group)
    else:
        src_ids, mask, pads = _left_padded([seq.source_ids for seq in group])
        src = capture_kv(source_model, src_ids, mask)
    tgt_keys = [tgt.unrotated_keys(layer) for layer in range(tgt.num_layers)]
    src_keys = tgt_keys if src is tgt else [src.unrotated_keys(layer) for layer in range(src.num_layers)]
    src_values = [v.float() for v in src.values]
    src_rows = [seq.src_rows + pad for seq, pad in zip(group, pads)]
    if group[0].pool is not None:  # policy "mean": one pooled source row per target token
        src_keys, src_values = _pooled(src_keys, group, pads), _pooled(src_values, group, pads)
        src_rows = [seq.src_rows for seq in group]
    return PairedKV(
        source_keys=src_keys,
        source_values=src_values,
        target_keys=tgt_keys,
        target_values=[v.float() for v in tgt.values],
        src_rows=_rows(src_rows),
        tgt_rows=_rows([seq.tgt_rows for seq in group]),
        heldout=heldout,
        key_weights=weights[0],
        value_weights=weights[1],
    )


def _left_padded(ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """ids [batch, longest] left-padded with 0, the mask (None when no row is padded) and each
    row's padding."""
    longest = max(int(x.numel()) for x in ids)
    pads = [longest - int(x.numel()) for x in ids]
    if not any(pads):
        return torch.stack(ids), None, pads
    out = torch.zeros(len(ids), longest, dtype=torch.long)
    mask = torch.zeros(len(ids), longest, dtype=torch.long)
    for row, (x, pad) in enumerate(zip(ids, pads)):
        out[row, pad:], mask[row, pad:] = x, 1
    return out, mask, pads


def _pooled(layers: list[torch.Tensor], group, pads) -> list[torch.Tensor]:
    """Each layer's source rows pooled per target token, sequence by sequence (padding dropped)."""
    from bridgecache.kv.align import gather_rows

    per_sequence = list(enumerate(zip(group, pads)))
    return [
        torch.cat([gather_rows(x[b : b + 1, :, pad:], seq.pool) for b, (seq, pad) in per_sequence])
        for x in layers
    ]


def _rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """One sequence's rows [n] as they are; a batch's [batch, longest], -1 after each row's end."""
    if len(rows) == 1:
        return rows[0]
    out = torch.full((len(rows), max(int(r.numel()) for r in rows)), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r
    return out
