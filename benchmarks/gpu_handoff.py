"""Time to first token of a handoff against the target reading the document itself, on a GPU.

    python benchmarks/gpu_handoff.py --out DIR            # a CUDA machine (bf16, sdpa): every table
    python benchmarks/gpu_handoff.py --smoke              # tiny shapes on the CPU, to check the script
    python benchmarks/gpu_handoff.py --profile 4096       # where one default handoff's time goes

Random-weight models at real configs (no download): the source is Qwen2.5-1.5B-shaped, the
targets Qwen2.5-0.5B- and Qwen2.5-7B-shaped; a Full-Head-shaped random bridge (each target head
reads every KV head of 4 source layers); a 16-token question after the context. The source's
prefill of the context is not timed (the field's convention: it has read the document anyway).
Rows, side by side in one run, median of --repeats after a warm-up, CUDA-synchronised wall time,
each until the first new token:
- native: target.generate(context + question, max_new_tokens=1), the target's own prefill;
- native, graph: the same forward replayed from a CUDA graph captured for this length (what a
  compiled deployment pays: no launch overhead; the "compiled vs compiled" reference; at long
  contexts eager can be faster: "default / best native" divides by the faster of the two);
- default: `BridgedCache(..., config=HandoffConfig(route="handoff"), source_model=source,
  prompt_ids=question)` + generate (every bridged row forces the handoff route; the cost gate's
  own choice is the "route auto" row): the source reads the question (choosing 20% of the
  context), translation, and one target forward for the native head, the refreshed tokens, the
  held-back token and the question (both forwards replayed from CUDA graphs, the default on CUDA);
- default, forward: the same handoff, its first token from one target forward (no generate():
  beside "native, graph", the compiled-vs-compiled comparison without generate()'s host work);
- default, eager: the same with `cuda_graphs=False` (every kernel launched from Python);
- default, whole words: the default given the context's words (`words=`, random words of 1-4
  tokens), as `handoff()` and every path that tokenizes a text builds it; the rows above build
  the cache from ids alone, so their refresh goes token by token (`RefreshConfig` whole_words=None);
- whole words, no ends: the same with `RefreshConfig(word_ends=False)` (each chosen word without
  the token after it, the default before 15b174b);
- default, source reads L layers (--reading-layers L): the default with
  `SourceAttention(layers=L)`, the source's reading stopping after its first L layers;
- translation only: `HandoffConfig(refresh=None)` (loses facts; the floor of the handoff);
- default, route auto: `HandoffConfig()`, the default as users get it: the cost gate
  (bridgecache.runtime.route) times both routes on the engine's first request at a length (in the
  row's warm-up, not timed) and takes the faster; the route it took is printed under the table.
- refresh r, given: the same choice made beforehand (no source reading): translation + the one
  forward; minus the translation-only row, it is what the refresh costs.
The batch table: `--batch` contexts of `--batch-tokens` tokens, `--new-tokens` new tokens each,
handoff (source prefill excluded, and included) vs the target's batched prefill + generation.
--profile N: torch.profiler over one default handoff at N tokens: kernel launches, GPU busy time,
the top operators. --host-profile N: cProfile over default handoffs at N tokens (where the host's
milliseconds go once the forwards replay from CUDA graphs).
Each row's first-token logits are checked before its time counts: finite, and every repeat
within bf16 noise of the row's first run at that length (a replay of the same shapes).
Per length: allocated and reserved device memory and the allocator's retries during its rows
(a nearly full allocator frees and retries: a slow native row).
Prints device, date, torch/transformers versions and the git commit.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

from bridgecache import (
    BridgedCache,
    GivenScores,
    HandoffConfig,
    HandoffEngine,
    RefreshConfig,
    SourceAttention,
    capture_kv,
)
from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.compat import cache_kwargs
from bridgecache.models.spec import model_spec
from bridgecache.runtime.engine import generate
from bridgecache.runtime.native_work.forward import forward_with_pass

_ENGINES: dict = {}  # (bridge, source, target) ids -> HandoffEngine: one per pair for the whole run


def engine_of(bridge, source, target) -> HandoffEngine:
    """The run's engine of this pair: its plans and CUDA graphs are reused across rows, as a
    deployment reuses them across requests."""
    key = (id(bridge), id(source), id(target))
    if key not in _ENGINES:
        _ENGINES[key] = HandoffEngine(bridge, source, target)
    return _ENGINES[key]


SHAPES = {  # config.json of the published models
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
}  # fmt: skip
QUESTION = 16


def config_of(name: str, smoke: bool) -> Qwen2Config:
    shape = dict(SHAPES[name], vocab_size=151936)
    if smoke:  # the same head layout, tiny widths
        shape |= dict(hidden_size=shape["num_attention_heads"] * 16, intermediate_size=64)
        shape |= dict(num_hidden_layers=3, vocab_size=512)
    rope = {"rope_type": "default", "rope_theta": 1e6}
    return Qwen2Config(**shape, max_position_embeddings=40960, rope_parameters=rope, tie_word_embeddings=True)


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
        maps = [torch.randn(target.num_kv_heads, n_in, dt) / n_in**0.5, torch.zeros(target.num_kv_heads, dt)]
        layers.append(LayerMap(used, inputs, maps[0], maps[1], maps[0].clone(), maps[1].clone()))
    return Bridge(source, target, "fullhead", "identity", layers)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


HANDOFF = HandoffConfig(route="handoff")
STABLE = 0.2  # relative L2 of a repeat's logits from the row's first run, at most (replays of one shape)


def timed(fn, device, repeats: int, name: str = "", n: int = 0) -> float:
    """Median seconds of `fn()` after a warm-up; `fn` returns first-token logits (or None), checked
    (finite, each repeat near the first run's) before the time is reported."""
    first = fn()  # warm-up: autotuning, allocator, the cost gate's timing
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
        if out is not None:
            out, ref = out.float(), first.float()
            if not torch.isfinite(out).all():
                raise AssertionError(f"row {name!r} at {n} tokens: non-finite first-token logits")
            distance = float((out - ref).norm() / ref.norm())
            if distance > STABLE:
                raise AssertionError(
                    f"row {name!r} at {n} tokens: a repeat's logits {distance:.3f} from the first run's"
                )
    return statistics.median(times)


def random_request(source, target, batch: int, n: int, device):
    """Random ids: context [batch, n], question [batch, QUESTION], their concatenation, and the
    source's KV of the context (it has read the document: never timed)."""
    vocab = target.config.vocab_size
    context = torch.randint(0, vocab, (batch, n), device=device)
    question = torch.randint(0, vocab, (batch, QUESTION), device=device)
    return context, question, torch.cat([context, question], dim=1), capture_kv(source, context)


def random_words(n: int):
    """`ContextWords` of n context tokens in words of 1-4 tokens, the same on both sides (one
    vocabulary: the alignment is the identity), as `handoff()` finds them in a text."""
    from bridgecache.runtime.selection.words import ContextWords

    groups = torch.repeat_interleave(torch.arange(n), torch.randint(1, 5, (n,)))[:n].reshape(1, n)
    return ContextWords(groups, groups)


@torch.no_grad()
def handoff_rows(source, target, bridge, n: int, device, repeats: int, fractions, reading_layers=()) -> dict:
    """Seconds to the first token of each row (see the module docstring) at n context tokens."""
    context, question, full, kv = random_request(source, target, 1, n, device)
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    gen |= dict(output_logits=True, return_dict_in_generate=True)  # first-token logits, checked
    routes = {}

    def bridged(config, words=None, record=None):
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            config=config,
            source_model=source,
            prompt_ids=question,
            words=words,
            engine=engine_of(bridge, source, target),
        )
        out = generate(target, cache, full, **gen)
        if record is not None:
            report = cache.report()
            routes[record] = f"{report.route}: {report.route_reason}"
        return out.logits[0]

    def bridged_forward(config):  # the first token's logits without generate()'s own host work
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            config=config,
            source_model=source,
            prompt_ids=question,
            engine=engine_of(bridge, source, target),
        )
        first = cache.get_seq_length()
        kwargs = cache_kwargs(target, cache)
        return forward_with_pass(target, input_ids=full[:, first:], logits_to_keep=1, **kwargs).logits[:, -1]

    def row(name, fn):
        rows[name] = timed(fn, device, repeats, name, n)

    rows = {}
    row("native", lambda: target.generate(full, **gen).logits[0])
    if device.type == "cuda":
        replay = native_graph(target, full)
        row("native, graph", replay)
    row("default", lambda: bridged(HANDOFF))
    row("default, forward", lambda: bridged_forward(HANDOFF))
    row("default, eager", lambda: bridged(HANDOFF.replace(cuda_graphs=False)))
    words = random_words(n)
    row("default, whole words", lambda: bridged(HANDOFF, words))
    no_ends = HANDOFF.replace(refresh=RefreshConfig(word_ends=False))
    row("whole words, no ends", lambda: bridged(no_ends, words))
    for layers in reading_layers:
        fewer = HANDOFF.replace(refresh=RefreshConfig(0.2, SourceAttention(layers=layers)))
        row(f"default, source reads {layers} layers", lambda: bridged(fewer))  # noqa: B023
    row("translation only", lambda: bridged(HANDOFF.replace(refresh=None)))
    scores = torch.rand(1, n)
    for r in fractions:
        given = HANDOFF.replace(refresh=RefreshConfig(r, GivenScores(scores)))
        row(f"refresh {r}, given", lambda: bridged(given))  # noqa: B023
    row("default, route auto", lambda: bridged(HandoffConfig(), record="auto"))
    rows["route auto took"] = routes.get("auto", "?")
    return rows


