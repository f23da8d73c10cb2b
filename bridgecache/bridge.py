"""Bridge: the per-layer affine maps that turn a source model's KV into a target model's.

A `Bridge` holds one `LayerMap` per target layer plus the identity (`ModelSpec`) of both models,
the method that fitted it, the token-alignment policy and a description of the calibration data.
It is a container: fitting lives in `bridgecache.fitting`, application in `bridgecache.translate`.

Files: `bridge.json` (metadata, per-tensor shape/dtype/sha256, and `tensors_file`: the name of
the tensors file) + `bridge-<16 hex>.safetensors` (the tensors; `bridge.safetensors` in bridges
written before format 2). A save writes a new tensors file beside the old one and then replaces
`bridge.json` in one rename: the pointer moves last, so a reader, a crash or a second writer
leaves the old bridge or the new one, never half. Loading validates everything against the
metadata and names the field that is wrong. No pickle.

This module knows nothing about tokenizers, calibration text or how the maps were fitted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from bridgecache.bridgeformat import (
    MAX_JSON_BYTES,
    METHODS,
    TENSORS_FILE,
    BridgeFormatError,
    check_bridge_json,
    printable,
)
from bridgecache.files import clean_leftovers, directory_lock, publish, staging_folder
from bridgecache.fingerprint import weight_fingerprint
from bridgecache.modelinfo import ModelSpec, SpecMismatchError, WeightMismatchWarning, model_spec
from bridgecache.refinement import REFINE_FIELDS, LayerRefinement, refinement_shapes
from bridgecache.untrusted import all_finite, shown

__all__ = [
    "LayerMap",
    "Bridge",
    "BridgeFormatError",
    "WeightMismatchWarning",
    "FORMAT_VERSION",
    "METHODS",
    "tensors_path",
]

FORMAT_VERSION = 2  # 2: bridge.json names its tensors file (`tensors_file`); 1 is still read
_JSON, _TENSORS = "bridge.json", "bridge.safetensors"  # _TENSORS: the name format 1 used
_CARD = "README.md"
_FIELDS = ("inputs", "key_weight", "key_bias", "value_weight", "value_bias")


@dataclass
class LayerMap:
    """Affine maps of one target layer: Y_hat = X W + b per target head, keys un-rotated.

    inputs: int64 [tgt_heads, n_in, 2], the (source layer, source head) of each input slot.
        X_h = concat over slots of those source rows: [tokens, n_in * src_dim].
    key_weight, value_weight: float32 [tgt_heads, n_in * src_dim, tgt_dim].
    key_bias, value_bias: float32 [tgt_heads, tgt_dim].
    r2_key, r2_value: held-out R^2 (NaN when not measured, e.g. the identity).
    refinement: an optional trained low-rank residual on top of the maps (bridgecache.refinement).
    """

    source_layers: list[int]
    inputs: torch.Tensor
    key_weight: torch.Tensor
    key_bias: torch.Tensor
    value_weight: torch.Tensor
    value_bias: torch.Tensor
    r2_key: float = math.nan
    r2_value: float = math.nan
    refinement: LayerRefinement | None = None

    @property
    def num_parameters(self) -> int:
        extra = [] if self.refinement is None else list(self.refinement.tensors().values())
        maps = (self.key_weight, self.key_bias, self.value_weight, self.value_bias)
        return sum(t.numel() for t in (*maps, *extra))

    @property
    def nbytes(self) -> int:
        extra = [] if self.refinement is None else list(self.refinement.tensors().values())
        return sum(t.numel() * t.element_size() for t in (*(getattr(self, name) for name in _FIELDS), *extra))


@dataclass
class Bridge:
    """Everything needed to map a source model's KV cache into a target model's cache space.

    method: "fullhead" | "cachebridge" | "identity".
    alignment_policy: "identity" (same tokenizer) or a tokenalign policy name.
    native_head: positions [0, native_head) the target computes itself (excluded from fitting).
    layers: one LayerMap per target layer.
    calibration: JSON-able description of the calibration data and fit settings.
    fingerprints: {"source": ..., "target": ...} weight fingerprints at fit time
        (`bridgecache.fingerprint`); empty for the identity and for older bridge files.
    refinement: JSON-able description of the trained refinement (bridgecache.fitting.refine);
        empty when no layer has one.
    """

    source: ModelSpec
    target: ModelSpec
    method: str
    alignment_policy: str
    layers: list[LayerMap]
    native_head: int = 1
    calibration: dict = field(default_factory=dict)
    fingerprints: dict = field(default_factory=dict)
    refinement: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown bridge method {self.method!r}; expected one of {METHODS}")
        if len(self.layers) != self.target.num_layers:
            raise ValueError(
                f"{len(self.layers)} layer maps for a target with {self.target.num_layers} layers"
            )

    # ------------------------------------------------------------------ construction

    @classmethod
    def identity(cls, model, tokenizer=None, native_head: int = 1) -> Bridge:
        """The exact identity bridge of a model onto itself (W = I, b = 0; no regression)."""
        spec = model if isinstance(model, ModelSpec) else model_spec(model, tokenizer)
        heads, dim = spec.num_kv_heads, spec.head_dim
        eye = torch.eye(dim).expand(heads, dim, dim).contiguous()
        layers = []
        for layer in range(spec.num_layers):
            inputs = torch.stack([torch.full((heads,), layer), torch.arange(heads)], dim=-1)
            layers.append(
                LayerMap(
                    source_layers=[layer],
                    inputs=inputs.unsqueeze(1).long(),
                    key_weight=eye.clone(),
                    key_bias=torch.zeros(heads, dim),
                    value_weight=eye.clone(),
                    value_bias=torch.zeros(heads, dim),
                )
            )
        return cls(spec, spec, "identity", "identity", layers, native_head, {"description": "exact identity"})

    # ------------------------------------------------------------------ checks and sizes

    def check(
        self,
        source=None,
        target=None,
        strict: bool = False,
        *,
        source_tokenizer=None,
        target_tokenizer=None,
    ) -> None:
        """Raise SpecMismatchError naming each field where the given models differ from the bridge's.

        source, target: transformers models or ModelSpecs (None: that side is not checked).
        source_tokenizer, target_tokenizer: compared with the vocabulary fingerprint the bridge
            records (when it records one).
        Given models (not specs), their weights are compared with the fingerprints recorded at
        fit time: a mismatch (e.g. a fine-tuned copy) warns (WeightMismatchWarning), or raises
        SpecMismatchError under `strict=True`.
        """
        sides = (
            ("source", source, source_tokenizer, self.source),
            ("target", target, target_tokenizer, self.target),
        )
        for role, model, tokenizer, spec in sides:
            if model is not None:
                spec.check(_as_spec(model, tokenizer), role)
                _check_fingerprint(self.fingerprints.get(role), model, role, strict)
            elif tokenizer is not None and spec.tokenizer:
                from bridgecache.modelinfo import tokenizer_fingerprint

                got = tokenizer_fingerprint(tokenizer)
                if got != spec.tokenizer:
                    raise SpecMismatchError(
                        f"this bridge was fitted with {role} tokenizer {spec.tokenizer} "
                        f"({printable(spec.name)!r}), got tokenizer {got}"
                    )

    def num_parameters(self) -> int:
        """Coefficients of all maps (weights and biases, keys and values)."""
        return sum(layer.num_parameters for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes of all tensors (weights, biases and input tables)."""
        return sum(layer.nbytes for layer in self.layers)

    def summary(self) -> str:
        """A per-layer table: source layers, inputs per head, parameters, held-out R^2 of K and V."""
        lines = [
            f"bridge {printable(self.source.name)} -> {printable(self.target.name)}  method={self.method}  "
            f"alignment={self.alignment_policy}  native_head={self.native_head}",
            f"{'layer':>5}  {'source layers':<18}{'n_in':>5}{'params':>12}{'R2 K':>9}{'R2 V':>9}",
        ]
        for i, layer in enumerate(self.layers):
            src = ",".join(str(s) for s in layer.source_layers)
            lines.append(
                f"{i:>5}  {src:<18}{layer.inputs.shape[1]:>5}{layer.num_parameters:>12,}"
                f"{_fmt(layer.r2_key):>9}{_fmt(layer.r2_value):>9}"
            )
        r2k = [x.r2_key for x in self.layers if not math.isnan(x.r2_key)]
        r2v = [x.r2_value for x in self.layers if not math.isnan(x.r2_value)]
        mean_k = sum(r2k) / len(r2k) if r2k else math.nan
        mean_v = sum(r2v) / len(r2v) if r2v else math.nan
        lines.append(
            f"{'mean':>5}  {'':<18}{'':>5}{self.num_parameters():>12,}{_fmt(mean_k):>9}{_fmt(mean_v):>9}"
        )
        lines.append(f"mapper size: {self.nbytes():,} bytes")
        return "\n".join(lines)

    # ------------------------------------------------------------------ files

    def save_pretrained(self, directory: str | Path, overwrite: bool = True) -> Path:
        """Write the bridge (tensors, bridge.json, README.md card) into `directory` (created if needed).

        Atomic as a whole: a new tensors file is written under its own name, then bridge.json,
        which names it, replaces the old one in one rename; a crash at any point leaves the old
        bridge (or none) loadable and the next save or load removes what it left. Concurrent
        writers leave one of their bridges. Other files in `directory` are kept; files get the
        umask's mode. overwrite=False refuses (FileExistsError) to replace a bridge already in
        `directory`, also against a writer that creates one meanwhile (exactly one wins).
        """
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"{directory} exists and is not a directory")
        if not overwrite and (directory / _JSON).exists():  # early; checked again at the commit
            raise FileExistsError(f"{directory} already holds a bridge; refusing to overwrite it")
        tensors, described = {}, {}
        for i, layer in enumerate(self.layers):
            named = {name: getattr(layer, name) for name in _FIELDS}
            if layer.refinement is not None:
                named |= {f"refinement.{k}": t for k, t in layer.refinement.tensors().items()}
            for name, t in named.items():
                t = t.detach().cpu().contiguous()
                tensors[f"layers.{i}.{name}"] = t
                described[f"layers.{i}.{name}"] = {
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "sha256": _tensor_sha(t),
                }
        digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
        tensors_file = f"bridge-{digest}.safetensors"  # named by content: writers never collide
        meta = {
            "format": "bridgecache.bridge",
            "format_version": FORMAT_VERSION,
            "tensors_file": tensors_file,
            "source": self.source.to_dict(),
            "target": self.target.to_dict(),
            "method": self.method,
            "alignment_policy": self.alignment_policy,
            "native_head": self.native_head,
            "calibration": self.calibration,
            "layers": [
                {
                    "source_layers": list(layer.source_layers),
                    "inputs": layer.inputs.tolist(),
                    "r2_key": _json_float(layer.r2_key),
                    "r2_value": _json_float(layer.r2_value),
                }
                for layer in self.layers
            ],
            "tensors": described,
        }
        if self.fingerprints:
            meta["fingerprints"] = dict(self.fingerprints)
        refined = [i for i, layer in enumerate(self.layers) if layer.refinement is not None]
        if refined:
            rank = self.layers[refined[0]].refinement.rank
            meta["refinement"] = {**self.refinement, "rank": rank, "layers": refined}
        from bridgecache.artifacts.card import render_card

        created = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        clean_leftovers(directory)
        try:
            with staging_folder(directory) as staging:
                tensors_tmp, card_tmp, json_tmp = staging / tensors_file, staging / _CARD, staging / _JSON
                save_file(tensors, str(tensors_tmp))
                card_tmp.write_text(render_card(self))
                json_tmp.write_text(json.dumps(meta, indent=1))
                with directory_lock(directory):  # the commit: short, one writer at a time
                    if not overwrite and (directory / _JSON).exists():
                        raise FileExistsError(
                            f"{directory} already holds a bridge (another writer saved one meanwhile); "
                            "refusing to overwrite it"
                        )
                    publish(tensors_tmp, directory / tensors_file)
                    publish(card_tmp, directory / _CARD)
                    publish(json_tmp, directory / _JSON, exclusive=not overwrite)  # the pointer moves last
                    _remove_unreferenced(directory, keep=tensors_file)
        except BaseException:
            if created:  # a folder this call made and nothing landed in: not left behind
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise
        return directory

    def push_to_hub(self, repo_id: str, **kwargs) -> str:
        """Upload this bridge (files + card) to a Hub repo; see `bridgecache.artifacts.hub.push_to_hub`."""
        from bridgecache.artifacts.hub import push_to_hub

        return push_to_hub(self, repo_id, **kwargs)

    def __repr__(self) -> str:
        from bridgecache.artifacts.summary import short_summary

        return short_summary(self)

    def _repr_markdown_(self) -> str:
        from bridgecache.artifacts.summary import markdown_summary

        return markdown_summary(self)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path, device: str | torch.device = "cpu", **hub_kwargs
    ) -> Bridge:
        """Load and validate a bridge; any inconsistency raises BridgeFormatError.

        name_or_path: a bridge directory, "builtin:SOURCE->TARGET" (shipped with bridgecache) or a
            Hub repo id "org/name" (hub_kwargs: revision, cache_dir, token, local_files_only).
        Stored float16/bfloat16 maps are upcast to float32.
        """
        from bridgecache.artifacts.resolve import check_fingerprints, resolve_bridge

        directory = resolve_bridge(name_or_path, **hub_kwargs)
        meta, tensors = _read_files(directory)
        _tidy(directory, meta)
        _check_tensors(meta, tensors, directory)
        try:
            source, target = ModelSpec.from_dict(meta["source"]), ModelSpec.from_dict(meta["target"])
        except (KeyError, TypeError) as err:
            raise BridgeFormatError(
                f"{directory / _JSON}: field 'source'/'target' is not a model spec ({err})"
            ) from err
        layers = []
        for i, entry in enumerate(meta["layers"]):
            where = f"{directory / _JSON}: layers[{i}]"
            t = {name: _as_fp32(tensors[f"layers.{i}.{name}"]).to(device) for name in _FIELDS}
            if t["inputs"].tolist() != _get(entry, "inputs", where):
                raise BridgeFormatError(
                    f"{directory}: layers.{i}.inputs differs between {_JSON} and its tensors file"
                )
            refinement = None
            if i in meta.get("refinement", {}).get("layers", []):
                prefix = f"layers.{i}.refinement."
                refinement = LayerRefinement(
                    **{name: _as_fp32(tensors[prefix + name]).to(device) for name in REFINE_FIELDS}
                )
            layers.append(
                LayerMap(
                    source_layers=[int(s) for s in _get(entry, "source_layers", where)],
                    r2_key=_from_json_float(_get(entry, "r2_key", where)),
                    r2_value=_from_json_float(_get(entry, "r2_value", where)),
                    refinement=refinement,
                    **t,
                )
            )
        bridge = cls(
            source=source,
            target=target,
            method=meta["method"],
            alignment_policy=meta["alignment_policy"],
            layers=layers,
            native_head=meta["native_head"],
            calibration=meta["calibration"],
            fingerprints=meta.get("fingerprints", {}),
            refinement={k: v for k, v in meta.get("refinement", {}).items() if k != "layers"},
        )
        _check_layer_shapes(bridge, directory)
        check_fingerprints(bridge, directory)  # a built-in bridge loads only against its zoo models
        return bridge


