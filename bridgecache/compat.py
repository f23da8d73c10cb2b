"""Differences between the transformers 5.x releases we support (5.17 .. 5.24+).

transformers 5.24 renamed the `past_key_values` keyword of model forward() and generate() to
`cache` (the old name warns until 5.40 / 6.0). We pass whichever name the installed version
takes, so neither version warns.
"""

from __future__ import annotations

import inspect
from functools import cache

__all__ = ["cache_kwargs", "cache_keyword"]


@cache
def _keyword_for(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_keyword(model) -> str:
    """'cache' on transformers >= 5.24, else 'past_key_values'."""
    return _keyword_for(type(model).forward)


def cache_kwargs(model, cache) -> dict:
    """{keyword: cache} for model(...) and model.generate(...)."""
    return {cache_keyword(model): cache}
