"""Concurrent handoffs on one engine, real models: identical to the same requests run in turn.

    cd /tmp && python /path/to/benchmarks/engine_threads.py --handoffs 10     # CPU, minutes

SmolLM2-135M -> Qwen2.5-Coder-0.5B with the shipped bridge (across tokenizers), one
`HandoffEngine`, the default `HandoffConfig`. Contexts: held-out prose of different lengths, one
question. The requests run one after another, then again from two threads at once while a third
thread runs a plain `target.generate()` over its own prompt; every output must equal its
sequential twin, and the plain generate() its solo run. Prints the counts and the wall times.
"""

from __future__ import annotations

import argparse
import datetime
import threading
import time

import torch

from bridgecache import Bridge, HandoffEngine, load_model
from bridgecache.text import documents


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--handoffs", type=int, default=10, help="requests per thread")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    source, source_tok = load_model("smollm2-135m")
    target, target_tok = load_model("qwen2.5-coder-0.5b")
    bridge = Bridge.from_pretrained("builtin:smollm2-135m->qwen2.5-coder-0.5b")
    texts = [text for _, text in documents("prose", "eval")]
    question = "\nIn one sentence, what is this about?"
    jobs = [(texts[i % len(texts)][: 300 + 97 * i], question) for i in range(args.handoffs * args.threads)]
    engine = HandoffEngine(bridge, source, target, source_tokenizer=source_tok, target_tokenizer=target_tok)
    gen = dict(max_new_tokens=8, do_sample=False)
    plain_ids = target_tok("def fibonacci(n):", return_tensors="pt").input_ids

    def plain():
        return target.generate(plain_ids, max_new_tokens=16, do_sample=False, pad_token_id=0)

    start = time.perf_counter()
    sequential = [engine.handoff(c, p, **gen).output_ids for c, p in jobs]
    alone = plain()
    sequential_s = time.perf_counter() - start
    results, plains = {}, []

    def worker(k: int) -> None:
        for i in range(k, len(jobs), args.threads):
            results[i] = engine.handoff(*jobs[i], **gen).output_ids

    def generator() -> None:
        while len(results) < len(jobs):
            plains.append(plain())

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.threads)]
    threads.append(threading.Thread(target=generator))
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    concurrent_s = time.perf_counter() - start
    same = sum(torch.equal(results[i], sequential[i]) for i in range(len(jobs)))
    plain_same = sum(torch.equal(p, alone) for p in plains)
    print(f"{datetime.date.today()}, CPU, torch {torch.__version__}, {torch.get_num_threads()} torch threads")
    print(f"{len(jobs)} handoffs, {args.threads} threads: {same}/{len(jobs)} identical to the sequential run")
    print(f"plain generate() in a third thread: {plain_same}/{len(plains)} identical to its solo run")
    print(f"wall: sequential {sequential_s:.1f} s, concurrent {concurrent_s:.1f} s")
    if same != len(jobs) or plain_same != len(plains):
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    main()
