"""Time to first token of a handoff against the target reading the document itself, on a GPU.

    python benchmarks/gpu_handoff.py --out DIR            # a CUDA machine (bf16, sdpa): every table
    python benchmarks/gpu_handoff.py --smoke              # tiny shapes on the CPU, to check the script
    python benchmarks/gpu_handoff.py --profile 4096       # where one default handoff's time goes
    python benchmarks/gpu_handoff.py --reading-profile 16384   # the source's reading alone

Random-weight models at real configs (no download): the source is Qwen2.5-1.5B-shaped, the
targets Qwen2.5-0.5B- and Qwen2.5-7B-shaped; a Full-Head-shaped random bridge (each target head
reads every KV head of 4 source layers); a 16-token question after the context. The source's
prefill of the context is not timed (the field's convention: it has read the document anyway).
Rows, side by side in one run, median of --repeats after a warm-up, CUDA-synchronised wall time,
each until the first new token:
- native: target.generate(context + question, max_new_tokens=1), the target's own prefill;
- native, graph: the same forward replayed from a CUDA graph captured for this length (what a
  compiled deployment pays: no launch overhead; the "compiled vs compiled" reference), with no
  causal mask built where the decoder takes a prepared mapping (`prefill.mask_mapping`: under
  capture transformers 5.17 builds one and sdpa loses flash attention, which made this row 3x
  eager at 32K before 2026-12-07); "default / best native" divides by the faster of the two;
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
- native route: `HandoffConfig(route="native")` through the same BridgedCache and generate(): the
  cost gate's other side (the cache starts empty; generate()'s first forward is the target's own
  prefill, replayed from a CUDA graph from a shape's second request on), checked against "native";
- native route, forward: the same, its first token from one forward (no generate()): beside
  "native, graph";
- default, route auto: `HandoffConfig()`, the default as users get it: the cost gate
  (bridgecache.runtime.route) times both routes on the engine's first request at a length (in the
  row's warm-up, not timed) and takes the faster; the route it took (`report().route`, and
  `route_reason`) is printed under the table; "route auto / best native" is what it costs;
- route auto, forward: the same, its first token from one forward (no generate()): "route auto,
  forward / best native" is the compiled-vs-compiled cost of the gate's choice;
- refresh r, given: the same choice made beforehand (no source reading): translation + the one
  forward; minus the translation-only row, it is what the refresh costs.
"best native" is the faster of native and native, graph. --fresh-native also measures the native
rows in a new process per length (the same seeded weights and ids; its logits checked against the
in-process native row's), printed beside the in-process native ms: a clean allocator's time.
The batch table: `--batch` contexts of `--batch-tokens` tokens, `--new-tokens` new tokens each,
handoff (route="handoff"; source prefill excluded, and included) and the handoff under route
"auto" vs the target's batched prefill + generation.
--profile N: torch.profiler over one default handoff (route="handoff") at N tokens: kernel
launches, GPU busy time, the top operators. --host-profile N: cProfile over default handoffs at N
tokens (where the host's milliseconds go once the forwards replay from CUDA graphs).
--profile also prints the native route's stages (the cache's set-up, its one forward) beside a
bare graph replay, and each run's top operators by GPU time. --reading-profile N: the source's
reading of the question alone at N tokens, eager and replayed from a graph (scores checked
against each other), then the eager reading under torch.profiler.
Each row's result is checked before its time is recorded: every timed run returns its first-token
logits, which must be finite and, at the same inputs, within TOLERANCE (relative L2) of an earlier
run of the row that refreshed the same context tokens (the warm-up runs a new shape eagerly, the
repeats replay CUDA graphs at bucketed shapes: bf16 sums differ, and on random weights the
source's near-tied attention scores can then pick another refreshed set, which moves the logits
as much as another context would; such a run is held to sharing MIN_SHARED of the first run's
refreshed tokens instead). Across rows, on the last runs: "native, graph" against "native",
"default, forward" and "default, eager" against "default", "route auto" against the row of the
route it took. A failure raises with the row, the length and the difference.
Per length, before its rows: the previous length's tensors freed (gc, `empty_cache()`); then
allocated and reserved device memory, the peak during the rows and the allocator's retries
(`num_alloc_retries`: a nearly full allocator frees its cache and retries: a slow native row).
One engine per target serves the whole table, as a deployment keeps one; it is closed, and the
target freed, before the next target's rows.
Prints device, date, torch/transformers versions and the git commit.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

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


def routed_engine(bridge, source, target, config, tokens: int, words=None) -> HandoffEngine:
    """The pair's engine with the routes timed where `config` (route="auto") needs them at
    `tokens` context tokens, as `HandoffEngine.plan` does for every request (a BridgedCache built
    directly times nothing since issue 61: its cost gate would fall back to the FLOP estimate).
    Measured once per length, in a row's warm-up; a later call only finds the lengths timed."""
    engine = engine_of(bridge, source, target)
    engine.time_routes(config.with_words(words is not None), tokens)
    return engine


