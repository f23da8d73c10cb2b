"""CPU handoff time: the target's native prefill vs a BridgedCache handoff, side by side.

    python benchmarks/handoff_cpu.py [--source qwen2.5-coder-1.5b] [--target qwen2.5-coder-0.5b]
        [--method cachebridge] [--lengths 512 2048] [--repeats 3]

Per context length (evaluation-split prose, in the target's tokens), interleaved runs, median:
- native: target.generate(context, max_new_tokens=1): prefill + first token;
- handoff: BridgedCache(..., source_model=source) + generate(max_new_tokens=1) with the default
  `HandoffConfig`: the source's last 16 context tokens read the context (there is no prompt) to
  choose 20% of it, every layer is translated, and one target forward computes the native head,
  the chosen tokens and the held-back last token, up to the first token;
- translation only: the same with `HandoffConfig(refresh=None)`;
- translate: BridgedCache(..., config=HandoffConfig(refresh=None)).materialize() alone
  (translation and the native head);
- source prefill of the same context (what a handoff does NOT repeat; reported apart).
The bridge comes from the cache (`bridgecache.fitting.cached.bridge_for`), fitted on first use.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bridgecache import BridgedCache, HandoffConfig, align_context, capture_kv, load_model
from bridgecache.fitting import FitConfig
from bridgecache.fitting.cached import bridge_for
from bridgecache.runtime.engine import HandoffEngine, generate
from bridgecache.text import text_chunks


def context_of_length(tokenizer, n_tokens: int) -> str:
    """Evaluation prose cut to about n_tokens of this tokenizer."""
    text = " ".join(text_chunks("prose", "eval", 8, 4000, seed=1))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


@torch.no_grad()
def seconds(source, target, bridge, text: str, source_tok, target_tok, repeats: int) -> dict:
    """Median seconds of each row of the module docstring for one context text."""
    alignment, source_ids, target_ids = align_context(bridge, text, source_tok, target_tok)
    start = time.perf_counter()
    source_kv = capture_kv(source, source_ids)
    source_s = time.perf_counter() - start
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=target_tok.eos_token_id)
    translation_only = HandoffConfig(refresh=None)

    engine = HandoffEngine(bridge, source, target)

    def cache(config=None):
        return BridgedCache(
            bridge, source_kv, target, target_ids, config=config, alignment=alignment, source_model=source,
            engine=engine,
        )  # fmt: skip

    times = {"native": [], "handoff": [], "translation only": [], "translate": []}
    for _ in range(repeats):  # interleaved: the machine's noise hits every path alike
        start = time.perf_counter()
        target.generate(target_ids, **gen)
        times["native"].append(time.perf_counter() - start)
        for name, config in (("handoff", None), ("translation only", translation_only)):
            start = time.perf_counter()
            generate(target, cache(config), target_ids, **gen)
            times[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        cache(translation_only).materialize()
        times["translate"].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    return median | {"tokens": target_ids.shape[1], "source prefill": source_s}


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
    bridge = bridge_for(args.source, args.target, FitConfig(method=args.method), source, target)

    print(f"{args.source} -> {args.target} ({args.method}), CPU, {torch.get_num_threads()} threads")
    columns = ["context tokens", "source prefill s", "native TTFT s", "handoff TTFT s"]
    columns += ["translation-only TTFT s", "translate s", "native / handoff"]
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for n in args.lengths:
        text = context_of_length(target_tok, n)
        t = seconds(source, target, bridge, text, source_tok, target_tok, args.repeats)
        cells = [str(t["tokens"]), f"{t['source prefill']:.2f}", f"{t['native']:.2f}", f"{t['handoff']:.3f}"]
        cells += [
            f"{t['translation only']:.3f}",
            f"{t['translate']:.3f}",
            f"{t['native'] / t['handoff']:.1f}x",
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
