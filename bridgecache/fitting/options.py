"""Checks of fitting options, run before any model is loaded or any sequence is read.

`check_fit_options(...)` raises ValueError naming the option, the value given and what is
expected; `fit_bridge` and `bridgecache fit` both call it, so a bad option costs nothing.
`check_model_reference(name)` says whether a model argument can possibly load (a built-in
name, an existing model directory, or a string shaped like a hub id).

Knows option names and ranges; nothing about models or statistics.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from tokenalign import POLICIES

__all__ = ["check_fit_options", "check_model_reference"]

METHODS = ("fullhead", "cachebridge")
DOMAINS = ("prose", "code", "mixed")
STATS_PRECISIONS = ("tf32x3", "tf32", "bf16")  # bridgecache.kernels.stats.PRECISIONS
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_fit_options(
    *,
    method: str = "cachebridge",
    num_sequences: int = 32,
    seq_len: int = 256,
    domain: str = "prose",
    layers_k: int | None = None,
    lam: float = 1e-2,
    alignment_policy: str | None = None,
    native_head: int = 1,
    heldout_every: int = 8,
    source_layers: int | None = None,
    stats_precision: str = "tf32x3",
) -> None:
    """Raise ValueError for the first option outside its range (names as in `fit_bridge`)."""
    if method not in METHODS:
        _bad("method", method, f"one of {METHODS}")
    _int_at_least("num_sequences", num_sequences, 2, "one sequence is held out to score the maps")
    _int_at_least("native_head", native_head, 0)
    _int_at_least("seq_len", seq_len, native_head + 2, f"native_head={native_head} positions are not fitted")
    if domain not in DOMAINS:
        _bad("domain", domain, f"one of {DOMAINS}")
    if layers_k is not None:
        _int_at_least("layers_k", layers_k, 1)
        if source_layers is not None and layers_k > source_layers:
            _bad("layers_k", layers_k, f"at most the source model's {source_layers} layers")
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam <= 0:
        _bad("lam", lam, "a finite number > 0 (ridge strength relative to the data scale)")
    if alignment_policy is not None and alignment_policy not in POLICIES:
        _bad("alignment_policy", alignment_policy, f"one of {POLICIES}")
    _int_at_least("heldout_every", heldout_every, 1)
    if stats_precision not in STATS_PRECISIONS:
        expected = f"one of {STATS_PRECISIONS} (benchmarks/reports/gpu-kernels.md)"
        _bad("stats_precision", stats_precision, expected)


def check_model_reference(name: str, builtin_names) -> str | None:
    """None if `name` may load (built-in, model directory, hub-id-shaped); else the reason."""
    if name in builtin_names:
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            return f"{name!r} is a directory without config.json (not a saved transformers model)"
        return None
    if path.exists():
        return f"{name!r} is a file; expected a model directory"
    if _HUB_ID.match(name) and ".." not in name:
        return None
    return (
        f"{name!r} is neither a built-in name ({', '.join(builtin_names)}), an existing model "
        "directory, nor a hub id like 'Qwen/Qwen2.5-0.5B'"
    )


def _int_at_least(name: str, value, low: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _bad(name, value, f"an integer >= {low}" + (f" ({why})" if why else ""))


def _bad(name: str, value, expected: str) -> None:
    raise ValueError(f"{name} is {value!r}; expected {expected}")
