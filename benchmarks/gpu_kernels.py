"""GPU benchmark of bridgecache.kernels: fused translation of a whole cache, its baselines, and the
fitting statistics, side by side in one run.

    python benchmarks/gpu_kernels.py --out DIR             # CUDA machine, bf16 (~4 minutes)
    python benchmarks/gpu_kernels.py --smoke               # tiny shapes on CPU (Triton interpreter)

Rows (all measured in the same process, median of --repeats after warm-up, CUDA events, L2
flushed between runs):
- apply: KV cache shapes of real model pairs (random data, random head-local maps with k = 1
  source layer per target layer, a cross-tokenizer-like alignment with NATIVE rows):
    tiled, persistent
              keys + values with each apply kernel through its launcher
              (kernels.affine.launch_affine(..., kernel=)): every layer of the cache in 2
              launches, called from Python (launch overhead included), and replayed from a CUDA
              graph (GPU time alone);
    fused     map_layers as the library calls it (argument checks included; its default
              kernel: persistent for these one-input maps);
    copy      torch copy of a buffer moving the same bytes (read + write) as `fused` must;
    torch     the PyTorch reference path (per target layer) on the GPU;
    fullhead  map_fullhead per target layer, k = 4 source layers, keys + values;
    prefill   the target model's own prefill of the same context (random weights, real config,
              sdpa), i.e. what translation replaces.
- accuracy: one layer of each pair, fused vs torch vs a float64 reference. Every row checks its
  result before it is timed (apply: layer 0's keys vs float64; stats: layer 0's moments vs
  float64, within each precision's bound): a wrong result is an error row, never a time.
- stats: ridge statistics for 500 x 1024 tokens at Qwen3-14B -> Qwen3-32B shapes (all 64 target
  layers, keys and values): SufficientStats.update fused (Triton, each precision mode; the
  64-wide Gram tile and a sweep of token-split policies through the launcher
  kernels.stats.launch_stats(..., tile=, splits=); also replayed from a CUDA graph) vs
  materialised (PyTorch), measured on --stats-seqs sequences and scaled; errors of layer 0's
  moments vs float64. The persistent kernel's tuning times come from its logger (DEBUG).
Time to first token through generate() lives in benchmarks/gpu_ttft.py.

Bytes counted for the apply kernels: the source rows of every source head read (once), the target cache
written, the first halves of the rope tables and the weights (once each).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def import_kernels():
    """bridgecache.kernels, installed or straight from the repository's kernels/ folder."""
    try:
        import bridgecache.kernels as kernels

        return kernels
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    try:
        import bridgecache
    except Exception:  # the parent package only needs to exist
        bridgecache = types.ModuleType("bridgecache")
        bridgecache.__path__ = [str(ROOT / "bridgecache")]
        sys.modules["bridgecache"] = bridgecache
    spec = importlib.util.spec_from_file_location(
        "bridgecache.kernels",
        ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")],
    )
    kernels = importlib.util.module_from_spec(spec)
    sys.modules["bridgecache.kernels"] = kernels
    spec.loader.exec_module(kernels)
    bridgecache.kernels = kernels
    return kernels