SHAPES = {  # config.json of the published models
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
}  # fmt: skip
QUESTION = 16
FIRST_ID = 3  # random ids start here: no pad (0), bos or eos among them


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
SEEDS = {"1.5b": 0, "0.5b": 1, "7b": 2}  # each model's weights, whatever else the run made first
# The checks' tolerances. Measured on the CPU in bf16, Qwen2.5-1.5B -> 7B shapes, 300 and 700
# tokens: the native pass at bucketed shapes (masked padding, as a graph replays it) against its
# exact shape moved the first-token logits by 0.030 relative L2 (0.020 at 0.5B shapes); a
# different context under the same question by 1.39-1.41 (uncorrelated vectors of equal norm lie
# ~1.4 apart), and 8-10 of 60-140 refreshed tokens swapped (the reading's scores perturbed by 2%)
# by 0.8-1.1: random weights make every refreshed token count. So runs are compared only where
# they refreshed the same tokens, within 0.2 (6x the noise, a fifth of a real difference);
# where the refresh differs, a reading of the right context still shares most of its choice
# (the swaps above kept 85-95%), a reading of another context shares about the refresh's 20%.
TOLERANCE = 0.2
MIN_SHARED = 0.5


@dataclass
class FirstToken:
    """One timed run's result: its first new token's logits and, for a bridged cache, what it did."""

    logits: torch.Tensor  # [batch, vocab]
    cache: object = None  # the BridgedCache: read by settled(), after the clock stops
    columns: torch.Tensor | None = None  # [batch, k] int64 the refreshed context columns
    route: str = "?"  # report().route (and route_reason) of a bridged cache

    def settled(self) -> FirstToken:
        """This result held on the CPU (logits as float32, the refresh's columns, the route),
        without the cache: a repeat's cache is freed before the next repeat."""
        logits = self.logits.detach().float().cpu()
        if self.cache is None:
            return FirstToken(logits, columns=torch.empty(len(logits), 0, dtype=torch.long), route="")
        report = self.cache.report()  # route/route_reason: getattr while the cost gate lands
        route = f"{getattr(report, 'route', '?')}: {getattr(report, 'route_reason', '?')}"
        return FirstToken(logits, columns=self.cache.refreshed_columns, route=route)


def distance(a: FirstToken, b: FirstToken) -> float:
    """The largest relative L2 distance of a's logits from b's over the batch's rows."""
    return float(((a.logits - b.logits).norm(dim=-1) / b.logits.norm(dim=-1)).max())


def shared(a: FirstToken, b: FirstToken) -> float:
    """The smallest share, over the batch's rows, of b's refreshed columns that a refreshed too."""
    shares = []
    for ca, cb in zip(a.columns.tolist(), b.columns.tolist()):
        chosen = set(cb)
        shares.append(len(set(ca) & chosen) / len(chosen) if chosen else float(not ca))
    return min(shares, default=1.0)


def check(result: FirstToken, earlier: list, what: str) -> dict:
    """Check `result` against `earlier` results of the same inputs (the first one first; see the
    module docstring): finite logits; within TOLERANCE of an earlier result that refreshed the same
    columns; where none did, sharing MIN_SHARED of the first's refreshed columns (it then joins
    `earlier`). Raises AssertionError naming `what`; returns what it measured."""
    if not torch.isfinite(result.logits).all():
        raise AssertionError(f"{what}: non-finite first-token logits")
    same = next((e for e in earlier if torch.equal(e.columns, result.columns)), None)
    if same is not None:
        d = distance(result, same)
        if d > TOLERANCE:
            raise AssertionError(
                f"{what}: first-token logits {d:.3f} (relative L2) from those of a run that refreshed "
                f"the same tokens (tolerance {TOLERANCE})"
            )
        return {"distance": d}
    if not earlier:
        earlier.append(result)
        return {}
    share = shared(result, earlier[0])
    if share < MIN_SHARED:
        raise AssertionError(
            f"{what}: the refresh shares {share:.0%} of the first run's tokens (at least {MIN_SHARED:.0%}; "
            f"logits {distance(result, earlier[0]):.3f} apart)"
        )
    earlier.append(result)
    return {"shared": share, "distance_other_refresh": distance(result, earlier[0])}


