"""Time to first token through generate(): native target prefill vs a translation-only handoff.

    python benchmarks/gpu_ttft.py                 # on a CUDA machine (bf16, sdpa)
    python benchmarks/gpu_ttft.py --smoke         # tiny shapes on CPU, to check the script

Random-weight models built from real configs (no download): the source's KV is random tensors of
the source's shape (its prefill is excluded from handoff time, as the field reports it), and
the bridge is a head-local (CacheBridge-shaped) map with random coefficients: only time is
measured here. Pairs: Qwen2.5-7B -> 1.5B, 1.5B -> 7B, and the Qwen3-14B -> 32B shapes of the
CacheBridge paper (`--pairs`). Every handoff here is translation only, `CONFIG` below (a handoff
with the default token refresh is timed by benchmarks/gpu_handoff.py). Rows, per context length,
all measured side by side in one run:
- native: target.generate(ids, max_new_tokens=1), i.e. prefill of the whole context;
- ceiling: generate(max_new_tokens=1) over an already-filled native cache of the same prefix
  (what bridged would cost if translation were free);
- bridged: BridgedCache construction (the plan) + generate(max_new_tokens=1), i.e. translation
  of every layer + one forward of the native head (1 token) and the held-back token, translating
  in one launch per group of layers for keys and one for values (bridgecache.runtime.translation.grouped; the
  default on CUDA, forced on the CPU too);
- construct: BridgedCache(...) alone; translate: construct + materialize() (translation and the
  native head's forward), CUDA-synchronised;
- host: the same call's CPU time before it returns (no synchronisation; the GPU runs behind),
  less construct, per target layer: what the lazy path adds to each layer's forward;
- compiled (`--compiled`, not for the Qwen3 pair): the target's forward under
  torch.compile(mode="reduce-overhead") over one transformers StaticCache of max(lengths) + 8
  tokens, reused by every call (fixed addresses and shapes: one compiled graph per pair), first
  token = argmax of the held-back token's logits. native static = the eager forward prefilling
  the whole context into a StaticCache (transformers never compiles prefill); ceiling compiled =
  the compiled one-token forward over the static cache filled with the native prefix; bridged
  compiled = BridgedCache(...).to_static(into=...) + that compiled forward. At the first length
  of each pair, bridged compiled vs bridged eager logits are printed.
Median of --repeats after warm-up, CUDA-synchronised wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config, Qwen3Config

from bridgecache import BridgedCache, HandoffConfig
from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.compat import cache_kwargs
from bridgecache.models.spec import model_spec
from bridgecache.runtime.engine import HandoffEngine, generate

# Translation only, in one launch per group of layers; Qwen3 targets normalise keys: key_norm=False
# keeps them on the one-launch path (timing only).
CONFIG = HandoffConfig(refresh=None, key_norm=False, one_launch=True)

QWEN25 = {
    "qwen2.5-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4
    ),
}
VOCAB = {"qwen2.5-1.5b": 151936, "qwen2.5-7b": 152064}
# Qwen3 (q/k-norm, head_dim 128): the CacheBridge paper's 14B -> 32B pair.
QWEN3 = {
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=40,
                      num_key_value_heads=8, num_hidden_layers=40),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64,
                      num_key_value_heads=8, num_hidden_layers=64),
}  # fmt: skip
PAIRS = {
    "7b-1.5b": ("qwen2.5-7b", "qwen2.5-1.5b"),
    "1.5b-7b": ("qwen2.5-1.5b", "qwen2.5-7b"),
    "qwen3-14b-32b": ("qwen3-14b", "qwen3-32b"),
}


def config_of(name: str, smoke: bool):
    rope = {"rope_type": "default", "rope_theta": 1e6}
    if name in QWEN3:
        shape = dict(QWEN3[name], head_dim=128, vocab_size=151936)
        if smoke:
            shape |= dict(hidden_size=256, intermediate_size=64, num_hidden_layers=2, vocab_size=512)
        return Qwen3Config(
            **shape, max_position_embeddings=40960, rope_parameters=rope, tie_word_embeddings=False
        )
    shape = dict(QWEN25[name], num_hidden_layers=28, vocab_size=VOCAB[name])
    if smoke:  # same head layout, tiny widths
        shape |= dict(hidden_size=shape["num_attention_heads"] * 16, intermediate_size=64)
        shape |= dict(num_hidden_layers=2, vocab_size=512)
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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_timed(fn, device, repeats: int) -> float:
    """Median CPU time of fn() until it returns, the GPU idle at the start of each call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        sync(device)
    return statistics.median(times)


