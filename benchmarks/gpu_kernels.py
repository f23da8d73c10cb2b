"""GPU benchmark of bridgecache.kernels: fused translation of a whole cache, its baselines, and the
fitting statistics, side by side in one run.

    python benchmarks/gpu_kernels.py --out DIR             # CUDA machine, bf16 (~4 minutes)
    python benchmarks/gpu_kernels.py --smoke               # tiny shapes on CPU (Triton interpreter)

Rows (all measured in the same process, median of --repeats after warm-up, CUDA events, L2
flushed between runs):
- apply: KV cache shapes of real model pairs (random data, random head-local maps with k = 1
  source layer per target layer, a cross-tokenizer-like alignment with NATIVE rows):
    fused     map_layers for keys + values: every layer of the cache in 2 launches, called from
              Python (host overhead included), and replayed from a CUDA graph (GPU time alone);
    copy      torch copy of a buffer moving the same bytes (read + write) as `fused` must;
    torch     the PyTorch reference path (per target layer) on the GPU;
    fullhead  map_fullhead per target layer, k = 4 source layers, keys + values;
    prefill   the target model's own prefill of the same context (random weights, real config,
              sdpa), i.e. what translation replaces.
- accuracy: one layer of each pair, fused vs torch vs a float64 reference.
- stats: ridge statistics for 500 x 1024 tokens at Qwen3-14B -> Qwen3-32B shapes (all 64 target
  layers, keys and values): SufficientStats.update fused (Triton) vs materialised (PyTorch),
  measured on --stats-seqs sequences and scaled.
Time to first token through generate() lives in benchmarks/gpu_ttft.py.

Bytes counted for `fused`: the source rows of every source head read (once), the target cache
written, the first halves of the rope tables and the weights (once each).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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

    def graphed(self, kernels):
        """fused() captured in a CUDA graph (autotuned first): its replay times the GPU work alone."""
        self.fused(kernels)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fused(kernels)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.fused(kernels)
        return graph.replay

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


def accuracy(kernels, case: Case) -> dict:
    """Layer 0 keys: relative error of fused and torch vs float64 (the STYLE.md rule's numbers)."""
    args = (case.rows, case.heads[:1], case.wk[:1], case.bk[:1], case.sc, case.ss, case.tc, case.ts)
    fused = kernels.map_layers(case.keys, *args, backend="triton")[0].double()
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

    def run(backend):  # each target layer reads its own source layer (head-local, k = 1)
        for l in range(tgt.layers):
            bufs["k"][l].update(keys[layer_of[l]], rows, heads, ys, None, cos, sin, backend=backend)
            bufs["v"][l].update(keys[layer_of[l]], rows, heads, ys, backend=backend)

    out = []
    for backend, label in (("triton", "fused"), ("torch", "materialised")):
        ms = timer(lambda b=backend: run(b), repeats=3)
        out.append(
            {
                "path": label,
                "ms_per_batch": ms,
                "seqs_per_batch": seqs,
                "scaled_s": ms / 1e3 * total_seqs / seqs,
            }
        )
    # accuracy of the fused statistics on the last update, layer 0 keys
    a = kernels.SufficientStats.zeros(tgt.kv_heads, src.head_dim, tgt.head_dim, device=device)
    b = kernels.SufficientStats.zeros(tgt.kv_heads, src.head_dim, tgt.head_dim, device=device)
    a.update(keys[0], rows, heads, ys, None, cos, sin, backend="triton")
    b.update(keys[0], rows, heads, ys, None, cos, sin, backend="torch")
    out[0]["xtx_rel_diff"] = float((a.xtx - b.xtx).norm() / b.xtx.norm())
    out[0]["xty_rel_diff"] = float((a.xty - b.xty).norm() / b.xty.norm())
    flops = (
        2 * tgt.layers * tgt.kv_heads * seqs * tokens * (src.head_dim**2 + src.head_dim * tgt.head_dim) * 2
    )
    for row in out:
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
    for src, tgt, token_counts in pairs:
        for t in token_counts:
            row = {"pair": f"{src.name} -> {tgt.name}", "tokens": t}
            try:
                case = Case(src, tgt, t, device)
                row["MB"] = case.bytes_moved() / 1e6
                row["fused_ms"] = timer(lambda c=case: c.fused(kernels))
                row["copy_ms"] = copy_time(timer, case.bytes_moved(), device)
                if device.type == "cuda":
                    row["graph_ms"] = timer(case.graphed(kernels))
                kernel_ms = row.get("graph_ms", row["fused_ms"])
                row["frac_of_copy"] = row["copy_ms"] / kernel_ms
                row["GBps"] = case.bytes_moved() / (kernel_ms * 1e-3) / 1e9
                row["torch_ms"] = timer(lambda c=case: c.fused(kernels, backend="torch"), repeats=3)
                full = FullHead(case, device)
                row["fullhead_ms"] = timer(lambda f=full: f(kernels), repeats=3)
                if t == token_counts[0]:
                    acc_rows.append({"pair": row["pair"], **accuracy(kernels, case)})
                del case, full
            except Exception as e:  # keep the other rows
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(json.dumps(row), flush=True)
            apply_rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":
        best = kernels.affine._KERNEL.autotuned
        info["autotune"] = {str(k): str(v) for k, v in best.cache.items()}

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
        "| pair (bf16) | tokens | MB moved | fused ms | fused, CUDA graph ms | GB/s (graph) "
        "| copy ms (same bytes) | graph / copy bw | torch ms | torch / fused | full-head k=4 ms "
        "| full-head / fused | prefill ms | prefill / fused |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in apply_rows:
        if "error" in r:
            lines.append(f"| {r['pair']} | {r['tokens']} | error: {r['error']} |")
            continue
        pre = r.get("prefill_ms")
        lines.append(
            f"| {r['pair']} | {r['tokens']} | {r['MB']:.1f} | {fmt(r['fused_ms'])} "
            f"| {fmt(r.get('graph_ms'))} | {r['GBps']:.0f} | "
            f"{fmt(r['copy_ms'])} | {r['frac_of_copy']:.0%} | {fmt(r['torch_ms'], '.2f')} | "
            f"{r['torch_ms'] / r['fused_ms']:.1f}x | {fmt(r['fullhead_ms'], '.2f')} | "
            f"{r['fullhead_ms'] / r['fused_ms']:.1f}x | {fmt(pre, '.2f')} | "
            f"{'-' if pre is None else format(pre / r['fused_ms'], '.0f') + 'x'} |"
        )
    lines += [
        "",
        "| accuracy, layer 0 keys (bf16 out) | fused rel. err | torch rel. err | ratio (rule: <= 2) |",
        "|---|---:|---:|---:|",
    ]
    for a in acc_rows:
        lines.append(f"| {a['pair']} | {a['fused_err']:.2e} | {a['torch_err']:.2e} | {a['ratio']:.2f} |")
    lines += [
        "",
        "| fitting statistics, Qwen3-14B -> Qwen3-32B, 64 layers K+V | ms per batch | sequences per batch "
        "| 500 x 1024 tokens (scaled), s | TFLOP/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in stats:
        if "error" in s:
            lines.append(f"| error: {s['error']} |")
            continue
        lines.append(
            f"| {s['path']} | {s['ms_per_batch']:.1f} | {s['seqs_per_batch']} | {s['scaled_s']:.2f} "
            f"| {s['tflops']:.1f} |"
        )
    if len(stats) == 2 and "error" not in stats[0] and "error" not in stats[1]:
        speedup = stats[1]["ms_per_batch"] / stats[0]["ms_per_batch"]
        lines.append(
            f"\nfused statistics: {speedup:.1f}x faster than materialised; relative difference "
            f"xtx {stats[0]['xtx_rel_diff']:.1e}, xty {stats[0]['xty_rel_diff']:.1e}"
        )
    lines += ["", "Time to first token through generate(): see benchmarks/gpu_ttft.py (not measured here)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
