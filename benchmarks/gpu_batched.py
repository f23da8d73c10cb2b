"""Handoffs per second on one GPU, contexts in batches: Qwen2.5-1.5B -> Qwen2.5-0.5B shapes.

    python benchmarks/gpu_batched.py                # on a CUDA machine (bf16, sdpa)
    python benchmarks/gpu_batched.py --smoke        # tiny shapes on CPU, to check the script

Random-weight models at the real configs (no download), a head-local bridge with random
coefficients (timing only), contexts of random token ids with lengths drawn from
[--min-tokens, --max-tokens], sorted by length and cut into batches. One handoff = the source
reads the context (its prefill is counted), a BridgedCache with the default `HandoffConfig`
translates it (the source's last 16 context tokens choose the 20% of it that the target recomputes
in its first forward; there is no prompt), the target generates --new-tokens tokens (exactly:
min_new_tokens). Rows per batch size, measured side by side:
- handoff: capture_kv over the left-padded batch + BridgedCache + generate(), per batch;
- native: the target reads the contexts itself and generates the same tokens (no source);
Throughput = requests / wall time of the whole pass, after a warm-up pass over the same batches
(kernel compilation and autotuning per length bucket are one-time costs); CUDA-synchronised.
"""

from __future__ import annotations

import argparse
import time

import torch
from gpu_ttft import random_headlocal_bridge
from transformers import AutoModelForCausalLM, Qwen2Config

from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.engine import HandoffEngine, generate
from bridgecache.runtime.entry.batch import left_pad

SHAPES = {  # Qwen2.5-1.5B -> Qwen2.5-0.5B
    "source": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "target": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
}


def config_of(role: str, smoke: bool) -> Qwen2Config:
    shape = dict(SHAPES[role], num_key_value_heads=2, vocab_size=151936)
    if smoke:
        shape |= dict(hidden_size=shape["num_attention_heads"] * 16, intermediate_size=64)
        shape |= dict(num_hidden_layers=2, vocab_size=512)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    return Qwen2Config(**shape, max_position_embeddings=32768, rope_parameters=rope, tie_word_embeddings=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def handoff_pass(source, target, bridge, batches, new_tokens: int) -> None:
    device = target.device
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    engine = HandoffEngine(bridge, source, target)  # plans and graphs reused across the batches
    for rows in batches:
        ids, mask = left_pad(rows, pad_id=0)
        ids, mask = ids.to(device), mask.to(device)
        kv = capture_kv(source, ids, attention_mask=mask)
        cache = BridgedCache(
            bridge,
            kv,
            target,
            ids,
            target_attention_mask=mask,
            source_attention_mask=mask,
            source_model=source,
            engine=engine,
        )
        generate(target, cache, ids, mask, **gen)


@torch.no_grad()
def native_pass(target, batches, new_tokens: int) -> None:
    device = target.device
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    for rows in batches:
        ids, mask = left_pad(rows, pad_id=0)
        target.generate(ids.to(device), attention_mask=mask.to(device), **gen)


def timed_pass(fn, batches, device) -> float:
    fn(batches)  # warm-up pass: compilation and autotuning of every length bucket, allocator
    sync(device)
    start = time.perf_counter()
    fn(batches)
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    parser.add_argument("--requests", type=int, default=128, help="per batch size (at least 2 batches)")
    parser.add_argument("--min-tokens", type=int, default=900)
    parser.add_argument("--max-tokens", type=int, default=1100)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.smoke:
        args.batch_sizes, args.requests, args.min_tokens, args.max_tokens = [1, 4], 8, 20, 40
    torch.manual_seed(0)
    configs = {role: config_of(role, args.smoke) for role in SHAPES}
    with torch.device(device):
        models = {
            role: AutoModelForCausalLM.from_config(c, dtype=dtype, attn_implementation="sdpa").eval()
            for role, c in configs.items()
        }
    bridge = random_headlocal_bridge(configs["source"], configs["target"])
    vocab = configs["target"].vocab_size
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {dtype}; contexts of {args.min_tokens}-"
          f"{args.max_tokens} tokens, {args.new_tokens} new tokens each")  # fmt: skip
    print(
        "| batch size | requests | handoff s | handoffs/s | native s | native requests/s | handoff / native |"
    )
    print("|---|---|---|---|---|---|---|")
    for size in args.batch_sizes:
        n = max(args.requests, 2 * size)
        lengths = torch.randint(args.min_tokens, args.max_tokens + 1, (n,)).sort().values.tolist()
        rows = [torch.randint(1, vocab, (1, length)) for length in lengths]
        batches = [rows[i : i + size] for i in range(0, n, size)]
        handoff_s = timed_pass(
            lambda b: handoff_pass(models["source"], models["target"], bridge, b, args.new_tokens),
            batches,
            device,
        )
        native_s = timed_pass(lambda b: native_pass(models["target"], b, args.new_tokens), batches, device)
        rates = f"{n / handoff_s:.1f} | {native_s:.2f} | {n / native_s:.1f} | {native_s / handoff_s:.2f}x"
        print(f"| {size} | {n} | {handoff_s:.2f} | {rates} |", flush=True)


if __name__ == "__main__":
    main()