@torch.no_grad()
def run_pair(pair, lengths, device, dtype, repeats, smoke, compiled):
    source_name, target_name = PAIRS[pair]
    source_config, target_config = config_of(source_name, smoke), config_of(target_name, smoke)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(
            target_config, dtype=dtype, attn_implementation="sdpa"
        ).eval()
    bridge = random_headlocal_bridge(source_config, target_config)
    heads = source_config.num_key_value_heads
    head_dim = (
        getattr(source_config, "head_dim", None)
        or source_config.hidden_size // source_config.num_attention_heads
    )
    static = {}  # one StaticCache per pair (its buffers keep their addresses across calls)
    compiled = compiled and pair in ("7b-1.5b", "1.5b-7b")
    max_cache_len = max(lengths) + 8
    rows = []
    for n in lengths:
        ids = torch.randint(0, target_config.vocab_size, (1, n), device=device)
        kv = [
            tuple(torch.randn(1, heads, n, head_dim, device=device, dtype=dtype) for _ in range(2))
            for _ in range(source_config.num_hidden_layers)
        ]
        times = measure(target, bridge, kv, ids, device, repeats)
        if compiled:
            try:
                times |= measure_compiled(
                    target, bridge, kv, ids, device, repeats, static, max_cache_len, n == lengths[0]
                )
            except Exception as error:  # keep the eager rows of this run; say why compiled has none
                print(f"compiled rows failed at {n} tokens: {error!r}", flush=True)
                compiled = False
        rows.append(times)
        print(_format(pair, n, target_config.num_hidden_layers, times), flush=True)
        del kv
    del target, static
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def measure(target, bridge, kv, ids, device, repeats) -> dict[str, float]:
    """Seconds of each eager row of the module docstring for one context."""
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    prefix = DynamicCache()
    target(ids[:, :-1], **cache_kwargs(target, prefix))
    filled = [(layer.keys, layer.values) for layer in prefix.layers]

    def native():
        target.generate(ids, **gen)

    engine = HandoffEngine(bridge, None, target)  # plans and graphs reused across repeats

    def bridged():
        cache = BridgedCache(bridge, kv, target, ids, config=CONFIG, engine=engine)
        generate(target, cache, ids, **gen)

    def ceiling():  # the held-back token over a ready cache: translation for free
        cache = DynamicCache()
        for i, (k, v) in enumerate(filled):
            cache.update(k.clone(), v.clone(), i)
        target.generate(ids, **gen, **cache_kwargs(target, cache))

    def translate():
        BridgedCache(bridge, kv, target, ids, config=CONFIG).materialize()

    times = dict(native=timed(native, device, repeats), ceiling=timed(ceiling, device, repeats))
    times["construct"] = timed(lambda: BridgedCache(bridge, kv, target, ids, config=CONFIG), device, repeats)
    times["bridged"] = timed(bridged, device, repeats)
    times["translate"] = timed(translate, device, repeats)
    times["host"] = host_timed(translate, device, repeats)
    return times


