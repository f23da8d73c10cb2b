"""Fit real-scale pairs on one GPU: random weights at the published configs, bf16, sdpa.

    python benchmarks/fit_gpu.py --tokenizer DIR --out DIR [--pairs Qwen3-14B]   # CUDA machine
    python benchmarks/fit_gpu.py --tokenizer DIR --smoke --out DIR  # tiny configs on CPU
    python benchmarks/fit_gpu.py --tokenizer DIR --out DIR --seqs 64 --profile   # where time goes
    python benchmarks/fit_gpu.py --tokenizer DIR --out DIR --pairs Qwen3-14B --depth 0.5  # a smaller GPU

Pairs: Qwen2.5-7B -> Qwen2.5-1.5B and Qwen3-14B -> Qwen3-32B (transformers config classes, built
directly on the GPU, both models resident on cuda:0); the Qwen2.5 tokenizer for both. Each method
(fullhead, cachebridge) is fitted with `fit_bridge` and FitConfig(num_sequences=--seqs,
seq_len=--seq-len, domain="mixed"), every other option its default (the prose alone holds too few
windows of 1024 tokens: "mixed" fills with code). Per fit: whole fit (wall clock), each phase's
seconds (bridgecache.fitting.phases: forwards, probes, statistics, solve, scoring; CUDA
synchronised at each phase's end), construction = probes + statistics + solve (the model
forwards excluded), peak memory beside the models' own, the statistics' passes over the text and
the mean held-out attention cosine (random weights: a smoke number, not a quality number).

The Qwen2.5 pair alone took about 200 s on an H200 (benchmarks/reports/fit-gpu-2026-12-03.md):
give each pair its own call where calls are time-limited. Writes results.json and report.md
under --out after every fit (a run cut short keeps what it
finished). The random-weight models say nothing of quality; benchmarks/reports/quality.md does.

--depth F: both models keep round(F x) of their layers, every width as published: a pair whose
weights do not fit the GPU at hand (Qwen3-14B -> 32B, 95 GB, on an 80 GB H100) is fitted at a
fraction of its depth; the forwards, statistics and scoring scale with the layers, the per-layer
work is the real one. Its rows are named "(depth F)" and are not the full pair's.

--profile: each fit once more (--profile-seqs sequences) under torch.profiler and cProfile after
its timed run: per phase
the kernels and the GPU's busy share, the top operators by GPU time and by host time, and the
top Python functions (written to profile-<pair>-<method>.txt under --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

GiB = 2**30

# The published configs (config.json of each Hugging Face repo), the fields that shape the work.
_QWEN = dict(vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6)
CONFIGS = {
    "Qwen2.5-7B": ("qwen2", _QWEN | dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=131072,
    )),
    "Qwen2.5-1.5B": ("qwen2", _QWEN | dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=131072,
    )),
    "Qwen3-14B": ("qwen3", _QWEN | dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960,
    )),
    "Qwen3-32B": ("qwen3", _QWEN | dict(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960,
    )),
}  # fmt: skip
PAIRS = [("Qwen2.5-7B", "Qwen2.5-1.5B"), ("Qwen3-14B", "Qwen3-32B")]
METHODS = ("fullhead", "cachebridge")
PHASES = ("text", "forwards", "probes", "statistics", "solve", "scoring")
# --smoke: the same families, a few layers and narrow widths (the heads keep their real shapes).
SMOKE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=2)


def build(name: str, device, dtype, smoke: bool, depth: float = 1.0):
    """A random-weight model of `name`'s published config, built on `device` in `dtype`, sdpa;
    `depth` < 1 keeps that fraction of its layers (at least one)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    family, fields = CONFIGS[name]
    fields = dict(fields)
    if smoke:
        kv = fields["num_key_value_heads"]
        fields |= SMOKE | dict(num_key_value_heads=kv, num_attention_heads=2 * kv, head_dim=128)
    fields["num_hidden_layers"] = max(1, round(fields["num_hidden_layers"] * depth))
    config = (Qwen2Config if family == "qwen2" else Qwen3Config)(**fields)
    if family == "qwen2":
        config.head_dim = fields.get("head_dim", config.hidden_size // config.num_attention_heads)
    config.rope_parameters = {"rope_type": "default", "rope_theta": fields["rope_theta"]}
    torch.manual_seed(list(CONFIGS).index(name))  # other weights per model (--smoke shapes can coincide)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def fit_one(
    source, target, tok, method: str, args, device, precision: str | None = None
) -> tuple[dict, object]:
    """One timed fit: (its row, the bridge). precision: FitConfig.stats_precision (None: default)."""
    from bridgecache.fitting import FitConfig, fit_bridge
    from bridgecache.fitting.phases import PhaseClock

    config = FitConfig(method=method, num_sequences=args.seqs, seq_len=args.seq_len, domain="mixed")
    config = config.replace(stats_precision=precision or config.stats_precision)
    if args.score_sequences is not None:
        count = None if args.score_sequences == "all" else int(args.score_sequences)
        config = config.replace(score_sequences=count)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        models = torch.cuda.memory_allocated(device)
    clock = PhaseClock(device)
    start = time.perf_counter()
    bridge = fit_bridge(source, target, tok, tok, config, progress=not args.no_progress, clock=clock)
    if cuda:
        torch.cuda.synchronize(device)
    whole = time.perf_counter() - start
    phases = clock.report()
    seconds = {name: v["s"] for name, v in phases.items() if isinstance(v, dict)}
    row = {
        "method": method,
        "stats_precision": config.stats_precision,
        "whole_fit_s": round(whole, 2),
        "construction_s": round(sum(seconds.get(p, 0.0) for p in ("probes", "statistics", "solve")), 2),
        "phases": phases,
        "statistics_passes": bridge.calibration.get("statistics_passes"),
        "batch_sequences": bridge.calibration.get("batch_sequences"),
        "rows": bridge.calibration.get("rows"),
        "heldout_cosine_mean": (bridge.calibration.get("heldout_scores") or {}).get("mean"),
        "heldout_sequences_scored": (bridge.calibration.get("heldout_scores") or {}).get("sequences"),
        "heldout_scores_error": bridge.calibration.get("heldout_scores_error"),
        "layer_maps_finite": all(
            bool(torch.isfinite(t).all())
            for layer in bridge.layers
            for t in (layer.key_weight, layer.value_weight)
        ),
    }
    if cuda:
        row["models_GiB"] = round(models / GiB, 2)
        row["peak_GiB"] = round(torch.cuda.max_memory_allocated(device) / GiB, 2)
        row["fit_own_peak_GiB"] = round(row["peak_GiB"] - row["models_GiB"], 2)
        row["device_total_GiB"] = round(torch.cuda.get_device_properties(device).total_memory / GiB, 2)
    return row, bridge


