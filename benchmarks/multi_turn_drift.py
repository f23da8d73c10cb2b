"""Drift over turns: does a bridged conversation keep the facts of the document it was handed?

    python benchmarks/multi_turn_drift.py --source qwen2.5-coder-1.5b --target qwen2.5-coder-0.5b \\
        [--bridge builtin:qwen2.5-coder-1.5b->qwen2.5-coder-0.5b] [--task facts-choice-512] [--limit 24] \\
        [--turns 0 1 2 4] [--max-new-tokens 32] [--refresh 0.2 [--no-whole-words]] [--json drift.json]

For each built-in fact item (bridgecache.evaluation, `facts-choice-N`: invented facts, five
choices, answerable only from the context), the conversation so far is two messages: the user
shares the context, the assistant acknowledges. Then, on one cache each:
    bridged    the source read those turns; the target's cache of them is translated
               (Conversation.handoff with HandoffConfig(): its default refresh)
    refreshed  with --refresh F: as bridged, with HandoffConfig(refresh=RefreshConfig(F)): whole
               words, as in every Conversation (RefreshConfig(F, whole_words=False) with
               --no-whole-words); the source chooses the refreshed tokens by reading the first
               user turn after the handover
    native     the target read them itself (Conversation.native)
and two controls the target reads itself (--no-controls leaves them out):
    no-context the conversation opens with a greeting instead of the context: what the model
               answers from no document (chance is 20%)
    unrelated  the context shared is another item's (the next one's): the same kind of document,
               but not the one the question asks about
the target answers k further unrelated user turns (FILLERS, greedy, --max-new-tokens) and is then
asked the item's question; the choice with the highest mean log-likelihood per token as the
assistant's reply is its answer. Accuracy is reported after each k of --turns (one conversation per
item serves every k: scoring leaves the chat unchanged), with Wilson 95% intervals and, per
bridged condition, a paired bootstrap interval of its difference from native. Prints a table;
--json writes the numbers, the per-item answers and the command. --records FILE.jsonl keeps one
line per finished item (with the run's settings): a killed run started again with the same
settings resumes after the items it finished. --explain ITEM... instead says, per item, the choice
each conversation picks at turn 0 and how many tokens of each choice's text in the chat the refresh
recomputed. On CPU, pass --threads 1 on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import torch

FILLERS = (
    "What is a good name for a grey cat?",
    "Give me one tip for keeping basil alive indoors.",
    "What is the capital of Portugal?",
    "Write one sentence about autumn.",
    "How many legs does a spider have?",
    "Suggest a title for a short story about a lost key.",
    "What colour do you get by mixing blue and yellow?",
    "Name a board game that two people can play.",
)
ACK = "I have read it and will keep it in mind."
GREETING = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hello! How can I help?"}]
CONTROLS = ("no-context", "unrelated")


def drift(
    source,
    target,
    bridge,
    items,
    turns,
    *,
    source_tokenizer,
    target_tokenizer,
    max_new_tokens=32,
    configs=None,
    records=None,
    controls=False,
    others=None,
    on_record=None,
    known=None,
):
    """{condition: {k: correct count}} over `items` after k further turns, for each k in turns.

    configs: bridged condition -> its HandoffConfig (default {"bridged": HandoffConfig()}); the
    "native" condition is always measured, and with `controls` the "no-context" and "unrelated"
    ones (item i's unrelated context is others[i].context; default: the next item's). records (a
    list) receives one dict per item: condition -> k -> right; on_record(i, record) is called as
    each item finishes. known: per item, {condition: {k: right}} already measured (native and
    the controls of an earlier run, which no config changes): those conversations are not run
    again and their answers enter the record as given."""
    from tqdm.auto import tqdm

    from bridgecache import HandoffConfig
    from bridgecache.runtime.entry.conversation import Conversation

    configs = {"bridged": HandoffConfig()} if configs is None else configs
    kinds = [*configs, "native", *(CONTROLS if controls else ())]
    correct = {kind: dict.fromkeys(turns, 0) for kind in kinds}
    others = others if others is not None else [items[(i + 1) % len(items)] for i in range(len(items))]
    known = known if known is not None else [{}] * len(items)
    tokenizers = dict(source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer)
    items_shown = tqdm(items, desc="drift items", unit="item")

    def answers(kind, item, other) -> dict:
        if kind in configs:
            shared = _shared(item)
            chat = Conversation.handoff(bridge, source, target, shared, **tokenizers, config=configs[kind])
        else:
            shared = {"native": _shared(item), "no-context": GREETING, "unrelated": _shared(other)}[kind]
            chat = Conversation.native(target, target_tokenizer, shared)
        return _answers(chat, item, turns, max_new_tokens)

    for i, (item, other, given) in enumerate(zip(items_shown, others, known, strict=True)):
        record = {  # a conversation whose answers are known never runs
            kind: given[kind] if kind in given else answers(kind, item, other) for kind in kinds
        }
        for kind, by_k in record.items():
            for k, right in by_k.items():
                correct[kind][k] += int(right)
        if records is not None:
            records.append(record)
        if on_record is not None:
            on_record(i, record)
    return correct


def _shared(item) -> list[dict]:
    """The conversation so far: the user shares the item's context, the assistant acknowledges."""
    return [{"role": "user", "content": item.context}, {"role": "assistant", "content": ACK}]