def measure_compiled(target, bridge, kv, ids, device, repeats, static, max_cache_len, check):
    """Seconds of the compiled rows: one-token steps of a torch.compile'd forward over a static
    cache (fixed shapes at every length: one compiled graph per pair), warm."""
    from transformers import StaticCache  # here: construct_host.py imports this module on older trees

    from bridgecache.runtime.interop.static import fill_static

    n = ids.shape[1]
    prefix = DynamicCache()
    target(ids[:, :-1], **cache_kwargs(target, prefix))
    filled = [(layer.keys, layer.values) for layer in prefix.layers]
    position = torch.full((1, 1), n - 1, device=device)  # the held-back token's position
    if "compiled" not in static:
        static["compiled"] = torch.compile(target.forward, mode="reduce-overhead")
        static["native"] = StaticCache(config=target.config, max_cache_len=max_cache_len)

    def step(forward, cache):  # the held-back token's forward over a filled static cache
        out = forward(
            input_ids=ids[:, -1:], position_ids=position, use_cache=True, **cache_kwargs(target, cache)
        )
        return out.logits[:, -1].argmax(-1), out.logits[:, -1].float()

    def native_static():  # eager prefill into a static cache (transformers never compiles prefill)
        static["native"].reset()
        return target(ids, use_cache=True, **cache_kwargs(target, static["native"])).logits[:, -1].argmax(-1)

    def ceiling(forward=None):
        static["cache"] = fill_static(filled, target.config, max_cache_len, into=static.get("cache"))
        return step(forward or static["compiled"], static["cache"])

    def bridged(forward=None):
        cache = BridgedCache(bridge, kv, target, ids, config=CONFIG)
        static["cache"] = cache.to_static(max_cache_len, into=static.get("cache"))
        return step(forward or static["compiled"], static["cache"])

    times = {"native static": timed(native_static, device, repeats)}
    start = time.perf_counter()
    bridged()
    bridged()  # reduce-overhead records its CUDA graph on a later call
    sync(device)
    print(f"compiled first calls at {n} tokens: {time.perf_counter() - start:.1f} s", flush=True)
    if check:
        token, logits = bridged()
        eager_token, eager_logits = bridged(target.forward)
        native_token = native_static()
        ceiling_token, _ = ceiling()
        print(f"check: bridged compiled vs eager step: max |logit diff| "
              f"{(logits - eager_logits).abs().max().item():.4f} of {eager_logits.abs().max().item():.2f}, "
              f"same token {bool((token == eager_token).all())}; ceiling compiled token == native "
              f"{bool((ceiling_token == native_token).all())}", flush=True)  # fmt: skip
    times["ceiling compiled"] = timed(ceiling, device, repeats)
    times["bridged compiled"] = timed(bridged, device, repeats)
    return times


COLUMNS = ["native", "ceiling", "bridged", "construct", "translate"]
COMPILED = ["native static", "ceiling compiled", "bridged compiled"]


def _format(pair, n, layers, t) -> str:
    ratio = lambda a, b: f"{t[a] / t[b]:.2f}" if a in t and b in t else "-"  # noqa: E731
    cells = [pair, str(n)]
    cells += [f"{t[c] * 1e3:.2f}" for c in COLUMNS]
    cells += [f"{(t['host'] - t['construct']) / layers * 1e6:.0f}"]
    cells += [f"{t[c] * 1e3:.2f}" if c in t else "-" for c in COMPILED]
    cells += [f"{ratio('native', 'bridged')}x", ratio("bridged", "ceiling")]
    cells += [ratio("bridged compiled", "ceiling compiled"), f"{ratio('native static', 'bridged compiled')}x"]
    cells += [f"{t['native'] / t['translate']:.0f}x"]
    return "| " + " | ".join(cells) + " |"


HEADER = [
    "pair", "context tokens", "native TTFT ms", "ceiling ms", "bridged ms", "construct ms", "translate ms",
    "host us/layer", "native static ms", "ceiling compiled ms", "bridged compiled ms", "native / bridged",
    "bridged / ceiling", "compiled / ceiling compiled", "native static / bridged compiled",
    "native / translate",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384, 32768])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compiled", action="store_true", help="add the static-cache + torch.compile rows")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    lengths = [32, 64] if args.smoke else args.lengths
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, {dtype}, median of {args.repeats}")
    print("| " + " | ".join(HEADER) + " |")
    print("|---" * len(HEADER) + "|")
    for pair in args.pairs:
        run_pair(pair, lengths, device, dtype, 2 if args.smoke else args.repeats, args.smoke, args.compiled)


if __name__ == "__main__":
    main()
