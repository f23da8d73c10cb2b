"""A refresh sized per request (`RefreshConfig(mass=...)`) against the fixed 20%: accuracy and
the share of the context refreshed, on the same items.

    python benchmarks/refresh_sizing.py run --pair qwen1.5b-to-0.5b --task facts-choice-512 --items 0:48 \\
        --variants fixed=0.2 fixed=0.1 mass=0.5 mass=0.7
    python benchmarks/refresh_sizing.py report --pair qwen1.5b-to-0.5b --task facts-choice-512
    python benchmarks/refresh_sizing.py recall --pair smollm2-to-qwen0.5b --task needle-4096 --items 0:48 \\
        --variants fixed=0.2 mass=0.3 mass=0.5
    python benchmarks/refresh_sizing.py needles --pair smollm2-to-qwen0.5b --task needle-4096 --tag sizing

`run` evaluates item by item (`bridgecache.evaluation.evaluate`, every variant it still lacks on
that item, with the native, no-context and unrelated-context controls) and appends one JSON line
per (item, variant) to $BRIDGECACHE_HOME/refresh-sizing/<pair>/<task>.jsonl (`--raw`): a killed
run resumes where it stopped. Every variant is forced to the handoff (`route="handoff"`): the
cost gate must not answer for the bridge by sending a context to the target's own prefill.
Variants (each the default `RefreshConfig` but for what it names):
    fixed=F     refresh a share F of the translated tokens (fixed=0.2: the library's default)
    mass=M      the fewest tokens holding a share M of the selection scores' mass, at most 20% and
                at least 2% of the translated tokens (`RefreshConfig(mass=M)`)
`recall` is the cheap proxy on long items (needles), where a target's prefill per item and arm
costs minutes on a CPU: per item and variant it builds the `BridgedCache` as a handoff does (the
source reads the question over its cache, the refresh picks its columns; the target's forward
never runs) and records the share of the answers' target tokens refreshed, the answers refreshed
whole and the refreshed share of the context, to .../refresh-sizing/recall/<pair>/<task>.jsonl;
it prints the table when done.
`needles` reads the records `long_context.py run --tag TAG --variants default mass=M ...` wrote
(benchmarks/reports/needle-records/TAG/<pair>/<task>.jsonl: greedy replies scored by exact match,
with the native, no-context and unrelated-context controls) and prints the same table as `report`,
paired against the library's default config (`default`), with each arm's FLOPs share.
`report` prints accuracy per arm with Wilson 95% intervals, the paired difference to fixed=0.2
(bootstrap 95% interval over items) and the refreshed share of the context tokens (mean, p10, p90).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from native_dial import PAIRS  # noqa: E402


def variant_config(spec: str):
    """fixed=F or mass=M -> its HandoffConfig (forced to the handoff route)."""
    from bridgecache import HandoffConfig, RefreshConfig

    key, _, value = spec.partition("=")
    try:
        number = float(value)
    except ValueError:
        raise SystemExit(f"bad variant {spec!r}: expected fixed=F or mass=M") from None
    if key == "fixed":
        refresh = RefreshConfig(amount=number)
    elif key == "mass":
        refresh = RefreshConfig(mass=number)
    else:
        raise SystemExit(f"bad variant {spec!r}: expected fixed=F or mass=M")
    return HandoffConfig(refresh=refresh, route="handoff")


def _raw(args) -> Path:
    return args.raw / args.pair / f"{args.task}.jsonl"


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(args) -> None:
    import torch

    from bridgecache.bridge import Bridge
    from bridgecache.evaluation import evaluate, summarise
    from bridgecache.evaluation.builtin import builtin_items
    from bridgecache.evaluation.controls import ControlScores
    from bridgecache.evaluation.runner import Variant
    from bridgecache.models.zoo import cache_root, load_model

    torch.set_num_threads(args.threads)
    source_name, target_name = PAIRS[args.pair]
    bridge = Bridge.from_pretrained(f"builtin:{source_name}->{target_name}")
    target, target_tok = load_model(target_name)
    source, source_tok = load_model(source_name)
    controls = ControlScores(cache_root() / "refresh-sizing" / "controls.json")
    first, _, stop = args.items.partition(":")
    first, stop = int(first), int(stop)
    items = builtin_items(args.task, target_tok, limit=stop)
    out = _raw(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["index"], r["spec"]) for r in _read(out)}
    command = " ".join(["python", *sys.argv])
    # choice items need an unrelated context from another item: evaluated in pairs (i, i + 1)
    for i in range(first, stop, 2):
        chunk = list(range(i, min(i + 2, stop)))
        todo = [s for s in args.variants if any((j, s) not in done for j in chunk)]
        if not todo:
            continue
        variants = [Variant(bridge, variant_config(spec)) for spec in todo]
        start = time.perf_counter()
        ev = evaluate(
            source, source_tok, target, target_tok, [items[j] for j in chunk], "choice", variants,
            progress=False, controls=controls,
        )  # fmt: skip
        with out.open("a") as f:
            for spec, variant in zip(todo, variants):
                summary = summarise(ev, variant)
                for record in summary["items"]:
                    index = chunk[record["index"]]
                    record |= {
                        "index": index,
                        "spec": spec,
                        "variant": variant.name,
                        "pair": args.pair,
                        "task": args.task,
                        "date": time.strftime("%Y-%m-%d"),
                        "command": command,
                    }
                    f.write(json.dumps(record) + "\n")
        print(f"items {chunk}: {len(todo)} variants in {time.perf_counter() - start:.0f} s", flush=True)


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _paired(a: list[bool], b: list[bool], seed: int = 0, rounds: int = 2000) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(a)
    diffs = []
    for _ in range(rounds):
        pick = [rng.randrange(n) for _ in range(n)]
        diffs.append(sum(a[i] - b[i] for i in pick) / n)
    diffs.sort()
    return diffs[int(0.025 * rounds)], diffs[int(0.975 * rounds) - 1]


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def report(args) -> None:
    records = [r for r in _read(_raw(args)) if not args.variants or r["spec"] in args.variants]
    by_spec: dict[str, dict[int, dict]] = {}
    for r in records:
        by_spec.setdefault(r["spec"], {})[r["index"]] = r
    if not by_spec:
        raise SystemExit(f"no records in {_raw(args)}")
    common = sorted(set.intersection(*(set(v) for v in by_spec.values())))
    any_spec = next(iter(by_spec.values()))
    rows = [any_spec[i] for i in common]
    n = len(rows)
    print(f"{args.pair}, {args.task}: {n} items common to every arm (same items per arm)\n")
    print("| arm | accuracy [95% CI] | vs fixed=0.2 (paired, 95% CI) | refreshed share: mean (p10, p90) |")
    print("|---|---|---|---|")
    for name in ("native", "no_context", "other_native"):
        k = sum(r[f"pick_{name}"] == r["answer"] for r in rows)
        lo, hi = _wilson(k, n)
        print(f"| {name} | {k / n:.1%} [{lo:.0%}, {hi:.0%}] | | |")
    base = by_spec.get("fixed=0.2")
    base_right = [base[i]["pick_bridged"] == base[i]["answer"] for i in common] if base else None
    for spec in sorted(by_spec, key=lambda s: (s.split("=")[0] != "fixed", s)):
        arm = [by_spec[spec][i] for i in common]
        right = [r["pick_bridged"] == r["answer"] for r in arm]
        k = sum(right)
        lo, hi = _wilson(k, n)
        shares = [len(set(r["refreshed"])) / r["context_tokens"] for r in arm if "refreshed" in r]
        share = (
            f"{statistics.mean(shares):.3f} ({_quantile(shares, 0.1):.3f}, {_quantile(shares, 0.9):.3f})"
            if shares
            else "-"
        )
        diff = ""
        if base_right is not None and spec != "fixed=0.2":
            d = (k - sum(base_right)) / n
            dlo, dhi = _paired(right, base_right)
            diff = f"{d:+.1%} [{dlo:+.1%}, {dhi:+.1%}]"
        print(f"| {spec} | {k / n:.1%} [{lo:.0%}, {hi:.0%}] | {diff} | {share} |")


def recall(args) -> None:
    import torch
    from long_context import answer_columns

    from bridgecache import BridgedCache, capture_kv
    from bridgecache.bridge import Bridge
    from bridgecache.evaluation.builtin import builtin_items
    from bridgecache.evaluation.prompts import Prompts
    from bridgecache.models.zoo import load_model

    torch.set_num_threads(args.threads)
    source_name, target_name = PAIRS[args.pair]
    bridge = Bridge.from_pretrained(f"builtin:{source_name}->{target_name}")
    source, source_tok = load_model(source_name)
    target, target_tok = load_model(target_name)  # the cache plans on it; its forward never runs
    first, _, stop = args.items.partition(":")
    first, stop = int(first), int(stop)
    items = builtin_items(args.task, target_tok, limit=stop)
    prompts = Prompts(source_tok, target_tok)
    out = args.raw / "recall" / args.pair / f"{args.task}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["index"], r["spec"]) for r in _read(out)}
    configs = {spec: variant_config(spec) for spec in args.variants}
    for i in tqdm(range(first, stop), desc=f"{args.pair} {args.task} recall"):
        todo = [spec for spec in args.variants if (i, spec) not in done]
        if not todo:
            continue
        item = items[i]
        words = any(configs[spec].refresh.whole_words is not False for spec in todo)
        context = prompts.context(item.context, bridge, words=words)
        kv = capture_kv(source, context.source_ids)
        query = torch.tensor([prompts.source_prompt(item)], dtype=torch.long)
        columns = answer_columns(target_tok, context.target_ids[0].tolist(), item.context, item.answers)
        wanted = [c for cols in columns for c in cols]
        with out.open("a") as f:
            for spec in todo:
                cache = BridgedCache(
                    bridge, kv, target, context.target_ids, config=configs[spec], alignment=context.alignment,
                    source_model=source, prompt_ids=query, words=context.words,
                )  # fmt: skip
                picked = set(cache.refreshed_columns[0].tolist())
                record = {
                    "index": i, "spec": spec, "pair": args.pair, "task": args.task,
                    "context_tokens": context.target_ids.shape[1],
                    "refreshed_share": len(picked) / context.target_ids.shape[1],
                    "answer_tokens": sum(c in picked for c in wanted) / len(wanted),
                    "answers_whole": sum(all(c in picked for c in cols) for cols in columns) / len(columns),
                    "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]),
                }  # fmt: skip
                f.write(json.dumps(record) + "\n")
    recall_report(_read(out), args)


def recall_report(records: list[dict], args) -> None:
    by_spec: dict[str, dict[int, dict]] = {}
    for r in records:
        by_spec.setdefault(r["spec"], {})[r["index"]] = r
    common = sorted(set.intersection(*(set(v) for v in by_spec.values())))
    print(f"\n{args.pair}, {args.task}: {len(common)} items common to every variant\n")
    print("| variant | answer tokens | whole answers refreshed | refreshed share: mean (p10, p90) |")
    print("|---|---|---|---|")
    for spec in sorted(by_spec, key=lambda s: (s.split("=")[0] != "fixed", s)):
        arm = [by_spec[spec][i] for i in common]
        shares = [r["refreshed_share"] for r in arm]
        tokens = statistics.mean(r["answer_tokens"] for r in arm)
        whole = sum(r["answers_whole"] == 1.0 for r in arm)
        lo, hi = _wilson(whole, len(arm))
        print(
            f"| {spec} | {tokens:.1%} | {whole}/{len(arm)} [{lo:.0%}, {hi:.0%}] | "
            f"{statistics.mean(shares):.3f} ({_quantile(shares, 0.1):.3f}, {_quantile(shares, 0.9):.3f}) |"
        )


def needles(args) -> None:
    path = Path(__file__).parent / "reports" / "needle-records" / args.tag / args.pair / f"{args.task}.jsonl"
    by_spec: dict[str, dict[int, dict]] = {}
    for r in _read(path):
        if "skipped" not in r:
            by_spec.setdefault(r["spec"], {})[r["index"]] = r
    if "default" not in by_spec:
        raise SystemExit(f"no records of the variant 'default' in {path}")
    common = sorted(set.intersection(*(set(v) for v in by_spec.values())))
    n, rows = len(common), [by_spec["default"][i] for i in common]
    print(f"{args.pair}, {args.task}: {n} items common to every arm (same items per arm)\n")
    header = "| arm | exact match [95% CI] | vs default (paired, 95% CI) | refreshed share: mean (p10, p90) |"
    print(header + " FLOPs share |")
    print("|---|---|---|---|---|")
    for name in ("native", "no_context", "other_native"):
        k = sum(r[f"correct_{name}"] for r in rows)
        lo, hi = _wilson(k, n)
        print(f"| {name} | {k / n:.1%} [{lo:.0%}, {hi:.0%}] | | | |")
    base = [r["correct_bridged"] for r in rows]
    for spec in sorted(by_spec, key=lambda s: (s != "default", s)):
        arm = [by_spec[spec][i] for i in common]
        right = [r["correct_bridged"] for r in arm]
        k = sum(right)
        lo, hi = _wilson(k, n)
        shares = [len(set(r["refreshed"])) / r["context_tokens"] for r in arm]
        flops = statistics.mean(r["native_cost_fraction"] for r in arm)
        diff = ""
        if spec != "default":
            dlo, dhi = _paired(right, base)
            diff = f"{(k - sum(base)) / n:+.1%} [{dlo:+.1%}, {dhi:+.1%}]"
        share = f"{statistics.mean(shares):.3f} ({_quantile(shares, 0.1):.3f}, {_quantile(shares, 0.9):.3f})"
        print(f"| {spec} | {k / n:.1%} [{lo:.0%}, {hi:.0%}] | {diff} | {share} | {flops:.3f} |")


def main() -> None:
    from bridgecache.models.zoo import cache_root

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "report", "recall", "needles"):
        p = sub.add_parser(name)
        p.add_argument("--pair", choices=list(PAIRS), default="qwen1.5b-to-0.5b")
        p.add_argument("--task", default="facts-choice-512")
        p.add_argument("--raw", type=Path, default=cache_root() / "refresh-sizing")
        if name == "needles":
            p.add_argument("--tag", default="sizing", help="long_context.py run's --tag")
        if name == "report":
            p.add_argument("--variants", nargs="*", help="only these arms (default: every one recorded)")
        if name in ("run", "recall"):
            p.add_argument("--items", default="0:48")
            p.add_argument(
                "--variants", nargs="+", default=["fixed=0.2", "fixed=0.1", "mass=0.5", "mass=0.7"]
            )
            p.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    {"run": run, "report": report, "recall": recall, "needles": needles}[args.command](args)


if __name__ == "__main__":
    main()
