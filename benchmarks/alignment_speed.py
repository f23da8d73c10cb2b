"""Alignment throughput on CPU for ~4K-token texts, beside the target's prefill time.

    python benchmarks/alignment_speed.py              # alignment only (seconds)
    python benchmarks/alignment_speed.py --prefill    # also time the target's prefill (minutes)

Text: Python's own documentation (`pydoc_data.topics`), cut so the source tokenizer makes about
`--tokens` tokens. For each (source, target) pair it times, median of `--repeats` after a warm-up:
- `align`: both tokenizations with offsets + tokenalign's work (what handoff and fitting call);
- tokenizing alone (the two tokenizer calls), so tokenalign's own share is the difference;
- `align_ids`: from ids only (each side's text rebuilt from its vocabulary, then matched);
and prints a markdown table. Alignment is linear: one pass over each token list.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from functools import partial

from tokenalign import align, align_ids

PAIRS = [
    ("smollm2-135m", "qwen2.5-coder-0.5b"),
    ("qwen2.5-coder-0.5b", "gemma3-270m"),
    ("gemma3-270m", "smollm2-135m"),
]


def documentation_text(tokenizer, tokens: int) -> str:
    """The first `tokens` tokens' worth of pydoc topics (by the given tokenizer's offsets)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text[: offsets[min(tokens, len(offsets)) - 1][1]]


def tokenize_both(text: str, source, target) -> None:
    """The tokenizer calls inside `align`, alone."""
    for tokenizer in (source, target):
        tokenizer(text, return_offsets_mapping=True)


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: vocab caches, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_seconds(name: str, ids: list[int]) -> float:
    """One forward pass of the target over the ids (after a 64-token warm-up), fp32 on CPU."""
    import torch

    from bridgecache.models.zoo import load_model

    model, _ = load_model(name)
    with torch.no_grad():
        model(torch.tensor([ids[:64]]))
        start = time.perf_counter()
        model(torch.tensor([ids]))
        seconds = time.perf_counter() - start
    del model
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="source tokens per text")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill", action="store_true", help="also time the target's prefill")
    args = parser.parse_args()

    from bridgecache.models.zoo import load_tokenizer

    if args.prefill:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
    tokenizers = {name: load_tokenizer(name) for pair in PAIRS for name in pair}
    header = "| source -> target | chars | source tokens | target tokens | align ms | target tokens/s "
    header += "| tokenizing ms | align_ids ms |" + (
        " target prefill s | prefill / align |" if args.prefill else ""
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for source_name, target_name in PAIRS:
        source, target = tokenizers[source_name], tokenizers[target_name]
        text = documentation_text(source, args.tokens)
        _, source_ids, target_ids = align(text, source, target)
        align_s = median_seconds(partial(align, text, source, target), args.repeats)
        tokenize_s = median_seconds(partial(tokenize_both, text, source, target), args.repeats)
        ids_s = median_seconds(partial(align_ids, source_ids, source, target_ids, target), args.repeats)
        row = (
            f"| {source_name} -> {target_name} | {len(text)} | {len(source_ids)} | {len(target_ids)} "
            f"| {align_s * 1e3:.1f} | {len(target_ids) / align_s:,.0f} | {tokenize_s * 1e3:.1f} "
            f"| {ids_s * 1e3:.1f} |"
        )
        if args.prefill:
            prefill_s = prefill_seconds(target_name, target_ids)
            row += f" {prefill_s:.1f} | {prefill_s / align_s:,.0f}x |"
        print(row, flush=True)
    machine = platform.processor() or platform.machine()
    print(f"\n{machine}, {os.cpu_count()} CPUs, python {platform.python_version()}")


if __name__ == "__main__":
    main()
