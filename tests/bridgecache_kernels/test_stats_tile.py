"""The statistics kernel with an explicit Gram tile narrower than the head (tiles split a head at,
or inside, its rope halves) computes the same moments as the PyTorch reference, on fresh random
inputs: CPU interpreter here, the compiled kernel on CUDA (tests/fitting/test_fit_cuda.py's run)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bridgecache.kernels import SufficientStats  # noqa: E402
from bridgecache.kernels.affine import source_tables  # noqa: E402
from bridgecache.kernels.stats import launch_stats  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_compiled_only() -> bool:
    """True when this process imported triton before TRITON_INTERPRET=1 (it cannot interpret)."""
    if DEVICE == "cuda" or "triton" not in sys.modules:
        return False
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(std.cdiv, InterpretedFunction)


@pytest.fixture(autouse=True)
def _interpreter_or_cuda(request):
    pytest.importorskip("triton")
    if _triton_compiled_only() and request.node.name != "test_in_fresh_process":
        pytest.skip("triton was imported without its interpreter; test_in_fresh_process runs these")


def test_in_fresh_process(tmp_path):
    """Run this module in a new process with the interpreter on, when this one cannot."""
    if not _triton_compiled_only():
        pytest.skip("this process interprets Triton (or has CUDA): the tests run here")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    # From another directory: the repository root on sys.path would shadow Hugging Face's `kernels`.
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]


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
