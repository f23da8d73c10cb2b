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
says so. A row that runs out of device memory is printed as such (listed under "out_of_memory" in
families.json), its tensors freed, and the run goes on; it does not fail the run.

Where each config comes from (config.json of the published checkpoint; no hub access here, the
numbers are written out below):
- the first ten families: their checkpoints' config.json (reports/families-2026-12-06.md);
- Phi-4-mini (microsoft/Phi-4-mini-instruct; copies read 2026-12-07 in onnx-community's
  Phi-4-mini-instruct-ONNX-MHA and unsloth's mirrors): Phi3Config, 3072 wide, 32 layers, 24 query /
  8 KV heads of 128, partial_rotary_factor 0.75 (96 rotary channels), vocab 200064, 131072
  positions, longrope over an original 4096 (48 long factors: the first 46 as read in those copies,
  the last two, 44.16 and 47.77, as remembered: the excerpts read stopped at 46; short factors 1),
  sliding_window 262144 (longer than any context: full attention), tied embeddings;
- Command R7B (CohereForAI/c4ai-command-r7b-12-2024; a copy of its config.json read 2026-12-07
  in huihui-ai's derivative, and transformers' Cohere2 page): Cohere2Config, 4096 wide, 32
  layers, 32 / 8 heads of 128, 14336 MLP, vocab 256000, window 4096 on three layers of four
  (the fourth global, without RoPE), rope_theta 50000, logit_scale 0.25, tied embeddings, and
  max_position_embeddings 8192 as that file has it (the model card says 128K): its longer row
  stops at 8175 tokens, as Gemma 2's;
- GPT-OSS-20B (openai/gpt-oss-20b; its config.json's fields as third-party copies give them):
  GptOssConfig, 2880 wide, 24 layers alternating a 128-token window (even layers) and full
  attention, 64 / 8 heads of 64 with learned sinks, 32 experts (4 per token) of 2880, vocab
  201088, yarn (factor 32 over 4096, beta 32 / 1, theta 150000), 131072 positions, bias in
  attention; the experts in bf16 (the checkpoint ships them in MXFP4): every layer, 21B
  parameters. transformers runs it with eager attention only (no sdpa), whose weights at 16K
  tokens are 64 x 16K x 16K bf16 = 32 GiB per copy: its 16K rows run out of memory on an 80 GB
  card, and are reported so;
- Llama-4-Scout's text layers (meta-llama/Llama-4-Scout-17B-16E-Instruct's text_config, its
  fields as third-party reimplementations give them): Llama4TextConfig, 5120 wide, 40 / 8 heads of
  128, qk-norm, chunked attention in chunks of 8192 with NoPE on every fourth layer (temperature
  tuning: floor_scale 8192, attn_scale 0.1), 16 routed experts of 8192 (one per token) and a
  shared MLP of 16384 on every layer, vocab 202048, llama3 rope (theta 5e5, factor 16 over 8192,
  low / high frequency factors 1): 2.2B parameters per layer, 109B in all, so only 8 of its 48
  layers (a sixth, the pattern kept: NoPE on layers 3 and 7) are built, 19B parameters;
- Pythia-6.9B (EleutherAI/pythia-6.9b; from its config.json as remembered, not re-read here):
  GPTNeoXConfig, 4096 wide, 32 layers, 32 heads of 128 (no GQA), 16384 MLP, rotary on 0.25 of each
  head, parallel residual, vocab 50432, 2048 positions: one row, at 2031 tokens;
- StableLM-2-1.6B (stabilityai/stablelm-2-1_6b; likewise): StableLmConfig, 2048 wide, 24 layers,
  32 heads of 64 (no GQA), 5632 MLP, rotary on 0.25, qkv bias, vocab 100352, 4096 positions: one
  row, at 4079 tokens.
Random weights; GPT-OSS's sinks drawn N(0, 2) (at their init, ~0.02, a sink hardly moves the
softmax; trained ones are logits of a few units), as in tests/tiny_models.py.
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
    Cohere2Config,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen3Config,
    SmolLM3Config,
    StableLmConfig,
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
PHI4_LONG_FACTOR = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
    2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
    5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
    11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
    25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
    32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]  # fmt: skip
