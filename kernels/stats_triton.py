"""The Triton kernel of bridgecache.kernels.stats: weighted Gram tiles of [X | Y] per head.

Tiles the Gram matrix of [X | Y] per head (upper triangle of X^T X, and X^T Y), gathering and
un-rotating each X chunk on the fly (kernels.rotary's helper, the apply kernels' too); token
blocks are split across programs, which add their partial sums with float64 atomics.
`launch_stats` is what `accumulate_stats` calls on CUDA (and in the interpreter); the function
computed is stats.py's.

Knows nothing about models, layers, bridges or how the statistics are solved.
"""

from __future__ import annotations

import torch

from ._dispatch import LazyKernel, device_of, interpreting, next_pow2, sm_count, source_view
from .rotary import HELPERS, _gather_unrotated, _pair_channels, _scaled_table, layout_constants

tl = None  # triton.language, bound when the kernel is first compiled (see _dispatch.LazyKernel)

__all__ = ["launch_stats"]


def _chunk(k, HALF_S: tl.constexpr, C: tl.constexpr, NC: tl.constexpr, INTERLEAVED: tl.constexpr,
           ROT_HALF: tl.constexpr):  # fmt: skip
    """X chunk k = (input slot, block c of its 2 * HALF_S dims): (slot, dims within the slot's
    head [C], their columns in [0, p), valid dims). Dims are in pair order (d < HALF_S: channel a
    of pair d, else channel b of pair d - HALF_S; kernels.rotary), columns in channel order."""
    slot = k // NC
    d = (k % NC) * C + tl.arange(0, C)
    a, b = _pair_channels(d % HALF_S, INTERLEAVED, ROT_HALF, HALF_S)
    return slot, d, slot * 2 * HALF_S + tl.where(d < HALF_S, a, b), d < 2 * HALF_S


def _x_chunk(
    src_ptr, lay_off_ptr, s_b, s_h, s_s, heads_ptr, hd_h, hd_j,
    sc_ptr, ss_ptr, sc_b, sc_l, sc_h, sc_s,
    h, k, b, row, ok, HS,
    HALF_S: tl.constexpr, C: tl.constexpr, NC: tl.constexpr, SRC_ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr, ROT_HALF: tl.constexpr,
):  # fmt: skip
    """Un-rotated X chunk k of head h at source rows `row` [BLOCK_T]: float32 [BLOCK_T, C], 0
    where not ok. A chunk may span both channels of a pair: each dim reads the whole pair."""
    slot, d, _, dm = _chunk(k, HALF_S, C, NC, INTERLEAVED, ROT_HALF)
    v = tl.load(heads_ptr + h * hd_h + slot * hd_j)
    lay = v // HS
    hd = v % HS
    x_row = src_ptr + tl.load(lay_off_ptr + lay) + b * s_b + hd * s_h + row * s_s
    m = ok[:, None] & dm[None, :]
    pair = d % HALF_S
    if SRC_ROPE:
        t_off = b * sc_b + lay * sc_l + hd * sc_h + row[:, None] * sc_s + pair[None, :]
        cs, sn = _scaled_table(sc_ptr, ss_ptr, t_off, m)
    else:
        cs = 0.0
        sn = 0.0
    u1, u2 = _gather_unrotated(x_row, pair, m, cs, sn, SRC_ROPE, INTERLEAVED, ROT_HALF, HALF_S)
    return tl.where((d < HALF_S)[None, :], u1, u2)


