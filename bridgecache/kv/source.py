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
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from bridgecache.files import apply_umask
from bridgecache.kv.rope import RopeTables, unrotate

__all__ = [
    "SourceKV",
    "as_source",
    "save_kv",
    "load_kv",
    "KVFileError",
    "check_mask",
    "position_ids_from_mask",
]

_KV_FORMAT = "bridgecache.kv/2"  # /2: a sha256 of all tensors in the header, verified on load


class KVFileError(ValueError):
    """A KV file is missing, truncated, corrupted or not a bridgecache KV file."""


@dataclass(frozen=True)
class SourceKV:
    """Per-layer keys/values of one context (never mutated).

    keys[l], values[l]: [batch, kv_heads, kept_tokens_l, head_dim] as cached (keys post-RoPE);
        row r is context token first_token[l] + r.
    attention_mask: [batch, tokens] int64, 0 on left padding, 1 on the context's tokens.
    position_ids: [batch, tokens] int64, the positions RoPE was applied at.
    first_token: per layer, the context token of row 0 (0 unless a sliding layer dropped rows).
    rope: the model's rotary tables (set by `capture_kv`; None for KV made elsewhere).
    token_ids: [batch, tokens] the context's token ids (set by `capture_kv`; None elsewhere).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    first_token: tuple[int, ...]
    rope: RopeTables | None = field(default=None, compare=False, repr=False)
    token_ids: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "values", tuple(self.values))
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
        return unrotate(keys, cos.to(keys.device), sin.to(keys.device))

    def check(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Raise ValueError unless every layer has the shape the bridge's source spec says."""
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


def as_source(source, attention_mask: torch.Tensor | None = None) -> SourceKV:
    """A `SourceKV` of a cache, per-layer (k, v) pairs, a KV file path, or a SourceKV itself.

    attention_mask: [batch, tokens] 0/1 for left-padded batches. A SourceKV (or file) carries its
    own mask; one given as well must agree with it.
    """
    if isinstance(source, (str, Path)):
        source = load_kv(source)
    if isinstance(source, SourceKV):
        if attention_mask is not None and not torch.equal(
            attention_mask.long().cpu(), source.attention_mask.long().cpu()
        ):
            raise ValueError(
                "source_attention_mask differs from the attention mask the source KV were captured with"
            )
        return source
    if hasattr(source, "layers"):  # a transformers Cache
        return _from_cache(source, attention_mask)
    if isinstance(source, (list, tuple)) and source and all(len(p) == 2 for p in source):
        keys = tuple(k for k, _ in source)
        values = tuple(v for _, v in source)
        mask, positions = _mask_and_positions(keys[0], attention_mask)
        return SourceKV(
            keys, values, attention_mask=mask, position_ids=positions, first_token=(0,) * len(keys)
        )
    raise TypeError(
        f"cannot read source KV from {type(source).__name__}: expected a transformers Cache, a "
        "SourceKV (capture_kv), a list of (keys, values) per layer, or a path written by save_kv"
    )


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


def save_kv(path: str | Path, source, attention_mask: torch.Tensor | None = None, **metadata: str) -> Path:
    """Write a context's source KV to one safetensors file.

    The header holds the format, the layer count, each layer's first token, a sha256 of every
    tensor (verified by `load_kv`) and any `metadata` given. The file gets the umask's mode.
    """
    kv = as_source(source, attention_mask)
    tensors = {"position_ids": kv.position_ids.contiguous().cpu()}
    tensors["attention_mask"] = kv.attention_mask.contiguous().cpu()
    for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
        tensors[f"keys.{layer}"] = k.contiguous().cpu()
        tensors[f"values.{layer}"] = v.contiguous().cpu()
    reserved = {"format", "num_layers", "first_token", "sha256"} & set(metadata)
    if reserved:
        raise ValueError(f"metadata keys {sorted(reserved)} are reserved by the KV file format")
    header = {k: str(v) for k, v in metadata.items()}
    header |= {
        "format": _KV_FORMAT,
        "num_layers": str(kv.num_layers),
        "first_token": json.dumps(kv.first_token),
        "sha256": _kv_digest(tensors),
    }
    path = Path(path)
    save_file(tensors, str(path), metadata=header)
    apply_umask(path)  # safetensors writes 0600; a shared cache needs the user's usual mode
    return path


