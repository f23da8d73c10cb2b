"""Drift over turns: does a bridged conversation keep the facts of the document it was handed?

    python benchmarks/multi_turn_drift.py --source qwen2.5-coder-1.5b --target qwen2.5-coder-0.5b \\
        [--bridge builtin:qwen2.5-coder-1.5b->qwen2.5-coder-0.5b] [--task facts-choice-512] [--limit 24] \\
        [--turns 0 1 2 4] [--max-new-tokens 32] [--json drift.json]

For each built-in fact item (bridgecache.evaluation, `facts-choice-N`: invented facts, five
choices, answerable only from the context), the conversation so far is two messages: the user
shares the context, the assistant acknowledges. Then, on one cache each:
    bridged  the source read those turns; the target's cache of them is translated (Conversation.handoff)
    native   the target read them itself (Conversation.native)
the target answers k further unrelated user turns (FILLERS, greedy, --max-new-tokens) and is then
asked the item's question; the choice with the highest mean log-likelihood per token as the
assistant's reply is its answer. Accuracy is reported after each k of --turns (one conversation per
item serves every k: scoring leaves the chat unchanged). Prints a table; --json writes the numbers
and the command. On CPU, pass --threads 1 on a shared machine.
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


def drift(source, target, bridge, items, turns, *, source_tokenizer, target_tokenizer, max_new_tokens=32):
    """{"bridged"|"native": {k: correct count}} over `items` after k further turns, for each k in turns."""
    from bridgecache.runtime.conversation import Conversation

    correct = {kind: dict.fromkeys(turns, 0) for kind in ("bridged", "native")}
    for item in items:
        earlier = [{"role": "user", "content": item.context}, {"role": "assistant", "content": ACK}]
        chats = {
            "bridged": Conversation.handoff(
                bridge,
                source,
                target,
                earlier,
                source_tokenizer=source_tokenizer,
                target_tokenizer=target_tokenizer,
            ),
            "native": Conversation.native(target, target_tokenizer, earlier),
        }
        for kind, chat in chats.items():
            done = 0
            for k in sorted(turns):
                for filler in FILLERS[done:k]:
                    chat.ask(filler, max_new_tokens=max_new_tokens, do_sample=False)
                done = k
                scores = chat.score(item.question, item.choices)
                correct[kind][k] += int(max(range(len(scores)), key=scores.__getitem__) == item.answer)
    return correct


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
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if not args.task.startswith("facts-choice"):
        parser.error("--task must be a built-in facts-choice-N task")
    if min(args.turns) < 0 or max(args.turns) > len(FILLERS):
        parser.error(f"--turns must lie in 0..{len(FILLERS)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    from bridgecache import Bridge, load_model
    from bridgecache.evaluation.builtin import builtin_items

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    bridge = Bridge.from_pretrained(args.bridge or f"builtin:{args.source}->{args.target}")
    items = builtin_items(args.task, target_tok, limit=args.limit)
    start = time.perf_counter()
    correct = drift(
        source,
        target,
        bridge,
        items,
        args.turns,
        source_tokenizer=source_tok,
        target_tokenizer=target_tok,
        max_new_tokens=args.max_new_tokens,
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
        "accuracy": {kind: {str(k): c / n for k, c in by_k.items()} for kind, by_k in correct.items()},
        "seconds": round(time.perf_counter() - start, 1),
        "command": shlex.join(
            ["python", "benchmarks/multi_turn_drift.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    print(f"{args.source} -> {args.target} ({bridge.method}), {args.task}, {n} items")
    print(f"{'further turns':>14}{'native':>9}{'bridged':>9}")
    for k in sorted(args.turns):
        acc = result["accuracy"]
        print(f"{k:>14}{acc['native'][str(k)]:>9.3f}{acc['bridged'][str(k)]:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
