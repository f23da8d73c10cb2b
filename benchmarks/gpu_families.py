"""The handoff beside the target's own prefill, one model of each supported family at its
published config.

    python benchmarks/gpu_families.py --out DIR     # CUDA, bf16: 4K and 16K tokens
    python benchmarks/gpu_families.py --smoke       # tiny widths on the CPU, to check the script

Random weights at each model's published config.json shapes (docs/architectures.md lists what
is supported; this times it at the sizes users run). The source is Qwen2.5-1.5B's shape for every
target, the bridge a random Full-Head-shaped one (benchmarks/gpu_handoff.py's: the handoff's work
does not depend on the maps' values), the context random ids both vocabularies hold (one
position per token on both sides), a 16-token question. Per target and context length (capped at
the model's window less the question: Phi-3-mini-4k, OLMo-2 and Gemma 2 stop below 16K):
- native: `target.generate(context + question, max_new_tokens=1)`, the target's own prefill;
- default: `BridgedCache(..., config=HandoffConfig(route="handoff"))` through the engine's
  generate(): the default refresh (20%, chosen by the source's reading of the question), the
  handoff forced so the row times it (`gpu_handoff.py` times the cost gate);
- checked before any time is reported: every timed run's first-token logits against an earlier
  run that refreshed the same tokens (`gpu_handoff.check`), and a full refresh (every context
  token recomputed by the target through the same pass) against native: relative L2 within
  `gpu_handoff.TOLERANCE`, the distance printed.
Median of --repeats runs after a warm-up (which also captures the engine's CUDA graphs).
Prints device, date, versions, a table; --out writes families.json there after every row. A row
whose check fails is printed as failed without its times; the others go on, and the exit status
says so.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen3Config,
    SmolLM3Config,
    Starcoder2Config,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_handoff import (  # noqa: E402
    FIRST_ID,
    FIRST_TOKEN,
    HANDOFF,
    QUESTION,
    TOLERANCE,
    FirstToken,
    _commit,
    config_of,
    distance,
    random_fullhead_bridge,
    summary,
    sync,
    timed,
)

from bridgecache import BridgedCache, HandoffEngine, RefreshConfig, capture_kv  # noqa: E402
from bridgecache.runtime.engine import generate  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
FAMILIES = {  # name: (config class, the published config.json's shape fields)
    "Llama-3.1-8B": (LlamaConfig, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
        rope_parameters=LLAMA3_ROPE)),
    "Mistral-7B-v0.1 (window 4096)": (MistralConfig, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "Qwen3-8B": (Qwen3Config, dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "Gemma-2-9B": (Gemma2Config, dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256)),
    "Gemma-3-4B (text)": (Gemma3TextConfig, dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=262208, max_position_embeddings=131072,
        sliding_window=1024, query_pre_attn_scalar=256)),
    "Phi-3-mini-4k (window 2047)": (Phi3Config, dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096, sliding_window=2047)),
    "OLMo-2-7B": (Olmo2Config, dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "Granite-3.1-8B": (GraniteConfig, dict(
        hidden_size=4096, intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=49155, max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
        # its published multipliers: at the config class's defaults (all 1.0, attention scaled by
        # 1 instead of 1/128) random bf16 weights are chaotic (two native attention backends differ
        # by 0.35 relative L2 at 8 layers on the CPU; a full refresh lay 1.06 from native here)
        attention_multiplier=0.0078125, embedding_multiplier=12.0, residual_multiplier=0.22,
        logits_scaling=16.0)),
    "SmolLM3-3B (no-RoPE layers)": (SmolLM3Config, dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=128256, max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0})),
    "StarCoder2-7B (window 4096)": (Starcoder2Config, dict(
        hidden_size=4608, intermediate_size=18432, num_hidden_layers=32, num_attention_heads=36,
        num_key_value_heads=4, vocab_size=49152, max_position_embeddings=16384, sliding_window=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}  # fmt: skip
FULL_REFRESH = HANDOFF.replace(refresh=RefreshConfig(1.0, "deviation"))


def family_config(name: str, smoke: bool):
    """The family's config at its published shapes (smoke: the same head layout at tiny widths,
    the windows shrunk with the contexts)."""
    cls, shape = FAMILIES[name]
    shape = dict(shape)
    if smoke:
        heads = shape["num_attention_heads"]
        shape |= dict(hidden_size=heads * 16, intermediate_size=64, vocab_size=512)
        shape |= dict(num_hidden_layers=min(shape["num_hidden_layers"], 6), head_dim=16)
        if "sliding_window" in shape:
            shape["sliding_window"] = 24
        if "query_pre_attn_scalar" in shape:
            shape["query_pre_attn_scalar"] = 16
        shape |= dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the tiny vocabulary
    if cls is not Phi3Config and cls is not Starcoder2Config:
        shape.setdefault("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    return cls(**shape, tie_word_embeddings=False)


def lengths_for(config, wanted: list[int]) -> list[int]:
    """The wanted context lengths the model's window takes with the question (capped, deduplicated)."""
    limit = config.max_position_embeddings - QUESTION - 1
    return sorted({min(n, limit) for n in wanted})