def summary(seen: list[dict]) -> dict:
    """What a row's (or a length's) checks measured, for the table's notes and results.json."""
    distances = [s["distance"] for s in seen if "distance" in s]
    shares = [s["shared"] for s in seen if "shared" in s]
    return {
        "compared": len(distances),
        "max_distance": max(distances, default=None),
        "other_refreshes": len(shares),
        "min_shared": min(shares, default=None),
    }


def timed(fn, device, repeats: int, what: str) -> tuple[float, FirstToken, dict]:
    """(median seconds of `fn()` after a warm-up, the last run's result, its checks' summary):
    `fn` returns a `FirstToken`; each run's is checked (`check`) before its time is recorded."""
    earlier, seen = [], []
    seen.append(check(fn().settled(), earlier, f"{what}, warm-up"))  # autotuning, allocator, capture
    times = []
    for k in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        seconds = time.perf_counter() - start
        last = out.settled()
        del out  # its cache, before the next run
        seen.append(check(last, earlier, f"{what}, repeat {k + 1}"))
        times.append(seconds)
    return statistics.median(times), last, summary(seen)


def random_ids(vocab: int, batch: int, n: int, device):
    """Context [batch, n] and question [batch, QUESTION] ids, seeded by (batch, n): a fresh process
    (--fresh-native) draws the same ones."""
    generator = torch.Generator().manual_seed(n * 1024 + batch)
    # From 3: generate() takes a pad_token_id (0) in its inputs for padding and masks it out
    context = torch.randint(FIRST_ID, vocab, (batch, n), generator=generator)
    question = torch.randint(FIRST_ID, vocab, (batch, QUESTION), generator=generator)
    return context.to(device), question.to(device)


def random_request(source, target, batch: int, n: int, device):
    """Random ids: context [batch, n], question [batch, QUESTION], their concatenation, and the
    source's KV of the context (it has read the document: never timed)."""
    context, question = random_ids(target.config.vocab_size, batch, n, device)
    return context, question, torch.cat([context, question], dim=1), capture_kv(source, context)


def random_words(n: int):
    """`ContextWords` of n context tokens in words of 1-4 tokens, the same on both sides (one
    vocabulary: the alignment is the identity), as `handoff()` finds them in a text."""
    from bridgecache.runtime.selection.words import ContextWords

    groups = torch.repeat_interleave(torch.arange(n), torch.randint(1, 5, (n,)))[:n].reshape(1, n)
    return ContextWords(groups, groups)


FIRST_TOKEN = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
FIRST_TOKEN |= dict(output_logits=True, return_dict_in_generate=True)  # its logits, checked


def native_rows(target, full, device, repeats: int, what: str) -> tuple[dict, dict, dict]:
    """(seconds, last results, checks) of the native rows: the target's own prefill of `full`, by
    generate() and (CUDA) replayed from a CUDA graph; "native, graph" checked against "native"."""
    seconds, results, checks = {}, {}, {}
    runs = [("native", lambda: FirstToken(target.generate(full, **FIRST_TOKEN).logits[0]))]
    if device.type == "cuda":
        runs.append(("native, graph", native_graph(target, full)))
    for name, fn in runs:
        seconds[name], results[name], checks[name] = timed(fn, device, repeats, f"{what}, row {name!r}")
    if "native, graph" in results:
        c = check(results["native, graph"], [results["native"]], f"{what}, 'native, graph' vs 'native'")
        checks["native, graph"]["vs native"] = c
    return seconds, results, checks


