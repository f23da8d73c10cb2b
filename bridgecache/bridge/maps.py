"""Bridge: the per-layer affine maps that turn a source model's KV into a target model's.

A `Bridge` holds one `LayerMap` per target layer plus the identity (`ModelSpec`) of both models,
the method that fitted it, the token-alignment policy and a description of the calibration data.
It is a container: fitting lives in `bridgecache.fitting`, application in
`bridgecache.runtime.translation.layers`.

Files: `bridge.json` (metadata, per-tensor shape/dtype/sha256, and `tensors_file`: the name of
the tensors file) + `bridge-<16 hex>.safetensors` (the tensors; `bridge.safetensors` in bridges
written before format 2). A save writes a new tensors file beside the old one and then replaces
`bridge.json` in one rename: the pointer moves last, so a reader, a crash or a second writer
leaves the old bridge or the new one, never half. Loading validates everything against the
metadata and names the field that is wrong. No pickle.

This module knows nothing about tokenizers, calibration text or how the maps were fitted.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

import bridgecache.bridge.storage as storage
import bridgecache.checks as checks
from bridgecache.bridge.format import (
    METHODS,
    BridgeFormatError,
    printable,
)
from bridgecache.models.fingerprint import weight_fingerprint
from bridgecache.models.spec import ModelSpec, SpecMismatchError, WeightMismatchWarning, model_spec

__all__ = [
    "LayerMap",
    "Bridge",
    "BridgeFormatError",
    "WeightMismatchWarning",
    "FORMAT_VERSION",
    "METHODS",
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
    """

    source_layers: list[int]
    inputs: torch.Tensor
    key_weight: torch.Tensor
    key_bias: torch.Tensor
    value_weight: torch.Tensor
    value_bias: torch.Tensor
    r2_key: float = math.nan
    r2_value: float = math.nan

    @property
    def num_parameters(self) -> int:
        maps = (self.key_weight, self.key_bias, self.value_weight, self.value_bias)
        return sum(t.numel() for t in maps)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, name) for name in _FIELDS))


@dataclass
class Bridge:
    """Everything needed to map a source model's KV cache into a target model's cache space.

    method: "fullhead" | "cachebridge" | "identity".
    alignment_policy: "identity" (same tokenizer) or a tokenalign policy name.
    native_head: positions [0, native_head) the target computes itself (excluded from fitting).
    layers: one LayerMap per target layer.
    calibration: JSON-able description of the calibration data and fit settings.
    fingerprints: {"source": ..., "target": ...} weight fingerprints at fit time
        (`bridgecache.models.fingerprint`); empty for the identity and for older bridge files.
    """

    source: ModelSpec
    target: ModelSpec
    method: str
    alignment_policy: str
    layers: list[LayerMap]
    native_head: int = 1
    calibration: dict = field(default_factory=dict)
    fingerprints: dict = field(default_factory=dict)

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
                from bridgecache.models.spec import tokenizer_fingerprint

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

        Atomic as a whole (bridgecache.bridge.storage): a crash at any point leaves the old bridge
        (or none) loadable, concurrent writers leave one of their bridges, and overwrite=False
        refuses (FileExistsError) to replace a bridge already there, also against a writer that
        creates one meanwhile. Other files in `directory` are kept; files get the umask's mode.
        """
        return storage.write(self, directory, overwrite)

    def push_to_hub(self, repo_id: str, **kwargs) -> str:
        """Upload this bridge (files + card) to a Hub repo; see `bridgecache.bridge.hub.push_to_hub`."""
        from bridgecache.bridge.hub import push_to_hub

        return push_to_hub(self, repo_id, **kwargs)

    def __repr__(self) -> str:
        from bridgecache.bridge.summary import short_summary

        return short_summary(self)

    def _repr_markdown_(self) -> str:
        from bridgecache.bridge.summary import markdown_summary

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
        from bridgecache.bridge.resolve import check_fingerprints, resolve_bridge

        checks.path(name_or_path, "name_or_path")  # a name any lookup can take (bridgecache.checks)
        directory = resolve_bridge(name_or_path, **hub_kwargs)
        meta, tensors = storage.read(directory)
        try:
            source, target = ModelSpec.from_dict(meta["source"]), ModelSpec.from_dict(meta["target"])
        except (KeyError, TypeError) as err:
            raise BridgeFormatError(
                f"{directory / _JSON}: field 'source'/'target' is not a model spec ({err})"
            ) from err
        layers = [LayerMap(**fields) for fields in storage.layer_fields(meta, tensors, directory, device)]
        bridge = cls(
            source=source,
            target=target,
            method=meta["method"],
            alignment_policy=meta["alignment_policy"],
            layers=layers,
            native_head=meta["native_head"],
            calibration=meta["calibration"],
            fingerprints=meta.get("fingerprints", {}),
        )
        storage.check_layer_shapes(bridge, directory)
        check_fingerprints(bridge, directory)  # a built-in bridge loads only against its zoo models
        return bridge


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


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.4f}"