def maps_difference(bridge, reference) -> dict:
    """Per map kind, the largest relative difference ||a - b|| / ||b|| over the layers (the same
    method fitted at two statistics precisions: what the precision changes in the maps)."""
    out = {}
    for name in ("key_weight", "key_bias", "value_weight", "value_bias"):
        rel = [
            float(
                (getattr(a, name).double() - getattr(b, name).double()).norm()
                / getattr(b, name).double().norm()
            )
            for a, b in zip(bridge.layers, reference.layers)
        ]
        out[name] = round(max(rel), 6)
    return out


def profile_fit(source, target, tok, method: str, args, device, path: Path) -> None:
    """One more fit under torch.profiler (CPU + CUDA) and cProfile: where its time goes, per phase."""
    import cProfile
    import io
    import pstats

    from bridgecache.fitting import FitConfig, fit_bridge
    from bridgecache.fitting.phases import PhaseClock

    config = FitConfig(method=method, num_sequences=args.profile_seqs, seq_len=args.seq_len, domain="mixed")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    clock = PhaseClock(device)
    host = cProfile.Profile()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        host.enable()
        fit_bridge(source, target, tok, tok, config, progress=False, clock=clock)
        host.disable()
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6
    out = io.StringIO()
    out.write(f"{method}: {wall:.2f} s wall under the profilers, {len(kernels)} kernels, GPU busy "
              f"{busy:.2f} s ({busy / wall:.0%}); phases: {json.dumps(clock.report())}\n\n")  # fmt: skip
    averages = prof.key_averages()
    out.write(averages.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    out.write("\n")
    out.write(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    stats = pstats.Stats(host, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    path.write_text(out.getvalue())
    print(out.getvalue()[:6000], flush=True)


def render(info: dict, rows: list[dict]) -> str:
    lines = [
        f"# Fitting on one GPU: random weights at the published configs ({info['date']})",
        "",
        f"device: {info['device']}; torch {info['torch']}, transformers {info['transformers']}; "
        f'{info["seqs"]} sequences x {info["seq_len"]} tokens (domain "mixed"), bf16, sdpa, both models on '
        f"{info['where']}; command: `{info['command']}`{'; ' + info['label'] if info.get('label') else ''}",
        "",
        "| pair | method | whole fit s | construction s (probes + statistics + solve) | text s | forwards s "
        "| probes s | statistics s | solve s | scoring s | forward tok/s | statistics passes | batch "
        "| models GiB | peak GiB | fit's own GiB | held-out cosine (sequences) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['pair']} | {r.get('method', '-')} | error: {r['error'][:200]} |")
            continue
        ph = r["phases"]
        s = {name: f"{ph[name]['s']:.2f}" if name in ph else "-" for name in PHASES}
        rate = (ph.get("forwards") or {}).get("tokens_per_s")
        lines.append(
            f"| {r['pair']} | {r['method']} ({r.get('stats_precision', 'tf32x3')}) | {r['whole_fit_s']:.1f} "
            f"| {r['construction_s']:.2f} "
            f"| {' | '.join(s[name] for name in PHASES)} | {rate or '-'} "
            f"| {r['statistics_passes']} | {r.get('batch_sequences', '-')} | {r.get('models_GiB', '-')} "
            f"| {r.get('peak_GiB', '-')} "
            f"| {r.get('fit_own_peak_GiB', '-')} | {r['heldout_cosine_mean']} "
            f"({r.get('heldout_sequences_scored', '-')}) |"
        )
    lines += [
        "",
        "text: reading and tokenizing the calibration text; forwards: both models over it (KV capture, "
        "un-rotation, attention weights for cachebridge), once for the probes and once per statistics "
        "pass; forward tok/s counts the rows fitted. Peak: torch.cuda.max_memory_allocated during the "
        "fit; models: allocated before it. A scoring error (if any) is in results.json; the bridge is "
        "kept all the same.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="the Qwen2.5 tokenizer (a folder)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seqs", type=int, default=500)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--pairs", nargs="+", default=None, help="e.g. Qwen3-14B (pairs whose names contain it)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument(
        "--precisions",
        nargs="+",
        default=[None],
        help="FitConfig.stats_precision values, each fitted "
        "in turn (default: the default); later ones' maps are compared with the first's",
    )
    ap.add_argument("--smoke", action="store_true", help="a few narrow layers per model, on CPU")
    ap.add_argument("--budget-s", type=float, default=math.inf, help="start no fit after this many seconds")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--depth", type=float, default=1.0, help="fraction of the layers built (0-1]")
    ap.add_argument(
        "--score-sequences", default=None, help="FitConfig.score_sequences: a count or all (default: its own)"
    )
    ap.add_argument("--label", default="", help="what code or setting this run is, kept in results.json")
    ap.add_argument("--profile", action="store_true", help="each fit again under the profilers")
    ap.add_argument("--profile-seqs", type=int, default=64, help="sequences of the profiled fits")
    args = ap.parse_args()
    if not 0 < args.depth <= 1:
        ap.error(f"--depth must be in (0, 1], got {args.depth}")
    from transformers import AutoTokenizer

    device = torch.device("cpu" if args.smoke else "cuda:0")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --smoke")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    info = {
        "device": name, "torch": torch.__version__, "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seqs": args.seqs, "seq_len": args.seq_len,
        "depth": args.depth, "where": str(device), "label": args.label,
        "command": " ".join(["python benchmarks/fit_gpu.py", *sys.argv[1:]]),
    }  # fmt: skip
    print(json.dumps(info), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.perf_counter()
    for source_name, target_name in PAIRS:
        pair = f"{source_name} -> {target_name}"
        if args.pairs and not any(p in pair for p in args.pairs):
            continue
        if args.depth != 1:
            pair += f" (depth {args.depth:g})"
        firsts: dict = {}  # method -> (precision, bridge) of its first fit
        try:
            t0 = time.perf_counter()
            source = build(source_name, device, dtype, args.smoke, args.depth)
            target = build(target_name, device, dtype, args.smoke, args.depth)
            built = round(time.perf_counter() - t0, 1)
        except Exception as e:  # keep the other pair
            rows.append({"pair": pair, "error": f"building: {type(e).__name__}: {e}"[:500]})
            continue
        for precision, method in itertools.product(args.precisions, args.methods):
            if time.perf_counter() - started > args.budget_s:
                rows.append({"pair": pair, "method": method, "error": "skipped: --budget-s spent"})
                continue
            try:
                row, bridge = fit_one(source, target, tok, method, args, device, precision)
                row = {"pair": pair, "build_s": built, **row}
                first = firsts.setdefault(method, (row["stats_precision"], bridge))
                if first[1] is not bridge:
                    row["maps_rel_diff_vs"] = {first[0]: maps_difference(bridge, first[1])}
            except Exception as e:
                row = {"pair": pair, "method": method, "error": f"{type(e).__name__}: {e}"[:500]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.profile and device.type == "cuda":
                slug = f"{source_name}-{target_name}-{method}".lower()
                profile_fit(source, target, tok, method, args, device, args.out / f"profile-{slug}.txt")
            (args.out / "results.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
            (args.out / "report.md").write_text(render(info, rows))
        del source, target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (args.out / "results.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    (args.out / "report.md").write_text(render(info, rows))
    print(render(info, rows), flush=True)


if __name__ == "__main__":
    main()
