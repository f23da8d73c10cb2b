"""Ridge regression from sufficient statistics: float64 solve on centred data, held-out R^2.

Convention: with D the row weights and Xc, Yc the weighted-centred data,
    W = (Xc^T D Xc + lambda_eff I)^-1 Xc^T D Yc,    b = mean_w(Y) - mean_w(X) W,
    lambda_eff = lam * trace(Xc^T D Xc) / p,
so `lam` is relative to the average input variance (scale free: the same `lam` suits keys of
norm 1 and of norm 100). Default lam = 1e-2: Full-Head Mapping reports lambda = 0.01 flat over
four orders of magnitude, and the plain ridge maps measured here used 1e-2 * trace / d.
The bias is not penalised. When the Gram matrix is shared by all heads (SufficientStats.shared), one
Cholesky factorisation solves every head of the layer at once.

Variance matching of keys (`variance_scale`, `rescale`): a ridge prediction is a conditional mean,
so its spread around the mean is about R^2 of the target's (less with lam). Attention logits q.k
made from shrunken keys are flatter than the target's own, and attention spreads over the whole
context. Stretching each head's centred prediction by alpha = sqrt(tr Cov(y) / tr Cov(x W)),
keeping its mean, restores the spread: it costs MSE (R^2 falls) but not attention sharpness.

R^2 of a fitted map on held-out statistics is 1 - SSE / SST, pooled over the output dims of a
head (SST about the held-out mean), computed from the held-out moments alone.

Knows nothing about models, layers or tokenizers.
"""

from __future__ import annotations

import torch

from bridgecache.bridge.recipe import FitConfig
from bridgecache.fitting.stats import SufficientStats

__all__ = ["DEFAULT_LAM", "centred", "solve", "sse_sst", "r2", "variance_scale", "rescale"]

DEFAULT_LAM = FitConfig.lam  # one default: FitConfig's


def centred(
    m: SufficientStats,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cxx [G,p,p], cxy [heads,p,d], mean_x [G,p], mean_y [heads,d], tr_cyy [heads]) of `m`."""
    heads = m.xty.shape[0]
    sw = m.sum_w.clamp_min(1e-300)
    mean_x = m.sum_x / sw[:, None]
    cxx = m.xtx - sw[:, None, None] * mean_x[:, :, None] * mean_x[:, None, :]
    cxx = 0.5 * (cxx + cxx.transpose(1, 2))  # exact symmetry for Cholesky
    sw_h = sw.expand(heads) if m.shared else sw
    mean_y = m.sum_y / sw_h[:, None]
    mx_h = mean_x.expand(heads, -1) if m.shared else mean_x
    cxy = m.xty - sw_h[:, None, None] * mx_h[:, :, None] * mean_y[:, None, :]
    tr_cyy = (m.sum_yy - sw_h[:, None] * mean_y * mean_y).sum(-1)
    return cxx, cxy, mean_x, mean_y, tr_cyy


def solve(m: SufficientStats, lam: float = DEFAULT_LAM) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted ridge maps of every head: W [heads, p, d] and b [heads, d], float64."""
    if float(m.sum_w.min()) <= 0:
        raise ValueError("no calibration rows: the statistics are empty")
    cxx, cxy, mean_x, mean_y, _ = centred(m)
    p = m.xtx.shape[-1]
    scale = torch.diagonal(cxx, dim1=1, dim2=2).sum(-1) / p  # [G] average input variance x weight
    eye = torch.eye(p, dtype=cxx.dtype, device=cxx.device)
    a = cxx + (lam * scale.clamp_min(1e-30))[:, None, None] * eye
    chol = _cholesky(a)
    heads, d = cxy.shape[0], cxy.shape[-1]
    if m.shared:
        # One factorisation, every head: solve for the [p, heads * d] right-hand side at once.
        rhs = cxy.permute(1, 0, 2).reshape(1, p, heads * d)
        w = _solve_wide(rhs, chol).reshape(p, heads, d).permute(1, 0, 2)
        mx = mean_x.expand(heads, -1)
    else:
        w = torch.cholesky_solve(cxy, chol)
        mx = mean_x
    b = mean_y - (mx.unsqueeze(1) @ w).squeeze(1)
    return w, b


