"""Checks of one configuration field where it enters: exact types, then bounds.

    flag(value, "HandoffConfig.key_norm")                    True or False, nothing else
    flag(value, "HandoffConfig.one_launch", optional=True)   None, True or False
    count(value, "HandoffConfig.native_tail")                an int >= 0 (an int-like numpy scalar too)
    real(value, "QualityPolicy.min_coverage", 0.0, 1.0)      a finite real in [low, high]

A wrong type raises `FieldTypeError`: a TypeError (what it is), and a ValueError too, so code
that caught the ValueError these checks raised before still catches it. A wrong value of the
right type raises ValueError. Every message names the field, the value and what was expected:
a string "false" from a config file is refused, never read as true.

Knows nothing about models, caches or the configs that call it.
"""

from __future__ import annotations

import math
import operator

from bridgecache.checks import FieldTypeError  # the boundary's type error (bridgecache.checks)

__all__ = ["FieldTypeError", "count", "flag", "real"]


def flag(value, name: str, *, optional: bool = False):
    """`value` if it is True or False (or None with `optional`); else FieldTypeError."""
    if value is True or value is False or (optional and value is None):
        return value
    expected = "None, True or False" if optional else "True or False"
    raise FieldTypeError(f"{name}={value!r}; expected {expected}, not a {type(value).__name__}")


def count(value, name: str, *, low: int = 0, what: str = "a count") -> int:
    """`value` as an int if it is an integer (not a bool) >= `low`; FieldTypeError for another
    type, ValueError below `low`."""
    if isinstance(value, (bool, float)):
        raise FieldTypeError(f"{name}={value!r}; expected {what} >= {low}, not a {type(value).__name__}")
    try:
        number = operator.index(value)
    except TypeError:
        raise FieldTypeError(
            f"{name}={value!r}; expected {what} >= {low}, not a {type(value).__name__}"
        ) from None
    if number < low:
        raise ValueError(f"{name}={number}; expected {what} >= {low}")
    return number


def real(value, name: str, low: float | None = None, high: float | None = None) -> float:
    """`value` as a float if it is a finite int or float (not a bool) in [low, high]."""
    bounds = (
        "a finite number"
        + (f" >= {low}" if low is not None else "")
        + (f" <= {high}" if high is not None else "")
    )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldTypeError(f"{name}={value!r}; expected {bounds}, not a {type(value).__name__}")
    number = float(value)
    if (
        not math.isfinite(number)
        or (low is not None and number < low)
        or (high is not None and number > high)
    ):
        raise ValueError(f"{name}={value!r}; expected {bounds}")
    return number
