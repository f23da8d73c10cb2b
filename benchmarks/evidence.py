"""Evidence study (issue 58): tasks where the target is stronger than the source, every arm.

    python benchmarks/evidence.py build --out DIR [--items 48]
    python benchmarks/evidence.py run --bridge BRIDGE [BRIDGE ...] --tasks DIR/two-hop.jsonl ... --out DIR
        [--arms all] [--chat] [--limit N] [--refresh 0.2 [0.5 ...]]
    python benchmarks/evidence.py table DIR        # every result in DIR, every arm
    python benchmarks/evidence.py scaffold DIR     # --chat results against plain ones, same items

`build` writes three 4-choice tasks (JSONL, `bridgecache eval --task choice` format), made only from
what Python ships and invented facts (never from editors' or GNU manuals):
    two-hop      who is the mayor of the town where PERSON lives (two stated facts to chain; the
                 other mayors in the context are the distractors)
    arithmetic   how many crates do the warehouses in TOWN and TOWN hold together (values stated in
                 the context; distractors are other pairs' sums and the sum +- 10)
    stdlib-code  the source of a pure-Python standard-library function; what is the default value
                 of one of its parameters (distractors: its other defaults, then other functions')
`run` evaluates a bridge (source and target from its metadata) on each task with the extra arms
(bridgecache.evaluation.arms) and writes one `summarise` JSON per task beside a table on stdout.
`--refresh` evaluates the default handoff at each refresh fraction on the same items in one pass
(the extra arms then run per fraction; `--arms none` keeps to the controls): one JSON per fraction,
named `...--refresh-R.json` where R is not the default 0.2.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import random
import sys
import textwrap
import time
from pathlib import Path

from bridgecache.evaluation.facts import _FIRST, _LAST, _TOWNS
from bridgecache.runtime.config import DEFAULT_REFRESH

SEED = 58


def _choices(rng: random.Random, right: str, wrong: list[str], k: int = 4) -> tuple[list[str], int]:
    wrong = list(dict.fromkeys(w for w in wrong if w != right))[: k - 1]
    if len(wrong) < k - 1:
        raise ValueError(f"too few distractors for {right!r}: {wrong}")
    at = rng.randrange(k)
    return wrong[:at] + [right] + wrong[at:], at


def two_hop(rng: random.Random) -> dict:
    people = rng.sample([f"{f} {last}" for f in _FIRST for last in _LAST], 12)
    towns = rng.sample(_TOWNS, 6)
    residents, mayors = people[:6], people[6:]
    lines = [f"{p} lives in {t}." for p, t in zip(residents, towns)]
    lines += [f"The mayor of {t} is {m}." for t, m in zip(towns, mayors)]
    rng.shuffle(lines)
    k = rng.randrange(6)
    choices, answer = _choices(rng, mayors[k], rng.sample(mayors[:k] + mayors[k + 1 :], 5))
    question = f"Who is the mayor of the town where {residents[k]} lives?"
    return {"context": " ".join(lines), "question": question, "choices": choices, "answer": answer}


def arithmetic(rng: random.Random) -> dict:
    towns = rng.sample(_TOWNS, 6)
    counts = [rng.randrange(11, 90) for _ in towns]
    lines = [f"The warehouse in {t} holds {n} crates." for t, n in zip(towns, counts)]
    a, b = rng.sample(range(6), 2)
    right = counts[a] + counts[b]
    others = [counts[a] + counts[c] for c in range(6) if c not in (a, b)]
    others += [counts[b] + counts[c] for c in range(6) if c not in (a, b)]
    wrong = [str(x) for x in rng.sample(others, len(others)) + [right + 10, right - 10] if x != right]
    choices, answer = _choices(rng, str(right), wrong)
    question = f"How many crates do the warehouses in {towns[a]} and {towns[b]} hold together?"
    return {"context": " ".join(lines), "question": question, "choices": choices, "answer": answer}


_STDLIB = (
    "textwrap", "calendar", "shlex", "difflib", "fnmatch", "glob", "gzip", "html", "imaplib", "json",
    "mimetypes", "netrc", "pprint", "quopri", "random", "sched", "smtplib", "statistics", "string",
    "tarfile", "tempfile", "uuid", "wave", "zipfile", "base64", "bisect", "csv", "ftplib", "heapq",
    "locale", "os", "poplib", "shutil", "socket", "subprocess", "tokenize", "traceback", "warnings",
)  # fmt: skip


def _stdlib_functions() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(qualified name, source, [(parameter, default source)]) of short pure-Python functions with
    at least two literal defaults, from the interpreter's own standard library."""
    found = []
    for name in _STDLIB:
        module = importlib.import_module(name)
        for attr, fn in sorted(vars(module).items()):
            if not inspect.isfunction(fn) or fn.__module__ != name or attr.startswith("_"):
                continue
            try:
                source = textwrap.dedent(inspect.getsource(fn))
            except (OSError, TypeError):
                continue
            lines = source.count("\n")
            if not 4 <= lines <= 30 or len(source) > 1400:
                continue
            args = ast.parse(source).body[0].args
            named = args.args[len(args.args) - len(args.defaults) :] + [
                a for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None
            ]
            values = list(args.defaults) + [d for d in args.kw_defaults if d is not None]
            pairs = [(a.arg, ast.unparse(v)) for a, v in zip(named, values) if isinstance(v, ast.Constant)]
            if len(pairs) >= 2:
                found.append((f"{name}.{attr}", source, pairs))
    return found


