"""Fit time, peak memory, mapper size and held-out R^2 of both fitting methods, on CPU.

    python benchmarks/fit_cpu.py [--source qwen2.5-coder-1.5b --target qwen2.5-coder-0.5b
                                  --calib-seqs 32 --seq-len 256 --methods fullhead cachebridge
                                  --stats-precision bf16-gemm]

Each method runs in its own subprocess (so peak RSS is that method's alone) on the same
calibration data; the fitted bridges are saved under ~/.cache/bridgecache/bridges/. Fit time
excludes loading the models; peak RSS includes them (their RSS after loading and one warm-up
forward of each is shown apart).
Prints Markdown tables and writes the raw numbers as JSON (--results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

SHORT = {"qwen2.5-coder-1.5b": "qwen1.5b", "qwen2.5-coder-0.5b": "0.5b"}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(args) -> None:
    """Fit one method and write its numbers to args.worker_out (runs in a fresh process)."""
    import torch

    from bridgecache.fitting import FitConfig, fit_bridge
    from bridgecache.models.zoo import load_model

    torch.set_num_threads(args.threads)
    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    with torch.no_grad():  # warm up: touch every (memory-mapped) weight once before measuring
        for model in (source, target):
            model(torch.zeros(1, args.seq_len, dtype=torch.long))
    loaded = _rss_mib()
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    config = FitConfig(
        method=args.worker, num_sequences=args.calib_seqs, seq_len=args.seq_len, layers_k=args.layers_k,
        domain=args.domain, stats_precision=args.stats_precision or FitConfig.stats_precision,
    )  # fmt: skip
    bridge = fit_bridge(
        source, target, source_tok, target_tok, config, source_name=args.source, target_name=args.target,
        progress=False,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    peak = _rss_mib()
    bridge.save_pretrained(args.save)
    result = {
        "method": args.worker,
        "stats_precision": config.stats_precision,
        "heldout_cosine": (bridge.calibration.get("heldout_scores") or {}).get("attention_cosine"),
        "layers_k": bridge.calibration["layers_k"],
        "weighting": bridge.calibration["weighting"],
        "fit_s": seconds,
        "loadavg": [load_before, os.getloadavg()[0]],  # 1-minute load average before / after
        "rss_loaded_mib": loaded,
        "rss_peak_mib": peak,
        "bytes": bridge.nbytes(),
        "params": bridge.num_parameters(),
        "rows": bridge.calibration["rows"],
        "r2_key": [layer.r2_key for layer in bridge.layers],
        "r2_value": [layer.r2_value for layer in bridge.layers],
        "source_layers": [layer.source_layers for layer in bridge.layers],
        "saved": str(args.save),
    }
    Path(args.worker_out).write_text(json.dumps(result))


def report(results: list[dict], args) -> str:
    lines = [
        f"`{' '.join(['python', 'benchmarks/fit_cpu.py', *sys.argv[1:]])}` on {date.today().isoformat()}, "
        f"{platform.machine()} {os.cpu_count()} cores, {args.threads} torch threads, torch "
        f"{_version('torch')}, transformers {_version('transformers')}; calibration {args.calib_seqs} x "
        f"{args.seq_len} tokens of {args.domain} (bridgecache.text calib split).",
        "",
        "| method | k | weighting | fit time (s) | peak RSS (MiB) | RSS of models, warm (MiB) | mapper bytes "
        "| parameters | mean R^2 K | mean R^2 V | load avg before/after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mk, mv = sum(r["r2_key"]) / len(r["r2_key"]), sum(r["r2_value"]) / len(r["r2_value"])
        lines.append(
            f"| {r['method']} | {r['layers_k']} | {r['weighting']} | {r['fit_s']:.0f} | "
            f"{r['rss_peak_mib']:.0f} | {r['rss_loaded_mib']:.0f} | {r['bytes']:,} | {r['params']:,} | "
            f"{mk:.3f} | {mv:.3f} | {r['loadavg'][0]:.1f} / {r['loadavg'][1]:.1f} |"
        )
    if len(results) == 2:
        lines.append(f"\nmapper size ratio {results[0]['method']} / {results[1]['method']}: "
                     f"{results[0]['bytes'] / results[1]['bytes']:.1f}x")  # fmt: skip
    rows = results[0]["rows"]
    lines.append(f"\nrows: {rows['train']} training, {rows['heldout']} held-out (R^2 on the held-out rows)\n")
    head = "| target layer | " + " | ".join(
        f"{r['method']} sources | {r['method']} R^2 K | {r['method']} R^2 V" for r in results
    )
    lines += [head + " |", "|---" * (1 + 3 * len(results)) + "|"]
    for t in range(len(results[0]["r2_key"])):
        cells = [
            f"{','.join(map(str, r['source_layers'][t]))} | {r['r2_key'][t]:.3f} | {r['r2_value'][t]:.3f}"
            for r in results
        ]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _version(name: str) -> str:
    return __import__(name).__version__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default="qwen2.5-coder-1.5b")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument("--calib-seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--domain", default="prose")
    parser.add_argument("--layers-k", type=int, default=None, help="override both methods' default k")
    parser.add_argument("--methods", nargs="+", default=["fullhead", "cachebridge"])
    parser.add_argument("--stats-precision", default=None, help="FitConfig.stats_precision (None: default)")
    parser.add_argument("--compare-with", help="another run's --results: each method compared with it")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--results", default="fit_cpu.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    from bridgecache.models.zoo import cache_root

    results = []
    for method in args.methods:
        name = f"{SHORT.get(args.source, args.source)}-to-{SHORT.get(args.target, args.target)}-{method}"
        name += f"-{args.stats_precision}" if args.stats_precision else ""
        save = cache_root() / "bridges" / name
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                method,
                "--worker-out",
                out.name,
                "--save",
                str(save),
            ]
            cmd += ["--source", args.source, "--target", args.target, "--calib-seqs", str(args.calib_seqs)]
            cmd += ["--seq-len", str(args.seq_len), "--domain", args.domain, "--threads", str(args.threads)]
            cmd += ["--layers-k", str(args.layers_k)] if args.layers_k else []
            cmd += ["--stats-precision", args.stats_precision] if args.stats_precision else []
            print(f"fitting {method} ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
            results.append(json.loads(Path(out.name).read_text()))
    Path(args.results).write_text(json.dumps(results, indent=1))
    print(report(results, args))
    if args.compare_with:
        print(comparison(results, json.loads(Path(args.compare_with).read_text())))
    return 0


def comparison(results: list[dict], others: list[dict]) -> str:
    """Each method against the same method in another run's results (e.g. another statistics
    precision): held-out R^2 and attention cosine per layer, and the saved maps' relative
    difference ||a - b|| / ||b|| (the largest over the layers)."""
    from fit_gpu import maps_difference  # benchmarks/: the same maps' difference as its GPU fits

    from bridgecache import Bridge

    lines = [
        "| method | vs | max abs diff R^2 K | R^2 V | attention cosine (means) | max abs diff cosine "
        "| same source layers | max rel diff key W | key b | value W | value b |",
        "|---|---|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        o = next(x for x in others if x["method"] == r["method"])
        dk = max(abs(a - b) for a, b in zip(r["r2_key"], o["r2_key"]))
        dv = max(abs(a - b) for a, b in zip(r["r2_value"], o["r2_value"]))
        ca, cb = r["heldout_cosine"], o["heldout_cosine"]
        dc = max(abs(a - b) for a, b in zip(ca, cb))
        moved = maps_difference(Bridge.from_pretrained(r["saved"]), Bridge.from_pretrained(o["saved"]))
        diffs = [f"{v:.4f}" for v in moved.values()]
        lines.append(
            f"| {r['method']} ({r['stats_precision']}) | {o['stats_precision']} | {dk:.1e} | {dv:.1e} "
            f"| {sum(ca) / len(ca):.4f} / {sum(cb) / len(cb):.4f} | {dc:.1e} "
            f"| {r['source_layers'] == o['source_layers']} | {' | '.join(diffs)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