@torch.no_grad()
def handoff_rows(
    source, target, bridge, n: int, device, repeats: int, fractions, reading_layers=(), label=""
) -> dict:
    """Each row (see the module docstring) at n context tokens: "seconds" to the first token,
    "checks" (what `check` measured, per row), "route auto took"."""
    context, question, full, kv = random_request(source, target, 1, n, device)
    what = f"{label} at {n} tokens"

    def bridged(config, words=None):
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            config=config,
            source_model=source,
            prompt_ids=question,
            words=words,
            engine=routed_engine(bridge, source, target, config, n, words),
        )
        return FirstToken(generate(target, cache, full, **FIRST_TOKEN).logits[0], cache)

    def bridged_forward(config):  # the first token's logits without generate()'s own host work
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            config=config,
            source_model=source,
            prompt_ids=question,
            engine=routed_engine(bridge, source, target, config, n),
        )
        first = cache.get_seq_length()
        kwargs = cache_kwargs(target, cache)
        out = forward_with_pass(target, input_ids=full[:, first:], logits_to_keep=1, **kwargs)
        return FirstToken(out.logits[:, -1], cache)

    rows, last, checks = native_rows(target, full, device, repeats, what)

    def row(name, fn):
        rows[name], last[name], checks[name] = timed(fn, device, repeats, f"{what}, row {name!r}")

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
    row("native route", lambda: bridged(HANDOFF.replace(route="native")))
    row("native route, forward", lambda: bridged_forward(HANDOFF.replace(route="native")))
    row("default, route auto", lambda: bridged(HandoffConfig()))
    row("route auto, forward", lambda: bridged_forward(HandoffConfig()))
    route = last["default, route auto"].route
    pairs = [("default, forward", "default"), ("default, eager", "default"), ("native route", "native")]
    pairs.append(("native route, forward", "native"))
    taken = route.split(":")[0]  # the row of the route it took: "handoff" is the default row
    if taken in ("handoff", "native"):
        pairs.append(("default, route auto", "default" if taken == "handoff" else "native"))
        pairs.append(("route auto, forward", "default" if taken == "handoff" else "native"))
    for name, other in pairs:  # the last runs: no forward beyond the timed ones
        checks[name][f"vs {other}"] = check(last[name], [last[other]], f"{what}, {name!r} vs {other!r}")
    return {"seconds": rows, "checks": checks, "route auto took": route, "last": last}


def native_graph(target, ids: torch.Tensor):
    """A replay of the target's prefill of `ids` from a CUDA graph; returns the last token's logits.
    The forward is given no causal mask where the decoder takes a prepared mapping (as the native
    route's graphs are: under capture transformers 5.17 otherwise builds a [1, 1, n, n] mask and
    sdpa loses its flash kernels; bridgecache/runtime/native_work/prefill.py)."""
    from bridgecache.runtime.interop.graphs import capture
    from bridgecache.runtime.native_work.prefill import mask_mapping

    def forward(masks=None):
        return target(input_ids=ids, use_cache=False, logits_to_keep=1, attention_mask=masks).logits

    with torch.no_grad():
        masks = mask_mapping(target, forward)
        graph, logits = capture(lambda: forward(masks))

    def replay():
        graph.replay()
        return FirstToken(logits[:, -1].clone())  # the buffer is rewritten by the next replay

    return replay


@torch.no_grad()
def batch_rows(source, target, bridge, batch: int, tokens: int, new: int, device, reading_layers=()) -> dict:
    """Requests per second: handoffs of `batch` contexts in one pass vs the target's own batch
    ("rates"), with each row's "checks" and the route "handoff, route auto" took."""
    context, question, full, kv = random_request(source, target, batch, tokens, device)
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    gen |= dict(output_logits=True, return_dict_in_generate=True)  # the first token's, checked
    what = f"batch {batch} x {tokens} tokens"

    def handoff(with_source_prefill: bool, config=HANDOFF):
        source_kv = capture_kv(source, context) if with_source_prefill else kv
        cache = BridgedCache(
            bridge,
            source_kv,
            target,
            context,
            config=config,
            source_model=source,
            prompt_ids=question,
            engine=routed_engine(bridge, source, target, config, tokens),
        )
        return FirstToken(generate(target, cache, full, **gen).logits[0], cache)

    runs = {
        "native": lambda: FirstToken(target.generate(full, **gen).logits[0]),
        "handoff": lambda: handoff(False),
        "handoff incl. source prefill": lambda: handoff(True),
        "handoff, route auto": lambda: handoff(False, HandoffConfig()),
    }
    for layers in reading_layers:
        fewer = HANDOFF.replace(refresh=RefreshConfig(0.2, SourceAttention(layers=layers)))
        runs[f"handoff, source reads {layers} layers"] = lambda: handoff(False, fewer)  # noqa: B023
    rates, checks, peaks, route = {}, {}, {}, "?"
    for name, fn in runs.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds, last, checks[name] = timed(fn, device, 2, f"{what}, row {name!r}")
        rates[name] = batch / seconds
        if device.type == "cuda":  # the row's own peak: models, the source's KV and what it made
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        route = last.route if name == "handoff, route auto" else route
    return {"rates": rates, "checks": checks, "route auto took": route, "peak_gib": peaks}


