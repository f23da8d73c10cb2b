"""Weighted sufficient statistics: the Triton kernel (CPU interpreter) and the PyTorch reference
against float64 moments of an explicitly gathered X, on fresh random inputs.

Rule (../shared/STYLE.md): relative error of the kernel <= 2x that of the PyTorch reference (both
form each update's products in float32), plus a small floor. Buffers start from random values, so
the update must add to every element rather than overwrite it.
"""

from __future__ import annotations

import os
from dataclasses import fields

import pytest
import torch

# Triton runs CPU tensors only in its interpreter, which it picks when it is imported: say so first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bridgecache.kernels import SufficientStats  # noqa: E402
from bridgecache.kernels.affine import source_tables  # noqa: E402
from bridgecache.kernels.stats import launch_stats  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = 1e-7


pytestmark = pytest.mark.usefixtures("interpreted_triton")  # tests/conftest.py


def test_in_fresh_process(run_in_fresh_process):
    """This module's tests in a new process with the interpreter on, when this one cannot."""
    run_in_fresh_process(__file__)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_tables(*shape: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(*shape[:-1], shape[-1] // 2, generator=gen, dtype=torch.float64) * 100.0
    factor = 1.0 + 0.5 * torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64)
    cos, sin = angle.cos() * factor, angle.sin() * factor
    return torch.cat((cos, cos), -1).float(), torch.cat((sin, sin), -1).float()


def float64_moments(src, rows, heads, y, weights, cos, sin, shared):
    """Moments of the documented rows in float64. src [B, Hv, S, Ds]; cos/sin [B, S, Ds] or None."""
    x = src.double()
    if cos is not None:
        c, s = cos.double()[:, None], sin.double()[:, None]
        x = (x * c - rotate_half(x) * s) / (c * c + s * s)
    bsz, t = rows.shape
    n_heads, n = heads.shape
    g = 1 if shared else n_heads
    out = {f.name: [] for f in fields(SufficientStats)}
    for h in range(n_heads):
        xs, ys, ws = [], [], []
        for b in range(bsz):
            keep = rows[b] >= 0
            idx = rows[b][keep]
            xs.append(torch.cat([x[b, heads[h, j], idx] for j in range(n)], dim=-1))
            ys.append(y[b, h][keep].double())
            ws.append(
                torch.ones(int(keep.sum()), dtype=torch.float64)
                if weights is None
                else weights[b, h][keep].double()
            )
        xh, yh, wh = torch.cat(xs), torch.cat(ys), torch.cat(ws)
        xw = xh * wh[:, None]
        if h < g:
            out["xtx"].append(xw.T @ xh)
            out["sum_x"].append(xw.sum(0))
            out["sum_w"].append(wh.sum())
        out["xty"].append(xw.T @ yh)
        out["sum_y"].append((wh[:, None] * yh).sum(0))
        out["sum_yy"].append((wh[:, None] * yh * yh).sum(0))
    return {k: torch.stack(v) for k, v in out.items()}


def random_stats(heads, p, dt, shared, dtype, gen) -> SufficientStats:
    stats = SufficientStats.zeros(heads, p, dt, shared=shared, dtype=dtype, device=DEVICE)
    for f in fields(stats):
        buf = getattr(stats, f.name)
        buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float64))
    return stats


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double().cpu() - ref).norm() / ref.norm())


# src heads, tgt heads, n inputs, Ds, Dt, S, T, weighted, rope, shared, buffer dtype, programs per tile
CASES = [
    (3, 2, 2, 64, 32, 19, 21, True, True, False, torch.float64, None),
    (3, 2, 2, 64, 32, 19, 37, True, True, False, torch.float64, 2),
    (2, 1, 1, 128, 64, 13, 21, False, True, False, torch.float64, None),
    (2, 3, 1, 32, 64, 11, 19, True, False, False, torch.float32, 2),
    (2, 2, 2, 32, 32, 9, 23, False, True, True, torch.float64, None),
]


