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
the target answers k further unrelated user turns (FILLERS, greedy, --max-new-tokens) and is then
asked the item's question; the choice with the highest mean log-likelihood per token as the
assistant's reply is its answer. Accuracy is reported after each k of --turns (one conversation per
item serves every k: scoring leaves the chat unchanged), with Wilson 95% intervals and, per
bridged condition, a paired bootstrap interval of its difference from native. Prints a table;
--json writes the numbers, the per-item answers and the command. On CPU, pass --threads 1 on a
shared machine.
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
):
    """{condition: {k: correct count}} over `items` after k further turns, for each k in turns.

    configs: bridged condition -> its HandoffConfig (default {"bridged": HandoffConfig()}); the
    "native" condition is always measured. records (a list) receives one dict per item:
    condition -> k -> right."""
    from bridgecache import HandoffConfig
    from bridgecache.runtime.conversation import Conversation

    configs = {"bridged": HandoffConfig()} if configs is None else configs
    correct = {kind: dict.fromkeys(turns, 0) for kind in [*configs, "native"]}
    for item in items:
        earlier = [{"role": "user", "content": item.context}, {"role": "assistant", "content": ACK}]
        tokenizers = dict(source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer)
        chats = {
            kind: Conversation.handoff(bridge, source, target, earlier, **tokenizers, config=config)
            for kind, config in configs.items()
        }
        chats["native"] = Conversation.native(target, target_tokenizer, earlier)
        record = {kind: {} for kind in chats}
        for kind, chat in chats.items():
            done = 0
            for k in sorted(turns):
                for filler in FILLERS[done:k]:
                    chat.ask(filler, max_new_tokens=max_new_tokens, do_sample=False)
                done = k
                scores = chat.score(item.question, item.choices)
                right = max(range(len(scores)), key=scores.__getitem__) == item.answer
                correct[kind][k] += int(right)
                record[kind][k] = right
        if records is not None:
            records.append(record)
    return correct


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
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", help="write the result here")
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
    bridge = Bridge.from_pretrained(args.bridge or f"builtin:{args.source}->{args.target}")
    items = builtin_items(args.task, target_tok, limit=args.limit)
    configs = {"bridged": HandoffConfig()}
    if args.refresh:
        amount = int(args.refresh) if args.refresh >= 1 else args.refresh
        configs["refreshed"] = HandoffConfig(refresh=RefreshConfig(amount, whole_words=args.whole_words))
    start = time.perf_counter()
    records: list[dict] = []
    correct = drift(
        source,
        target,
        bridge,
        items,
        args.turns,
        source_tokenizer=source_tok,
        target_tokenizer=target_tok,
        max_new_tokens=args.max_new_tokens,
        configs=configs,
        records=records,
    )
    n = len(items)
    result = {
        "source": args.source,
        "target": args.target,
        "bridge": args.bridge or f"builtin:{args.source}->{args.target}",
        "method": bridge.method,
        "task": args.task,
        "n": n,
        "max_new_tokens": args.max_new_tokens,
        "configs": {kind: config.label for kind, config in configs.items()},
        "accuracy": {kind: {str(k): c / n for k, c in by_k.items()} for kind, by_k in correct.items()},
        "intervals": _intervals(records, args.turns),
        "items": [{kind: {str(k): v for k, v in by_k.items()} for kind, by_k in r.items()} for r in records],
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.perf_counter() - start, 1),
        "command": shlex.join(
            ["python", "benchmarks/multi_turn_drift.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    print(f"{args.source} -> {args.target} ({bridge.method}), {args.task}, {n} items")
    kinds = ["native", *configs]
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


if __name__ == "__main__":
    main()
