"""Sufficient statistics and ridge: streaming == one-shot == a direct materialised solve."""

from __future__ import annotations

import math

import pytest
import torch

from bridgecache.fitting import ridge
from bridgecache.fitting.ridge import r2, solve
from bridgecache.fitting.stats import WeightedMoments, accumulate, shrinkage, zeros

F64 = torch.float64


def _data(n=300, p=6, heads=2, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, p, generator=g, dtype=F64) * torch.linspace(0.5, 3, p, dtype=F64) + 1.0  # off-centre
    w_true = torch.randn(heads, p, d, generator=g, dtype=F64)
    y = torch.einsum("np,hpd->hnd", x, w_true) + 1.0 + 0.3 * torch.randn(heads, n, d, generator=g, dtype=F64)
    return x, y


def _stats(x, y, w=None, shared=True, chunk=None):
    """Statistics of rows x [n, p] -> y [heads, n, d] (weights w [heads, n]) through `accumulate`:
    x is a one-head source [1, 1, n, p] read at rows 0..n-1 by every target head."""
    heads, n, d = y.shape
    m = zeros(heads, x.shape[1], d, shared)
    chunk = chunk or n
    for lo in range(0, n, chunk):
        sl = slice(lo, lo + chunk)
        src = x[None, None, sl].float()
        rows = torch.arange(src.shape[2])[None]
        head_index = torch.zeros(heads, 1, dtype=torch.long)
        weights = None if w is None else w[None, :, sl].float()
        accumulate(m, src, rows, head_index, y[None, :, sl].float(), weights)
    return m


def _direct_ridge(x, y, w, lam):
    """Materialised weighted ridge on centred data, lambda_eff = lam * trace(Xc^T D Xc) / p."""
    mx = (w[:, None] * x).sum(0) / w.sum()
    my = (w[:, None] * y).sum(0) / w.sum()
    xc, yc = x - mx, y - my
    a = xc.T @ (w[:, None] * xc)
    a = a + lam * torch.trace(a) / x.shape[1] * torch.eye(x.shape[1], dtype=F64)
    coef = torch.linalg.solve(a, xc.T @ (w[:, None] * yc))
    return coef, my - mx @ coef


