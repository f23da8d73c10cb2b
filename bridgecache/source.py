"""SourceKV: a context's per-layer KV, read-only: the one KV container of bridgecache.

`capture_kv` returns one; `as_source` makes one from whatever the caller has: a transformers
cache after the source's forward pass (`DynamicCache`), per-layer `(keys, values)` tensors, or a
file written by `save_kv` (safetensors: how a context moves between processes or machines).
Nothing here ever writes into the caller's tensors: bridging reads them, and the source cache
stays usable by the source model.

Shapes: keys/values per layer [batch, kv_heads, tokens, head_dim] (keys post-RoPE, as cached);
attention_mask and position_ids [batch, tokens]. Padding is read from the attention mask (left
padding only), never inferred from the positions. A sliding-window source layer may hold only its
last tokens: `first_token[l]` says which context token its row 0 is.

KV know where they came from where that is known: the spec and weight fingerprint of the model
that computed them and the token ids they hold (`capture_kv` records all three; `as_source(...,
model=, input_ids=)` checks them, or records them for a bare cache). A KV file always carries
them, and `load_kv(path, model=, input_ids=)` refuses a file of another model or another
document (KVMismatchError); a bridge refuses KV of a model of another architecture (`check`).
Every count in a file's header is bounded by the tensors the file holds before anything is
allocated, keys and values must be finite floating-point numbers, and error messages are short.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from bridgecache.files import clean_leftovers, publish, staging_folder
from bridgecache.modelinfo import ModelSpec, SpecMismatchError, WeightMismatchWarning, spec_from_untrusted
from bridgecache.rope import RopeTables, unrotate
from bridgecache.untrusted import all_finite, printable, shown

__all__ = [
    "SourceKV",
    "as_source",
    "save_kv",
    "load_kv",
    "KVFileError",
    "KVMismatchError",
    "position_ids_from_mask",
]

# /2: a sha256 of all tensors in the header; /3: the model (spec, weight fingerprint) and the
# token ids (tensor "input_ids") the KV belong to.
_KV_FORMAT = "bridgecache.kv/3"
_HEADER = ("format", "num_layers", "first_token", "sha256", "model", "model_fingerprint")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTEGERS = (torch.int64, torch.int32)
_HEX16 = re.compile(r"[0-9a-f]{16}")


class KVFileError(ValueError):
    """A KV file is missing, truncated, corrupted or not a bridgecache KV file."""


class KVMismatchError(ValueError):
    """Source KV used with a model or tokens other than the ones they were computed from."""


@dataclass(frozen=True)
class SourceKV:
    """Per-layer keys/values of one context (never mutated).

    keys[l], values[l]: [batch, kv_heads, kept_tokens_l, head_dim] as cached (keys post-RoPE);
        row r is context token first_token[l] + r.
    attention_mask: [batch, tokens] int64, 0 on left padding, 1 on the context's tokens.
    position_ids: [batch, tokens] int64, the positions RoPE was applied at.
    first_token: per layer, the context token of row 0 (0 unless a sliding layer dropped rows).
    rope: the model's rotary tables (set by `capture_kv`; None for KV made elsewhere).
    input_ids: [batch, tokens] the token ids the KV hold (None: not known).
    model, fingerprint: the ModelSpec and weight fingerprint (bridgecache.fingerprint) of the model
        that computed them (None: not known).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    first_token: tuple[int, ...]
    rope: RopeTables | None = field(default=None, compare=False, repr=False)
    input_ids: torch.Tensor | None = field(default=None, compare=False, repr=False)
    model: ModelSpec | None = field(default=None, compare=False, repr=False)
    fingerprint: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "values", tuple(self.values))
        _check_tensors(self)
        _check_mask(self.attention_mask, tuple(self.position_ids.shape), "source attention_mask")

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_tokens(self) -> int:
        return self.position_ids.shape[-1]

    @property
    def padding(self) -> torch.Tensor:
        """[batch] int64 on the CPU: left padding columns of each row."""
        return (self.attention_mask == 0).sum(1).cpu()

    def unrotated_keys(self, layer: int) -> torch.Tensor:
        """Keys of `layer` with RoPE removed: [batch, kv_heads, tokens, head_dim], float32."""
        if self.rope is None:
            raise ValueError("these KV carry no rope tables; capture them with bridgecache.capture_kv")
        first = self.first_token[layer]
        positions = self.position_ids[:, first : first + self.keys[layer].shape[-2]]
        cos, sin = self.rope.cos_sin(layer, positions)
        keys = self.keys[layer].float()
        return unrotate(keys, cos.to(keys.device), sin.to(keys.device))

    def check(self, spec: ModelSpec, fingerprint: str | None = None) -> None:
        """Raise unless these KV can stand for a model of `spec` (a bridge's source).

        The model that computed them, where recorded, must have `spec` (SpecMismatchError: KV of
        another family with the same shapes are refused), other weights than `fingerprint` warn
        (WeightMismatchWarning), and every layer must have the shape `spec` says (ValueError).
        """
        if self.model is not None and spec.mismatches(self.model):
            raise SpecMismatchError(
                f"the source KV were computed by a model other than the bridge's source model "
                f"{printable(spec.name, 200)!r} ({printable(spec.model_type, 60)}): "
                + "; ".join(spec.mismatches(self.model))
            )
        if fingerprint and self.fingerprint and fingerprint != self.fingerprint:
            warnings.warn(
                f"the source KV were computed by a model with weights {self.fingerprint}, not the ones "
                f"this bridge was fitted on ({fingerprint}): same architecture, other checkpoint",
                WeightMismatchWarning,
                stacklevel=3,
            )
        self._check_shapes(spec.num_layers, spec.num_kv_heads, spec.head_dim)

    def _check_shapes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        if self.num_layers != num_layers:
            raise ValueError(
                f"source KV has {self.num_layers} layers; the bridge's source model has {num_layers}"
            )
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            expected = (self.batch_size, num_kv_heads, k.shape[2], head_dim)
            for name, t in (("keys", k), ("values", v)):
                if t.dim() != 4 or tuple(t.shape) != expected:
                    raise ValueError(
                        f"source layer {layer} {name} have shape {tuple(t.shape)}; expected "
                        f"[batch={self.batch_size}, kv_heads={num_kv_heads}, tokens, head_dim={head_dim}]"
                    )


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch, tokens] 0/1 mask (left padding) -> [batch, tokens] positions as generate() makes
    them in transformers 5.x: 0, 1, ... over the real tokens, 0 on the padding."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)


