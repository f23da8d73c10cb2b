"""One statistics pass over a group of target layers, and each layer's accumulator ready to solve.

Three ways, by method and precision: Full-Head's shared blocks (`gram.SharedGram`: uniform
weights, a GEMM precision: "bf16-gemm" or "tf32x3", bridgecache.fitting.products); every (layer,
head) of the group on one stacked head axis (`gram.StackedHeads`: per-head statistics at a GEMM
precision on CUDA, each chunk of rows gathered once and each statistic one batched GEMM for all
the group's layers, where their heads read the same number of input slots); else one
`LayerAccumulator` per layer (GEMMs on the CPU; the fused kernel at "tf32" or "bf16").

Knows nothing about models, tokenizers or calibration text.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from bridgecache.fitting.core import LayerAccumulator, PairedKV, row_matrix
from bridgecache.fitting.gram import SharedGram, StackedHeads, chunks
from bridgecache.fitting.products import GEMM_PRECISIONS

__all__ = [
    "GroupStatistics",
    "gram_path",
    "stacks_heads",
    "shared_supports",
    "statistics_label",
    "layer_groups",
    "shared_groups",
]


def gram_path(weighted: bool, precision: str) -> bool:
    """Whether shared statistics run as GEMMs over distinct blocks (SharedGram): uniform weights
    (one Gram matrix per layer) at a GEMM precision; "tf32" and "bf16" ask for the fused kernel."""
    return not weighted and precision in GEMM_PRECISIONS


def stacks_heads(inputs: list[torch.Tensor], precision: str, device) -> bool:
    """Whether a group's per-head statistics run on one stacked head axis (StackedHeads): GEMMs
    (GEMM_PRECISIONS) on CUDA, every layer's heads reading the same number of input slots. Layers
    whose heads share one Gram matrix (weighted Full-Head) are stacked as well, keeping theirs.
    On CUDA one accumulator per layer is bound by its launches (7B -> 1.5B, 500 x 1,024: 3.93 s
    against 1.31 s stacked on an H100); on the CPU the stacking's copies cost more than the
    launches it saves (28 layers: 4.3 s a batch against 3.2 s, `benchmarks/fit_statistics.py`)."""
    on_cuda = torch.device(device or "cpu").type == "cuda"
    return on_cuda and precision in GEMM_PRECISIONS and len({x.shape[1] for x in inputs}) == 1


def statistics_label(shared: bool, precision: str) -> str:
    """How the statistics were accumulated, for a bridge's calibration record."""
    if precision not in GEMM_PRECISIONS:
        return f"fused kernel ({precision})"
    rows = "bfloat16 rows" if precision == "bf16-gemm" else "float64 rows"
    return f"{'shared' if shared else 'per-head'} GEMMs on {rows}, float64 totals"


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
    SharedGram per split and kind, when `supports` is given), every layer's heads stacked (one
    StackedHeads, `stacks_heads`) or one LayerAccumulator per layer.

    shape: (source heads, source dim, target heads, target dim).
    """

    def __init__(self, group, inputs, supports, shape, weighted: bool, device, precision: str):
        hs, ds, ht, dt = shape
        self.group, self.inputs, self.shape, self.weighted = group, inputs, shape, weighted
        self.grams = self.heads = self.accs = None
        if supports:
            mine = {t: supports[t] for t in group}
            self.grams = {
                s: {k: SharedGram(mine, hs, ds, ht, dt, device, precision) for k in "kv"} for s in _SPLITS
            }
        elif stacks_heads([inputs[t] for t in group], precision, device):
            self.heads = StackedHeads({t: inputs[t] for t in group}, hs, ds, dt, weighted, device, precision)
        else:
            self.accs = [
                LayerAccumulator(t, inputs[t], hs, ds, dt, weighted, device, precision=precision)
                for t in group
            ]

    def add(self, seq: PairedKV) -> None:
        """Add a (shifted) batch of rows."""
        src_rows, tgt_rows = row_matrix(seq.src_rows), row_matrix(seq.tgt_rows)
        src_dim = seq.source_keys[0].shape[-1]
        # The GEMM paths' chunks, made once for every layer and kind: each making waits for the GPU
        if self.accs is not None:
            index = None
            if self.accs[0].uses_gemm:
                width = max(acc.row_bytes(src_dim) for acc in self.accs)
                index = chunks(src_rows.to(self.accs[0].heads.device), width)
            for acc in self.accs:
                acc.add(seq, index)
        elif self.heads is not None:
            self._add_stacked(seq, src_rows, tgt_rows, src_dim)
        else:
            grams = self.grams["heldout" if seq.heldout else "train"]
            index = chunks(src_rows, grams["k"].row_bytes(self.shape[0] * src_dim))
            grams["k"].add(seq.source_keys, seq.target_keys, src_rows, tgt_rows, index)
            grams["v"].add(seq.source_values, seq.target_values, src_rows, tgt_rows, index)

    def _add_stacked(self, seq: PairedKV, src_rows, tgt_rows, src_dim: int) -> None:
        heads, weighted = self.heads, self.weighted and not seq.heldout
        if weighted and (seq.key_weights is None or seq.value_weights is None):
            raise ValueError("attention-weighted fitting needs key_weights and value_weights")
        src_rows, tgt_rows = src_rows.to(heads.device), tgt_rows.to(heads.device)
        index = chunks(src_rows, heads.row_bytes(src_dim))
        for kind, src, tgt, weights in (
            ("k", seq.source_keys, seq.target_keys, seq.key_weights),
            ("v", seq.source_values, seq.target_values, seq.value_weights),
        ):
            weights = weights if weighted else None
            heads.add(kind, src, tgt, weights, src_rows, tgt_rows, index, seq.heldout)

    def accumulators(self) -> Iterator[LayerAccumulator]:
        """Each layer's accumulator, ready to solve (shared blocks assembled one layer at a time)."""
        if self.accs is not None:
            yield from self.accs
            return
        hs, ds, _, dt = self.shape
        for t in self.group:
            if self.heads is not None:
                stats, weighted = self.heads.statistics(t), self.weighted
            else:
                stats, weighted = tuple({k: self.grams[s][k].stats(t) for k in "kv"} for s in _SPLITS), False
            yield LayerAccumulator(t, self.inputs[t], hs, ds, dt, weighted, statistics=stats)


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
