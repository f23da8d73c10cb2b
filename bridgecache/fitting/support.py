"""Layer support and head matching: which source (layer, head) each target head reads.

Layer support ("probe"): every (source layer, target layer) pair is scored by the held-out R^2
of a single-layer least-squares probe (all source KV heads of the layer -> all target KV heads of
the other), keys un-rotated and values, averaged over K, V and target heads; each target layer
takes its top-k source layers. The scores come from `ProbeRows`: the probe sequences' rows are
kept (in the models' precision) and each source layer's float64 moments against every target
layer ([Hs*Ds, Lt*Ht*Dt]) are formed from them in turn, so memory is the rows plus one source
layer's moments, not the [Ls, Hs*Ds, Lt*Ht*Dt] of all layer pairs at once.
Layer support ("depth"): the k source layers nearest in relative depth; no statistics needed.

Head matching (CacheBridge): by index when the head counts match; otherwise each target head
reads the source head whose single-head probe (a sub-block of the same statistics) has the best
held-out R^2 for that (source layer, target layer) pair.

Knows nothing about models or tokenizers; it sees KV tensors only.
"""

from __future__ import annotations

import torch

from bridgecache.fitting.products import Products
from bridgecache.fitting.ridge import DEFAULT_LAM, r2, solve
from bridgecache.fitting.stats import SufficientStats

__all__ = [
    "ProbeRows",
    "ProbeScores",
    "score_probes",
    "top_layers",
    "depth_layers",
    "match_heads",
    "full_inputs",
]

_F64 = torch.float64


