"""Rotary layouts in the kernels: which two channels of a head RoPE rotates together.

A layout is a plain `(kind, rotary_dim)` pair (bridgecache.models.layout.RotaryLayout is one;
None means ("half", head_dim)): kind "half" pairs channels (j, j + rotary_dim / 2) as Llama's
`rotate_half`, "interleaved" pairs (2j, 2j + 1) as Cohere's, GLM's and Helium's; channels from
rotary_dim on pass through. The kernels and their references work on pairs p in [0, D/2) of a
D-channel head: pair p is channels (a(p), b(p)); the rotated pairs come first (p < rotary_dim/2)
and the pass-through channels are paired among themselves (their tables hold cos 1, sin 0, so
one formula serves every pair). cos/sin tables are indexed by pair (their first D/2 columns):

    half, rotary_dim R:  a = p,  b = p + R/2        (p < R/2);   a = p + R/2,  b = p + D/2  (else)
    interleaved:         a = 2p, b = 2p + 1

    pair_channels        (a, b) as int64 tensors, for the PyTorch references
    layout_constants     the kernels' compile-time constants (INTERLEAVED, ROT_HALF) of a layout
    layout_meta          those of a source and a target layout, as the apply kernels name them
    _pair_channels       (a, b) inside a Triton kernel
    _gather_unrotated    the gather + un-rotation of source rows that every kernel shares

Knows tensors only.
"""

from __future__ import annotations

import torch

tl = None  # triton.language, bound when a kernel using these helpers is first compiled

__all__ = ["ROTARY_KINDS", "check_layout", "layout_constants", "layout_meta", "pair_channels"]

ROTARY_KINDS = ("half", "interleaved")


def check_layout(rotary, head_dim: int, name: str) -> tuple[str, int]:
    """`rotary` as a checked (kind, rotary_dim) pair for heads of `head_dim` channels; None is
    the half-split over the whole head. ValueError names the argument otherwise."""
    if rotary is None:
        return ("half", head_dim)
    try:
        kind, dim = rotary
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a (kind, rotary_dim) pair or None, got {rotary!r}") from None
    if kind not in ROTARY_KINDS or isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{name}: expected kind in {ROTARY_KINDS} and an int rotary_dim, got {rotary!r}")
    if dim % 2 or not 2 <= dim <= head_dim:
        raise ValueError(f"{name}: rotary_dim must be even and in [2, {head_dim}], got {dim}")
    return (kind, dim)


def layout_constants(rotary, head_dim: int) -> tuple[bool, int]:
    """(INTERLEAVED, ROT_HALF): the compile-time constants of a checked layout."""
    kind, dim = check_layout(rotary, head_dim, "rotary")
    return kind == "interleaved", dim // 2


def layout_meta(src_rotary, tgt_rotary, ds: int, dt: int) -> dict:
    """The apply kernels' layout constants (S_/T_INTERLEAVED, S_/T_ROT_HALF). A side without RoPE
    passes None: its pairing is immaterial, and the half-split over the whole head loads plainest."""
    s_interleaved, s_rot_half = layout_constants(src_rotary, ds)
    t_interleaved, t_rot_half = layout_constants(tgt_rotary, dt)
    return dict(
        S_INTERLEAVED=s_interleaved, S_ROT_HALF=s_rot_half, T_INTERLEAVED=t_interleaved, T_ROT_HALF=t_rot_half
    )


def pair_channels(rotary, head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b): int64 [head_dim / 2] channels of each pair (see the module docstring)."""
    interleaved, rot_half = layout_constants(rotary, head_dim)
    p = torch.arange(head_dim // 2, device=device)
    if interleaved:
        return 2 * p, 2 * p + 1
    rotated = p < rot_half
    return torch.where(rotated, p, p + rot_half), torch.where(rotated, p + rot_half, p + head_dim // 2)


def _pair_channels(p, INTERLEAVED: tl.constexpr, ROT_HALF: tl.constexpr, HALF: tl.constexpr):
    """(a, b): the channels of pairs p in a head of 2 * HALF channels."""
    if INTERLEAVED:
        a = 2 * p
        b = 2 * p + 1
    elif ROT_HALF == HALF:
        a = p
        b = p + HALF
    else:
        a = tl.where(p < ROT_HALF, p, p + ROT_HALF)
        b = tl.where(p < ROT_HALF, p + ROT_HALF, p + HALF)
    return a, b


def _gather_unrotated(x_row, p, m, cs, sn, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr,
                      ROT_HALF: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """Both channels of pairs p [C] at rows x_row [BLOCK_T] (pointers to each row's head), cast to
    float32 and, with ROPE, un-rotated by tables cs, sn [BLOCK_T, C] already divided by
    cos^2 + sin^2: (u1, u2) [BLOCK_T, C], 0 where not m. u1 = x1 c + x2 s, u2 = x2 c - x1 s."""
    a, b = _pair_channels(p, INTERLEAVED, ROT_HALF, HALF)
    x1 = tl.load(x_row[:, None] + a[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row[:, None] + b[None, :], mask=m, other=0.0).to(tl.float32)
    if ROPE:
        u1 = x1 * cs + x2 * sn
        u2 = x2 * cs - x1 * sn
    else:
        u1 = x1
        u2 = x2
    return u1, u2


def _scaled_table(c_ptr, s_ptr, offset, m):
    """cos, sin at `offset` (0 and 1 where not m), divided by cos^2 + sin^2: un-rotation is then
    exact for rope types that scale both tables (an attention factor)."""
    cs = tl.load(c_ptr + offset, mask=m, other=1.0)
    sn = tl.load(s_ptr + offset, mask=m, other=0.0)
    inv = 1.0 / (cs * cs + sn * sn)
    return cs * inv, sn * inv


HELPERS = (_pair_channels, _gather_unrotated, _scaled_table)
