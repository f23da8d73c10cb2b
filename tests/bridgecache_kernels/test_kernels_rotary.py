"""Rotary layouts in the kernels: partial and interleaved RoPE through map_heads / map_layers /
map_fullhead (tiled and persistent Triton kernels, CPU interpreter) and the statistics kernel,
against a float64 oracle written the way the models' own code rotates (Phi-3's `q_rot, q_pass`
split, Cohere's interleaved `rotate_half`, GLM's both), on fresh random inputs.

Rule (../shared/STYLE.md): relative error of the kernel <= 2x that of the PyTorch reference in the
same output dtype, plus a small floor; outputs start poisoned (NaN) so every element must be written.
"""

from __future__ import annotations

import os
from dataclasses import fields

import pytest
import torch

# Triton runs CPU tensors only in its interpreter, which it picks when it is imported: say so first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bridgecache.kernels import SufficientStats, map_fullhead, map_heads, map_layers  # noqa: E402
from bridgecache.kernels.rotary import pair_channels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = 1e-6
REF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# 64-channel heads: Phi-4-mini's 0.75, GPT-NeoX's 0.25, Cohere's interleaved, GLM's half interleaved
LAYOUTS = [("half", 48), ("half", 16), ("interleaved", 64), ("interleaved", 32)]

pytestmark = pytest.mark.usefixtures("interpreted_triton")  # tests/conftest.py


def test_in_fresh_process(run_in_fresh_process):
    """This module's tests in a new process with the interpreter on, when this one cannot."""
    run_in_fresh_process(__file__)


def on_device(*xs):
    return [None if x is None else x.to(DEVICE) for x in xs]


