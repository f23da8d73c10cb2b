"""A bridge's recipe: the exact `fit_bridge` arguments it was made with.

`fit_bridge` records `calibration["recipe"]` (model names, method, calibration size, domain, seed,
every solver setting). `bridgecache.fitting.refit.refit` fits again from it, optionally overriding
some (e.g. fewer sequences for a quick check); `recipe_command` writes the equivalent command line.
Knows fitting's arguments; nothing about files.
"""

from __future__ import annotations

import shlex

__all__ = ["RecipeError", "recipe_of", "infer_recipe", "recipe_command"]

# recipe key -> `bridgecache fit` option (the keys with no option keep fit_bridge's default).
_OPTIONS = {
    "source": "--source",
    "target": "--target",
    "method": "--method",
    "num_sequences": "--calib-seqs",
    "seq_len": "--seq-len",
    "layers_k": "--layers-k",
    "layer_support": "--layer-support",
    "weighting": "--weighting",
    "domain": "--domain",
    "alignment_policy": "--alignment-policy",
    "key_scale": "--key-scale",
    "stats_precision": "--stats-precision",
    "lam": "--lam",
    "native_head": "--native-head",
    "seed": "--seed",
}


class RecipeError(ValueError):
    """A bridge records no recipe (an identity bridge, or fitted before recipes were recorded)."""


def recipe_of(bridge) -> dict:
    """The recorded fit arguments of `bridge` (a copy)."""
    recipe = bridge.calibration.get("recipe")
    if not recipe:
        raise RecipeError(
            f"bridge {bridge.source.name} -> {bridge.target.name} ({bridge.method}) records no fit "
            "recipe: it was not made by fit_bridge, or by a bridgecache older than recipes"
        )
    return dict(recipe)


def infer_recipe(bridge) -> dict:
    """The recipe of a bridge fitted before recipes were recorded, rebuilt from its calibration record.

    Every setting that decides the maps is in that record (resolved: `layers_k` and `weighting`
    hold the values the method defaults gave); `probe_subset` and `identity_if_same` were never
    recorded and take `bridgecache fit`'s values (16, True).
    """
    calib = bridge.calibration
    needed = ("num_sequences", "seq_len", "domain", "seed", "heldout_every", "layers_k", "layer_support")
    needed += ("lam", "weighting", "key_scale")
    missing = [key for key in needed if key not in calib]
    if missing or bridge.method not in ("fullhead", "cachebridge"):
        raise RecipeError(
            f"bridge {bridge.source.name} -> {bridge.target.name} ({bridge.method}): its calibration "
            f"record lacks {missing or 'a fitted method'}, so its recipe cannot be rebuilt; fit it again"
        )
    return {
        "source": bridge.source.name,
        "target": bridge.target.name,
        "method": bridge.method,
        **{key: calib[key] for key in needed},
        "alignment_policy": None if bridge.alignment_policy == "identity" else bridge.alignment_policy,
        "native_head": bridge.native_head,
        "boundaries": calib.get("boundaries") or _FIT_DEFAULTS["boundaries"],
        "probe_subset": _FIT_DEFAULTS["probe_subset"],
        "identity_if_same": True,
    }


def recipe_command(recipe: dict, out: str = "DIR") -> str:
    """The `bridgecache fit` command that makes this recipe (options only where they are needed)."""
    words = ["bridgecache", "fit"]
    for key, option in _OPTIONS.items():
        if recipe.get(key) is not None:
            words += [option, str(recipe[key])]
    extra = {k: v for k, v in recipe.items() if k not in _OPTIONS and _FIT_DEFAULTS.get(k, v) != v}
    words += ["--out", out]
    command = shlex.join(words)
    return command + (f"  # with fit_bridge({_kwargs(extra)})" if extra else "")


# Recipe entries that `bridgecache fit` has no option for but always passes at these values.
_FIT_DEFAULTS = {"heldout_every": 8, "boundaries": 32, "probe_subset": 16, "identity_if_same": True}


def _kwargs(extra: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(extra.items()))
