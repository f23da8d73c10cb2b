"""One statistics pass over a group of target layers: Full-Head's shared blocks or one
accumulator per layer, and each layer's accumulator ready to solve.

Knows nothing about models, tokenizers or calibration text.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bridgecache.fitting.core import LayerAccumulator, PairedKV, row_matrix
from bridgecache.fitting.gram import SharedGram, chunks

__all__ = ["GroupStatistics", "gram_path", "shared_supports"]


def gram_path(weighted: bool, precision: str) -> bool:
    """Whether shared statistics run as float64 GEMMs (SharedGram): uniform weights (one Gram
    matrix per layer) at the default precision; "tf32" and "bf16" ask for the fused kernel's
    faster, coarser products."""
    return not weighted and precision == "tf32x3"


def shared_supports(inputs: list[torch.Tensor], src_heads: int) -> dict[int, list[int]] | None:
    """{target layer: source layers} when every layer's heads all read every head of its source
    layers in full_inputs' order (Full-Head); else None."""
    out = {}
    for t, x in enumerate(inputs):
        layers = sorted({int(a) for a in x[..., 0].flatten()})
        full = torch.tensor([(a, h) for a in layers for h in range(src_heads)], dtype=x.dtype)
        if x.shape[1] != full.shape[0] or not bool((x == full).all()):
            return None
        out[t] = layers
    return out


class GroupStatistics:
    """One pass's statistics for a group of target layers: Full-Head's shared blocks (one
    SharedGram per split and kind, when `supports` is given) or one LayerAccumulator per layer.

    shape: (source heads, source dim, target heads, target dim).
    """

    def __init__(self, group, inputs, supports, shape, weighted: bool, device, precision: str):
        hs, ds, ht, dt = shape
        self.group, self.inputs, self.shape = group, inputs, shape
        if supports:
            mine = {t: supports[t] for t in group}
            self.grams = {s: {k: SharedGram(mine, hs, ds, ht, dt, device) for k in "kv"} for s in _SPLITS}
        else:
            self.grams = None
            self.accs = [
                LayerAccumulator(t, inputs[t], hs, ds, dt, weighted, device, precision=precision)
                for t in group
            ]

    def add(self, seq: PairedKV) -> None:
        """Add a (shifted) batch of rows."""
        if self.grams is None:
            index = None
            if self.accs[0].precision == "tf32x3":  # the GEMM path's chunks: one wait for the GPU per batch
                width = max(acc.row_bytes(seq.source_keys[0].shape[-1]) for acc in self.accs)
                index = chunks(row_matrix(seq.src_rows).to(self.accs[0].heads.device), width)
            for acc in self.accs:
                acc.add(seq, index)
            return
        grams = self.grams["heldout" if seq.heldout else "train"]
        src_rows, tgt_rows = row_matrix(seq.src_rows), row_matrix(seq.tgt_rows)
        grams["k"].add(seq.source_keys, seq.target_keys, src_rows, tgt_rows)
        grams["v"].add(seq.source_values, seq.target_values, src_rows, tgt_rows)

    def accumulators(self) -> Iterator[LayerAccumulator]:
        """Each layer's accumulator, ready to solve (shared blocks assembled one layer at a time)."""
        if self.grams is None:
            yield from self.accs
            return
        hs, ds, _, dt = self.shape
        for t in self.group:
            stats = tuple({k: self.grams[s][k].stats(t) for k in "kv"} for s in _SPLITS)
            yield LayerAccumulator(t, self.inputs[t], hs, ds, dt, False, statistics=stats)


_SPLITS = ("train", "heldout")