def pair_tables(*shape: int, rotary, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., D] indexed by pair (the kernels' layout): rotated pairs with random angles and
    an attention factor, pass-through pairs cos 1, sin 0; the second half repeats the first."""
    half, rot_half = shape[-1] // 2, rotary[1] // 2
    angle = torch.rand(*shape[:-1], rot_half, generator=gen, dtype=torch.float64) * 100.0
    factor = 1.0 + 0.5 * torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64)
    ones = torch.ones(*shape[:-1], half - rot_half, dtype=torch.float64)
    cos = torch.cat((angle.cos() * factor, ones), -1)
    sin = torch.cat((angle.sin() * factor, 0 * ones), -1)
    return torch.cat((cos, cos), -1).float(), torch.cat((sin, sin), -1).float()


def model_rotate(x, cos, sin, rotary, inverse=False):
    """RoPE the way the models' code applies it, float64. x [..., D]; cos/sin [..., D] pair tables."""
    kind, r = rotary
    c, s = cos[..., : r // 2].double(), sin[..., : r // 2].double()
    x_rot, x_pass = x[..., :r], x[..., r:]
    if kind == "half":  # Llama's rotate_half on the rotated channels, tables cat(freqs, freqs)
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        turned = torch.cat((-x_rot[..., r // 2 :], x_rot[..., : r // 2]), -1)
    else:  # Cohere's / GLM's: pairs (2j, 2j + 1), tables repeat_interleave(freqs, 2)
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        turned = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), -1).flatten(-2)
    x_rot = (x_rot * c - turned * s) / (c * c + s * s) if inverse else x_rot * c + turned * s
    return torch.cat((x_rot, x_pass), -1)


def oracle(src, rows, heads, weight, bias, src_tables, tgt_tables, src_rotary, tgt_rotary):
    """[B, Ht, T, Dt] float64: src [B, Hv, S, Ds]; heads [Ht, n]; tables [B, S, D] / [B, T, Dt]."""
    x = src.double()
    if src_tables is not None:
        x = model_rotate(x, src_tables[0][:, None], src_tables[1][:, None], src_rotary, inverse=True)
    bsz, t = rows.shape
    n_heads, n = heads.shape
    out = torch.zeros(bsz, n_heads, t, weight.shape[-1], dtype=torch.float64)
    for b in range(bsz):
        idx = rows[b].clamp(min=0)
        for h in range(n_heads):
            z = (
                torch.cat([x[b, heads[h, j], idx] for j in range(n)], -1) @ weight[h].double()
                + bias[h].double()
            )
            if tgt_tables is not None:
                z = model_rotate(z, tgt_tables[0][b], tgt_tables[1][b], tgt_rotary)
            out[b, h] = torch.where((rows[b] >= 0)[:, None], z, 0.0)
    return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "output not fully written (NaN poison left)"
    return float((a.double().cpu() - ref).norm() / ref.norm())


def check(run, ref, out_shape, dtype):
    poisoned = torch.full(out_shape, float("nan"), dtype=dtype, device=DEVICE)
    got = run("triton", poisoned)
    want = run("torch", None)
    err_kernel, err_torch = rel_err(got, ref), rel_err(want, ref)
    assert err_torch <= REF_TOL[dtype], err_torch
    assert err_kernel <= 2 * err_torch + FLOOR, (err_kernel, err_torch)


def random_rows(bsz, t, s, gen):
    rows = torch.randint(0, s, (bsz, t), generator=gen)
    rows[:, 0] = -1
    rows[:, 5] = -1
    return rows


def test_pair_channels_cover_the_head_once_and_pair_like_the_models():
    for kind, r in LAYOUTS:
        a, b = pair_channels((kind, r), 64)
        assert sorted(torch.cat((a, b)).tolist()) == list(range(64))
        rotated = slice(0, r // 2)
        if kind == "half":
            assert torch.equal(b[rotated] - a[rotated], torch.full((r // 2,), r // 2))
        else:
            assert torch.equal(a[rotated], 2 * torch.arange(r // 2)) and torch.equal(
                b - a, torch.ones(32).long()
            )
    assert [t.tolist() for t in pair_channels(None, 4)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="src_rotary"):
        rows, heads = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
        map_heads(
            torch.zeros(1, 1, 2, 8),
            rows,
            heads,
            torch.zeros(1, 8, 8),
            torch.zeros(1, 8),
            src_rotary=("half", 10),
        )


# source layout, target layout, inputs per head (n = 1: the persistent kernel, else the tiled one)
MAP_CASES = [
    (LAYOUTS[0], LAYOUTS[2], 2),
    (LAYOUTS[2], LAYOUTS[1], 1),
    (LAYOUTS[3], LAYOUTS[0], 1),
    (LAYOUTS[1], LAYOUTS[3], 2),
]


@pytest.mark.parametrize("src_rotary, tgt_rotary, n", MAP_CASES)
def test_map_layers_match_the_models_rotation(src_rotary, tgt_rotary, n):
    gen = torch.Generator().manual_seed(hash((src_rotary, tgt_rotary, n)) % 2**31)
    bsz, hs, s, ds, t, dt, lt, ht = 1, 2, 13, 64, 19, 64, 2, 2
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16)
    rows = random_rows(bsz, t, s, gen)
    heads = torch.randint(0, hs, (lt, ht, n), generator=gen)
    weight = torch.randn(lt, ht, n * ds, dt, generator=gen) / (n * ds) ** 0.5
    bias = torch.randn(lt, ht, dt, generator=gen)
    sc, ss = pair_tables(bsz, s, ds, rotary=src_rotary, gen=gen)
    tc, ts = pair_tables(bsz, t, dt, rotary=tgt_rotary, gen=gen)
    ref = torch.stack(
        [
            oracle(src, rows, heads[i], weight[i], bias[i], (sc, ss), (tc, ts), src_rotary, tgt_rotary)
            for i in range(lt)
        ]
    )

    def run(backend, out):
        args = on_device(rows, heads, weight, bias, sc, ss, tc, ts)
        layouts = dict(src_rotary=src_rotary, tgt_rotary=tgt_rotary)
        return map_layers(on_device(src), *args, backend=backend, out=out, **layouts)

    check(run, ref, (lt, bsz, ht, t, dt), torch.bfloat16)


def test_map_heads_and_fullhead_rotate_each_side_in_its_layout():
    """map_heads with per-head source tables; map_fullhead with several heads per program."""
    gen = torch.Generator().manual_seed(3)
    bsz, hs, s, ds, t, dt, ht = 1, 2, 11, 64, 17, 32, 3
    src_rotary, tgt_rotary = ("interleaved", 32), ("half", 24)
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16)
    rows = random_rows(bsz, t, s, gen)
    weight = torch.randn(ht, hs * ds, dt, generator=gen) / (hs * ds) ** 0.5
    bias = torch.randn(ht, dt, generator=gen)
    sc, ss = pair_tables(bsz, s, ds, rotary=src_rotary, gen=gen)
    tc, ts = pair_tables(bsz, t, dt, rotary=tgt_rotary, gen=gen)
    layouts = dict(src_rotary=src_rotary, tgt_rotary=tgt_rotary)
    every = torch.arange(hs)[None].expand(ht, hs)
    ref = oracle(src, rows, every, weight, bias, (sc, ss), (tc, ts), src_rotary, tgt_rotary)

    def fullhead(backend, out):
        return map_fullhead(
            *on_device(src, rows, weight, bias, sc, ss, tc, ts), backend=backend, out=out, **layouts
        )

    check(fullhead, ref, (bsz, ht, t, dt), torch.bfloat16)
    heads = torch.tensor([[1], [0], [1]])
    ref = oracle(src, rows, heads, weight[:, :ds], bias, (sc, ss), (tc, ts), src_rotary, tgt_rotary)
    per_head = (
        sc[:, None].expand(bsz, hs, s, ds).contiguous(),
        ss[:, None].expand(bsz, hs, s, ds).contiguous(),
    )

    def heads_run(backend, out):
        args = on_device(src, rows, heads, weight[:, :ds], bias, *per_head, tc, ts)
        return map_heads(*args, torch.float32, backend=backend, out=out, **layouts)

    check(heads_run, ref, (bsz, ht, t, dt), torch.float32)


@pytest.mark.parametrize("rotary", [LAYOUTS[0], LAYOUTS[3]])
def test_stats_unrotate_in_the_source_layout(rotary):
    gen = torch.Generator().manual_seed(rotary[1])
    bsz, hs, s, ds, t, dt, ht, n = 1, 2, 11, 32 if rotary[1] <= 32 else 64, 19, 16, 2, 2
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16)
    rows = random_rows(bsz, t, s, gen)
    heads = torch.randint(0, hs, (ht, n), generator=gen)
    y = torch.randn(bsz, ht, t, dt, generator=gen)
    weights = torch.rand(bsz, ht, t, generator=gen)
    cos, sin = pair_tables(bsz, s, ds, rotary=rotary, gen=gen)
    x = model_rotate(src.double(), cos[:, None], sin[:, None], rotary, inverse=True)
    keep = rows[0] >= 0
    moments = {}
    for h in range(ht):
        xh = torch.cat([x[0, heads[h, j], rows[0][keep]] for j in range(n)], -1)
        xw = xh * weights[0, h][keep].double()[:, None]
        moments.setdefault("xtx", []).append(xw.T @ xh)
        moments.setdefault("xty", []).append(xw.T @ y[0, h][keep].double())
        moments.setdefault("sum_x", []).append(xw.sum(0))
    results = {}
    for backend in ("triton", "torch"):
        stats = SufficientStats.zeros(ht, n * ds, dt, device=DEVICE)
        args = on_device(src, rows, heads, y, weights, cos, sin)
        results[backend] = stats.update(*args, backend=backend, src_rotary=rotary)
    for name, parts in moments.items():
        ref = torch.stack(parts)
        err_t = rel_err(getattr(results["torch"], name), ref)
        err_k = rel_err(getattr(results["triton"], name), ref)
        assert err_t <= 1e-5, (name, err_t)
        assert err_k <= 2 * err_t + FLOOR, (name, err_k, err_t)
    assert {f.name for f in fields(SufficientStats)} >= set(moments)
