"""The native-compute dial: quality against handoff cost, one curve per strategy.

Results: benchmarks/reports/quality.md.

    python benchmarks/native_dial.py run --pair qwen1.5b-to-0.5b --bridge DIR \\
        --tasks facts-choice-512 prose-ppl --limit 48 \\
        --variants plain layers=1 layers=4 refresh=0.1,by=source refresh=0.2,by=deviation ...
    python benchmarks/native_dial.py report [--plots benchmarks/reports/figures]

A variant is a `HandoffConfig`: `plain` (translation only) or comma-separated key=value pairs:
head (native head, default: the bridge's), tail (native tail, default 0), layers (native layers:
an int n, or 0+1+17 for a set, or all), refresh (fraction or token count; none without it), by
(deviation, the default | source), minq (quality gate threshold); source-guided selection
(`SourceAttention`): reduce (sum, the default | max over layers, heads and queries), after
(scores reach the N following tokens, default 0), read (the source reads with its first N
layers only, or a share of them such as 0.25; default all), words (1: the refresh takes whole
words, `RefreshConfig(whole_words=True)`; 0, the default here: token by token, `whole_words=False`,
as every run before the library's default took whole words), ends (1: with words, also the token
after each word, `word_ends=True`, the library's default; 0, the default here: without, as every
words=1 run before 15b174b).
`run` evaluates every variant of one pair in one pass with the library behind `bridgecache eval`
(`bridgecache.evaluation.evaluate`); the native, no-context and unrelated-context controls are
remembered per (target, item) in $BRIDGECACHE_HOME/quality/controls.json, so a later run with
new variants repeats only the bridged work. One JSON per (tag, pair, task) under --raw.
`report` prints one table per (pair, task): accuracy or content-gain with 95% intervals, the
handoff's native FLOPs as a share of the target's own prefill, and measured handoff time over
native prefill time; with --plots DIR it writes dial_<pair>.png (quality vs cost per strategy,
native and no-context levels drawn in).
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
    "qwen0.5b-to-gemma": ("qwen2.5-coder-0.5b", "gemma3-270m"),
}
_KEYS = {"head": "native_head", "tail": "native_tail", "layers": "native_layers", "refresh": "refresh"}
_KEYS |= {"by": "refresh_by", "minq": "min_quality"}
_KEYS |= {"reduce": "refresh_reduce", "after": "refresh_after", "read": "refresh_read_layers"}
_KEYS |= {"words": "refresh_whole_words", "ends": "refresh_word_ends"}


def handoff_config(options: dict):
    """parse_variant's options -> the variant's HandoffConfig."""
    from bridgecache import HandoffConfig, QualityPolicy, RefreshConfig, SourceAttention

    refresh, by = options.get("refresh"), options.get("refresh_by", "deviation")
    whole_words = bool(options.get("refresh_whole_words", 0))
    word_ends = bool(options.get("refresh_word_ends", 0))
    if by == "source":
        by = SourceAttention(
            reduce=options["refresh_reduce"],
            after=options["refresh_after"],
            layers=options.get("refresh_read_layers"),
        )
    return HandoffConfig(
        native_head=options.get("native_head"),
        native_tail=options.get("native_tail", 0),
        native_layers=options.get("native_layers"),
        refresh=None if refresh is None else RefreshConfig(refresh, by, whole_words, word_ends),
        quality=QualityPolicy(options.get("min_quality")),
    )


def parse_variant(spec: str) -> dict:
    """`plain` or `key=value,...` -> handoff_config's options (see the module docstring)."""
    if spec == "plain":
        return {}
    # Source-guided specs without reduce/after mean the first rule measured (sum, no reach),
    # so the tables' older rows keep their meaning.
    options = {"refresh_reduce": "sum", "refresh_after": 0}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key not in _KEYS or not value:
            raise SystemExit(f"bad variant {spec!r}: {part!r}; keys are {', '.join(_KEYS)}")
        if key == "layers":
            options["native_layers"] = (
                "all"
                if value == "all"
                else tuple(int(x) for x in value.split("+"))
                if "+" in value
                else int(value)
            )
        elif key in ("by", "reduce"):
            options[_KEYS[key]] = value
        elif key == "read":  # a layer count, or a share of the source's layers
            options[_KEYS[key]] = float(value) if "." in value else int(value)
        elif key in ("refresh", "minq"):
            number = float(value)
            options[_KEYS[key]] = int(number) if key == "refresh" and number >= 1 else number
        else:
            options[_KEYS[key]] = int(value)
    return options