def _stats_kernel(
    src_ptr, lay_off_ptr, s_b, s_h, s_s,
    rows_ptr, r_b, r_t,
    heads_ptr, hd_h, hd_j,
    y_ptr, y_b, y_h, y_t,
    w_ptr, w_b, w_h, w_t,
    sc_ptr, ss_ptr, sc_b, sc_l, sc_h, sc_s,
    tiles_ptr,
    xtx_ptr, xty_ptr, sx_ptr, sy_ptr, syy_ptr, sw_ptr,
    T, HS, P, DT, NXC, n_blocks, blocks_per_split,
    HALF_S: tl.constexpr, C: tl.constexpr, NC: tl.constexpr, SRC_ROPE: tl.constexpr, HAS_W: tl.constexpr,
    ATOMIC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr,
    INTERLEAVED: tl.constexpr, ROT_HALF: tl.constexpr,
):  # fmt: skip
    # tile = (i, j, h): X chunk i against X chunk j >= i, or against Y chunk j - NXC, of head h
    tile = tl.program_id(0)
    i = tl.load(tiles_ptr + 3 * tile)
    j = tl.load(tiles_ptr + 3 * tile + 1)
    h = tl.load(tiles_ptr + 3 * tile + 2).to(tl.int64)
    is_y = j >= NXC
    jx = tl.where(is_y, 0, j)
    dy = (j - NXC) * C + tl.arange(0, C)
    n_tb = tl.cdiv(T, BLOCK_T)
    q0 = tl.program_id(1) * blocks_per_split
    q1 = tl.minimum(q0 + blocks_per_split, n_blocks)

    acc = tl.zeros([C, C], dtype=tl.float32)
    sum_xi = tl.zeros([C], dtype=tl.float32)
    sum_yj = tl.zeros([C], dtype=tl.float32)
    sum_yyj = tl.zeros([C], dtype=tl.float32)
    sum_w = tl.zeros([BLOCK_T], dtype=tl.float32)
    for q in range(q0, q1):
        b = (q // n_tb).to(tl.int64)
        offs_t = (q % n_tb) * BLOCK_T + tl.arange(0, BLOCK_T)
        row = tl.load(rows_ptr + b * r_b + offs_t * r_t, mask=offs_t < T, other=-1)
        ok = row >= 0
        row = tl.where(ok, row, 0).to(tl.int64)
        if HAS_W:
            w = tl.load(w_ptr + b * w_b + h * w_h + offs_t * w_t, mask=ok, other=0.0).to(tl.float32)
        else:
            w = ok.to(tl.float32)
        xi = _x_chunk(src_ptr, lay_off_ptr, s_b, s_h, s_s, heads_ptr, hd_h, hd_j,
                      sc_ptr, ss_ptr, sc_b, sc_l, sc_h, sc_s, h, i, b, row, ok, HS,
                      HALF_S, C, NC, SRC_ROPE, INTERLEAVED, ROT_HALF)  # fmt: skip
        if is_y:
            m = ok[:, None] & (dy < DT)[None, :]
            xj = tl.load(y_ptr + b * y_b + h * y_h + offs_t[:, None] * y_t + dy[None, :], mask=m, other=0.0)
            xj = xj.to(tl.float32)
        elif jx == i:  # a diagonal tile: one gather serves both sides
            xj = xi
        else:
            xj = _x_chunk(src_ptr, lay_off_ptr, s_b, s_h, s_s, heads_ptr, hd_h, hd_j,
                          sc_ptr, ss_ptr, sc_b, sc_l, sc_h, sc_s, h, jx, b, row, ok, HS,
                          HALF_S, C, NC, SRC_ROPE, INTERLEAVED, ROT_HALF)  # fmt: skip
        xw = xi * w[:, None]
        if PRECISION == "bf16" and INTERPRET:  # the interpreter's bf16 dot is wrong: round, then dot
            a = tl.trans(xw.to(tl.bfloat16).to(tl.float32))
            acc = tl.dot(a, xj.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
        elif PRECISION == "bf16":  # bfloat16 operands (8 bits of mantissa), float32 sums
            acc = tl.dot(tl.trans(xw.to(tl.bfloat16)), xj.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(tl.trans(xw), xj, acc, input_precision=PRECISION)
        sum_xi += tl.sum(xw, axis=0)
        yw = xj * w[:, None]
        sum_yj += tl.sum(yw, axis=0)
        sum_yyj += tl.sum(yw * xj, axis=0)
        sum_w += w

    buf = xtx_ptr.dtype.element_ty
    _, _, cols_i, mi = _chunk(i, HALF_S, C, NC, INTERLEAVED, ROT_HALF)
    if is_y:
        my = dy < DT
        _add(
            xty_ptr + h * P * DT + cols_i[:, None] * DT + dy[None, :],
            acc.to(buf),
            mi[:, None] & my[None, :],
            ATOMIC,
        )
        if i == 0:
            _add(sy_ptr + h * DT + dy, sum_yj.to(buf), my, ATOMIC)
            _add(syy_ptr + h * DT + dy, sum_yyj.to(buf), my, ATOMIC)
    else:
        _, _, cols_j, mj = _chunk(jx, HALF_S, C, NC, INTERLEAVED, ROT_HALF)
        m2 = mi[:, None] & mj[None, :]
        _add(xtx_ptr + h * P * P + cols_i[:, None] * P + cols_j[None, :], acc.to(buf), m2, ATOMIC)
        if j != i:  # mirror into the lower triangle
            _add(xtx_ptr + h * P * P + cols_j[None, :] * P + cols_i[:, None], acc.to(buf), m2, ATOMIC)
        else:
            _add(sx_ptr + h * P + cols_i, sum_xi.to(buf), mi, ATOMIC)
            if i == 0:
                total = tl.sum(sum_w, axis=0).to(buf)
                if ATOMIC:
                    tl.atomic_add(sw_ptr + h, total, sem="relaxed")
                else:
                    tl.store(sw_ptr + h, tl.load(sw_ptr + h) + total)


def _add(ptr, val, mask, ATOMIC: tl.constexpr):
    """*ptr += val: a relaxed atomic when several programs add to one element, else load + store."""
    if ATOMIC:
        tl.atomic_add(ptr, val, mask=mask, sem="relaxed")
    else:
        tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + val, mask=mask)


_KERNEL = LazyKernel(_stats_kernel, helpers=(*HELPERS, _chunk, _x_chunk, _add))
_BLOCK_T = 64
_CHUNK = 128  # Gram tile edge on CUDA: whole heads up to 128 dims
_INTERPRET_BLOCK_T = 16
_INTERPRET_CHUNK = 32
# Default token splits per tile: about 2 programs per SM, each at least 8 token blocks.
_SPLIT_POLICY = (2, 8)


def _tiles(nxc: int, nyc: int, g: int, n_heads: int, device) -> torch.Tensor:
    """int32 [P, 3] (i, j, h): X-X tiles j >= i for g heads, X-Y tiles for every head."""
    out = [(i, j, h) for h in range(g) for i in range(nxc) for j in range(i, nxc)]
    out += [(i, nxc + j, h) for h in range(n_heads) for i in range(nxc) for j in range(nyc)]
    return torch.tensor(out, dtype=torch.int32).to(device, non_blocking=True)


_TILES_CACHE: dict[tuple, torch.Tensor] = {}


def launch_stats(layers, rows, heads, y, weights, src_cos, src_sin, bufs,
                 splits: int | tuple[int, int] | None = None, precision: str = "tf32x3",
                 tile: int | None = None, src_rotary=None) -> None:  # fmt: skip
    """Run the Triton kernel; arguments as the operator's (src_rotary: (kind, rotary_dim) or
    None). splits: programs per tile along the tokens, or a policy (programs per SM, fewest token
    blocks per program) that picks them (None: (2, 8)); > 1 makes them add with atomics.
    precision: see PRECISIONS. tile: edge of the Gram tiles, a power of two >= 16 (None: the head
    dim up to 128; 32 in the interpreter)."""
    xtx = bufs[0]
    view = source_view(layers)
    src = view.base
    bsz, hs, _, ds = src.shape
    n_heads, n = heads.shape
    t, dt = rows.shape[1], y.shape[-1]
    half_s = ds // 2
    interp = src.device.type != "cuda" or interpreting()
    # [C, C] tiles of the Gram matrix: whole heads up to 128 dims (one gather and un-rotation of X
    # per tile row); in the interpreter at most 32, so tiles also split a head at its rope halves
    c = min(next_pow2(max(ds, 16)), tile or (_INTERPRET_CHUNK if interp else _CHUNK))
    nc = -(-ds // c)
    nxc, nyc = n * nc, -(-dt // c)
    g = xtx.shape[0]
    key = (nxc, nyc, g, n_heads, xtx.device)
    if key not in _TILES_CACHE:
        _TILES_CACHE[key] = _tiles(nxc, nyc, g, n_heads, xtx.device)
    tiles = _TILES_CACHE[key]
    block_t = _INTERPRET_BLOCK_T if interp else _BLOCK_T
    n_blocks = bsz * -(-t // block_t)
    if not isinstance(splits, int):  # programs per SM, each at least a few token blocks (its atomic adds)
        per_sm, fewest = splits or _SPLIT_POLICY
        sms = 1 if interp else sm_count(src.device)
        splits = max(1, min(-(-per_sm * sms // tiles.shape[0]), n_blocks // fewest))
    per_split = -(-n_blocks // splits)
    splits = -(-n_blocks // per_split)
    src_rope, has_w = src_cos is not None, weights is not None
    sc, ss = (src_cos, src_sin) if src_rope else (src, src)
    interleaved, rot_half = layout_constants(src_rotary if src_rope else None, ds)
    wt = weights if has_w else rows
    args = (
        src, view.offsets, *src.stride()[:3],
        rows, *rows.stride(),
        heads, *heads.stride(),
        y, *y.stride()[:3],
        wt, *(weights.stride() if has_w else (0, 0, 0)),
        sc, ss, *(src_cos.stride()[:4] if src_rope else (0, 0, 0, 0)),
        tiles, *bufs,
        t, hs, n * ds, dt, nxc, n_blocks, per_split,
    )  # fmt: skip
    with device_of(src):
        _KERNEL[(tiles.shape[0], splits)](
            *args, HALF_S=half_s, C=c, NC=nc, SRC_ROPE=src_rope, HAS_W=has_w, ATOMIC=splits > 1,
            PRECISION=precision, BLOCK_T=block_t, INTERPRET=interp, INTERLEAVED=interleaved,
            ROT_HALF=rot_half, num_warps=8 if c >= 128 else 4,
        )  # fmt: skip