_OUR_CODE = ("bridgecache", "transformers/", "gpu_handoff")


def live_allocations(top: int = 12) -> list[str]:
    """The live CUDA allocations, summed by where they were made (the innermost frame in
    bridgecache, transformers or this script), largest first: needs
    torch.cuda.memory._record_memory_history(stacks="python") before the allocations."""
    sites: dict[str, int] = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = block.get("frames") or (block.get("history") or [{}])[-1].get("frames", [])
            ours = [f for f in frames if any(k in f["filename"] for k in _OUR_CODE)]
            site = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in ours[:3])
            site = site or "?"
            sites[site] = sites.get(site, 0) + block["size"]
    ranked = sorted(sites.items(), key=lambda item: -item[1])[:top]
    return [f"{size / 2**30:7.2f} GiB  {site}" for site, size in ranked]


@torch.no_grad()
def profile(source, target, bridge, n: int, device) -> None:
    """Kernel launches, GPU busy share and top operators of one default handoff at n tokens."""
    context, question, full, kv = random_request(source, target, 1, n, device)
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)

    def handoff(config=HANDOFF):
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
        handoff(HANDOFF.replace(refresh=None))

    def stages() -> tuple[float, float]:
        sync(device)
        start = time.perf_counter()
        cache = BridgedCache(
            bridge,
            kv,
            target,
            context,
            config=HANDOFF,
            source_model=source,
            prompt_ids=question,
            engine=engine_of(bridge, source, target),
        )
        sync(device)
        built = time.perf_counter()
        generate(target, cache, full, **gen)
        sync(device)
        return built - start, time.perf_counter() - built

    def native_stages() -> tuple[float, float]:  # the native route: set-up, then its one forward
        sync(device)
        start = time.perf_counter()
        cache = BridgedCache(
            bridge, kv, target, context, config=HANDOFF.replace(route="native"), source_model=source,
            prompt_ids=question, engine=engine_of(bridge, source, target),
        )  # fmt: skip
        sync(device)
        built = time.perf_counter()
        forward_with_pass(target, input_ids=full, logits_to_keep=1, **cache_kwargs(target, cache))
        sync(device)
        return built - start, time.perf_counter() - built

    for _ in range(3):  # a shape's second request captures its graph
        native_stages()
    runs = [native_stages() for _ in range(7)]
    bare = [math.nan]  # a bare graph replay of the same prefill (CUDA only)
    if device.type == "cuda":
        replay = native_graph(target, full)
        replay()
        bare = []
        for _ in range(7):
            sync(device)
            start = time.perf_counter()
            replay()
            sync(device)
            bare.append(time.perf_counter() - start)
    build_ms, forward_ms = (statistics.median(r[i] for r in runs) * 1e3 for i in range(2))
    print(f"native route at {n} tokens: BridgedCache {build_ms:.2f} ms, its forward {forward_ms:.2f} ms; "
          f"native, graph {statistics.median(bare) * 1e3:.2f} ms")  # fmt: skip
    handoff()
    runs = [stages() for _ in range(5)]
    # not named `generate`: that would shadow the function the nested handoffs call
    build_ms, generate_ms = (statistics.median(r[i] for r in runs) * 1e3 for i in range(2))
    print(f"stages at {n} tokens: BridgedCache (reading, planning) {build_ms:.1f} ms, "
          f"generate {generate_ms:.1f} ms")  # fmt: skip
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    runs = (("native", native), ("default handoff", handoff), ("translation only", translation_only))
    for name, fn in runs:
        for _ in range(3):  # a shape's second request captures its graphs: not in the profile
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
        if device.type == "cuda":  # where the GPU's time goes
            averages = prof.key_averages()
            print(averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70))