PHI4_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "long_factor": PHI4_LONG_FACTOR, "short_factor": [1.0] * 48,
             "original_max_position_embeddings": 4096}  # fmt: skip
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip
SCOUT_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
              "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}  # fmt: skip
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
    # issue 62's families (the module docstring says where each config comes from)
    "Phi-4-mini (partial rotary 0.75)": (Phi3Config, dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
        original_max_position_embeddings=4096, sliding_window=262144, rope_parameters=PHI4_ROPE,
        tie_word_embeddings=True)),
    "Command R7B (window 4096, interleaved)": (Cohere2Config, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=256000, max_position_embeddings=8192,
        sliding_window=4096, logit_scale=0.25, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    "GPT-OSS-20B (sinks, window 128)": (GptOssConfig, dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        vocab_size=201088, max_position_embeddings=131072, sliding_window=128,
        attention_bias=True, rope_parameters=GPT_OSS_YARN)),
    "Llama-4-Scout text (8 of 48 layers, chunks 8192)": (Llama4TextConfig, dict(
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=8,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16,
        num_experts_per_tok=1, interleave_moe_layer_step=1, use_qk_norm=True, vocab_size=202048,
        max_position_embeddings=10485760, attention_chunk_size=8192, no_rope_layer_interval=4,
        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, rope_parameters=SCOUT_ROPE)),
    "Pythia-6.9B (GPT-NeoX, partial rotary 0.25)": (GPTNeoXConfig, dict(
        hidden_size=4096, intermediate_size=16384, num_hidden_layers=32, num_attention_heads=32,
        vocab_size=50432, max_position_embeddings=2048, use_parallel_residual=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    "StableLM-2-1.6B (partial rotary 0.25)": (StableLmConfig, dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096, use_qkv_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
}  # fmt: skip
NEW_FAMILIES = list(FAMILIES)[10:]  # issue 62's: `--families new`
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
        if "sliding_window" in shape and shape["sliding_window"] < shape["max_position_embeddings"]:
            shape["sliding_window"] = 24
        if "attention_chunk_size" in shape:  # a few chunks, each row's NoPE temperature biting
            shape |= dict(attention_chunk_size=24, floor_scale=16, intermediate_size_mlp=64)
        if "query_pre_attn_scalar" in shape:
            shape["query_pre_attn_scalar"] = 16
        rope = shape.get("rope_parameters", {})
        if "long_factor" in rope:  # longrope: a factor per rotary pair, the switch within the contexts
            pairs = int(16 * rope["partial_rotary_factor"]) // 2
            rope = rope | dict(long_factor=rope["long_factor"][::8][:pairs], short_factor=[1.0] * pairs)
            shape |= dict(rope_parameters=rope | dict(original_max_position_embeddings=64))
            shape |= dict(original_max_position_embeddings=64)
        shape |= dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the tiny vocabulary
    if cls is not Phi3Config and cls is not Starcoder2Config:
        shape.setdefault("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    shape.setdefault("tie_word_embeddings", False)
    return cls(**shape)


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
        "--families", nargs="+", default=list(FAMILIES), choices=[*FAMILIES, "new"], metavar="NAME",
        help="family names, or 'new' for issue 62's (Phi-4-mini to StableLM)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", help="write families.json here")
    args = parser.parse_args()
    args.families = [f for name in args.families for f in (NEW_FAMILIES if name == "new" else [name])]
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
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        with torch.no_grad():  # GPT-OSS: sinks of a few units, as trained ones (the docstring)
            for module in model.modules():
                if isinstance(getattr(module, "sinks", None), torch.Tensor):
                    module.sinks.normal_(0.0, 2.0)
        return model

    source = build(config_of("1.5b", args.smoke), 0)
    # smoke: 56 + the question crosses longrope's switch (original_max 64 in the smoke configs), as
    # 4096 + 16 does Phi-4-mini's; 100 lies past it
    wanted = [40, 56, 100] if args.smoke else args.lengths
    results = {
        "device": name,
        "date": stamp,
        "commit": _commit(),
        "source": "Qwen2.5-1.5B shapes",
        "rows": [],
        "failed": [],
        "out_of_memory": [],
        "errors": [],
    }
    print("\n| target (published config) | attention | context tokens | native ms | default ms | "
          "default / native | full refresh vs native (rel. L2) | device GiB peak |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for family in args.families:
        try:
            target_rows(family, args, build, source, wanted, device, results)
        except Exception as error:  # noqa: BLE001  (a family that cannot run: said, and the rest go on)
            results["errors"].append({"family": family, "error": f"{type(error).__name__}: {error}"})
            print(f"| {family} | | | error: {type(error).__name__}: {error} | | | | |", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    checks = [summary([]) | r["checks"]["default"] for r in results["rows"]]
    worst = max((c["max_distance"] or 0.0 for c in checks), default=0.0)
    print(f"\nchecks: repeated handoffs within {worst:.3f} (relative L2) of runs refreshing the same tokens")
    for oom in results["out_of_memory"]:
        print(f"out of memory: {oom['family']} at {oom['tokens']} tokens ({oom['error'][:160]})")
    _write(args.out, results)
    if results["failed"] or results["errors"]:
        sys.exit(f"{len(results['failed'])} row(s) failed their checks, {len(results['errors'])} "
                 f"family(ies) could not run: {results['failed'] + results['errors']}")  # fmt: skip


def target_rows(family: str, args, build, source, wanted: list[int], device, results: dict) -> None:
    """One family's rows, appended to `results` (and printed) one length at a time."""
    config = family_config(family, args.smoke)
    target = build(config, 1)
    bridge = random_fullhead_bridge(source.config, target.config)
    with HandoffEngine(bridge, source, target) as engine:
        for n in lengths_for(config, wanted):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                row = family_rows(source, target, engine, bridge, n, device, args.repeats, f"{family} at {n}")
            except AssertionError as failed:  # a check failed: no time for this row, the rest go on
                results["failed"].append({"family": family, "tokens": n, "error": str(failed)})
                print(f"| {family} | | {n} | check failed: {failed} | | | | |", flush=True)
                continue
            except torch.OutOfMemoryError as oom:  # too large for this card: said, freed, the rest go on
                results["out_of_memory"].append({"family": family, "tokens": n, "error": str(oom)})
                print(f"| {family} | | {n} | out of device memory | | | | |", flush=True)
                del oom
                gc.collect()
                torch.cuda.empty_cache()
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


def _write(out: str | None, results: dict) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "families.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
