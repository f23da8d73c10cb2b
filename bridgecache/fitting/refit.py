"""Fit a bridge again from the recipe it records (`bridgecache fit --recipe`).

Knows fit_bridge's arguments; the recipe itself is described by bridgecache.bridge.recipe.
"""

from __future__ import annotations

from bridgecache.bridge.recipe import RecipeError
from bridgecache.fitting.fit import fit_bridge

__all__ = ["refit"]


def refit(recipe: dict, source, target, source_tokenizer, target_tokenizer, **overrides):
    """Fit a Bridge again from `recipe` on the given models; `overrides` replace recipe entries."""
    args = {**recipe, **overrides}
    unknown = set(overrides) - set(recipe) - {"progress"}
    if unknown:
        raise RecipeError(f"overrides {sorted(unknown)} are not recipe entries ({sorted(recipe)})")
    source_name, target_name = args.pop("source"), args.pop("target")
    return fit_bridge(
        source,
        target,
        source_tokenizer,
        target_tokenizer,
        source_name=source_name,
        target_name=target_name,
        **args,
    )
