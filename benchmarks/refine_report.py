"""Facts with and without the trained refinement: combine `native_dial.py run` slices and compare.

    python benchmarks/refine_report.py --runs ~/.cache/bridgecache/quality/refine \\
        --baseline ~/.cache/bridgecache/quality/dial/dial/smollm2-to-qwen0.5b/facts-choice-512.json

Reads every `facts-choice-512.json` under --runs (slices written with `--offset`/`--limit`, any
tags and labels), puts each variant's per-item picks back at their item numbers, and prints per
variant: items, accuracy and retention (bridged / native) with 95% bootstrap intervals
(`bridgecache.evaluation.metrics.choice_metrics`). With --baseline (another run's JSON, e.g. the
closed-form bridge's variants), each variant is also compared on exactly the items both measured
(same item numbers, answers and context lengths; otherwise no comparison is printed): the paired
difference in accuracy with its 95% bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _items(record: dict) -> dict[str, dict[int, dict]]:
    """variant spec -> {global item number: per-item record}."""
    offset = record.get("offset", 0)
    return {s["spec"]: {offset + it["index"]: it for it in s["items"]} for s in record["variants"]}


def _merge(records: list[dict]) -> dict[str, dict[int, dict]]:
    merged: dict[str, dict[int, dict]] = {}
    for record in records:
        for spec, items in _items(record).items():
            merged.setdefault(spec, {}).update(items)
    return merged


def _metrics(items: list[dict]) -> dict:
    from bridgecache.evaluation.metrics import choice_metrics

    picks = {c: [it[f"pick_{c}"] for it in items] for c in ("native", "bridged", "no_context")}
    return choice_metrics(picks, [it["answer"] for it in items], [5] * len(items))


def _same(a: dict | None, b: dict) -> bool:
    """Whether two per-item records are of the same item (answer and context length agree)."""
    return a is not None and (a["answer"], a["context_tokens"]) == (b["answer"], b["context_tokens"])


def _paired(a: list[dict], b: list[dict]) -> tuple[float, tuple[float, float]]:
    from bridgecache.evaluation.metrics import bootstrap_ci

    right = lambda its, ix: sum(its[i]["pick_bridged"] == its[i]["answer"] for i in ix) / len(ix)  # noqa: E731
    every = list(range(len(a)))
    diff = lambda ix: right(a, ix) - right(b, ix)  # noqa: E731
    return diff(every), bootstrap_ci(len(a), diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--task", default="facts-choice-512")
    parser.add_argument("--baseline", type=Path)
    args = parser.parse_args()
    records = [json.loads(p.read_text()) for p in sorted(args.runs.expanduser().glob(f"**/{args.task}.json"))]
    merged = _merge(records)
    baseline = _merge([json.loads(args.baseline.expanduser().read_text())]) if args.baseline else {}
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    ci = lambda lo_hi: f"[{100 * lo_hi[0]:.0f}, {100 * lo_hi[1]:.0f}]"  # noqa: E731
    print("| variant | n | accuracy | retention | native | no context | vs baseline (same items) |")
    print("|---|---|---|---|---|---|---|")
    for spec, by_item in merged.items():
        numbers = sorted(by_item)
        items = [by_item[i] for i in numbers]
        m = _metrics(items)
        versus = ""
        base_spec = spec.split(":", 1)[-1]
        if base_spec in baseline and all(_same(baseline[base_spec].get(i), by_item[i]) for i in numbers):
            diff, interval = _paired(items, [baseline[base_spec][i] for i in numbers])
            versus = f"{100 * diff:+.1f} points {ci(interval)} vs {base_spec}"
        print(
            f"| {spec} | {len(items)} | {pct(m['acc_bridged'])} {ci(m['acc_bridged_ci'])} | "
            f"{pct(m['retention'])} {ci(m['retention_ci'])} | {pct(m['acc_native'])} | "
            f"{pct(m['acc_no_context'])} | {versus} |"
        )
    for record in records:
        print(f"# {record['date']} {record['wall_s']:.0f} s: {record['command']}")


if __name__ == "__main__":
    main()
