"""Weighted sufficient statistics of per-head ridge fits, accumulated without materialising X.

For target head h the regression rows are (x, y, w) over the target positions t of a chunk:
x = concat_j unrotate(src[v_j][b, rows[b, t]]) [p = n*Ds] (v_j = heads[h, j], as in map_heads; RoPE
on the pairs of the source's rotary layout, kernels.rotary),
y = y[b, h, t] [Dt] (targets, already un-rotated), w = weights[b, h, t] (1 when None), and
positions with rows == -1 are skipped. `accumulate_stats` adds, in place,

    xtx[g]  += sum w x x^T  [p, p]      sum_x[g] += sum w x  [p]      sum_w[g] += sum w
    xty[h]  += sum w x y^T  [p, Dt]     sum_y[h] += sum w y  [Dt]     sum_yy[h] += sum w y*y  [Dt]

g = h, or g = 0 for every head when the statistics are `shared` (full-head, unweighted: all
heads read the same x, so one Gram matrix serves the layer). Buffers are float64 (or float32);
each call forms its products in float32 (the Triton kernel: 3xTF32 dots, about float32) and adds
them to the buffers, so long streams keep float64 totals.

The Triton kernel tiles the Gram matrix of [X | Y] per head (upper triangle of X^T X, and X^T Y),
gathering and un-rotating each X chunk on the fly; token blocks are split across programs, which
add their partial sums with float64 atomics (order-dependent at float64 rounding only). Its
PyTorch reference is `reference.stats_reference`.

Knows nothing about models, layers, bridges or how the statistics are solved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch._subclasses.fake_tensor import is_fake

from ._dispatch import resolve_backend
from .reference import source_tables, stats_reference
from .rotary import check_layout
from .stats_triton import launch_stats

tl = None  # triton.language, bound when the kernel is first compiled (see _dispatch.LazyKernel)

__all__ = ["PRECISIONS", "SufficientStats", "accumulate_stats", "stats_reference"]

# The Triton kernel's dot products: 3xTF32 (about float32; the default), TF32 (10-bit mantissas),
# bfloat16 operands (8-bit mantissas); all sum in float32 and add to the float32/64 buffers.
PRECISIONS = ("tf32x3", "tf32", "bf16")


@dataclass
class SufficientStats:
    """Running weighted moments of one target layer's K (or V) maps; see the module docstring.

    xtx [G, p, p], sum_x [G, p], sum_w [G]: moments of the inputs (G = 1 if shared, else Ht);
    xty [Ht, p, Dt], sum_y [Ht, Dt], sum_yy [Ht, Dt]: moments involving the targets.
    All float64 (or all float32), contiguous, on one device.
    """

    xtx: torch.Tensor
    xty: torch.Tensor
    sum_x: torch.Tensor
    sum_y: torch.Tensor
    sum_yy: torch.Tensor
    sum_w: torch.Tensor

    @classmethod
    def zeros(
        cls,
        tgt_heads: int,
        in_dim: int,
        tgt_dim: int,
        *,
        shared: bool = False,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> SufficientStats:
        """Empty statistics for `tgt_heads` heads with inputs [in_dim] (= n*Ds) and targets [tgt_dim]."""
        g = 1 if shared else tgt_heads

        def z(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            z(g, in_dim, in_dim), z(tgt_heads, in_dim, tgt_dim), z(g, in_dim),
            z(tgt_heads, tgt_dim), z(tgt_heads, tgt_dim), z(g),
        )  # fmt: skip

    @property
    def shared(self) -> bool:
        return self.xtx.shape[0] == 1 and self.xty.shape[0] > 1

    def update(
        self,
        src: torch.Tensor | Sequence[torch.Tensor],
        rows: torch.Tensor,
        heads: torch.Tensor,
        y: torch.Tensor,
        weights: torch.Tensor | None = None,
        src_cos: torch.Tensor | None = None,
        src_sin: torch.Tensor | None = None,
        *,
        backend: str | None = None,
        precision: str = "tf32x3",
        src_rotary: tuple[str, int] | None = None,
    ) -> SufficientStats:
        """Add one chunk of rows (see `accumulate_stats`); returns self."""
        accumulate_stats(
            self, src, rows, heads, y, weights, src_cos, src_sin, backend=backend, precision=precision,
            src_rotary=src_rotary,
        )  # fmt: skip
        return self


def accumulate_stats(
    stats: SufficientStats,
    src: torch.Tensor | Sequence[torch.Tensor],
    rows: torch.Tensor,
    heads: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor | None = None,
    src_cos: torch.Tensor | None = None,
    src_sin: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    precision: str = "tf32x3",
    src_rotary: tuple[str, int] | None = None,
) -> None:
    """Add the regression rows of one chunk to `stats`, in place.

    Args:
        stats: buffers for Ht heads, p = n*Ds inputs, Dt targets (float64 or float32).
        src: [B, Hs, S, Ds] float32/bfloat16/float16 source K or V as cached, or a list of such
            layers stacked on the head axis without a copy (as in map_heads).
        rows: [B, T] int64: source token of each row; -1: skip the row.
        heads: [Ht, n] int64: (stacked) source heads forming x of head h, in input order. With
            shared statistics every row of `heads` must be the same.
        y: [B, Ht, T, Dt] float32/bfloat16/float16, any strides: the targets (keys un-rotated).
        weights: [B, Ht, T] floating, or None (all ones); shared statistics need None.
        src_cos, src_sin: [B, Hs_total, S, Ds] or [B, S, Ds] float32 to un-rotate source keys;
            None for values.
        backend: "triton" | "torch" | None (auto: Triton on CUDA).
        precision: the Triton kernel's products (PRECISIONS): "tf32x3" (default, about float32),
            "tf32" or "bf16" (faster, coarser: benchmarks/reports/gpu-kernels.md has the accuracy
            table). The PyTorch reference always forms float32 products.
        src_rotary: the source keys' rotary layout (kind "half" | "interleaved", rotary_dim),
            kernels.rotary; None: the half-split over the whole head.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    layers = [src] if isinstance(src, torch.Tensor) else list(src)
    bsz, hs, s, ds = layers[0].shape
    n_heads, n = heads.shape
    t = rows.shape[1]
    dt = y.shape[-1]
    p = n * ds
    g = stats.xtx.shape[0]
    shapes = {
        "xtx": (g, p, p), "xty": (n_heads, p, dt), "sum_x": (g, p),
        "sum_y": (n_heads, dt), "sum_yy": (n_heads, dt), "sum_w": (g,),
    }  # fmt: skip
    for name, shape in shapes.items():
        buf = getattr(stats, name)
        if tuple(buf.shape) != shape or buf.dtype != stats.xtx.dtype or not buf.is_contiguous():
            raise ValueError(
                f"stats.{name}: expected contiguous {shape} {stats.xtx.dtype}, got {tuple(buf.shape)}"
            )
    if g not in (1, n_heads) or stats.xtx.dtype not in (torch.float64, torch.float32):
        raise ValueError("stats must be float64 or float32 with G = 1 (shared) or G = Ht")
    if g == 1 and n_heads > 1 and weights is not None:
        raise ValueError("shared statistics hold one Gram matrix: per-head weights need per-head statistics")
    if tuple(rows.shape) != (bsz, t) or rows.dtype != torch.int64:
        raise ValueError(f"rows: expected int64 {(bsz, t)}, got {rows.dtype} {tuple(rows.shape)}")
    if tuple(y.shape) != (bsz, n_heads, t, dt):
        raise ValueError(f"y: expected {(bsz, n_heads, t, dt)}, got {tuple(y.shape)}")
    if weights is not None and tuple(weights.shape) != (bsz, n_heads, t):
        raise ValueError(f"weights: expected {(bsz, n_heads, t)}, got {tuple(weights.shape)}")
    if ds % 2:
        raise ValueError(f"source head dim must be even (rotate_half), got {ds}")
    src_kind, src_rotary_dim = check_layout(src_rotary, ds, "src_rotary")
    layers = [x if x.stride(-1) == 1 else x.contiguous() for x in layers]
    y = y if y.stride(-1) == 1 else y.contiguous()
    src_cos, src_sin = source_tables(src_cos, src_sin, bsz, len(layers), hs, s, ds)
    if src_cos is not None and (src_cos.stride() != src_sin.stride() or src_cos.stride(-1) != 1):
        src_cos, src_sin = src_cos.contiguous(), src_sin.contiguous()
    if rows.numel() == 0 or s == 0:
        return
    choice = resolve_backend(backend, stats.xtx.device)
    # The custom op is what torch.compile / export (and fake tensors) trace; eager calls skip its dispatch.
    traced = torch.compiler.is_compiling() or is_fake(stats.xtx)
    run = _stats_op if traced else _run_stats
    run(
        layers, rows, heads, y, weights, src_cos, src_sin, choice, precision, src_kind, src_rotary_dim,
        *(getattr(stats, f.name) for f in fields(stats)),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The operator

_SCHEMA = (
    "(Tensor[] src, Tensor rows, Tensor heads, Tensor y, Tensor? weights, Tensor? src_cos, Tensor? src_sin, "
    "str backend, str precision, str src_kind, int src_rotary_dim, Tensor(a!) xtx, Tensor(b!) xty, "
    "Tensor(c!) sum_x, Tensor(d!) sum_y, Tensor(e!) sum_yy, Tensor(f!) sum_w) -> ()"
)


@torch.library.custom_op(
    "bridgecache::accumulate_stats",
    mutates_args=("xtx", "xty", "sum_x", "sum_y", "sum_yy", "sum_w"),
    schema=_SCHEMA,
)
def _stats_op(
    src: list[torch.Tensor],
    rows: torch.Tensor,
    heads: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor | None,
    src_cos: torch.Tensor | None,
    src_sin: torch.Tensor | None,
    backend: str,
    precision: str,
    src_kind: str,
    src_rotary_dim: int,
    xtx: torch.Tensor,
    xty: torch.Tensor,
    sum_x: torch.Tensor,
    sum_y: torch.Tensor,
    sum_yy: torch.Tensor,
    sum_w: torch.Tensor,
) -> None:
    _run_stats(src, rows, heads, y, weights, src_cos, src_sin, backend, precision, src_kind, src_rotary_dim,
               xtx, xty, sum_x, sum_y, sum_yy, sum_w)  # fmt: skip


def _run_stats(src, rows, heads, y, weights, src_cos, src_sin, backend, precision, src_kind, src_rotary_dim,
               *bufs) -> None:  # fmt: skip
    """The operator's body; eager callers run it directly (no dispatcher on the hot path)."""
    rotary = (src_kind, src_rotary_dim)
    if backend == "torch":
        stats_reference(src, rows, heads, y, weights, src_cos, src_sin, *bufs, src_rotary=rotary)
        return
    if len({t.stride() for t in src}) > 1:
        src = [t.contiguous() for t in src]
    launch_stats(src, rows, heads, y, weights, src_cos, src_sin, bufs, precision=precision, src_rotary=rotary)


@_stats_op.register_fake
def _(src, rows, heads, y, weights, src_cos, src_sin, backend, precision, src_kind, src_rotary_dim,
      xtx, xty, sum_x, sum_y, sum_yy, sum_w):  # fmt: skip
    return None