def native_graph(target, ids: torch.Tensor):
    """A replay of the target's prefill of `ids` (the last token's logits) from a CUDA graph."""
    from bridgecache.runtime.interop.graphs import capture

    with torch.no_grad():
        graph, logits = capture(lambda: target(input_ids=ids, use_cache=False, logits_to_keep=1).logits)

    def replay():
        graph.replay()
        return logits[:, -1].clone()  # the buffer is rewritten by the next replay

    return replay


@torch.no_grad()
def batch_rows(source, target, bridge, batch: int, tokens: int, new: int, device, reading_layers=()) -> dict:
    """Requests per second: handoffs of `batch` contexts in one pass vs the target's own batch."""
    context, question, full, kv = random_request(source, target, batch, tokens, device)
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def handoff(with_source_prefill: bool, config=None):
        source_kv = capture_kv(source, context) if with_source_prefill else kv
        cache = BridgedCache(
            bridge,
            source_kv,
            target,
            context,
            config=config or HANDOFF,
            source_model=source,
            prompt_ids=question,
            engine=engine_of(bridge, source, target),
        )
        generate(target, cache, full, **gen)

    seconds = {
        "native": timed(lambda: target.generate(full, **gen), device, 2),
        "handoff": timed(lambda: handoff(False), device, 2),
        "handoff incl. source prefill": timed(lambda: handoff(True), device, 2),
    }
    for layers in reading_layers:
        fewer = HandoffConfig(refresh=RefreshConfig(0.2, SourceAttention(layers=layers)))
        seconds[f"handoff, source reads {layers} layers"] = timed(lambda: handoff(False, fewer), device, 2)  # noqa: B023
    return {name: batch / s for name, s in seconds.items()}


