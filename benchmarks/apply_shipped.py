"""The apply kernel at the shipped bridges' shapes: full-head maps, k = 4 source layers a target layer.

    python benchmarks/apply_shipped.py --out DIR                 # CUDA machine, bf16 (~1 minute)
    python benchmarks/apply_shipped.py --kernels OLD/kernels     # the same rows from another copy
    python benchmarks/apply_shipped.py --smoke                   # tiny shapes, Triton interpreter

What a handoff with a shipped bridge launches (`runtime/translation/layers.py`, `map_layers`):
every target layer's heads read all heads of its 4 source layers (8 inputs a head from
Qwen2.5-1.5B, 12 from SmolLM2-135M), keys un-rotated at source positions and re-rotated at
target positions, one launch for the keys of every layer and one for the values. Random data at
the models' KV shapes, a cross-tokenizer-like alignment (monotone, repeats, two rows with no
source), one rope table shared by every source layer (as Qwen2.5 and SmolLM2 have).

Each row checks its result before it is timed: keys and values of the first and last target
layers against a float64 computation of the documented formula on 256 target rows (relative
error bound 2e-2, bf16 output). Times: median of --repeats, CUDA events, L2 flushed before each;
"graph" replays both launches from a CUDA graph (GPU time without Python).

Bounds printed beside each time:
- bytes: what the launches must move: every target layer reads its 4 source layers' rows (a
  source layer read by several target layers counts each time: at 16-32K tokens a layer's rows
  do not stay in L2 between them), writes its own rows; tables and weights once.
- copy ms: a device-to-device copy of that many bytes (read + write) on the same GPU.
- FLOP: 2 x rows x (inputs x source dim) x (heads x target dim), keys and values; the dots run in
  TF32 for bf16 outputs. "TF32 ms" is that at the dense TF32 peak given by --tf32-tflops
  (H100 / H200 SXM: 494.7).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import Timer, alignment_rows, copy_time, graphed, k_contiguous, rope  # noqa: E402

ERROR_BOUND = 2e-2
CHECK_ROWS = 256


@dataclass(frozen=True)
class Pair:
    name: str
    src_layers: int
    src_heads: int
    src_dim: int
    tgt_layers: int
    tgt_heads: int
    tgt_dim: int
    k: int = 4

    @property
    def inputs(self) -> int:
        return self.k * self.src_heads


PAIRS = [
    Pair("Qwen2.5-1.5B -> Qwen2.5-0.5B", 28, 2, 128, 24, 2, 64),
    Pair("SmolLM2-135M -> Qwen2.5-0.5B", 30, 3, 64, 24, 2, 64),
    Pair("Qwen2.5-1.5B -> Qwen2.5-7B", 28, 2, 128, 28, 4, 128),
]
SMOKE_PAIRS = [
    Pair("smoke 2x64 -> 2x64", 5, 2, 64, 3, 2, 64),
    Pair("smoke 3x64 -> 1x128", 5, 3, 64, 2, 1, 128),
]


def load_kernels(folder: Path | None):
    """bridgecache.kernels as installed, or from another copy's kernels/ folder (a separate process
    per copy: each registers the same torch operator)."""
    if folder is None:
        import bridgecache.kernels as kernels

        return kernels
    parent = types.ModuleType("bridgecache")
    parent.__path__ = []
    sys.modules["bridgecache"] = parent
    spec = importlib.util.spec_from_file_location(
        "bridgecache.kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    kernels = importlib.util.module_from_spec(spec)
    sys.modules["bridgecache.kernels"] = kernels
    spec.loader.exec_module(kernels)
    return kernels


class Case:
    """Random source KV, full-head maps and tables of one (pair, tokens) row, on `device`."""

    def __init__(self, pair: Pair, tokens: int, device):
        g = torch.Generator(device=device).manual_seed(tokens + pair.inputs)
        p = pair
        shape = (1, p.src_heads, tokens, p.src_dim)
        self.keys = [torch.randn(shape, device=device, generator=g).bfloat16() for _ in range(p.src_layers)]
        self.values = [torch.randn(shape, device=device, generator=g).bfloat16() for _ in range(p.src_layers)]
        self.rows = alignment_rows(tokens, tokens, device)
        # target layer l reads the k source layers nearest its relative depth, every head of each
        first = [min(p.src_layers - p.k, round(l * p.src_layers / p.tgt_layers)) for l in range(p.tgt_layers)]
        layer_heads = torch.tensor(
            [[(f + i) * p.src_heads + h for i in range(p.k) for h in range(p.src_heads)] for f in first],
            device=device,
        )
        self.heads = layer_heads[:, None].expand(p.tgt_layers, p.tgt_heads, p.inputs)  # shared: stride 0
        wshape = (p.tgt_layers, p.tgt_heads, p.inputs * p.src_dim, p.tgt_dim)
        scale = (p.inputs * p.src_dim) ** -0.5
        self.wk = k_contiguous(torch.randn(wshape, device=device, generator=g) * scale)
        self.wv = k_contiguous(torch.randn(wshape, device=device, generator=g) * scale)
        self.bk = torch.randn(p.tgt_layers, p.tgt_heads, p.tgt_dim, device=device, generator=g)
        self.bv = torch.randn(p.tgt_layers, p.tgt_heads, p.tgt_dim, device=device, generator=g)
        self.sc, self.ss = rope(tokens, p.src_dim, device)
        self.tc, self.ts = rope(tokens, p.tgt_dim, device)
        out = (p.tgt_layers, 1, p.tgt_heads, tokens, p.tgt_dim)
        self.out_k = torch.empty(out, dtype=torch.bfloat16, device=device)
        self.out_v = torch.empty(out, dtype=torch.bfloat16, device=device)
        self.pair, self.tokens = pair, tokens

    def run(self, kernels) -> None:
        """Both launches, into buffers allocated once (as a handoff's cache is)."""
        kernels.map_layers(self.keys, self.rows, self.heads, self.wk, self.bk, self.sc, self.ss,
                           self.tc, self.ts, out=self.out_k, backend="triton")  # fmt: skip
        kernels.map_layers(
            self.values, self.rows, self.heads, self.wv, self.bv, out=self.out_v, backend="triton"
        )

    def bytes_moved(self) -> int:
        p, t = self.pair, self.tokens
        read = 2 * p.tgt_layers * p.inputs * t * p.src_dim * 2
        write = 2 * p.tgt_layers * p.tgt_heads * t * p.tgt_dim * 2
        tables = 4 * t * (p.src_dim + p.tgt_dim) // 2 * 4
        weights = 4 * (self.wk.numel() + self.wv.numel())
        return read + write + tables + weights

    def flop(self) -> int:
        p = self.pair
        return 2 * 2 * p.tgt_layers * self.tokens * p.inputs * p.src_dim * p.tgt_heads * p.tgt_dim

    def errors(self) -> dict[str, float]:
        """Relative error of the kernel's output (written by run()) against float64, per checked
        (layer, keys/values), on CHECK_ROWS target rows spread over the context."""
        p = self.pair
        pick = torch.linspace(0, self.tokens - 1, min(CHECK_ROWS, self.tokens)).long()
        found = {}
        for layer in sorted({0, p.tgt_layers - 1}):
            for kind, src, w, b, out in (("k", self.keys, self.wk, self.bk, self.out_k),
                                         ("v", self.values, self.wv, self.bv, self.out_v)):  # fmt: skip
                want = self._float64(layer, kind == "k", src, w[layer], b[layer], pick)
                got = out[layer, 0][:, pick].double().cpu()
                found[f"{kind}{layer}"] = float((got - want).norm() / want.norm())
        return found

    def _float64(self, layer, keys, src, w, b, pick) -> torch.Tensor:
        """[heads, picked rows, tgt_dim]: the documented formula (kernels/affine.py) in float64."""
        rows = self.rows[0, pick].cpu()
        idx = rows.clamp(min=0)
        hs, at = self.pair.src_heads, idx.to(src[0].device)
        x = torch.cat(
            [src[int(v) // hs][0, int(v) % hs, at].double().cpu() for v in self.heads[layer, 0]], -1
        )
        if keys:
            x = self._unrotate(x, idx)
        z = x @ w.double().cpu() + b.double().cpu()[:, None]  # [heads, rows, dt]
        if keys:
            c, s = self.tc[0, pick].double().cpu(), self.ts[0, pick].double().cpu()
            z = z * c + _rotate_half(z) * s
        return torch.where((rows >= 0)[None, :, None], z, 0.0)

    def _unrotate(self, x, idx) -> torch.Tensor:
        ds = self.pair.src_dim
        c, s = (
            self.sc[0, idx.to(self.sc.device)].double().cpu(),
            self.ss[0, idx.to(self.ss.device)].double().cpu(),
        )
        parts = x.split(ds, -1)
        return torch.cat([(u * c - _rotate_half(u) * s) / (c * c + s * s) for u in parts], -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def measure(case: Case, kernels, timer: Timer, device, tf32_tflops: float) -> dict:
    row = {"pair": case.pair.name, "tokens": case.tokens, "MB": case.bytes_moved() / 1e6}
    case.out_k.fill_(float("nan"))
    case.out_v.fill_(float("nan"))
    case.run(kernels)
    errors = case.errors()
    row["max_rel_err"] = max(errors.values())
    if not row["max_rel_err"] <= ERROR_BOUND:  # NaN (a row left unwritten) fails too
        raise AssertionError(f"wrong output: {errors} (bound {ERROR_BOUND:g})")
    row["eager_ms"] = timer(lambda: case.run(kernels))
    if device.type == "cuda":
        row["graph_ms"] = timer(graphed(lambda: case.run(kernels)))
        row["copy_ms"] = copy_time(timer, case.bytes_moved(), device)
        row["tf32_ms"] = case.flop() / (tf32_tflops * 1e12) * 1e3
        row["of_copy_bw"] = row["copy_ms"] / row["graph_ms"]
        row["of_tf32_peak"] = row["tf32_ms"] / row["graph_ms"]
    return row


_COLUMNS = [("MB", ".0f"), ("eager_ms", ".3f"), ("graph_ms", ".3f"), ("copy_ms", ".3f"),
            ("of_copy_bw", ".0%"), ("tf32_ms", ".3f"), ("of_tf32_peak", ".0%")]  # fmt: skip


def render(info: dict, rows: list[dict]) -> str:
    lines = [
        f"device: {info['device']}; torch {info['torch']}, triton {info['triton']}; {info['date']}; "
        f"kernels: {info['kernels']}",
        "",
        "| pair (bf16, full-head k = 4) | tokens | MB moved | eager ms | graph ms | copy ms | of copy bw "
        "| TF32 ms at peak | of TF32 peak | max rel. err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['pair']} | {r['tokens']} | error: {r['error']} |||||||| ")
            continue
        cells = [format(r[key], spec) if key in r else "-" for key, spec in _COLUMNS]
        lines.append(f"| {r['pair']} | {r['tokens']} | {' | '.join(cells)} | {r['max_rel_err']:.2e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    ap.add_argument("--kernels", type=Path, default=None, help="a kernels/ folder to load instead")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--pair", nargs="+", default=None, help="only pairs whose name contains one of these")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tf32-tflops", type=float, default=494.7, help="dense TF32 peak of the GPU")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json and table.md")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            sys.exit("no CUDA device: use --smoke")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    kernels = load_kernels(args.kernels)
    timer = Timer(device, 2 if args.smoke else args.repeats)
    import triton

    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "kernels": str(args.kernels or "installed"),
        "argv": sys.argv,
    }
    print(json.dumps(info), flush=True)
    rows = []
    for pair in SMOKE_PAIRS if args.smoke else PAIRS:
        if args.pair and not any(part in pair.name for part in args.pair):
            continue
        for tokens in [40] if args.smoke else args.tokens:
            try:
                row = measure(Case(pair, tokens, device), kernels, timer, device, args.tf32_tflops)
            except Exception as e:  # keep the other rows
                row = {"pair": pair.name, "tokens": tokens, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":  # the configurations the autotuner chose, per shape bucket
        info["tuned"] = {str(key): config for key, config in kernels.affine._RESOLVED.items()}
    table = render(info, rows)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps({"info": info, "rows": rows}, indent=1, default=str)
        )
        (args.out / "table.md").write_text(table + "\n")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
