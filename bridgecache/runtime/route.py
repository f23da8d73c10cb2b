"""The cost gate: hand a context off only where that reaches the first token sooner.

A handoff has a fixed cost (the source reading the prompt, launches, the native pass) that the
target's own prefill of a short context does not pay, so below some length on a given device
the target is faster reading the document itself. `HandoffConfig.route` picks the side:

    "auto"     (default) the handoff where it is expected to be faster, else the target's own
               prefill of the context (exact: every layer computed natively);
    "handoff"  always the handoff;     "native"  always the target's own prefill.

What "expected" rests on, in order:
1. `RouteCosts` measured on this device for this pair and configuration: seconds to the first
   token of both routes at a ladder of context lengths (`route_timing.measure_route_costs`,
   through the engine's own paths), interpolated in log-log. A `HandoffEngine` on CUDA measures
   the ladder's lengths up to a request's on its first request past what it has measured (none
   longer but the smallest: no memory the request would not need), and keeps them in
   `$BRIDGECACHE_HOME/route-costs/` for every later process on that device.
   On the CPU (compute-bound: time follows FLOPs) the engine times a few short calibration
   lengths once instead (`route_timing.CALIBRATION`), kept the same way, and `RouteCosts` with
   scale="flops" predicts other lengths affinely in each route's FLOPs between and beyond them:
   the fixed cost of a handoff (the source's reading, the translation, small matrix products)
   is measured, and the long contexts are never timed.
2. Otherwise FLOPs (no source model to time with, or nothing measured yet): the handoff's native
   work and the source's reading against the target's prefill of the context. With the default
   20% refresh it hands off at every length; a refresh of the whole context routes to the target.

The decision is made per cache before the source reads the prompt or anything is translated;
`BridgedCache.report()` gives `route` and `route_reason`.

Knows configs, model configs and the cost tables; runs no model (route_timing.py does).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

import torch

from bridgecache.files import replace_file, set_aside
from bridgecache.models.zoo import cache_root
from bridgecache.runtime.config import refresh_budget, resolve_native_layers
from bridgecache.runtime.report import handoff_flops, prefill_flops, reading_flops

__all__ = ["RouteCosts", "RouteDecision", "decide_route", "route_key", "load_costs", "save_costs"]

COSTS_FORMAT = 1  # bump when RouteCosts' fields change: older files are measured again
SCALES = ("length", "flops")  # RouteCosts.scale


@dataclass(frozen=True)
class RouteDecision:
    """route: "handoff" or "native" (the target's own prefill of the context); reason: why, in words."""

    route: str
    reason: str


@dataclass
class RouteCosts:
    """Seconds to the first token of both routes, measured at `lengths` context tokens (ascending)
    on `device`, for the setup `key` names (`route_key`). scale: how other lengths are predicted,
    "length" (log-log in the length: a launch-bound GPU) or "flops" (affine in each route's FLOPs:
    a compute-bound CPU, `predict`)."""

    key: str
    device: str
    lengths: list[int]
    handoff_s: list[float]
    native_s: list[float]
    prompt_tokens: int = 16
    scale: str = "length"
    format: int = COSTS_FORMAT

    def __post_init__(self):
        for name in ("lengths", "handoff_s", "native_s"):
            if not isinstance(getattr(self, name), list):
                raise TypeError(f"RouteCosts.{name}={getattr(self, name)!r}; expected a list")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.lengths):
            raise ValueError(f"RouteCosts.lengths={self.lengths}; expected context lengths >= 1 token")
        if self.scale not in SCALES:
            raise ValueError(f"RouteCosts.scale={self.scale!r}; expected one of {', '.join(SCALES)}")
        if not isinstance(self.key, str) or not isinstance(self.device, str):
            raise TypeError(f"RouteCosts key={self.key!r}, device={self.device!r}; expected strings")
        if not (len(self.lengths) == len(self.handoff_s) == len(self.native_s)):
            raise ValueError("RouteCosts: lengths, handoff_s and native_s differ in length")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError(f"RouteCosts.lengths={self.lengths}; expected ascending distinct lengths")
        for name in ("handoff_s", "native_s"):
            seconds = getattr(self, name)
            if not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in seconds):
                raise ValueError(f"RouteCosts.{name}={getattr(self, name)}; expected positive seconds")

    def predict(self, tokens: int, flops=None) -> tuple[float, float]:
        """(handoff, native) seconds at `tokens` context tokens: piecewise linear in log-log between
        measured lengths; outside them, the nearest measured length's times scaled by the
        length (the ratio of the two held). With scale="flops" and `flops` (n -> (the handoff's
        FLOPs, the target's prefill FLOPs) at n context tokens), above the first measured length
        each route's time is affine in its own FLOPs through the two measured lengths around
        `tokens` (the last two beyond them; never below the lower one's time)."""
        if self.scale == "flops" and flops is not None and len(self.lengths) > 1 and tokens > self.lengths[0]:
            return self._affine_in_flops(tokens, flops)
        n = max(1, tokens)
        xs = [math.log(x) for x in self.lengths]
        x = math.log(n)
        out = []
        for ys in (self.handoff_s, self.native_s):
            ys = [math.log(y) for y in ys]
            if len(xs) == 1 or x <= xs[0]:
                out.append(math.exp(ys[0] + x - xs[0]))
            elif x >= xs[-1]:
                out.append(math.exp(ys[-1] + x - xs[-1]))
            else:
                i = next(i for i in range(1, len(xs)) if x <= xs[i])
                w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
                out.append(math.exp(ys[i - 1] + w * (ys[i] - ys[i - 1])))
        return out[0], out[1]

    def _affine_in_flops(self, tokens: int, flops) -> tuple[float, float]:
        i = next((i for i in range(1, len(self.lengths)) if tokens <= self.lengths[i]), len(self.lengths) - 1)
        low, high, here = flops(self.lengths[i - 1]), flops(self.lengths[i]), flops(tokens)
        out = []
        for r, ys in enumerate((self.handoff_s, self.native_s)):
            span = high[r] - low[r]
            slope = max(0.0, (ys[i] - ys[i - 1]) / span) if span > 0 else 0.0
            out.append(ys[i - 1] + slope * max(0.0, here[r] - low[r]))
        return out[0], out[1]

    def covers(self, tokens: int) -> bool:
        """Whether `tokens` lies within the measured lengths (or below the smallest)."""
        return bool(self.lengths) and tokens <= self.lengths[-1]

    def merged(self, other: RouteCosts) -> RouteCosts:
        """These costs with `other`'s lengths added (other's times win where both measured)."""
        table = dict(zip(self.lengths, zip(self.handoff_s, self.native_s)))
        table.update(zip(other.lengths, zip(other.handoff_s, other.native_s)))
        lengths = sorted(table)
        return RouteCosts(
            self.key,
            self.device,
            lengths,
            [table[n][0] for n in lengths],
            [table[n][1] for n in lengths],
            self.prompt_tokens,
            other.scale,
        )


