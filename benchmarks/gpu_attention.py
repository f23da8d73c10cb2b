"""GPU benchmark of bridgecache.kernels.column_attention: attention of queries at scattered context
columns (a refreshed share of the context plus a prompt) against what they replace, one run.

    PYTHONPATH=. python3 benchmarks/gpu_attention.py [--out DIR]   # one CUDA GPU, bf16 (~5 minutes)
    python benchmarks/gpu_attention.py --smoke                     # tiny shapes on CPU (Triton interpreter)

One attention layer at the shapes of Qwen2.5-0.5B (14 q heads, 2 kv heads, dim 64) and Qwen2.5-7B
(28 / 4 / 128), bf16, batch 1, random data, context n = 4K / 8K / 16K / 32K tokens, keys at columns
0..n-1. The queries: a fraction r (0.1, 0.2, 1.0) of the first n - 16 columns, sorted random
distinct (r = 1.0: all of them), plus the 16 prompt queries at the last 16 columns. Each query sees
every key up to its own column. Rows, same inputs, side by side:
- ours:     column_attention (the Triton kernel);
- causal:   sdpa is_causal over all n tokens (the attention of the target's own prefill);
- dense:    sdpa of the same queries with a dense additive [queries, keys] mask (today's refresh path);
- flex:     FlexAttention (torch.compile) with a BlockMask built from block indices (no dense mask
            evaluated): full key blocks below each query block's first column, partial ones up to
            its last, where a mask_mod compares columns.
sdpa rows read K / V already repeated to the query heads (repeat_kv outside the timing), masks and
block masks are built outside the timing. Time: triton.testing.do_bench (L2 flushed, warm-up
first), median ms. TFLOP/s counts only visible (query, key) pairs: 4 * D * q_heads per pair.
Before timing: ours against sdpa with a dense mask and against float32 math on small cases (max
abs error), printed. Prints JSON lines as it goes and a markdown table last; writes
attention.json to --out or $OUT when set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

MODELS = {"Qwen2.5-0.5B": (14, 2, 64), "Qwen2.5-7B": (28, 4, 128)}
CONTEXTS = (4096, 8192, 16384, 32768)
FRACTIONS = (0.1, 0.2, 1.0)
PROMPT = 16
SMOKE_MODELS = {"tiny-gqa": (4, 2, 64)}
SMOKE_CONTEXTS = (96,)


def import_attention():
    """bridgecache.kernels.attention, installed or straight from the repository's kernels/ folder."""
    try:
        from bridgecache.kernels import attention

        return attention
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    bridgecache = types.ModuleType("bridgecache")
    bridgecache.__path__ = [str(ROOT / "bridgecache")]
    sys.modules.setdefault("bridgecache", bridgecache)
    spec = importlib.util.spec_from_file_location(
        "bridgecache.kernels",
        ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")],
    )
    kernels = importlib.util.module_from_spec(spec)
    sys.modules["bridgecache.kernels"] = kernels
    spec.loader.exec_module(kernels)
    from bridgecache.kernels import attention

    return attention


# ----------------------------------------------------------------------------------------------
# inputs


class Case:
    """One (model shape, context, fraction): q for the chosen columns, q for all, K, V, columns."""

    def __init__(self, heads, n: int, r: float, device, seed: int = 0):
        hq, hkv, dim = heads
        g = torch.Generator(device="cpu").manual_seed(seed + n)
        body = n - PROMPT
        if r >= 1.0:
            chosen = torch.arange(body)
        else:
            chosen = torch.randperm(body, generator=g)[: max(1, round(r * body))].sort().values
        self.query_columns = torch.cat([chosen, torch.arange(body, n)])[None].to(device)
        self.key_columns = torch.arange(n, device=device)
        self.first = torch.zeros(1, dtype=torch.int64, device=device)
        self.n_q = self.query_columns.shape[1]
        bf = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.q_all = torch.randn(1, hq, n, dim, generator=g).to(device, bf)
        self.q = self.q_all[:, :, self.query_columns[0]].contiguous()
        self.k = torch.randn(1, hkv, n, dim, generator=g).to(device, bf)
        self.v = torch.randn(1, hkv, n, dim, generator=g).to(device, bf)
        self.scale = dim**-0.5
        self.heads, self.n = heads, n
        self.pairs = int((self.query_columns + 1).sum())  # visible (query, key) pairs
        self.causal_pairs = n * (n + 1) // 2

    def repeated(self):
        """K, V repeated to the query heads (transformers' repeat_kv), for sdpa."""
        group = self.heads[0] // self.heads[1]
        return self.k.repeat_interleave(group, 1), self.v.repeat_interleave(group, 1)

    def dense_mask(self) -> torch.Tensor:
        """[1, 1, n_q, n] additive mask, as the refresh pass built it before column_attention."""
        seen = self.key_columns[None, :] <= self.query_columns[0, :, None]
        mask = torch.zeros(seen.shape, dtype=self.q.dtype, device=self.q.device)
        return mask.masked_fill(~seen, torch.finfo(self.q.dtype).min)[None, None]

    def ours(self, attention):
        """column_attention on the Triton kernel (on CPU: its interpreter, for --smoke)."""
        return attention.column_attention(
            self.q, self.k, self.v, self.query_columns, self.key_columns, self.first, scale=self.scale,
            backend="triton",
        )  # fmt: skip


