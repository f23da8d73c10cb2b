"""The layer probes: their moments are those of all the rows, and they find the generating layer."""

from __future__ import annotations

import torch

from bridgecache.fitting.support import ProbeRows, score_probes

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


def test_probe_moments_are_those_of_all_rows_and_score_the_generating_layer():
    sizes = [300, 300, 500, 200, 900, 1100, 40]  # forwards of unequal lengths
    probe = ProbeRows(*SHAPE, precision="tf32x3")
    batches = [_rows(n, seed) for seed, n in enumerate(sizes)]
    for batch in batches:
        probe.update(*batch)
    for k, kind in enumerate("kv"):
        y = torch.cat([torch.cat([t.reshape(t.shape[0], -1) for t in b[2 + k]], 1) for b in batches]).double()
        for layer in range(SHAPE[0]):
            x = torch.cat([b[k][layer].reshape(b[k][layer].shape[0], -1) for b in batches]).double()
            m = probe.moments(kind, layer)
            for got, want in ((m.xtx, x.T @ x), (m.sx, x.sum(0)), (m.xty, x.T @ y), (m.sy, y.sum(0))):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)
    held = ProbeRows(*SHAPE, precision="tf32x3")
    held.update(*_rows(400, 50))
    scores = score_probes(probe, held, heads=False)
    assert scores.layer[1].min() > 0.9 > scores.layer[0].max()  # the generating layer stands out
    assert scores.head is None
