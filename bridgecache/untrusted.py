"""Text read from files, made safe to show: no terminal escapes, no unbounded messages.

    printable(spec.name)            control characters escaped (ESC -> \\x1b), bidi overrides too
    printable(report, lines=True)   the same, keeping line breaks
    shown(value)                    a short repr for error messages (60 characters, then ...)
    all_finite(tensor)              no NaN or Inf in a tensor read from a file (one cheap pass)

A bridge or KV file is data from anywhere: a name holding ESC sequences would reach the user's
terminal through `print`, and a value of megabytes would make an error message of megabytes.
Everything bridgecache prints or puts in a message from a file goes through these.

Knows nothing about bridges or caches.
"""

from __future__ import annotations

import math
import re
import reprlib

import torch

__all__ = ["all_finite", "printable", "shown"]

# C0 and C1 controls, DEL, zero-width and bidirectional formatting characters.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
_UNSAFE_KEEP_LINES = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def printable(text, limit: int | None = None, *, lines: bool = False) -> str:
    """`text` with every control or formatting character escaped; cut after `limit` characters."""
    text = str(text)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}... ({len(text):,} characters)"
    pattern = _UNSAFE_KEEP_LINES if lines else _UNSAFE
    return pattern.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def shown(value, limit: int = 60) -> str:
    """repr(value), escaped and cut to about `limit` characters: for error messages. Never builds
    the whole repr of a large container (a list of millions of entries costs nothing here)."""
    short = reprlib.Repr()  # keyword arguments only from Python 3.12
    short.maxlevel, short.maxlist, short.maxtuple, short.maxdict = 3, 8, 8, 4
    short.maxstring = short.maxother = short.maxlong = limit
    text = short.repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return printable(text)


def all_finite(t: torch.Tensor) -> bool:
    """True if `t` holds no NaN or Inf: one float64 sum (NaN and Inf survive it; no float16,
    bfloat16 or float32 tensor can overflow it), about 5x cheaper than `isfinite(t).all()`."""
    return math.isfinite(float(t.sum(dtype=torch.float64)))
