"""Gathered, rope-aware affine maps of KV rows: the computation behind map_heads and map_fullhead.

For every target layer l, target head h and target position t (one batch row b):

    x_j   = src[v_j][b, rows[b, t], :]           j < n, v_j = heads[l, h, j] (virtual source head)
    u_j   = unrotate(x_j, src_cos[b, v_j, rows[b, t]], src_sin[...])      (keys; identity for values)
    z     = concat_j(u_j) @ weight[l, h] + bias[l, h]                      ([n * Ds] -> [Dt])
    out[l, b, h, t] = rotate(z, tgt_cos[l, b, t], tgt_sin[l, b, t])       (keys), cast to out's dtype
    out[l, b, h, t] = 0 where rows[b, t] == -1

RoPE rotates the channel pairs (a, b) of each side's rotary layout (`src_rotary`, `tgt_rotary`:
Triton compile-time constants; kernels.rotary): x1 = x[a], x2 = x[b], (c, s) = cos/sin[..., p] for
pair p (tables [..., D] by pair, first half read: for Llama's layout, transformers' own tables):
    unrotate: u1 = (x1 c + x2 s) / (c^2 + s^2),  u2 = (x2 c - x1 s) / (c^2 + s^2)
    rotate:   y1 = z1 c - z2 s,                  y2 = z2 c + z1 s
Dividing by c^2 + s^2 inverts rope types that scale both tables (attention factor) exactly.

`affine_reference` (PyTorch, float32 arithmetic) and the Triton kernel compute the same function;
`gathered_affine` checks the arguments, dispatches, and is registered as the torch operator
bridgecache::gathered_affine. A Triton program owns one block of target positions of one target
layer and a tile of 128 output columns: matching column blocks of both rope halves of one head,
or, when every head reads the same inputs (full-head), of several heads, which then share the
gathered, un-rotated X (a GEMM tile). Every layer of a cache is one launch. Arithmetic: gathered
rows are cast to float32; dot products run on tensor cores in TF32 for bf16 outputs (well below
bf16 rounding) and 3xTF32 for fp16/fp32 outputs (about float32). Triton needs power-of-two head
dims >= 32; other dims use the reference.

Which Triton kernel runs (`launch_affine`'s `kernel`, "auto" unless a caller asks): maps with one
input slot per head and a source head dim of 32..256 (identity maps, head-local CacheBridge maps
with k = 1) run on the persistent kernel of `bridgecache.kernels.persistent` (same function,
weights kept on chip across token blocks); every other call runs on this module's tiled kernel:
full-head maps, so both shipped bridges (8 and 12 inputs per head), map_fullhead, and head-local
maps with k > 1.

Knows nothing about models, bridges or which source heads feed which target head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from ._dispatch import (
    LazyKernel,
    SourceView,
    device_of,
    interpreting,
    next_pow2,
    resolve_backend,
    source_view,
)
from .checks import FLOATS, expect, last_contiguous
from .persistent import launch_persistent, supports_persistent
from .reference import affine_reference, rope_pairs, source_tables, target_tables, unrope_pairs
from .rotary import HELPERS, _gather_unrotated, _pair_channels, _scaled_table, check_layout, layout_meta

tl = None  # triton.language, bound when the kernel is first compiled (see _dispatch.LazyKernel)

__all__ = [
    "APPLY_KERNELS",
    "affine_reference",
    "gathered_affine",
    "launch_affine",
    "rope_pairs",
    "source_tables",
    "target_tables",
    "unrope_pairs",
]


# ----------------------------------------------------------------------------------------------
# Triton kernel


def _affine_kernel(
    src_ptr, lay_off_ptr, s_b, s_h, s_s,
    rows_ptr, r_b, r_t,
    heads_ptr, hd_l, hd_h, hd_j,
    w_ptr, w_l, w_h, w_k, w_n,
    bias_ptr, bi_l, bi_h,
    sc_ptr, ss_ptr, sc_b, sc_l, sc_h, sc_s,
    tc_ptr, ts_ptr, tc_l, tc_b, tc_t,
    out_ptr, o_l, o_b, o_h, o_t,
    T, T_KEY, Ht, n, HS,
    HALF_S: tl.constexpr, HALF_T: tl.constexpr, HB: tl.constexpr, BH: tl.constexpr,
    SRC_ROPE: tl.constexpr, SHARED_TABLE: tl.constexpr, TGT_ROPE: tl.constexpr, ALIGNED: tl.constexpr,
    PRECISION: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
    S_INTERLEAVED: tl.constexpr, S_ROT_HALF: tl.constexpr,
    T_INTERLEAVED: tl.constexpr, T_ROT_HALF: tl.constexpr,
):  # fmt: skip
    # axis 0: (target layer, head group, column block), fastest, so the programs of one token
    # block run together and share source rows and rope tables in L2; axis 1: (batch, token block).
    n_hg = tl.cdiv(Ht, HB)
    cb = tl.program_id(0) % (HALF_T // BH)
    hg = (tl.program_id(0) // (HALF_T // BH)) % n_hg
    layer = (tl.program_id(0) // ((HALF_T // BH) * n_hg)).to(tl.int64)
    n_tb = tl.cdiv(T, BLOCK_T)
    b = (tl.program_id(1) // n_tb).to(tl.int64)
    offs_t = (tl.program_id(1) % n_tb) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    row = tl.load(rows_ptr + b * r_b + offs_t * r_t, mask=t_mask, other=-1)
    valid = row >= 0
    row = tl.where(valid, row, 0).to(tl.int64)
    ld_mask = t_mask & valid

    # Accumulator column c = (hb * 2 + side) * BH + e holds channel a (side 0) or b (side 1) of target
    # pair cb * BH + e of head hg * HB + hb (kernels.rotary): each program owns whole rope pairs.
    offs_n = tl.arange(0, HB * 2 * BH)
    ta, tb = _pair_channels(cb * BH + offs_n % BH, T_INTERLEAVED, T_ROT_HALF, HALF_T)
    col_n = tl.where((offs_n // BH) % 2 == 0, ta, tb)
    if not T_INTERLEAVED and T_ROT_HALF == HALF_T:
        col_n = tl.max_contiguous(tl.multiple_of(col_n, BH), BH)
    head_n = (hg * HB + offs_n // (2 * BH)).to(tl.int64)
    n_mask = head_n < Ht
    w_base = w_ptr + layer * w_l + head_n[None, :] * w_h + col_n[None, :] * w_n
    offs_c = tl.arange(0, BLOCK_S)

    acc = tl.zeros([BLOCK_T, HB * 2 * BH], dtype=tl.float32)
    m = ld_mask[:, None]
    # chunks of the head dim outside, input slots inside: when every slot reads the same rope
    # table (SHARED_TABLE: one rope for all source layers and heads) a chunk's table is loaded
    # once for all n slots, not once per slot (the tables' float32 re-reads from L2 were twice
    # the bytes of the bfloat16 rows they rotate; benchmarks/reports/gpu-kernels.md)
    for c0 in tl.static_range(0, HALF_S, BLOCK_S):
        d = c0 + offs_c
        sa, sb = _pair_channels(d, S_INTERLEAVED, S_ROT_HALF, HALF_S)
        if SRC_ROPE and SHARED_TABLE:
            cs, sn = _scaled_table(sc_ptr, ss_ptr, b * sc_b + row[:, None] * sc_s + d[None, :], m)
        elif not SRC_ROPE:
            cs = 0.0
            sn = 0.0
        for j in range(n):
            # the heads of a group read the same slot list (HB > 1 only when shared)
            v = tl.load(heads_ptr + layer * hd_l + (hg * HB).to(tl.int64) * hd_h + j * hd_j)
            lay = v // HS
            hd = v % HS
            src_off = tl.load(lay_off_ptr + lay) + b * s_b + hd * s_h + row * s_s
            if ALIGNED:
                src_off = tl.multiple_of(src_off, 16)
            if SRC_ROPE and not SHARED_TABLE:
                t_off = b * sc_b + lay * sc_l + hd * sc_h + row[:, None] * sc_s + d[None, :]
                cs, sn = _scaled_table(sc_ptr, ss_ptr, t_off, m)
            u1, u2 = _gather_unrotated(
                src_ptr + src_off, d, m, cs, sn, SRC_ROPE, S_INTERLEAVED, S_ROT_HALF, HALF_S
            )
            w1 = tl.load(w_base + (j * 2 * HALF_S + sa)[:, None] * w_k, mask=n_mask[None, :], other=0.0)
            w2 = tl.load(w_base + (j * 2 * HALF_S + sb)[:, None] * w_k, mask=n_mask[None, :], other=0.0)
            acc = tl.dot(u1, w1, acc, input_precision=PRECISION)
            acc = tl.dot(u2, w2, acc, input_precision=PRECISION)

    acc += tl.load(bias_ptr + layer * bi_l + head_n * bi_h + col_n, mask=n_mask, other=0.0)[None, :]
    # split the columns into the two halves of each head: z1, z2 [BLOCK_T, HB * BH]
    z = tl.permute(tl.reshape(acc, [BLOCK_T, HB, 2, BH]), (0, 1, 3, 2))
    z1, z2 = tl.split(tl.reshape(z, [BLOCK_T, HB * BH, 2]))
    offs_h = tl.arange(0, HB * BH)
    dh = cb * BH + offs_h % BH
    head_h = (hg * HB + offs_h // BH).to(tl.int64)
    if TGT_ROPE:
        t_off = layer * tc_l + b * tc_b + offs_t[:, None] * tc_t + dh[None, :]
        tm = t_mask[:, None]
        cs = tl.load(tc_ptr + t_off, mask=tm, other=1.0)
        sn = tl.load(ts_ptr + t_off, mask=tm, other=0.0)
        y1 = z1 * cs - z2 * sn
        y2 = z2 * cs + z1 * sn
    else:
        y1 = z1
        y2 = z2
    y1 = tl.where(valid[:, None], y1, 0.0)
    y2 = tl.where(valid[:, None], y2, 0.0)
    if OUT_BF16:
        # round to nearest even by hand: Triton's interpreter truncates in .to(bfloat16)
        b1 = y1.to(tl.uint32, bitcast=True)
        b2 = y2.to(tl.uint32, bitcast=True)
        y1 = ((b1 + 0x7FFF + ((b1 >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        y2 = ((b2 + 0x7FFF + ((b2 >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    oa, ob = _pair_channels(dh, T_INTERLEAVED, T_ROT_HALF, HALF_T)
    o_ptr = out_ptr + layer * o_l + b * o_b + head_h[None, :] * o_h + offs_t[:, None] * o_t
    om = t_mask[:, None] & (head_h < Ht)[None, :]
    tl.store(o_ptr + oa[None, :], y1.to(out_ptr.dtype.element_ty), mask=om)
    tl.store(o_ptr + ob[None, :], y2.to(out_ptr.dtype.element_ty), mask=om)


def _configs():
    import triton

    return [
        triton.Config({"BLOCK_T": bt, "BLOCK_S": bs}, num_warps=nw, num_stages=ns)
        for bt, bs, nw, ns in (
            (64, 32, 4, 2),
            (64, 32, 8, 2),
            (128, 32, 8, 2),
            (32, 32, 4, 2),
            (128, 16, 8, 2),
            (64, 16, 4, 2),
            (128, 64, 8, 2),  # the keys' choice at the shipped bridges' shapes (H200, 2026-12-07)
        )  # fmt: skip
    ]


def _prune(configs, named_args, **kwargs):
    """Drop chunk widths wider than half the source head dim (all masked work)."""
    half_s = named_args.get("HALF_S", kwargs.get("HALF_S", 64))
    kept = [c for c in configs if c.kwargs["BLOCK_S"] <= half_s]
    return kept or configs[:1]


_KERNEL = LazyKernel(
    _affine_kernel, _configs, key=["T_KEY", "HALF_S", "HALF_T", "HB", "SRC_ROPE", "Ht", "n"], prune=_prune,
    helpers=HELPERS,
    # token counts (and the rows' batch stride, = T) vary per context: one compiled variant for all
    do_not_specialize=["T", "r_b"],
)  # fmt: skip

# Interpreter blocks: small, so odd token counts span several blocks and head dims several chunks.
_INTERPRET_CONFIG = {"BLOCK_T": 16, "BLOCK_S": 16}
# Output columns per program: one accumulator of [BLOCK_T, _TILE_N] float32.
_TILE_N = 128


def triton_supports(src_dim: int, tgt_dim: int) -> bool:
    """The kernel's head dims: powers of two, source >= 32, target >= 32 (tensor-core tiles)."""
    return all(d >= 32 and d & (d - 1) == 0 for d in (src_dim, tgt_dim))


