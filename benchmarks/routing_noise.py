"""How far a routed mixture of experts carries the rounding of a differently shaped pass: the same
handoff's first-token logits through the native-work pass at its exact slot count and at the
shape bucket a captured graph uses, on a GPT-OSS-like target (sinks, 128-token window).

    python benchmarks/routing_noise.py                 # the CPU, ~10 minutes
    python benchmarks/routing_noise.py --layers 4 --tokens 200   # a quick look

gpu_families.py's GPT-OSS-20B row at 4K tokens (bf16, one H100, 2026-12-07) found a replayed pass
0.369 (relative L2) from its eager warm-up, with the same refreshed tokens, where other families
stay within 0.035. A captured pass runs at bucketed shapes (`interop.graphs.bucket`): more slots,
placeholders included, so other matrix shapes and other rounding. This script asks, without a
GPU, what such a change of shape does on its own: per row, the target's first-token logits from
the eager pass at the exact slot count, then at the bucketed one (everything else equal), and
the exact one against the target's own prefill. Rows: float32 with routing (placeholders and
buckets are exact if this is ~1e-6), bf16 with routing (top-k of many experts), bf16 with every
expert taken (the same weights' kind without a discrete choice). Random weights, sinks drawn as
gpu_families.py draws them (N(0, 2)), an identity bridge marked as fitted, the tokens refreshed
given (GivenScores), 16 question tokens.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GptOssConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bridgecache import BridgedCache, GivenScores, HandoffConfig, HandoffEngine, RefreshConfig, capture_kv  # noqa: E402
from bridgecache.bridge.maps import Bridge  # noqa: E402
from bridgecache.runtime.engine import generate  # noqa: E402
from bridgecache.runtime.interop.graphs import bucket  # noqa: E402
from bridgecache.runtime.native_work import forward  # noqa: E402

QUESTION = 16


def target(layers: int, experts: int, top: int, dtype: torch.dtype):
    config = GptOssConfig(
        hidden_size=256, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, num_local_experts=experts, num_experts_per_tok=top,
        vocab_size=1024, sliding_window=128, max_position_embeddings=4096, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0.0, 2.0)
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def row(model, tokens: int, refresh: float) -> dict:
    """The exact pass against the target's own prefill, and the bucketed pass against the exact."""
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"  # refreshed like a fitted bridge
    engine = HandoffEngine(bridge, model, model)
    generator = torch.Generator().manual_seed(tokens)
    context = torch.randint(3, 1000, (1, tokens), generator=generator)
    full = torch.cat([context, torch.randint(3, 1000, (1, QUESTION), generator=generator)], 1)
    scores = torch.rand(1, tokens, generator=generator)
    config = HandoffConfig(refresh=RefreshConfig(refresh, GivenScores(scores)), route="handoff")
    kv = capture_kv(model, context)
    native = model(full).logits[0, -1]

    def first_token() -> torch.Tensor:
        cache = BridgedCache(bridge, kv, model, context, config=config, engine=engine)
        out = generate(
            model, cache, full, max_new_tokens=1, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        return out.logits[0][0]

    exact = first_token()
    exact_slots = forward._slots
    forward._slots = lambda work, m: bucket(work.count + m)  # the captured pass's slot count
    try:
        bucketed = first_token()
    finally:
        forward._slots = exact_slots
    engine.close()
    return {"vs_native": relative(exact, native), "bucketed_vs_exact": relative(bucketed, exact)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24, help="GPT-OSS-20B has 24")
    parser.add_argument("--tokens", type=int, default=700)
    parser.add_argument("--refresh", type=float, nargs="+", default=[1.0, 0.2])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"CPU, {stamp}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.layers} layers, {args.tokens} context tokens\n")  # fmt: skip
    print("| dtype | experts taken | refresh | exact pass vs native | bucketed pass vs exact |")
    print("|---|---|---:|---:|---:|")
    for dtype, experts, top in ((torch.float32, 16, 4), (torch.bfloat16, 16, 4), (torch.bfloat16, 4, 4)):
        model = target(args.layers, experts, top, dtype)
        for refresh in args.refresh:
            r = row(model, args.tokens, refresh)
            name = str(dtype).removeprefix("torch.")
            print(
                f"| {name} | top {top} of {experts} | {refresh:g} | {r['vs_native']:.2e} | "
                f"{r['bucketed_vs_exact']:.2e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
