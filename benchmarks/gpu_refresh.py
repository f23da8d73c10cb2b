"""Time of a handoff with token refresh against the target's own prefill, on a GPU (issue 12).

    python benchmarks/gpu_refresh.py                  # on a CUDA machine (bf16, sdpa)
    python benchmarks/gpu_refresh.py --smoke          # tiny shapes on CPU, to check the script

The question of docs/results.md's dial, answered where the models would run: what does a handoff
that refreshes a share of the context cost in TIME next to the target's prefill, at 512 to 16K
context tokens? Random-weight models at the Qwen2.5-Coder-1.5B (source) and -0.5B (target)
configs (no download); a Full-Head-shaped random bridge (each target head reads every head of 4
source layers); a 16-token question after the context. Only time is measured; quality is in
docs/results.md. Rows, side by side in one run, each until the first new token:
- native: target.generate(context + question, max_new_tokens=1): the target's own prefill;
- plain: BridgedCache (translation, no refresh) + generate over the held-back token + question;
- refresh F by source: the source reads the question over its own cache (its prefill of the
  context is excluded, as the field reports handoffs: the source has read it anyway), the top F
  of the context by its attention is recomputed through every target layer, then generate;
- refresh F by target: the target reads the question over the translated cache to choose.
Median of --repeats after a warm-up, CUDA-synchronised wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.compat import cache_kwargs
from bridgecache.kv.capture import capture_kv
from bridgecache.models.spec import model_spec
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.guides import target_guided
from bridgecache.runtime.handoff import source_guided_scores

CONFIGS = {  # Qwen2.5-Coder-1.5B and -0.5B (config.json of the published models)
    "qwen2.5-coder-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
        num_hidden_layers=28,
    ),
    "qwen2.5-coder-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
        num_hidden_layers=24,
    ),
}  # fmt: skip
QUESTION_TOKENS = 16


def config_of(name: str, smoke: bool) -> Qwen2Config:
    shape = dict(CONFIGS[name], vocab_size=151936)
    if smoke:  # same head layout, tiny widths
        shape |= dict(hidden_size=shape["num_attention_heads"] * 16, intermediate_size=64)
        shape |= dict(num_hidden_layers=3, vocab_size=512)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    return Qwen2Config(**shape, max_position_embeddings=32768, rope_parameters=rope, tie_word_embeddings=True)


def random_fullhead_bridge(source_config, target_config, k: int = 4) -> Bridge:
    """A Full-Head-shaped bridge: each target head reads every KV head of k source layers."""
    source, target = model_spec(source_config), model_spec(target_config)
    ds, dt, hs = source.head_dim, target.head_dim, source.num_kv_heads
    layers = []
    for layer in range(target.num_layers):
        centre = round(layer * (source.num_layers - 1) / max(1, target.num_layers - 1))
        used = sorted({min(max(centre + d, 0), source.num_layers - 1) for d in range(-(k // 2), k - k // 2)})
        slots = torch.tensor([[s, h] for s in used for h in range(hs)])
        inputs = slots[None].expand(target.num_kv_heads, -1, -1).contiguous()
        n_in = inputs.shape[1] * ds
        w = lambda: torch.randn(target.num_kv_heads, n_in, dt) / n_in**0.5  # noqa: B023
        b = lambda: torch.zeros(target.num_kv_heads, dt)
        layers.append(LayerMap(used, inputs, w(), b(), w(), b()))
    return Bridge(source, target, "fullhead", "identity", layers)


def timed(fn, device, repeats: int) -> float:
    fn()  # warm-up (autotuning, allocator)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure(source, target, bridge, context, question, fractions, device, repeats) -> tuple[dict, dict]:
    """Seconds per row of the module docstring, and each variant's native FLOPs share."""
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    full = torch.cat([context, question], dim=1)
    source_kv = capture_kv(source, context)  # the source has read the context (not timed)

    def bridged(refresh=None, by=None):
        scores = None
        if by == "source":
            scores = source_guided_scores(source, source_kv, None, context, context, question)
        elif by == "target":
            scores = target_guided(question)
        cache = BridgedCache(bridge, source_kv, target, context, refresh=refresh, refresh_by=scores)
        target.generate(full, **gen, **cache_kwargs(target, cache))
        return cache

    times = {"native": timed(lambda: target.generate(full, **gen), device, repeats)}
    times["plain"] = timed(bridged, device, repeats)
    shares = {"plain": bridged().report().native_cost_fraction}
    for fraction in fractions:
        for by in ("source", "target"):
            name = f"refresh {fraction} by {by}"
            times[name] = timed(lambda: bridged(fraction, by), device, repeats)  # noqa: B023
            shares[name] = bridged(fraction, by).report().native_cost_fraction
    return times, shares


