"""Quality against calibration size (issue 37): both fitting methods at several `num_sequences`.

    python benchmarks/calibration_size.py fit --pair qwen1.5b-to-0.5b --methods fullhead cachebridge \\
        --sizes 8 32 128 max [--threads 1]
    python benchmarks/calibration_size.py run --pair qwen1.5b-to-0.5b --bridges fullhead:8 cachebridge:8 \\
        [--limit 48] [--threads 1]
    python benchmarks/calibration_size.py [--out DIR] report [--plot PNG]

`fit` fits one bridge per (method, size) with `bridgecache.fitting.fit_bridge` and
`FitConfig(method=M, num_sequences=N)` (every other field the default: 256 target tokens of the
built-in "prose" calibration split, seed 0); "max" is the most windows that split holds at the
default seq_len for the target's tokenizer (`bridgecache.text.builtin_windows`). Each bridge is
saved under $BRIDGECACHE_HOME/bridges/calibration-size/<pair>-<method>-n<N>/ with its fit seconds
(wall clock, one torch thread) in a JSON beside the reports; an existing bridge is reused.

`run` evaluates the named bridges on the built-in invented-facts task (`facts-choice-512`,
evaluation split, the first --limit items of the 48-item set) with the library behind
`bridgecache eval` (`bridgecache.evaluation.evaluate`), in one pass: per bridge two variants,
`HandoffConfig()` (the default refresh) and `HandoffConfig(refresh=None)` (translation only). The
native, no-context and unrelated-context controls are remembered per (target, item) in
$BRIDGECACHE_HOME/calibration-size/controls.json, so later runs repeat only bridged work (both pairs
share the target and the items). One JSON per (pair, method, size) under --out.

`report` prints one Markdown table per pair (accuracy, retention with its 95% bootstrap interval
over items, the accuracy difference from Full-Head at the largest size measured on the same items
with a paired 95% bootstrap interval, n, fit seconds) and, with --plot, draws retention against
calibration sequences.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

PAIRS = {
    "qwen1.5b-to-0.5b": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
    "smollm2-to-qwen0.5b": ("smollm2-135m", "qwen2.5-coder-0.5b"),
}
METHODS = ("fullhead", "cachebridge")
TASK = "facts-choice-512"
ITEMS = 48  # the built-in item set is drawn for its count: always load 48, then take the first --limit
PREFIX = "2026-12-05-calibration-size"
REFRESH = {"default": "default refresh", "none": "no refresh"}


def _bridge_dir(pair: str, method: str, n: int) -> Path:
    from bridgecache.models.zoo import cache_root

    return cache_root() / "bridges" / "calibration-size" / f"{pair}-{method}-n{n}"


def most_windows(target_tok) -> int:
    """Windows the built-in "prose" calib split holds at FitConfig's default seq_len."""
    from bridgecache.fitting import FitConfig
    from bridgecache.text import builtin_windows

    config = FitConfig()
    return sum(1 for _ in builtin_windows(target_tok, config.seq_len, config.domain, "calib", config.seed))


def _sizes(specs: list[str], target_tok) -> list[int]:
    return [most_windows(target_tok) if s == "max" else int(s) for s in specs]


def fit(args) -> None:
    import torch

    from bridgecache.bridge.maps import Bridge
    from bridgecache.fitting import FitConfig, fit_bridge
    from bridgecache.models.zoo import load_model

    torch.set_num_threads(args.threads)
    source_name, target_name = PAIRS[args.pair]
    target, target_tok = load_model(target_name)
    source, source_tok = load_model(source_name)
    for n in _sizes(args.sizes, target_tok):
        for method in args.methods:
            directory = _bridge_dir(args.pair, method, n)
            record_path = args.out / f"{PREFIX}-fit-{args.pair}-{method}-n{n}.json"
            if (directory / "bridge.json").exists():
                Bridge.from_pretrained(directory)  # loads and checks it
                print(f"{directory} exists; reused", flush=True)
                continue
            config = FitConfig(method=method, num_sequences=n)
            print(f"fitting {args.pair} {method} num_sequences={n} -> {directory}", flush=True)
            start = time.perf_counter()
            bridge = fit_bridge(source, target, source_tok, target_tok, config, progress=False)
            seconds = time.perf_counter() - start
            bridge.calibration["fit_seconds"] = round(seconds, 1)
            bridge.save_pretrained(directory)
            record = {
                "pair": args.pair,
                "method": method,
                "num_sequences": n,
                "fit_config": config.label,
                "fit_s": seconds,
                "threads": args.threads,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "dir": str(directory),
                "r2_key": [layer.r2_key for layer in bridge.layers],
                "r2_value": [layer.r2_value for layer in bridge.layers],
            }
            args.out.mkdir(parents=True, exist_ok=True)
            record_path.write_text(json.dumps(record, indent=1, default=str))
            print(f"  {seconds:.0f} s", flush=True)