def sse_sst(w: torch.Tensor, b: torch.Tensor, m: SufficientStats) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted residual and total sums of squares of y_hat = x w + b on `m`: ([heads], [heads]).

    Split about m's own means: sum w ||r||^2 = (centred part) + sw ||mean_y - mean_x w - b||^2.
    """
    cxx, cxy, mean_x, mean_y, tr_cyy = centred(m)
    w = w.to(torch.float64)
    heads = m.xty.shape[0]
    quad = _quad(w, cxx, m.shared)
    if m.shared:
        mean_x, sw = mean_x.expand(heads, -1), m.sum_w.expand(heads)
    else:
        sw = m.sum_w
    cross = (w * cxy).sum((-2, -1))  # tr(W^T Cxy)
    offset = mean_y - (mean_x.unsqueeze(1) @ w).squeeze(1) - b.to(torch.float64)
    sse = tr_cyy - 2.0 * cross + quad + sw * (offset * offset).sum(-1)
    return sse.clamp_min(0.0), tr_cyy


def r2(w: torch.Tensor, b: torch.Tensor, m: SufficientStats) -> tuple[torch.Tensor, float]:
    """Held-out R^2 per head [heads] and pooled over heads (1 - sum SSE / sum SST)."""
    sse, sst = sse_sst(w, b, m)
    per_head = 1.0 - sse / sst.clamp_min(1e-300)
    pooled = 1.0 - float(sse.sum()) / max(float(sst.sum()), 1e-300)
    return per_head, pooled


def variance_scale(w: torch.Tensor, m: SufficientStats) -> torch.Tensor:
    """alpha [heads]: how much to stretch each head's centred prediction x W so that its spread
    matches the target's on `m` (alpha^2 = tr Cov(y) / tr Cov(x W))."""
    cxx, _, _, _, tr_cyy = centred(m)
    quad = _quad(w.to(torch.float64), cxx, m.shared)
    return torch.sqrt(tr_cyy / quad.clamp_min(1e-300))


def rescale(
    w: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, m: SufficientStats
) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha W, b'): the centred prediction stretched by alpha per head, the mean prediction on
    `m` (the statistics W was solved from) unchanged: b' = b + (1 - alpha) mean_x W."""
    mean_x = m.sum_x / m.sum_w.clamp_min(1e-300)[:, None]
    mean_pred = (mean_x.unsqueeze(1) @ w.to(mean_x.dtype)).squeeze(1)  # [heads or 1, d]
    alpha = alpha.to(w.dtype)
    return w * alpha[:, None, None], b + ((1.0 - alpha)[:, None] * mean_pred.to(b.dtype))


def _quad(w: torch.Tensor, cxx: torch.Tensor, shared: bool) -> torch.Tensor:
    """tr(W_h^T Cxx W_h) per head [heads]: the spread of the centred predictions."""
    if shared:
        # One [p, p] @ [p, heads * d] product instead of a batch over an expanded Gram matrix.
        heads, p, d = w.shape
        cxx_w = (cxx[0] @ w.permute(1, 0, 2).reshape(p, heads * d)).reshape(p, heads, d).permute(1, 0, 2)
    else:
        cxx_w = cxx @ w
    return (w * cxx_w).sum((-2, -1))


# Right-hand sides per unknown beyond which the inverse and one GEMM beat two triangular solves:
# the layer probes solve 1,024 unknowns for every target layer's heads at once (65,536 columns
# at Qwen3-32B), where cuBLAS's float64 triangular solves ran at about 15 TFLOP/s on an H100 and
# its float64 GEMMs at about 50 (benchmarks/reports/fit-gpu-2026-12-07.md).
_WIDE = 8


def _solve_wide(rhs: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """A^-1 rhs for A = chol chol^T [G, p, p] and rhs [G, p, m]: by cholesky_solve, or for m >=
    8 p by A's inverse (from its Cholesky factor: SPD, the ridge bounds its condition) and a GEMM."""
    if rhs.shape[-1] < _WIDE * rhs.shape[-2]:
        return torch.cholesky_solve(rhs, chol)
    return torch.cholesky_inverse(chol) @ rhs


def _cholesky(a: torch.Tensor) -> torch.Tensor:
    """Cholesky with escalating jitter: float64 with lam > 0 is positive definite in practice."""
    chol, info = torch.linalg.cholesky_ex(a)
    jitter = 1e-12
    while bool((info > 0).any()):
        scale = torch.diagonal(a, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        chol, info = torch.linalg.cholesky_ex(a + (jitter * scale)[..., None, None] * eye)
        jitter *= 100
        if jitter > 1:
            raise RuntimeError("ridge system is not positive definite even with jitter (NaN statistics?)")
    return chol