def route_key(bridge, source, target, config) -> str:
    """What the costs depend on, hashed: the device and its software, both models' shapes and
    dtypes and attention implementations, and the parts of the config that change the work."""
    parts = {"torch": torch.__version__, "device": device_name(target)}
    for role, model, spec in (("source", source, bridge.source), ("target", target, bridge.target)):
        spec = spec.to_dict()
        spec.pop("name", None)
        spec.pop("tokenizer", None)
        weight = None if model is None else model.get_input_embeddings().weight
        implementation = None if model is None else getattr(model.config, "_attn_implementation", None)
        dtype = str(getattr(weight, "dtype", None))
        parts[role] = {"spec": spec, "dtype": dtype, "attention": implementation}
    parts["method"] = bridge.method
    parts["config"] = [config.kv_recipe, config.one_launch, config.cuda_graphs]
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def device_name(model) -> str:
    """The model's device in words: "NVIDIA H100 80GB HBM3 (cuda:0)", "cpu"."""
    device = model.get_input_embeddings().weight.device
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return device.type


def costs_path(key: str) -> Path:
    return cache_root() / "route-costs" / f"{key}.json"


def load_costs(key: str) -> RouteCosts | None:
    """The costs saved under `key`, or None (none saved, another format, or damaged).

    A file that is not a cost table of this format for this key (cut short, a JSON list, a
    length that is a string, a time that is NaN) is set aside as `<key>.json.bad-<time>` with a
    DamagedFileWarning: the costs are measured (or estimated) again, never trusted, and the next
    handoff does not trip on the same file."""
    path = costs_path(key)
    try:
        if path.stat().st_size > _MAX_COSTS_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes; a cost table is a few kB")
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as err:
        set_aside(path, f"{type(err).__name__}: {str(err)[:120]}")
        return None
    if isinstance(data, dict) and _another_version(data):
        return None  # another bridgecache's table (its format or fields): measured again and replaced
    problem = _costs_problem(data, key)
    if problem is None:
        try:
            return RouteCosts(**data)
        except ValueError as err:  # ascending lengths, positive finite seconds
            problem = str(err)
    set_aside(path, problem)
    return None