def flex_runner(case: Case, block: int = 128):
    """FlexAttention with a BlockMask from block indices: full blocks [0, (c_min + 1) // block),
    partial blocks up to c_max // block, per query block (columns ascend)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    device = case.q.device
    n_qb = -(-case.n_q // block)
    n_kb = -(-case.n // block)
    cols = case.query_columns[0]
    padded = torch.cat([cols, cols[-1:].expand(n_qb * block - case.n_q)])  # padding rows: last column
    c_min, c_max = padded[::block], padded[block - 1 :: block]
    full_n = (c_min + 1) // block
    part_n = c_max // block + 1 - full_n
    j = torch.arange(n_kb, device=device)
    full_idx = j.expand(n_qb, n_kb)
    part_idx = (full_n[:, None] + j).clamp(max=n_kb - 1)

    def shaped(x):
        return x.to(torch.int32)[None, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return padded[q_idx] >= kv_idx

    kwargs = dict(BLOCK_SIZE=block, mask_mod=mask_mod)
    try:
        bm = BlockMask.from_kv_blocks(shaped(part_n), shaped(part_idx), shaped(full_n), shaped(full_idx),
                                      seq_lengths=(case.n_q, case.n), **kwargs)  # fmt: skip
    except TypeError:  # an older signature without seq_lengths
        bm = BlockMask.from_kv_blocks(
            shaped(part_n), shaped(part_idx), shaped(full_n), shaped(full_idx), **kwargs
        )
    # every row brings new shapes and a new mask_mod: let dynamo recompile rather than fall back to
    # eager flex_attention (which materialises the scores)
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
    flex = torch.compile(flex_attention)
    return lambda: flex(case.q, case.k, case.v, block_mask=bm, scale=case.scale, enable_gqa=True)


# ----------------------------------------------------------------------------------------------
# timing and checks


def bench(fn, device, repeats: int) -> float:
    """Median ms of fn(): triton.testing.do_bench on CUDA (warm-up, L2 flush), wall time on CPU."""
    fn()
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=repeats * 10, return_mode="median"))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def correctness(attention, device) -> list[dict]:
    """Max abs error of ours vs sdpa with a dense mask (same dtype) and vs float32 math, small cases."""
    rows = []
    models = MODELS if device.type == "cuda" else SMOKE_MODELS
    for name, heads in models.items():
        for r in (0.2, 1.0):
            case = Case(heads, 1024 if device.type == "cuda" else 64, r, device, seed=7)
            k, v = case.repeated()
            mask = case.dense_mask()
            got = case.ours(attention).transpose(1, 2)
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                case.q, k, v, attn_mask=mask, scale=case.scale
            )
            exact = torch.nn.functional.scaled_dot_product_attention(
                case.q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=case.scale
            )
            row = {
                "check": name, "r": r, "queries": case.n_q, "keys": case.n,
                "max_abs_ours_vs_dense_sdpa": float((got.float() - sdpa.float()).abs().max()),
                "max_abs_ours_vs_float32": float((got.float() - exact).abs().max()),
                "max_abs_dense_sdpa_vs_float32": float((sdpa.float() - exact).abs().max()),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def measure(attention, heads, n, r, device, repeats, flex: bool) -> dict:
    case = Case(heads, n, r, device)
    hq, _, dim = heads
    row = {"queries": case.n_q, "keys": n}
    timings = {"ours": lambda: case.ours(attention)}
    k, v = case.repeated()
    timings["causal"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        case.q_all, k, v, is_causal=True, scale=case.scale
    )
    mask = case.dense_mask()
    timings["dense"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        case.q, k, v, attn_mask=mask, scale=case.scale
    )
    if flex:
        try:
            timings["flex"] = flex_runner(case)
        except Exception as e:
            row["flex_error"] = f"{type(e).__name__}: {e}"[:300]
    for name, fn in timings.items():
        try:
            row[f"{name}_ms"] = bench(fn, device, repeats)
        except Exception as e:  # keep the other columns
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        if device.type == "cuda":
            torch.cuda.synchronize()
    flops_per_pair = 4 * dim * hq
    for name in timings:
        ms = row.get(f"{name}_ms")
        if ms is None:
            continue
        pairs = case.causal_pairs if name == "causal" else case.pairs
        row[f"{name}_tflops"] = flops_per_pair * pairs / (ms * 1e-3) / 1e12
        if "causal_ms" in row and name != "causal":
            row[f"{name}_vs_causal"] = ms / row["causal_ms"]
    return row


# ----------------------------------------------------------------------------------------------
# main


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() or None
    except Exception:
        return None


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def render(info: dict, checks: list[dict], rows: list[dict]) -> str:
    lines = [
        f"device: {info['device']}; torch {info['torch']}, triton {info['triton']}; {info['date']}; "
        f"commit {info['commit']}",
        "",
        "| check | r | queries | keys | ours vs dense sdpa | ours vs float32 | dense sdpa vs float32 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in checks:
        lines.append(
            f"| {c['check']} | {c['r']} | {c['queries']} | {c['keys']} "
            f"| {c['max_abs_ours_vs_dense_sdpa']:.2e} | {c['max_abs_ours_vs_float32']:.2e} "
            f"| {c['max_abs_dense_sdpa_vs_float32']:.2e} |"
        )
    lines += [
        "",
        "| shape (bf16, one layer) | context | r | queries | causal sdpa ms | ours ms | dense-mask sdpa ms "
        "| flex ms | ours / causal | dense / causal | flex / causal | ours TFLOP/s | causal TFLOP/s "
        "| dense TFLOP/s | flex TFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['context']} | {r['r']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['model']} | {r['context']} | {r['r']} | {r['queries']} | {fmt(r.get('causal_ms'))} "
            f"| {fmt(r.get('ours_ms'))} | {fmt(r.get('dense_ms'))} | {fmt(r.get('flex_ms'))} "
            f"| {fmt(r.get('ours_vs_causal'), '.2f')} | {fmt(r.get('dense_vs_causal'), '.2f')} "
            f"| {fmt(r.get('flex_vs_causal'), '.2f')} | {fmt(r.get('ours_tflops'), '.0f')} "
            f"| {fmt(r.get('causal_tflops'), '.0f')} | {fmt(r.get('dense_tflops'), '.0f')} "
            f"| {fmt(r.get('flex_tflops'), '.0f')} |"
        )
    errors = [f"{r['model']} {r['context']} r={r['r']}: {k} = {v}" for r in rows for k, v in r.items()
              if k.endswith("_error")]  # fmt: skip
    if errors:
        lines += ["", "Errors:", *(f"- {e}" for e in errors)]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="folder for attention.json")
    ap.add_argument("--repeats", type=int, default=20, help="do_bench runs for rep = 10 x this many ms")
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--fractions", type=float, nargs="+", default=None)
    ap.add_argument("--model", nargs="+", default=None, help="only shapes whose name contains one of these")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--budget-s", type=float, default=540, help="start no new row after this many seconds")
    args = ap.parse_args()
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            sys.exit("no CUDA device: use --smoke")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    attention = import_attention()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    info = {
        "device": name,
        "torch": torch.__version__, "triton": triton_version, "commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
    }  # fmt: skip
    print(json.dumps(info), flush=True)

    checks = correctness(attention, device)
    models = SMOKE_MODELS if args.smoke else MODELS
    contexts = args.contexts or (SMOKE_CONTEXTS if args.smoke else CONTEXTS)
    fractions = args.fractions or FRACTIONS
    flex = not args.no_flex and device.type == "cuda"
    rows = []
    for name, heads in models.items():
        if args.model and not any(m in name for m in args.model):
            continue
        for n in contexts:
            for r in fractions:
                row = {"model": name, "context": n, "r": r}
                if time.perf_counter() - started > args.budget_s:
                    row["error"] = "skipped: time budget"
                else:
                    try:
                        row |= measure(
                            attention, heads, n, r, device, 2 if args.smoke else args.repeats, flex
                        )
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    table = render(info, checks, rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attention.json").write_text(
            json.dumps({"info": info, "checks": checks, "rows": rows}, indent=1)
        )
    print(table, flush=True)


if __name__ == "__main__":
    main()
