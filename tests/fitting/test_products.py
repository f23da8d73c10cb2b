"""The statistics' GEMM precisions (bridgecache.fitting.products): bfloat16 rows multiplied
exactly (float64 on the CPU, float32 sums per GEMM on CUDA) and added to float64 totals, against
float64 products of the same rounded rows, fresh random inputs each run; float64 rows exactly."""

from __future__ import annotations

import pytest
import torch

from bridgecache.bridge.recipe import STATS_PRECISIONS, FitConfig
from bridgecache.fitting.products import GEMM_PRECISIONS, Products

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rows(*shape, device="cpu"):
    """Rows far from bfloat16 numbers: shifted data of spread 1 about an offset of 3."""
    return (torch.randn(*shape, dtype=torch.float64) + 3.0).to(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_every_gemm_precision_is_a_fit_option_and_bf16_gemm_is_the_default():
    assert set(GEMM_PRECISIONS) <= set(STATS_PRECISIONS)
    assert FitConfig().stats_precision == "bf16-gemm"
    with pytest.raises(ValueError, match=r"one of \('bf16-gemm', 'tf32x3'\) here, got 'tf32'"):
        Products("tf32")


@pytest.mark.parametrize("batched", [False, True])
def test_bf16_rows_are_multiplied_exactly_and_their_rounding_is_seen(batched):
    shape = (3, 200, 24) if batched else (200, 24)
    a, b = _rows(*shape), _rows(*shape[:-1], 5)
    products = Products("bf16-gemm")
    total = torch.full((*shape[:-2], 24, 5), 0.5, dtype=torch.float64)
    products.add_gram(total, products.rows(a), products.rows(b))
    ra, rb = a.bfloat16().double(), b.bfloat16().double()
    torch.testing.assert_close(total, 0.5 + ra.transpose(-1, -2) @ rb, rtol=1e-13, atol=1e-10)
    exact = 0.5 + a.transpose(-1, -2) @ b
    assert 1e-6 < _rel(total, exact) < 2**-8  # the rows' rounding, about 2^-9 of each value


def test_float64_rows_are_multiplied_in_float64():
    a, b = _rows(4, 100, 16), _rows(4, 100, 8)
    products = Products("tf32x3")
    total = torch.zeros(4, 16, 8, dtype=torch.float64)
    products.add_gram(total, products.rows(a), products.rows(b))
    torch.testing.assert_close(total, a.transpose(1, 2) @ b, rtol=1e-14, atol=1e-12)
    assert products.weighted(a, None) is a


def test_weighted_rows_are_rounded_after_weighting():
    x, w = _rows(2, 50, 8), torch.rand(2, 50, dtype=torch.float64)
    products = Products("bf16-gemm")
    got = products.weighted(products.rows(x), w)
    assert got.dtype == torch.float64  # on the CPU: rounded values kept in float64 for its GEMMs
    want = (x.bfloat16().double() * w.bfloat16().double()[..., None]).bfloat16()  # exact, then rounded
    assert torch.equal(got, want.double())
    assert not torch.equal(got, x.bfloat16().double() * w[..., None])


@_CUDA
@pytest.mark.parametrize("batched", [False, True])
def test_bf16_gemms_on_cuda_sum_in_float32_to_the_float64_products_of_the_rounded_rows(batched):
    """4,096 rows a GEMM, as a chunk of statistics: float32 sums of 4,096 positive products err
    by about 1e-5 relative (H100: 1.04e-5), at most 4096 x 2^-24 = 2.4e-4."""
    shape = (8, 4096, 256) if batched else (4096, 1024)
    a, b = _rows(*shape, device="cuda"), _rows(*shape[:-1], 128, device="cuda")
    products = Products("bf16-gemm")
    assert products.rows(a).dtype == torch.bfloat16  # on CUDA the GEMMs take bfloat16
    total = torch.zeros(*shape[:-2], shape[-1], 128, dtype=torch.float64, device="cuda")
    for _ in range(3):  # three chunks added to the same totals
        products.add_gram(total, products.rows(a), products.rows(b))
    ra, rb = a.bfloat16().double(), b.bfloat16().double()
    want = 3 * (ra.transpose(-1, -2) @ rb)
    assert _rel(total, want) < 5e-5
    exact = 3 * (a.transpose(-1, -2) @ b)
    assert 1e-6 < _rel(total, exact) < 2**-8  # the rows' rounding, as on the CPU


def test_bf16_rows_move_a_ridge_map_far_less_than_its_sampling_error():
    """10,000 rows, 64 correlated inputs, R^2 about 0.5: rounding the rows to bfloat16 moves the
    fitted map by under 5% of how far the float64 fit is from the true map (measured: 0.7%)."""
    from bridgecache.fitting.ridge import solve
    from bridgecache.fitting.stats import add_moments, zeros

    heads, p, d, n = 2, 64, 32, 10_000
    x = torch.randn(heads, n, p, dtype=torch.float64) @ torch.randn(p, p, dtype=torch.float64) * 0.3
    truth = torch.randn(heads, p, d, dtype=torch.float64) * 0.1
    y = x @ truth + torch.randn(heads, n, d, dtype=torch.float64)
    maps = {}
    for precision in GEMM_PRECISIONS:
        products, stats = Products(precision), zeros(heads, p, d, False)
        add_moments(stats, products.rows(x), products.rows(y), None, products)
        maps[precision] = solve(stats, 1e-2)[0]
    moved, sampling = _rel(maps["bf16-gemm"], maps["tf32x3"]), _rel(maps["tf32x3"], truth)
    assert 0 < moved < 0.05 * sampling


def test_weighted_sums_of_float64_rows_are_float64_sums():
    y, w = _rows(3, 40, 8), torch.rand(3, 40, dtype=torch.float64)
    sums, squares = Products("tf32x3").weighted_sums(y, w)
    torch.testing.assert_close(sums, (w[..., None] * y).sum(1), rtol=1e-14, atol=0)
    torch.testing.assert_close(squares, (w[..., None] * y * y).sum(1), rtol=1e-14, atol=0)


@_CUDA
def test_weighted_sums_of_bf16_rows_on_cuda_are_their_gemms():
    """sum w y and sum w y^2 of 2,048 bfloat16 rows by GEMMs: within 1e-5 of the float64 sums of
    the rounded rows and weights (w y rounded too for the squares: 2^-9 of each, averaged out)."""
    y, w = _rows(16, 2048, 128, device="cuda"), torch.rand(16, 2048, dtype=torch.float64, device="cuda")
    products = Products("bf16-gemm")
    sums, squares = products.weighted_sums(products.rows(y), w)
    ry, rw = y.bfloat16().double(), w.bfloat16().double()[..., None]
    assert _rel(sums.double(), (rw * ry).sum(1)) < 1e-5
    assert _rel(squares.double(), (rw * ry * ry).sum(1)) < 1e-4
    assert _rel(squares.double(), (w[..., None] * y * y).sum(1)) < 2**-8
    x = products.rows(_rows(4, 1000, 64, device="cuda"))
    assert Products.sum(x, 1).dtype == torch.float32  # one kernel, no float64 copy of the rows
    assert _rel(Products.sum(x, 1).double(), x.double().sum(1)) < 1e-6
