"""The persistent apply kernel: `gathered_affine` for maps with one input slot per head (n = 1).

Computes exactly the function of `bridgecache.kernels.affine` (same arguments, same rope
convention, same arithmetic: float32 accumulation, TF32 dots for bfloat16 outputs, 3xTF32
otherwise); `affine.affine_reference` is its PyTorch reference. What differs is how the work is
laid out, after Nsight Compute showed the tiled kernel latency-bound (low occupancy, most of its
loads re-reads from L2 of the weights and rope tables; benchmarks/reports/gpu-kernels.md):

- A fixed grid of programs (a few per SM) walks a flat list of work items, item = (unit, token
  block) with unit = (target layer, head group, column block), each program a contiguous share.
  A program loads a unit's weight tile [Ds, 128 columns] and bias once and keeps them on chip
  while it streams that unit's token blocks; it reloads them only when its share crosses into the
  next unit (at most a few times per program). The tiled kernel re-read them per token block.
- The whole source head (both rope halves) is one K chunk: per token block, four dots of
  K = Ds/2 (each input half into each output half), so the output halves need no shuffles.
- The launch configuration (block, warps, programs per SM, software-pipelining stages of the
  token loop, optional register cap) is timed once per shape bucket and kept by the launcher
  (the times go to this module's logger at DEBUG level; the configurations that won on an H200
  are in benchmarks/reports/gpu-kernels.md).

Only one input slot per target head (n = 1: identity maps, head-local CacheBridge maps with
k = 1), and power-of-two head dims 32..256 (source) / >= 32 (target); `supports_persistent` says
which calls it takes, and affine.launch_affine routes every other call to the tiled kernel. A
unit's weights for n slots would be n times larger than what it keeps on chip, so full-head maps
(both shipped bridges: 8 and 12 inputs per head) and map_fullhead run the tiled kernel.

Knows nothing about models, bridges or which source heads feed which target head.
"""

from __future__ import annotations

import logging

import torch

from ._dispatch import LazyKernel, SourceView, device_of, interpreting, next_pow2, sm_count
from .rotary import HELPERS, _gather_unrotated, _pair_channels, _scaled_table, layout_meta

tl = None  # triton.language, bound when the kernel is first compiled (see _dispatch.LazyKernel)

__all__ = ["launch_persistent", "supports_persistent"]

_log = logging.getLogger(__name__)

# Output columns per unit: matching column blocks of both rope halves, [BLOCK_T, _TILE_N] float32.
_TILE_N = 128


def supports_persistent(src_dim: int, tgt_dim: int, n_inputs: int) -> bool:
    """The persistent kernel takes one input slot and a source head dim of 32..256 (one K chunk)."""
    return n_inputs == 1 and 32 <= src_dim <= 256


