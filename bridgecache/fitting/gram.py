"""The maps' statistics as GEMMs into float64 totals (rows in bfloat16 or float64 by the
precision, bridgecache.fitting.products): Full-Head's shared blocks once for all the layers that
need them (`SharedGram`), and per-head statistics of a whole group of target layers on one stacked
head axis (`StackedHeads`).

Full-Head Mapping regresses every head of target layer t on the same inputs: all heads of its
source layers S_t. So its Gram matrix X^T X is one per target layer, made of blocks X_a^T X_b
for source layers a <= b in S_t, and target layers whose supports overlap need the same blocks
(the shipped bridges' 24 target layers need 240 blocks, 98-100 of them distinct). `SharedGram`
adds each distinct block once per chunk of rows with one GEMM (`Products.add_gram`), the cross
moments X_a^T Y_t once per (source layer,
target layer), and assembles each target layer's `SufficientStats` for the solver.

Per-head statistics (CacheBridge's matched heads, attention-weighted rows): `StackedHeads` puts
every (target layer, target head) of a group on one head axis of size L * Ht. Per batch and kind
it stacks the source layers read and the group's target layers once, and per chunk of rows
gathers x [L * Ht, rows, p], y [L * Ht, rows, Dt] and the weights r [L * Ht, rows] with one
index each, then adds each statistic with one batched GEMM (`stats.add_moments`; the plain and
r-weighted statistics of `WeightedMoments` share the gather): a few dozen kernels per chunk for
the whole group where one accumulator per layer launched as many per layer. The sums of the
targets and their squares come from the stacked target layers once per batch (a head's target
rows are its layer's positions whatever its inputs: no gather). Each layer's
`LayerAccumulator` gets its slice to solve. `head_rows` gathers one layer's rows alone
(LayerAccumulator's own GEMM path, for groups whose layers read different numbers of input
slots). The fused kernel (bridgecache.kernels.stats) does the same without materialising X, at
float32 or coarser products.

Memory: the statistics (never more than one `SufficientStats` per target layer would hold),
one chunk of gathered rows (at most 256 MiB of them: bfloat16 on CUDA at "bf16-gemm", else
float64) and, for `StackedHeads`, one batch's copy of the stacked layers of one kind.

Knows nothing about models, tokenizers or how the statistics are solved.
"""

from __future__ import annotations

import torch

from bridgecache.fitting.products import Products
from bridgecache.fitting.stats import SufficientStats, WeightedMoments, add_moments

__all__ = ["SharedGram", "StackedHeads", "head_rows", "chunks"]

_CHUNK_BYTES = 256 * 2**20  # gathered float64 rows held at once


class SharedGram:
    """Float64 moments of one split (training or held-out) for a group of Full-Head target layers.

    supports: {target layer: its source layers, ascending}; widths: source heads x head dim (the
    inputs of one source layer), target heads x head dim (the outputs of one target layer).
    """

    def __init__(self, supports: dict[int, list[int]], src_heads: int, src_dim: int, tgt_heads: int,
                 tgt_dim: int, device=None, precision: str = "bf16-gemm"):  # fmt: skip
        self.supports = {t: list(s) for t, s in supports.items()}
        self.products, self.device = Products(precision), device
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
        """Bytes of one gathered row of every source layer read (`chunks`' row_bytes)."""
        return self.products.row_bytes(self.device) * width * len(self.used)

    def add(self, sources: list[torch.Tensor], targets: list[torch.Tensor], src_rows: torch.Tensor,
            tgt_rows: torch.Tensor, index: list) -> None:  # fmt: skip
        """Add a batch: sources[a] [batch, src_heads, src_tokens, src_dim], targets[t] [batch,
        tgt_heads, tgt_tokens, tgt_dim] (shifted; keys un-rotated); src_rows, tgt_rows [batch, n]
        int64 on their device, -1 where a row pads; index: its chunks (`chunks`, made once for
        keys and values)."""
        for b, i in index:
            self._add_rows(sources, targets, b, src_rows[b, i], tgt_rows[b, i])

    def _add_rows(self, sources, targets, b, s, t) -> None:
        m, products = b.numel(), self.products
        # [m, heads, d] -> [m, heads * d]: a source layer's heads side by side, as full_inputs orders them
        x = {a: products.rows(sources[a][b, :, s].reshape(m, -1)) for a in self.used}
        for a, c in self.pairs:
            products.add_gram(self.xx[(a, c)], x[a], x[c])
        for a in self.used:
            self.sx[a] += products.sum(x[a], 0)
        for layer, support in self.supports.items():
            y = products.rows(targets[layer][b, :, t].reshape(m, -1))
            for a in support:
                products.add_gram(self.xy[(a, layer)], x[a], y)
            # bfloat16 rows: their squares are exact in float32, and a chunk's sums too to ~1e-7
            # (a float64 sum of float32 rows would first copy them to float64)
            y = y.float() if y.dtype == torch.bfloat16 else y
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