def strategy(summary: dict) -> str:
    """The curve a variant belongs to in the plot."""
    layers = summary.get("native_layers") not in (None, 0)
    refresh = summary.get("refresh")
    spec = summary.get("spec", "")
    prefix = f"{summary['label']}: " if summary.get("label") else ""
    if summary.get("min_quality") is not None:
        return prefix + "quality gate"
    by = {"source attention": "source", "key deviation": "deviation"}.get(summary.get("refresh_by"))
    by = by or summary.get("refresh_by")
    if layers and refresh:
        return prefix + f"native layers + refresh ({by})"
    if refresh and "after=" in spec:
        return prefix + f"refresh ({by}, max, after)"
    if refresh and "spread=" in spec:
        return prefix + f"refresh ({by}, spans)"
    if refresh:
        return prefix + f"refresh ({by})"
    if layers:
        return prefix + "native layers"
    if summary.get("native_tail"):
        return prefix + "native tail"
    return prefix + "translated only"


_COLORS = {
    "translated only": "tab:red",
    "native layers": "tab:blue",
    "native tail": "tab:brown",
    "refresh (source)": "tab:green",
    "refresh (source, spans)": "tab:olive",
    "refresh (source, max, after)": "darkgreen",
    "refresh (target)": "tab:cyan",
    "refresh (source+target)": "tab:pink",
    "refresh (deviation)": "tab:orange",
    "native layers + refresh (source)": "tab:purple",
    "quality gate": "tab:gray",
}


def run(args) -> None:
    import torch

    from bridgecache.bridge.maps import Bridge
    from bridgecache.cli.evaluate import _json_safe
    from bridgecache.evaluation import evaluate, load_items, summarise
    from bridgecache.evaluation.runner import ControlScores, Variant
    from bridgecache.models.zoo import cache_root, load_model

    torch.set_num_threads(args.threads)
    source_name, target_name = PAIRS[args.pair]
    bridge = Bridge.from_pretrained(args.bridge)
    target, target_tok = load_model(target_name)
    source, source_tok = load_model(source_name)
    # Labelled by their spec: a HandoffConfig's label does not tell selection rules' options apart.
    specs = [f"{args.label}:{spec}" if args.label else spec for spec in args.variants]
    variants = [
        Variant(bridge, handoff_config(parse_variant(spec)), label)
        for spec, label in zip(args.variants, specs)
    ]
    controls = ControlScores(args.controls or cache_root() / "quality" / "controls.json")
    for task_name in args.tasks:
        data = f"builtin:{task_name}"
        out = args.raw / args.tag / args.pair / f"{task_name}.json"
        task, items = load_items(data, None, target_tok, args.offset + args.limit)
        items = items[args.offset :]  # a later slice of the same items (runs too long to do at once)
        print(f"{args.pair} {data}: {len(items)} items x {len(variants)} variants", flush=True)
        start = time.perf_counter()
        evaluation = evaluate(
            source, source_tok, target, target_tok, items, task, variants, controls=controls
        )
        summaries = [
            summarise(evaluation, v, source=source_name, target=target_name, data=data)
            | {"spec": f"{args.label}:{spec}" if args.label else spec}
            for v, spec in zip(variants, args.variants)
        ]
        record = {
            "pair": args.pair,
            "tag": args.tag,
            "label": args.label,
            "task": task_name,
            "bridge": str(args.bridge),
            "threads": args.threads,
            "offset": args.offset,
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv),
            "wall_s": time.perf_counter() - start,
            "variants": summaries,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():  # keep earlier variants of the same tag: merge by variant name
            old = {s["variant"]: s for s in json.loads(out.read_text())["variants"]}
            record["variants"] = list((old | {s["variant"]: s for s in summaries}).values())
        out.write_text(json.dumps(_json_safe(record), indent=1))
        print(f"wrote {out} ({record['wall_s']:.0f} s)", flush=True)
        for s in summaries:
            print("  " + _one_line(s), flush=True)


def _quality(s: dict) -> tuple[float, tuple]:
    if s["task"] == "ppl":
        return s["content_gain_recovered"], tuple(s.get("content_gain_recovered_ci") or (None, None))
    return s["acc_bridged"], tuple(s.get("acc_bridged_ci") or (None, None))


