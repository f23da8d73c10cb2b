"""Quality of bridges on the built-in model pairs: the tables and plots of benchmarks/reports/quality.md.

    python benchmarks/quality.py run --pair qwen1.5b-to-0.5b [--tasks prose-ppl code-ppl facts-choice]
        [--limit 16] [--methods fullhead cachebridge] [--anchors 1:0 1:32] [--fit domain=mixed ...]
        [--refresh 0.2 | none] [--tag default] [--threads 1]
    python benchmarks/quality.py report [--tags default ...] [--plots DIR --plot-tag TAG --r2-tag TAG]

`run` measures every variant (method x native anchors, `head:tail`) of one pair with the library
call behind `bridgecache eval` (`bridgecache.evaluation.evaluate`), each a `HandoffConfig` with
those anchors and the default token refresh (`--refresh none`: the translation alone, what the
bridge itself recovers; a fraction or a token count: that refresh, chosen by the source's
attention from the prompt). One pass over the data serves
all variants, so the source prefill, the target's native prefills and the controls are computed
once. Each (tag, pair, task) writes one JSON under --raw ($BRIDGECACHE_HOME/quality by default):
the `bridgecache eval --json` summary of every variant, the fit options and the bridges' per-layer
R^2, and the `bridgecache eval` command that reproduces each variant alone.
Bridges are fitted once per (pair, method, fit options) with `fit_bridge` on the CALIBRATION split
and cached under $BRIDGECACHE_HOME/bridges/quality/; the identity pair uses `Bridge.identity`.
`--threads 1` by default: on a shared 2-core machine two threads spin-wait and run 3-10x slower.

`report` reads the JSON files and prints the Markdown tables; with --plots DIR it writes
content_gain_vs_length.png, retention_vs_length.png and r2_per_layer.png there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
import time
from pathlib import Path

PAIRS = {
    "smollm2-identity": ("smollm2-135m", "smollm2-135m"),
    "qwen1.5b-to-0.5b": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
    "qwen0.5b-to-gemma": ("qwen2.5-coder-0.5b", "gemma3-270m"),
    "smollm2-to-qwen0.5b": ("smollm2-135m", "qwen2.5-coder-0.5b"),
}
METHODS = ("fullhead", "cachebridge")


def _default_raw() -> Path:
    from bridgecache.models.zoo import cache_root

    return cache_root() / "quality"


def _parse_fit(options: list[str]) -> dict:
    """key=value fit options -> FitConfig fields (ints and floats parsed)."""
    out = {}
    for option in options:
        key, _, value = option.partition("=")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        out[key] = value
    return out


def _bridge_dir(pair: str, method: str, fit: dict) -> Path:
    from bridgecache.models.zoo import cache_root

    digest = hashlib.sha256(json.dumps(fit, sort_keys=True).encode()).hexdigest()[:8]
    return cache_root() / "bridges" / "quality" / f"{pair}-{method}-{digest}"


def _bridge(pair: str, method: str, fit: dict, models, given: dict[str, str]):
    """(bridge, directory): the given directory, the cached fit, or a fresh fit (then cached)."""
    from bridgecache.bridge.maps import Bridge
    from bridgecache.fitting import FitConfig, fit_bridge

    source, source_tok, target, target_tok = models
    source_name, target_name = PAIRS[pair]
    if method in given:
        directory = Path(given[method])
        return Bridge.from_pretrained(directory), directory
    directory = _bridge_dir(pair, method, fit)
    if (directory / "bridge.json").exists():
        return Bridge.from_pretrained(directory), directory
    if source_name == target_name:
        bridge = Bridge.identity(target, target_tok)
    else:
        print(f"fitting {method} {pair} with {fit or 'default options'} -> {directory}", flush=True)
        start = time.perf_counter()
        bridge = fit_bridge(source, target, source_tok, target_tok, FitConfig(method=method, **fit))
        bridge.calibration["fit_seconds"] = round(time.perf_counter() - start, 1)
    bridge.save_pretrained(directory)
    return bridge, directory


def _refresh(text: str) -> float | int | None:
    """--refresh: a fraction (has a point), a token count, or none."""
    if text == "none":
        return None
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a fraction like 0.2, a count, or none"
        ) from None


def _finite(values) -> list:
    return [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values]


def run(args) -> None:
    import torch

    from bridgecache import HandoffConfig, RefreshConfig
    from bridgecache.cli.evaluate import _json_safe
    from bridgecache.evaluation import Variant, evaluate, load_items, summarise
    from bridgecache.models.zoo import load_model

    torch.set_num_threads(args.threads)
    source_name, target_name = PAIRS[args.pair]
    fit = _parse_fit(args.fit)
    given = dict(option.split("=", 1) for option in args.bridge)
    target, target_tok = load_model(target_name)
    source, source_tok = (target, target_tok) if source_name == target_name else load_model(source_name)
    models = (source, source_tok, target, target_tok)
    methods = ["identity"] if source_name == target_name else args.methods
    bridges = {
        m: _bridge(args.pair, m if m != "identity" else "identity", fit, models, given) for m in methods
    }
    anchors = [tuple(int(x) for x in a.split(":")) for a in args.anchors]
    refresh = None if args.refresh is None else RefreshConfig(args.refresh)
    configs = [
        HandoffConfig(native_head=head, native_tail=tail, key_norm=not args.no_key_norm, refresh=refresh)
        for head, tail in anchors
    ]
    variants = [Variant(bridges[m][0], config) for m in methods for config in configs]

    for task_name in args.tasks:
        data = f"builtin:{task_name}"
        out = args.raw / args.tag / args.pair / f"{task_name}.json"
        if out.exists() and not args.overwrite:
            print(f"{out} exists; skipping (--overwrite to redo)", flush=True)
            continue
        task, items = load_items(data, None, target_tok, args.limit)
        print(f"{args.pair} {data}: {len(items)} items x {len(variants)} variants", flush=True)
        start = time.perf_counter()
        evaluation = evaluate(source, source_tok, target, target_tok, items, task, variants)
        summaries = []
        for variant, method in zip(variants, [m for m in methods for _ in anchors]):
            summary = summarise(evaluation, variant, source=source_name, target=target_name, data=data)
            directory = bridges[method][1]
            command = [
                "bridgecache",
                "eval",
                "--bridge",
                str(directory),
                "--data",
                data,
                "--limit",
                str(args.limit),
            ]
            config = variant.config
            command += ["--native-head", str(config.native_head), "--native-tail", str(config.native_tail)]
            command += [] if config.key_norm else ["--no-key-norm"]
            command += ["--refresh", "none" if args.refresh is None else str(args.refresh)]
            summary["command"] = shlex.join(command)
            summaries.append(summary)
        record = {
            "pair": args.pair,
            "tag": args.tag,
            "task": task_name,
            "fit": fit,
            "threads": args.threads,
            "wall_s": time.perf_counter() - start,
            "bridges": {
                m: {
                    "dir": str(d),
                    "method": b.method,
                    "r2_key": _finite([layer.r2_key for layer in b.layers]),
                    "r2_value": _finite([layer.r2_value for layer in b.layers]),
                    "calibration": b.calibration,
                }
                for m, (b, d) in bridges.items()
            },
            "variants": summaries,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_json_safe(record), indent=1))
        print(f"wrote {out} ({record['wall_s']:.0f} s)", flush=True)
        for s in summaries:
            print("  " + _one_line(s), flush=True)


def _one_line(s: dict) -> str:
    name = f"{s['method']} {s['native_head']}:{s['native_tail']}"
    if s["task"] == "ppl":
        return (
            f"{name:<18} context-gain {_pct(s['context_gain_recovered'])}  "
            f"content-gain {_pct(s['content_gain_recovered'])}  speedup {s['speedup']:.1f}x"
        )
    accuracy = f"acc {_pct(s['acc_bridged'])} / native {_pct(s['acc_native'])}"
    return f"{name:<18} {accuracy}  retention {_pct(s['retention'])}"


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


# ---------------------------------------------------------------------- report


def _records(raw: Path, tags: list[str] | None) -> list[dict]:
    records = [json.loads(p.read_text()) for p in sorted(raw.glob("*/*/*.json"))]
    return [r for r in records if tags is None or r["tag"] in tags]


def _length(task: str) -> int:
    from bridgecache.evaluation.builtin import DEFAULT_LENGTH

    tail = task.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else DEFAULT_LENGTH


def _ci(s: dict, key: str) -> str:
    lo, hi = s.get(f"{key}_ci") or (None, None)
    return "" if lo is None else f" [{100 * lo:.0f}, {100 * hi:.0f}]"


def _row_head(r: dict, s: dict) -> str:
    anchors = f"{s['native_head']}:{s['native_tail']}"
    return f"{r['pair']} | {r['tag']} | {r['task']} | {s['n']} | {s['method']} | {anchors}"


def _pair_order(record: dict) -> tuple:
    return (list(PAIRS).index(record["pair"]), record["tag"], _length(record["task"]), record["task"])


def report(args) -> None:
    records = sorted(_records(args.raw, args.tags), key=_pair_order)
    ppl = [(r, s) for r in records for s in r["variants"] if s["task"] == "ppl"]
    choice = [(r, s) for r in records for s in r["variants"] if s["task"] == "choice"]
    print("### Perplexity tasks (mean NLL per continuation token; gains in log-likelihood; 95% CI)\n")
    print(
        "| pair | tag | task | n | method | head:tail | native | bridged | no ctx | other native | "
        "other bridged | context-gain | content-gain | prefill s/item | handoff s/item | speedup |"
    )
    print("|" + "---|" * 16)
    for r, s in ppl:
        n = s["n"]
        print(
            f"| {_row_head(r, s)} "
            f"| {s['nll_native']:.3f} | {s['nll_bridged']:.3f} | {s['nll_no_context']:.3f} "
            f"| {s['nll_other_native']:.3f} | {s['nll_other_bridged']:.3f} "
            f"| {_pct(s['context_gain_recovered'])}{_ci(s, 'context_gain_recovered')} "
            f"| {_pct(s['content_gain_recovered'])}{_ci(s, 'content_gain_recovered')} "
            f"| {s['native_prefill_s'] / n:.2f} | {s['handoff_s'] / n:.2f} | {s['speedup']:.1f}x |"
        )
    print("\n### Multiple-choice tasks (length-normalised log-likelihood; 95% CI of retention)\n")
    print(
        "| pair | tag | task | n | method | head:tail | acc native | acc bridged | acc no ctx | "
        "acc other native | retention | above chance | prefill s/item | handoff s/item | speedup |"
    )
    print("|" + "---|" * 15)
    for r, s in choice:
        n = s["n"]
        print(
            f"| {_row_head(r, s)} "
            f"| {_pct(s['acc_native'])} | {_pct(s['acc_bridged'])} | {_pct(s['acc_no_context'])} "
            f"| {_pct(s['acc_other_native'])} | {_pct(s['retention'])}{_ci(s, 'retention')} "
            f"| {_pct(s['retention_above_chance'])} "
            f"| {s['native_prefill_s'] / n:.2f} | {s['handoff_s'] / n:.2f} | {s['speedup']:.1f}x |"
        )
    print("\n### Source prefill (the cost a handoff assumes already paid)\n")
    print("| pair | tag | task | n | source prefill s/item | target native prefill s/item |")
    print("|---|---|---|---|---|---|")
    for r in records:
        s = r["variants"][0]
        print(
            f"| {r['pair']} | {r['tag']} | {r['task']} | {s['n']} | {s['source_prefill_s'] / s['n']:.2f} "
            f"| {s['native_prefill_s'] / s['n']:.2f} |"
        )
    if args.plots:
        _plots(records, args.plots, args.plot_tag, args.r2_tag)


def _series(records, family: str, key: str, tag: str):
    """{(pair, method, anchors): sorted [(context tokens, value)]} over the lengths of a task family."""
    series: dict = {}
    for r in records:
        if r["tag"] != tag or not r["task"].startswith(family):
            continue
        for s in r["variants"]:
            value = s.get(key)
            if value is None:
                continue
            label = (r["pair"], s["method"], f"{s['native_head']}:{s['native_tail']}")
            series.setdefault(label, []).append((s["context_tokens_mean"], value))
    return {k: sorted(v) for k, v in series.items()}


def _plots(records: list[dict], directory: Path, tag: str, r2_tag: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    for family, key, title, name in (
        (
            "prose-ppl",
            "content_gain_recovered",
            "content-gain recovered (prose continuation)",
            "content_gain",
        ),
        ("facts-choice", "retention", "retention (5-choice fact questions)", "retention"),
    ):
        series = {k: v for k, v in _series(records, family, key, tag).items() if len(v) >= 2}
        if not series:  # this configuration was measured at one context length only
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for (pair, method, anchors), points in series.items():
            xs, ys = zip(*points)
            style = "-" if method == "cachebridge" else "--"
            ax.plot(xs, [100 * y for y in ys], style, marker="o", label=f"{pair} {method} {anchors}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (target tokens)")
        ax.set_ylabel("%")
        ax.axhline(100, color="grey", lw=0.5)
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(directory / f"{name}_vs_length.png", dpi=110)
        plt.close(fig)

    bridges = {}
    for r in records:
        if r["tag"] == r2_tag:
            for method, b in r["bridges"].items():
                bridges[(r["pair"], method)] = b
    pairs = sorted({p for p, m in bridges if m != "identity"}, key=list(PAIRS).index)
    if not pairs:
        return
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.5 * len(pairs), 3.8), squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        for method in METHODS:
            b = bridges.get((pair, method))
            if b is None:
                continue
            for kind, style in (("r2_key", "-"), ("r2_value", ":")):
                values = [math.nan if v is None else v for v in b[kind]]
                ax.plot(range(len(values)), values, style, marker=".", label=f"{method} {kind[3:]}")
        ax.set_title(pair, fontsize=9)
        ax.set_xlabel("target layer")
        ax.set_ylim(-0.5, 1.0)
        ax.axhline(0, color="grey", lw=0.5)
    axes[0][0].set_ylabel("held-out R^2")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "r2_per_layer.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from bridgecache.runtime.config import DEFAULT_REFRESH

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--raw", type=Path, default=None, help="results directory (default $BRIDGECACHE_HOME/quality)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="measure one pair")
    r.add_argument("--pair", required=True, choices=list(PAIRS))
    r.add_argument("--tasks", nargs="+", default=["prose-ppl", "code-ppl", "facts-choice"])
    r.add_argument("--limit", type=int, default=16)
    r.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    r.add_argument("--anchors", nargs="+", default=["1:0", "1:32"], help="native_head:native_tail options")
    r.add_argument("--fit", nargs="*", default=[], help="fit_bridge options, key=value (e.g. domain=mixed)")
    r.add_argument("--bridge", nargs="*", default=[], help="METHOD=DIR: use this bridge instead of fitting")
    r.add_argument(
        "--no-key-norm", action="store_true", help="HandoffConfig(key_norm=False) in every variant"
    )
    r.add_argument(
        "--refresh",
        type=_refresh,
        default=DEFAULT_REFRESH,
        help=f"tokens the target recomputes: a fraction (default {DEFAULT_REFRESH}), a count, or none",
    )
    r.add_argument("--tag", default="default", help="name of this configuration (for before/after)")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--overwrite", action="store_true")
    r.set_defaults(func=run)
    rep = sub.add_parser("report", help="Markdown tables (and plots) from the results")
    rep.add_argument("--tags", nargs="*", default=None)
    rep.add_argument("--plots", type=Path, help="write the PNG plots here (e.g. benchmarks/reports/figures)")
    rep.add_argument("--plot-tag", default="default", help="the configuration the length plots show")
    rep.add_argument("--r2-tag", default="default", help="the configuration whose bridges the R^2 plot shows")
    rep.set_defaults(func=report)
    args = parser.parse_args(argv)
    args.raw = args.raw or _default_raw()
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
