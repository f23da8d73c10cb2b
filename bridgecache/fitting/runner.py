"""Run the source and target models over calibration sequences and yield `PairedKV`s.

One sequence at a time (memory does not grow with the number of sequences): capture both
models' KV, un-rotate keys with each model's own rotary tables and, when asked, compute the
target's attention-aligned token weights from the same target forward pass.

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

__all__ = ["paired_kv"]


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
) -> Iterator[PairedKV]:
    """Yield one PairedKV per calibration sequence (see `bridgecache.fitting.core.PairedKV`)."""
    same = source_model is target_model
    tokens = sum(int(seq.target_ids.numel()) for seq in sequences)
    bar = tqdm(total=tokens, desc=desc, unit="tok", unit_scale=True, disable=not progress)
    for seq in sequences:
        bar.update(int(seq.target_ids.numel()))  # tokens/s: of the forwards and what follows them
        tgt_ids = seq.target_ids[None]
        weights = (None, None)
        if with_weights and not seq.heldout:  # held-out rows are scored unweighted
            rows = boundary_rows(tgt_ids.shape[1], boundaries, native_head)
            with QueryRecorder(target_model, rows) as recorder:
                tgt = capture_kv(target_model, tgt_ids)
            weights = layer_weights(target_model, recorder, tgt.keys, tgt.values)
        else:
            tgt = capture_kv(target_model, tgt_ids)
        same_ids = same and torch.equal(seq.source_ids, seq.target_ids)
        src = tgt if same_ids else capture_kv(source_model, seq.source_ids[None])
        tgt_keys = [tgt.unrotated_keys(layer) for layer in range(tgt.num_layers)]
        src_keys = tgt_keys if src is tgt else [src.unrotated_keys(layer) for layer in range(src.num_layers)]
        src_values = [v.float() for v in src.values]
        if seq.pool is not None:  # policy "mean": one pooled source row per target token
            from bridgecache.kv.align import gather_rows

            src_keys = [gather_rows(k, seq.pool) for k in src_keys]
            src_values = [gather_rows(v, seq.pool) for v in src_values]
        yield PairedKV(
            source_keys=src_keys,
            source_values=src_values,
            target_keys=tgt_keys,
            target_values=[v.float() for v in tgt.values],
            src_rows=seq.src_rows,
            tgt_rows=seq.tgt_rows,
            heldout=seq.heldout,
            key_weights=weights[0],
            value_weights=weights[1],
        )
    bar.close()