@torch.no_grad()
def profile(source, target, bridge, n: int, device) -> None:
    """Kernel launches, GPU busy share and top operators of one default handoff at n tokens."""
    context, question, full, kv = random_request(source, target, 1, n, device)
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)

    def handoff(config=None):
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            config=config,
            source_model=source,
            prompt_ids=question,
            engine=engine_of(bridge, source, target),
        )
        generate(target, cache, full, **gen)

    def native():
        target.generate(full, **gen)

    def translation_only():
        handoff(HandoffConfig(refresh=None))

    def stages() -> tuple[float, float]:
        sync(device)
        start = time.perf_counter()
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            source_model=source,
            prompt_ids=question,
            engine=engine_of(bridge, source, target),
        )
        sync(device)
        built = time.perf_counter()
        generate(target, cache, full, **gen)
        sync(device)
        return built - start, time.perf_counter() - built

    handoff()
    runs = [stages() for _ in range(5)]
    build, generate = (statistics.median(r[i] for r in runs) * 1e3 for i in range(2))
    print(
        f"stages at {n} tokens: BridgedCache (reading, planning) {build:.1f} ms, generate {generate:.1f} ms"
    )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    runs = (("native", native), ("default handoff", handoff), ("translation only", translation_only))
    for name, fn in runs:
        fn()
        sync(device)
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            fn()
            sync(device)
            wall = time.perf_counter() - start
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e6  # us -> s
        print(f"{name}: {wall * 1e3:.1f} ms wall, {len(kernels)} kernels, GPU busy {busy * 1e3:.1f} ms "
              f"({busy / wall:.0%})")  # fmt: skip
        print(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50)
        )


@torch.no_grad()
def host_profile(source, target, bridge, n: int, device, repeats: int = 10) -> None:
    """The host's share of default handoffs at n tokens: cProfile, by own time and by total time."""
    import cProfile
    import pstats

    context, question, full, kv = random_request(source, target, 1, n, device)
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)

    def handoff():
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            source_model=source,
            prompt_ids=question,
            engine=engine_of(bridge, source, target),
        )
        generate(target, cache, full, **gen)
        sync(device)

    handoff()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(repeats):
        handoff()
    profiler.disable()
    print(f"host profile at {n} tokens: {(time.perf_counter() - start) / repeats * 1e3:.1f} ms per handoff")
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)


def memory_state(device) -> dict:
    """Device memory before a length's rows (GiB) and the allocator's retry count so far."""
    if device.type != "cuda":
        return {"allocated_gib": 0.0, "reserved_gib": 0.0, "retries_before": 0}
    return {
        "allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.memory_reserved() / 2**30,
        "retries_before": torch.cuda.memory_stats().get("num_alloc_retries", 0),
    }


def memory_after(device, before: dict) -> dict:
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if device.type == "cuda" else 0
    return {"alloc_retries": retries - before["retries_before"]}


