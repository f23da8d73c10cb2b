"""The handoff flags of every command that hands a context over (eval, demo): one `HandoffConfig`.

add_handoff_arguments(parser)   --native-head --native-tail --no-key-norm --native-layers
                                --refresh --refresh-by --min-quality
handoff_config(args)            -> HandoffConfig (defaults: HandoffConfig()'s own)
"""

from __future__ import annotations

import argparse

from bridgecache.runtime.config import DEFAULT_REFRESH, HandoffConfig, QualityPolicy, RefreshConfig

__all__ = ["add_handoff_arguments", "handoff_config", "native_layers_arg"]

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
    """A fraction in (0, 1] (has a point), a token count, or none."""
    if text == "none":
        return None
    try:
        value = float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a fraction like 0.15, a token count, or none"
        ) from None
    if value == 0:
        return None
    if value < 0 or (isinstance(value, float) and value > 1):
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction lies in (0, 1]; a count is >= 1")
    return value


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
        "--min-quality",
        type=float,
        help="quality gate: layers whose held-out score is below it run natively; too many fall back",
    )


def handoff_config(args) -> HandoffConfig:
    """The HandoffConfig the flags of `add_handoff_arguments` describe (ValueError if invalid)."""
    refresh = None if args.refresh is None else RefreshConfig(args.refresh, args.refresh_by)
    return HandoffConfig(
        native_head=args.native_head,
        native_tail=args.native_tail,
        key_norm=not args.no_key_norm,
        native_layers=args.native_layers,
        refresh=refresh,
        quality=QualityPolicy(args.min_quality),
    )