# ---------------------------------------------------------------------- validation helpers


def tensors_path(directory: str | Path) -> Path:
    """The tensors file that `directory`'s bridge.json names (bridge.safetensors before format 2)."""
    directory = Path(directory)
    meta = _read_json(directory / _JSON)
    return directory / meta.get("tensors_file", _TENSORS)


def _read_files(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """bridge.json and the tensors it names. A writer may replace the bridge between the two
    reads (and remove the old tensors): then bridge.json is read again."""
    for _ in range(5):
        meta = _read_json(directory / _JSON)
        path = directory / meta.get("tensors_file", _TENSORS)
        try:
            return meta, _read_tensors(path, set(meta["tensors"]))
        except FileNotFoundError:
            if _read_json(directory / _JSON) == meta:  # not a concurrent replacement: really missing
                break
    raise BridgeFormatError(f"no bridge tensors at {path} (named by {directory / _JSON})")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise BridgeFormatError(f"no bridge metadata at {path} (is this a bridge directory?)")
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise BridgeFormatError(
            f"{path} has {size:,} bytes; a bridge's metadata has at most {MAX_JSON_BYTES:,}"
        )
    try:
        meta = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise BridgeFormatError(
            f"{path} is not valid JSON (truncated or corrupted?): {printable(str(err), 200)}"
        ) from err
    if not isinstance(meta, dict) or meta.get("format") != "bridgecache.bridge":
        raise BridgeFormatError(f"{path}: field 'format' is not 'bridgecache.bridge'")
    if meta.get("format_version") not in (1, FORMAT_VERSION):
        raise BridgeFormatError(
            f"{path}: field 'format_version' is {printable(repr(meta.get('format_version')), 60)}; "
            f"this bridgecache reads 1 and {FORMAT_VERSION}"
        )
    check_bridge_json(meta, path)
    return meta


def _read_tensors(path: Path, described: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of `path` (FileNotFoundError if it is gone; BridgeFormatError if unreadable).
    Its header is bounded by, and its tensor names must be, those bridge.json describes, before
    any tensor is built (a file of a million empty tensors costs nothing)."""
    if not path.exists():
        raise FileNotFoundError(path)
    try:
        with open(path, "rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
        limit = 512 * len(described) + 65536  # a tensor's entry takes ~150 bytes
        if header_bytes > limit:
            raise BridgeFormatError(
                f"{path}: its header has {header_bytes:,} bytes; {len(described)} tensors need "
                f"at most {limit:,}"
            )
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
        if names != described:
            missing, extra = sorted(described - names), sorted(names - described)
            raise BridgeFormatError(
                f"{path}: tensors {shown(missing, 120)} are missing and {len(extra)} are not described "
                f"by bridge.json (e.g. {shown(extra[:3], 120)})"
            )
        return load_file(str(path))
    except BridgeFormatError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        if isinstance(err, FileNotFoundError) or not path.exists():  # removed by a writer meanwhile
            raise FileNotFoundError(path) from err
        raise BridgeFormatError(
            f"{path} is not a readable safetensors file (truncated or corrupted?): {printable(str(err), 200)}"
        ) from err


def _tidy(directory: Path, meta: dict) -> None:
    """Remove what killed writers left in a bridge directory (best effort: it may be read-only).
    Folders others manage (the package's built-in bridges, a Hub cache snapshot) are left alone."""
    from bridgecache.artifacts.builtin import builtin_root

    resolved = directory.resolve()
    if resolved.parent.name == "snapshots" or resolved.is_relative_to(builtin_root()):
        return
    clean_leftovers(directory)
    with contextlib.suppress(OSError, BridgeFormatError), directory_lock(directory, blocking=False) as locked:
        if locked and _read_json(directory / _JSON) == meta:  # still the bridge just read
            _remove_unreferenced(directory, meta.get("tensors_file", _TENSORS))


def _remove_unreferenced(directory: Path, keep: str) -> None:
    """Delete tensors files of replaced bridges (the caller holds the directory lock)."""
    for path in directory.iterdir():
        if path.name != keep and TENSORS_FILE.fullmatch(path.name):
            with contextlib.suppress(OSError):
                path.unlink()


def _tensors_name(meta: dict, directory: Path) -> Path:
    return directory / meta.get("tensors_file", _TENSORS)


def _check_tensors(meta: dict, tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Every described tensor exists with its shape, dtype and sha256, and holds finite numbers
    (a NaN or Inf in a map turns every translated row into NaN); nothing extra."""
    described = meta["tensors"]
    expected_names = {f"layers.{i}.{name}" for i in range(len(meta["layers"])) for name in _FIELDS}
    refined = meta.get("refinement", {}).get("layers", [])
    expected_names |= {f"layers.{i}.refinement.{name}" for i in refined for name in REFINE_FIELDS}
    if set(described) != expected_names:
        raise BridgeFormatError(
            f"{directory / _JSON}: field 'tensors' does not list one set of maps per layer"
        )
    for name in sorted(expected_names):
        if name not in tensors:
            raise BridgeFormatError(f"{_tensors_name(meta, directory)}: tensor {name!r} is missing")
        t, want = tensors[name], described[name]
        if list(t.shape) != want["shape"]:
            raise BridgeFormatError(
                f"tensor {name!r}: shape {list(t.shape)} but {_JSON} says {want['shape']}"
            )
        if str(t.dtype).removeprefix("torch.") != want["dtype"]:
            raise BridgeFormatError(f"tensor {name!r}: dtype {t.dtype} but {_JSON} says {want['dtype']}")
        if _tensor_sha(t) != want["sha256"]:
            raise BridgeFormatError(
                f"tensor {name!r}: checksum mismatch (the file was modified or corrupted)"
            )
        if t.is_floating_point() and not all_finite(t):
            bad = int((~torch.isfinite(t)).sum())
            raise BridgeFormatError(
                f"{_tensors_name(meta, directory)}: tensor {name!r} holds {bad} NaN or infinite "
                "values; expected finite numbers (a map with them turns every translated row into NaN)"
            )
    extra = sorted(set(tensors) - expected_names)
    if extra:
        raise BridgeFormatError(
            f"{_tensors_name(meta, directory)}: {len(extra)} unexpected tensors, e.g. "
            f"{printable(repr(extra[:3]), 200)}"
        )


def _check_layer_shapes(bridge: Bridge, directory: Path) -> None:
    """The maps' shapes agree with the source and target specs."""
    src, tgt = bridge.source, bridge.target
    for i, layer in enumerate(bridge.layers):
        heads, n_in = layer.inputs.shape[:2]
        expected = {
            "inputs": (tgt.num_kv_heads, n_in, 2),
            "key_weight": (tgt.num_kv_heads, n_in * src.head_dim, tgt.head_dim),
            "value_weight": (tgt.num_kv_heads, n_in * src.head_dim, tgt.head_dim),
            "key_bias": (tgt.num_kv_heads, tgt.head_dim),
            "value_bias": (tgt.num_kv_heads, tgt.head_dim),
        }
        for name, shape in expected.items():
            got = tuple(getattr(layer, name).shape)
            if got != shape:
                raise BridgeFormatError(
                    f"{directory}: layers.{i}.{name} has shape {got}; the specs imply {shape}"
                )
        for name in _FIELDS[1:]:
            if getattr(layer, name).dtype != torch.float32:
                raise BridgeFormatError(
                    f"{directory}: layers.{i}.{name} is {getattr(layer, name).dtype}, not float32"
                )
        src_layer, src_head = layer.inputs[..., 0], layer.inputs[..., 1]
        if heads and (int(src_layer.min()) < 0 or int(src_layer.max()) >= src.num_layers):
            raise BridgeFormatError(
                f"{directory}: layers.{i}.inputs names a source layer outside the source model"
            )
        if heads and (int(src_head.min()) < 0 or int(src_head.max()) >= src.num_kv_heads):
            raise BridgeFormatError(
                f"{directory}: layers.{i}.inputs names a source head outside the source model"
            )
        if sorted(set(src_layer.flatten().tolist())) != sorted(layer.source_layers):
            raise BridgeFormatError(f"{directory}: layers.{i}.source_layers disagrees with layers.{i}.inputs")
        if layer.refinement is not None:
            rank = bridge.refinement.get("rank")
            shapes = refinement_shapes(tgt.num_kv_heads, n_in * src.head_dim, rank, tgt.head_dim)
            for name, shape in shapes.items():
                got = tuple(getattr(layer.refinement, name).shape)
                if got != shape:
                    raise BridgeFormatError(
                        f"{directory}: layers.{i}.refinement.{name} has shape {got}; "
                        f"the specs and refinement.rank {rank} imply {shape}"
                    )


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    # Shipped bridges store their maps in float16/bfloat16; the maps are applied in float32.
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _get(entry, key: str, where: str):
    if not isinstance(entry, dict) or key not in entry:
        raise BridgeFormatError(f"{where}: field {key!r} is missing")
    return entry[key]


def _as_spec(model_or_spec, tokenizer=None) -> ModelSpec:
    if isinstance(model_or_spec, ModelSpec):
        return model_or_spec
    if hasattr(model_or_spec, "config"):
        return model_spec(model_or_spec, tokenizer)
    raise SpecMismatchError(
        f"expected a transformers model or a ModelSpec, got {type(model_or_spec).__name__}"
    )


def _check_fingerprint(recorded: str | None, model_or_spec, role: str, strict: bool) -> None:
    if recorded is None or isinstance(model_or_spec, ModelSpec):
        return
    got = weight_fingerprint(model_or_spec)
    if got == recorded:
        return
    message = (
        f"the {role} model's weights (fingerprint {got}) are not the ones this bridge was fitted on "
        f"(expected {recorded}): same architecture, other checkpoint (a fine-tune?); the maps may not fit it"
    )
    if strict:
        raise SpecMismatchError(message)
    warnings.warn(message, WeightMismatchWarning, stacklevel=3)


def _tensor_sha(t: torch.Tensor) -> str:
    # Hash the raw bytes (any dtype) through a uint8 view; 16 hex digits suffice to catch corruption.
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()[:16]


def _json_float(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _from_json_float(x) -> float:
    return math.nan if x is None else float(x)


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.4f}"
