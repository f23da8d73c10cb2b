"""The maps' statistics as float64 GEMMs: Full-Head's shared blocks once for all the layers that
need them (`SharedGram`), and per-head statistics from rows gathered once (`head_rows`).

Full-Head Mapping regresses every head of target layer t on the same inputs: all heads of its
source layers S_t. So its Gram matrix X^T X is one per target layer, made of blocks X_a^T X_b
for source layers a <= b in S_t, and target layers whose supports overlap need the same blocks
(the shipped bridges' 24 target layers need 240 blocks, 98-100 of them distinct). `SharedGram`
adds each distinct block once per chunk of rows with one float64 GEMM (`addmm_`, exact where
the fused kernel forms float32 products), the cross moments X_a^T Y_t once per (source layer,
target layer), and assembles each target layer's `SufficientStats` for the solver.

Memory: the distinct blocks and cross moments (never more than one `SufficientStats` per target
layer would hold) plus one chunk of gathered rows (at most 256 MiB of them).

Per-head statistics (CacheBridge's matched heads, attention-weighted rows): `head_rows` gathers
each head's rows X [heads, rows, p] once per chunk in float64, and `stats.add_moments` adds
their (optionally weighted) moments with batched GEMMs; the unweighted and the r-weighted
statistics of `WeightedMoments` share one gather. The fused kernel (bridgecache.kernels.stats)
does the same without materialising X, at float32 or coarser products.

Knows nothing about models, tokenizers or how the statistics are solved.
"""

from __future__ import annotations

import torch

from bridgecache.fitting.stats import SufficientStats

__all__ = ["SharedGram", "head_rows", "chunks"]

_CHUNK_BYTES = 256 * 2**20  # gathered float64 rows held at once


