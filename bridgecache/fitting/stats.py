"""Streaming sufficient statistics of per-head affine regressions, and attention-aligned weighting.

The container and the accumulator are `bridgecache.kernels.stats`: `SufficientStats` holds, for
Ht target heads with inputs x [p] and targets y [Dt], the float64 raw weighted moments
    xtx = sum w x x^T [G, p, p]   sum_x [G, p]   sum_w [G]     (G = 1: shared by all heads)
    xty = sum w x y^T [Ht, p, Dt] sum_y [Ht, Dt] sum_yy [Ht, Dt]
and `accumulate` (= `accumulate_stats`) adds one chunk of rows from source KV plus row and head
indices, never materialising X on CUDA (fused Triton kernel; PyTorch reference elsewhere).
Memory depends on (Ht, p, Dt) only, never on the number of rows; chunk by chunk equals one shot.

This module adds what fitting needs on top:
- `WeightedMoments`: attention-aligned weights w = 1 + alpha (r / mean(r) - 1) need the mean
  and spread of r over ALL rows before any row can be weighted. w is linear in r, so we keep the
  unweighted and the r-weighted statistics and combine them exactly once alpha is known.
- `shrinkage`: alpha from the effective-sample-size bound n / (1 + alpha^2 CV^2) >= min(n, 2p).

Knows nothing about models, layers or tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from bridgecache.fitting.products import Products
from bridgecache.kernels.stats import SufficientStats
from bridgecache.kernels.stats import accumulate_stats as accumulate

__all__ = [
    "SufficientStats",
    "WeightedMoments",
    "accumulate",
    "add_moments",
    "zeros",
    "per_head",
    "shrinkage",
]


def zeros(heads: int, p: int, d: int, shared: bool, device=None) -> SufficientStats:
    """Empty float64 statistics of `heads` heads, inputs [p], targets [d]."""
    return SufficientStats.zeros(heads, p, d, shared=shared, dtype=torch.float64, device=device)


def add_moments(stats: SufficientStats, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None,
                products: Products, target_sums: bool = True) -> None:  # fmt: skip
    """Add the moments of rows x [heads, m, p], y [heads, m, dt] with weights w [heads, m] (None:
    1), both from `products.rows`, to `stats` (float64; a shared Gram matrix, G = 1, takes head
    0's rows). target_sums=False leaves sum_y and sum_yy to the caller (gram.StackedHeads forms
    them from the target layers without the gathered rows)."""
    g = stats.xtx.shape[0]
    xw = products.weighted(x, w)
    products.add_gram(stats.xtx, xw[:g], x[:g])
    stats.sum_x += products.sum(xw[:g], 1)
    stats.sum_w += float(x.shape[1]) if w is None else w[:g].sum(1)
    products.add_gram(stats.xty, xw, y)
    if not target_sums:
        return
    y = y.double()
    yw = y if w is None else y * w[..., None]
    stats.sum_y += yw.sum(1)
    stats.sum_yy += (yw * y).sum(1)


def per_head(m: SufficientStats) -> SufficientStats:
    """The same statistics with G = heads (a shared Gram matrix expanded, not copied)."""
    if not m.shared:
        return m
    h = m.xty.shape[0]
    return SufficientStats(
        m.xtx.expand(h, -1, -1), m.xty, m.sum_x.expand(h, -1), m.sum_y, m.sum_yy, m.sum_w.expand(h)
    )


def shrinkage(n: float, sum_r: float, sum_r2: float, p: int) -> tuple[float, float]:
    """(alpha, mean r) for w = 1 + alpha (r / mean - 1): the largest alpha <= 1 whose effective
    sample size n / (1 + alpha^2 CV^2) stays >= min(n, 2p)."""
    if n <= 0 or sum_r <= 0:
        return 0.0, 1.0
    mean = sum_r / n
    cv2 = max(sum_r2 / n / (mean * mean) - 1.0, 0.0)
    if cv2 == 0.0:
        return 1.0, mean
    floor = min(n, 2.0 * p)
    return min(1.0, math.sqrt(max((n / floor - 1.0) / cv2, 0.0))), mean


@dataclass
class WeightedMoments:
    """Unweighted and r-weighted statistics, combined exactly into w-weighted ones at the end.

    plain: w = 1 (G = 1 or heads); by_r: w = r (G = heads);
    n, sum_r, sum_r2: [heads] float64 row count and first two moments of r per head.
    """

    plain: SufficientStats
    by_r: SufficientStats
    n: torch.Tensor
    sum_r: torch.Tensor
    sum_r2: torch.Tensor

    @classmethod
    def zeros(cls, heads: int, p: int, d: int, shared: bool, device=None) -> WeightedMoments:
        z = lambda: torch.zeros(heads, dtype=torch.float64, device=device)  # noqa: E731
        return cls(zeros(heads, p, d, shared, device), zeros(heads, p, d, False, device), z(), z(), z())

    def add(self, src, rows, heads, y, r, precision: str = "tf32x3") -> None:
        """Add a chunk (arguments as `accumulate`; r: [batch, heads, n] raw weights >= 0, 0 where
        rows is -1)."""
        accumulate(self.plain, src, rows, heads, y, precision=precision)
        accumulate(self.by_r, src, rows, heads, y, r, precision=precision)
        r = r.double()
        self.n += (rows >= 0).sum()
        self.sum_r += r.sum((0, 2))
        self.sum_r2 += (r * r).sum((0, 2))

    def add_rows(self, x: torch.Tensor, y: torch.Tensor, r: torch.Tensor, products: Products,
                 target_sums: bool = True) -> None:  # fmt: skip
        """Add gathered rows from `products.rows`: x [heads, m, p], y [heads, m, d], r [heads, m]
        raw weights (bridgecache.fitting.gram's GEMM path; one gather for both statistics);
        target_sums as `add_moments`."""
        add_moments(self.plain, x, y, None, products, target_sums)
        add_moments(self.by_r, x, y, r, products, target_sums)
        self.n += x.shape[1]
        self.sum_r += r.sum(1)
        self.sum_r2 += (r * r).sum(1)

    def combine(self) -> tuple[SufficientStats, list[float]]:
        """The w-weighted statistics, w_i = 1 + alpha (r_i / mean r - 1), and alpha per head.

        Linear in r: sum w f = (1 - alpha) sum f + (alpha / mean r) sum r f, for every moment f.
        """
        plain = per_head(self.plain)
        heads, p, d = plain.xty.shape
        out = zeros(heads, p, d, False, plain.xtx.device)
        alphas = []
        for h in range(heads):
            alpha, mean = shrinkage(float(self.n[h]), float(self.sum_r[h]), float(self.sum_r2[h]), p)
            alphas.append(alpha)
            for f in fields(SufficientStats):
                a, b = getattr(plain, f.name)[h], getattr(self.by_r, f.name)[h]
                getattr(out, f.name)[h] = (1.0 - alpha) * a + (alpha / mean) * b
        return out, alphas
