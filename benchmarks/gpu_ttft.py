"""Time to first token through generate(): native target prefill vs a BridgedCache handoff.

    python benchmarks/gpu_ttft.py                 # on a CUDA machine (bf16, sdpa)
    python benchmarks/gpu_ttft.py --smoke         # tiny shapes on CPU, to check the script

Random-weight models built from real configs (no download): the source's KV is random tensors of
the source's shape (its prefill is excluded from handoff time, as the field reports it), and
the bridge is a head-local (CacheBridge-shaped) map with random coefficients: only time is
measured here. Rows, per context length, all measured side by side in one run:
- native: target.generate(ids, max_new_tokens=1), i.e. prefill of the whole context;
- ceiling: generate(max_new_tokens=1) over an already-filled native cache of the same prefix
  (what bridged would cost if translation were free);
- bridged: BridgedCache construction (plan + 1-token native head) + generate(max_new_tokens=1),
  i.e. translation of every layer + the held-back token's forward, by three paths:
  old = per layer through the torch custom op and Triton's autotuner on every call (the code
  before issue 14: `one_launch=False` with `bridgecache.kernels.affine.DIRECT_LAUNCH = False`);
  per-layer = per layer, direct launches (`one_launch=False`); one-launch = the default on CUDA,
  one launch per group of layers for keys and one for values (bridgecache.grouped);
- translate: BridgedCache(...).materialize() alone (old and one-launch), CUDA-synchronised;
- host: the same call's CPU time before it returns (no synchronisation; the GPU runs behind),
  per target layer: what the lazy path adds to each layer's forward.
Median of --repeats after warm-up, CUDA-synchronised wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bridgecache.kernels import affine
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

from bridgecache.bridge import Bridge, LayerMap
from bridgecache.cache import BridgedCache
from bridgecache.compat import cache_kwargs
from bridgecache.modelinfo import model_spec

QWEN25 = {
    "qwen2.5-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4
    ),
}
VOCAB = {"qwen2.5-1.5b": 151936, "qwen2.5-7b": 152064}
PAIRS = [("qwen2.5-7b", "qwen2.5-1.5b"), ("qwen2.5-1.5b", "qwen2.5-7b")]


def config_of(name: str, smoke: bool) -> Qwen2Config:
    shape = dict(QWEN25[name], num_hidden_layers=28, vocab_size=VOCAB[name])
    if smoke:  # same head layout, tiny widths
        shape |= dict(hidden_size=shape["num_attention_heads"] * 16, intermediate_size=64)
        shape |= dict(num_hidden_layers=2, vocab_size=512)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    return Qwen2Config(
        **shape, max_position_embeddings=32768, rope_parameters=rope, tie_word_embeddings=False
    )


def random_headlocal_bridge(source_config, target_config) -> Bridge:
    """A CacheBridge-shaped bridge (each target head reads one source head of one layer)."""
    source, target = model_spec(source_config), model_spec(target_config)
    ds, dt = source.head_dim, target.head_dim
    layers = []
    for layer in range(target.num_layers):
        src_layer = round(layer * (source.num_layers - 1) / max(1, target.num_layers - 1))
        heads = torch.arange(target.num_kv_heads) * source.num_kv_heads // target.num_kv_heads
        inputs = torch.stack([torch.full_like(heads, src_layer), heads], dim=-1).unsqueeze(1)
        w = lambda: torch.randn(target.num_kv_heads, ds, dt) / ds**0.5
        b = lambda: torch.zeros(target.num_kv_heads, dt)
        layers.append(LayerMap([src_layer], inputs, w(), b(), w(), b()))
    return Bridge(source, target, "cachebridge", "identity", layers)


def timed(fn, device, repeats: int) -> float:
    fn()  # warm-up
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
def run_pair(source_name, target_name, lengths, device, dtype, repeats, smoke):
    source_config, target_config = config_of(source_name, smoke), config_of(target_name, smoke)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(
            target_config, dtype=dtype, attn_implementation="sdpa"
        ).eval()
    bridge = random_headlocal_bridge(source_config, target_config)
    shape = (
        source_config.num_key_value_heads,
        source_config.hidden_size // source_config.num_attention_heads,
    )
    rows = []
    for n in lengths:
        ids = torch.randint(0, target_config.vocab_size, (1, n), device=device)
        kv = [
            tuple(torch.randn(1, shape[0], n, shape[1], device=device, dtype=dtype) for _ in range(2))
            for _ in range(source_config.num_hidden_layers)
        ]
        times = measure(target, bridge, kv, ids, device, repeats)
        rows.append(times)
        print(
            _format(f"{source_name} -> {target_name}", n, target_config.num_hidden_layers, times), flush=True
        )
        del kv
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def host_timed(fn, device, repeats: int) -> float:
    """Median CPU time of fn() until it returns, the GPU idle at the start of each call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return statistics.median(times)