class SharedGram:
    """Float64 moments of one split (training or held-out) for a group of Full-Head target layers.

    supports: {target layer: its source layers, ascending}; widths: source heads x head dim (the
    inputs of one source layer), target heads x head dim (the outputs of one target layer).
    """

    def __init__(self, supports: dict[int, list[int]], src_heads: int, src_dim: int, tgt_heads: int,
                 tgt_dim: int, device=None):  # fmt: skip
        self.supports = {t: list(s) for t, s in supports.items()}
        self.src_heads, self.tgt_heads, self.tgt_dim = src_heads, tgt_heads, tgt_dim
        self.used = sorted({a for s in self.supports.values() for a in s})
        self.pairs = sorted({(a, b) for s in self.supports.values() for i, a in enumerate(s) for b in s[i:]})
        w, q = src_heads * src_dim, tgt_heads * tgt_dim
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.xx = {pair: z(w, w) for pair in self.pairs}  # X_a^T X_b
        self.sx = {a: z(w) for a in self.used}
        self.xy = {(a, t): z(w, q) for t, s in self.supports.items() for a in s}  # X_a^T Y_t
        self.sy = {t: z(q) for t in self.supports}
        self.syy = {t: z(q) for t in self.supports}
        self.n = 0

    @staticmethod
    def bytes_of(supports: dict[int, list[int]], width: int, out_width: int) -> int:
        """What a SharedGram of these supports holds (float64), for inputs and outputs of one
        source and one target layer `width` and `out_width` wide."""
        pairs = {(a, b) for s in supports.values() for i, a in enumerate(s) for b in s[i:]}
        used = {a for s in supports.values() for a in s}
        cross = sum(len(s) for s in supports.values())
        return 8 * (len(pairs) * width * width + len(used) * width + cross * width * out_width
                    + 2 * len(supports) * out_width)  # fmt: skip

    def row_bytes(self, width: int) -> int:
        """Bytes of one gathered row of every source layer read, float64 (`chunks`' row_bytes)."""
        return 8 * width * len(self.used)

    def add(self, sources: list[torch.Tensor], targets: list[torch.Tensor], src_rows: torch.Tensor,
            tgt_rows: torch.Tensor, index: list) -> None:  # fmt: skip
        """Add a batch: sources[a] [batch, src_heads, src_tokens, src_dim], targets[t] [batch,
        tgt_heads, tgt_tokens, tgt_dim] (shifted; keys un-rotated); src_rows, tgt_rows [batch, n]
        int64 on their device, -1 where a row pads; index: its chunks (`chunks`, made once for
        keys and values)."""
        for b, i in index:
            self._add_rows(sources, targets, b, src_rows[b, i], tgt_rows[b, i])

    def _add_rows(self, sources, targets, b, s, t) -> None:
        m = b.numel()
        # [m, heads, d] -> [m, heads * d]: a source layer's heads side by side, as full_inputs orders them
        x = {a: sources[a][b, :, s].reshape(m, -1).double() for a in self.used}
        for a, c in self.pairs:
            self.xx[(a, c)].addmm_(x[a].T, x[c])
        for a in self.used:
            self.sx[a] += x[a].sum(0)
        for layer, support in self.supports.items():
            y = targets[layer][b, :, t].reshape(m, -1).double()
            for a in support:
                self.xy[(a, layer)].addmm_(x[a].T, y)
            self.sy[layer] += y.sum(0)
            self.syy[layer] += (y * y).sum(0)
        self.n += m

    def stats(self, layer: int) -> SufficientStats:
        """Target `layer`'s statistics as the solver reads them: xtx [1, p, p], xty [heads, p, d]."""
        support = self.supports[layer]
        w = self.xx[self.pairs[0]].shape[0]
        p, device = len(support) * w, self.xx[self.pairs[0]].device
        xtx = torch.empty(1, p, p, dtype=torch.float64, device=device)
        for i, a in enumerate(support):
            for j, c in enumerate(support[i:], i):
                block = self.xx[(a, c)]
                xtx[0, i * w : (i + 1) * w, j * w : (j + 1) * w] = block
                xtx[0, j * w : (j + 1) * w, i * w : (i + 1) * w] = block.T
        xy = torch.cat([self.xy[(a, layer)] for a in support])  # [p, heads * d]
        h, d = self.tgt_heads, self.tgt_dim
        return SufficientStats(
            xtx=xtx,
            xty=xy.view(p, h, d).transpose(0, 1).contiguous(),
            sum_x=torch.cat([self.sx[a] for a in support])[None],
            sum_y=self.sy[layer].view(h, d).clone(),
            sum_yy=self.syy[layer].view(h, d).clone(),
            sum_w=torch.full((1,), float(self.n), dtype=torch.float64, device=device),
        )


def chunks(rows: torch.Tensor, row_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(batch index, position) of the valid rows of `rows` [batch, n] (-1: padding), in chunks
    whose gathered rows (`row_bytes` each) take at most 256 MiB (one wait for the GPU per call)."""
    batch, pos = (rows >= 0).nonzero(as_tuple=True)
    size = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    return [(batch[i : i + size], pos[i : i + size]) for i in range(0, batch.numel(), size)]


def head_rows(src: list[torch.Tensor], src_heads: int, slots: list[list[int]], index, rows: torch.Tensor,
              y: torch.Tensor, weights: torch.Tensor | None = None):  # fmt: skip
    """One chunk of each target head's regression rows, float64.

    src: layers [batch, src_heads, tokens, d] stacked on the head axis (slot v: layer v //
    src_heads, head v % src_heads); slots[h]: head h's input slots, in order; index: (batch,
    position) of the chunk (`chunks`); rows [batch, n]: source row per position; y [batch,
    heads, n, dt]; weights [batch, heads, n] or None.
    Returns x [heads, m, p], y [heads, m, dt], w [heads, m] (None without weights).
    """
    b, i = index
    s = rows[b, i]
    column = {v: src[v // src_heads][b, v % src_heads, s].double() for v in {v for row in slots for v in row}}
    x = torch.stack([torch.cat([column[v] for v in row], 1) for row in slots])
    w = None if weights is None else weights[b, :, i].T.double()
    return x, y[b, :, i].transpose(0, 1).double(), w
