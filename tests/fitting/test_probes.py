"""The layer probes: their moments are those of all the rows (on CUDA, consecutive chunks summed
in float32 runs first), and they find the generating layer."""

from __future__ import annotations

import pytest
import torch

from bridgecache.fitting.products import Products
from bridgecache.fitting.support import ProbeRows, _Run, score_probes

SHAPE = (3, 2, 8, 2, 2, 8)  # source layers, heads, dim -> target layers, heads, dim


def _rows(n: int, seed: int):
    """(src_k, src_v, tgt_k, tgt_v): per-layer rows [n, heads, dim]; the targets are linear in
    source layer 1."""
    ls, hs, ds, lt, ht, dt = SHAPE
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(hs * ds, ht * dt, generator=torch.Generator().manual_seed(99))
    out = []
    for _ in "kv":
        src = [torch.randn(n, hs, ds, generator=g) + 0.5 for _ in range(ls)]
        y = src[1].reshape(n, -1) @ mix
        out.append(
            (src, [(y + 0.1 * torch.randn(y.shape, generator=g)).reshape(n, ht, dt) for _ in range(lt)])
        )
    (src_k, tgt_k), (src_v, tgt_v) = out
    return src_k, src_v, tgt_k, tgt_v


def _assert_moments_of_all_rows(probe: ProbeRows, batches, rtol: float, atol) -> None:
    """Every source layer's moments (keys and values) against float64 ones of all the batches' rows."""
    for k, kind in enumerate("kv"):
        y = torch.cat([torch.cat([t.reshape(t.shape[0], -1) for t in b[2 + k]], 1) for b in batches]).double()
        for layer in range(SHAPE[0]):
            x = torch.cat([b[k][layer].reshape(b[k][layer].shape[0], -1) for b in batches]).double()
            m = probe.moments(kind, layer)
            for got, want in ((m.xtx, x.T @ x), (m.sx, x.sum(0)), (m.xty, x.T @ y), (m.sy, y.sum(0))):
                torch.testing.assert_close(got, want.to(got.device), rtol=rtol, atol=atol(want))


def test_probe_moments_are_those_of_all_rows_and_score_the_generating_layer():
    sizes = [300, 300, 500, 200, 900, 1100, 40]  # forwards of unequal lengths
    probe = ProbeRows(*SHAPE, precision="tf32x3")
    batches = [_rows(n, seed) for seed, n in enumerate(sizes)]
    for batch in batches:
        probe.update(*batch)
    _assert_moments_of_all_rows(probe, batches, rtol=1e-12, atol=lambda want: 1e-9)
    held = ProbeRows(*SHAPE, precision="tf32x3")
    held.update(*_rows(400, 50))
    scores = score_probes(probe, held, heads=False)
    assert scores.layer[1].min() > 0.9 > scores.layer[0].max()  # the generating layer stands out
    assert scores.head is None


def test_a_run_sums_consecutive_chunks_in_float32_and_adds_each_run_once():
    """What the probes do with bfloat16 rows on CUDA (float32 rows here): one float64 add per
    run of up to `block` rows, not one per chunk."""

    class Counting(_Run):
        adds = 0

        def close(self):
            Counting.adds += self.partial is not None
            super().close()

    g = torch.Generator().manual_seed(3)
    sizes = (300, 300, 500, 200, 900, 40)
    chunks = [(torch.randn(n, 6, generator=g), torch.randn(n, 5, generator=g)) for n in sizes]
    total = torch.zeros(6, 5, dtype=torch.float64)
    run = Counting(total, block=1024)
    for x, y in chunks:
        run.add(x, y, Products("tf32x3"))
    run.close()
    assert Counting.adds == 3  # 300 + 300 | 500 + 200 | 900 + 40
    x, y = (torch.cat([c[i] for c in chunks]).double() for i in (0, 1))
    torch.testing.assert_close(total, x.T @ y, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_bfloat16_rows_in_float32_runs_give_the_moments_of_those_rows():
    """The CUDA path: bfloat16 rows, products summed in float32 runs of up to 4,096 rows, each
    run added to the float64 moments once; against float64 moments of the same rounded rows."""
    sizes = [1024] * 5 + [300, 40]  # five runs' worth of sequence-long chunks, then odd ones
    probe = ProbeRows(*SHAPE, device="cuda", dtype=torch.bfloat16)
    batches = [
        [[t.to("cuda", torch.bfloat16) for t in part] for part in _rows(n, seed)]
        for seed, n in enumerate(sizes)
    ]
    for batch in batches:
        probe.update(*batch)
    _assert_moments_of_all_rows(probe, batches, rtol=1e-5, atol=lambda want: 1e-3 * want.abs().max().item())