APPLY_KERNELS = ("auto", "tiled", "persistent")


def launch_affine(
    view: SourceView,
    rows: torch.Tensor,
    heads: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    src_cos: torch.Tensor | None,
    src_sin: torch.Tensor | None,
    tgt_cos: torch.Tensor | None,
    tgt_sin: torch.Tensor | None,
    out: torch.Tensor,
    kernel: str = "auto",
    src_rotary=None,
    tgt_rotary=None,
) -> None:
    """Run a Triton kernel, writing every element of `out`; arguments as in `gathered_affine`,
    with the source layers as a SourceView. kernel (APPLY_KERNELS): "auto" (the module
    docstring's rule), "tiled" (any call) or "persistent" (calls with one input slot per head).
    A tiled program computes _TILE_N output columns: one head's (or, when all heads share their
    inputs, several heads') matching blocks of both rope halves."""
    src = view.base
    bsz, hs, _, ds = src.shape
    n_layers, n_heads, n = heads.shape
    dt = out.shape[-1]
    t = rows.shape[1]
    if kernel not in APPLY_KERNELS:
        raise ValueError(f"kernel must be one of {APPLY_KERNELS}, got {kernel!r}")
    persistent = supports_persistent(ds, dt, n)
    if kernel == "persistent" and not persistent:
        raise ValueError(f"the persistent kernel takes one input slot and source dims 32..256, got {n}, {ds}")
    if kernel != "tiled" and persistent:
        tables = (src_cos, src_sin, tgt_cos, tgt_sin)
        launch_persistent(view, rows, heads, weight, bias, *tables, out, src_rotary, tgt_rotary)
        return
    heads_per_program = 1
    if heads.stride(1) == 0:  # shared inputs: put several heads in one tile
        while heads_per_program * 2 <= min(n_heads, _TILE_N // dt):
            heads_per_program *= 2
    half_cols = min(dt // 2, _TILE_N // (2 * heads_per_program))
    src_rope, tgt_rope = src_cos is not None, tgt_cos is not None
    sc, ss = (src_cos, src_sin) if src_rope else (src, src)
    tc, ts = (tgt_cos, tgt_sin) if tgt_rope else (out, out)
    args = (
        src, view.offsets, *src.stride()[:3],
        rows, *rows.stride(),
        heads, *heads.stride(),
        weight, *weight.stride(),
        bias, *bias.stride()[:2],
        sc, ss, *(src_cos.stride()[:4] if src_rope else (0, 0, 0, 0)),
        tc, ts, *(tgt_cos.stride()[:3] if tgt_rope else (0, 0, 0)),
        out, *out.stride()[:4],
        t, next_pow2(t), n_heads, n, hs,
    )  # fmt: skip
    meta = dict(
        HALF_S=ds // 2, HALF_T=dt // 2, HB=heads_per_program, BH=half_cols, SRC_ROPE=src_rope,
        SHARED_TABLE=src_rope and _one_table(src_cos), TGT_ROPE=tgt_rope,
        ALIGNED=view.aligned and all(st % 16 == 0 for st in src.stride()[:3]),
        PRECISION="tf32" if out.dtype == torch.bfloat16 else "tf32x3", OUT_BF16=out.dtype == torch.bfloat16,
    )  # fmt: skip
    meta.update(layout_meta(src_rotary if src_rope else None, tgt_rotary if tgt_rope else None, ds, dt))
    programs_per_layer = -(-n_heads // heads_per_program) * (dt // 2 // half_cols)

    def grid(cfg):
        return (n_layers * programs_per_layer, bsz * -(-t // cfg["BLOCK_T"]))

    with device_of(src):
        if src.device.type != "cuda" or interpreting():
            _KERNEL[grid](*args, **meta, **_INTERPRET_CONFIG)
        else:
            # The autotuner runs once per shape bucket; later launches skip its per-call work.
            key = (src.device, src.dtype, out.dtype, next_pow2(t), n_heads, n, *meta.values())
            config = _RESOLVED.get(key)
            if config is None:
                tuner = _KERNEL.autotuned
                tuner[grid](*args, **meta)
                _RESOLVED[key] = _launch_options(tuner.best_config)
            else:
                _KERNEL[grid](*args, **meta, **config)


def _one_table(src_cos: torch.Tensor) -> bool:
    """Whether every source layer and head of [B, Ls, Hs, S, Ds] tables reads one table."""
    return all(src_cos.stride(i) == 0 or src_cos.shape[i] == 1 for i in (1, 2))


# Launch options chosen by the autotuner, per (device, dtypes, autotune key, constexprs): state of
# the launcher, read by no one else.
_RESOLVED: dict[tuple, dict] = {}


def _launch_options(config) -> dict:
    """A triton.Config as keyword arguments of a plain launch."""
    options = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    if getattr(config, "num_ctas", 1) != 1:
        options["num_ctas"] = config.num_ctas
    if getattr(config, "maxnreg", None) is not None:
        options["maxnreg"] = config.maxnreg
    return options


# ----------------------------------------------------------------------------------------------
# The operator: torch.library registration and dispatch

_SCHEMA = (
    "(Tensor[] src, Tensor rows, Tensor heads, Tensor weight, Tensor bias, Tensor? src_cos, Tensor? src_sin, "
    "Tensor? tgt_cos, Tensor? tgt_sin, str backend, str src_kind, int src_rotary_dim, str tgt_kind, "
    "int tgt_rotary_dim, Tensor(a!) out) -> ()"
)


@torch.library.custom_op("bridgecache::gathered_affine", mutates_args=("out",), schema=_SCHEMA)
def _gathered_affine_op(
    src: list[torch.Tensor], rows: torch.Tensor, heads: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor, src_cos: torch.Tensor | None, src_sin: torch.Tensor | None,
    tgt_cos: torch.Tensor | None, tgt_sin: torch.Tensor | None, backend: str, src_kind: str,
    src_rotary_dim: int, tgt_kind: str, tgt_rotary_dim: int, out: torch.Tensor,
) -> None:  # fmt: skip
    _run_affine(src, rows, heads, weight, bias, src_cos, src_sin, tgt_cos, tgt_sin, backend,
                src_kind, src_rotary_dim, tgt_kind, tgt_rotary_dim, out)  # fmt: skip


def _run_affine(src, rows, heads, weight, bias, src_cos, src_sin, tgt_cos, tgt_sin, backend,
                src_kind, src_rotary_dim, tgt_kind, tgt_rotary_dim, out) -> None:  # fmt: skip
    """The operator's body; eager callers run it directly (no dispatcher on the hot path)."""
    layouts = dict(src_rotary=(src_kind, src_rotary_dim), tgt_rotary=(tgt_kind, tgt_rotary_dim))
    if backend == "torch":
        affine_reference(src, rows, heads, weight, bias, src_cos, src_sin, tgt_cos, tgt_sin, out, **layouts)
        return
    if len({t.stride() for t in src}) > 1:  # the kernel addresses every layer with one set of strides
        src = [t.contiguous() for t in src]
    view = source_view(src)
    launch_affine(view, rows, heads, weight, bias, src_cos, src_sin, tgt_cos, tgt_sin, out, **layouts)


@_gathered_affine_op.register_fake
def _(src, rows, heads, weight, bias, src_cos, src_sin, tgt_cos, tgt_sin, backend,
      src_kind, src_rotary_dim, tgt_kind, tgt_rotary_dim, out):  # fmt: skip
    return None


def gathered_affine(
    src: Sequence[torch.Tensor],
    rows: torch.Tensor,
    heads: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    src_cos: torch.Tensor | None,
    src_sin: torch.Tensor | None,
    tgt_cos: torch.Tensor | None,
    tgt_sin: torch.Tensor | None,
    out: torch.Tensor,
    backend: str | None = None,
    src_rotary: tuple[str, int] | None = None,
    tgt_rotary: tuple[str, int] | None = None,
) -> torch.Tensor:
    """Checked core of map_heads / map_layers / map_fullhead; writes and returns `out`.

    src: Ls tensors [B, Hs, S, Ds] float32/bfloat16/float16, one shape, dtype and device
        (virtual source head v = layer * Hs + head; any strides, last axis made contiguous).
    rows: [B, T] int64, source row per target position, -1 for none (output row zero).
    heads: [Lt, Ht, n] int64 virtual source heads per input slot (stride 0 over Ht: shared).
    weight: [Lt, Ht, n*Ds, Dt] float32, any strides; the Triton path reads it input-axis-contiguous
        (`w.transpose(-1, -2).contiguous().transpose(-1, -2)`) and copies other layouts to that.
    bias: [Lt, Ht, Dt] float32.
    src_cos, src_sin: [B, Ls, Hs, S, Ds] float32 (stride 0 where shared) or both None.
    tgt_cos, tgt_sin: [Lt, B, T, Dt] float32 (stride 0 where shared) or both None.
    out: [Lt, B, Ht, T, Dt] float32/bfloat16/float16, last axis contiguous.
    backend: "triton" | "torch" | None (see bridgecache.kernels._dispatch.resolve_backend).
    src_rotary, tgt_rotary: (kind "half" | "interleaved", rotary_dim) of each side's keys
        (kernels.rotary); None: the half-split over the whole head. Read where a side has tables.
    """
    src = [last_contiguous(t) for t in src]
    bsz, hs, s, ds = src[0].shape
    n_layers, n_heads, n = heads.shape
    t = rows.shape[1]
    dt = out.shape[-1]
    expect(rows, (bsz, t), (torch.int64,), "rows")
    expect(heads, (n_layers, n_heads, n), (torch.int64,), "heads")
    expect(weight, (n_layers, n_heads, n * ds, dt), (torch.float32,), "weight")
    expect(bias, (n_layers, n_heads, dt), (torch.float32,), "bias")
    expect(out, (n_layers, bsz, n_heads, t, dt), FLOATS, "out")
    if ds % 2 or dt % 2:
        raise ValueError(f"head dims must be even (rotate_half), got {ds} and {dt}")
    src_rotary = check_layout(src_rotary, ds, "src_rotary")
    tgt_rotary = check_layout(tgt_rotary, dt, "tgt_rotary")
    if (src_cos is None) != (src_sin is None) or (tgt_cos is None) != (tgt_sin is None):
        raise ValueError("pass cos and sin together")
    if src_cos is not None:
        for name, tab in (("src_cos", src_cos), ("src_sin", src_sin)):
            expect(tab, (bsz, len(src), hs, s, ds), (torch.float32,), name)
        src_cos, src_sin = last_contiguous(src_cos), last_contiguous(src_sin)
        if src_cos.stride() != src_sin.stride():
            src_cos, src_sin = src_cos.contiguous(), src_sin.contiguous()
    if tgt_cos is not None:
        for name, tab in (("tgt_cos", tgt_cos), ("tgt_sin", tgt_sin)):
            expect(tab, (n_layers, bsz, t, dt), (torch.float32,), name)
        tgt_cos, tgt_sin = last_contiguous(tgt_cos), last_contiguous(tgt_sin)
        if tgt_cos.stride() != tgt_sin.stride():
            tgt_cos, tgt_sin = tgt_cos.contiguous(), tgt_sin.contiguous()
    if out.stride(-1) != 1:
        raise ValueError("out's last axis must be contiguous")
    for x in (*src, rows, heads, weight, bias, out):
        if x.device != out.device:
            raise ValueError(f"all tensors must be on one device; got {x.device} and {out.device}")
    if out.numel() == 0:
        return out
    if s == 0:  # no source rows: every target row is NATIVE
        return out.zero_()
    choice = resolve_backend(backend, out.device)
    if choice == "triton" and not triton_supports(ds, dt):
        if backend == "triton":
            raise ValueError(f"the Triton kernel needs power-of-two head dims >= 32, got {ds} -> {dt}")
        choice = "torch"
    if choice == "triton" and weight.stride(-2) != 1:  # the kernel reads W input-axis-contiguous
        weight = weight.transpose(-1, -2).contiguous().transpose(-1, -2)
    # The custom op is what torch.compile / export (and fake tensors) trace; eager calls skip its dispatch.
    traced = torch.compiler.is_compiling() or is_fake(out)
    run = _gathered_affine_op if traced else _run_affine
    run(src, rows, heads, weight, last_contiguous(bias), src_cos, src_sin, tgt_cos, tgt_sin, choice,
        *src_rotary, *tgt_rotary, out)  # fmt: skip
    return out
