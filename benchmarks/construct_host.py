"""Host time of `BridgedCache(...)` construction (row planning, rope tables, checks, the native
work's plan): the fixed cost every handoff pays before any translation, on the CPU or with CUDA.

    python benchmarks/construct_host.py                    # CPU: tiny and real head shapes
    python benchmarks/construct_host.py --profile 12       # plus cProfile's top 12 (internal time)

Shapes: "tiny" = tests/tiny_models.py's qwen2 pair (3 layers); "7b->1.5b" = Qwen2.5-7B ->
Qwen2.5-1.5B layer counts and head layouts (28 layers, 4 / 2 kv heads of 128) with tiny MLPs and
vocabulary (construction never runs the target: its native work waits for the first forward);
random weights, head-local random bridge (benchmarks/gpu_ttft.py). Two configurations:
- translation only: `HandoffConfig(refresh=None)`;
- refresh, given scores: the default 20% refresh with the choice made beforehand
  (`GivenScores`): the plan's ranking of the columns without the source reading the prompt (a
  model forward, timed by benchmarks/gpu_handoff.py).
Median of --repeats after warm-up; on CUDA the GPU is synchronised before each call and not after
(host time only). The process's CPU time is printed beside wall time: on a shared CPU, wall time
includes waiting for a core.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_ttft import random_headlocal_bridge  # noqa: E402

from bridgecache import BridgedCache, GivenScores, HandoffConfig, RefreshConfig  # noqa: E402


def config(heads: int, kv_heads: int, layers: int, head_dim: int) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, intermediate_size=64, num_hidden_layers=layers, vocab_size=512,
        max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
    )  # fmt: skip


TINY = config(heads=4, kv_heads=2, layers=3, head_dim=16)
SHAPES = {
    "tiny": (TINY, TINY),
    "7b->1.5b": (
        config(heads=28, kv_heads=4, layers=28, head_dim=128),
        config(heads=12, kv_heads=2, layers=28, head_dim=128),
    ),
}


@torch.no_grad()
def measure(shape: str, tokens: int, device: torch.device, repeats: int, profile: int) -> None:
    source_config, target_config = SHAPES[shape]
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(target_config, attn_implementation="sdpa").eval()
    bridge = random_headlocal_bridge(source_config, target_config)
    ids = torch.randint(0, 512, (1, tokens), device=device)
    shape_kv = (1, source_config.num_key_value_heads, tokens, source_config.head_dim)
    kv = [
        tuple(torch.randn(shape_kv, device=device) for _ in range(2))
        for _ in range(source_config.num_hidden_layers)
    ]
    given = RefreshConfig(by=GivenScores(torch.rand(1, tokens)))
    configs = {
        "translation only": HandoffConfig(refresh=None),
        "refresh, given scores": HandoffConfig(refresh=given),
    }

    def construct(config):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        BridgedCache(bridge, kv, target, ids, config=config)
        return time.perf_counter() - start, time.process_time() - start_cpu

    for name, config in configs.items():
        construct(config)
        times = [construct(config) for _ in range(repeats)]
        wall = statistics.median(wall for wall, _ in times)
        cpu = statistics.median(cpu for _, cpu in times)
        print(
            f"| {shape} | {tokens} | {device.type} | {name} | {wall * 1e3:.3f} | {cpu * 1e3:.3f} |",
            flush=True,
        )
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(repeats):
                BridgedCache(bridge, kv, target, ids, config=config)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-4000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 32768])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N (0: none)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, median of {args.repeats}")
    print("| shape | context tokens | device | config | construct ms (wall) | construct ms (process CPU) |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        for tokens in args.tokens:
            measure(shape, tokens, torch.device(args.device), args.repeats, args.profile)


if __name__ == "__main__":
    main()
