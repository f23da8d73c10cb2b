"""CPU handoff time: the target's native prefill vs a BridgedCache handoff, side by side.

    python benchmarks/handoff_cpu.py [--source qwen2.5-coder-1.5b] [--target qwen2.5-coder-0.5b]
        [--method cachebridge] [--lengths 512 2048] [--repeats 3]

Per context length (evaluation-split prose, in the target's tokens), interleaved runs, median:
- native: target.generate(context, max_new_tokens=1): prefill + first token;
- handoff: BridgedCache(...) + generate(max_new_tokens=1): translate every layer, the native
  head token, the held-back last token, first token;
- translate: BridgedCache(...).materialize() alone;
- source prefill of the same context (what a handoff does NOT repeat; reported apart).
The bridge comes from the cache (`bridgecache.fitting.cached.bridge_for`), fitted on first use.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bridgecache.compat import cache_kwargs
from bridgecache.fitting.cached import bridge_for
from bridgecache.kv.capture import capture_kv
from bridgecache.models.zoo import load_model
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.handoff import align_context
from bridgecache.text import text_chunks


def context_of_length(tokenizer, n_tokens: int) -> str:
    """Evaluation prose cut to about n_tokens of this tokenizer."""
    text = " ".join(text_chunks("prose", "eval", 8, 4000, seed=1))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="qwen2.5-coder-1.5b")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument("--method", default="cachebridge")
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    bridge = bridge_for(args.source, args.target, args.method, source, target)
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=target_tok.eos_token_id)

    print(f"{args.source} -> {args.target} ({args.method}), CPU, {torch.get_num_threads()} threads")
    columns = ["context tokens", "source prefill s", "native TTFT s", "handoff TTFT s", "translate s"]
    print("| " + " | ".join(columns + ["native / handoff"]) + " |")
    print("|---|---|---|---|---|---|")
    for n in args.lengths:
        text = context_of_length(target_tok, n)
        alignment, source_ids, target_ids = align_context(bridge, text, source_tok, target_tok)
        start = time.perf_counter()
        source_kv = capture_kv(source, source_ids)
        source_s = time.perf_counter() - start
        native, handoff, translate = [], [], []
        for _ in range(args.repeats):  # interleaved: the machine's noise hits both paths alike
            start = time.perf_counter()
            target.generate(target_ids, **gen)
            native.append(time.perf_counter() - start)
            start = time.perf_counter()
            cache = BridgedCache(bridge, source_kv, target, target_ids, alignment=alignment)
            target.generate(target_ids, **gen, **cache_kwargs(target, cache))
            handoff.append(time.perf_counter() - start)
            start = time.perf_counter()
            BridgedCache(bridge, source_kv, target, target_ids, alignment=alignment).materialize()
            translate.append(time.perf_counter() - start)
        med = statistics.median
        print(
            f"| {target_ids.shape[1]} | {source_s:.2f} | {med(native):.2f} | {med(handoff):.3f} | "
            f"{med(translate):.3f} | {med(native) / med(handoff):.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