class StackedHeads:
    """Float64 per-head moments of a group of target layers (CacheBridge's matched heads), every
    (target layer, target head) of the group one head of one stacked axis of size H = L * Ht.

    inputs: {target layer: int64 [Ht, n_in, 2] (source layer, source head) per input slot}, the
    same n_in for every layer (p = n_in * src_dim); weighted: the training split's statistics are
    `WeightedMoments` (attention-aligned fitting), else `SufficientStats`.
    train[kind], heldout[kind] (kind "k", "v"): xty [H, p, Dt], sum_y, sum_yy [H, Dt] (and by_r's
    moments, n, sum_r, sum_r2 [H]); xtx [G, p, p], sum_x [G, p], sum_w [G] with G = H, less Ht - 1
    per layer whose heads all read the same inputs (one Gram matrix, as `LayerAccumulator` keeps).
    Axis order: first the heads that own a Gram matrix, layer by layer (a sharing layer's head 0),
    then the sharing layers' other heads; `add_moments` takes the Gram matrices from x[:G].
    `statistics(layer)` hands a layer its slice: views, copies only for a sharing layer's heads.
    """

    def __init__(self, inputs: dict[int, torch.Tensor], src_heads: int, src_dim: int, tgt_dim: int,
                 weighted: bool, device=None, precision: str = "bf16-gemm"):  # fmt: skip
        self.layers, self.weighted = list(inputs), weighted
        self.products = Products(precision)
        self.used = sorted({int(a) for x in inputs.values() for a in x[..., 0].flatten()})
        owners, others, shared = [], [], []  # (layer's place in the group, head), in stacked-axis order
        for i, x in enumerate(inputs.values()):
            shared.append(bool((x == x[:1]).all()))  # every head reads the same inputs: one Gram matrix
            owners += [(i, h) for h in range(1 if shared[i] else x.shape[0])]
            others += [(i, h) for h in range(1, x.shape[0])] if shared[i] else []
        order = owners + others
        place = {pair: j for j, pair in enumerate(order)}
        self.heads_at = {t: [place[(i, h)] for h in range(len(inputs[t]))] for i, t in enumerate(self.layers)}
        self.grams_at = {t: self.heads_at[t][: 1 if shared[i] else None] for i, t in enumerate(self.layers)}
        position = {a: u for u, a in enumerate(self.used)}
        slots = [inputs[self.layers[i]][h].tolist() for i, h in order]  # [H][n_in] (source layer, head)
        self.slot_layer = torch.tensor([[position[a] for a, _ in row] for row in slots], device=device)
        self.slot_head = torch.tensor([[hd for _, hd in row] for row in slots], device=device)  # [H, n_in]
        self.tgt_layer = torch.tensor([i for i, _ in order], device=device)  # [H] place in the group
        self.tgt_head = torch.tensor([h for _, h in order], device=device)
        self.device = self.tgt_head.device
        heads, g, p = len(order), len(owners), len(slots[0]) * src_dim

        def moments(g: int) -> SufficientStats:
            z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
            return SufficientStats(z(g, p, p), z(heads, p, tgt_dim), z(g, p), z(heads, tgt_dim),
                                   z(heads, tgt_dim), z(g))  # fmt: skip

        def train() -> SufficientStats | WeightedMoments:
            if not weighted:
                return moments(g)
            z = lambda: torch.zeros(heads, dtype=torch.float64, device=device)  # noqa: E731
            return WeightedMoments(moments(g), moments(heads), z(), z(), z())

        self.train = {kind: train() for kind in "kv"}
        self.heldout = {kind: moments(g) for kind in "kv"}

    def row_bytes(self, src_dim: int) -> int:
        """Bytes of one gathered row of every head's inputs (`chunks`' row_bytes)."""
        return self.products.row_bytes(self.device) * self.slot_layer.numel() * src_dim

    def add(self, kind: str, sources: list[torch.Tensor], targets: list[torch.Tensor],
            weights: list[torch.Tensor] | None, src_rows: torch.Tensor, tgt_rows: torch.Tensor,
            index: list, heldout: bool) -> None:  # fmt: skip
        """Add a batch of one kind: sources[a] [batch, Hs, src_tokens, Ds], targets[t] [batch, Ht,
        tgt_tokens, Dt] (shifted; keys un-rotated), weights[t] [batch, Ht, tgt_tokens] raw attention
        weights (a weighted fit's training rows; else None); src_rows, tgt_rows [batch, n] int64 on
        this device, -1 where a row pads; index: their chunks (`chunks`, made once for both kinds)."""
        on, products = self.device, self.products
        low = torch.bfloat16 if products.low else None  # stacked once in bfloat16: fewer bytes
        src = torch.stack([sources[a].to(on, low) for a in self.used])  # [U, batch, Hs, Ts, Ds]
        tgt = torch.stack([targets[t].to(on, low) for t in self.layers])  # [L, batch, Ht, Tt, Dt]
        r = (
            None if weights is None else torch.stack([weights[t].to(on) for t in self.layers])
        )  # [L, batch, Ht, Tt]
        _, batch, hs, ts, ds = src.shape
        ht, tt = tgt.shape[2], tgt.shape[3]
        # flat row numbers of src viewed [U * batch * Hs * Ts, Ds] and tgt viewed [L * batch * Ht * Tt, Dt]:
        # a slot's (layer, head) part here, a row's (batch, token) part per chunk
        x_at = (self.slot_layer * batch * hs + self.slot_head) * ts  # [H, n_in]
        y_at = (self.tgt_layer * batch * ht + self.tgt_head) * tt  # [H]
        self._target_sums(kind, tgt, r, tgt_rows, heldout)
        src, tgt = src.view(-1, ds), tgt.view(-1, tgt.shape[-1])
        for b, i in index:
            s, t = src_rows[b, i], tgt_rows[b, i].clamp_min(0)
            xi = x_at[:, None, :] + (b * (hs * ts) + s)[None, :, None]  # [H, m, n_in]
            yi = y_at[:, None] + (b * (ht * tt) + t)[None, :]  # [H, m]
            x = products.rows(_rows(src, xi).flatten(2))  # [H, m, p]
            y = products.rows(_rows(tgt, yi))  # [H, m, Dt]
            if heldout:
                add_moments(self.heldout[kind], x, y, None, products, target_sums=False)
            elif r is None:
                add_moments(self.train[kind], x, y, None, products, target_sums=False)
            else:
                r_rows = _rows(r.view(-1, 1), yi)[..., 0].double()
                self.train[kind].add_rows(x, y, r_rows, products, target_sums=False)

    def _target_sums(self, kind: str, tgt: torch.Tensor, r: torch.Tensor | None, tgt_rows: torch.Tensor,
                     heldout: bool) -> None:  # fmt: skip
        """Add sum_y and sum_yy (and their r-weighted sums) of every stacked head's rows, formed
        from the stacked target layers tgt [L, batch, Ht, Tt, Dt] and weights r [L, batch, Ht, Tt]
        at once: a head's rows are its layer's positions `tgt_rows` [batch, n] whatever its
        inputs, so they need no gather (`Products.weighted_sums`: GEMMs for bfloat16 rows)."""
        layers, batch, ht, tt, dt = tgt.shape
        count = torch.zeros(batch, tt, dtype=torch.float64, device=tgt.device)
        # [batch, Tt]: how many rows each position is
        count.scatter_add_(1, tgt_rows.clamp_min(0), (tgt_rows >= 0).double())
        count = count[None, :, None, :].expand(layers, batch, ht, tt)
        y = self.products.rows(tgt).reshape(layers * batch * ht, tt, dt)

        def add(m: SufficientStats, w: torch.Tensor) -> None:
            sums = self.products.weighted_sums(y, w.reshape(-1, tt))
            at = (self.tgt_layer, self.tgt_head)  # [L, Ht, Dt] -> [H, Dt] in stacked-axis order
            sum_y, sum_yy = (v.view(layers, batch, ht, dt).sum(1, dtype=torch.float64)[at] for v in sums)
            m.sum_y += sum_y
            m.sum_yy += sum_yy

        if heldout:
            add(self.heldout[kind], count)
        elif r is None:
            add(self.train[kind], count)
        else:
            add(self.train[kind].plain, count)
            add(self.train[kind].by_r, count * r)

    def statistics(self, layer: int) -> tuple[dict, dict]:
        """Target `layer`'s ({kind: training statistics}, {kind: held-out statistics}), shaped as
        its own `LayerAccumulator` would hold them."""
        heads, grams = self.heads_at[layer], self.grams_at[layer]

        def part(m: SufficientStats, g: list[int]) -> SufficientStats:
            x, y = (m.xtx, m.sum_x, m.sum_w), (m.xty, m.sum_y, m.sum_yy)
            (xtx, sum_x, sum_w), (xty, sum_y, sum_yy) = [_take(v, g) for v in x], [_take(v, heads) for v in y]
            return SufficientStats(xtx, xty, sum_x, sum_y, sum_yy, sum_w)

        def train(m):
            if not self.weighted:
                return part(m, grams)
            n, sum_r, sum_r2 = (_take(v, heads) for v in (m.n, m.sum_r, m.sum_r2))
            return WeightedMoments(part(m.plain, grams), part(m.by_r, heads), n, sum_r, sum_r2)

        return (
            {kind: train(m) for kind, m in self.train.items()},
            {kind: part(m, grams) for kind, m in self.heldout.items()},
        )