def measure(target, bridge, kv, ids, device, repeats) -> dict[str, float]:
    """Seconds of each row of the module docstring for one context."""
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    prefix = DynamicCache()
    target(ids[:, :-1], **cache_kwargs(target, prefix))
    filled = [(layer.keys, layer.values) for layer in prefix.layers]

    def native():
        target.generate(ids, **gen)

    def bridged(one_launch):
        cache = BridgedCache(bridge, kv, target, ids, one_launch=one_launch)
        target.generate(ids, **gen, **cache_kwargs(target, cache))

    def ceiling():  # the held-back token over a ready cache: translation for free
        cache = DynamicCache()
        for i, (k, v) in enumerate(filled):
            cache.update(k.clone(), v.clone(), i)
        target.generate(ids, **gen, **cache_kwargs(target, cache))

    def translate(one_launch):
        BridgedCache(bridge, kv, target, ids, one_launch=one_launch).materialize()

    def construct():
        BridgedCache(bridge, kv, target, ids)

    times = dict(native=timed(native, device, repeats), ceiling=timed(ceiling, device, repeats))
    times["construct"] = timed(construct, device, repeats)
    # per-layer first: it runs the autotuner, whose choice "old" then finds (tuning from inside
    # the custom op failed on the H200 with "ValueError: vector::reserve", 2026-11-30)
    for label, one_launch, direct in (
        ("per-layer", False, True),
        ("old", False, False),
        ("one-launch", None, True),
    ):
        affine.DIRECT_LAUNCH = direct
        try:
            times[f"bridged {label}"] = timed(lambda: bridged(one_launch), device, repeats)  # noqa: B023
            if label != "per-layer":
                times[f"translate {label}"] = timed(lambda: translate(one_launch), device, repeats)  # noqa: B023
                times[f"host {label}"] = host_timed(lambda: translate(one_launch), device, repeats)  # noqa: B023
        finally:
            affine.DIRECT_LAUNCH = True
    return times


COLUMNS = ["native", "ceiling", "bridged old", "bridged per-layer", "bridged one-launch", "construct",
           "translate old", "translate one-launch"]  # fmt: skip


def _format(pair, n, layers, t) -> str:
    ms = " | ".join(f"{t[c] * 1e3:.2f}" for c in COLUMNS)
    host = " | ".join(
        f"{(t[f'host {c}'] - t['construct']) / layers * 1e6:.0f}" for c in ("old", "one-launch")
    )
    best = t["bridged one-launch"]
    old = t["bridged old"] / t["ceiling"]
    return (f"| {pair} | {n} | {ms} | {host} | {t['native'] / best:.2f}x | {old:.2f} | "
            f"{best / t['ceiling']:.2f} | {t['native'] / t['translate one-launch']:.0f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    lengths = [32, 64] if args.smoke else args.lengths
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {dtype}, median of {args.repeats}")
    print("| pair | context tokens | native TTFT ms | ceiling ms | bridged old ms | bridged per-layer ms | "
          "bridged one-launch ms | construct ms | translate old ms | translate one-launch ms | "
          "host us/layer old | host us/layer one-launch | native / bridged | old / ceiling | "
          "one-launch / ceiling | native / translate |")  # fmt: skip
    print("|---" * 16 + "|")
    for source_name, target_name in PAIRS:
        run_pair(
            source_name, target_name, lengths, device, dtype, 2 if args.smoke else args.repeats, args.smoke
        )


if __name__ == "__main__":
    main()
