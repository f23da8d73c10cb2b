"""map_heads / map_layers / map_fullhead: the Triton kernel (CPU interpreter) and the PyTorch
reference against a float64 computation of the documented formula, on fresh random inputs.

Rule (../shared/STYLE.md): relative error of the kernel <= 2x that of the PyTorch reference in the
same output dtype, plus a small floor; outputs start poisoned (NaN) so every element must be written.
"""

from __future__ import annotations

import os

import pytest
import torch

# Triton runs CPU tensors only in its interpreter, which it picks when it is imported: say so first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bridgecache.kernels import map_fullhead, map_heads, map_layers  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = 1e-6  # relative error both backends reach in float32 arithmetic
# What the PyTorch reference must reach on its own (output rounding), so a shared bug still fails.
REF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


pytestmark = pytest.mark.usefixtures("interpreted_triton")  # tests/conftest.py


def test_in_fresh_process(run_in_fresh_process):
    """This module's tests in a new process with the interpreter on, when this one cannot."""
    run_in_fresh_process(__file__)


def on_device(*xs):
    return [None if x is None else x.to(DEVICE) for x in xs]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_tables(*shape: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., D] as transformers builds them (halves repeated), with an attention factor."""
    angle = torch.rand(*shape[:-1], shape[-1] // 2, generator=gen, dtype=torch.float64) * 100.0
    factor = 1.0 + 0.5 * torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64)
    cos, sin = angle.cos() * factor, angle.sin() * factor
    return torch.cat((cos, cos), -1).float(), torch.cat((sin, sin), -1).float()


def random_rows(bsz: int, t: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """[B, T] source rows with -1 (no source) and repeated indices."""
    rows = torch.randint(0, s, (bsz, t), generator=gen)
    rows[:, 0] = -1
    rows[:, 1::7] = -1
    rows[:, 2] = rows[:, 3]
    return rows


def float64_map(src, rows, heads, weight, bias, src_cos, src_sin, tgt_cos, tgt_sin):
    """The documented function, full-width formula, float64. src [B, Hv, S, Ds]; heads [Ht, n];
    src_cos [B, Hv, S, Ds] or None; tgt_cos [B, T, Dt] or None -> [B, Ht, T, Dt]."""
    x = src.double()
    if src_cos is not None:
        c, s = src_cos.double(), src_sin.double()
        x = (x * c - rotate_half(x) * s) / (c * c + s * s)
    bsz, t = rows.shape
    n_heads, n = heads.shape
    out = torch.zeros(bsz, n_heads, t, weight.shape[-1], dtype=torch.float64)
    for b in range(bsz):
        idx = rows[b].clamp(min=0)
        for h in range(n_heads):
            xh = torch.cat([x[b, heads[h, j], idx] for j in range(n)], dim=-1)
            z = xh @ weight[h].double() + bias[h].double()
            if tgt_cos is not None:
                z = z * tgt_cos[b].double() + rotate_half(z) * tgt_sin[b].double()
            out[b, h] = torch.where((rows[b] >= 0)[:, None], z, 0.0)
    return out


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "output not fully written (NaN poison left)"
    return float((a.double() - ref).norm() / ref.norm())


def check(run, ref, out_shape, dtype):
    """Run both backends (Triton into a NaN-poisoned buffer) and apply the error rule."""
    poisoned = torch.full(out_shape, float("nan"), dtype=dtype, device=DEVICE)
    got = run("triton", poisoned)
    assert got.data_ptr() == poisoned.data_ptr()
    want = run("torch", None)
    got, want = got.cpu(), want.cpu()
    err_kernel, err_torch = rel_err(got, ref), rel_err(want, ref)
    assert err_torch <= REF_TOL[dtype], err_torch
    assert err_kernel <= 2 * err_torch + FLOOR, (err_kernel, err_torch)
    return got


# src heads -> tgt heads, n inputs per head, Ds -> Dt, tokens S -> T, src dtype, out dtype, keys?
CASES = [
    (3, 2, 2, 64, 64, 29, 37, torch.bfloat16, torch.bfloat16, True),
    (2, 1, 1, 128, 128, 23, 21, torch.bfloat16, torch.float16, True),
    (8, 8, 1, 64, 64, 13, 19, torch.float16, torch.float32, True),
    (2, 4, 1, 128, 256, 11, 17, torch.bfloat16, torch.bfloat16, True),
    (2, 2, 1, 256, 64, 9, 18, torch.float32, torch.float32, False),
    (3, 2, 2, 64, 128, 15, 33, torch.bfloat16, torch.bfloat16, False),
]


@pytest.mark.parametrize("hs, ht, n, ds, dt, s, t, src_dtype, out_dtype, keys", CASES)
def test_map_heads_matches_float64(hs, ht, n, ds, dt, s, t, src_dtype, out_dtype, keys):
    gen = torch.Generator().manual_seed(hash((hs, ht, n, ds, dt, s, t)) % 2**31)
    bsz = 2
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(src_dtype)
    rows = random_rows(bsz, t, s, gen)
    heads = torch.randint(0, hs, (ht, n), generator=gen)
    weight = torch.randn(ht, n * ds, dt, generator=gen) / (n * ds) ** 0.5
    bias = torch.randn(ht, dt, generator=gen)
    sc = ss = tc = ts = None
    if keys:
        sc, ss = rope_tables(bsz, s, ds, gen=gen)
        sc, ss = sc[:, None].expand(bsz, hs, s, ds), ss[:, None].expand(bsz, hs, s, ds)  # stride 0
        tc, ts = rope_tables(bsz, t, dt, gen=gen)
    ref = float64_map(src, rows, heads, weight, bias, sc, ss, tc, ts)

    def run(backend, out):
        args = on_device(src, rows, heads, weight, bias, sc, ss, tc, ts)
        return map_heads(*args, out_dtype, backend=backend, out=out)

    got = check(run, ref, (bsz, ht, t, dt), out_dtype)
    assert (got[:, :, 0] == 0).all() and (got[:, :, 1::7] == 0).all()  # rows -1 are zero


def test_map_heads_strided_source_and_per_head_tables():
    """A source that is a transposed view, per-head (not broadcast) source tables, a list source."""
    gen = torch.Generator().manual_seed(7)
    bsz, hs, s, ds, t, dt = 1, 2, 19, 64, 25, 64
    storage = torch.randn(bsz, s, hs, ds, generator=gen).to(torch.bfloat16)
    src = storage.transpose(1, 2)  # [B, Hs, S, Ds], non-contiguous
    other = torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16)
    rows = random_rows(bsz, t, s, gen)
    heads = torch.tensor([[0, 3], [2, 1]])  # virtual heads of [src, other]
    weight = torch.randn(2, 2 * ds, dt, generator=gen) / ds**0.5
    bias = torch.randn(2, dt, generator=gen)
    sc, ss = rope_tables(bsz, 2 * hs, s, ds, gen=gen)
    tc, ts = rope_tables(bsz, t, dt, gen=gen)
    both = torch.cat([src, other], dim=1)
    ref = float64_map(both, rows, heads, weight, bias, sc, ss, tc, ts)

    def run(backend, out):
        a, b, *args = on_device(src, other, rows, heads, weight, bias, sc, ss, tc, ts)
        return map_heads([a, b], *args, backend=backend, out=out)

    check(run, ref, (bsz, 2, t, dt), torch.bfloat16)


def test_map_layers_matches_float64():
    """All target layers in one launch; separate source tensors; per-layer-type source tables."""
    gen = torch.Generator().manual_seed(11)
    bsz, hs, s, ds, t, dt, n_src, n_tgt, ht, n = 2, 2, 17, 64, 23, 128, 3, 2, 3, 2
    src = [torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16) for _ in range(n_src)]
    rows = random_rows(bsz, t, s, gen)
    heads = torch.randint(0, n_src * hs, (n_tgt, ht, n), generator=gen)
    weight = torch.randn(n_tgt, ht, n * ds, dt, generator=gen) / (n * ds) ** 0.5
    bias = torch.randn(n_tgt, ht, dt, generator=gen)
    per_layer_cos, per_layer_sin = rope_tables(bsz, n_src, s, ds, gen=gen)  # [B, Ls, S, Ds]
    sc = per_layer_cos[:, :, None].expand(bsz, n_src, hs, s, ds)
    ss = per_layer_sin[:, :, None].expand(bsz, n_src, hs, s, ds)
    tc, ts = rope_tables(bsz, t, dt, gen=gen)
    flat = (sc.reshape(bsz, n_src * hs, s, ds), ss.reshape(bsz, n_src * hs, s, ds))
    both = torch.cat(src, dim=1)
    ref = torch.stack(
        [float64_map(both, rows, heads[i], weight[i], bias[i], *flat, tc, ts) for i in range(n_tgt)]
    )

    def run(backend, out):
        return map_layers(on_device(*src), *on_device(rows, heads, weight, bias, sc, ss, tc, ts),
                          backend=backend, out=out)  # fmt: skip

    check(run, ref, (n_tgt, bsz, ht, t, dt), torch.bfloat16)


@pytest.mark.parametrize("dt, ht", [(64, 3), (128, 2)])
def test_map_fullhead_matches_float64(dt, ht):
    """Every target head reads all heads of k = 2 source layers (dt 64: two heads per program)."""
    gen = torch.Generator().manual_seed(dt + ht)
    bsz, hs, s, ds, t = 1, 2, 15, 64, 21
    src = [torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16) for _ in range(2)]
    rows = random_rows(bsz, t, s, gen)
    weight = torch.randn(ht, 2 * hs * ds, dt, generator=gen) / (2 * hs * ds) ** 0.5
    bias = torch.randn(ht, dt, generator=gen)
    sc, ss = rope_tables(bsz, s, ds, gen=gen)
    tc, ts = rope_tables(bsz, t, dt, gen=gen)
    heads = torch.arange(2 * hs)[None].expand(ht, -1)
    sc4, ss4 = sc[:, None].expand(bsz, 2 * hs, s, ds), ss[:, None].expand(bsz, 2 * hs, s, ds)
    ref = float64_map(torch.cat(src, 1), rows, heads, weight, bias, sc4, ss4, tc, ts)

    def run(backend, out):
        return map_fullhead(
            on_device(*src), *on_device(rows, weight, bias, sc, ss, tc, ts), backend=backend, out=out
        )

    check(run, ref, (bsz, ht, t, dt), torch.bfloat16)


def test_map_layers_writes_a_slice_of_a_larger_buffer_with_shared_heads():
    """What BridgedCache's grouped translation launches: every target layer reads the same inputs
    (heads stride 0 over Ht and over layers' heads), output is the tail of a [Lt, B, Ht, R, Dt]
    buffer whose first columns hold other rows and must stay untouched."""
    gen = torch.Generator().manual_seed(5)
    bsz, hs, s, ds, t, dt, n_src, n_tgt, ht, front = 2, 2, 13, 64, 19, 64, 3, 3, 2, 2
    src = [torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16) for _ in range(n_src)]
    rows = random_rows(bsz, t, s, gen)
    per_layer = torch.randint(0, n_src * hs, (n_tgt, 1, 2), generator=gen)
    heads = per_layer.expand(n_tgt, ht, 2)
    weight = torch.randn(n_tgt, ht, 2 * ds, dt, generator=gen) / (2 * ds) ** 0.5
    bias = torch.randn(n_tgt, ht, dt, generator=gen)
    sc, ss = rope_tables(bsz, s, ds, gen=gen)  # [B, S, Ds] shared by every source layer
    tc, ts = rope_tables(bsz, t, dt, gen=gen)
    flat = (sc[:, None].expand(bsz, n_src * hs, s, ds), ss[:, None].expand(bsz, n_src * hs, s, ds))
    both = torch.cat(src, dim=1)
    ref = torch.stack(
        [float64_map(both, rows, heads[i], weight[i], bias[i], *flat, tc, ts) for i in range(n_tgt)]
    )
    buffer = torch.full((n_tgt, bsz, ht, front + t, dt), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    buffer[..., :front, :] = 7.0
    args = (on_device(*src), *on_device(rows, heads, weight, bias, sc, ss, tc, ts))
    got = map_layers(*args, backend="triton", out=buffer[..., front:, :])
    want = map_layers(*args, backend="torch")
    err_kernel, err_torch = rel_err(got.cpu(), ref), rel_err(want.cpu(), ref)
    assert err_torch <= REF_TOL[torch.bfloat16], err_torch
    assert err_kernel <= 2 * err_torch + FLOOR, (err_kernel, err_torch)
    assert bool((buffer[..., :front, :] == 7.0).all())


# The persistent kernel (kernels/persistent.py) on the calls it takes, where "auto" picks it: one
# input slot per head.
# Lt, Ht, shared heads, Ds -> Dt, T, source dtype, out dtype, keys, per-head source tables
PERSISTENT_CASES = [
    (2, 2, False, 64, 256, 21, torch.bfloat16, torch.bfloat16, True, False),
    (2, 3, True, 64, 64, 29, torch.float32, torch.float16, False, False),
    (2, 2, False, 256, 32, 21, torch.bfloat16, torch.float32, True, True),
]


@pytest.mark.parametrize("lt, ht, shared, ds, dt, t, src_dtype, out_dtype, keys, per_head", PERSISTENT_CASES)
def test_persistent_kernel_matches_float64(monkeypatch, lt, ht, shared, ds, dt, t, src_dtype, out_dtype, keys,
                                           per_head):  # fmt: skip
    """Every layer in one launch, three programs whose shares of the work items cross units (layer,
    head group, column block); several column blocks (Dt 256), head groups with a masked head
    (shared, Ht 3), per-layer target tables, per-head source tables."""
    from bridgecache.kernels import affine

    launches = []
    real = affine.launch_persistent
    monkeypatch.setattr(affine, "launch_persistent", lambda *a, **k: launches.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(hash((lt, ht, ds, dt, t)) % 2**31)
    bsz, hs, s, n_src = 2, 2, 23, 2
    src = [torch.randn(bsz, hs, s, ds, generator=gen).to(src_dtype) for _ in range(n_src)]
    rows = random_rows(bsz, t, s, gen)
    heads = torch.randint(0, n_src * hs, (lt, 1 if shared else ht, 1), generator=gen).expand(lt, ht, 1)
    weight = torch.randn(lt, ht, ds, dt, generator=gen) / ds**0.5
    bias = torch.randn(lt, ht, dt, generator=gen)
    sc5 = ss5 = tc = ts = flat = None
    if keys:
        if per_head:
            sc, ss = rope_tables(bsz, n_src * hs, s, ds, gen=gen)
            sc5, ss5, flat = sc.unflatten(1, (n_src, hs)), ss.unflatten(1, (n_src, hs)), (sc, ss)
        else:
            sc, ss = rope_tables(bsz, s, ds, gen=gen)
            sc5, ss5 = sc, ss
            flat = (sc[:, None].expand(bsz, n_src * hs, s, ds), ss[:, None].expand(bsz, n_src * hs, s, ds))
        tc, ts = rope_tables(lt, bsz, t, dt, gen=gen)  # per target layer
    both = torch.cat(src, dim=1)
    ref = torch.stack(
        [
            float64_map(both, rows, heads[i], weight[i], bias[i], *(flat or (None, None)),
                        None if tc is None else tc[i], None if ts is None else ts[i])
            for i in range(lt)
        ]
    )  # fmt: skip

    def run(backend, out):
        return map_layers(on_device(*src), *on_device(rows, heads, weight, bias, sc5, ss5, tc, ts),
                          out_dtype=out_dtype, backend=backend, out=out)  # fmt: skip

    got = check(run, ref, (lt, bsz, ht, t, dt), out_dtype)
    assert launches, "the persistent kernel did not run"
    assert (got[:, :, :, 0] == 0).all() and (got[:, :, :, 1::7] == 0).all()  # rows -1 are zero


@pytest.mark.parametrize("kernel", ["tiled", "persistent"])
def test_apply_kernel_argument(kernel):
    """launch_affine's kernel: either Triton kernel on a one-input map (the tiled one too, which
    "auto" does not pick there), writing every element; the persistent one refuses n > 1."""
    from bridgecache.kernels import affine
    from bridgecache.kernels._dispatch import source_view

    gen = torch.Generator().manual_seed(len(kernel))
    bsz, hs, s, ds, t, dt = 1, 2, 13, 64, 17, 64
    src = torch.randn(bsz, hs, s, ds, generator=gen).to(torch.bfloat16)
    rows = random_rows(bsz, t, s, gen)
    heads = torch.tensor([[[1], [0]]])
    weight = torch.randn(1, 2, ds, dt, generator=gen) / ds**0.5
    bias = torch.randn(1, 2, dt, generator=gen)
    tc, ts = rope_tables(1, bsz, t, dt, gen=gen)
    ref = float64_map(src, rows, heads[0], weight[0], bias[0], None, None, tc[0], ts[0])[None]
    out = torch.full((1, bsz, 2, t, dt), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    args = on_device(rows, heads, weight, bias)
    affine.launch_affine(source_view([src.to(DEVICE)]), *args, None, None, *on_device(tc, ts), out, kernel)
    want = map_layers([src], rows, heads, weight, bias, tgt_cos=tc, tgt_sin=ts, backend="torch")
    err_kernel, err_torch = rel_err(out.cpu(), ref), rel_err(want, ref)
    assert err_kernel <= 2 * err_torch + FLOOR, (err_kernel, err_torch)
    if kernel == "persistent":
        two = torch.tensor([[[1, 0], [0, 1]]], device=DEVICE)
        wide = weight.repeat(1, 1, 2, 1).to(DEVICE)
        with pytest.raises(ValueError, match="persistent"):
            affine.launch_affine(source_view([src.to(DEVICE)]), args[0], two, wide, args[3], None, None, None,
                                 None, out, kernel)  # fmt: skip