@dataclass
class Side:
    """The KV cache shape of one model (and, for prefill, its config)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int


QWEN25_7B = Side("Qwen2.5-7B", 28, 4, 128)
QWEN25_15B = Side("Qwen2.5-1.5B", 28, 2, 128)
GEMMA2_2B = Side("Gemma-2-2B", 26, 4, 256)
QWEN3_14B = Side("Qwen3-14B", 40, 8, 128)
QWEN3_32B = Side("Qwen3-32B", 64, 8, 128)
# The apply kernels compared side by side (kernels/affine.py's tiled one, kernels/persistent.py).
KERNELS = ("tiled", "persistent")
# Relative error of the fused statistics vs float64 above which a row reports an error, not a
# time: 3xTF32 is about float32; TF32 and bf16 operands are 10- and 8-bit mantissas.
STATS_ERROR_BOUND = {"tf32x3": 1e-4, "tf32": 5e-3, "bf16": 3e-2}
# Relative error of an apply kernel's bf16 keys vs float64 above which its row is an error.
APPLY_ERROR_BOUND = 2e-2
PAIRS = [
    (QWEN25_7B, QWEN25_15B, (1024, 4096, 16384, 32768)),
    (QWEN25_15B, GEMMA2_2B, (1024, 4096, 16384, 32768)),
    (QWEN3_14B, QWEN3_32B, (128, 512, 1024)),
]
SMOKE_PAIRS = [
    (Side("src-a", 3, 4, 64), Side("tgt-a", 3, 2, 64), (40,)),
    (Side("src-b", 2, 2, 64), Side("tgt-b", 2, 4, 128), (24,)),
]


# ----------------------------------------------------------------------------------------------
# timing


class Timer:
    """Median time (ms) of fn() over repeats, after warm-up; CUDA events and an L2 flush on GPU."""

    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats
        self.flush = (
            torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        )

    def __call__(self, fn, repeats: int | None = None) -> float:
        repeats = repeats or self.repeats
        fn()  # compile / autotune / allocate
        fn()
        times = []
        for _ in range(repeats):
            if self.flush is not None:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# apply


def alignment_rows(tokens: int, src_tokens: int, device) -> torch.Tensor:
    """[1, T] cross-tokenizer-like rows: monotone, some repeats, two NATIVE (-1) rows up front."""
    rows = torch.linspace(0, src_tokens - 1, tokens, device=device).round().long()
    rows[:2] = -1
    return rows[None]


def rope(tokens: int, dim: int, device, base: float = 1e6) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [1, T, dim] float32, transformers' layout."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    ang = torch.arange(tokens, device=device, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((ang, ang), -1)
    return emb.cos()[None], emb.sin()[None]


def k_contiguous(w: torch.Tensor) -> torch.Tensor:
    """Same values, input axis contiguous: the layout the Triton kernel reads fastest."""
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


class Case:
    """Random source cache + head-local maps for one (source, target, tokens) row."""

    def __init__(self, src: Side, tgt: Side, tokens: int, device, dtype=torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(tokens)
        s_tokens = tokens
        self.src, self.tgt, self.tokens = src, tgt, tokens
        shape = (1, src.kv_heads, s_tokens, src.head_dim)
        self.keys = [torch.randn(shape, device=device, generator=g).to(dtype) for _ in range(src.layers)]
        self.values = [torch.randn(shape, device=device, generator=g).to(dtype) for _ in range(src.layers)]
        self.rows = alignment_rows(tokens, s_tokens, device)
        # head-local, k = 1: target layer l, head h reads source layer ~ l * Ls / Lt, head h * Hs / Ht
        lsrc = [min(src.layers - 1, round(l * src.layers / tgt.layers)) for l in range(tgt.layers)]
        hsrc = [h * src.kv_heads // tgt.kv_heads for h in range(tgt.kv_heads)]
        self.heads = torch.tensor([[[ls * src.kv_heads + hs] for hs in hsrc] for ls in lsrc], device=device)
        p, dt = src.head_dim, tgt.head_dim
        wshape = (tgt.layers, tgt.kv_heads, p, dt)
        self.wk = k_contiguous(torch.randn(wshape, device=device, generator=g) / p**0.5)
        self.wv = k_contiguous(torch.randn(wshape, device=device, generator=g) / p**0.5)
        self.bk = torch.randn(tgt.layers, tgt.kv_heads, dt, device=device, generator=g)
        self.bv = torch.randn(tgt.layers, tgt.kv_heads, dt, device=device, generator=g)
        self.sc, self.ss = rope(s_tokens, src.head_dim, device)
        self.tc, self.ts = rope(tokens, tgt.head_dim, device)
        self.dtype = dtype

    def fused(self, kernels, backend=None):
        k = kernels.map_layers(
            self.keys,
            self.rows,
            self.heads,
            self.wk,
            self.bk,
            self.sc,
            self.ss,
            self.tc,
            self.ts,
            backend=backend,
        )
        v = kernels.map_layers(self.values, self.rows, self.heads, self.wv, self.bv, backend=backend)
        return k, v

    def launcher(self, kernels, kernel: str):
        """fused() by one apply kernel: its launcher on arguments prepared once (as map_layers
        prepares them), keys then values, into buffers allocated once."""
        affine = kernels.affine
        src, tgt = self.src, self.tgt
        t = self.tokens
        sc, ss = affine.source_tables(self.sc, self.ss, 1, src.layers, src.kv_heads, t, src.head_dim)
        tc, ts = affine.target_tables(self.tc, self.ts, tgt.layers, 1, t, tgt.head_dim)
        shape = (tgt.layers, 1, tgt.kv_heads, t, tgt.head_dim)
        out_k = torch.empty(shape, dtype=self.dtype, device=self.rows.device)
        out_v = torch.empty_like(out_k)
        view_k, view_v = kernels._dispatch.source_view(self.keys), kernels._dispatch.source_view(self.values)

        def run():
            affine.launch_affine(
                view_k, self.rows, self.heads, self.wk, self.bk, sc, ss, tc, ts, out_k, kernel
            )
            no_rope = (None, None, None, None)
            affine.launch_affine(view_v, self.rows, self.heads, self.wv, self.bv, *no_rope, out_v, kernel)
            return out_k, out_v

        return run

    def bytes_moved(self) -> int:
        """Fewest bytes the fused translation must move (see the module docstring)."""
        src, tgt, t = self.src, self.tgt, self.tokens
        e = torch.finfo(self.dtype).bits // 8
        used = len(set(self.heads.flatten().tolist()))
        read = 2 * used * t * src.head_dim * e
        write = 2 * tgt.layers * tgt.kv_heads * t * tgt.head_dim * e
        tables = 4 * t * (src.head_dim + tgt.head_dim) // 2 * 4
        weights = 2 * (self.wk.numel() + self.bk.numel()) * 4
        return read + write + tables + weights


class FullHead:
    """Full-head maps with k = 4 source layers per target layer for a Case (keys + values)."""

    K = 4

    def __init__(self, case: Case, device):
        src, tgt = case.src, case.tgt
        k = min(self.K, src.layers)
        g = torch.Generator(device=device).manual_seed(1)
        n = k * src.kv_heads * src.head_dim
        wshape = (tgt.layers, tgt.kv_heads, n, tgt.head_dim)
        self.wk = k_contiguous(torch.randn(wshape, device=device, generator=g) / n**0.5)
        self.wv = k_contiguous(torch.randn(wshape, device=device, generator=g) / n**0.5)
        self.bias = torch.zeros(tgt.layers, tgt.kv_heads, tgt.head_dim, device=device)
        self.layers = []
        for l in range(tgt.layers):
            first = min(src.layers - k, round(l * src.layers / tgt.layers))
            self.layers.append(list(range(first, first + k)))
        self.case = case

    def __call__(self, kernels, backend=None):
        c = self.case
        for l, used in enumerate(self.layers):
            kernels.map_fullhead(
                [c.keys[i] for i in used],
                c.rows,
                self.wk[l],
                self.bias[l],
                c.sc,
                c.ss,
                c.tc,
                c.ts,
                backend=backend,
            )
            kernels.map_fullhead(
                [c.values[i] for i in used], c.rows, self.wv[l], self.bias[l], backend=backend
            )


def copy_time(timer: Timer, nbytes: int, device) -> float:
    """ms to copy a buffer of nbytes / 2 (nbytes moved: read + write)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    return timer(lambda: b.copy_(a))


