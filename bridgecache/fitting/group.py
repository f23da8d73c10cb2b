"""One statistics pass over a group of target layers: Full-Head's shared blocks or one
accumulator per layer, and each layer's accumulator ready to solve.

Knows nothing about models, tokenizers or calibration text.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bridgecache.fitting.core import LayerAccumulator, PairedKV, row_matrix
from bridgecache.fitting.gram import SharedGram, chunks

__all__ = [
    "GroupStatistics",
    "gram_path",
    "shared_supports",
    "statistics_label",
    "layer_groups",
    "shared_groups",
]


def gram_path(weighted: bool, precision: str) -> bool:
    """Whether shared statistics run as float64 GEMMs (SharedGram): uniform weights (one Gram
    matrix per layer) at the default precision; "tf32" and "bf16" ask for the fused kernel's
    faster, coarser products."""
    return not weighted and precision == "tf32x3"


def statistics_label(shared: bool, precision: str) -> str:
    """How the statistics were accumulated, for a bridge's calibration record."""
    if shared:
        return "shared float64 GEMMs"
    return "per-head float64 GEMMs" if precision == "tf32x3" else f"fused kernel ({precision})"


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
        src_rows, tgt_rows = row_matrix(seq.src_rows), row_matrix(seq.tgt_rows)
        src_dim = seq.source_keys[0].shape[-1]
        # The GEMM paths' chunks, made once for every layer and kind: each making waits for the GPU
        if self.grams is None:
            index = None
            if self.accs[0].uses_gemm:
                width = max(acc.row_bytes(src_dim) for acc in self.accs)
                index = chunks(src_rows.to(self.accs[0].heads.device), width)
            for acc in self.accs:
                acc.add(seq, index)
            return
        grams = self.grams["heldout" if seq.heldout else "train"]
        index = chunks(src_rows, grams["k"].row_bytes(self.shape[0] * src_dim))
        grams["k"].add(seq.source_keys, seq.target_keys, src_rows, tgt_rows, index)
        grams["v"].add(seq.source_values, seq.target_values, src_rows, tgt_rows, index)

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


def layer_groups(inputs, hs: int, ds: int, dt: int, weighted: bool, budget: int | None) -> list[list[int]]:
    """Target layers in consecutive groups whose per-layer statistics fit the budget together. The
    sizes come from accumulators built on the meta device."""
    sizes = [
        sum(t.nbytes for t in LayerAccumulator(i, x, hs, ds, dt, weighted, "meta").buffers())
        for i, x in enumerate(inputs)
    ]
    return consecutive_groups(list(range(len(inputs))), lambda group: sum(sizes[t] for t in group), budget)


def shared_groups(supports: dict[int, list[int]], width: int, out_width: int, copies: int,
                  budget: int | None) -> list[list[int]]:  # fmt: skip
    """Target layers in consecutive groups whose `copies` SharedGrams (splits x kinds) fit the
    budget together (blocks shared inside a group are counted once)."""
    return consecutive_groups(
        sorted(supports),
        lambda group: copies * SharedGram.bytes_of({t: supports[t] for t in group}, width, out_width),
        budget,
    )


def consecutive_groups(layers: list[int], bytes_of, budget: int | None) -> list[list[int]]:
    """`layers` in consecutive groups whose statistics (`bytes_of(group)`) fit the budget (one
    group: one pass over the text; None: one group); MemoryError if a layer alone does not."""
    if budget is None:
        return [layers]
    groups: list[list[int]] = [[]]
    for layer in layers:
        alone = bytes_of([layer])
        if alone > budget:
            raise MemoryError(
                f"target layer {layer}'s statistics need {alone / 2**30:.2f} GiB, over the memory budget "
                f"of {budget / 2**30:.2f} GiB; raise memory_budget_gb or lower layers_k"
            )
        if groups[-1] and bytes_of([*groups[-1], layer]) > budget:
            groups.append([])
        groups[-1].append(layer)
    return groups