@pytest.mark.parametrize("hs, ht, n, ds, dt, s, t, weighted, rope, shared, dtype, splits", CASES)
def test_stats_match_float64(hs, ht, n, ds, dt, s, t, weighted, rope, shared, dtype, splits):
    gen = torch.Generator().manual_seed(hash((hs, ht, n, ds, dt, s, t, shared)) % 2**31)
    bsz = 2
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16)
    rows = torch.randint(0, s, (bsz, t), generator=gen)
    rows[:, ::5] = -1
    rows[:, 1] = rows[:, 2]
    heads = torch.randint(0, hs, (1 if shared else ht, n), generator=gen).expand(ht, n).contiguous()
    y = torch.randn(bsz, ht, t, dt, generator=gen).to(torch.bfloat16)
    y[..., ::5, :] = float("nan")  # rows -1 are skipped: their targets are never read
    weights = torch.rand(bsz, ht, t, generator=gen) if weighted else None
    cos, sin = rope_tables(bsz, s, ds, gen=gen) if rope else (None, None)
    ref = float64_moments(src, rows, heads, y, weights, cos, sin, shared)

    start = random_stats(ht, n * ds, dt, shared, dtype, gen)
    kernel = SufficientStats(*(getattr(start, f.name).clone() for f in fields(start)))
    torch_ref = SufficientStats(*(getattr(start, f.name).clone() for f in fields(start)))
    args = [x.to(DEVICE) if x is not None else None for x in (src, rows, heads, y, weights, cos, sin)]
    if splits is None:
        kernel.update(*args, backend="triton")
    else:  # several programs per tile along the tokens: atomic adds
        src_d, rows_d, heads_d, y_d, w_d, cos_d, sin_d = args
        tables = source_tables(cos_d, sin_d, bsz, 1, hs, s, ds)
        bufs = [getattr(kernel, f.name) for f in fields(kernel)]
        launch_stats([src_d], rows_d, heads_d, y_d, w_d, *tables, bufs, splits=splits)
    torch_ref.update(*args, backend="torch")
    for f in fields(SufficientStats):
        delta_k = getattr(kernel, f.name).cpu().double() - getattr(start, f.name).cpu().double()
        delta_t = getattr(torch_ref, f.name).cpu().double() - getattr(start, f.name).cpu().double()
        err_k, err_t = rel_err(delta_k, ref[f.name]), rel_err(delta_t, ref[f.name])
        assert err_t <= 1e-5, (f.name, err_t)
        assert err_k <= 2 * err_t + FLOOR, (f.name, err_k, err_t)
    if not weighted:  # counts are exact
        want = float((rows >= 0).sum())
        assert torch.allclose(
            kernel.sum_w.cpu().double() - start.sum_w.cpu().double(), torch.tensor(want).double()
        )


def test_chunks_accumulate_like_one_pass_across_backends():
    gen = torch.Generator().manual_seed(3)
    bsz, hs, s, ds, t, dt = 2, 2, 11, 32, 17, 32
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(DEVICE)
    rows = torch.randint(-1, s, (bsz, t), generator=gen).to(DEVICE)
    heads = torch.tensor([[1], [0]], device=DEVICE)
    y = torch.randn(bsz, 2, t, dt, generator=gen).to(DEVICE)
    whole = SufficientStats.zeros(2, ds, dt, device=DEVICE).update(src, rows, heads, y, backend="torch")
    chunked = SufficientStats.zeros(2, ds, dt, device=DEVICE)
    chunked.update(src[:1], rows[:1], heads, y[:1], backend="torch")
    chunked.update(src[1:], rows[1:], heads, y[1:], backend="triton")
    for f in fields(SufficientStats):
        assert torch.allclose(getattr(chunked, f.name), getattr(whole, f.name), rtol=1e-5, atol=1e-5), f.name


