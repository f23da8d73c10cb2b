"""Host cost of whole words: tokenizing a context for a handoff with and without its words.

    python benchmarks/words_cost.py [--lengths 4096 16384 32768] [--repeats 5] [--threads 1]

`handoff()` tokenizes the context once per tokenizer (`tokenize_context`); with whole words (the
default refresh, wherever the text is known) it also finds each side's words, from the byte spans
of the same tokenizer calls. Per pair of tokenizers (one shared, two aligned) and context length,
the best of --repeats wall-clock times of `tokenize_context(words=False)` and
`tokenize_context(words=True)`, and of `word_groups` alone from spans already made. The text is
Python's own source (the standard library's `email` and `json` packages, repeated to length).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import email
import json
import time
from pathlib import Path

import torch

PAIRS = {
    "qwen -> qwen (one tokenizer)": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
    "smollm2 -> qwen (aligned)": ("smollm2-135m", "qwen2.5-coder-0.5b"),
}


def stdlib_text() -> str:
    text = []
    for package in (email, json):
        text += [p.read_text() for p in sorted(Path(package.__file__).parent.glob("*.py"))]
    return "\n".join(text)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    from bridgecache.bridge import Bridge
    from bridgecache.models.zoo import load_tokenizer
    from bridgecache.runtime.entry.handoff import tokenize_context
    from bridgecache.runtime.selection.words import word_groups
    from tokenalign import token_spans

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = stdlib_text()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, torch threads {args.threads}, best of {args.repeats}\n")
    print("| tokenizers | target tokens | tokenize | tokenize + words | words from spans |")
    print("|---|---|---|---|---|")
    for name, (source_name, target_name) in PAIRS.items():
        bridge = Bridge.from_pretrained(f"builtin:{source_name}->{target_name}")
        source_tok, target_tok = load_tokenizer(source_name), load_tokenizer(target_name)
        for length in args.lengths:
            # Whole lines of the text, repeated, until the target reads about `length` tokens.
            context = text
            while len(target_tok(context)["input_ids"]) < length:
                context += text
            ids = target_tok(context)["input_ids"][:length]
            context = target_tok.decode(ids[1:] if ids[0] == target_tok.bos_token_id else ids)
            n = len(target_tok(context)["input_ids"])
            plain = best(lambda: tokenize_context(bridge, context, source_tok, target_tok), args.repeats)  # noqa: B023
            words = best(
                lambda: tokenize_context(bridge, context, source_tok, target_tok, words=True),  # noqa: B023
                args.repeats,
            )
            _, spans = token_spans(context, target_tok)
            alone = best(lambda: word_groups(context, spans=spans), args.repeats)  # noqa: B023
            print(f"| {name} | {n} | {1e3 * plain:.1f} ms | {1e3 * words:.1f} ms | {1e3 * alone:.2f} ms |")


if __name__ == "__main__":
    main()