_MAX_COSTS_BYTES = 1 << 20


def _costs_problem(data, key: str) -> str | None:
    """Why `data` is not the JSON of a RouteCosts for `key` (None: it is)."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    fields = RouteCosts.__dataclass_fields__.values()
    missing = {f.name for f in fields if f.default is MISSING} - set(data)
    if missing:
        return f"no {', '.join(sorted(missing))}"
    if data["key"] != key:
        return f"key {str(data['key'])[:40]!r}, not {key!r}"
    if not isinstance(data["device"], str):
        return "'device' is not a text"
    if not _is_count(data.get("prompt_tokens", 1)):
        return "'prompt_tokens' is not a count"
    for name, valid in (("lengths", _is_count), ("handoff_s", _is_number), ("native_s", _is_number)):
        values = data[name]
        if not isinstance(values, list) or not values or not all(valid(v) for v in values):
            return f"'{name}' is not a non-empty list of {'counts' if name == 'lengths' else 'seconds'}"
    return None


def _another_version(data: dict) -> bool:
    """A table another bridgecache wrote: another format number, or fields this one does not know."""
    version = data.get("format")
    other_format = version != COSTS_FORMAT and isinstance(version, int) and not isinstance(version, bool)
    return other_format or not set(data) <= set(RouteCosts.__dataclass_fields__)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def save_costs(costs: RouteCosts) -> Path:
    """Write `costs` atomically (a reader sees the old file or the new one, never a part; a
    failure half-way leaves nothing under the final name)."""
    path = costs_path(costs.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    return replace_file(path, json.dumps(asdict(costs), indent=1))


def decide_route(
    config, costs: RouteCosts | None, *, tokens: int, prompt_tokens: int, models
) -> RouteDecision:
    """The route of one cache of `tokens` context tokens (its longest row).

    config: the HandoffConfig; costs: measured costs of this setup, or None; models: (bridge,
    source config or None, target config) for the FLOP estimate.
    """
    if config.route != "auto":
        return RouteDecision(config.route, f"HandoffConfig(route={config.route!r})")
    bridge, source_config, target_config = models
    if costs is not None:
        flops = None
        if costs.scale == "flops":
            flops = lambda n: estimated_flops(  # noqa: E731
                config, bridge, source_config, target_config, n, costs.prompt_tokens
            )
        handoff, native = costs.predict(tokens, flops)
        where = "measured" if costs.covers(tokens) else f"extrapolated from {costs.lengths[-1]} tokens"
        if costs.scale == "flops":
            where += f" ({', '.join(map(str, costs.lengths))} tokens timed, scaled by FLOPs)"
        route = "handoff" if handoff <= native else "native"
        return RouteDecision(
            route,
            f"{where} on {costs.device}: at {tokens} context tokens the handoff takes "
            f"{handoff * 1e3:.1f} ms to the first token, the target's own prefill {native * 1e3:.1f} ms",
        )
    work, whole = estimated_flops(config, bridge, source_config, target_config, tokens, prompt_tokens)
    route = "handoff" if work < whole else "native"
    return RouteDecision(
        route,
        f"estimated from FLOPs (no costs measured for this setup on this device): the handoff's "
        f"own work is {work / max(whole, 1.0):.0%} of the target's prefill of {tokens} tokens",
    )


def estimated_flops(config, bridge, source_config, target_config, tokens: int, prompt_tokens: int):
    """(the handoff's FLOPs, the target's prefill FLOPs) of a `tokens`-token context: the target's
    native work (head, native layers, refreshed tokens) and the source reading the prompt."""
    layers = target_config.get_text_config().num_hidden_layers
    whole = prefill_flops(target_config, tokens)
    refresh = config.refresh if bridge.method != "identity" else None
    # a refresh sized by the scores' mass (RefreshConfig.mass) is estimated at its cap, `amount`
    refreshed = refresh_budget(refresh.amount, tokens) if refresh is not None else 0
    native = tuple(resolve_native_layers(config.native_layers, layers))
    work = handoff_flops(
        target_config,
        context_tokens=tokens,
        prefix=max(0, tokens - 1),
        native_prefix=min(tokens, config.native_head or 1),
        native_layers=native,
        refreshed=refreshed,
    )
    if refresh is not None and refresh.by == "source" and source_config is not None:
        work += reading_flops(source_config, max(1, prompt_tokens), tokens)
    return work, whole
