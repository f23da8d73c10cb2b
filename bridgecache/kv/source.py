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
import re
import warnings
from dataclasses import dataclass, field

import torch

from bridgecache.kv.rope import RopeTables, unrotate
from bridgecache.models.spec import ModelSpec, SpecMismatchError, WeightMismatchWarning
from bridgecache.untrusted import printable

__all__ = [
    "SourceKV",
    "KVFileError",
    "KVMismatchError",
    "check_mask",
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
    model, fingerprint: the ModelSpec and weight fingerprint (bridgecache.models.fingerprint) of the model
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
        check_mask(self.attention_mask, tuple(self.position_ids.shape), "source attention_mask")

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
        return unrotate(keys, cos.to(keys.device), sin.to(keys.device), self.rope.layout)

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


def check_mask(mask: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
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
        from bridgecache.models.fingerprint import weight_fingerprint
        from bridgecache.models.spec import model_spec

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
    check_mask(attention_mask, (batch, tokens), "source attention_mask")
    mask = attention_mask.to(device=keys.device, dtype=torch.long)
    return mask, position_ids_from_mask(mask)
