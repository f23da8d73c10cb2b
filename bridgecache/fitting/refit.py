"""Fit a bridge again from the recipe it records (`bridgecache fit --recipe`).

The recipe reads back into a `FitConfig` (bridgecache.bridge.recipe); the models are the caller's.
"""

from __future__ import annotations

import dataclasses

from bridgecache.bridge.recipe import FitConfig, RecipeError
from bridgecache.fitting.fit import fit_bridge

__all__ = ["refit"]

_FIELDS = tuple(f.name for f in dataclasses.fields(FitConfig))


def refit(recipe: dict, source, target, source_tokenizer, target_tokenizer, *, progress=True, **overrides):
    """Fit a Bridge again from `recipe` on the given models; `overrides` (FitConfig fields)
    replace the recipe's values, e.g. `num_sequences=4` for a quick slice."""
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise RecipeError(
            f"overrides {unknown} are not recipe entries (FitConfig fields: {', '.join(_FIELDS)})"
        )
    config = FitConfig.from_recipe(recipe).replace(**overrides)
    return fit_bridge(
        source,
        target,
        source_tokenizer,
        target_tokenizer,
        config,
        progress=progress,
        source_name=recipe["source"],
        target_name=recipe["target"],
    )