def stdlib_code(rng: random.Random, functions, pool: list[str], used: set) -> dict:
    while True:
        qualified, source, pairs = rng.choice(functions)
        parameter, right = rng.choice(pairs)
        if (qualified, parameter) not in used:
            used.add((qualified, parameter))
            break
    own = [d for p, d in pairs if p != parameter]
    wrong = own + rng.sample(pool, len(pool))
    choices, answer = _choices(rng, right, wrong)
    function = qualified.split(".")[-1]
    question = f"In the code above, what is the default value of the parameter `{parameter}` of `{function}`?"
    context = f"Source of {qualified} from the Python standard library:\n{source}"
    return {"context": context, "question": question, "choices": choices, "answer": answer}


def build(out: Path, items: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    functions = _stdlib_functions()
    pool = sorted({d for _, _, pairs in functions for _, d in pairs})
    used: set = set()
    makers = {
        "two-hop": two_hop,
        "arithmetic": arithmetic,
        "stdlib-code": lambda rng: stdlib_code(rng, functions, pool, used),
    }
    for task, make in makers.items():
        rng = random.Random(f"{task}/{SEED}")
        rows = [make(rng) for _ in range(items)]
        path = out / f"{task}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} items")


def run(args) -> None:
    import torch

    from bridgecache import Bridge
    from bridgecache.bridge.builtin import check_models
    from bridgecache.models.zoo import load_model

    torch.set_num_threads(args.threads)
    models: dict = {}  # name -> (model, tokenizer), loaded once for every bridge that reads it

    def model(name: str):
        if name not in models:
            start = time.perf_counter()
            models[name] = load_model(name)
            print(f"loaded {name} in {time.perf_counter() - start:.1f} s", flush=True)
        return models[name]

    for reference in args.bridge:
        bridge = Bridge.from_pretrained(reference)
        (target, target_tok), (source, source_tok) = model(bridge.target.name), model(bridge.source.name)
        check_models(bridge, source, target, source_tok, target_tok)
        _run_pair(args, bridge, source, source_tok, target, target_tok)


