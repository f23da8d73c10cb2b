"""Peak memory of handoffs against the target's own prefill, on the CPU, in units of the target's KV.

    python benchmarks/handoff_memory.py [--batch 8 --tokens 2048 --requests 3 --new-tokens 16]

Random-weight Qwen2-shaped models whose KV outweighs their weights, as it does for a batch of 32 x
4K contexts on a 7B target (16 layers, 8 KV heads of 64 dims, hidden size 256, float32): source and
target share the config, the bridge is Full-Head-shaped and random
(benchmarks/gpu_handoff.py), every request a batch of `--batch` contexts of `--tokens` random
tokens and a 16-token question, `--new-tokens` new tokens each.

Each measurement runs in a process of its own, since a process's peak resident set (ru_maxrss)
only grows: the process builds the models and the source's KV of the contexts, notes its resident
set, then runs either the target's own `generate()` over context + question ("native") or
`--requests` default handoffs one after another through one `HandoffEngine` (`engine.generate`
over a `BridgedCache`; each result dropped before the next request, as a server drops a finished
request), and prints its peak above that set-up. `--one-launch` translates in groups of layers
(`HandoffConfig(one_launch=True)`, the CUDA default) instead of the CPU's layer by layer. Python's
cyclic collector is left as it is: a handoff cache that only the collector frees stays resident
until it runs.

On the CPU the grouped translation runs the kernels' PyTorch reference over every layer of a
group at once, whose float32 intermediates (gathered inputs, outputs) add about the target's KV
again; CUDA's Triton kernel has none.

Each request's new tokens are checked against the first request's (same inputs: the same
tokens). The numbers are this machine's allocator's; the GPU's caching allocator holds freed
blocks for reuse, so the GPU table (benchmarks/gpu_handoff.py, "peak GiB per row") is the one to
quote for CUDA.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

QUESTION = 16


def build(seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
        attn_implementation="sdpa",
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def resident_gib() -> float:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def current_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


@torch.no_grad()
def measure(kind: str, args) -> dict:
    """Run one side in this process; its peak above the set-up and the new tokens."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from gpu_handoff import random_fullhead_bridge

    from bridgecache import BridgedCache, HandoffConfig, capture_kv
    from bridgecache.runtime.engine import HandoffEngine
    from bridgecache.runtime.interop.graphs import kv_bytes

    torch.set_num_threads(args.threads)
    source, target = build(0), build(1)
    bridge = random_fullhead_bridge(source.config, target.config)
    g = torch.Generator().manual_seed(7)
    context = torch.randint(3, 1024, (args.batch, args.tokens), generator=g)
    question = torch.randint(3, 1024, (args.batch, QUESTION), generator=g)
    full = torch.cat([context, question], dim=1)
    kv = capture_kv(source, context)
    engine = HandoffEngine(bridge, source, target)
    gen = dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
    )
    kv_gib = kv_bytes(target, args.batch, args.tokens) / 2**30
    before = current_gib()
    outputs = []
    if kind == "native":
        outputs.append(target.generate(full, **gen)[:, full.shape[1] :].tolist())
    else:
        for _ in range(args.requests):
            cache = BridgedCache(
                bridge, kv, target, context, config=HandoffConfig(one_launch=args.one_launch or None),
                source_model=source,
                prompt_ids=question, engine=engine,
            )  # fmt: skip
            out = engine.generate(cache, full, torch.ones_like(full), **gen)
            outputs.append(out[:, full.shape[1] :].tolist())
            del cache, out  # the request is finished: its cache is the caller's no longer
    assert all(o == outputs[0] for o in outputs), f"{kind}: requests on the same inputs answered differently"
    peak = resident_gib()
    return {
        "kind": kind,
        "kv_gib": kv_gib,
        "setup_gib": before,
        "peak_gib": peak,
        "above_setup": peak - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--one-launch", action="store_true", help="translate in groups of layers, as CUDA does by default"
    )
    parser.add_argument("--one", choices=["native", "handoff"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args)))
        return
    rows = {}
    for kind in ("native", "handoff"):
        command = [sys.executable, __file__, "--one", kind] + sys.argv[1:]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
        rows[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    kv = rows["native"]["kv_gib"]
    how = "in groups of layers" if args.one_launch else "layer by layer (the CPU's default)"
    print(f"batch {args.batch} x {args.tokens} tokens, {args.new_tokens} new tokens, translated {how}; "
          f"target KV {kv:.2f} GiB")  # fmt: skip
    print("| run | peak above set-up, GiB | x target KV |\n|---|---:|---:|")
    names = {"native": "native generate()", "handoff": f"{args.requests} default handoffs in a row"}
    for kind, row in rows.items():
        print(f"| {names[kind]} | {row['above_setup']:.2f} | {row['above_setup'] / kv:.2f} |")


if __name__ == "__main__":
    main()