def test_zeros_shapes_and_checks():
    stats = SufficientStats.zeros(4, 256, 128, shared=True)
    assert stats.shared and stats.xtx.shape == (1, 256, 256) and stats.xty.shape == (4, 256, 128)
    assert stats.sum_w.shape == (1,) and stats.xtx.dtype == torch.float64
    src = torch.randn(1, 2, 5, 128)
    rows = torch.zeros(1, 3, dtype=torch.int64)
    heads = torch.zeros(4, 2, dtype=torch.int64)
    y = torch.randn(1, 4, 3, 128)
    with pytest.raises(ValueError, match="per-head weights"):
        stats.update(src, rows, heads, y, torch.ones(1, 4, 3))
    with pytest.raises(ValueError, match="stats.xtx"):
        stats.update(src[..., :64], rows, heads, y)


def test_precision_modes_trade_accuracy_as_documented():
    """bf16 operands: Gram matrices within bfloat16 rounding (~1e-3..1e-2) of float64, clearly
    coarser than the default 3xTF32; an unknown mode is refused by name."""
    gen = torch.Generator().manual_seed(23)
    bsz, hs, s, ds, t, dt = 1, 2, 13, 32, 19, 32
    src = torch.randn(bsz, hs, s, ds, generator=gen)  # float32: its rounding to bf16 shows
    rows = torch.randint(0, s, (bsz, t), generator=gen)
    heads = torch.tensor([[1]])
    y = torch.randn(bsz, 1, t, dt, generator=gen)
    cos, sin = rope_tables(bsz, s, ds, gen=gen)
    ref = float64_moments(src, rows, heads, y, None, cos, sin, False)
    args = [x.to(DEVICE) for x in (src, rows, heads, y)]
    errs = {}
    for mode in ("tf32x3", "bf16"):
        stats = SufficientStats.zeros(1, ds, dt, device=DEVICE)
        stats.update(*args, None, cos.to(DEVICE), sin.to(DEVICE), backend="triton", precision=mode)
        errs[mode] = max(rel_err(stats.xtx, ref["xtx"]), rel_err(stats.xty, ref["xty"]))
        assert rel_err(stats.sum_x, ref["sum_x"]) < 1e-5  # sums stay float32 in every mode
    assert errs["tf32x3"] < 1e-5, errs
    assert 1e-4 < errs["bf16"] < 1e-2, errs
    with pytest.raises(ValueError, match="precision must be one of"):
        SufficientStats.zeros(1, ds, dt).update(src, rows, heads, y, precision="fp8")


def test_launcher_tile_and_split_policy():
    """launch_stats' own choices: a 16-wide Gram tile and a split policy (programs per SM, fewest
    token blocks per program) instead of the defaults; the same moments as float64."""
    gen = torch.Generator().manual_seed(9)
    bsz, hs, s, ds, t, dt = 2, 2, 13, 32, 40, 16
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16)
    rows = torch.randint(-1, s, (bsz, t), generator=gen)
    heads = torch.tensor([[1], [0]])
    y = torch.randn(bsz, 2, t, dt, generator=gen).to(torch.bfloat16)
    cos, sin = rope_tables(bsz, s, ds, gen=gen)
    ref = float64_moments(src, rows, heads, y, None, cos, sin, False)
    stats = SufficientStats.zeros(2, ds, dt, device=DEVICE)
    src_d, rows_d, heads_d, y_d, cos_d, sin_d = (x.to(DEVICE) for x in (src, rows, heads, y, cos, sin))
    tables = source_tables(cos_d, sin_d, bsz, 1, hs, s, ds)
    bufs = [getattr(stats, f.name) for f in fields(stats)]
    launch_stats([src_d], rows_d, heads_d, y_d, None, *tables, bufs, splits=(32, 1), tile=16)  # 3 splits
    for f in fields(SufficientStats):
        assert rel_err(getattr(stats, f.name), ref[f.name]) <= 1e-5, f.name