@torch.no_grad()
def reading_profile(source, target, n: int, device, repeats: int) -> None:
    """The source's reading of the question alone at n context tokens (what the default's refresh
    choice costs): eager, and replayed from a CUDA graph in a store whose budget admits it (the
    engine's default budget refuses a graph whose buffers pass a quarter of it); the two scores
    checked against each other; then torch.profiler over the eager reading."""
    import threading

    from bridgecache.runtime.interop.graphs import as_view
    from bridgecache.runtime.selection.reading import attention_scores
    from bridgecache.runtime.state import GraphStore

    context, question, _, kv = random_request(source, target, 1, n, device)
    view = as_view(source)  # a view of the source, as SourceReader reads through the engine's
    first = (kv.attention_mask == 0).sum(1)
    lock = threading.RLock()
    stores = {"eager": None}
    if device.type == "cuda":
        stores["graph"] = GraphStore(64 * 2**30)

    def read(store):
        return attention_scores(
            view, kv.keys, kv.values, kv.position_ids, first, question, n, graphs=store, replay_lock=lock
        )

    results, times = {}, {}
    for name, store in stores.items():
        for _ in range(3):  # the second request captures
            read(store)
        seconds = []
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            results[name] = read(store)
            sync(device)
            seconds.append(time.perf_counter() - start)
        times[name] = statistics.median(seconds)
        if not torch.isfinite(results[name]).all():
            raise AssertionError(f"reading at {n} tokens, {name}: non-finite scores")
    if "graph" in results:
        gap = (results["graph"] - results["eager"]).abs().max().item()
        scale = results["eager"].abs().max().item()
        if gap > 0.05 * scale:
            raise AssertionError(f"reading at {n} tokens: graph vs eager scores differ by {gap:.3g}")
        print(f"reading at {n} tokens: graph vs eager scores differ by <= {gap:.3g} (scores <= {scale:.3g})")
    print(f"reading at {n} tokens: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        read(None)
        sync(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e6
    print(f"eager reading at {n} tokens, profiled: {wall * 1e3:.1f} ms wall, {len(kernels)} kernels, "
          f"GPU busy {busy * 1e3:.1f} ms ({busy / wall:.0%})")  # fmt: skip
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


@torch.no_grad()
def host_profile(source, target, bridge, n: int, device, repeats: int = 10) -> None:
    """The host's share of the target's own generate(), the native route and default handoffs at
    n tokens: wall time per run, then cProfile by total and by own time."""
    import cProfile
    import pstats

    context, question, full, kv = random_request(source, target, 1, n, device)
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)

    def handoff(config):
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

    runs = {
        "native (generate)": lambda: target.generate(full, **gen),
        "native route": lambda: handoff(HANDOFF.replace(route="native")),
        "default handoff": lambda: handoff(HANDOFF),
    }
    for name, run in runs.items():
        for _ in range(2):  # warm-ups: a shape's second request captures its graphs
            run()
        sync(device)
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(repeats):
            run()
            sync(device)
        profiler.disable()
        ms = (time.perf_counter() - start) / repeats * 1e3
        print(f"\nhost profile at {n} tokens, {name}: {ms:.1f} ms per run (under cProfile)")
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(15)


def free(device) -> None:
    """Give back what earlier rows held (their tensors and the allocator's cached blocks), so a
    length's rows start from the models, the engine and its graphs only."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_state(device) -> dict:
    """Device memory before a length's rows (GiB) and the allocator's retry count so far; the
    peak is counted from here."""
    if device.type != "cuda":
        return {}
    torch.cuda.reset_peak_memory_stats()
    return {
        "allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "reserved_gib": torch.cuda.memory_reserved() / 2**30,
        "retries_before": torch.cuda.memory_stats().get("num_alloc_retries", 0),
    }


def memory_after(device, before: dict) -> dict:
    """The peak allocated during the rows (GiB) and the allocator's retries during them."""
    if device.type != "cuda":
        return {}
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - before["retries_before"]
    return {"peak_gib": torch.cuda.max_memory_allocated() / 2**30, "alloc_retries": retries}


def memory_line(m: dict) -> str:
    if not m:
        return "no device memory (CPU)"
    return (f"{m['allocated_gib']:.1f} GiB allocated / {m['reserved_gib']:.1f} reserved before, "
            f"peak {m['peak_gib']:.1f}, {m['alloc_retries']} allocator retries")  # fmt: skip


def checks_line(checks: dict) -> str:
    """The largest logit distance and the runs that refreshed other tokens, over a length's checks
    (each row's `summary` and its "vs <row>" checks)."""
    distances, shares = [], []
    for row in checks.values():
        distances.append(row["max_distance"])
        shares += [row["min_shared"]] * row["other_refreshes"]
        for against in (v for k, v in row.items() if k.startswith("vs ")):
            distances.append(against.get("distance"))
            shares += [against["shared"]] if "shared" in against else []
    largest = max((d for d in distances if d is not None), default=0.0)
    line = f"logits within {largest:.3f} (relative L2) of a run that refreshed the same tokens"
    if shares:
        line += f"; {len(shares)} runs refreshed other tokens (sharing at least {min(shares):.0%})"
    return line


def fresh_native(target_name: str, n: int, args) -> dict:
    """The native rows at n tokens measured in a new process (the same seeded weights and ids,
    nothing else on its allocator): {"seconds": {row: s}, "logits": the native row's, CPU}."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "native.pt")
        command = [sys.executable, os.path.abspath(__file__), "--native-only", target_name, str(n)]
        command += ["--repeats", str(args.repeats), "--native-out", path] + ["--smoke"] * args.smoke
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"--fresh-native at {n} tokens failed:\n{done.stderr[-4000:]}")
        return torch.load(path)


def native_only(model, target_name: str, n: int, device, args) -> None:
    """--native-only (the process --fresh-native starts): the native rows alone, saved."""
    target = model(target_name)
    context, question = random_ids(target.config.vocab_size, 1, n, device)
    full = torch.cat([context, question], dim=1)
    with torch.no_grad():
        seconds, last, _ = native_rows(target, full, device, args.repeats, f"{target_name} at {n} tokens")
    torch.save({"seconds": seconds, "logits": last["native"].logits}, args.native_out)


def _commit() -> str:
    if os.environ.get("BRIDGECACHE_COMMIT"):  # a copy of the tree without .git (the GPU machine)
        return os.environ["BRIDGECACHE_COMMIT"]
    try:
        return subprocess.run(  # the script's checkout, wherever it is run from
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
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
    parser.add_argument(
        "--lengths-7b", type=int, nargs="*", default=[4096, 16384, 32768], help="none: the batch table only"
    )
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--batch",
        type=int,
        default=32,
        help="contexts in the batch table (32 x --batch-tokens 4096 was sized for a 139 GB H200; "
        "on an 80 GB H100 it ran out of memory while the 0.5B target's engine was still held)",
    )
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--no-batch", action="store_true")
    parser.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="on running out of memory in the batch table, "
        "print the live allocations by the code that made them",
    )
    parser.add_argument(
        "--fresh-native",
        action="store_true",
        help="also time the native rows in a new process per length (same seeded weights and ids)",
    )
    parser.add_argument(
        "--profile", type=int, nargs="+", help="profile one handoff at these token counts, then stop"
    )
    parser.add_argument("--host-profile", type=int, nargs="+", help="cProfile default handoffs, then stop")
    parser.add_argument(
        "--reading-profile", type=int, nargs="+", help="the source's reading alone (eager, graph), then stop"
    )
    parser.add_argument(
        "--reading-layers", type=int, nargs="+", default=[], help="rows where the source reads fewer layers"
    )
    parser.add_argument("--targets", nargs="+", default=["0.5b", "7b"], choices=["0.5b", "7b"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--out", help="write results.json here")
    parser.add_argument("--native-only", nargs=2, help=argparse.SUPPRESS)  # TARGET N: --fresh-native's
    parser.add_argument("--native-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)

    def model(name):
        torch.manual_seed(SEEDS[name])  # the same weights in a --fresh-native process
        with torch.device(device):
            return AutoModelForCausalLM.from_config(
                config_of(name, args.smoke), dtype=dtype, attn_implementation="sdpa"
            ).eval()

    if args.native_only:
        return native_only(model, args.native_only[0], int(args.native_only[1]), device, args)
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
        if args.profile or args.host_profile or args.reading_profile:
            for n in args.reading_profile or []:
                reading_profile(source, target, n, device, args.repeats)
            for n in args.profile or []:
                profile(source, target, bridge, n, device)
            for n in args.host_profile or []:
                host_profile(source, target, bridge, n, device)
            return
        table, header = {}, None
        for n in ns:
            free(device)  # the previous length's tensors and graphs' pools
            memory = memory_state(device)
            out = handoff_rows(
                source, target, bridge, n, device, args.repeats, args.fractions, args.reading_layers,
                label=target_name,
            )  # fmt: skip
            memory |= memory_after(device, memory)
            rows = out["seconds"]
            table[n] = rows | {k: out[k] for k in ("route auto took", "checks")} | {"memory": memory}
            fresh = None
            if args.fresh_native:
                fresh = fresh_native(target_name, n, args)
                what = f"{target_name} at {n} tokens, the fresh process's 'native' vs this one's"
                same = check(FirstToken(fresh["logits"], columns=out["last"]["native"].columns),
                             [out["last"]["native"]], what)  # fmt: skip
                table[n]["fresh process"] = {"seconds": fresh["seconds"], "vs native": same}
            graph = "native, graph" in rows
            best = min(rows["native"], rows.get("native, graph", rows["native"]))
            if header is None:
                header = ["context tokens", "native ms"] + ["fresh process: native (graph) ms"] * bool(fresh)
                header += [f"{k} (x native)" for k in rows if k != "native"] + ["default / best native"]
                header += ["default, forward / native, graph"] * graph + ["route auto / best native"]
                header += ["route auto, forward / best native"]
                print(f"\nQwen2.5-1.5B -> Qwen2.5-{target_name.upper()} shapes: time to the first token")
                print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
            cells = [str(n), f"{rows['native'] * 1e3:.1f}"]
            if fresh:
                seconds = fresh["seconds"]
                cells.append(f"{seconds['native'] * 1e3:.1f}" + (
                    f" ({seconds['native, graph'] * 1e3:.1f})" if "native, graph" in seconds else ""
                ))  # fmt: skip
            cells += [f"{v * 1e3:.1f} ({v / rows['native']:.2f})" for k, v in rows.items() if k != "native"]
            cells.append(f"{rows['default'] / best:.2f}")  # against the faster of the two native forms
            if graph:
                cells.append(f"{rows['default, forward'] / rows['native, graph']:.2f}")
            cells.append(f"{rows['default, route auto'] / best:.2f}")
            cells.append(f"{rows['route auto, forward'] / best:.2f}")
            print("| " + " | ".join(cells) + " |", flush=True)
        print("per length: the route auto took; memory; the checks")
        for n, rows in table.items():
            print(f"  {n}: route auto took {rows['route auto took']}")
            print(f"  {' ' * len(str(n))}  {memory_line(rows['memory'])}; {checks_line(rows['checks'])}")
        results["tables"][target_name] = table
        if target_name == "7b" and not args.no_batch:
            batch, tokens = (4, 64) if args.smoke else (args.batch, args.batch_tokens)
            free(device)
            memory = memory_state(device)
            if args.memory_snapshot and device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
            try:
                out = batch_rows(
                    source, target, bridge, batch, tokens, args.new_tokens, device, args.reading_layers
                )
            except torch.OutOfMemoryError:
                if not args.memory_snapshot:
                    raise
                # the traceback still holds the failing call's tensors: say where they came from
                print(f"\nbatch {batch} x {tokens}: out of memory; live allocations by site:")
                try:
                    print("\n".join(live_allocations()), flush=True)
                except Exception as error:  # the snapshot's layout differs across torch versions
                    print(f"(no snapshot: {error!r})\n{torch.cuda.memory_summary()}", flush=True)
                raise
            memory |= memory_after(device, memory)
            rates = out["rates"]
            results["batch"] = {"batch": batch, "tokens": tokens, "new_tokens": args.new_tokens, **rates}
            results["batch"] |= {k: out[k] for k in ("route auto took", "checks")} | {"memory": memory}
            each = f"{args.new_tokens} new tokens each"
            print(f"\nbatch {batch} x {tokens} tokens, {each}, 1.5B -> 7B: requests/s")
            names, native = [k for k in rates if k != "native"], rates["native"]
            cells = [f"{native:.2f}"] + [f"{rates[k]:.2f} ({rates[k] / native:.2f})" for k in names]
            print("| native | " + " | ".join(f"{k} (x native)" for k in names) + " |")
            print("|" + "---|" * len(cells) + "\n| " + " | ".join(cells) + " |")
            print(f"handoff, route auto took {out['route auto took']}")
            print(f"{memory_line(memory)}; {checks_line(out['checks'])}")
            if out["peak_gib"]:
                print("peak GiB per row: " + ", ".join(f"{k} {v:.1f}" for k, v in out["peak_gib"].items()))
        for key in [k for k in _ENGINES if k[2] == id(target)]:  # the next target's rows start clean
            _ENGINES.pop(key).close()
        del target, bridge
        free(device)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