def _run_pair(args, bridge, source, source_tok, target, target_tok) -> None:
    from bridgecache import HandoffConfig, RefreshConfig
    from bridgecache.evaluation import Variant, evaluate, format_table, load_items, summarise

    variants = [
        Variant(bridge, HandoffConfig(route="handoff", refresh=RefreshConfig(amount=r))) for r in args.refresh
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    arms = None if args.arms == ["none"] else ("all" if args.arms == ["all"] else args.arms)
    for path in args.tasks:
        # a built-in task (`builtin:facts-choice-512`) is sized in the target's tokens
        items = load_items(str(path), "choice", tokenizer=target_tok, limit=args.limit)[1]
        start = time.perf_counter()
        ev = evaluate(
            source, source_tok, target, target_tok, items, "choice", variants,
            chat=args.chat, progress=True, arms=arms,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        pair = f"{Path(bridge.source.name).name}--{Path(bridge.target.name).name}"
        for refresh, variant in zip(args.refresh, variants):
            names = {"source": bridge.source.name, "target": bridge.target.name}
            summary = summarise(ev, variant, **names, data=str(path), chat=args.chat)
            summary["wall_s"] = seconds  # of the whole pass, every fraction together
            summary["refresh"] = refresh
            dial = "" if refresh == DEFAULT_REFRESH else f"--refresh-{refresh:g}"
            name = f"{pair}--{_file_task(path)}{dial}{'--chat' if args.chat else ''}.json"
            (args.out / name).write_text(json.dumps(summary, indent=1, default=str))
            print(format_table(summary))
            print(
                f"{_file_task(path)}, refresh {refresh:g}: {len(items)} items -> {args.out / name}",
                flush=True,
            )
        print(f"{_file_task(path)}: {len(items)} items in {seconds:.0f} s\n", flush=True)


def _file_task(path: Path) -> str:
    """A task's name in file names: a JSONL file's stem, or a built-in's name without `builtin:`."""
    return path.stem.removeprefix("builtin:")


_ARMS = ("native", "source_alone", "bridged", "translation", "chosen_only", "wrong_document", "random_map")
_ARMS += ("no_context", "other_native")
_DIFFS = (
    ("bridged", "native"),
    ("bridged", "chosen_only"),
    ("translation", "wrong_document"),
    ("translation", "random_map"),
    ("translation", "no_context"),
)


def _task_name(result: dict) -> str:
    """The task's file name, with the refresh fraction where a dial set another than the default."""
    refresh = result.get("refresh", DEFAULT_REFRESH)
    return Path(result["data"]).stem + ("" if refresh == DEFAULT_REFRESH else f", refresh {refresh:g}")


def table(folder: Path) -> None:
    """Markdown tables of every result JSON in `folder`: accuracy per arm (Wilson 95%), then the
    gap recovered, retention and paired differences (bootstrap 95%) and the handoff's cost."""
    from bridgecache.evaluation.answers import wilson

    results = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]

    def pct(x):
        return "n/a" if x is None or x != x else f"{100 * x:.1f}"

    def ci(pair):
        return (
            ""
            if pair is None or pair[0] is None or pair[0] != pair[0]
            else f" [{pct(pair[0])}, {pct(pair[1])}]"
        )

    print("| pair | task | chat | n | " + " | ".join(_ARMS) + " |")
    print("|---" * (len(_ARMS) + 4) + "|")
    for r in results:
        cells = []
        for arm in _ARMS:
            if f"acc_{arm}" not in r:
                cells.append("-")
                continue
            right = sum(1 for item in r["items"] if item[f"pick_{arm}"] == item["answer"])
            cells.append(f"{pct(r[f'acc_{arm}'])}{ci(wilson(right, r['n']))}")
        task = _task_name(r)
        print(
            f"| {r['source']} -> {r['target']} | {task} | {'yes' if r.get('chat') else 'no'} | {r['n']} | "
            + " | ".join(cells)
            + " |"
        )
    print()
    heads = ["gap recovered", "retention"] + [f"{a} - {b}" for a, b in _DIFFS]
    print(
        "| pair | task | chat | "
        + " | ".join(heads)
        + " | native FLOPs | + choosing | chosen share | map uses input | wall s |"
    )
    print("|---" * (len(heads) + 8) + "|")
    for r in results:
        cells = [
            f"{pct(r.get('gap_recovered'))}{ci(r.get('gap_recovered_ci'))}",
            f"{pct(r['retention'])}{ci(r['retention_ci'])}",
        ]
        for a, b in _DIFFS:
            key = f"diff_{a}_{b}"
            cells.append(f"{pct(r[key])}{ci(r[key + '_ci'])}" if key in r else "-")
        cells += [pct(r["native_cost_fraction"]), pct(r["guide_cost_fraction"]), pct(r.get("chosen_share"))]
        cells += [str(r.get("map_uses_input")), f"{r.get('wall_s', 0):.0f}"]
        task = _task_name(r)
        print(
            f"| {r['source']} -> {r['target']} | {task} | {'yes' if r.get('chat') else 'no'} | "
            + " | ".join(cells)
            + " |"
        )


def scaffold(folder: Path) -> None:
    """The chat template's fresh assistant turn against the plain `Answer:` delimiter (issue 58 item
    4): every `--chat` result in `folder` beside the plain result of the same pair and task, the
    same items; accuracy of the native reading and of the handoff under each, and the paired
    difference chat - plain (bootstrap 95% over items)."""
    from bridgecache.evaluation.metrics import bootstrap_ci

    def pct(x):
        return f"{100 * x:.1f}"

    print("| pair | task | n | native: plain / chat | chat - plain | handoff: plain / chat | chat - plain |")
    print("|---" * 7 + "|")
    for chat_path in sorted(folder.glob("*--chat.json")):
        chat = json.loads(chat_path.read_text())
        plain_path = chat_path.with_name(chat_path.name.replace("--chat.json", ".json"))
        if not plain_path.exists():
            print(f"| {chat['source']} -> {chat['target']} | {_task_name(chat)} | no plain result |")
            continue
        plain = json.loads(plain_path.read_text())
        by_index = {item["index"]: item for item in plain["items"]}
        pairs = [(by_index[item["index"]], item) for item in chat["items"] if item["index"] in by_index]
        cells = []
        for arm in ("native", "bridged"):
            right = [
                (float(p[f"pick_{arm}"] == p["answer"]), float(c[f"pick_{arm}"] == c["answer"]))
                for p, c in pairs
            ]

            def diff(indices, right=right):
                return sum(right[i][1] - right[i][0] for i in indices) / len(indices)

            low, high = bootstrap_ci(len(right), diff)
            plain_acc = sum(r[0] for r in right) / len(right)
            chat_acc = sum(r[1] for r in right) / len(right)
            cells += [
                f"{pct(plain_acc)} / {pct(chat_acc)}",
                f"{pct(chat_acc - plain_acc)} [{pct(low)}, {pct(high)}]",
            ]
        print(
            f"| {chat['source']} -> {chat['target']} | {_task_name(chat)} | {len(pairs)} | "
            + " | ".join(cells)
            + " |"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--items", type=int, default=48)
    r = sub.add_parser("run")
    r.add_argument("--bridge", nargs="+", required=True, help="one or more bridges, run in turn")
    r.add_argument("--tasks", type=Path, nargs="+", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--arms", nargs="+", default=["all"])
    r.add_argument("--chat", action="store_true")
    r.add_argument("--limit", type=int)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument(
        "--refresh", type=float, nargs="+", default=[DEFAULT_REFRESH],
        help="refresh fractions of the default handoff, evaluated on the same items in one pass",
    )  # fmt: skip
    t = sub.add_parser("table")
    t.add_argument("folder", type=Path)
    c = sub.add_parser("scaffold", help="chat against plain results, paired on the same items")
    c.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "table":
        table(args.folder)
        return 0
    if args.command == "scaffold":
        scaffold(args.folder)
        return 0
    if args.command == "build":
        build(args.out, args.items)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