def _answers(chat, item, turns, max_new_tokens) -> dict:
    """{k: whether the chat picks the item's answer after k further (filler) turns}."""
    out, done = {}, 0
    for k in sorted(turns):
        for filler in FILLERS[done:k]:
            chat.ask(filler, max_new_tokens=max_new_tokens, do_sample=False)
        done = k
        out[k] = _pick(chat, item) == item.answer
    return out


def _pick(chat, item) -> int:
    """The index of the choice `chat` likes best as its reply to the item's question."""
    scores = chat.score(item.question, item.choices)
    return max(range(len(scores)), key=scores.__getitem__)


def explain(source, target, bridge, item, *, source_tokenizer, target_tokenizer, config=None) -> dict:
    """Why a bridged chat answers `item` as it does at turn 0: the choice each conversation picks
    and, for every choice, how many of its tokens the refresh recomputed at each place the shared
    chat holds it ("refreshed/tokens" per occurrence; the target's rendering, byte spans from
    tokenalign), and those tokens with three before and one after, each marked R (refreshed) or
    t (translated). Returns {"bridged", "native", "answer": choice indices, "refreshed", "tokens":
    counts over the chat, "choices": [{"text", "occurrences", "around"}]}."""
    from bridgecache import HandoffConfig
    from bridgecache.runtime.entry.conversation import Conversation
    from tokenalign import render_chat, token_spans

    chat = Conversation.handoff(
        bridge, source, target, _shared(item), source_tokenizer=source_tokenizer,
        target_tokenizer=target_tokenizer, config=config or HandoffConfig(),
    )  # fmt: skip
    native = Conversation.native(target, target_tokenizer, _shared(item))
    picks = {"bridged": _pick(chat, item), "native": _pick(native, item)}  # the first builds the cache
    refreshed = set(chat.cache.refreshed_columns[0].tolist())
    text = render_chat(_shared(item), target_tokenizer).text
    _, spans = token_spans(text, target_tokenizer, chat.ids[0].tolist())
    data = text.encode("utf-8")
    choices = []
    for choice in item.choices:
        needle, found, around = choice.encode("utf-8"), [], []
        at = data.find(needle)
        while at >= 0:  # the tokens that overlap this occurrence's bytes
            tokens = [t for t in range(len(spans)) if spans.start[t] < at + len(needle) and spans.end[t] > at]
            found.append(f"{sum(t in refreshed for t in tokens)}/{len(tokens)}")
            near = range(max(tokens[0] - 3, 0), min(tokens[-1] + 2, len(spans)))  # 3 before, 1 after
            marked = [f"{data[spans.start[t] : spans.end[t]].decode(errors='replace')!r}" for t in near]
            around.append(
                " ".join(m + ("R" if t in refreshed else "t") for m, t in zip(marked, near, strict=True))
            )
            at = data.find(needle, at + 1)
        choices.append({"text": choice, "occurrences": found, "around": around})
    return {
        **picks,
        "answer": item.answer,
        "refreshed": len(refreshed),
        "tokens": len(spans),
        "choices": choices,
    }


