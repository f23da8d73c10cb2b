"""Source KV from whatever the caller has, and to and from files.

    as_source(x)           a SourceKV of a transformers cache, per-layer (keys, values), a SourceKV
                           or a path written by `save_kv`; checked against model= and input_ids=
    save_kv(path, kv)      one safetensors file, written atomically, recording the model and tokens
    load_kv(path, ...)     read back, every count bounded by what the file holds, every tensor checked

A KV file records which model computed the KV (its ModelSpec and weight fingerprint) and the token
ids they hold: a file of another model, or of another document of the same length, is refused
(KVMismatchError). The container itself is bridgecache.kv.source's `SourceKV`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

import bridgecache.checks as checks
from bridgecache.files import clean_leftovers, publish, staging_folder
from bridgecache.kv.source import (
    _FLOATS,
    _HEADER,
    _HEX16,
    _INTEGERS,
    _KV_FORMAT,
    KVFileError,
    SourceKV,
    _bind,
    _describe,
    _from_cache,
    _is_pair,
    _mask_and_positions,
)
from bridgecache.models.spec import ModelSpec, spec_from_untrusted
from bridgecache.untrusted import all_finite, printable, shown

__all__ = ["as_source", "save_kv", "load_kv"]


def as_source(
    source, attention_mask: torch.Tensor | None = None, *, model=None, input_ids: torch.Tensor | None = None
) -> SourceKV:
    """A `SourceKV` of a cache, per-layer (k, v) pairs, a KV file path, or a SourceKV itself.

    attention_mask: [batch, tokens] 0/1 for left-padded batches. A SourceKV (or file) carries its
    own mask; one given as well must agree with it.
    model, input_ids: the source model and the context's token ids [batch, tokens] these KV are
        used as. KV that record their model or tokens must match them (KVMismatchError: KV of
        another model, or of another document of the same length, are refused); KV that do not
        (a bare cache, tensors) must have their length and are bound to them from here on.
    """
    if isinstance(source, (str, Path)):
        return load_kv(source, model=model, input_ids=input_ids, attention_mask=attention_mask)
    if isinstance(source, SourceKV):
        if attention_mask is not None and not torch.equal(
            attention_mask.long().cpu(), source.attention_mask.long().cpu()
        ):
            raise ValueError(
                "source_attention_mask differs from the attention mask the source KV were captured with"
            )
        kv = source
    elif hasattr(source, "layers"):  # a transformers Cache
        kv = _from_cache(source, attention_mask)
    elif isinstance(source, (list, tuple)) and source and all(_is_pair(p) for p in source):
        keys = tuple(k for k, _ in source)
        values = tuple(v for _, v in source)
        if not isinstance(keys[0], torch.Tensor) or keys[0].dim() != 4:
            raise TypeError(
                f"source layer 0 keys are {_describe(keys[0])}; expected a tensor "
                "[batch, kv_heads, tokens, head_dim]"
            )
        mask, positions = _mask_and_positions(keys[0], attention_mask)
        kv = SourceKV(keys, values, attention_mask=mask, position_ids=positions, first_token=(0,) * len(keys))
    else:
        raise TypeError(
            f"cannot read source KV from {type(source).__name__}: expected a transformers Cache, a "
            "SourceKV (capture_kv), a list of (keys, values) per layer, or a path written by save_kv"
        )
    return _bind(kv, model, input_ids, "the source KV")


def save_kv(
    path: str | Path,
    source,
    attention_mask: torch.Tensor | None = None,
    *,
    model=None,
    input_ids: torch.Tensor | None = None,
    **metadata: str,
) -> Path:
    """Write a context's source KV to one safetensors file, atomically (a temporary file renamed
    into place: a reader or a kill never sees half a file, and the next save or load in that
    folder removes what a killed save left).

    The file records which model computed the KV (its ModelSpec and weight fingerprint) and the
    token ids they hold: KV from `capture_kv` carry both; for others pass `model=` (the source
    model) and `input_ids=` ([batch, tokens]). The header holds the format, the layer count, each
    layer's first token, a sha256 of every tensor (verified by `load_kv`) and any `metadata`
    given. The file gets the umask's mode.
    """
    reserved = set(_HEADER) & set(metadata)
    if reserved:
        raise ValueError(f"metadata keys {sorted(reserved)} are reserved by the KV file format")
    kv = as_source(source, attention_mask, model=model, input_ids=input_ids)
    if kv.model is None or kv.fingerprint is None or kv.input_ids is None:
        raise ValueError(
            "save_kv records which model computed the KV and which tokens they hold: pass model= "
            "(the source model) and input_ids= (the context's ids, [batch, tokens]), or save what "
            "capture_kv returned"
        )
    tensors = {"position_ids": kv.position_ids.contiguous().cpu()}
    tensors["attention_mask"] = kv.attention_mask.contiguous().cpu()
    tensors["input_ids"] = kv.input_ids.long().contiguous().cpu()
    for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
        tensors[f"keys.{layer}"] = k.contiguous().cpu()
        tensors[f"values.{layer}"] = v.contiguous().cpu()
    header = {k: str(v) for k, v in metadata.items()}
    header |= {
        "format": _KV_FORMAT,
        "num_layers": str(kv.num_layers),
        "first_token": json.dumps(kv.first_token),
        "sha256": _kv_digest(tensors),
        "model": json.dumps(kv.model.to_dict()),
        "model_fingerprint": kv.fingerprint,
    }
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; save_kv writes a file")
    clean_leftovers(path.parent)
    with staging_folder(path.parent) as staging:
        save_file(tensors, str(staging / path.name), metadata=header)
        publish(staging / path.name, path)  # umask mode (safetensors writes 0600), fsync, one rename
    return path


def load_kv(
    path: str | Path,
    device: str | torch.device = "cpu",
    *,
    model=None,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> SourceKV:
    """Read a file written by `save_kv`; corrupted, malformed or foreign files raise KVFileError.

    model, input_ids: the source model and the context's token ids the KV are used for: a file
    computed by another model, or holding another document's tokens, raises KVMismatchError.
    attention_mask: must agree with the file's, when given.
    """
    path = checks.path(path, "path")  # a name the lookup can take (bridgecache.checks)
    if not path.is_file():
        raise KVFileError(f"no KV file at {path}" + (" (a directory)" if path.is_dir() else ""))
    clean_leftovers(path.parent)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            names = set(f.keys())
        n, first, spec = _check_kv_header(path, header, names)
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        if isinstance(err, KVFileError):
            raise
        raise KVFileError(
            f"{path} is not a readable safetensors file (truncated or corrupted?): {printable(str(err), 200)}"
        ) from err
    if _kv_digest(tensors) != header["sha256"]:
        raise KVFileError(
            f"{path}: checksum mismatch (sha256 in the header differs from the tensors'): corrupted"
        )
    _check_kv_tensors(path, tensors, n, first)
    kv = SourceKV(
        tuple(tensors[f"keys.{i}"].to(device) for i in range(n)),
        tuple(tensors[f"values.{i}"].to(device) for i in range(n)),
        attention_mask=tensors["attention_mask"].to(device),
        position_ids=tensors["position_ids"].to(device),
        first_token=first,
        input_ids=tensors["input_ids"],
        model=spec,
        fingerprint=header["model_fingerprint"],
    )
    if attention_mask is not None and not torch.equal(
        attention_mask.long().cpu(), kv.attention_mask.long().cpu()
    ):
        raise ValueError(f"source_attention_mask differs from the attention mask stored in {path}")
    return _bind(kv, model, input_ids, f"the KV in {path}")


def _kv_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        hasher.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        hasher.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def _check_kv_header(path: Path, header: dict, names: set[str]) -> tuple[int, tuple[int, ...], ModelSpec]:
    """(num_layers, first_token, model spec) from a KV file's header, or KVFileError naming the bad
    field. Every count is checked against the tensors the file holds before anything is built."""
    fmt = header.get("format")
    if fmt in ("bridgecache.kv/1", "bridgecache.kv/2"):
        missing = "a checksum" if fmt.endswith("/1") else "the model and the tokens it holds"
        raise KVFileError(f"{path} was written by an older bridgecache without {missing}; save it again")
    if fmt != _KV_FORMAT:
        raise KVFileError(
            f"{path} is not a bridgecache KV file (format {shown(fmt)}, expected {_KV_FORMAT!r})"
        )
    raw = header.get("num_layers")
    if raw is None or not raw.isdigit() or len(raw) > 9 or int(raw) < 1:
        raise KVFileError(f"{path}: header field 'num_layers' is {shown(raw)}; expected a positive integer")
    n = int(raw)
    held = sum(1 for name in names if re.fullmatch(r"keys\.\d{1,9}", name))
    if n > held:  # bounded by the file before any per-layer list is built
        raise KVFileError(
            f"{path}: header field 'num_layers' is {n:,}, but the file holds keys of {held} layers"
        )
    text = header.get("first_token", "")
    first = None
    if len(text) <= 12 * n + 2:
        try:
            first = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            first = None
    if (
        not isinstance(first, list)
        or len(first) != n
        or not all(type(x) is int and 0 <= x < 2**40 for x in first)
    ):
        raise KVFileError(
            f"{path}: header field 'first_token' is {shown(header.get('first_token'))}; "
            f"expected a JSON list of {n} integers >= 0"
        )
    sha = header.get("sha256")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise KVFileError(f"{path}: header field 'sha256' is {shown(sha)}; expected 64 hex digits")
    if not _HEX16.fullmatch(header.get("model_fingerprint") or ""):
        raise KVFileError(
            f"{path}: header field 'model_fingerprint' is {shown(header.get('model_fingerprint'))}; "
            "expected 16 hex digits (the weight fingerprint of the model that computed the KV)"
        )
    try:
        spec = spec_from_untrusted(json.loads(header.get("model") or "null"))
    except (ValueError, RecursionError) as err:
        raise KVFileError(
            f"{path}: header field 'model' is not a model spec: {printable(str(err), 300)}"
        ) from err
    expected = {"position_ids", "attention_mask", "input_ids"}
    expected |= {f"{kind}.{i}" for i in range(n) for kind in ("keys", "values")}
    missing, extra = sorted(expected - names), sorted(names - expected)
    if missing or extra:
        problem = f"lacks tensors {shown(missing, 120)} for its {n} layers" if missing else ""
        problem += ("; " if missing and extra else "") + (
            f"holds unexpected tensors {shown(extra, 120)}" if extra else ""
        )
        raise KVFileError(f"{path} {problem}")
    return n, tuple(first), spec


def _check_kv_tensors(path: Path, tensors: dict, n: int, first: tuple[int, ...]) -> None:
    """Dtypes; keys and values agree per layer, are [batch, heads, rows, dim], fit in the context
    and hold finite numbers."""
    positions = tensors["position_ids"]
    for name in ("position_ids", "attention_mask", "input_ids"):
        t = tensors[name]
        if t.dim() != 2 or t.shape != positions.shape or t.dtype not in _INTEGERS:
            raise KVFileError(
                f"{path}: {name} is a {t.dtype} tensor of shape {tuple(t.shape)}; expected int64 "
                f"[batch, tokens] like position_ids {tuple(positions.shape)}"
            )
    batch, tokens = positions.shape
    for i in range(n):
        k, v = tensors[f"keys.{i}"], tensors[f"values.{i}"]
        if k.dtype not in _FLOATS or v.dtype not in _FLOATS:
            raise KVFileError(
                f"{path}: layer {i} keys are {k.dtype}, values {v.dtype}; expected float16, bfloat16, "
                "float32 or float64"
            )
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] != batch or k.shape[:3] != v.shape[:3]:
            raise KVFileError(
                f"{path}: layer {i} keys {tuple(k.shape)} / values {tuple(v.shape)}; expected "
                f"[batch={batch}, kv_heads, rows, head_dim] each, with the same rows"
            )
        if first[i] + k.shape[2] > tokens:
            raise KVFileError(
                f"{path}: layer {i} holds rows {first[i]}..{first[i] + k.shape[2] - 1} "
                f"of a {tokens}-token context"
            )
        for name, t in (("keys", k), ("values", v)):
            if not all_finite(t):
                raise KVFileError(
                    f"{path}: layer {i} {name} hold {int((~torch.isfinite(t)).sum()):,} NaN or infinite "
                    "values; expected finite numbers"
                )