def _rows(flat: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The rows of flat [rows, d] that `at` [...] names: [..., d] (one gather)."""
    return flat.index_select(0, at.flatten()).view(*at.shape, flat.shape[-1])


def _take(x: torch.Tensor, at: list[int]) -> torch.Tensor:
    """x[at] on the first axis: a view where `at` is a run of consecutive places."""
    if at == list(range(at[0], at[0] + len(at))):
        return x[at[0] : at[0] + len(at)]
    return x[torch.tensor(at, device=x.device)]


def chunks(rows: torch.Tensor, row_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(batch index, position) of the valid rows of `rows` [batch, n] (-1: padding), in chunks
    whose gathered rows (`row_bytes` each) take at most 256 MiB (one wait for the GPU per call)."""
    batch, pos = (rows >= 0).nonzero(as_tuple=True)
    size = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    return [(batch[i : i + size], pos[i : i + size]) for i in range(0, batch.numel(), size)]


def head_rows(src: list[torch.Tensor], src_heads: int, slots: list[list[int]], index, rows: torch.Tensor,
              y: torch.Tensor, weights: torch.Tensor | None = None, as_rows=torch.Tensor.double):  # fmt: skip
    """One chunk of each target head's regression rows, x and y as `as_rows` makes them
    (`Products.rows`; the weights float64).

    src: layers [batch, src_heads, tokens, d] stacked on the head axis (slot v: layer v //
    src_heads, head v % src_heads); slots[h]: head h's input slots, in order; index: (batch,
    position) of the chunk (`chunks`); rows [batch, n]: source row per position; y [batch,
    heads, n, dt]; weights [batch, heads, n] or None.
    Returns x [heads, m, p], y [heads, m, dt], w [heads, m] (None without weights).
    """
    b, i = index
    s = rows[b, i]
    used = {v for row in slots for v in row}
    column = {v: as_rows(src[v // src_heads][b, v % src_heads, s]) for v in used}
    x = torch.stack([torch.cat([column[v] for v in row], 1) for row in slots])
    w = None if weights is None else weights[b, :, i].T.double()
    return x, as_rows(y[b, :, i].transpose(0, 1)), w
