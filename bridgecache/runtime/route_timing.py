"""Measuring the cost gate's table: both routes timed through an engine, on this device.

    costs = measure_route_costs(engine, config, lengths=[256, 512, 1024])

At each length: random ids (timing only: the work does not depend on which tokens), the source's
KV of them (not timed: the source has read the document), then the time to the first token of
a `BridgedCache` forced to each route (route="handoff" and route="native") over the engine's own
state, as requests run it. On CUDA: two warm-ups (the second captures the CUDA graphs a repeated
shape gets), then the median of `repeats`, device-synchronised. On the CPU (shared with other
work): one warm-up, then `repeats` rounds alternating the routes, each route's fastest round.
`route_lengths` gives the CUDA ladder; `CALIBRATION` the CPU's few short lengths (its costs are
scaled by FLOPs to other lengths: bridgecache.runtime.route).

Knows engines, caches and generate(); the table and the decision are bridgecache.runtime.route's.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from functools import partial

import torch
from tqdm.auto import tqdm

from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.route import RouteCosts, device_name
from bridgecache.runtime.selection.rules import GivenScores

__all__ = ["CALIBRATION", "LADDER", "calibration_lengths", "measure_route_costs", "route_lengths"]

LADDER = tuple(256 * 2**i for i in range(10))  # 256 .. 131,072 context tokens
# The CPU's lengths: a short one where a handoff's fixed cost shows and a longer one for the
# slope; timed once per setup (seconds on two cores), every other length scaled by FLOPs.
CALIBRATION = (64, 512)
PROMPT_TOKENS = 16  # a question's length; what the source reads to choose the refresh


def route_lengths(tokens: int, limit: int, measured=()) -> list[int]:
    """The ladder's lengths not yet `measured` up to `tokens` (the smallest at least; at most
    `limit`, the models' window less the prompt): what a request of `tokens` needs measured.
    Never past the request: timing a longer context could need memory the request does not (a
    length between two measured ones is interpolated, one past the last extrapolated)."""
    top = max(LADDER[0], tokens)
    return [n for n in LADDER if n <= min(top, limit) and n not in measured]


def calibration_lengths(limit: int) -> list[int]:
    """The CPU's calibration lengths within `limit` (the models' window less the prompt)."""
    return [n for n in CALIBRATION if n <= limit] or [max(1, limit)]


@torch.no_grad()
def measure_route_costs(engine, config, lengths, *, repeats: int = 3, progress: bool = True) -> RouteCosts:
    """Seconds to the first token of both routes at each of `lengths` (see the module docstring);
    scale="length" on CUDA, "flops" elsewhere (`RouteCosts.predict`)."""
    lengths = sorted(set(lengths))
    if not lengths or lengths[0] < 1:
        raise ValueError(f"lengths={lengths}; expected context lengths >= 1 token")
    source, target = engine.source, engine.target
    if source is None:
        raise ValueError("measuring the routes needs the engine's source model (it reads the prompt)")
    device = target.get_input_embeddings().weight.device
    source_device = source.get_input_embeddings().weight.device
    generator = torch.Generator().manual_seed(0)
    vocab_s, vocab_t = source.config.get_text_config().vocab_size, target.config.get_text_config().vocab_size
    times = {route: [] for route in ("handoff", "native")}
    label = f"bridgecache: timing both routes on {device_name(target)}"
    for n in tqdm(lengths, desc=label, disable=not progress):
        source_ids = torch.randint(3, vocab_s, (1, n), generator=generator).to(source_device)
        context = torch.randint(3, vocab_t, (1, n), generator=generator).to(device)
        question = torch.randint(3, vocab_t, (1, PROMPT_TOKENS), generator=generator).to(device)
        prompt = torch.randint(3, vocab_s, (1, PROMPT_TOKENS), generator=generator).to(source_device)
        inputs = (capture_kv(source, source_ids), context, prompt, torch.cat([context, question], dim=1))
        runs = {
            route: partial(_first_token, engine, _timing_config(config, route, n, generator), *inputs)
            for route in times
        }
        if device.type == "cuda":
            for route, run in runs.items():
                times[route].append(_median_seconds(run, device, repeats))
        else:
            for route, seconds in _fastest_interleaved(runs, repeats).items():
                times[route].append(seconds)
    return RouteCosts(
        engine.state.route_key(config),
        device_name(target),
        list(lengths),
        times["handoff"],
        times["native"],
        PROMPT_TOKENS,
        "length" if device.type == "cuda" else "flops",
    )


def _timing_config(config, route: str, tokens: int, generator) -> HandoffConfig:
    """`config` forced to `route`, for random ids of `tokens` context tokens. What a request's
    config holds of its own request is replaced by the same kind of work on the random ids: no
    words (a request's config arrives resolved to whole_words=True, which a cache without words
    refuses; words move which tokens are refreshed, not how much work that is) and, for given
    scores, random scores of this length (given scores cost nothing to select by); a native head
    longer than the length is cut to what the length holds. The costs stay filed under the request
    config's key."""
    if config.native_head is not None and config.native_head >= tokens:
        config = config.replace(native_head=tokens - 1)
    refresh = config.refresh
    if refresh is not None:
        changes = {}
        if config.wants_words:
            changes["whole_words"] = False
        if isinstance(refresh.by, GivenScores):
            changes["by"] = GivenScores(torch.rand(1, tokens, generator=generator))
        refresh = dataclasses.replace(refresh, **changes)
    return config.replace(refresh=refresh, route=route)


def _first_token(engine, config, source_kv, context, prompt, full) -> None:
    """One request's first token through the engine's state, as `HandoffEngine` runs it."""
    cache = BridgedCache(
        engine.bridge, source_kv, engine.target, context, config=config, source_model=engine.source,
        prompt_ids=prompt, engine=engine,
    )  # fmt: skip
    engine.generate(cache, full, torch.ones_like(full), max_new_tokens=1, do_sample=False, pad_token_id=0)


def _fastest_interleaved(runs: dict, repeats: int) -> dict:
    """On a CPU shared with other work: one warm-up of each run, then `repeats` rounds that run
    each once in turn; each run's fastest round (other work only ever adds time, and a load that
    changes during the timing weighs on both routes alike)."""
    for run in runs.values():
        run()
    seconds = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: min(times) for name, times in seconds.items()}


def _median_seconds(run, device, repeats: int) -> float:
    for _ in range(2):  # warm-ups: lazy initialisation; a shape's second request captures its graphs
        run()
    seconds = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