def _check_mask(mask: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """Raise ValueError unless `mask` is a [batch, tokens] 0/1 left-padding mask of `shape`."""
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}; expected {shape} ([batch, tokens])")
    if mask.numel() == 0:
        return
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} holds values other than 0 and 1")
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        bad = int((mask[:, 1:] < mask[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"{name} row {bad} is not left padding (expected 0s, then 1s)")


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


def _is_pair(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) == 2


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)}"
    return f"a {type(t).__name__}"


def _check_tensors(kv: SourceKV) -> None:
    """Types, dtypes and dimensions of every tensor (metadata only: no pass over the data)."""
    if len(kv.keys) != len(kv.values) or not kv.keys:
        raise ValueError(
            f"source KV have {len(kv.keys)} key and {len(kv.values)} value layers; expected the same, >= 1"
        )
    for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
        for name, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATS or t.dim() != 4:
                raise TypeError(
                    f"source layer {layer} {name} are {_describe(t)}; expected a float16, bfloat16, "
                    "float32 or float64 tensor [batch, kv_heads, tokens, head_dim]"
                )
    for name in ("attention_mask", "position_ids", "input_ids"):
        t = getattr(kv, name)
        if name == "input_ids" and t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in (*_INTEGERS, torch.bool) or t.dim() != 2:
            raise TypeError(f"source {name} is {_describe(t)}; expected an integer tensor [batch, tokens]")
    if kv.input_ids is not None and kv.input_ids.shape != kv.position_ids.shape:
        raise ValueError(
            f"source input_ids have shape {tuple(kv.input_ids.shape)}; the KV hold "
            f"{tuple(kv.position_ids.shape)} [batch, tokens]"
        )