def _one_line(s: dict) -> str:
    value, _ = _quality(s)
    kind = "content-gain" if s["task"] == "ppl" else "accuracy"
    ratio = s["handoff_s"] / s["native_prefill_s"] if s["native_prefill_s"] else math.nan
    return (
        f"{s['spec']:<28} {kind} {_pct(value)}  cost {_pct(s['native_cost_fraction'])} FLOPs, "
        f"{_pct(ratio)} time of native prefill"
    )


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _ci(lo_hi) -> str:
    lo, hi = lo_hi
    return "" if lo is None else f" [{100 * lo:.0f}, {100 * hi:.0f}]"


def guide_cost(record: dict, s: dict) -> float:
    """FLOPs share of choosing the refreshed tokens (a model reading the prompt over the context).

    Recorded by runs since it was counted (`guide_cost_fraction`); for earlier runs rebuilt from
    the same items, tokenizers and model configs (what the runner now computes per item)."""
    if s.get("guide_cost_fraction") is not None:
        return s["guide_cost_fraction"]
    by = s.get("refresh_by") if s.get("refresh") else None
    if by not in ("source", "target", "source+target"):
        return 0.0
    from transformers import AutoConfig

    from bridgecache.evaluation.builtin import builtin_items
    from bridgecache.evaluation.prompts import _plain_prompt
    from bridgecache.models.zoo import load_tokenizer, model_dir
    from bridgecache.runtime.report import reading_fraction

    source_name, target_name = PAIRS[record["pair"]]
    configs = {name: AutoConfig.from_pretrained(model_dir(name)) for name in (source_name, target_name)}
    toks = {name: load_tokenizer(name) for name in (source_name, target_name)}
    items = builtin_items(record["task"], toks[target_name], limit=max(i["index"] for i in s["items"]) + 1)
    costs = []
    for row in s["items"]:
        item, total = items[row["index"]], 0.0
        S, T = row["source_tokens"], row["context_tokens"]
        text = _plain_prompt(item)
        if by in ("source", "source+target"):
            q = len(toks[source_name](text, add_special_tokens=False)["input_ids"]) or min(16, S - 1)
            context = S if text else S - q
            total += reading_fraction(configs[source_name], q, context, configs[target_name], T)
        if by in ("target", "source+target"):  # held-back token + prompt over T - 1 columns
            q = 1 + len(toks[target_name](text, add_special_tokens=False)["input_ids"])
            total += reading_fraction(configs[target_name], q, T - 1, configs[target_name], T)
        costs.append(total)
    return sum(costs) / len(costs)


def merged(records: list[dict]) -> list[dict]:
    """One record per (pair, task): the variants of every tag, each marked with its tag."""
    out: dict[tuple, dict] = {}
    for r in records:
        key = (r["pair"], r["task"])
        if key not in out:
            out[key] = {**r, "variants": [], "tags": []}
        out[key]["tags"].append(r["tag"])
        for s in r["variants"]:
            label = r.get("label")
            s = dict(s, tag=r["tag"], label=label, guide=guide_cost(r, s))
            if label and s["spec"].startswith(f"{label}:"):  # runs that wrote "label:spec"
                s["spec"] = s["spec"][len(label) + 1 :]
            s["cost"] = s["native_cost_fraction"] + s["guide"]
            out[key]["variants"].append(s)
    return list(out.values())


def report(args) -> None:
    records = [json.loads(p.read_text()) for p in sorted(args.raw.glob("*/*/*.json"))]
    records = merged([r for r in records if args.tags is None or r["tag"] in args.tags])
    for r in records:
        s0 = r["variants"][0]
        n = s0["n"]
        tail = "| FLOPs share: native + choosing tokens | handoff time / native prefill |"
        second = "context-gain" if s0["task"] == "ppl" else "retention"
        first = "content-gain" if s0["task"] == "ppl" else "accuracy"
        print(f"\n#### {r['pair']}, {r['task']} (tags {', '.join(r['tags'])}, {r['date']}, {n} items)\n")
        if s0["task"] == "ppl":
            print(f"native: NLL {s0['nll_native']:.3f}; no context {s0['nll_no_context']:.3f}; "
                  f"unrelated context {s0['nll_other_native']:.3f}\n")  # fmt: skip
        else:
            print(f"native accuracy {_pct(s0['acc_native'])}; no context {_pct(s0['acc_no_context'])}; "
                  f"unrelated context {_pct(s0['acc_other_native'])}\n")  # fmt: skip
        print(f"| variant | n | {first} | {second} {tail}")
        print("|---|---|---|---|---|---|")
        for s in sorted(r["variants"], key=lambda s: s["cost"]):
            value, ci = _quality(s)
            ratio = s["handoff_s"] / s["native_prefill_s"] if s["native_prefill_s"] else math.nan
            key = "context_gain_recovered" if s["task"] == "ppl" else "retention"
            kept = f"{_pct(s[key])}{_ci(tuple(s.get(key + '_ci') or (None, None)))}"
            flops = (
                _pct(s["cost"])
                if not s["guide"]
                else (f"{_pct(s['native_cost_fraction'])} + {_pct(s['guide'])} = {_pct(s['cost'])}")
            )
            name = f"{s['label']}: {s['spec']}" if s.get("label") else s["spec"]
            print(f"| {name} | {s['n']} | {_pct(value)}{_ci(ci)} | {kept} | {flops} | {_pct(ratio)} |")
    if args.plots:
        _plots(records, args.plots)