@torch.no_grad()
def family_rows(source, target, engine, bridge, n: int, device, repeats: int, what: str) -> dict:
    """Seconds of the native and default rows at n context tokens, their checks, and the full
    refresh's distance from native."""
    vocab = min(source.config.vocab_size, target.config.vocab_size)
    generator = torch.Generator().manual_seed(n)
    context = torch.randint(FIRST_ID, vocab, (1, n), generator=generator).to(device)
    question = torch.randint(FIRST_ID, vocab, (1, QUESTION), generator=generator).to(device)
    full = torch.cat([context, question], dim=1)
    kv = capture_kv(source, context)

    def bridged(config):
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            config=config,
            source_model=source,
            prompt_ids=question,
            engine=engine,
        )
        return FirstToken(generate(target, cache, full, **FIRST_TOKEN).logits[0], cache)

    native_s, native, native_checks = timed(
        lambda: FirstToken(target.generate(full, **FIRST_TOKEN).logits[0]), device, repeats, f"{what}, native"
    )
    handoff_s, _, handoff_checks = timed(lambda: bridged(HANDOFF), device, repeats, f"{what}, default")
    full_refresh = bridged(FULL_REFRESH).settled()
    d = distance(full_refresh, native)
    if not torch.isfinite(full_refresh.logits).all() or d > TOLERANCE:
        raise AssertionError(
            f"{what}: a full refresh lies {d:.3f} (relative L2) from native (tolerance {TOLERANCE})"
        )
    sync(device)
    return {
        "native_s": native_s,
        "default_s": handoff_s,
        "full_refresh_distance": d,
        "checks": {"native": native_checks, "default": handoff_checks},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES), metavar="NAME"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", help="write families.json here")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"device {name}, {stamp}, commit {_commit()}, {versions}, {dtype}, median of {args.repeats}")

    def build(config, seed: int):
        torch.manual_seed(seed)
        with torch.device(device):
            # transformers' default attention: sdpa where the family supports it (Gemma 2: eager)
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()

    source = build(config_of("1.5b", args.smoke), 0)
    wanted = [40, 100] if args.smoke else args.lengths
    results = {
        "device": name,
        "date": stamp,
        "commit": _commit(),
        "source": "Qwen2.5-1.5B shapes",
        "rows": [],
        "failed": [],
    }
    print("\n| target (published config) | attention | context tokens | native ms | default ms | "
          "default / native | full refresh vs native (rel. L2) | device GiB peak |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for family in args.families:
        config = family_config(family, args.smoke)
        target = build(config, 1)
        bridge = random_fullhead_bridge(source.config, target.config)
        with HandoffEngine(bridge, source, target) as engine:
            for n in lengths_for(config, wanted):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    row = family_rows(
                        source, target, engine, bridge, n, device, args.repeats, f"{family} at {n}"
                    )
                except AssertionError as failed:  # a check failed: no time for this row, the rest go on
                    results["failed"].append({"family": family, "tokens": n, "error": str(failed)})
                    print(f"| {family} | | {n} | check failed: {failed} | | | | |", flush=True)
                    continue
                peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
                attention = target.config._attn_implementation
                row |= {"family": family, "config_class": type(config).__name__, "attention": attention}
                row |= {"tokens": n, "peak_gib": peak}
                results["rows"].append(row)
                print(f"| {family} | {attention} | {n} | {row['native_s'] * 1e3:.1f} | "
                      f"{row['default_s'] * 1e3:.1f} | {row['default_s'] / row['native_s']:.2f} | "
                      f"{row['full_refresh_distance']:.3f} | {peak:.1f} |", flush=True)  # fmt: skip
                _write(args.out, results)  # after every row: a run cut short keeps what it measured
        del target, engine, bridge
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    checks = [summary([]) | r["checks"]["default"] for r in results["rows"]]
    worst = max((c["max_distance"] or 0.0 for c in checks), default=0.0)
    print(f"\nchecks: repeated handoffs within {worst:.3f} (relative L2) of runs refreshing the same tokens")
    _write(args.out, results)
    if results["failed"]:
        sys.exit(f"{len(results['failed'])} row(s) failed their checks: {results['failed']}")


def _write(out: str | None, results: dict) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "families.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
