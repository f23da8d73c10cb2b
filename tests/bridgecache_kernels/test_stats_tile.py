"""The statistics kernel with an explicit Gram tile narrower than the head (tiles split a head at,
or inside, its rope halves) computes the same moments as the PyTorch reference, on fresh random
inputs: CPU interpreter here, the compiled kernel on CUDA (tests/fitting/test_fit_cuda.py's run)."""

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


pytestmark = pytest.mark.usefixtures("interpreted_triton")  # tests/conftest.py


def test_in_fresh_process(run_in_fresh_process):
    """This module's tests in a new process with the interpreter on, when this one cannot."""
    run_in_fresh_process(__file__)


@pytest.mark.parametrize("ds,tile,weighted,splits", [(128, 64, False, 1), (64, 32, True, 2)])
def test_explicit_tile_below_the_head_dim_matches_the_reference(ds, tile, weighted, splits):
    gen = torch.Generator().manual_seed(ds * 1000 + tile)
    bsz, hs, s, t, ht, n, dt = 1, 2, 11, 20, 2, 2, 32
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16)
    rows = torch.randint(-1, s, (bsz, t), generator=gen)
    heads = torch.randint(0, hs, (ht, n), generator=gen)
    y = torch.randn(bsz, ht, t, dt, generator=gen).to(torch.bfloat16)
    weights = torch.rand(bsz, ht, t, generator=gen) if weighted else None
    angles = torch.rand(bsz, s, ds // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    args = [x.to(DEVICE) if x is not None else None for x in (src, rows, heads, y, weights, cos, sin)]
    reference = SufficientStats.zeros(ht, n * ds, dt, device=DEVICE)
    reference.update(*args, backend="torch")
    stats = SufficientStats.zeros(ht, n * ds, dt, device=DEVICE)
    src_d, rows_d, heads_d, y_d, w_d, cos_d, sin_d = args
    tables = source_tables(cos_d, sin_d, bsz, 1, hs, s, ds)
    bufs = [getattr(stats, f.name) for f in fields(stats)]
    launch_stats([src_d], rows_d, heads_d, y_d, w_d, *tables, bufs, splits=splits, tile=tile)
    for f in fields(SufficientStats):
        got, want = getattr(stats, f.name).double(), getattr(reference, f.name).double()
        assert float((got - want).norm() / want.norm()) < 1e-5, f.name
