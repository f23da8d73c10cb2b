"""SourceKV: a source model's context KV, read-only, from whatever the caller has.

Accepted sources: a transformers cache after the source's forward pass (`DynamicCache`), a
`CapturedKV`, per-layer `(keys, values)` tensors, or a file written by `save_kv` (safetensors:
this is how a context moves between processes or machines). Nothing here ever writes into the
caller's tensors: bridging reads them, and the source cache stays usable by the source model.

Shapes: keys/values per layer [batch, kv_heads, tokens, head_dim] (keys post-RoPE, as cached);
position_ids [batch, tokens]. A sliding-window source layer may hold only its last tokens:
`first_token[l]` says which context token its row 0 is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from bridgecache.capture import CapturedKV, position_ids_from_mask
from bridgecache.files import apply_umask

__all__ = ["SourceKV", "as_source", "save_kv", "load_kv", "KVFileError"]

_KV_FORMAT = "bridgecache.kv/2"  # /2: a sha256 of all tensors in the header, verified on load


class KVFileError(ValueError):
    """A KV file is missing, truncated, corrupted or not a bridgecache KV file."""


@dataclass(frozen=True)
class SourceKV:
    """Per-layer source keys/values of one context (never mutated).

    keys[l], values[l]: [batch, kv_heads, kept_tokens_l, head_dim]; row r is context token
    first_token[l] + r. position_ids: [batch, tokens] of the whole context.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    position_ids: torch.Tensor
    first_token: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_tokens(self) -> int:
        return self.position_ids.shape[-1]

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


def as_source(source, attention_mask: torch.Tensor | None = None) -> SourceKV:
    """A `SourceKV` view of a cache, a CapturedKV, per-layer (k, v) pairs, or a KV file path.

    attention_mask: [batch, tokens] 0/1 for left-padded batches (positions follow generate()).
    """
    if isinstance(source, SourceKV):
        return source
    if isinstance(source, (str, Path)):
        return load_kv(source)
    if isinstance(source, CapturedKV):
        keys, values, positions = source.keys, source.values, source.position_ids
        return SourceKV(tuple(keys), tuple(values), positions, (0,) * len(keys))
    if hasattr(source, "layers"):  # a transformers Cache
        return _from_cache(source, attention_mask)
    if isinstance(source, (list, tuple)) and source and all(len(p) == 2 for p in source):
        keys = tuple(k for k, _ in source)
        values = tuple(v for _, v in source)
        return SourceKV(keys, values, _positions(keys[0], attention_mask), (0,) * len(keys))
    raise TypeError(
        f"cannot read source KV from {type(source).__name__}: expected a transformers Cache, a "
        "CapturedKV, a list of (keys, values) per layer, or a path written by save_kv"
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
        positions = torch.arange(total_tokens, device=longest.device).expand(longest.shape[0], total_tokens)
    else:
        positions = _positions(longest, attention_mask)
    return SourceKV(tuple(keys), tuple(values), positions, tuple(first))


def _positions(keys: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    batch, _, tokens, _ = keys.shape
    if attention_mask is None:
        return torch.arange(tokens, device=keys.device).expand(batch, tokens)
    if tuple(attention_mask.shape) != (batch, tokens):
        raise ValueError(
            f"source attention_mask has shape {tuple(attention_mask.shape)}; expected {(batch, tokens)}"
        )
    return position_ids_from_mask(attention_mask.to(keys.device))


def save_kv(path: str | Path, source, attention_mask: torch.Tensor | None = None, **metadata: str) -> Path:
    """Write a context's source KV to one safetensors file.

    The header holds the format, the layer count, each layer's first token, a sha256 of every
    tensor (verified by `load_kv`) and any `metadata` given. The file gets the umask's mode.
    """
    kv = as_source(source, attention_mask)
    tensors = {"position_ids": kv.position_ids.contiguous().cpu()}
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
    return SourceKV(keys, values, tensors["position_ids"].to(device), first)


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