def _persistent_kernel(
    src_ptr, lay_off_ptr, s_b, s_h, s_s,
    rows_ptr, r_b, r_t,
    heads_ptr, hd_l, hd_h,
    w_ptr, w_l, w_h, w_k, w_n,
    bias_ptr, bi_l, bi_h,
    sc_ptr, ss_ptr, sc_b, sc_l, sc_h, sc_s,
    tc_ptr, ts_ptr, tc_l, tc_b, tc_t,
    out_ptr, o_l, o_b, o_h, o_t,
    T, Ht, HS, n_blocks, n_items,
    HALF_S: tl.constexpr, HALF_T: tl.constexpr, HB: tl.constexpr, BH: tl.constexpr,
    SRC_ROPE: tl.constexpr, TGT_ROPE: tl.constexpr, ALIGNED: tl.constexpr, PRECISION: tl.constexpr,
    OUT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, NUM_STAGES: tl.constexpr, PER_SM: tl.constexpr,
    INTERPRET: tl.constexpr, S_INTERLEAVED: tl.constexpr, S_ROT_HALF: tl.constexpr,
    T_INTERLEAVED: tl.constexpr, T_ROT_HALF: tl.constexpr,
):  # fmt: skip
    # This program's share of the items [start, stop); item = unit * n_blocks + token block.
    pid = tl.program_id(0).to(tl.int64)
    n_prog = tl.num_programs(0)
    start = pid * n_items // n_prog
    stop = (pid + 1) * n_items // n_prog
    n_cb = HALF_T // BH
    n_hg = tl.cdiv(Ht, HB)
    n_tb = tl.cdiv(T, BLOCK_T)
    offs_c = tl.arange(0, HALF_S)
    sa, sb = _pair_channels(offs_c, S_INTERLEAVED, S_ROT_HALF, HALF_S)  # the source pairs' channels
    # Column e of a half-accumulator [BLOCK_T, HB * BH] is channel a (first accumulator) or b
    # (second) of target pair cb * BH + e % BH of head hg * HB + e // BH (kernels.rotary): each
    # unit owns whole rope pairs, as two accumulators (no register shuffles between them).
    offs_h = tl.arange(0, HB * BH)
    item = start
    while item < stop:
        unit = item // n_blocks
        seg_stop = tl.minimum(stop, (unit + 1) * n_blocks)
        cb = unit % n_cb
        hg = (unit // n_cb) % n_hg
        layer = unit // (n_cb * n_hg)
        dh = cb * BH + offs_h % BH
        dh = tl.max_contiguous(tl.multiple_of(dh, BH), BH)
        head_h = hg * HB + offs_h // BH
        h_mask = head_h < Ht
        ta, tb = _pair_channels(dh, T_INTERLEAVED, T_ROT_HALF, HALF_T)  # the target pairs' channels
        # the unit's weights [source channels a, b] x [target channels a, b], kept on chip for all
        # of its token blocks in this program
        w_base = w_ptr + layer * w_l + head_h[None, :] * w_h
        w_lo = w_base + sa[:, None] * w_k
        w_hi = w_base + sb[:, None] * w_k
        w11 = tl.load(w_lo + ta[None, :] * w_n, mask=h_mask[None, :], other=0.0)
        w21 = tl.load(w_hi + ta[None, :] * w_n, mask=h_mask[None, :], other=0.0)
        w12 = tl.load(w_lo + tb[None, :] * w_n, mask=h_mask[None, :], other=0.0)
        w22 = tl.load(w_hi + tb[None, :] * w_n, mask=h_mask[None, :], other=0.0)
        b_ptr = bias_ptr + layer * bi_l + head_h * bi_h
        bias1 = tl.load(b_ptr + ta, mask=h_mask, other=0.0)
        bias2 = tl.load(b_ptr + tb, mask=h_mask, other=0.0)
        # the heads of a group read the same source head (HB > 1 only when shared)
        v = tl.load(heads_ptr + layer * hd_l + hg * HB * hd_h)
        lay = v // HS
        hd = v % HS
        src_head = tl.load(lay_off_ptr + lay) + hd * s_h
        for q in tl.range(item % n_blocks, item % n_blocks + (seg_stop - item), num_stages=NUM_STAGES):
            b = q // n_tb
            offs_t = (q % n_tb) * BLOCK_T + tl.arange(0, BLOCK_T)
            t_mask = offs_t < T
            row = tl.load(rows_ptr + b * r_b + offs_t * r_t, mask=t_mask, other=-1)
            valid = row >= 0
            row = tl.where(valid, row, 0).to(tl.int64)
            m = (t_mask & valid)[:, None]
            src_off = src_head + b * s_b + row * s_s
            if ALIGNED:
                src_off = tl.multiple_of(src_off, 16)
            if SRC_ROPE:
                t_off = b * sc_b + lay * sc_l + hd * sc_h + row[:, None] * sc_s + offs_c[None, :]
                cs, sn = _scaled_table(sc_ptr, ss_ptr, t_off, m)
            else:
                cs = 0.0
                sn = 0.0
            u1, u2 = _gather_unrotated(
                src_ptr + src_off, offs_c, m, cs, sn, SRC_ROPE, S_INTERLEAVED, S_ROT_HALF, HALF_S
            )
            z1 = tl.dot(u1, w11, input_precision=PRECISION)
            z1 = tl.dot(u2, w21, z1, input_precision=PRECISION) + bias1[None, :]
            z2 = tl.dot(u1, w12, input_precision=PRECISION)
            z2 = tl.dot(u2, w22, z2, input_precision=PRECISION) + bias2[None, :]
            if TGT_ROPE:
                g_off = layer * tc_l + b * tc_b + offs_t[:, None] * tc_t + dh[None, :]
                tm = t_mask[:, None]
                tcs = tl.load(tc_ptr + g_off, mask=tm, other=1.0)
                tsn = tl.load(ts_ptr + g_off, mask=tm, other=0.0)
                y1 = z1 * tcs - z2 * tsn
                y2 = z2 * tcs + z1 * tsn
            else:
                y1 = z1
                y2 = z2
            y1 = tl.where(valid[:, None], y1, 0.0)
            y2 = tl.where(valid[:, None], y2, 0.0)
            if OUT_BF16 and INTERPRET:
                # round to nearest even by hand: Triton's interpreter truncates in .to(bfloat16)
                b1 = y1.to(tl.uint32, bitcast=True)
                b2 = y2.to(tl.uint32, bitcast=True)
                y1 = ((b1 + 0x7FFF + ((b1 >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
                y2 = ((b2 + 0x7FFF + ((b2 >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            o_ptr = out_ptr + layer * o_l + b * o_b + head_h[None, :] * o_h + offs_t[:, None] * o_t
            om = t_mask[:, None] & h_mask[None, :]
            tl.store(o_ptr + ta[None, :], y1.to(out_ptr.dtype.element_ty), mask=om)
            tl.store(o_ptr + tb[None, :], y2.to(out_ptr.dtype.element_ty), mask=om)
        item = seg_stop


def _configs():
    import triton

    # PER_SM: programs launched per SM (the grid is SMs * PER_SM, fewer for small problems)
    # (ptxas, sm_90, offline: ~255 registers at 4 and 8 warps; shared memory ~80 KB with
    # NUM_STAGES 1 and ~160 KB with 2, so 2 / 1 programs fit on an SM)
    # maxnreg caps registers (spilling to local memory) so more programs fit on an SM.
    return [
        triton.Config(
            {"BLOCK_T": bt, "NUM_STAGES": ns, "PER_SM": ps}, num_warps=nw, num_stages=1, maxnreg=regs
        )
        for bt, nw, ns, ps, regs in (
            (64, 4, 1, 2, None),
            (64, 8, 1, 1, None),
            (64, 4, 2, 1, None),
            (64, 8, 2, 1, None),
            (32, 4, 1, 3, None),
            (128, 8, 1, 1, None),
            (64, 4, 1, 3, 168),
            (64, 4, 1, 4, 128),
            (64, 8, 1, 2, 128),
        )  # fmt: skip
    ]


# token counts (and the strides and counts that follow them) vary per context: one variant for all
_KERNEL = LazyKernel(
    _persistent_kernel, helpers=HELPERS, do_not_specialize=["T", "r_b", "n_blocks", "n_items"]
)

# Interpreter: small blocks and three programs, so shares cross unit boundaries.
_INTERPRET_CONFIG = {"BLOCK_T": 16, "NUM_STAGES": 1, "PER_SM": 1}
_INTERPRET_PROGRAMS = 3


def launch_persistent(view: SourceView, rows, heads, weight, bias, src_cos, src_sin, tgt_cos, tgt_sin,
                      out, src_rotary=None, tgt_rotary=None) -> None:  # fmt: skip
    """Run the persistent kernel, writing every element of `out`; arguments as in
    affine.gathered_affine (source layers as a SourceView, heads [Lt, Ht, 1], rotary layouts as
    (kind, rotary_dim) or None). The first CUDA
    launch of a shape bucket times the configurations (`_tune`); later ones reuse its choice."""
    src = view.base
    bsz, hs, _, ds = src.shape
    n_layers, n_heads, _ = heads.shape
    dt = out.shape[-1]
    t = rows.shape[1]
    heads_per_program = 1
    if heads.stride(1) == 0:  # shared inputs: several heads in one tile
        while heads_per_program * 2 <= min(n_heads, _TILE_N // dt):
            heads_per_program *= 2
    half_cols = min(dt // 2, _TILE_N // (2 * heads_per_program))
    units = n_layers * -(-n_heads // heads_per_program) * (dt // 2 // half_cols)
    src_rope, tgt_rope = src_cos is not None, tgt_cos is not None
    sc, ss = (src_cos, src_sin) if src_rope else (src, src)
    tc, ts = (tgt_cos, tgt_sin) if tgt_rope else (out, out)
    interp = src.device.type != "cuda" or interpreting()
    meta = dict(
        HALF_S=ds // 2, HALF_T=dt // 2, HB=heads_per_program, BH=half_cols, SRC_ROPE=src_rope,
        TGT_ROPE=tgt_rope, ALIGNED=view.aligned and all(st % 16 == 0 for st in src.stride()[:3]),
        PRECISION="tf32" if out.dtype == torch.bfloat16 else "tf32x3", OUT_BF16=out.dtype == torch.bfloat16,
        INTERPRET=interp,
    )  # fmt: skip
    meta.update(layout_meta(src_rotary if src_rope else None, tgt_rotary if tgt_rope else None, ds, dt))

    def args(block_t):
        n_blocks = bsz * -(-t // block_t)
        return (
            src, view.offsets, *src.stride()[:3],
            rows, *rows.stride(),
            heads, *heads.stride()[:2],
            weight, *weight.stride(),
            bias, *bias.stride()[:2],
            sc, ss, *(src_cos.stride()[:4] if src_rope else (0, 0, 0, 0)),
            tc, ts, *(tgt_cos.stride()[:3] if tgt_rope else (0, 0, 0)),
            out, *out.stride()[:4],
            t, n_heads, hs, n_blocks, units * n_blocks,
        )  # fmt: skip

    def grid(cfg):
        items = units * bsz * -(-t // cfg["BLOCK_T"])
        cap = _INTERPRET_PROGRAMS if interp else sm_count(src.device) * cfg["PER_SM"]
        return (min(items, cap),)

    with device_of(src):
        if interp:
            _KERNEL[grid(_INTERPRET_CONFIG)](*args(_INTERPRET_CONFIG["BLOCK_T"]), **meta, **_INTERPRET_CONFIG)
            return
        key = (src.device, src.dtype, out.dtype, next_pow2(t), n_heads, *meta.values())
        config = _RESOLVED.get(key)
        if config is None:
            # triton.autotune cannot re-derive the block counts per configuration: time each here
            config = _tune(lambda cfg: _KERNEL[grid(cfg)](*args(cfg["BLOCK_T"]), **meta, **cfg), key)
            _RESOLVED[key] = config
        _KERNEL[grid(config)](*args(config["BLOCK_T"]), **meta, **config)


# Launch options per shape bucket, chosen by _tune (state of the launcher, read by no one else).
_RESOLVED: dict[tuple, dict] = {}


def _tune(run, key: tuple) -> dict:
    """Time each configuration (CUDA events, median of a few runs) and return the fastest's options;
    what was measured goes to the logger (DEBUG): [(launch options, median ms or the error)]."""
    from triton.testing import do_bench

    best, best_ms, seen = None, float("inf"), []
    for cfg in _configs():
        options = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.maxnreg is not None:
            options["maxnreg"] = cfg.maxnreg
        try:
            ms = do_bench(lambda o=options: run(o), warmup=5, rep=20, return_mode="median")
        except Exception as e:  # a configuration that does not compile or fit (shared memory): skip it
            seen.append((options, f"{type(e).__name__}: {e}"[:200]))
            continue
        seen.append((options, ms))
        if ms < best_ms:
            best, best_ms = options, ms
    _log.debug("persistent apply kernel, bucket %s: %s", key, seen)
    if best is None:
        raise RuntimeError(f"no configuration of the persistent apply kernel ran on this device: {seen}")
    return best