@torch.no_grad()
def stages(source, target, bridge, context, question, fraction, device, repeats) -> None:
    """Where a refreshed handoff's time goes: each stage synchronised, then torch.profiler's
    top operators by CPU time (the host side) for one whole handoff."""
    source_kv = capture_kv(source, context)
    full = torch.cat([context, question], dim=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once():
        marks = [time.perf_counter()]
        scores = source_guided_scores(source, source_kv, None, context, context, question)
        sync()
        marks.append(time.perf_counter())
        cache = BridgedCache(bridge, source_kv, target, context)
        sync()
        marks.append(time.perf_counter())
        cache = BridgedCache(bridge, source_kv, target, context, refresh=fraction, refresh_by=scores)
        sync()
        marks.append(time.perf_counter())
        target.generate(
            full, max_new_tokens=1, do_sample=False, pad_token_id=0, **cache_kwargs(target, cache)
        )
        sync()
        marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])]

    once()
    runs = [once() for _ in range(repeats)]
    names = ["source reads the question", "BridgedCache without refresh", "BridgedCache with refresh",
             "generate (held-back token + question)"]  # fmt: skip
    for i, name in enumerate(names):
        print(f"  {name}: {statistics.median(r[i] for r in runs) * 1e3:.1f} ms")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        once()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--stages", type=int, help="at this length: time per stage and a profile, then stop")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    lengths = [32, 64] if args.smoke else args.lengths
    source_config = config_of("qwen2.5-coder-1.5b", args.smoke)
    target_config = config_of("qwen2.5-coder-0.5b", args.smoke)
    torch.manual_seed(0)
    with torch.device(device):
        source, target = (
            AutoModelForCausalLM.from_config(c, dtype=dtype, attn_implementation="sdpa").eval()
            for c in (source_config, target_config)
        )
    bridge = random_fullhead_bridge(source_config, target_config)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device {name}, torch {torch.__version__}, {dtype}, median of {args.repeats}, "
          f"{QUESTION_TOKENS}-token question, Qwen2.5-Coder-1.5B -> 0.5B configs")  # fmt: skip
    if args.stages:
        context = torch.randint(0, target_config.vocab_size, (1, args.stages), device=device)
        question = torch.randint(0, target_config.vocab_size, (1, QUESTION_TOKENS), device=device)
        print(f"stages of a handoff with refresh {args.fractions[-1]} by source, {args.stages} tokens")
        stages(source, target, bridge, context, question, args.fractions[-1], device, args.repeats)
        return
    header = None
    for n in lengths:
        context = torch.randint(0, target_config.vocab_size, (1, n), device=device)
        question = torch.randint(0, target_config.vocab_size, (1, QUESTION_TOKENS), device=device)
        times, shares = measure(
            source, target, bridge, context, question, args.fractions, device, args.repeats
        )
        if header is None:
            variants = [v for v in times if v != "native"]
            header = ["context tokens", "native ms"] + [f"{v}: ms (time, FLOPs share)" for v in variants]
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
        cells = [str(n), f"{times['native'] * 1e3:.1f}"]
        for v in variants:
            cells.append(f"{times[v] * 1e3:.1f} ({times[v] / times['native']:.0%}, {shares[v]:.0%})")
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