def load_kv(path: str | Path, device: str | torch.device = "cpu") -> SourceKV:
    """Read a file written by `save_kv`; corrupted, malformed or foreign files raise KVFileError."""
    path = Path(path)
    if not path.exists():
        raise KVFileError(f"no KV file at {path}")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise KVFileError(
            f"{path} is not a readable safetensors file (truncated or corrupted?): {err}"
        ) from err
    n, first = _check_kv_header(path, header)
    missing = [f"{kind}.{i}" for i in range(n) for kind in ("keys", "values") if f"{kind}.{i}" not in tensors]
    if missing or "position_ids" not in tensors:
        raise KVFileError(f"{path} lacks tensors {missing or ['position_ids']} for its {n} layers")
    if _kv_digest(tensors) != header["sha256"]:
        raise KVFileError(
            f"{path}: checksum mismatch (sha256 in the header differs from the tensors'): corrupted"
        )
    _check_kv_shapes(path, tensors, n, first)
    keys = tuple(tensors[f"keys.{i}"].to(device) for i in range(n))
    values = tuple(tensors[f"values.{i}"].to(device) for i in range(n))
    positions = tensors["position_ids"].to(device)
    mask = tensors.get("attention_mask")
    mask = torch.ones_like(positions) if mask is None else mask.to(device)
    return SourceKV(keys, values, attention_mask=mask, position_ids=positions, first_token=first)


def _kv_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        hasher.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        hasher.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def _check_kv_header(path: Path, header: dict) -> tuple[int, tuple[int, ...]]:
    """(num_layers, first_token) from a KV file's header, or KVFileError naming the bad field."""
    fmt = header.get("format")
    if fmt == "bridgecache.kv/1":
        raise KVFileError(f"{path} was written by an older bridgecache without a checksum; save it again")
    if fmt != _KV_FORMAT:
        raise KVFileError(f"{path} is not a bridgecache KV file (format {fmt!r}, expected {_KV_FORMAT!r})")
    raw = header.get("num_layers")
    if raw is None or not raw.isdigit() or int(raw) < 1:
        raise KVFileError(f"{path}: header field 'num_layers' is {raw!r}; expected a positive integer")
    n = int(raw)
    try:
        first = json.loads(header.get("first_token", ""))
    except json.JSONDecodeError:
        first = header.get("first_token")
    if not isinstance(first, list) or len(first) != n or not all(type(x) is int and x >= 0 for x in first):
        raise KVFileError(
            f"{path}: header field 'first_token' is {header.get('first_token')!r}; "
            f"expected a JSON list of {n} integers >= 0"
        )
    sha = header.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        raise KVFileError(f"{path}: header field 'sha256' is {sha!r}; expected 64 hex digits")
    return n, tuple(first)


def _check_kv_shapes(path: Path, tensors: dict, n: int, first: tuple[int, ...]) -> None:
    """Keys and values agree per layer, are [batch, heads, rows, dim], and fit in the context."""
    positions = tensors["position_ids"]
    if positions.dim() != 2:
        raise KVFileError(
            f"{path}: position_ids has shape {tuple(positions.shape)}; expected [batch, tokens]"
        )
    batch, tokens = positions.shape
    for i in range(n):
        k, v = tensors[f"keys.{i}"], tensors[f"values.{i}"]
        if k.dim() != 4 or k.shape[0] != batch or k.shape[:3] != v.shape[:3]:
            raise KVFileError(
                f"{path}: layer {i} keys {tuple(k.shape)} / values {tuple(v.shape)}; expected "
                f"[batch={batch}, kv_heads, rows, head_dim] each, with the same rows"
            )
        if first[i] + k.shape[2] > tokens:
            raise KVFileError(
                f"{path}: layer {i} holds rows {first[i]}..{first[i] + k.shape[2] - 1} "
                f"of a {tokens}-token context"
            )