def _intervals(records: list[dict], turns) -> dict:
    """Wilson 95% interval per condition and k ("kind@k"); paired bootstrap 95% interval of each
    bridged condition's accuracy minus native's ("kind-native@k")."""
    from bridgecache.evaluation.answers import wilson
    from bridgecache.evaluation.metrics import bootstrap_ci

    n = len(records)
    out = {}
    for kind in records[0]:
        for k in turns:
            out[f"{kind}@{k}"] = list(wilson(sum(r[kind][k] for r in records), n))
            if kind != "native":
                diffs = [int(r[kind][k]) - int(r["native"][k]) for r in records]
                out[f"{kind}-native@{k}"] = list(
                    bootstrap_ci(n, lambda ix, d=diffs: sum(d[i] for i in ix) / len(ix))
                )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default="qwen2.5-coder-1.5b")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument(
        "--bridge", help="directory, builtin:NAME or hub id (default: builtin:SOURCE->TARGET)"
    )
    parser.add_argument("--task", default="facts-choice-512", help="a built-in facts-choice-N task")
    parser.add_argument("--limit", type=int, default=24, help="items")
    parser.add_argument(
        "--turns", type=int, nargs="+", default=[0, 1, 2, 4], help="further turns before asking"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, help="reply length of each further turn")
    parser.add_argument(
        "--refresh", type=float, help="also a conversation whose bridged cache refreshes this share (0.2)"
    )
    parser.add_argument(
        "--whole-words",
        action=argparse.BooleanOptionalAction,
        help="--refresh's conversation refreshes whole words (the default) or, with --no-whole-words, "
        "token by token",
    )
    parser.add_argument(
        "--controls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the no-context and unrelated-context conversations (on by default)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--records", help="JSONL of finished items: resume a killed run from it")
    parser.add_argument(
        "--reuse",
        metavar="RECORDS.jsonl|RESULT.json",
        help="take native's and the controls' answers from the records (or the --json result, such as "
        "a report's raw file) of an earlier run that differs only in its bridged configs (a new "
        "default): only the bridged conversations run again",
    )
    parser.add_argument(
        "--explain",
        type=int,
        nargs="+",
        metavar="ITEM",
        help="instead of the run: for these item indices, the choice each conversation picks at turn 0 "
        "and how much of each choice's text in the chat the default refresh recomputed",
    )
    args = parser.parse_args(argv)
    if not args.task.startswith("facts-choice"):
        parser.error("--task must be a built-in facts-choice-N task")
    if min(args.turns) < 0 or max(args.turns) > len(FILLERS):
        parser.error(f"--turns must lie in 0..{len(FILLERS)}")
    if args.whole_words is not None and not args.refresh:
        parser.error("--[no-]whole-words is an option of --refresh's conversation")
    if args.threads:
        torch.set_num_threads(args.threads)

    from bridgecache import Bridge, HandoffConfig, RefreshConfig, load_model
    from bridgecache.evaluation.builtin import builtin_items

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    bridge_name = args.bridge or f"builtin:{args.source}->{args.target}"
    bridge = Bridge.from_pretrained(bridge_name)
    items = builtin_items(args.task, target_tok, limit=args.limit)
    if args.explain:
        if not all(0 <= i < len(items) for i in args.explain):
            parser.error(f"--explain takes item indices in 0..{len(items) - 1} (--limit {args.limit})")
        tokenizers = dict(source_tokenizer=source_tok, target_tokenizer=target_tok)
        found = {i: explain(source, target, bridge, items[i], **tokenizers) for i in args.explain}
        for i, why in found.items():
            picks = f"answer {why['answer']}, bridged picks {why['bridged']}, native picks {why['native']}"
            print(f"item {i}: {picks}; {why['refreshed']} of {why['tokens']} chat tokens refreshed")
            for c, choice in enumerate(why["choices"]):
                where = ", ".join(choice["occurrences"]) or "not in the chat"
                print(f"  choice {c} {choice['text']!r}: refreshed/tokens where the chat holds it: {where}")
                for tokens in choice["around"]:  # R: refreshed, t: translated
                    print(f"    {tokens}")
        return {"explain": found}
    configs = {"bridged": HandoffConfig()}
    if args.refresh:
        amount = int(args.refresh) if args.refresh >= 1 else args.refresh
        configs["refreshed"] = HandoffConfig(refresh=RefreshConfig(amount, whole_words=args.whole_words))
    settings = {
        "source": args.source,
        "target": args.target,
        "bridge": bridge_name,
        "task": args.task,
        "item_count": len(items),  # the task's items depend on how many are made
        "turns": sorted(args.turns),
        "max_new_tokens": args.max_new_tokens,
        # what each config does, spelled out: a label says "default" whatever the default is
        "configs": {kind: config.kv_recipe for kind, config in configs.items()},
        "controls": args.controls,
    }
    finished = _finished(args.records, settings) if args.records else {}
    reused = {}
    if args.reuse:  # what no config changes: native and the controls
        earlier = _earlier(args.reuse, settings)
        unchanged = ("native", *(CONTROLS if args.controls else ()))
        reused = {i: {kind: r[kind] for kind in unchanged} for i, r in earlier.items()}
        print(f"reusing native and the controls of {len(reused)} items from {args.reuse}")
    todo = [i for i in range(len(items)) if i not in finished]
    if finished:
        print(f"resuming: {len(finished)} items finished in {args.records}, {len(todo)} to go")

    def keep(position: int, record: dict) -> None:
        finished[todo[position]] = record
        if args.records:
            line = {"settings": settings, "index": todo[position], "record": _jsonable(record)}
            with open(args.records, "a") as f:
                f.write(json.dumps(line) + "\n")

    start = time.perf_counter()
    drift(
        source,
        target,
        bridge,
        [items[i] for i in todo],
        args.turns,
        source_tokenizer=source_tok,
        target_tokenizer=target_tok,
        max_new_tokens=args.max_new_tokens,
        configs=configs,
        controls=args.controls,
        others=[items[(i + 1) % len(items)] for i in todo],
        on_record=keep,
        known=[reused.get(i, {}) for i in todo],
    )
    records = [finished[i] for i in range(len(items))]
    kinds = list(records[0])
    correct = {kind: {k: sum(r[kind][k] for r in records) for k in args.turns} for kind in kinds}
    n = len(items)
    result = {
        **settings,
        "labels": {kind: config.label for kind, config in configs.items()},
        "method": bridge.method,
        "n": n,
        "accuracy": {kind: {str(k): c / n for k, c in by_k.items()} for kind, by_k in correct.items()},
        "intervals": _intervals(records, args.turns),
        "items": [_jsonable(r) for r in records],
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.perf_counter() - start, 1),
        "command": shlex.join(
            ["python", "benchmarks/multi_turn_drift.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    print(f"{args.source} -> {args.target} ({bridge.method}), {args.task}, {n} items")
    kinds = ["native", *configs, *(CONTROLS if args.controls else ())]
    print(f"{'further turns':>14}" + "".join(f"{kind:>24}" for kind in kinds))
    for k in sorted(args.turns):
        acc, ci = result["accuracy"], result["intervals"]
        cells = [
            f"{acc[kind][str(k)]:.3f} [{ci[f'{kind}@{k}'][0]:.2f}, {ci[f'{kind}@{k}'][1]:.2f}]"
            for kind in kinds
        ]
        print(f"{k:>14}" + "".join(f"{c:>24}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _jsonable(record: dict) -> dict:
    """condition -> {str(k): right}: JSON keys are strings."""
    return {kind: {str(k): bool(v) for k, v in by_k.items()} for kind, by_k in record.items()}


def _from_jsonable(record: dict) -> dict:
    """`_jsonable`'s inverse: condition -> {k: right}."""
    return {kind: {int(k): v for k, v in by_k.items()} for kind, by_k in record.items()}


def _earlier(path: str, settings: dict) -> dict:
    """--reuse's records: a --records JSONL, or a --json result (which holds its settings and one
    record per item), made with `settings` but for the bridged configs."""
    if not path.endswith(".json"):
        return _finished(path, settings, ignore=("configs",))
    with open(path) as f:
        result = json.load(f)
    differ = sorted(k for k in settings if k != "configs" and result.get(k) != settings[k])
    if differ:
        shown = ", ".join(f"{k}: {result.get(k)!r} there, {settings[k]!r} here" for k in differ)
        raise SystemExit(
            f"--reuse {path}: made with other settings ({shown}); expected all but the configs alike"
        )
    return {i: _from_jsonable(record) for i, record in enumerate(result["items"])}


def _finished(path: str, settings: dict, ignore: tuple = ()) -> dict:
    """{item index: record (condition -> k -> right)} of the lines in `path` made with `settings`
    (the keys in `ignore` aside); lines of other settings are ignored (said once), so one file may
    hold several runs."""
    import os

    if not os.path.exists(path):
        return {}
    out, other = {}, 0
    with open(path) as f:
        for line in f:
            entry = json.loads(line)
            if {**entry["settings"], **dict.fromkeys(ignore)} != {**settings, **dict.fromkeys(ignore)}:
                other += 1
                continue
            out[entry["index"]] = _from_jsonable(entry["record"])
    if other:
        print(f"{path}: {other} lines of other settings ignored")
    return out


if __name__ == "__main__":
    main()