def _bind(kv: SourceKV, model, input_ids, where: str) -> SourceKV:
    """`kv`, checked against (and, where it recorded nothing, bound to) a model and token ids."""
    changes = {}
    if model is not None and not hasattr(model, "named_parameters"):
        raise TypeError(f"model= is the source model (a transformers model), not a {type(model).__name__}")
    if model is not None:
        from bridgecache.fingerprint import weight_fingerprint
        from bridgecache.modelinfo import model_spec

        spec, weights = model_spec(model), weight_fingerprint(model)
        if kv.fingerprint is not None and kv.fingerprint != weights:
            made_by = f" ({printable(kv.model.name, 200)!r})" if kv.model is not None else ""
            raise KVMismatchError(
                f"{where} were computed by a model with weights {kv.fingerprint}{made_by}, not by the "
                f"source model given ({printable(spec.name, 200)!r}, weights {weights})"
            )
        if kv.model is not None and kv.model.mismatches(spec):
            raise KVMismatchError(
                f"{where} were computed by another model than the source model given: "
                + "; ".join(kv.model.mismatches(spec))
            )
        if kv.fingerprint is None:
            changes.update(model=spec, fingerprint=weights)
    if input_ids is not None:
        ids = torch.as_tensor(input_ids).detach().long().cpu()
        ids = ids[None] if ids.dim() == 1 else ids
        held = kv.input_ids
        if held is not None:
            held = held.long().cpu()
            if held.shape != ids.shape:
                raise KVMismatchError(
                    f"{where} hold {tuple(held.shape)} tokens [batch, tokens]; the context given has "
                    f"{tuple(ids.shape)}: another document"
                )
            if not torch.equal(held, ids):
                first = int((held != ids).flatten().nonzero()[0])
                raise KVMismatchError(
                    f"{where} hold the tokens of another document of the same length (first difference "
                    f"at token {first % ids.shape[-1]}: {int(held.flatten()[first])} in the KV, "
                    f"{int(ids.flatten()[first])} in the context)"
                )
        elif tuple(ids.shape) != tuple(kv.position_ids.shape):
            raise KVMismatchError(
                f"{where} hold {tuple(kv.position_ids.shape)} tokens [batch, tokens]; the context given "
                f"has {tuple(ids.shape)}"
            )
        else:
            changes["input_ids"] = ids
    return dataclasses.replace(kv, **changes) if changes else kv


def _from_cache(cache, attention_mask) -> SourceKV:
    keys, values, first = [], [], []
    for i, layer in enumerate(cache.layers):
        if layer.keys is None or layer.keys.numel() == 0:
            raise ValueError(f"source cache layer {i} is empty: run the source model over the context first")
        keys.append(layer.keys)
        values.append(layer.values)
        total = getattr(layer, "cumulative_length", layer.keys.shape[-2])
        first.append(int(total) - layer.keys.shape[-2])  # sliding layers keep only the last tokens
    longest = max(keys, key=lambda k: k.shape[-2])
    total_tokens = max(f + k.shape[-2] for f, k in zip(first, keys))
    if longest.shape[-2] < total_tokens and attention_mask is not None:
        raise ValueError("a left-padded source cache must hold the whole context in at least one layer")
    if longest.shape[-2] < total_tokens:  # only sliding layers: positions are simply 0..tokens-1
        batch = longest.shape[0]
        mask = torch.ones(batch, total_tokens, dtype=torch.long, device=longest.device)
        positions = position_ids_from_mask(mask)
    else:
        mask, positions = _mask_and_positions(longest, attention_mask)
    return SourceKV(
        tuple(keys), tuple(values), attention_mask=mask, position_ids=positions, first_token=tuple(first)
    )


def _mask_and_positions(keys: torch.Tensor, attention_mask: torch.Tensor | None):
    """(mask, positions) [batch, tokens] of keys [batch, heads, tokens, dim]: all ones without a mask."""
    batch, _, tokens, _ = keys.shape
    if attention_mask is None:
        attention_mask = torch.ones(batch, tokens, dtype=torch.long, device=keys.device)
    _check_mask(attention_mask, (batch, tokens), "source attention_mask")
    mask = attention_mask.to(device=keys.device, dtype=torch.long)
    return mask, position_ids_from_mask(mask)


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
    path = Path(path)
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
