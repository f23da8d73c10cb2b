"""Long-context retrieval through the handoff: RULER's needle task per strategy and length
(dated results belong in benchmarks/reports/, beside the commands that made them).

    python benchmarks/long_context.py run --pair qwen1.5b-to-0.5b --task needle-4096 --items 0:30 \\
        --variants plain refresh=0.1 refresh=0.2 refresh=0.3 refresh=0.2,words
    python benchmarks/long_context.py recall --pair smollm2-to-qwen0.5b --task needle-4096 --items 60:84
    python benchmarks/long_context.py report [--misses] [--cells benchmarks/reports/needle-cells.json] \\
        [--plot FILE.png]

`run` evaluates item by item (`bridgecache.evaluation.evaluate` on one item with every variant it
still lacks) and appends one JSON line per (item, variant) to
benchmarks/reports/needle-records/<tag>/<pair>/<task>.jsonl (`--raw`). The records are results
and live in the repository: a killed run resumes where it stopped, on this machine or another,
and `report` reads every cell. The native, no-context and unrelated-context replies (the target's
prefill of item i + 1's context, asked item i's question) are a cache, remembered in
$BRIDGECACHE_HOME/needle/controls.json, so both pairs (one target) compute them once. Each line
holds the replies (native, no context, unrelated, bridged), whether each is right, the handoff's
FLOPs share (`cache.report()`), the CPU (process) seconds of the target's prefill, the source's
prefill and the handoff, the refreshed columns and the target columns of the answers (so the
report can say whether a miss had its answer refreshed).

`recall` is the cheap proxy of benchmarks/refresh_recall.py on other items than `run` reports:
per item, rule and budget a `BridgedCache` is built (the source reads the question over its
cache and the refresh picks its columns, as in a handoff; the target's forward never runs), and
the share of the answers' target tokens picked is reported (with the share of answers picked
whole).

`report` prints the tables (accuracy with Wilson 95% intervals, retention with a paired
bootstrap, cost per row) and draws accuracy against context length per strategy. `--cells` keeps
each cell's counts (right / n per row and control) in a file of the repository, merged with the
cells of the records at hand, and the plot draws from it: the cells whose records were made
before they lived in the repository (and stayed on the machine that ran them) stay drawn.

Variants (`variant_config` maps each onto its `HandoffConfig`):
    plain            translation only (refresh=None)
    refresh=F        a share F of the context refreshed (F >= 1: a token count), the tokens chosen
                     by the source's attention from the question (`SourceAttention()`, the
                     default rule: max over layers, heads and question tokens, reaching the 4
                     tokens after), token by token (`whole_words=False`, said explicitly: the
                     library's default takes whole words)
    refresh=F,words  the same at the same budget with `RefreshConfig(whole_words=True)`: scores
                     spread over whole words and numbers on both sides of the alignment
                     (bridgecache/runtime/selection/words.py)
    refresh=F,words,ends  the same with `RefreshConfig(whole_words=True, word_ends=True)`: each
                     chosen word also brings the token after it, so a refreshed number ends where
                     the context ends it
    default          the library's default `HandoffConfig()`, whatever it is at the commit run
    mass=M           the default but for the refresh's size: the fewest tokens holding a share M
                     of the selection scores' mass, between the floor and the default amount
                     (`RefreshConfig(mass=M)`: issue 60's refresh sized per request)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from native_dial import PAIRS  # noqa: E402

# The records are results: they live in the repository (a machine's cache dies with it), one JSON
# line per (item, variant), a few KB each.
RECORDS = Path(__file__).parent / "reports" / "needle-records"
SPEC_ORDER = (
    "plain",
    "refresh=0.1",
    "refresh=0.1,words",
    "refresh=0.1,words,ends",
    "refresh=0.2",
    "refresh=0.2,words",
    "refresh=0.2,words,ends",
    "refresh=0.3",
    "refresh=0.3,words,ends",
)


def variant_config(spec: str):
    """A variant spec (see the module docstring) -> its HandoffConfig."""
    from bridgecache import HandoffConfig, RefreshConfig

    if spec == "plain":
        return HandoffConfig(refresh=None)
    if spec == "default":
        return HandoffConfig()
    if spec.startswith("mass="):
        try:
            return HandoffConfig(refresh=RefreshConfig(mass=float(spec.removeprefix("mass="))))
        except ValueError as error:
            raise SystemExit(f"bad variant {spec!r}: {error}") from None
    amount, words, ends = None, False, False
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key == "refresh" and value:
            number = float(value)
            amount = int(number) if number >= 1 else number
        elif key == "words" and not value:
            words = True
        elif key == "ends" and not value:
            ends = True
        else:
            raise SystemExit(
                f"bad variant {spec!r}: {part!r} "
                "(plain, default, mass=M, refresh=F, refresh=F,words, refresh=F,words,ends)"
            )
    if amount is None:
        raise SystemExit(f"bad variant {spec!r}: say refresh=F")
    if ends and not words:
        raise SystemExit(f"bad variant {spec!r}: ends only with words (refresh=F,words,ends)")
    # word_ends only means something with whole words (and is said explicitly there)
    options = {"whole_words": words, "word_ends": ends} if words else {"whole_words": False}
    return HandoffConfig(refresh=RefreshConfig(amount, "source", **options))


def row_name(record: dict) -> str:
    """The report row of a run record: its spec, or "SPEC [earlier ends]" for word ends made
    before an end brought the word it enters whole (their label's tag "+ends"; now
    "+whole-ends"). `run` makes such items again; their old records stay beside them, apart."""
    if record.get("variant", "").endswith("+ends"):
        return f"{record['spec']} [earlier ends]"
    return record["spec"]


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "?"


def _span(text: str) -> tuple[int, int]:
    start, _, stop = text.partition(":")
    return int(start), int(stop)


def answer_columns(tokenizer, ids: list[int], text: str, answers) -> list[list[int]]:
    """Per answer, the target columns whose characters overlap its (single) occurrence in text."""
    enc = tokenizer(text, return_offsets_mapping=True)
    if enc["input_ids"] != ids:
        raise ValueError("the context's target ids are not the tokenizer's own tokenization of its text")
    spans = []
    for answer in answers:
        at = text.find(answer)
        spans.append(
            [c for c, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < at + len(answer) and b > at]
        )
    return spans


def _raw(args) -> Path:
    return args.raw / args.tag / args.pair / f"{args.task}.jsonl"


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(args) -> None:
    import torch

    from bridgecache.bridge import Bridge
    from bridgecache.evaluation import evaluate, summarise
    from bridgecache.evaluation.builtin import MAX_ITEMS, builtin_items
    from bridgecache.evaluation.controls import ControlScores
    from bridgecache.evaluation.prompts import Prompts
    from bridgecache.evaluation.runner import Variant
    from bridgecache.models.zoo import cache_root, load_model

    torch.set_num_threads(args.threads)
    source_name, target_name = PAIRS[args.pair]
    bridge = Bridge.from_pretrained(args.bridge or f"builtin:{source_name}->{target_name}")
    target, target_tok = load_model(target_name)
    source, source_tok = load_model(source_name)
    controls = ControlScores(cache_root() / "needle" / "controls.json")  # a cache: stays on the machine
    first, stop = _span(args.items)
    items = builtin_items(args.task, target_tok, limit=stop)
    # Item i's unrelated context: item i + 1's, from its own list (the measured items stay those of
    # `limit=stop`, whatever a longer list would make of them).
    others = builtin_items(args.task, target_tok, limit=min(stop + 1, MAX_ITEMS))
    out = _raw(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["index"], r["spec"]) for r in _read(out) if row_name(r) == r["spec"]}
    prompts = Prompts(source_tok, target_tok)
    commit, command = _commit(), " ".join(["python", *sys.argv])
    for i in range(first, stop):
        todo = [spec for spec in args.variants if (i, spec) not in done]
        if not todo:
            continue
        variants = [Variant(bridge, variant_config(spec)) for spec in todo]
        item, start = items[i], time.perf_counter()
        skipped = []
        ev = evaluate(
            source, source_tok, target, target_tok, [item], "generate", variants,
            progress=False, controls=controls, log=skipped.append, others=[others[(i + 1) % len(others)]],
        )  # fmt: skip
        with out.open("a") as f:
            if ev.skipped:
                for spec in todo:
                    f.write(json.dumps({"index": i, "spec": spec, "skipped": ev.skipped[0][1]}) + "\n")
                print(f"item {i}: skipped ({ev.skipped[0][1]})", flush=True)
                continue
            context = prompts.context(item.context, bridge)
            columns = answer_columns(target_tok, context.target_ids[0].tolist(), item.context, item.answers)
            for spec, variant in zip(todo, variants):
                record = summarise(ev, variant)["items"][0] | {
                    "index": i,
                    "spec": spec,
                    "variant": variant.name,
                    "kind": item.kind,
                    "answer_columns": columns,
                    "pair": args.pair,
                    "task": args.task,
                    "date": time.strftime("%Y-%m-%d"),
                    "commit": commit,
                    "command": command,
                    "threads": args.threads,
                }
                f.write(json.dumps(record) + "\n")
        r = ev.items[0]
        names = {f"bridged[{v.name}]": spec for spec, v in zip(todo, variants)}
        replies = {names.get(k, k): v.strip()[:12] for k, v in r.replies.items()}
        cpu = {names.get(k.replace("handoff[", "bridged["), k): round(v) for k, v in r.cpu_s.items()}
        seconds = time.perf_counter() - start
        print(
            f"item {i} ({item.kind}, {r.context_tokens} tokens) {item.answers}: {len(todo)} variants in "
            f"{seconds:.0f} s; cpu {cpu}; {replies}",
            flush=True,
        )


def recall(args) -> None:
    import torch

    from bridgecache import BridgedCache, HandoffConfig, RefreshConfig, capture_kv
    from bridgecache.bridge import Bridge
    from bridgecache.evaluation.builtin import builtin_items
    from bridgecache.evaluation.prompts import Prompts
    from bridgecache.models.zoo import load_model

    torch.set_num_threads(args.threads)
    source_name, target_name = PAIRS[args.pair]
    bridge = Bridge.from_pretrained(args.bridge or f"builtin:{source_name}->{target_name}")
    source, source_tok = load_model(source_name)
    target, target_tok = load_model(target_name)  # the cache plans on it; its forward never runs
    first, stop = _span(args.items)
    items = builtin_items(args.task, target_tok, limit=stop)
    prompts = Prompts(source_tok, target_tok)
    out = args.raw / "recall" / args.pair / f"{args.task}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["index"] for r in _read(out)}
    for i in range(first, stop):
        if i in done:
            continue
        item, start = items[i], time.perf_counter()
        context = prompts.context(item.context, bridge, words=True)
        if context.source_ids.shape[1] > source.config.max_position_embeddings:
            print(f"item {i}: {context.source_ids.shape[1]} source tokens exceed the window; skipped")
            continue
        kv = capture_kv(source, context.source_ids)
        query = torch.tensor([prompts.source_prompt(item)], dtype=torch.long)
        columns = answer_columns(target_tok, context.target_ids[0].tolist(), item.context, item.answers)
        wanted = [c for cols in columns for c in cols]
        record = {"index": i, "kind": item.kind, "pair": args.pair, "task": args.task, "commit": _commit()}
        for budget in args.budgets:
            amount = int(budget) if budget >= 1 else budget
            for name, whole_words in (("default", False), ("words", True)):
                # answer tokens only: word ends add the token after an answer, never one of it
                refresh = RefreshConfig(amount, "source", whole_words=whole_words, word_ends=False)
                config = HandoffConfig(refresh=refresh)
                cache = BridgedCache(
                    bridge, kv, target, context.target_ids, config=config, alignment=context.alignment,
                    source_model=source, prompt_ids=query, words=context.words,
                )  # fmt: skip
                picked = set(cache.refreshed_columns[0].tolist())
                record[f"{name}@{budget}"] = {
                    "tokens": sum(c in picked for c in wanted) / len(wanted),
                    "whole": sum(all(c in picked for c in cols) for cols in columns) / len(columns),
                }
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"item {i} ({item.kind}): {time.perf_counter() - start:.0f} s; {record}", flush=True)


# ---------------------------------------------------------------------- report


def _wilson(k: int, n: int) -> tuple[float, float]:
    from bridgecache.evaluation.answers import wilson

    return wilson(k, n)


def _boot(values: list[float], seed: int = 0) -> tuple[float, float]:
    if len(values) < 2:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(2000))
    return means[50], means[1949]


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _ci(lo_hi) -> str:
    lo, hi = lo_hi
    return "" if lo is None or math.isnan(lo) else f" [{100 * lo:.0f}, {100 * hi:.0f}]"


def _near_miss(reply: str, answer: str) -> bool:
    """A wrong first number within 2 single-digit edits of the answer (dropped, added, changed)."""
    from bridgecache.evaluation.answers import numbers

    found = numbers(reply)
    if not found or found[0] == answer:
        return False
    a, b = found[0], answer
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        row = [i]
        for j, y in enumerate(b, 1):
            row.append(min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = row
    return previous[-1] <= 2


def _retention_ci(pairs: list[tuple[bool, bool]]) -> tuple[float, float]:
    from bridgecache.evaluation.metrics import bootstrap_ci, ratio

    def stat(ix):
        return ratio(sum(pairs[i][0] for i in ix) / len(ix), sum(pairs[i][1] for i in ix) / len(ix))

    return bootstrap_ci(len(pairs), stat)


def summaries(records: list[dict]) -> dict:
    """{(pair, task): {"controls": {...}, "rows": {spec: {...}}}} from run records."""
    out: dict = {}
    by_cell: dict = {}
    for r in records:
        if "skipped" in r:
            continue
        by_cell.setdefault((r["pair"], r["task"]), {}).setdefault(row_name(r), {})[r["index"]] = r
    for cell, specs in by_cell.items():
        rows = {}
        for spec, items in specs.items():
            rs = [items[i] for i in sorted(items)]
            n = len(rs)
            k = sum(r["correct_bridged"] for r in rs)
            multi = [r for r in rs if len(r["answers"]) > 1]
            from bridgecache.evaluation.answers import partial

            cols = [c for r in rs for c in r["answer_columns"]]
            refreshed = [(set(r["refreshed"]), r["answer_columns"]) for r in rs]
            token_recall = [sum(c in s for cs in a for c in cs) / sum(map(len, a)) for s, a in refreshed]
            misses = [r for r in rs if not r["correct_bridged"]]
            rows[spec] = {
                "n": n,
                "acc": k / n,
                "acc_ci": _wilson(k, n),
                "native": sum(r["correct_native"] for r in rs) / n,
                "no_context": sum(r["correct_no_context"] for r in rs) / n,
                "retention": (k / n) / max(1e-12, sum(r["correct_native"] for r in rs) / n),
                "retention_ci": _retention_ci([(r["correct_bridged"], r["correct_native"]) for r in rs]),
                "partial": statistics.fmean(partial(r["reply_bridged"], r["answers"]) for r in multi)
                if multi
                else math.nan,
                "partial_n": len(multi),
                "flops": statistics.fmean(r["native_cost_fraction"] + r["guide_cost_fraction"] for r in rs),
                "cpu_handoff": statistics.fmean(r["cpu_s"]["handoff"] for r in rs),
                "cpu_native": statistics.fmean(r["cpu_s"]["native_prefill"] for r in rs),
                "cpu_source": statistics.fmean(r["cpu_s"]["source_prefill"] for r in rs),
                "wall_ratio": sum(r["handoff_s"] for r in rs) / sum(r["native_prefill_s"] for r in rs),
                "recall": statistics.fmean(token_recall) if cols else math.nan,
                "misses": len(misses),
                "near_misses": sum(
                    len(r["answers"]) == 1 and _near_miss(r["reply_bridged"], r["answers"][0]) for r in misses
                ),
                "misses_answer_refreshed": sum(
                    all(c in set(r["refreshed"]) for cs in r["answer_columns"] for c in cs) for r in misses
                )
                if spec != "plain"
                else 0,
                "kinds": {
                    kind: (
                        sum(r["correct_bridged"] for r in rs if r["kind"] == kind),
                        sum(r["kind"] == kind for r in rs),
                    )
                    for kind in ("single", "multikey", "multivalue")
                },
                "context_tokens": statistics.fmean(r["context_tokens"] for r in rs),
                "dates": sorted({r["date"] for r in rs}),
                "commits": sorted({r["commit"] for r in rs}),
                "indices": sorted(items),
            }
        # Controls over the union of items seen in this cell (every spec shares them).
        union = {}
        for items in specs.values():
            union |= items
        rs = list(union.values())
        n = len(rs)
        controls = {}
        for cond in ("native", "no_context"):
            k = sum(r[f"correct_{cond}"] for r in rs)
            controls[cond] = {"n": n, "acc": k / n, "acc_ci": _wilson(k, n)}
            controls[cond]["kinds"] = {
                kind: (
                    sum(r[f"correct_{cond}"] for r in rs if r["kind"] == kind),
                    sum(r["kind"] == kind for r in rs),
                )
                for kind in ("single", "multikey", "multivalue")
            }
        controls["cpu_native"] = statistics.fmean(r["cpu_s"]["native_prefill"] for r in rs)
        # The unrelated-context control: only records made since the runner measures it.
        unrelated = {
            r["index"]: r for items in specs.values() for r in items.values() if "correct_other_native" in r
        }
        if unrelated:
            k = sum(r["correct_other_native"] for r in unrelated.values())
            controls["unrelated"] = {
                "n": len(unrelated),
                "acc": k / len(unrelated),
                "acc_ci": _wilson(k, len(unrelated)),
            }
        out[cell] = {"controls": controls, "rows": rows, "threads": sorted({r.get("threads", 1) for r in rs})}
    return out


def cell_counts(cells: dict) -> list[dict]:
    """What a plot needs of `summaries()`' cells, as counts (right, n) per row and control, with
    each row's dates and commits: the form `report --cells` keeps in the repository, for cells
    whose records are not at hand."""
    entries = []
    for (pair, task), cell in sorted(cells.items()):
        controls = {
            cond: {"k": round(c["acc"] * c["n"]), "n": c["n"]}
            for cond, c in cell["controls"].items()
            if isinstance(c, dict) and "acc" in c
        }
        rows = {
            spec: {"k": round(s["acc"] * s["n"]), "n": s["n"], "dates": s["dates"], "commits": s["commits"]}
            for spec, s in cell["rows"].items()
        }
        cell_of = {"pair": pair, "task": task, "threads": cell["threads"]}
        entries.append(cell_of | {"controls": controls, "rows": rows})
    return entries


def cells_from_counts(entries: list[dict]) -> dict:
    """The cells `_plot` draws, from `cell_counts` entries (Wilson intervals from the counts)."""

    def acc(count: dict) -> dict:
        k, n = count["k"], count["n"]
        return {"acc": k / n, "acc_ci": _wilson(k, n), "n": n}

    return {
        (e["pair"], e["task"]): {
            "controls": {cond: acc(c) for cond, c in e["controls"].items()},
            "rows": {spec: acc(s) for spec, s in e["rows"].items()},
            "threads": e["threads"],
        }
        for e in entries
    }


def merge_counts(kept: list[dict], measured: list[dict]) -> list[dict]:
    """`kept` updated by `measured`: a measured row replaces the kept row of its name, a control
    is the one counted over more items (ties: the measured one); cells and rows that were not
    measured again stay as kept."""
    merged = {(e["pair"], e["task"]): copy.deepcopy(e) for e in kept}
    for e in measured:
        cell = merged.setdefault((e["pair"], e["task"]), {**e, "rows": {}, "controls": {}})
        cell["rows"] |= e["rows"]
        for cond, c in e["controls"].items():
            if c["n"] >= cell["controls"].get(cond, {"n": -1})["n"]:
                cell["controls"][cond] = c
        cell["threads"] = sorted(set(cell["threads"]) | set(e["threads"]))
    return [merged[key] for key in sorted(merged)]


def _kinds(kinds: dict) -> str:
    return ", ".join(f"{kind} {right}/{n}" for kind, (right, n) in kinds.items())


def _order(name: str) -> int:
    """A row's place: SPEC_ORDER's; a spec's rows made by the earlier ends (`row_name`) after it."""
    spec = name.split(" [")[0]
    return 2 * (SPEC_ORDER.index(spec) if spec in SPEC_ORDER else len(SPEC_ORDER)) + (spec != name)