@pytest.mark.parametrize("weighted", [False, True])
def test_solve_matches_direct_materialised_solve(weighted):
    x, y = _data()
    n, heads = x.shape[0], y.shape[0]
    w = (
        torch.rand(heads, n, dtype=F64, generator=torch.Generator().manual_seed(1)) + 0.1
        if weighted
        else torch.ones(heads, n, dtype=F64)
    )
    m = _stats(x, y, w if weighted else None, shared=not weighted)
    assert m.shared == (not weighted)
    coef, bias = solve(m, lam=0.05)
    for h in range(heads):
        want_w, want_b = _direct_ridge(
            x.float().double(), y[h].float().double(), w[h].float().double(), lam=0.05
        )
        torch.testing.assert_close(coef[h], want_w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(bias[h], want_b, rtol=1e-4, atol=1e-4)


def test_a_wide_shared_solve_by_the_inverse_equals_the_triangular_solves(monkeypatch):
    """Many right-hand sides per unknown (the layer probes: 64 at Qwen3-32B) take A^-1 and one
    GEMM; the maps are the triangular solves' to float64 rounding, and the materialised ridge's."""
    x, y = _data(heads=24, d=4)  # 96 right-hand sides for 6 unknowns
    m = _stats(x, y)
    inverses = []
    inverse = torch.cholesky_inverse
    monkeypatch.setattr(torch, "cholesky_inverse", lambda *a, **k: inverses.append(1) or inverse(*a, **k))
    wide, wide_b = solve(m, lam=0.05)
    monkeypatch.setattr(ridge, "_WIDE", 10**9)  # every solve by cholesky_solve
    narrow, narrow_b = solve(m, lam=0.05)
    assert inverses == [1]
    assert ((wide - narrow).norm() / narrow.norm()) < 1e-12
    assert ((wide_b - narrow_b).norm() / narrow_b.norm()) < 1e-12
    want_w, _ = _direct_ridge(
        x.float().double(), y[5].float().double(), torch.ones(x.shape[0], dtype=F64), 0.05
    )
    torch.testing.assert_close(wide[5], want_w, rtol=1e-4, atol=1e-4)


def test_chunked_statistics_equal_one_shot():
    x, y = _data(n=257)
    r = torch.rand(2, 257, dtype=F64, generator=torch.Generator().manual_seed(2))
    for shared, w in ((True, None), (False, r)):
        once = _stats(x, y, w, shared)
        chunked = _stats(x, y, w, shared, chunk=50)
        for name in ("xtx", "sum_x", "sum_w", "xty", "sum_y", "sum_yy"):
            torch.testing.assert_close(getattr(chunked, name), getattr(once, name), rtol=1e-5, atol=1e-5)


def test_heldout_r2_matches_direct_residuals():
    x, y = _data(n=400)
    train, held = _stats(x[:300], y[:, :300]), _stats(x[300:], y[:, 300:])
    coef, bias = solve(train, lam=1e-2)
    per_head, pooled = r2(coef, bias, held)
    pred = torch.einsum("np,hpd->hnd", x[300:], coef) + bias[:, None]
    resid = ((y[:, 300:] - pred) ** 2).sum((1, 2))
    total = ((y[:, 300:] - y[:, 300:].mean(1, keepdim=True)) ** 2).sum((1, 2))
    torch.testing.assert_close(per_head, 1 - resid / total, rtol=1e-4, atol=1e-4)
    assert math.isclose(pooled, 1 - float(resid.sum() / total.sum()), rel_tol=1e-4)
    assert pooled > 0.9  # noise is small against the signal


def test_weighted_moments_combine_equals_explicit_shrunk_weights():
    x, y = _data(n=200)
    heads, p = 2, 6
    r = (
        torch.exp(3 * torch.randn(heads, 200, dtype=F64, generator=torch.Generator().manual_seed(3)))
        .float()
        .double()
    )  # heavy-tailed raw weights
    wm = WeightedMoments.zeros(heads, p, 3, shared=True)
    for lo in range(0, 200, 64):  # streamed in chunks
        sl = slice(lo, lo + 64)
        src, rows = x[None, None, sl].float(), torch.arange(x[sl].shape[0])[None]
        wm.add(
            src, rows, torch.zeros(heads, 1, dtype=torch.long), y[None, :, sl].float(), r[None, :, sl].float()
        )
    combined, alphas = wm.combine()
    coef, bias = solve(combined, lam=1e-2)
    for h in range(heads):
        mean = r[h].mean()
        cv2 = (r[h] / mean).var(unbiased=False)
        alpha = min(1.0, math.sqrt((200 / min(200, 2 * p) - 1) / float(cv2)))
        assert 0 < alpha <= 1 and math.isclose(alphas[h], alpha, rel_tol=1e-6)
        w = 1 + alpha * (r[h] / mean - 1)
        assert 200 / (1 + alpha**2 * float(cv2)) >= min(200, 2 * p) - 1e-6  # effective sample size bound
        want_w, want_b = _direct_ridge(x.float().double(), y[h].float().double(), w, lam=1e-2)
        torch.testing.assert_close(coef[h], want_w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(bias[h], want_b, rtol=1e-4, atol=1e-4)
    assert min(alphas) < 0.5  # head 0's weights (CV^2 ~ 130) are shrunk toward uniform


def test_shrinkage_limits():
    assert shrinkage(100, 100.0, 100.0, 5)[0] == 1.0  # constant weights: nothing to shrink
    assert shrinkage(10, 10.0, 50.0, 5)[0] == 0.0  # n <= 2p: uniform weights
    alpha, mean = shrinkage(1000, 2000.0, 1e6, 10)  # CV^2 = 1000 / 4 - 1 = 249, floor 2p = 20
    assert math.isclose(alpha, math.sqrt((1000 / 20 - 1) / 249)) and mean == 2.0


def test_ridge_penalty_is_relative_to_data_scale():
    x, y = _data()
    a, _ = solve(_stats(x, y), lam=0.5)
    b, _ = solve(_stats(x * 1000, y), lam=0.5)  # inputs 1000x larger: same fit, coefficients / 1000
    torch.testing.assert_close(b * 1000, a, rtol=1e-4, atol=1e-5)
    loose, _ = solve(_stats(x, y), lam=1e-6)
    assert (a - loose).abs().max() > 1e-3  # the penalty does act


@pytest.mark.parametrize("shared", [True, False])
def test_variance_scale_restores_the_spread_and_keeps_the_mean(shared):
    from bridgecache.fitting.ridge import rescale, variance_scale

    x, y = _data(n=400, seed=7)
    y = y + 2.0 * torch.randn(y.shape, generator=torch.Generator().manual_seed(8), dtype=F64)  # R^2 < 1
    m = _stats(x, y, shared=shared)
    w, b = solve(m, lam=0.1)
    alpha = variance_scale(w, m)
    w2, b2 = rescale(w, b, alpha, m)
    xf = x.float().double()  # the rows the statistics saw (accumulated in float32)
    pred, pred2 = xf @ w, xf @ w2 + b2[:, None]
    spread = lambda t: ((t - t.mean(1, keepdim=True)) ** 2).sum((1, 2))  # noqa: E731
    yf = y.float().double()
    assert torch.allclose(spread(pred2), spread(yf), rtol=1e-4)  # the target's spread, per head
    assert bool((alpha > 1.05).all())  # ridge predictions of noisy targets are shrunken
    assert torch.allclose(pred2.mean(1), (pred + b[:, None]).mean(1), atol=1e-5)  # same mean prediction
    assert torch.allclose(alpha, torch.sqrt(spread(yf) / spread(pred)), rtol=1e-4)
