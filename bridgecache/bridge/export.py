"""Ship a fitted bridge inside the package: float16/bfloat16 maps plus the zoo's fingerprints.

Knows bridges and the zoo; what a shipped bridge is and how it loads is bridgecache.bridge.builtin.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bridgecache.bridge import builtin
from bridgecache.bridge.builtin import PREFIX, zoo_fingerprint
from bridgecache.bridge.maps import Bridge, LayerMap
from bridgecache.models.zoo import BUILTIN_MODELS

__all__ = ["export_builtin"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_MAPS = ("key_weight", "key_bias", "value_weight", "value_bias")


def export_builtin(
    source_dir: str | Path, name: str | None = None, dtype: str = "float16", root: str | Path | None = None
) -> Path:
    """Write a fitted bridge directory as a shipped bridge: `dtype` tensors + zoo fingerprints.

    The bridge must be fitted between two zoo models by their zoo names (as `bridgecache fit
    --source NAME --target NAME` records them) with their tokenizers. Returns the new directory.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_DTYPES)}")
    bridge = Bridge.from_pretrained(source_dir)
    name = (name or f"{bridge.source.name}->{bridge.target.name}").removeprefix(PREFIX)
    expected = f"{bridge.source.name}->{bridge.target.name}"
    if name != expected:
        raise ValueError(f"{source_dir}: a bridge {expected} cannot be shipped as {name!r}")
    fingerprints = {}
    for role, spec in (("source", bridge.source), ("target", bridge.target)):
        if spec.name not in BUILTIN_MODELS:
            raise ValueError(
                f"{source_dir}: {role} model {spec.name!r} is not a zoo model ({', '.join(BUILTIN_MODELS)}); "
                "only bridges between built-in models can be shipped"
            )
        if not spec.tokenizer:
            raise ValueError(
                f"{source_dir}: the {role} spec has no tokenizer fingerprint; fit with tokenizers"
            )
        fingerprints[role] = {
            "zoo": spec.name,
            "gguf": zoo_fingerprint(spec.name),
            "tokenizer": spec.tokenizer,
        }
    layers = [
        LayerMap(
            source_layers=list(layer.source_layers),
            inputs=layer.inputs,
            **{name: _cast(getattr(layer, name), dtype, f"layers.{i}.{name}") for name in _MAPS},
            r2_key=layer.r2_key,
            r2_value=layer.r2_value,
        )
        for i, layer in enumerate(bridge.layers)
    ]
    calibration = {**bridge.calibration, "fingerprints": fingerprints, "stored_dtype": dtype}
    if "recipe" not in calibration:  # fitted before recipes were recorded: rebuild it
        from bridgecache.bridge.recipe import infer_recipe

        calibration["recipe"] = infer_recipe(bridge)
        calibration["recipe_rebuilt"] = "from the calibration record, at export (fitted before recipes)"
    shipped = Bridge(
        source=bridge.source,
        target=bridge.target,
        method=bridge.method,
        alignment_policy=bridge.alignment_policy,
        layers=layers,
        native_head=bridge.native_head,
        calibration=calibration,
    )
    out = Path(root or builtin.builtin_root()) / name.replace("->", "--")
    return shipped.save_pretrained(out)


def _cast(t: torch.Tensor, dtype: str, name: str) -> torch.Tensor:
    out = t.to(_DTYPES[dtype])
    if not torch.isfinite(out).all():  # float16 tops out at 65504: never ship an inf
        raise ValueError(
            f"{name} does not fit in {dtype} (largest |value| {float(t.abs().max()):.3g}); "
            "export with --dtype bfloat16"
        )
    return out