def _commit() -> str:
    if os.environ.get("BRIDGECACHE_COMMIT"):  # a copy of the tree without .git (the GPU machine)
        return os.environ["BRIDGECACHE_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    )
    parser.add_argument("--lengths-7b", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--no-batch", action="store_true")
    parser.add_argument(
        "--profile", type=int, nargs="+", help="profile one handoff at these token counts, then stop"
    )
    parser.add_argument("--host-profile", type=int, nargs="+", help="cProfile default handoffs, then stop")
    parser.add_argument(
        "--reading-layers", type=int, nargs="+", default=[], help="rows where the source reads fewer layers"
    )
    parser.add_argument("--targets", nargs="+", default=["0.5b", "7b"], choices=["0.5b", "7b"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", help="write results.json here")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)

    def model(name):
        with torch.device(device):
            return AutoModelForCausalLM.from_config(
                config_of(name, args.smoke), dtype=dtype, attn_implementation="sdpa"
            ).eval()

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"device {name}, {stamp}, commit {_commit()}, {versions}, {dtype}, median of {args.repeats}")
    source = model("1.5b")
    results = {"device": name, "date": stamp, "commit": _commit(), "tables": {}}
    lengths = [32, 64] if args.smoke else args.lengths
    lengths_7b = [32, 64] if args.smoke else args.lengths_7b
    for target_name, ns in (("0.5b", lengths), ("7b", lengths_7b)):
        if target_name not in args.targets:
            continue
        target = model(target_name)
        bridge = random_fullhead_bridge(source.config, target.config)
        if args.profile or args.host_profile:
            for n in args.profile or []:
                profile(source, target, bridge, n, device)
            for n in args.host_profile or []:
                host_profile(source, target, bridge, n, device)
            return
        table, header = {}, None
        for n in ns:
            memory = memory_state(device)
            rows = handoff_rows(
                source, target, bridge, n, device, args.repeats, args.fractions, args.reading_layers
            )
            route = rows.pop("route auto took")
            table[n] = rows | {"route auto took": route, "memory": memory | memory_after(device, memory)}
            if header is None:
                header = ["context tokens", "native ms"] + [f"{k} (x native)" for k in rows if k != "native"]
                if "native, graph" in rows:
                    header += [
                        "default / best native",
                        "default, forward / native, graph",
                        "route auto / best native",
                    ]
                print(f"\nQwen2.5-1.5B -> Qwen2.5-{target_name.upper()} shapes: time to the first token")
                print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
            cells = [str(n), f"{rows['native'] * 1e3:.1f}"]
            cells += [f"{v * 1e3:.1f} ({v / rows['native']:.2f})" for k, v in rows.items() if k != "native"]
            if "native, graph" in rows:  # against the faster of the two native forms
                best = min(rows["native"], rows["native, graph"])
                cells.append(f"{rows['default'] / best:.2f}")
                cells.append(f"{rows['default, forward'] / rows['native, graph']:.2f}")
                cells.append(f"{rows['default, route auto'] / best:.2f}")
            print("| " + " | ".join(cells) + " |", flush=True)
        print("route auto took, and memory per length (GiB allocated / reserved, allocator retries):")
        for n, rows in table.items():
            m = rows["memory"]
            print(f"  {n}: {rows['route auto took']} | {m['allocated_gib']:.1f} / {m['reserved_gib']:.1f}, "
                  f"{m['alloc_retries']} retries")  # fmt: skip
        results["tables"][target_name] = table
        if target_name == "7b" and not args.no_batch:
            batch, tokens = (4, 64) if args.smoke else (args.batch, args.batch_tokens)
            rates = batch_rows(
                source, target, bridge, batch, tokens, args.new_tokens, device, args.reading_layers
            )
            results["batch"] = {"batch": batch, "tokens": tokens, "new_tokens": args.new_tokens, **rates}
            each = f"{args.new_tokens} new tokens each"
            print(f"\nbatch {batch} x {tokens} tokens, {each}, 1.5B -> 7B: requests/s")
            print("| native | handoff (x native) | handoff incl. source prefill (x native) |\n|---|---|---|")
            native = rates["native"]
            print(f"| {native:.2f} | {rates['handoff']:.2f} ({rates['handoff'] / native:.2f}) | "
                  f"{rates['handoff incl. source prefill']:.2f} "
                  f"({rates['handoff incl. source prefill'] / native:.2f}) |")  # fmt: skip
            for name, rate in rates.items():
                if name.startswith("handoff, source reads"):
                    print(f"{name}: {rate:.2f} requests/s ({rate / native:.2f} x native)")
        for key in [k for k in _ENGINES if k[2] == id(target)]:  # the next target's rows start clean
            _ENGINES.pop(key).close()
        del target, bridge
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
