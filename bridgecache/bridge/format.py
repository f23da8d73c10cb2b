"""Validation of a bridge's metadata file (`bridge.json`): every field's type and range.

`check_bridge_json(meta, path)` raises `BridgeFormatError` naming the file, the field (as a
dotted path: `target.num_layers`, `layers[3].r2_key`, `calibration.heldout_scores.attention_cosine`)
and what was expected, before any of the values reach a `Bridge`. Every count has a bound
(`LIMITS`), so no field can make a reader allocate more than the file could describe (a plot of
6,000 x 6,000 layers), and every field read later (the calibration block: held-out scores, the
fit recipe, the built-in fingerprints) is checked here, not where it is used. The tensors
themselves (shapes, dtypes, checksums, finiteness) are checked against this metadata by
`bridgecache.bridge.maps`.

Knows the JSON layout of a bridge; nothing about tensors, models or tokenizers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from bridgecache.bridge.recipe import RECIPE_FIELDS, FitConfig, FitOptionError
from bridgecache.models.spec import SPEC_LIMITS, check_spec_dict
from bridgecache.untrusted import printable, shown
from tokenalign import POLICIES

__all__ = [
    "ALIGNMENT_POLICIES",
    "LIMITS",
    "MAX_JSON_BYTES",
    "METHODS",
    "RECIPE_KEYS",
    "TENSORS_FILE",
    "BridgeFormatError",
    "check_bridge_json",
    "printable",
]

ALIGNMENT_POLICIES = ("identity", *POLICIES)
METHODS = ("fullhead", "cachebridge", "identity")
_HEX16 = re.compile(r"[0-9a-f]{16}")
TENSORS_FILE = re.compile(r"bridge(-[0-9a-f]{16})?\.safetensors")  # never a path: no "/", no ".."
MAX_JSON_BYTES = 64 * 2**20  # a 128-layer bridge's bridge.json is well under 1 MB

# Upper bounds of the counts a bridge.json may state; a value beyond them is a corrupted or
# hostile file.
LIMITS = {
    **SPEC_LIMITS,  # source.* and target.* (bridgecache.models.spec)
    "rank": 2**16,
    "count": 2**31,  # sequences, rows, tokens, boundaries in the calibration record
    "dims": 8,  # dimensions of a described tensor
}

# The entries of a fit recipe (the model names and FitConfig's): any other key is refused.
RECIPE_KEYS = ("source", "target", *RECIPE_FIELDS)


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
    version = meta.get("format_version")
    tensors_file = meta.get("tensors_file")
    if version == 1 and tensors_file is not None:
        fail("tensors_file", tensors_file, "absent in format 1 (its tensors are bridge.safetensors)")
    if version != 1 and not (isinstance(tensors_file, str) and TENSORS_FILE.fullmatch(tensors_file)):
        fail("tensors_file", tensors_file, "a file name 'bridge-<16 hex digits>.safetensors'")
    for role in ("source", "target"):
        check_spec_dict(meta[role], role, fail)
    if meta["method"] not in METHODS:
        fail("method", meta["method"], f"one of {METHODS}")
    if meta["alignment_policy"] not in ALIGNMENT_POLICIES:
        fail("alignment_policy", meta["alignment_policy"], f"one of {ALIGNMENT_POLICIES}")
    _int(fail, "native_head", meta["native_head"], 0, meta["target"]["max_position_embeddings"])
    num_target, num_source = meta["target"]["num_layers"], meta["source"]["num_layers"]
    _check_layers(meta["layers"], num_target, num_source, fail)
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
        if role not in ("source", "target") or not (value is None or _is_hex16(value)):
            fail(
                f"fingerprints.{role}", value, "a string of 16 hex digits (or null) for 'source' and 'target'"
            )
    _check_calibration(meta["calibration"], num_target, fail)


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
        if (
            not isinstance(src, list)
            or len(src) > num_source_layers
            or not all(_is_int(s) and 0 <= s < num_source_layers for s in src)
        ):
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
        field = f"tensors.{printable(name, 80)}"
        if not isinstance(want, dict):
            fail(field, want, "an object with shape, dtype and sha256")
        shape = want.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) > LIMITS["dims"]
            or not all(_is_int(d) and 0 <= d < LIMITS["count"] for d in shape)
        ):
            fail(f"{field}.shape", shape, f"a list of at most {LIMITS['dims']} integers in [0, 2**31)")
        if want.get("dtype") not in ("float32", "float16", "bfloat16", "int64"):
            fail(f"{field}.dtype", want.get("dtype"), "one of 'float32', 'float16', 'bfloat16', 'int64'")
        sha = want.get("sha256")
        if not _is_hex16(sha):
            fail(f"{field}.sha256", sha, "16 lowercase hex digits")


def _check_calibration(calib, num_target_layers: int, fail) -> None:
    """The calibration record: free-form, but every entry bridgecache reads back is checked."""
    if not isinstance(calib, dict):
        fail("calibration", calib, "an object")
    count = LIMITS["count"]
    for key in ("num_sequences", "seq_len", "heldout_every", "probe_sequences"):
        if key in calib:
            _int(fail, f"calibration.{key}", calib[key], 0 if key == "probe_sequences" else 1, count)
    if calib.get("boundaries") is not None:
        _int(fail, "calibration.boundaries", calib["boundaries"], 1, count, "null or ")
    if "seed" in calib:
        _int(fail, "calibration.seed", calib["seed"], 0, 2**63 - 1)
    for key in ("text", "domain", "split", "description", "stored_dtype", "command", "recipe_rebuilt"):
        if key in calib:
            _string(fail, f"calibration.{key}", calib[key], limit=65536)
    if "stored_dtype" in calib and calib["stored_dtype"] not in ("float32", "float16", "bfloat16"):
        fail("calibration.stored_dtype", calib["stored_dtype"], "'float32', 'float16' or 'bfloat16'")
    rows = calib.get("rows")
    if rows is not None:
        if not isinstance(rows, dict):
            fail("calibration.rows", rows, "an object with 'train' and 'heldout' row counts")
        for key, value in rows.items():
            _int(fail, f"calibration.rows.{printable(key, 40)}", value, 0, count)
    scores = calib.get("heldout_scores")
    if scores is not None:
        _check_heldout_scores(scores, num_target_layers, fail)
    if "fingerprints" in calib:
        _check_zoo_fingerprints(calib["fingerprints"], fail)
    if "recipe" in calib and calib["recipe"]:
        _check_recipe(calib["recipe"], fail)


def _check_heldout_scores(scores, num_target_layers: int, fail) -> None:
    where = "calibration.heldout_scores"
    if not isinstance(scores, dict):
        fail(where, scores, "an object with 'attention_cosine' per target layer")
    cosines = scores.get("attention_cosine")
    valid = lambda x: x is None or (_is_number(x) and (math.isnan(x) or -1 <= x <= 1))  # noqa: E731
    if cosines is not None and (  # the quality gate reads one score per target layer
        not isinstance(cosines, list) or len(cosines) != num_target_layers or not all(map(valid, cosines))
    ):
        fail(
            f"{where}.attention_cosine",
            cosines,
            f"a list of {num_target_layers} numbers in [-1, 1] (one per target layer; null: not measured)",
        )
    if "mean" in scores and not (scores["mean"] is None or _is_number(scores["mean"])):
        fail(f"{where}.mean", scores["mean"], "a number or null")
    for key in ("sequences", "heldout_sequences"):  # scored, and held out when not all were scored
        if key in scores:
            _int(fail, f"{where}.{key}", scores[key], 0, LIMITS["count"])


def _check_zoo_fingerprints(fingerprints, fail) -> None:
    """A built-in bridge's record of the zoo files it was fitted on (bridgecache.bridge.builtin)."""
    if not isinstance(fingerprints, dict) or set(fingerprints) != {"source", "target"}:
        fail("calibration.fingerprints", fingerprints, "an object with 'source' and 'target' entries")
    for role, entry in fingerprints.items():
        where = f"calibration.fingerprints.{role}"
        if not isinstance(entry, dict):
            fail(where, entry, "an object with 'zoo', 'gguf' and 'tokenizer'")
        _string(fail, f"{where}.zoo", entry.get("zoo"), limit=200)
        gguf = entry.get("gguf")
        if not (isinstance(gguf, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", gguf)):
            fail(f"{where}.gguf", gguf, "'sha256:' and 64 hex digits")
        if not _is_hex16(entry.get("tokenizer")):
            fail(f"{where}.tokenizer", entry.get("tokenizer"), "16 hex digits")


def _check_recipe(recipe, fail) -> None:
    """The recipe `bridgecache fit --recipe` reads back into a FitConfig: known keys, the model
    names, counts within LIMITS, and every value in FitConfig's range."""
    where = "calibration.recipe"
    if not isinstance(recipe, dict):
        fail(where, recipe, "an object of the model names and FitConfig fields")
    unknown = sorted(set(recipe) - set(RECIPE_KEYS))
    if unknown:
        fail(f"{where}", unknown, f"only the keys {RECIPE_KEYS}")
    for key in ("source", "target"):
        _string(fail, f"{where}.{key}", recipe.get(key), limit=4096, empty=False)
    highs = {"layers_k": LIMITS["num_layers"], "seed": 2**63 - 1}
    for key in ("num_sequences", "seq_len", "heldout_every", "native_head", "boundaries", "probe_subset"):
        highs[key] = LIMITS["count"]
    for key, high in highs.items():
        if _is_int(recipe.get(key)) and recipe[key] > high:
            fail(f"{where}.{key}", recipe[key], f"an integer of at most {high:,}")
    try:
        FitConfig.from_recipe(recipe)
    except FitOptionError as err:
        fail(f"{where}.{err.option}", err.value, err.expected)


def _failer(path: Path):
    def fail(field: str, value, expected: str):
        raise BridgeFormatError(
            f"{path}: field {field!r} is {shown(value)} ({type(value).__name__}); expected {expected}"
        )

    fail.path = path
    return fail


def _int(fail, field: str, value, low: int, high: int, prefix: str = "") -> None:
    if not _is_int(value) or not low <= value <= high:
        fail(field, value, f"{prefix}an integer in [{low}, {high:,}]")


def _string(fail, field: str, value, *, limit: int, empty: bool = True) -> None:
    if not isinstance(value, str) or len(value) > limit or (not empty and not value):
        fail(field, value, f"a {'non-empty ' if not empty else ''}string of at most {limit:,} characters")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_hex16(x) -> bool:
    return isinstance(x, str) and _HEX16.fullmatch(x) is not None
