"""Validation of a bridge's metadata file (`bridge.json`): every field's type and range.

`check_bridge_json(meta, path)` raises `BridgeFormatError` naming the file, the field (as a
dotted path: `target.num_layers`, `layers[3].r2_key`) and what was expected, before any of the
values reach a `Bridge`. The tensors themselves (shapes, dtypes, checksums) are checked against
this metadata by `bridgecache.bridge.maps`.

Knows the JSON layout of a bridge; nothing about tensors, models or tokenizers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from tokenalign import POLICIES

__all__ = ["ALIGNMENT_POLICIES", "METHODS", "BridgeFormatError", "check_bridge_json"]

ALIGNMENT_POLICIES = ("identity", *POLICIES)
METHODS = ("fullhead", "cachebridge", "identity")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


class BridgeFormatError(ValueError):
    """A bridge directory is missing, truncated, corrupted or inconsistent with its metadata."""


def check_bridge_json(meta: dict, path: Path) -> None:
    """Raise BridgeFormatError unless every field of a bridge.json has its type and range."""
    fail = _failer(path)
    for key in ("source", "target", "method", "alignment_policy", "native_head", "calibration", "layers"):
        if key not in meta:
            raise BridgeFormatError(f"{path}: field {key!r} is missing")
    if "tensors" not in meta:
        raise BridgeFormatError(f"{path}: field 'tensors' is missing")
    for role in ("source", "target"):
        _check_spec(meta[role], role, fail)
    if meta["method"] not in METHODS:
        fail("method", meta["method"], f"one of {METHODS}")
    if meta["alignment_policy"] not in ALIGNMENT_POLICIES:
        fail("alignment_policy", meta["alignment_policy"], f"one of {ALIGNMENT_POLICIES}")
    if not _is_int(meta["native_head"]) or meta["native_head"] < 0:
        fail("native_head", meta["native_head"], "an integer >= 0")
    if not isinstance(meta["calibration"], dict):
        fail("calibration", meta["calibration"], "an object")
    _check_layers(meta["layers"], meta["target"]["num_layers"], meta["source"]["num_layers"], fail)
    _check_tensor_table(meta["tensors"], fail)
    if "refinement" in meta:
        fail(
            "refinement",
            "a trained refinement",
            "no 'refinement' block: trained refinements (bridgecache refine) were removed after they "
            "measured no gain; load the closed-form bridge they were refined from",
        )
    fingerprints = meta.get("fingerprints", {})
    if not isinstance(fingerprints, dict):
        fail("fingerprints", fingerprints, "an object")
    for role, value in fingerprints.items():
        if role not in ("source", "target") or not (value is None or isinstance(value, str)):
            fail(f"fingerprints.{role}", value, "a string (or null) for 'source' and 'target'")


def _check_spec(spec, role: str, fail) -> None:
    if not isinstance(spec, dict):
        fail(role, spec, "an object describing a model")
    positive = (
        "num_layers",
        "num_kv_heads",
        "num_q_heads",
        "head_dim",
        "hidden_size",
        "max_position_embeddings",
    )
    for key in positive:
        if key not in spec:
            raise BridgeFormatError(f"{fail.path}: field '{role}.{key}' is missing")
        if not _is_int(spec[key]) or spec[key] < 1:
            fail(f"{role}.{key}", spec[key], "an integer >= 1")
    for key in ("model_type", "rope"):
        if not isinstance(spec.get(key), str):
            fail(f"{role}.{key}", spec.get(key), "a string")
    for key in ("name", "tokenizer"):
        if not isinstance(spec.get(key, ""), str):
            fail(f"{role}.{key}", spec[key], "a string")
    types = spec.get("layer_types")
    if (
        not isinstance(types, list)
        or len(types) != spec["num_layers"]
        or any(t not in _LAYER_TYPES for t in types)
    ):
        fail(f"{role}.layer_types", types, f"a list of {spec['num_layers']} of {_LAYER_TYPES}")
    window = spec.get("sliding_window")
    if window is not None and (not _is_int(window) or window < 1):
        fail(f"{role}.sliding_window", window, "null or an integer >= 1")
    bos = spec.get("bos_token_id")
    if bos is not None and (not _is_int(bos) or bos < 0):
        fail(f"{role}.bos_token_id", bos, "null or an integer >= 0")


def _check_layers(layers, num_target_layers: int, num_source_layers: int, fail) -> None:
    if not isinstance(layers, list) or len(layers) != num_target_layers:
        fail("layers", layers, f"a list of {num_target_layers} layer entries (one per target layer)")
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict):
            fail(f"layers[{i}]", entry, "an object")
        for key in ("source_layers", "inputs", "r2_key", "r2_value"):
            if key not in entry:
                raise BridgeFormatError(f"{fail.path}: layers[{i}]: field {key!r} is missing")
        src = entry["source_layers"]
        if not isinstance(src, list) or not all(_is_int(s) and 0 <= s < num_source_layers for s in src):
            fail(
                f"layers[{i}].source_layers",
                src,
                f"a list of source layer indices in [0, {num_source_layers})",
            )
        if not isinstance(entry["inputs"], list):
            fail(f"layers[{i}].inputs", entry["inputs"], "a nested list of [layer, head] pairs")
        for key in ("r2_key", "r2_value"):
            r2 = entry[key]
            if r2 is not None and (not _is_number(r2) or not math.isfinite(r2) or r2 > 1):
                fail(f"layers[{i}].{key}", r2, "null or a finite number <= 1")


def _check_tensor_table(tensors, fail) -> None:
    if not isinstance(tensors, dict):
        fail("tensors", tensors, "an object of tensor descriptions")
    for name, want in tensors.items():
        if not isinstance(want, dict):
            fail(f"tensors.{name}", want, "an object with shape, dtype and sha256")
        shape = want.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            fail(f"tensors.{name}.shape", shape, "a list of integers >= 0")
        if not isinstance(want.get("dtype"), str):
            fail(f"tensors.{name}.dtype", want.get("dtype"), "a dtype name such as 'float32'")
        sha = want.get("sha256")
        if not isinstance(sha, str) or not _HEX16.match(sha):
            fail(f"tensors.{name}.sha256", sha, "16 lowercase hex digits")


def _failer(path: Path):
    def fail(field: str, value, expected: str):
        raise BridgeFormatError(
            f"{path}: field {field!r} is {_short(value)} ({type(value).__name__}); expected {expected}"
        )

    fail.path = path
    return fail


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