def run(args) -> None:
    import torch

    from bridgecache import HandoffConfig
    from bridgecache.bridge.maps import Bridge
    from bridgecache.cli.evaluate import _json_safe
    from bridgecache.evaluation import evaluate, load_items, summarise
    from bridgecache.evaluation.runner import ControlScores, Variant
    from bridgecache.models.zoo import cache_root, load_model

    torch.set_num_threads(args.threads)
    source_name, target_name = PAIRS[args.pair]
    target, target_tok = load_model(target_name)
    source, source_tok = load_model(source_name)
    specs = []
    for spec in args.bridges:
        method, _, size = spec.partition(":")
        n = most_windows(target_tok) if size == "max" else int(size)
        specs.append((method, n, Bridge.from_pretrained(_bridge_dir(args.pair, method, n))))
    configs = {"default": HandoffConfig(), "none": HandoffConfig(refresh=None)}
    variants = {
        (method, n, key): Variant(bridge, config, f"n{n}")
        for method, n, bridge in specs
        for key, config in configs.items()
    }
    controls = ControlScores(args.controls or cache_root() / "calibration-size" / "controls.json")
    task, items = load_items(f"builtin:{TASK}", None, target_tok, ITEMS)
    items = items[: args.limit]
    print(f"{args.pair} {TASK}: {len(items)} items x {len(variants)} variants", flush=True)
    start = time.perf_counter()
    evaluation = evaluate(
        source, source_tok, target, target_tok, items, task, list(variants.values()), controls=controls
    )
    wall = time.perf_counter() - start
    print(f"evaluated in {wall:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for method, n, _ in specs:
        summaries = {
            key: summarise(
                evaluation, variants[(method, n, key)], source=source_name, target=target_name, data=TASK
            )
            for key in configs
        }
        record = {
            "pair": args.pair,
            "method": method,
            "num_sequences": n,
            "task": TASK,
            "limit": args.limit,
            "threads": args.threads,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(sys.argv),
            "wall_s_whole_run": wall,
            "bridges_in_run": len(specs),
            "refresh": {key: config.label for key, config in configs.items()},
            "variants": summaries,
        }
        path = args.out / f"{PREFIX}-{args.pair}-{method}-n{n}{args.suffix}.json"
        path.write_text(json.dumps(_json_safe(record), indent=1))
        for key, s in summaries.items():
            print(f"  {method:<11} n={n:<4} {REFRESH[key]:<15} {_cell(s)}", flush=True)


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _interval(lo_hi) -> str:
    lo, hi = lo_hi or (None, None)
    return "" if lo is None else f" [{100 * lo:.0f}, {100 * hi:.0f}]"


def _cell(s: dict) -> str:
    return (
        f"acc {_pct(s['acc_bridged'])}{_interval(s.get('acc_bridged_ci'))}, "
        f"retention {_pct(s['retention'])}{_interval(s.get('retention_ci'))}, n {s['n']}"
    )


def _records(out: Path) -> tuple[list[dict], dict]:
    runs = [
        json.loads(p.read_text()) for p in sorted(out.glob(f"{PREFIX}-*-n*.json")) if "-fit-" not in p.name
    ]
    fits = {}
    for p in sorted(out.glob(f"{PREFIX}-fit-*.json")):
        r = json.loads(p.read_text())
        fits[(r["pair"], r["method"], r["num_sequences"])] = r["fit_s"]
    return runs, fits


def _correct(summary: dict) -> dict[int, int]:
    """item index -> 1 if the bridged pick was the answer."""
    return {r["index"]: int(r["pick_bridged"] == r["answer"]) for r in summary["items"]}


def _paired(summary: dict, reference: dict | None) -> str:
    """Accuracy minus the reference's on the same items, with a paired 95% bootstrap interval."""
    from bridgecache.evaluation.metrics import bootstrap_ci

    if reference is None or reference is summary:
        return "-"
    a, b = _correct(summary), _correct(reference)
    common = sorted(set(a) & set(b))
    diff = [a[i] - b[i] for i in common]
    lo, hi = bootstrap_ci(len(diff), lambda ix: sum(diff[i] for i in ix) / len(ix))
    return f"{100 * sum(diff) / len(diff):+.1f} [{100 * lo:+.0f}, {100 * hi:+.0f}]"


def report(args) -> None:
    runs, fits = _records(args.out)
    for pair in PAIRS:
        rows = sorted(
            (r for r in runs if r["pair"] == pair),
            key=lambda r: (METHODS.index(r["method"]), r["num_sequences"], r["limit"]),
        )
        if not rows:
            continue
        s0 = rows[0]["variants"]["none"]
        print(f"\n### {pair} ({TASK}, {s0['n']} items)\n")
        print(
            f"native accuracy {_pct(s0['acc_native'])}; no context {_pct(s0['acc_no_context'])}; "
            f"unrelated context {_pct(s0['acc_other_native'])}\n"
        )
        full = [r for r in rows if r["method"] == "fullhead"]
        ref = max(full, key=lambda r: r["num_sequences"]) if full else None
        ref_n = ref["num_sequences"] if ref else "-"
        print(
            "| method | calibration sequences | default refresh: accuracy | retention [95%] "
            f"| vs fullhead {ref_n} (points, paired) | no refresh: accuracy | retention [95%] "
            f"| vs fullhead {ref_n} (points, paired) | n | fit s |"
        )
        print("|---|---:|---|---|---|---|---|---|---:|---:|")
        for r in rows:
            d, p = r["variants"]["default"], r["variants"]["none"]
            fit_s = fits.get((pair, r["method"], r["num_sequences"]))
            ref_d, ref_p = (ref["variants"]["default"], ref["variants"]["none"]) if ref else (None, None)
            print(
                f"| {r['method']} | {r['num_sequences']} "
                f"| {_pct(d['acc_bridged'])}{_interval(d.get('acc_bridged_ci'))} "
                f"| {_pct(d['retention'])}{_interval(d.get('retention_ci'))} "
                f"| {_paired(d, ref_d if r is not ref else d)} "
                f"| {_pct(p['acc_bridged'])}{_interval(p.get('acc_bridged_ci'))} "
                f"| {_pct(p['retention'])}{_interval(p.get('retention_ci'))} "
                f"| {_paired(p, ref_p if r is not ref else p)} "
                f"| {d['n']} | {'-' if fit_s is None else f'{fit_s:.0f}'} |"
            )
    if args.plot:
        _plot(runs, args.plot)


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [p for p in PAIRS if any(r["pair"] == p for r in runs)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(6.0 * len(pairs), 4.2), squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        for method, color in zip(METHODS, ("tab:blue", "tab:orange")):
            rows = sorted((r for r in runs if r["pair"] == pair and r["method"] == method),
                          key=lambda r: r["num_sequences"])  # fmt: skip
            for key, style, shift in (("default", "-", 0.97), ("none", "--", 1.03)):
                if not rows:
                    continue
                xs = [r["num_sequences"] * shift for r in rows]
                ss = [r["variants"][key] for r in rows]
                ys = [100 * s["retention"] for s in ss]
                err = [
                    [100 * (s["retention"] - s["retention_ci"][0]) for s in ss],
                    [100 * (s["retention_ci"][1] - s["retention"]) for s in ss],
                ]
                ax.errorbar(xs, ys, yerr=err, fmt=style, marker="o", capsize=3, color=color,
                            label=f"{method}, {REFRESH[key]}")  # fmt: skip
        ax.axhline(100, color="grey", lw=0.6)
        control = next(r["variants"]["default"] for r in runs if r["pair"] == pair)
        unrelated = 100 * control["acc_other_native"] / control["acc_native"]
        ax.axhline(unrelated, color="grey", lw=0.8, ls=":", label="unrelated context (control)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"calibration sequences (x {256} target tokens)")
        ax.set_ylabel("retention: bridged / native accuracy (%)")
        ax.set_title(f"{pair}, {TASK}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "reports",
        help="raw results (default benchmarks/reports)",
    )
    sub = parser.add_subparsers(required=True)
    f = sub.add_parser("fit")
    f.add_argument("--pair", required=True, choices=list(PAIRS))
    f.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    f.add_argument("--sizes", nargs="+", default=["8", "32", "128", "max"], help="num_sequences, or max")
    f.add_argument("--threads", type=int, default=1)
    f.set_defaults(func=fit)
    r = sub.add_parser("run")
    r.add_argument("--pair", required=True, choices=list(PAIRS))
    r.add_argument("--bridges", nargs="+", required=True, help="METHOD:N (N a count or max)")
    r.add_argument("--limit", type=int, default=ITEMS)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--controls", type=Path)
    r.add_argument("--suffix", default="", help="added to the JSON names (e.g. -timing)")
    r.set_defaults(func=run)
    p = sub.add_parser("report")
    p.add_argument("--plot", type=Path)
    p.set_defaults(func=report)
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.func(args)


if __name__ == "__main__":
    main()