def report(args) -> None:
    paths = sorted(args.raw.glob("*/*/*.jsonl"))
    tags = set(args.tags) if args.tags else {p.parent.parent.name for p in paths} - {"recall"}
    records = [r for path in paths if path.parent.parent.name in tags for r in _read(path)]
    cells = summaries(records)
    for (pair, task), cell in sorted(cells.items()):
        c = cell["controls"]
        print(f"\n#### {pair}, {task}\n")
        print(
            f"native {_pct(c['native']['acc'])}{_ci(c['native']['acc_ci'])} (n={c['native']['n']}); "
            f"no context {_pct(c['no_context']['acc'])}{_ci(c['no_context']['acc_ci'])}; "
            + (
                f"unrelated context {_pct(c['unrelated']['acc'])}{_ci(c['unrelated']['acc_ci'])} "
                f"(n={c['unrelated']['n']}); "
                if "unrelated" in c
                else ""
            )
            + f"target prefill {c['cpu_native']:.0f} CPU s/item\n"
        )
        print(
            "| variant | n | exact match [Wilson 95%] | native on these items | retention [bootstrap 95%] "
            "| multivalue partial | FLOPs share | CPU s handoff / native prefill | answer tokens refreshed "
            "| misses: near / answer refreshed |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for spec, s in sorted(cell["rows"].items(), key=lambda kv: _order(kv[0])):
            partial = f"{_pct(s['partial'])} of {s['partial_n']}" if s["partial_n"] else "-"
            cpu = (
                f"{s['cpu_handoff']:.1f} / {s['cpu_native']:.1f} = {_pct(s['cpu_handoff'] / s['cpu_native'])}"
            )
            misses = f"{s['misses']}: {s['near_misses']} / {s['misses_answer_refreshed']}"
            print(
                f"| {spec} | {s['n']} | {_pct(s['acc'])}{_ci(s['acc_ci'])} | {_pct(s['native'])} "
                f"| {_pct(s['retention'])}{_ci(s['retention_ci'])} | {partial} | {_pct(s['flops'])} "
                f"| {cpu} | {_pct(s['recall'])} | {misses} |"
            )
        print("\nper subtask (right / n):")
        for spec, s in sorted(cell["rows"].items(), key=lambda kv: _order(kv[0])):
            print(f"- {spec}: {_kinds(s['kinds'])}")
        print(f"- native: {_kinds(c['native']['kinds'])}; no context: {_kinds(c['no_context']['kinds'])}")
        row = next(iter(cell["rows"].values()))
        made = sorted(cell["rows"].items(), key=lambda kv: _order(kv[0]))
        dates = sorted({d for _, r in made for d in r["dates"]})
        commits = "; ".join(f"{spec} {', '.join(r['commits'])}" for spec, r in made)
        print(
            f"\nsource prefill {row['cpu_source']:.0f} CPU s/item; context {row['context_tokens']:.0f} "
            f"target tokens; dates {', '.join(dates)}; commits: {commits}"
        )
    if args.misses:
        _print_misses(records)
    recalls = [r for path in sorted((args.raw / "recall").glob("*/*.jsonl")) for r in _read(path)]
    if recalls:
        print("\n#### Selection recall of the answers' target tokens (held-out items)\n")
        print("| pair | task | items | budget | rule | answer tokens picked [95%] | answers whole [95%] |")
        print("|---|---|---|---|---|---|---|")
        groups: dict = {}
        for r in recalls:
            groups.setdefault((r["pair"], r["task"]), []).append(r)
        for (pair, task), rs in sorted(groups.items()):
            keys = [k for k in rs[0] if "@" in k]
            span = f"{min(r['index'] for r in rs)}-{max(r['index'] for r in rs)} (n={len(rs)})"
            for key in sorted(keys, key=lambda k: (k.split("@")[1], k)):
                name, budget = key.split("@")
                tokens = [r[key]["tokens"] for r in rs]
                whole = [r[key]["whole"] for r in rs]
                picked = f"{_pct(statistics.fmean(tokens))}{_ci(_boot(tokens))}"
                entire = f"{_pct(statistics.fmean(whole))}{_ci(_boot(whole))}"
                print(f"| {pair} | {task} | {span} | {budget} | {name} | {picked} | {entire} |")
    if args.cells:
        # Cells whose records are not at hand stay drawable from their counts; the cells of the
        # records here replace theirs.
        kept = json.loads(args.cells.read_text()) if args.cells.exists() else []
        counts = merge_counts(kept, cell_counts(cells))
        args.cells.write_text(json.dumps(counts, indent=1) + "\n")
        print(f"\nwrote {args.cells} ({len(counts)} cells)")
        cells = cells_from_counts(counts)
    if args.plot:
        _plot(cells, args.plot)


def _print_misses(records: list[dict]) -> None:
    """Every wrong bridged reply of a refresh variant: what was asked, what came back, and how
    much of the answer the refresh had recomputed."""
    print("\n#### Misses of the refresh variants\n")
    print("| pair | task | variant | item | kind | answers | reply | answer tokens refreshed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(
        records, key=lambda r: (r.get("pair", ""), r.get("task", ""), _order(r["spec"]), r["index"])
    ):
        if "skipped" in r or r["spec"] == "plain" or r["correct_bridged"]:
            continue
        picked = set(r["refreshed"])
        share = [f"{sum(c in picked for c in cols)}/{len(cols)}" for cols in r["answer_columns"]]
        reply = r["reply_bridged"].strip().replace("\n", " / ").replace("|", "\\|")[:60]
        where = f"{r['pair']} | {r['task']} | {r['spec']} | {r['index']} | {r['kind']}"
        print(f"| {where} | {' '.join(r['answers'])} | {reply} | {' '.join(share)} |")


def _variant_style(name: str) -> dict:
    """One colour per spec in every panel; a spec's rows made by the earlier ends in its colour,
    dotted, with hollow markers."""
    colour = f"C{_order(name) // 2}"
    if name.split(" [")[0] == name:
        return dict(color=colour)
    return dict(color=colour, linestyle=":", markerfacecolor="none", alpha=0.7)


def _plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = sorted({pair for pair, _ in cells})
    fig, axes = plt.subplots(1, len(pairs), figsize=(6.5 * len(pairs), 4.8), squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        tasks = sorted((t for p, t in cells if p == pair), key=lambda t: int(t.rsplit("-", 1)[1]))
        lengths = [int(t.rsplit("-", 1)[1]) for t in tasks]
        series: dict = {}
        for task, length in zip(tasks, lengths):
            cell = cells[(pair, task)]
            controls = (
                ("native", "native prefill"),
                ("no_context", "no context"),
                ("unrelated", "unrelated context"),
            )
            for cond, label in controls:
                if cond not in cell["controls"]:  # the unrelated control: records since b3e5f2d
                    continue
                c = cell["controls"][cond]
                series.setdefault(label, []).append((length, c["acc"], c["acc_ci"], c["n"]))
            for spec, s in cell["rows"].items():
                series.setdefault(spec, []).append((length, s["acc"], s["acc_ci"], s["n"]))
        styles = {
            "native prefill": dict(color="k", linestyle="--"),
            "no context": dict(color="grey", linestyle=":"),
            "unrelated context": dict(color="silver", linestyle="-."),
        }
        names = sorted(series, key=lambda n: (n not in styles, _order(n)))
        for slot, name in enumerate(names):
            points = sorted(series[name])
            # Each series a little to the side of the length it measures, so that intervals of
            # the same length stay readable (the x axis is logarithmic: a factor, not an offset).
            dodge = 2 ** (0.06 * (slot - (len(names) - 1) / 2))
            xs = [p[0] * dodge for p in points]
            ys = [100 * p[1] for p in points]
            err = [[100 * (p[1] - p[2][0]) for p in points], [100 * (p[2][1] - p[1]) for p in points]]
            style = styles.get(name) or _variant_style(name)
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(set(lengths)) or [4096])
        ax.set_xticklabels([f"{x // 1024}K" for x in sorted(set(lengths))] or ["4K"])
        ax.set_ylim(-3, 103)
        ax.set_xlabel("context length (target tokens, RULER's count)")
        ax.set_ylabel("exact match (%), Wilson 95% intervals")
        ax.set_title(pair)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    threads = sorted({t for cell in cells.values() for t in cell["threads"]})
    fig.suptitle(
        f"RULER needle retrieval through the handoff (2-core CPU, {'/'.join(map(str, threads))} "
        f"torch thread{'s' if threads != [1] else ''})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(required=True)
    for name, func in (("run", run), ("recall", recall)):
        p = sub.add_parser(name)
        p.add_argument("--pair", required=True, choices=list(PAIRS))
        p.add_argument("--bridge", help="default: the built-in bridge of the pair")
        p.add_argument("--task", default="needle-4096")
        p.add_argument("--items", default="0:30", help="FIRST:STOP item indices")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--raw", type=Path, default=RECORDS, help=f"the records' folder (default {RECORDS})")
        p.set_defaults(func=func)
        if name == "run":
            p.add_argument("--variants", nargs="+", default=["plain", "refresh=0.2"])
            p.add_argument("--tag", default="needle")
        else:
            p.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    p = sub.add_parser("report")
    p.add_argument("--raw", type=Path, default=RECORDS, help=f"the records' folder (default {RECORDS})")
    p.add_argument("--tags", nargs="*")
    p.add_argument("--plot", type=Path, help="e.g. benchmarks/reports/figures/needle_accuracy.png")
    p.add_argument("--misses", action="store_true", help="list every miss of the refresh variants")
    p.add_argument(
        "--cells",
        type=Path,
        help="counts per cell kept in the repository (benchmarks/reports/needle-cells.json): merged "
        "with the cells of the records here, written back, and what --plot draws",
    )
    p.set_defaults(func=report)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