def _plots(records: list[dict], directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    by_pair: dict[str, list[dict]] = {}
    for r in records:
        by_pair.setdefault(r["pair"], []).append(r)
    for pair, rs in by_pair.items():
        cols = min(2, len(rs))
        rows = math.ceil(len(rs) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5.2 * rows), squeeze=False)
        for ax in axes.flat[len(rs) :]:
            ax.set_visible(False)
        for ax, r in zip(axes.flat, rs):
            s0 = r["variants"][0]
            ppl = s0["task"] == "ppl"
            curves: dict[str, list[tuple[float, float, tuple]]] = {}
            for s in r["variants"]:
                value, ci = _quality(s)
                curves.setdefault(strategy(s), []).append((s["cost"], value, ci))
            for name, points in sorted(curves.items()):
                points.sort()
                xs = [100 * p[0] for p in points]
                ys = [100 * p[1] for p in points]
                err = [
                    [100 * (p[1] - p[2][0]) if p[2][0] is not None else 0 for p in points],
                    [100 * (p[2][1] - p[1]) if p[2][1] is not None else 0 for p in points],
                ]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name, color=_COLORS.get(name))
            if ppl:
                ax.axhline(100, color="k", linestyle="--", label="native prefill")
                ax.axhline(0, color="grey", linestyle=":", label="unrelated context")
                ax.set_ylabel("content-gain recovered (%)")
            else:
                ax.axhline(100 * s0["acc_native"], color="k", linestyle="--", label="native prefill")
                ax.axhline(100 * s0["acc_no_context"], color="grey", linestyle=":", label="no context")
                ax.set_ylabel("accuracy (%)")
            ax.axvline(25, color="red", alpha=0.3, label="25% cost goal")
            ax.set_xlabel("handoff FLOPs: native work + choosing tokens (% of target prefill)")
            ax.set_title(f"{r['task']} (n={s0['n']})")
            ax.grid(alpha=0.3)
        for ax in axes.flat[: len(rs)]:
            ax.legend(fontsize=6.5, loc="best", framealpha=0.8)
        fig.suptitle(f"{pair}: quality vs native compute ({rs[0]['date']})")
        fig.tight_layout()
        fig.savefig(directory / f"dial_{pair}.png", dpi=110)
        plt.close(fig)
        print(f"wrote {directory / f'dial_{pair}.png'}")


def main() -> None:
    from bridgecache.models.zoo import cache_root

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(required=True)
    r = sub.add_parser("run")
    r.add_argument("--pair", required=True, choices=list(PAIRS))
    r.add_argument("--bridge", required=True, help="directory, builtin:SOURCE->TARGET or hub id")
    r.add_argument("--tasks", nargs="+", default=["facts-choice-512"])
    r.add_argument("--limit", type=int, default=48)
    r.add_argument(
        "--offset",
        type=int,
        default=0,
        help="skip the first N of offset+limit items; builtin: item sets depend on their count, so a "
        "slice is not the same items as that range of a larger run",
    )
    r.add_argument("--variants", nargs="+", default=["plain"])
    r.add_argument("--tag", default="dial")
    r.add_argument("--label", help="names this bridge in tables and plots (e.g. a larger calibration)")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--controls", type=Path)
    r.add_argument("--raw", type=Path, default=cache_root() / "quality" / "dial")
    r.set_defaults(func=run)
    p = sub.add_parser("report")
    p.add_argument("--raw", type=Path, default=cache_root() / "quality" / "dial")
    p.add_argument("--tags", nargs="*")
    p.add_argument("--plots", type=Path)
    p.set_defaults(func=report)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
