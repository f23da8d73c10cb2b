"""column_attention: the PyTorch reference and the Triton kernel (CPU interpreter) against a float64
dense computation of the documented function, on fresh random inputs.

Rule (../shared/STYLE.md): relative error of the kernel <= 2x that of the PyTorch reference in the
same dtype, plus a small floor; outputs start poisoned (NaN) so every element must be written.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

# Triton runs CPU tensors only in its interpreter, which it picks when it is imported: say so first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bridgecache.kernels.attention import column_attention  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOOR = 1e-6
# What the PyTorch reference must reach on its own (output rounding), so a shared bug still fails.
REF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


pytestmark = pytest.mark.usefixtures("interpreted_triton")  # tests/conftest.py


def test_in_fresh_process(run_in_fresh_process):
    """This module's tests in a new process with the interpreter on, when this one cannot."""
    run_in_fresh_process(__file__)


def float64_attention(
    q, k, v, query_columns, key_columns, first_column, scale, window, softcap, chunk=None, sinks=None
):
    """The documented function, dense and explicit, in float64: [B, Nq, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    logits = (q.double() @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    qc, kc = query_columns[:, :, None], key_columns[None, None, :]
    seen = (kc <= qc) & (kc >= first_column[:, None, None])
    if window is not None:
        seen &= qc - kc < window
    if chunk is not None:  # chunks counted from each row's first column, as transformers' chunked mask
        first = first_column[:, None, None]
        seen &= torch.div(qc - first, chunk, rounding_mode="floor") == torch.div(
            kc - first, chunk, rounding_mode="floor"
        )
    logits = logits.masked_fill(~seen[:, None], float("-inf"))
    if sinks is None:
        probs = logits.softmax(-1).nan_to_num(0.0)
    else:  # one more column per head, dropped after the softmax (transformers' GPT-OSS eager attention)
        sink = sinks.double()[None, :, None, None].expand(*logits.shape[:-1], 1)
        probs = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
    return (probs @ v).transpose(1, 2), seen


def columns(gen, batch, n_k, n_q, padded):
    """key_columns [Nk] strictly ascending with gaps; first_column [B] (row 1 left-padded when
    `padded`); query_columns [B, Nq] ascending with: a query at each row's first column (its only
    visible key is itself), one just below it (sees nothing), a repeat, columns past the last key."""
    span = 2 * n_k
    key_columns = torch.randperm(span, generator=gen)[:n_k].sort().values
    first = [int(key_columns[3]) if padded and b == 1 else int(key_columns[0]) for b in range(batch)]
    rows = []
    for b in range(batch):
        row = torch.randint(0, span + 6, (n_q,), generator=gen)
        if n_q >= 4:
            row[0], row[1] = first[b], max(first[b] - 1, 0)
            row[2] = row[3]
        rows.append(row.sort().values)
    return torch.stack(rows), key_columns, torch.tensor(first)


def make_case(
    seed,
    batch,
    q_heads,
    kv_heads,
    dim,
    n_k,
    n_q,
    window,
    softcap,
    dtype,
    padded=True,
    chunk=None,
    sinks=False,
):
    gen = torch.Generator().manual_seed(seed)
    qc, kc, first = columns(gen, batch, n_k, n_q, padded)
    q = torch.randn(batch, q_heads, n_q, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, n_k, dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, n_k, dim, generator=gen).to(dtype)
    scale = 2.0 / dim**0.5 if softcap else dim**-0.5  # logits of a few units: the cap bites
    options = dict(scale=scale, window=window, softcap=softcap)
    if chunk is not None:
        options["chunk"] = chunk
    if sinks:  # logits of a few units, as the keys': the sink takes a real share (or almost all)
        options["sinks"] = 2.0 * torch.randn(q_heads, generator=gen)
    ref, seen = float64_attention(
        q, k, v, qc, kc, first, scale, window, softcap, options.get("chunk"), options.get("sinks")
    )
    args = (q, k, v, qc, kc, first)
    return args, options, ref, seen


def run(args, options, backend, out=None):
    options = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    got = column_attention(*(x.to(DEVICE) for x in args), **options, backend=backend, out=out)
    return got.cpu()


def case_seed(*params) -> int:
    """One seed per case, the same in every process (hash(None) is not, before Python 3.12)."""
    return zlib.crc32(repr(params).encode())


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """|a - ref| / |ref|; a case whose queries all see no key has ref == 0 (then a must be 0 too)."""
    assert not torch.isnan(a).any(), "output not fully written (NaN poison left)"
    return float((a.double() - ref).norm() / ref.norm().clamp_min(torch.finfo(torch.float64).tiny))


def assert_blind_rows_zero(got: torch.Tensor, seen: torch.Tensor) -> None:
    """Queries that see no key come back exactly zero."""
    blind = ~seen.any(-1)  # [B, Nq]
    assert (got[blind] == 0).all()


# batch, q heads, kv heads, head dim, keys, queries, window, softcap, dtype
REFERENCE_CASES = [
    (2, 4, 4, 64, 50, 20, None, None, torch.float32),
    (2, 4, 2, 128, 60, 30, 8, None, torch.bfloat16),
    (1, 7, 1, 64, 40, 1, None, None, torch.float32),
    (2, 2, 1, 256, 45, 25, None, 3.0, torch.bfloat16),
    (2, 4, 2, 64, 70, 300, 16, 2.0, torch.float32),  # two query blocks of the reference
    (2, 2, 2, 64, 30, 12, 1, None, torch.float32),  # window 1: each query sees only its own column
    (1, 6, 2, 128, 33, 17, None, None, torch.float16),
    (2, 4, 1, 64, 90, 40, 5, None, torch.bfloat16),
]


@pytest.mark.parametrize("batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype", REFERENCE_CASES)
def test_reference_matches_float64(batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype):
    seed = case_seed(batch, hq, hkv, dim, n_k, n_q, window)
    args, options, ref, seen = make_case(seed, batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype)
    got = run(args, options, "torch")
    assert got.dtype == dtype and got.shape == (batch, n_q, hq, dim)
    assert rel_err(got, ref) <= REF_TOL[dtype]
    assert_blind_rows_zero(got, seen)


# The Triton kernel (interpreter blocks: 16 queries x 16 keys): small shapes, same rule.
KERNEL_CASES = [
    (2, 2, 1, 64, 50, 20, None, None, torch.float32),
    (2, 2, 2, 64, 50, 20, 8, None, torch.bfloat16),
    (1, 2, 1, 128, 40, 1, None, None, torch.bfloat16),
    (1, 2, 1, 256, 40, 18, None, 3.0, torch.float32),
    (2, 2, 1, 64, 40, 15, 1, 2.0, torch.bfloat16),
    (1, 3, 1, 96, 37, 33, 20, None, torch.float32),  # head dim padded to 128 inside the kernel
]


@pytest.mark.parametrize("batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype", KERNEL_CASES)
def test_kernel_matches_float64(batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype):
    seed = case_seed(batch, hq, hkv, dim, n_k, n_q, window, 1)
    args, options, ref, seen = make_case(seed, batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype)
    poisoned = torch.full((batch, n_q, hq, dim), float("nan"), dtype=dtype, device=DEVICE)
    got = column_attention(*(x.to(DEVICE) for x in args), **options, backend="triton", out=poisoned)
    assert got.data_ptr() == poisoned.data_ptr()
    got = got.cpu()
    want = run(args, options, "torch")
    err_kernel, err_torch = rel_err(got, ref), rel_err(want, ref)
    assert err_torch <= REF_TOL[dtype], err_torch
    assert err_kernel <= 2 * err_torch + FLOOR, (err_kernel, err_torch)
    assert_blind_rows_zero(got, seen)


# Few queries over many keys (the split launch): the keys of each query block in shares.
SPLIT_CASES = [
    (2, 2, 1, 64, 90, 5, None, None, torch.float32, 3),
    (1, 4, 2, 128, 130, 17, None, None, torch.bfloat16, 4),
    (2, 2, 2, 64, 100, 12, 20, 2.0, torch.bfloat16, 2),
    (1, 2, 1, 96, 70, 1, None, None, torch.float32, 5),  # more shares than some blocks' keys fill
]


@pytest.mark.parametrize("batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype, splits", SPLIT_CASES)
def test_split_keys_match_float64(batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype, splits):
    """Partial softmaxes over shares of the keys, combined, are the softmax over all of them."""
    from bridgecache.kernels.attention import launch_attention

    seed = case_seed(batch, hq, hkv, dim, n_k, n_q, window, splits)
    args, options, ref, seen = make_case(seed, batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype)
    q, k, v, qc, kc, first = (x.to(DEVICE) for x in args)
    got = torch.full((batch, n_q, hq, dim), float("nan"), dtype=dtype, device=DEVICE)
    window, softcap = options["window"], options["softcap"]
    launch_attention(q, k, v, qc, kc, first, options["scale"], window, softcap, got, splits=splits)
    got = got.cpu()
    want = run(args, options, "torch")
    err_kernel, err_torch = rel_err(got, ref), rel_err(want, ref)
    assert err_kernel <= 2 * err_torch + FLOOR, (err_kernel, err_torch)
    assert_blind_rows_zero(got, seen)


# GPT-OSS's sinks and Llama 4's chunks, alone and with a window / cap, on both backends and split.
# batch, q heads, kv heads, head dim, keys, queries, window, softcap, chunk, sinks, dtype, splits
SINK_CHUNK_CASES = [
    (2, 4, 2, 64, 50, 20, None, None, None, True, torch.float32, 1),
    (2, 2, 1, 64, 50, 20, 8, None, None, True, torch.bfloat16, 1),
    (2, 2, 2, 64, 60, 25, None, None, 8, False, torch.float32, 1),
    (2, 2, 1, 128, 70, 33, None, None, 16, False, torch.bfloat16, 1),
    (1, 4, 2, 64, 40, 18, None, 3.0, 8, True, torch.float32, 1),
    (2, 2, 1, 64, 90, 5, None, None, None, True, torch.float32, 3),
    (2, 2, 2, 64, 100, 12, None, None, 32, True, torch.bfloat16, 2),
]


@pytest.mark.parametrize(
    "batch, hq, hkv, dim, n_k, n_q, window, softcap, chunk, sinks, dtype, splits", SINK_CHUNK_CASES
)
def test_sinks_and_chunks_match_float64(batch, hq, hkv, dim, n_k, n_q, window, softcap, chunk, sinks, dtype,
                                         splits):  # fmt: skip
    from bridgecache.kernels.attention import launch_attention

    seed = case_seed(batch, hq, hkv, dim, n_k, n_q, window, chunk, sinks, splits)
    args, options, ref, seen = make_case(
        seed, batch, hq, hkv, dim, n_k, n_q, window, softcap, dtype, chunk=chunk, sinks=sinks
    )
    want = run(args, options, "torch")
    err_torch = rel_err(want, ref)
    assert err_torch <= REF_TOL[dtype], err_torch
    assert_blind_rows_zero(want, seen)
    got = torch.full((batch, n_q, hq, dim), float("nan"), dtype=dtype, device=DEVICE)
    device_options = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    if splits == 1:
        column_attention(*(x.to(DEVICE) for x in args), **device_options, backend="triton", out=got)
    else:
        q, k, v, qc, kc, first = (x.to(DEVICE) for x in args)
        o = device_options
        launch_attention(q, k, v, qc, kc, first, o["scale"], window, softcap, got, splits=splits,
                         chunk=o.get("chunk"), sinks=o.get("sinks"))  # fmt: skip
    got = got.cpu()
    err_kernel = rel_err(got, ref)
    assert err_kernel <= 2 * err_torch + FLOOR, (err_kernel, err_torch)
    assert_blind_rows_zero(got, seen)
    # without them the function differs: the cases test something
    plain = float64_attention(*args, options["scale"], window, softcap)[0]
    assert rel_err(plain, ref) > 10 * REF_TOL[dtype]


def test_split_count_fills_the_multiprocessors_with_few_queries_only():
    from bridgecache.kernels.attention_launch import split_count

    assert split_count(programs=14, n_q=17, n_k=32768, sms=132) == 19  # about 2 programs per SM
    assert split_count(programs=14, n_q=17, n_k=300, sms=132) == 1  # too few keys to share
    assert split_count(programs=14, n_q=6600, n_k=32768, sms=132) == 1  # many queries fill it
    assert split_count(programs=264, n_q=17, n_k=32768, sms=132) == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_column_a_query_is_causal_attention(backend):
    """query_columns == key_columns == arange: plain causal attention (sdpa is_causal)."""
    gen = torch.Generator().manual_seed(3)
    bsz, hq, hkv, n, dim = 2, 4, 2, 40, 64
    q, k, v = (torch.randn(bsz, h, n, dim, generator=gen) for h in (hq, hkv, hkv))
    cols = torch.arange(n)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    args = (q, k, v, cols[None].expand(bsz, n), cols, torch.zeros(bsz, dtype=torch.int64))
    got = run(args, dict(scale=dim**-0.5), backend)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=2e-6, rtol=1e-5)


def test_kernel_skips_key_blocks_out_of_range():
    """Key blocks outside every query block's range are never read: NaN there changes nothing.
    Interpreter blocks are 16 keys: queries at columns 40..47 with window 8 reach keys 33..47,
    i.e. key blocks [32, 48); blocks [0, 32) and [48, 96) hold NaN."""
    if DEVICE == "cuda":
        pytest.skip("block sizes on CUDA are the tuned ones; the interpreter's are fixed")
    gen = torch.Generator().manual_seed(4)
    n_k, dim = 96, 64
    q = torch.randn(1, 2, 8, dim, generator=gen)
    k, v = torch.randn(1, 1, n_k, dim, generator=gen), torch.randn(1, 1, n_k, dim, generator=gen)
    qc, kc, first = torch.arange(40, 48)[None], torch.arange(n_k), torch.zeros(1, dtype=torch.int64)
    ref, _ = float64_attention(q, k, v, qc, kc, first, dim**-0.5, 8, None)
    for x in (k, v):
        x[:, :, :32] = float("nan")
        x[:, :, 48:] = float("nan")
    got = column_attention(q, k, v, qc, kc, first, scale=dim**-0.5, window=8, backend="triton")
    assert rel_err(got, ref) <= 1e-5


def test_fake_tensors_and_opcheck():
    """The operator traces (fake tensors: what torch.compile sees) and passes torch's op checks."""
    args, options, _, _ = make_case(0, 2, 4, 2, 64, 30, 9, 5, None, torch.float32)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in args]
        out = column_attention(*fake, **options)
        assert out.shape == (2, 9, 4, 64) and out.dtype == torch.float32
    out = torch.empty(2, 9, 4, 64)
    op_args = (*args, options["scale"], 5, None, None, None, "torch", out)
    torch.library.opcheck(torch.ops.bridgecache.column_attention.default, op_args)
    sinks = torch.randn(4)
    op_args = (*args, options["scale"], None, None, 4, sinks, "torch", out)
    torch.library.opcheck(torch.ops.bridgecache.column_attention.default, op_args)