def accuracy(kernels, case: Case, kernel: str) -> dict:
    """Layer 0 keys: relative error of one apply kernel and torch vs float64 (the STYLE.md rule's numbers)."""
    fused = case.launcher(kernels, kernel)()[0][0].double()
    args = (case.rows, case.heads[:1], case.wk[:1], case.bk[:1], case.sc, case.ss, case.tc, case.ts)
    ref = kernels.map_layers(case.keys, *args, backend="torch")[0].double()
    exact = torch.zeros_like(fused)
    half_s, half_t = case.src.head_dim // 2, case.tgt.head_dim // 2
    valid = case.rows[0] >= 0
    idx = case.rows[0].clamp(min=0)
    c, s = case.sc[0, idx, :half_s].double(), case.ss[0, idx, :half_s].double()
    tc, ts = case.tc[0, :, :half_t].double(), case.ts[0, :, :half_t].double()
    for h in range(case.tgt.kv_heads):
        v = int(case.heads[0, h, 0])
        x = case.keys[v // case.src.kv_heads][0, v % case.src.kv_heads, idx].double()
        x1, x2 = x[:, :half_s], x[:, half_s:]
        u = torch.cat(((x1 * c + x2 * s), (x2 * c - x1 * s)), -1) / (c * c + s * s).repeat(1, 2)
        z = u @ case.wk[0, h].double() + case.bk[0, h].double()
        z1, z2 = z[:, :half_t], z[:, half_t:]
        exact[0, h] = torch.where(valid[:, None], torch.cat((z1 * tc - z2 * ts, z2 * tc + z1 * ts), -1), 0.0)
    ek = float((fused - exact).norm() / exact.norm())
    et = float((ref - exact).norm() / exact.norm())
    return {"fused_err": ek, "torch_err": et, "ratio": ek / et}


# ----------------------------------------------------------------------------------------------
# stats


# (programs per SM, fewest token blocks per program) of the statistics kernel's token splits
SPLIT_SWEEP = ((1, 8), (2, 32), (8, 2), (16, 1))


class TuningLog(logging.Handler):
    """What the persistent apply kernel's tuner measured (its logger, DEBUG), while attached."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []
        self.logger = logging.getLogger("bridgecache.kernels.persistent")
        self.level_before = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)

    def emit(self, record):
        self.records.append(record.getMessage())

    def close(self):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        super().close()


def graphed(fn):
    """fn captured in a CUDA graph (run twice first: compilation, allocations); returns its replay."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def stats_rows(kernels, timer: Timer, device, seqs: int, total_seqs: int, smoke: bool) -> list[dict]:
    """Fused vs materialised SufficientStats for all target layers (keys + values), scaled."""
    src, tgt = (Side("s", 3, 2, 64), Side("t", 2, 2, 64)) if smoke else (QWEN3_14B, QWEN3_32B)
    tokens = 24 if smoke else 1024
    g = torch.Generator(device=device).manual_seed(5)
    bf = torch.bfloat16
    keys = [
        torch.randn(seqs, src.kv_heads, tokens, src.head_dim, device=device, generator=g).to(bf)
        for _ in range(src.layers)
    ]
    ys = torch.randn(seqs, tgt.kv_heads, tokens, tgt.head_dim, device=device, generator=g).to(bf)
    rows = alignment_rows(tokens, tokens, device).expand(seqs, -1).contiguous()
    layer_of = [min(src.layers - 1, round(l * src.layers / tgt.layers)) for l in range(tgt.layers)]
    heads = torch.tensor([[h * src.kv_heads // tgt.kv_heads] for h in range(tgt.kv_heads)], device=device)
    cos, sin = rope(tokens, src.head_dim, device)
    cos, sin = cos.expand(seqs, -1, -1), sin.expand(seqs, -1, -1)
    bufs = {
        kind: [
            kernels.SufficientStats.zeros(tgt.kv_heads, src.head_dim, tgt.head_dim, device=device)
            for _ in range(tgt.layers)
        ]
        for kind in "kv"
    }

    def run(backend, precision="tf32x3"):  # each target layer reads its own source layer (k = 1)
        for l in range(tgt.layers):
            src_l = keys[layer_of[l]]
            bufs["k"][l].update(src_l, rows, heads, ys, None, cos, sin, backend=backend, precision=precision)
            bufs["v"][l].update(src_l, rows, heads, ys, backend=backend, precision=precision)

    tables = kernels.affine.source_tables(cos, sin, seqs, 1, src.kv_heads, tokens, src.head_dim)

    def buffers(stats):  # the stats' own tensors (dataclasses.astuple would hand the kernel copies)
        return [getattr(stats, f.name) for f in dataclasses.fields(stats)]

    def launch(precision, tile=None, splits=None):  # run("triton", ...) through the launcher itself
        for l in range(tgt.layers):
            src_l = [keys[layer_of[l]]]
            for kind, (c, s) in (("k", tables), ("v", (None, None))):
                kernels.stats.launch_stats(src_l, rows, heads, ys, None, c, s, buffers(bufs[kind][l]),
                                           splits=splits, precision=precision, tile=tile)  # fmt: skip

    # float64 moments of layer 0's keys (X gathered and un-rotated in float64): the accuracy yardstick
    x = keys[0].double()[:, heads[:, 0]]  # [B, Ht, T, Ds] (rows are 0..T-1 with two -1 up front)
    half = src.head_dim // 2
    c, s_ = cos[..., :half].double()[:, None], sin[..., :half].double()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    x = torch.cat((x1 * c + x2 * s_, x2 * c - x1 * s_), -1) / (c * c + s_ * s_).repeat(1, 1, 1, 2)
    idx = rows[0].clamp(min=0)
    keep = rows[0] >= 0
    xg = x[:, :, idx][:, :, keep].permute(1, 0, 2, 3).reshape(tgt.kv_heads, -1, src.head_dim)
    yg = ys.double()[:, :, keep].permute(1, 0, 2, 3).reshape(tgt.kv_heads, -1, tgt.head_dim)
    exact_xtx, exact_xty = xg.transpose(1, 2) @ xg, xg.transpose(1, 2) @ yg

    def errors(backend, precision="tf32x3", tile=None, splits=None):
        """Layer 0's key moments vs float64; raises (the row is then an error, not a time) when
        they are off by more than the precision's bound."""
        st = kernels.SufficientStats.zeros(tgt.kv_heads, src.head_dim, tgt.head_dim, device=device)
        if tile is None and splits is None:
            st.update(keys[0], rows, heads, ys, None, cos, sin, backend=backend, precision=precision)
        else:
            kernels.stats.launch_stats([keys[0]], rows, heads, ys, None, *tables, buffers(st),
                                       precision=precision, tile=tile, splits=splits)  # fmt: skip
        out = {
            "xtx_err": float((st.xtx - exact_xtx).norm() / exact_xtx.norm()),
            "xty_err": float((st.xty - exact_xty).norm() / exact_xty.norm()),
        }
        bound = STATS_ERROR_BOUND[precision if backend == "triton" else "tf32x3"]
        if not max(out.values()) <= bound:  # NaN fails too
            raise AssertionError(f"wrong moments: {out} (bound {bound:g} for {precision})")
        return out

    out = []
    default_tile = 128  # the launcher's Gram tile edge on CUDA (whole heads up to 128 dims)
    for tile in (64, 128):  # 64: per rope half, through the launcher; 128: SufficientStats.update
        launched = tile != default_tile  # through the launcher with tile= (also in the interpreter)

        def fused(p, tile=tile, launched=launched):
            return launch(p, tile=tile) if launched else run("triton", p)

        for precision in kernels.stats.PRECISIONS:
            try:
                checked = errors("triton", precision, tile if launched else None)  # before any time
                ms = timer(lambda p=precision: fused(p), repeats=3)
                row = {"path": "fused", "precision": precision, "tile": tile, "ms_per_batch": ms}
                if device.type == "cuda":  # the same 128 updates replayed from a CUDA graph: GPU time
                    row["graph_ms"] = timer(graphed(lambda p=precision: fused(p)), repeats=3)
                row.update(checked)
            except Exception as e:
                row = {"error": f"fused {precision} tile {tile}: {type(e).__name__}: {e}"[:300]}
            out.append(row)
            print(json.dumps(row), flush=True)
    # Token splits (programs per tile, adding with float64 atomics), default tile: what bounds the kernel
    for splits in SPLIT_SWEEP if device.type == "cuda" else ():
        for precision in ("tf32x3", "bf16"):
            try:
                checked = errors("triton", precision, splits=splits)
                ms = timer(graphed(lambda p=precision, sp=splits: launch(p, splits=sp)), repeats=3)
                row = {"path": f"fused, splits {splits}", "precision": precision, "tile": default_tile,
                       "ms_per_batch": ms, "graph_ms": ms, **checked}  # fmt: skip
            except Exception as e:
                row = {"error": f"fused {precision} splits {splits}: {type(e).__name__}: {e}"[:300]}
            out.append(row)
            print(json.dumps(row), flush=True)
    try:
        checked = errors("torch")
        ms = timer(lambda: run("torch"), repeats=3)
        out.append({"path": "materialised", "ms_per_batch": ms, **checked})
    except Exception as e:
        out.append({"error": f"materialised: {type(e).__name__}: {e}"[:300]})
    flops = (
        2 * tgt.layers * tgt.kv_heads * seqs * tokens * (src.head_dim**2 + src.head_dim * tgt.head_dim) * 2
    )
    for row in out:
        if "error" not in row:
            row["seqs_per_batch"] = seqs
            row["scaled_s"] = row["ms_per_batch"] / 1e3 * total_seqs / seqs
            row["tflops"] = flops / (row["ms_per_batch"] * 1e-3) / 1e12
    return out


# ----------------------------------------------------------------------------------------------
# native prefill


def model_config(side: Side, smoke: bool):
    from transformers import Gemma2Config, Qwen2Config, Qwen3Config

    heads = dict(num_key_value_heads=side.kv_heads, head_dim=side.head_dim, num_hidden_layers=side.layers)
    if smoke:
        return Qwen2Config(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=512, **heads
        )
    if side is QWEN25_15B:
        return Qwen2Config(
            hidden_size=1536, intermediate_size=8960, num_attention_heads=12, vocab_size=151936,
            max_position_embeddings=32768, tie_word_embeddings=True, **heads,
        )  # fmt: skip
    if side is GEMMA2_2B:
        return Gemma2Config(
            hidden_size=2304, intermediate_size=9216, num_attention_heads=8, vocab_size=256000,
            max_position_embeddings=32768, **heads,
        )  # fmt: skip
    if side is QWEN3_32B:
        return Qwen3Config(
            hidden_size=5120, intermediate_size=25600, num_attention_heads=64, vocab_size=151936,
            max_position_embeddings=40960, **heads,
        )  # fmt: skip
    raise ValueError(side)


def prefill_times(side: Side, token_counts, timer: Timer, device, smoke: bool) -> dict:
    """ms of the target's own prefill (logits of the last token only), per context length; sdpa,
    or eager attention where sdpa refuses the model."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(side, smoke)
    out = {}
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=torch.float32 if smoke else torch.bfloat16, attn_implementation=attn
            )
        model.eval()
        try:
            for t in token_counts:
                ids = torch.randint(0, cfg.vocab_size, (1, t), device=device)
                with torch.inference_mode():
                    out[t] = timer(lambda m=model, x=ids: m(x, use_cache=True, logits_to_keep=1), repeats=3)
            out["attention"] = attn
            return out
        except Exception as e:
            out[f"{attn}_error"] = f"{type(e).__name__}: {e}"[:200]
        finally:
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------
# main


def fmt(x, spec=".3f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="tiny shapes; runs on CPU under the Triton interpreter"
    )
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json and table.md")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--stats-seqs", type=int, default=8, help="sequences per statistics batch (timed)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the native prefill column")
    ap.add_argument("--no-stats", action="store_true", help="skip the fitting statistics rows")
    ap.add_argument("--no-baselines", action="store_true", help="skip the torch and full-head columns")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts for every pair")
    ap.add_argument("--pair", nargs="+", default=None, help="only pairs whose name contains one of these")
    ap.add_argument(
        "--budget-s", type=float, default=420, help="start no prefill model after this many seconds"
    )
    args = ap.parse_args()
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            sys.exit("no CUDA device: use --smoke")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    kernels = import_kernels()
    torch.backends.cuda.matmul.allow_tf32 = False  # the PyTorch reference in full float32
    timer = Timer(device, 2 if args.smoke else args.repeats)
    pairs = SMOKE_PAIRS if args.smoke else PAIRS

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    info = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    info["argv"] = sys.argv
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if device.type == "cuda":
        peak = copy_time(timer, 4 << 30, device)
        info["copy_GBps_4GiB"] = (4 << 30) / (peak * 1e-3) / 1e9
    print(json.dumps(info), flush=True)

    apply_rows, acc_rows = [], []
    tuning = TuningLog()
    for src, tgt, token_counts in pairs:
        if args.pair and not any(f in f"{src.name} -> {tgt.name}" for f in args.pair):
            continue
        for t in args.tokens or token_counts:
            row = {"pair": f"{src.name} -> {tgt.name}", "tokens": t}
            try:
                case = Case(src, tgt, t, device)
                row["MB"] = case.bytes_moved() / 1e6
                row["copy_ms"] = copy_time(timer, case.bytes_moved(), device)
                for kernel in KERNELS:  # old (tiled) and new (persistent) apply kernels, same inputs
                    acc = accuracy(kernels, case, kernel)  # checked before any time is taken
                    if not acc["fused_err"] <= APPLY_ERROR_BOUND:  # NaN fails too
                        raise AssertionError(f"{kernel}: wrong keys, {acc} (bound {APPLY_ERROR_BOUND:g})")
                    launch = case.launcher(kernels, kernel)
                    row[f"{kernel}_ms"] = timer(launch)
                    if device.type == "cuda":
                        row[f"{kernel}_graph_ms"] = timer(graphed(launch))
                    kernel_ms = row.get(f"{kernel}_graph_ms", row[f"{kernel}_ms"])
                    row[f"{kernel}_frac_of_copy"] = row["copy_ms"] / kernel_ms
                    row[f"{kernel}_GBps"] = case.bytes_moved() / (kernel_ms * 1e-3) / 1e9
                    if t == (args.tokens or token_counts)[0]:
                        acc_rows.append({"pair": row["pair"], "kernel": kernel, **acc})
                    del launch
                row["fused_ms"] = timer(lambda c=case: c.fused(kernels))
                if not args.no_baselines:
                    row["torch_ms"] = timer(lambda c=case: c.fused(kernels, backend="torch"), repeats=3)
                    full = FullHead(case, device)
                    row["fullhead_ms"] = timer(lambda f=full: f(kernels), repeats=3)
                    del full
                del case
            except Exception as e:  # keep the other rows
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(json.dumps(row), flush=True)
            apply_rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":
        best = kernels.affine._KERNEL.autotuned
        info["autotune"] = {str(k): str(v) for k, v in best.cache.items()}
        info["persistent_tuning"] = tuning.records
    tuning.close()

    stats = []
    try:
        if not args.no_stats:
            stats = stats_rows(kernels, timer, device, 2 if args.smoke else args.stats_seqs, 500, args.smoke)
    except Exception as e:
        stats = [{"error": f"{type(e).__name__}: {e}"[:300]}]
    print(json.dumps(stats), flush=True)

    prefill = {}
    if not args.no_prefill:
        for _, tgt, token_counts in pairs:
            if time.perf_counter() - started > args.budget_s:
                prefill[tgt.name] = {"error": "skipped: time budget"}
                continue
            try:
                prefill[tgt.name] = prefill_times(tgt, token_counts, timer, device, args.smoke)
            except Exception as e:
                prefill[tgt.name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps({tgt.name: prefill[tgt.name]}, default=str), flush=True)
    for row in apply_rows:
        p = prefill.get(row["pair"].split(" -> ")[1], {})
        row["prefill_ms"] = p.get(row["tokens"]) if isinstance(p, dict) else None

    table = render(info, apply_rows, acc_rows, stats)
    print(table, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps(
                {"info": info, "apply": apply_rows, "accuracy": acc_rows, "stats": stats, "prefill": prefill},
                indent=1,
                default=str,
            )
        )
        (args.out / "table.md").write_text(table)


def render(info, apply_rows, acc_rows, stats) -> str:
    lines = [
        f"device: {info['device']}; torch {info['torch']}, triton {info['triton']}, "
        f"transformers {info['transformers']}; {info['date']}"
    ]
    if "copy_GBps_4GiB" in info:
        lines.append(
            f"copy bandwidth (4 GiB device-to-device, read + write): {info['copy_GBps_4GiB']:.0f} GB/s"
        )
    lines += [
        "",
        "| pair (bf16) | tokens | MB moved | copy ms (same bytes) | tiled ms | tiled, graph ms "
        "| tiled / copy bw | persistent ms | persistent, graph ms | persistent / copy bw "
        "| persistent speed-up (graph) | torch ms | full-head k=4 ms | prefill ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in apply_rows:
        if "error" in r:
            lines.append(f"| {r['pair']} | {r['tokens']} | error: {r['error']} |")
            continue
        old = r.get("tiled_graph_ms", r["tiled_ms"])
        new = r.get("persistent_graph_ms", r["persistent_ms"])
        lines.append(
            f"| {r['pair']} | {r['tokens']} | {r['MB']:.1f} | {fmt(r['copy_ms'])} | {fmt(r['tiled_ms'])} "
            f"| {fmt(r.get('tiled_graph_ms'))} | {r['tiled_frac_of_copy']:.0%} | {fmt(r['persistent_ms'])} "
            f"| {fmt(r.get('persistent_graph_ms'))} | {r['persistent_frac_of_copy']:.0%} | {old / new:.2f}x "
            f"| {fmt(r.get('torch_ms'), '.2f')} | {fmt(r.get('fullhead_ms'), '.2f')} "
            f"| {fmt(r.get('prefill_ms'), '.2f')} |"
        )
    lines += [
        "",
        "| accuracy, layer 0 keys (bf16 out) | kernel | kernel rel. err | torch rel. err "
        "| ratio (rule: <= 2) |",
        "|---|---|---:|---:|---:|",
    ]
    for a in acc_rows:
        lines.append(
            f"| {a['pair']} | {a['kernel']} | {a['fused_err']:.2e} | {a['torch_err']:.2e} "
            f"| {a['ratio']:.2f} |"
        )
    lines += [
        "",
        "| fitting statistics, Qwen3-14B -> Qwen3-32B, 64 layers K+V | precision | tile | ms per batch "
        "| CUDA graph ms "
        "| sequences per batch | 500 x 1024 tokens (scaled), s | TFLOP/s | vs materialised "
        "| xtx rel. err vs float64 | xty rel. err vs float64 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = next((x["ms_per_batch"] for x in stats if x.get("path") == "materialised"), None)
    for x in stats:
        if "error" in x:
            lines.append(f"| error: {x['error']} |")
            continue
        speed = "-" if base is None else f"{base / x['ms_per_batch']:.1f}x"
        lines.append(
            f"| {x['path']} | {x.get('precision', 'float32')} | {x.get('tile', '-')} "
            f"| {x['ms_per_batch']:.1f} | {fmt(x.get('graph_ms'), '.1f')} "
            f"| {x['seqs_per_batch']} | {x['scaled_s']:.2f} | {x['tflops']:.1f} | {speed} "
            f"| {fmt(x.get('xtx_err'), '.1e')} | {fmt(x.get('xty_err'), '.1e')} |"
        )
    lines += ["", "Time to first token through generate(): see benchmarks/gpu_ttft.py (not measured here)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
