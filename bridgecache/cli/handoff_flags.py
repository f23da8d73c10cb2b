"""The handoff flags of every command that hands a context over (eval, demo): one `HandoffConfig`.

add_handoff_arguments(parser)   --native-head --native-tail --no-key-norm --native-layers
                                --refresh --refresh-by --refresh-mass --refresh-floor
                                --[no-]whole-words --[no-]word-ends --min-quality --route
handoff_config(args)            -> HandoffConfig (defaults: HandoffConfig()'s own)
"""

from __future__ import annotations

import argparse
import math

from bridgecache.runtime.config import DEFAULT_REFRESH, ROUTES, HandoffConfig, QualityPolicy, RefreshConfig

__all__ = ["add_handoff_arguments", "config_problem", "handoff_config", "native_layers_arg"]

_DEFAULT = HandoffConfig()


def native_layers_arg(text: str):
    """N, L+L+..., or all -> HandoffConfig.native_layers."""
    if text == "all":
        return text
    try:
        return tuple(int(x) for x in text.split("+")) if "+" in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N, a set like 0+1+17, or all") from None


def _refresh(text: str):
    """A fraction (has a point), a token count, or none (ranges are checked by handoff_config)."""
    if text == "none":
        return None
    try:
        return float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        expected = "a fraction like 0.15, a token count, or none"
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None


def add_handoff_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a HandoffConfig, with its defaults."""
    group = parser.add_argument_group("handoff (what the target computes itself; default: HandoffConfig())")
    group.add_argument(
        "--native-head", type=int, help="context tokens the target computes first (default: the bridge's)"
    )
    group.add_argument(
        "--native-tail",
        type=int,
        default=_DEFAULT.native_tail,
        help="context tokens before the held-back one that the target reads itself",
    )
    group.add_argument(
        "--no-key-norm", action="store_true", help="do not put mapped keys on the norm of the target's k_norm"
    )
    group.add_argument(
        "--native-layers",
        type=native_layers_arg,
        help="target layers computed natively over the whole context: N (the first N), 0+1+17, or all",
    )
    group.add_argument(
        "--refresh",
        type=_refresh,
        default=DEFAULT_REFRESH,
        help=f"context tokens the target recomputes: a fraction (default {DEFAULT_REFRESH}), a count or none",
    )
    group.add_argument(
        "--refresh-by",
        choices=["source", "deviation"],
        default="source",
        help="source (default): the tokens the source's attention from the question picks out; "
        "deviation: translated vs native keys at layer 1 (CacheBlend's rule)",
    )
    group.add_argument(
        "--refresh-mass",
        type=float,
        help="size the refresh per request: the fewest tokens holding this share in (0, 1) of the "
        "selection scores' mass, at most --refresh (default: a fixed --refresh)",
    )
    group.add_argument(
        "--refresh-floor",
        type=_refresh,
        default=RefreshConfig().floor,
        help="with --refresh-mass, the fewest tokens refreshed: a fraction "
        f"(default {RefreshConfig().floor}) or a count",
    )
    group.add_argument(
        "--whole-words",
        action=argparse.BooleanOptionalAction,
        help="a refreshed token brings the rest of its word or number with it (both tokenizations); "
        "the default, as every command here knows the context's text; --no-whole-words: token by token",
    )
    group.add_argument(
        "--word-ends",
        action=argparse.BooleanOptionalAction,
        default=RefreshConfig().word_ends,
        help="with whole words, each refreshed word also brings the token after it, so a refreshed "
        "number ends where the context ends it (the default; no effect token by token)",
    )
    group.add_argument(
        "--route",
        choices=ROUTES,
        default=_DEFAULT.route,
        help="auto (default): hand off only where that reaches the first token sooner than the "
        "target's own prefill (timed once per device, pair and config; on the CPU at short lengths, "
        "scaled by FLOPs); handoff or native: always that side",
    )
    group.add_argument(
        "--min-quality",
        type=float,
        help="quality gate: layers whose held-out score is below it run natively; too many fall back",
    )


def handoff_config(args) -> HandoffConfig:
    """The HandoffConfig the flags of `add_handoff_arguments` describe (ValueError naming the flag
    when one is out of range)."""
    for flag, value in (("--native-head", args.native_head), ("--native-tail", args.native_tail)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} is {value}; expected an integer >= 0")
    amount = args.refresh
    if amount == 0:
        amount = None
    if amount is not None and not (0 < amount <= 1 if isinstance(amount, float) else amount >= 1):
        raise ValueError(
            f"--refresh is {amount}; expected a share of the context in (0, 1], a token count or none"
        )
    mass, floor = getattr(args, "refresh_mass", None), getattr(args, "refresh_floor", RefreshConfig().floor)
    if mass is not None and not 0 < mass < 1:  # NaN too
        raise ValueError(f"--refresh-mass is {mass}; expected a share of the scores in (0, 1)")
    if floor is None or (floor < 0 or isinstance(floor, float) and floor > 1):
        raise ValueError(f"--refresh-floor is {floor}; expected a fraction in [0, 1] or a token count")
    refresh = (
        None
        if amount is None
        else RefreshConfig(amount, args.refresh_by, args.whole_words, args.word_ends, mass=mass, floor=floor)
    )
    quality = args.min_quality
    if quality is not None and not (math.isfinite(quality) and quality <= 1):
        raise ValueError(
            f"--min-quality is {quality}; expected a finite number (a held-out score, at most 1)"
        )
    return HandoffConfig(
        native_head=args.native_head,
        native_tail=args.native_tail,
        key_norm=not args.no_key_norm,
        native_layers=args.native_layers,
        refresh=refresh,
        quality=QualityPolicy(args.min_quality),
        route=getattr(args, "route", _DEFAULT.route),
    )


def config_problem(config: HandoffConfig, bridge) -> str | None:
    """The first setting of `config` that cannot work with `bridge`'s target, in words (None if
    none): checked before any model loads."""
    from bridgecache.runtime.native_work.layers import resolve_native_layers

    limit = bridge.target.max_position_embeddings
    if config.native_head is not None and config.native_head > limit:
        head = config.native_head
        return f"--native-head is {head}; expected an integer in [0, {limit}] (the target's positions)"
    try:
        resolve_native_layers(config.native_layers, bridge.target.num_layers)
    except ValueError as err:
        return f"--native-layers: {err}"
    return None