def test_argument_checks():
    args, options, _, _ = make_case(1, 1, 4, 2, 64, 20, 6, None, None, torch.float32)
    q, k, v, qc, kc, first = args
    with pytest.raises(ValueError, match="multiple"):
        column_attention(q, torch.randn(1, 3, 20, 64), v, qc, kc, first, **options)
    with pytest.raises(ValueError, match="query_columns"):
        column_attention(q, k, v, qc.int(), kc, first, **options)
    with pytest.raises(ValueError, match="value"):
        column_attention(q, k, v.bfloat16(), qc, kc, first, **options)
    with pytest.raises(ValueError, match="window"):
        column_attention(q, k, v, qc, kc, first, scale=1.0, window=0)
    with pytest.raises(ValueError, match="chunk"):
        column_attention(q, k, v, qc, kc, first, scale=1.0, chunk=0)
    with pytest.raises(ValueError, match="sinks"):
        column_attention(q, k, v, qc, kc, first, scale=1.0, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks"):
        column_attention(q, k, v, qc, kc, first, scale=1.0, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="out"):
        column_attention(q, k, v, qc, kc, first, **options, out=torch.empty(1, 4, 6, 64))
    empty = column_attention(q, k[:, :, :0], v[:, :, :0], qc, kc[:0], first, **options)
    assert empty.shape == (1, 6, 4, 64) and not empty.any()
