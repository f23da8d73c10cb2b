"""The fitting core: paired KV of calibration sequences in, per-layer affine maps out.

Per calibration sequence it consumes a `PairedKV`: un-rotated source keys and values, target
keys and values, the pairing (source row, target row) of the rows to fit (positions the target
computes natively already removed) and, for attention-aligned fitting, the target's raw token
weights. It accumulates, per target layer, the statistics of that layer's maps (train split,
optionally attention-weighted, and an unweighted held-out split), then solves them.

Knows nothing about models, tokenizers or calibration text: a same-tokenizer pair and a
cross-tokenizer pair differ only in the pairing they hand in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch

from bridgecache.bridge.maps import LayerMap
from bridgecache.fitting.gram import chunks, head_rows
from bridgecache.fitting.products import GEMM_PRECISIONS, Products
from bridgecache.fitting.ridge import r2, rescale, solve, variance_scale
from bridgecache.fitting.stats import SufficientStats, WeightedMoments, accumulate, add_moments, zeros
from bridgecache.fitting.support import ProbeRows

__all__ = ["PairedKV", "Shift", "add_probe", "row_matrix", "LayerAccumulator"]


@dataclass
class PairedKV:
    """One calibration sequence as the core sees it.

    source_keys[l], source_values[l]: [batch, src_heads, src_tokens, src_dim], keys un-rotated.
    target_keys[l], target_values[l]: [batch, tgt_heads, tgt_tokens, tgt_dim], keys un-rotated.
    src_rows, tgt_rows: int64 [n] (batch 1) or [batch, n], the pairs to fit (target rows <
        native_head already dropped); -1 in both pads a batch's shorter sequences.
    key_weights[l], value_weights[l]: [batch, tgt_heads, tgt_tokens] raw attention weights, or None.
    heldout: whether these sequences score the maps instead of fitting them.
    """

    source_keys: list[torch.Tensor]
    source_values: list[torch.Tensor]
    target_keys: list[torch.Tensor]
    target_values: list[torch.Tensor]
    src_rows: torch.Tensor
    tgt_rows: torch.Tensor
    heldout: bool = False
    key_weights: list[torch.Tensor] | None = None
    value_weights: list[torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        """The pairs to fit, padding not counted."""
        return int((self.tgt_rows >= 0).sum())


def row_matrix(rows: torch.Tensor) -> torch.Tensor:
    """Rows as [batch, n] (one sequence's [n] as a batch of one)."""
    return rows if rows.dim() == 2 else rows[None]


@dataclass
class Shift:
    """Constant offsets subtracted from every row before accumulating: [1, heads, 1, dim] per layer.

    Raw moments lose digits to cancellation when the data sit far from zero (keys carry large
    biases) and the statistics kernel forms its products in float32. Any constant shift leaves the
    fitted W and the R^2 unchanged; with a shift near the mean (that of the first sequence) the
    moments stay well conditioned. `LayerAccumulator.solve` shifts the bias back.
    """

    source_keys: list[torch.Tensor]
    source_values: list[torch.Tensor]
    target_keys: list[torch.Tensor]
    target_values: list[torch.Tensor]

    @classmethod
    def of(cls, seq: PairedKV) -> Shift:
        """The means of the first sequence's paired rows."""
        src, tgt = row_matrix(seq.src_rows)[0], row_matrix(seq.tgt_rows)[0]
        src, tgt = src[src >= 0], tgt[tgt >= 0]

        def means(layers, idx):
            return [x[:1, :, idx.to(x.device)].mean(2, keepdim=True) for x in layers]

        return cls(
            means(seq.source_keys, src), means(seq.source_values, src),
            means(seq.target_keys, tgt), means(seq.target_values, tgt),
        )  # fmt: skip

    def apply(self, seq: PairedKV) -> PairedKV:
        """`seq` shifted, each side's layers views of one buffer [layers, batch, heads, tokens, d]:
        the statistics kernel then finds every batch's layers at the same offsets (no table copy)."""

        def sub(layers, shifts):
            return list(torch.stack(layers).sub_(torch.stack(shifts)).unbind(0))

        return replace(
            seq,
            source_keys=sub(seq.source_keys, self.source_keys),
            source_values=sub(seq.source_values, self.source_values),
            target_keys=sub(seq.target_keys, self.target_keys),
            target_values=sub(seq.target_values, self.target_values),
        )


def add_probe(probe: ProbeRows, seq: PairedKV) -> None:
    """Add the rows of one sequence (or a batch) to the single-layer probes' rows."""
    src, tgt = row_matrix(seq.src_rows), row_matrix(seq.tgt_rows)
    src = [r[r >= 0].to(seq.source_keys[0].device) for r in src]  # per sequence, padding dropped
    tgt = [r[r >= 0].to(seq.target_keys[0].device) for r in tgt]

    def rows(layers, idx):  # [batch, heads, tokens, d] -> [n, heads, d]
        return [torch.cat([x[b][:, i] for b, i in enumerate(idx)], 1).transpose(0, 1) for x in layers]

    probe.update(
        rows(seq.source_keys, src), rows(seq.source_values, src),
        rows(seq.target_keys, tgt), rows(seq.target_values, tgt),
    )  # fmt: skip


class LayerAccumulator:
    """Statistics of one target layer's K and V maps; `solve` turns them into a LayerMap.

    inputs: int64 [tgt_heads, n_in, 2] (source layer, source head) per input slot.
    weighted: accumulate attention-aligned (r-weighted) training statistics as well.
    statistics: ({kind: SufficientStats} of training, of held-out rows) accumulated elsewhere, to
        be solved only (Full-Head's shared statistics, bridgecache.fitting.gram).
    """

    def __init__(self, layer: int, inputs: torch.Tensor, src_heads: int, src_dim: int, tgt_dim: int,
                 weighted: bool, device=None, *, precision: str = "bf16-gemm",
                 statistics: tuple[dict, dict] | None = None):  # fmt: skip
        self.layer = layer
        # GEMM_PRECISIONS: GEMMs on gathered rows (fitting.products); "tf32", "bf16": the fused kernel
        self.precision = precision
        self.products = Products(precision) if precision in GEMM_PRECISIONS else None
        self.inputs = inputs
        self.used = sorted({int(s) for s in inputs[..., 0].flatten()})
        position = {s: i for i, s in enumerate(self.used)}
        layer_pos = torch.tensor(
            [[position[int(s)] for s in row] for row in inputs[..., 0]], dtype=torch.long
        )
        slots = layer_pos * src_heads + inputs[..., 1]  # index into stacked source heads
        self.slots, self.src_heads = slots.tolist(), src_heads
        self.heads = slots.to(device)
        shared = bool((inputs == inputs[:1]).all())  # full-head: one Gram matrix for the layer
        h, p = inputs.shape[0], inputs.shape[1] * src_dim
        self.weighted = weighted
        if statistics is not None:  # accumulated elsewhere (bridgecache.fitting.gram): only solved here
            self.train, self.heldout = statistics
        elif weighted:
            self.train = {kind: WeightedMoments.zeros(h, p, tgt_dim, shared, device) for kind in "kv"}
        else:
            self.train = {kind: zeros(h, p, tgt_dim, shared, device) for kind in "kv"}
        if statistics is None:
            self.heldout = {kind: zeros(h, p, tgt_dim, shared, device) for kind in "kv"}
        self.alphas: dict[str, list[float]] = {}

    def buffers(self) -> list[torch.Tensor]:
        """Every statistics tensor held (their bytes are this accumulator's memory)."""
        out = []
        for moments in [*self.train.values(), *self.heldout.values()]:
            if isinstance(moments, WeightedMoments):
                out += [moments.n, moments.sum_r, moments.sum_r2]
                parts = [moments.plain, moments.by_r]
            else:
                parts = [moments]
            out += [getattr(m, f.name) for m in parts for f in fields(m)]
        return out

    @property
    def uses_gemm(self) -> bool:
        """Whether rows are added as GEMMs on gathered rows (GEMM_PRECISIONS)."""
        return self.products is not None

    def row_bytes(self, src_dim: int) -> int:
        """Bytes of one row of every head's gathered inputs (the GEMM path's chunks)."""
        item = self.products.row_bytes(self.heads.device) if self.products else 8
        return item * self.heads.numel() * src_dim

    def add(self, seq: PairedKV, index: list | None = None) -> None:
        """Add the rows of one sequence (or a batch); its tensors should be on this accumulator's
        device already (fit_layer_maps moves them once for every layer). At GEMM_PRECISIONS
        GEMMs on the gathered rows (bridgecache.fitting.gram), in the chunks `index` (from
        `gram.chunks`, made once for every layer of a batch: each making waits for the GPU; None:
        made here), else the fused kernel."""
        device = self.heads.device
        rows = row_matrix(seq.src_rows).to(device)  # [batch, n], -1: padding (skipped)
        tgt = row_matrix(seq.tgt_rows).to(device).clamp_min(0)
        if not self.uses_gemm:
            index = None
        elif index is None:  # [heads, rows, p] per chunk, gathered once for a kind's statistics
            index = chunks(rows, self.row_bytes(seq.source_keys[0].shape[-1]))
        for kind, src_layers, tgt_layers, weights in (
            ("k", seq.source_keys, seq.target_keys, seq.key_weights),
            ("v", seq.source_values, seq.target_values, seq.value_weights),
        ):
            src = [src_layers[s].to(device) for s in self.used]  # stacked on the head axis
            y = _gather(tgt_layers[self.layer].to(device), tgt)  # [batch, Ht, n, Dt]
            if self.weighted and not seq.heldout and weights is None:
                raise ValueError("attention-weighted fitting needs key_weights and value_weights")
            r = None
            if self.weighted and not seq.heldout:
                r = _gather(weights[self.layer].to(device), tgt) * (rows >= 0)[:, None]  # 0 on padding
            if index is not None:
                self._add_rows(kind, src, index, rows, y, r, seq.heldout)
            elif seq.heldout:
                accumulate(self.heldout[kind], src, rows, self.heads, y, precision=self.precision)
            elif not self.weighted:
                accumulate(self.train[kind], src, rows, self.heads, y, precision=self.precision)
            else:
                self.train[kind].add(src, rows, self.heads, y, r, precision=self.precision)

    def _add_rows(self, kind: str, src, index, rows, y, r, heldout: bool) -> None:
        """The GEMM path: each chunk's rows gathered once for every statistic of `kind`."""
        products = self.products
        for part in index:
            x, yy, w = head_rows(src, self.src_heads, self.slots, part, rows, y, r, products.rows)
            if heldout:
                add_moments(self.heldout[kind], x, yy, None, products)
            elif not self.weighted:
                add_moments(self.train[kind], x, yy, None, products)
            else:
                self.train[kind].add_rows(x, yy, w, products)

    def training_moments(self, kind: str) -> SufficientStats:
        """The statistics the map is solved from (attention-weighted when asked for)."""
        if not self.weighted:
            return self.train[kind]
        combined, self.alphas[kind] = self.train[kind].combine()
        return combined

    def solve(self, lam: float, shift: Shift | None = None, key_scale: str = "none") -> LayerMap:
        """The fitted maps; `shift` is the Shift the accumulated rows were taken with, if any.

        key_scale "variance" (checked by fit_layer_maps): stretch each head's key prediction to
        the target keys' spread (see bridgecache.fitting.ridge), measured on the held-out rows
        (training rows if none);
        `self.key_alpha` [tgt_heads] and `self.r2_key_ridge` keep the factor and the R^2 before it.
        """
        maps, scores = {}, {}
        for kind in "kv":
            moments = self.training_moments(kind)
            w, b = solve(moments, lam)
            has_heldout = float(self.heldout[kind].sum_w.min()) > 0
            if kind == "k" and key_scale == "variance":
                self.r2_key_ridge = r2(w, b, self.heldout[kind])[1] if has_heldout else math.nan
                self.key_alpha = variance_scale(w, self.heldout[kind] if has_heldout else moments)
                w, b = rescale(w, b, self.key_alpha, moments)
            scores[kind] = r2(w, b, self.heldout[kind])[1] if has_heldout else math.nan
            if shift is not None:
                b = b + self._unshift(shift, kind, w)
            maps[kind] = (w.float().cpu(), b.float().cpu())
        return LayerMap(
            source_layers=self.used,
            inputs=self.inputs.cpu(),
            key_weight=maps["k"][0],
            key_bias=maps["k"][1],
            value_weight=maps["v"][0],
            value_bias=maps["v"][1],
            r2_key=scores["k"],
            r2_value=scores["v"],
        )

    def _unshift(self, shift: Shift, kind: str, w: torch.Tensor) -> torch.Tensor:
        """c_y - c_x W per head: the bias correction for rows shifted by (c_x, c_y)."""
        src = shift.source_keys if kind == "k" else shift.source_values
        tgt = shift.target_keys if kind == "k" else shift.target_values
        cx = torch.stack(
            [torch.cat([src[int(s)][0, int(h), 0] for s, h in head]) for head in self.inputs]
        ).to(w)  # [Ht, p]
        cy = tgt[self.layer][0, :, 0].to(w)  # [Ht, Dt]
        return cy - (cx.unsqueeze(1) @ w).squeeze(1)


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, tokens, ...] at the tokens index [batch, n] names: [batch, heads, n, ...]."""
    index = index[:, None, :] if x.dim() == 3 else index[:, None, :, None]
    return torch.take_along_dim(x, index, dim=2)