class ProbeRows:
    """The probe pass's regression rows, kept (not their moments) for keys and values.

    update(src_k, src_v, tgt_k, tgt_v): per-layer lists of rows, src_*[l]: [n, src_heads,
    src_dim]; tgt_*[l]: [n, tgt_heads, tgt_dim] (keys un-rotated); stored per chunk as
    src [Ls, n, Hs*Ds] and tgt [n, Lt*Ht*Dt] in `dtype` on `device`.
    `moments(kind, layer)` builds one source layer's float64 statistics against every target
    layer from them: memory is the rows plus one source layer's moments, never the
    [Ls, Hs*Ds, Lt*Ht*Dt] cross moments of all layer pairs at once.
    """

    def __init__(self, ls: int, hs: int, ds: int, lt: int, ht: int, dt: int, device=None,
                 dtype=torch.float32, precision: str = "bf16-gemm"):  # fmt: skip
        self.shape = (ls, hs, ds, lt, ht, dt)
        self.device, self.dtype = device, dtype
        # "tf32x3": float64 products as asked; any other precision: bf16 GEMMs (bridgecache.fitting.products)
        self.products = Products("tf32x3" if precision == "tf32x3" else "bf16-gemm")
        self.chunks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"k": [], "v": []}
        self.target_sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.n = 0

    @staticmethod
    def bytes_per_row(ls: int, hs: int, ds: int, lt: int, ht: int, dt: int, itemsize: int) -> int:
        """What one row of keys and values costs to keep."""
        return 2 * (ls * hs * ds + lt * ht * dt) * itemsize

    @staticmethod
    def moment_bytes(ls: int, hs: int, ds: int, lt: int, ht: int, dt: int, rows: int) -> int:
        """Peak bytes of scoring: two splits' float64 moments of one source layer, one row block in
        float64, one block's float32 products and a run's float32 cross moments (`_Run`)."""
        ps, qt = hs * ds, lt * ht * dt
        return (2 * 8 * (ps * ps + ps * qt + ps + 2 * qt) + 8 * min(rows, _BLOCK_ROWS) * (ps + qt)
                + 4 * (ps * ps + 2 * ps * qt))  # fmt: skip

    def update(self, src_k, src_v, tgt_k, tgt_v) -> None:
        n = src_k[0].shape[0]
        self.n += n
        self.target_sums.clear()
        for kind, src, tgt in (("k", src_k, tgt_k), ("v", src_v, tgt_v)):
            x = torch.stack([s.reshape(n, -1).to(self.device, self.dtype) for s in src])  # [Ls, n, ps]
            y = torch.cat([t.reshape(n, -1).to(self.device, self.dtype) for t in tgt], dim=1)  # [n, Lt*Ht*Dt]
            self.chunks[kind].append((x, y))

    def moments(self, kind: str, layer: int) -> LayerMoments:
        """Float64 statistics of source `layer` (all its heads) -> every target head."""
        ls, hs, ds, lt, ht, dt = self.shape
        ps, qt = hs * ds, lt * ht * dt
        device = self.chunks[kind][0][0].device if self.chunks[kind] else self.device
        z = lambda *s: torch.zeros(*s, dtype=_F64, device=device)  # noqa: E731
        xtx, sx, xty = z(ps, ps), z(ps), z(ps, qt)
        products = self.products
        # bfloat16 rows on CUDA: no float64 copies, so blocks as long (in bytes) as theirs
        on_gpu = products.low and torch.device(device or "cpu").type == "cuda"
        block = _BLOCK_ROWS * (4 if on_gpu else 1)
        cross = _Run(xty, block if on_gpu else 0)
        for x_all, y_all in self.chunks[kind]:
            for r in range(0, y_all.shape[0], block):
                x, y = products.rows(x_all[layer, r : r + block]), products.rows(y_all[r : r + block])
                products.add_gram(xtx, x, x)
                sx += products.sum(x, 0)
                cross.add(x, y, products)
        cross.close()
        sy, syy = self._target_sums(kind, z(qt), z(qt))
        return LayerMoments(self.shape, xtx, sx, xty, sy, syy, float(self.n))

    def _target_sums(self, kind: str, sy: torch.Tensor, syy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Sums of the target rows and their squares [Lt*Ht*Dt] (float64, the rows as the
        products see them), the same for every source layer: formed once per kind."""
        if kind not in self.target_sums:
            for _, y_all in self.chunks[kind]:
                for r in range(0, y_all.shape[0], _BLOCK_ROWS):  # bounded float64 temporaries
                    y = self.products.rows(y_all[r : r + _BLOCK_ROWS]).double()
                    sy += y.sum(0)
                    syy += (y * y).sum(0)
            self.target_sums[kind] = (sy, syy)
        return self.target_sums[kind]


_BLOCK_ROWS = 1024  # rows per float64 block when the probe moments are formed


class _Run:
    """x^T y of consecutive chunks summed in float32 over up to `block` rows, then added to the
    float64 `total` once: a forward of one 1,024-token sequence makes a chunk of 1,024 rows, and
    at Qwen3-32B the float64 adds of a [1,024, 65,536] product per chunk took a quarter of the
    probes' GPU time. block 0: every product added to `total` as it comes (float64 rows)."""

    def __init__(self, total: torch.Tensor, block: int):
        self.total, self.block = total, block
        self.partial: torch.Tensor | None = None
        self.rows = 0

    def add(self, x: torch.Tensor, y: torch.Tensor, products: Products) -> None:
        if not self.block:
            products.add_gram(self.total, x, y)
            return
        if self.rows + x.shape[0] > self.block:
            self.close()
        if self.partial is None:
            self.partial = torch.zeros(self.total.shape, dtype=torch.float32, device=self.total.device)
        products.add_gram(self.partial, x, y)  # float32 sums, as one GEMM over the run would make
        self.rows += x.shape[0]

    def close(self) -> None:
        if self.partial is not None:
            self.total += self.partial
            self.partial = None
        self.rows = 0


class LayerMoments:
    """One source layer's probe statistics (float64): xtx [ps, ps], sx [ps], xty [ps, Lt*Ht*Dt],
    sy, syy [Lt*Ht*Dt], n rows. `stats(head)`: those of all its heads, or one head, as
    SufficientStats whose output heads are the Lt * Ht target heads in (layer, head) order."""

    def __init__(self, shape, xtx, sx, xty, sy, syy, n: float):
        self.shape, self.xtx, self.sx, self.xty, self.sy, self.syy, self.n = shape, xtx, sx, xty, sy, syy, n

    def stats(self, head: int | None = None) -> SufficientStats:
        ls, hs, ds, lt, ht, dt = self.shape
        cols = slice(None) if head is None else slice(head * ds, (head + 1) * ds)
        xtx = self.xtx[cols, cols]
        xty = self.xty[cols]  # [p, Lt*Ht*Dt]
        p = xtx.shape[0]
        return SufficientStats(
            xtx=xtx.unsqueeze(0),
            xty=xty.reshape(p, lt * ht, dt).permute(1, 0, 2),
            sum_x=self.sx[cols].unsqueeze(0),
            sum_y=self.sy.reshape(lt * ht, dt),
            sum_yy=self.syy.reshape(lt * ht, dt),
            sum_w=torch.full((1,), self.n, dtype=_F64, device=xtx.device),
        )


class ProbeScores:
    """Held-out probe R^2.

    layer: [Ls, Lt] mean over K, V and target heads of the single-layer probe's R^2.
    head: [Ls, Hs, Lt, Ht] mean over K and V of the single-head probe's R^2 (None: not scored).
    """

    def __init__(self, layer: torch.Tensor, head: torch.Tensor | None):
        self.layer = layer
        self.head = head


def score_probes(
    train: ProbeRows, heldout: ProbeRows, lam: float = DEFAULT_LAM, progress=None, heads: bool = True
) -> ProbeScores:
    """Fit every probe on `train` rows and score it on `heldout` rows, one source layer at a time.

    progress: called once per source layer done (e.g. a tqdm bar's update), or None.
    heads: score the single-head probes too (what head matching reads); else `head` is None.
    """
    ls, hs, ds, lt, ht, dt = train.shape
    layer = torch.zeros(ls, lt, dtype=_F64)
    head = torch.zeros(ls, hs, lt, ht, dtype=_F64) if heads else None
    for s in range(ls):
        for kind in "kv":
            fit, held = train.moments(kind, s), heldout.moments(kind, s)
            w, b = solve(fit.stats(), lam)  # one Cholesky for every target layer
            per_head, _ = r2(w, b, held.stats())
            layer[s] += per_head.reshape(lt, ht).mean(-1).cpu() / 2
            if heads and hs == 1:
                head[s, 0] += per_head.reshape(lt, ht).cpu() / 2
            for h in range(hs if heads and hs > 1 else 0):
                w, b = solve(fit.stats(h), lam)
                per_head, _ = r2(w, b, held.stats(h))
                head[s, h] += per_head.reshape(lt, ht).cpu() / 2
            fit = held = w = b = None  # freed before the next layer's moments are formed
        if progress is not None:
            progress(1)
    return ProbeScores(layer, head)


def top_layers(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per target layer, its k best-scoring source layers (ascending). scores: [Ls, Lt]."""
    k = min(k, scores.shape[0])
    return [sorted(scores[:, t].topk(k).indices.tolist()) for t in range(scores.shape[1])]


def depth_layers(num_source: int, num_target: int, k: int) -> list[list[int]]:
    """Per target layer, the k source layers nearest in relative depth (ascending)."""
    k = min(k, num_source)
    out = []
    for t in range(num_target):
        depth = t / max(num_target - 1, 1) * (num_source - 1)
        order = sorted(range(num_source), key=lambda s: (abs(s - depth), s))
        out.append(sorted(order[:k]))
    return out


def match_heads(
    layers: list[list[int]], num_source_heads: int, num_target_heads: int, head_scores: torch.Tensor | None
) -> list[torch.Tensor]:
    """Head-local inputs per target layer: int64 [tgt_heads, k, 2] of (source layer, source head).

    Same head count: head h reads head h. Otherwise head h reads, in each supporting source layer,
    the source head with the best single-head probe score (head_scores [Ls, Hs, Lt, Ht]).
    """
    out = []
    for t, sources in enumerate(layers):
        inputs = torch.zeros(num_target_heads, len(sources), 2, dtype=torch.long)
        for j, s in enumerate(sources):
            inputs[:, j, 0] = s
            if num_source_heads == num_target_heads:
                inputs[:, j, 1] = torch.arange(num_target_heads)
            elif head_scores is None:
                raise ValueError(
                    f"{num_source_heads} source heads vs {num_target_heads} target heads: head matching "
                    "needs probe statistics"
                )
            else:
                inputs[:, j, 1] = head_scores[s, :, t, :].argmax(0)
        out.append(inputs)
    return out


def full_inputs(layers: list[list[int]], num_source_heads: int, num_target_heads: int) -> list[torch.Tensor]:
    """Full-head inputs per target layer: every head reads every head of its k source layers."""
    out = []
    for sources in layers:
        slots = torch.tensor([(s, h) for s in sources for h in range(num_source_heads)], dtype=torch.long)
        out.append(slots.unsqueeze(0).expand(num_target_heads, -1, -1).contiguous())
    return out
