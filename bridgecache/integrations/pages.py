"""The page store: a directory of translated contexts that engines read pages from, verified.

Layout: per context `<id>.safetensors` (tensors "keys", "values": [layers, kv_heads,
pages * page_size, head_dim], all KV heads, in the engine's dtype) and `<id>.json` (the manifest:
page keys, page size, shapes, dtype, served model name, specs, sha256 of the tensor file). The
manifest is written last, so a reader never indexes a half-written context; a tensor file whose
sha256 or shapes differ from its manifest is refused, never loaded. Every page key read from a
manifest must be 64 hex digits (`keys.check_page_key`) before it names anything.

Files are created under an unpredictable temporary name opened with O_CREAT | O_EXCL |
O_NOFOLLOW (never through a planted file or symlink), with mode 0666 minus the umask (as
`open()` would), then renamed into place.

`publish.py` fills the store; `sglang.py` and `vllm.py` read it inside the engines; this module
knows nothing about any engine's classes or about translation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from bridgecache.integrations.keys import EngineMismatchError, bridge_fingerprint, check_page_key

__all__ = [
    "FORMAT",
    "VERSION",
    "EngineMismatchError",
    "Manifest",
    "PageFormatError",
    "PageStore",
    "bridge_fingerprint",  # lives in keys; importable from here as before
    "check_engine",
    "read_context",
    "read_manifest",
    "write_new_file",
]

logger = logging.getLogger(__name__)
FORMAT = "bridgecache-kv-pages"
VERSION = 1
TEMP_PREFIX = ".tmp-"  # never *.json: a reader skips these


class PageFormatError(ValueError):
    """A page store file is missing, truncated, corrupted or not ours."""


@dataclass(frozen=True)
class Manifest:
    """One published context, as read from `<id>.json`."""

    path: Path
    cache_salt: str
    page_size: int
    page_keys: tuple[str, ...]
    token_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model_type: str
    model_name: str
    sha256: str
    meta: dict

    @property
    def tensor_path(self) -> Path:
        return self.path.with_suffix(".safetensors")

    @property
    def num_tokens(self) -> int:
        return len(self.page_keys) * self.page_size


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PageFormatError(f"unknown dtype {name!r}")
    return dtype


def read_manifest(path: Path) -> Manifest:
    """The manifest at `path`, checked (PageFormatError when it is not one of ours or garbled)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PageFormatError(f"{path} is not a readable JSON manifest: {err}") from err
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise PageFormatError(
            f"{path} is not a bridgecache page manifest (format {got!r}, expected {FORMAT!r})"
        )
    if d.get("version") != VERSION:
        raise PageFormatError(f"{path} has version {d.get('version')!r}; this bridgecache reads {VERSION}")
    try:
        m = Manifest(
            path=path,
            cache_salt=str(d["cache_salt"]),
            page_size=int(d["page_size"]),
            page_keys=tuple(d["page_keys"]),
            token_ids=tuple(int(t) for t in d["token_ids"]),
            num_layers=int(d["num_layers"]),
            num_kv_heads=int(d["num_kv_heads"]),
            head_dim=int(d["head_dim"]),
            dtype=str(d["dtype"]),
            model_type=str(d["target"]["model_type"]),
            model_name=d.get("model_name"),
            sha256=str(d["sha256"]),
            meta=d,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise PageFormatError(f"{path} lacks or garbles manifest field {err}") from err
    for i, key in enumerate(m.page_keys):
        try:
            check_page_key(key, f"page_keys[{i}]")
        except ValueError as err:
            raise PageFormatError(f"{path}: {err}") from None
    if not isinstance(m.model_name, str) or not m.model_name:
        raise PageFormatError(
            f"{path} names no served model (model_name {m.model_name!r}); publish it again with model_name="
        )
    if len(m.token_ids) != m.num_tokens or not m.page_keys:
        raise PageFormatError(
            f"{path}: {len(m.token_ids)} token ids for {len(m.page_keys)} pages of {m.page_size}"
        )
    _torch_dtype(m.dtype)
    return m


class PageStore:
    """A directory of published contexts; finds pages by key and reads them (verified).

    keys/values of a page: [layers, kv_heads, page_size, head_dim], all KV heads."""

    def __init__(self, directory: str | os.PathLike, max_open: int = 8):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"no page store directory at {self.directory}")
        self.max_open = max_open
        self._manifests: dict[Path, Manifest] = {}
        self._index: dict[str, tuple[Manifest, int]] = {}
        self._open: OrderedDict[Path, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._bad: set[Path] = set()
        self.refresh()

    @property
    def manifests(self) -> list[Manifest]:
        return list(self._manifests.values())

    def refresh(self, strict: bool = True) -> list[Manifest]:
        """Index manifests written since the last call; returns the new ones.

        strict=False (what engines call while serving) logs an unreadable manifest and skips it
        from then on instead of raising."""
        new = []
        for path in sorted(self.directory.glob("*.json")):
            if path in self._manifests or path in self._bad or path.name.startswith("."):
                continue
            try:
                manifest = read_manifest(path)
            except PageFormatError as err:
                if strict:
                    raise
                logger.error("page store: skipping %s", err)
                self._bad.add(path)
                continue
            self._manifests[path] = manifest
            for i, key in enumerate(manifest.page_keys):
                self._index.setdefault(key, (manifest, i))
            new.append(manifest)
        return new

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def locate(self, key: str) -> tuple[Manifest, int] | None:
        return self._index.get(key)

    def page(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [layers, kv_heads, page_size, head_dim] of the page stored under `key`.

        Raises KeyError (not stored) or PageFormatError (stored, but unreadable)."""
        found = self._index.get(key)
        if found is None:
            raise KeyError(f"page {key} is not in {self.directory}")
        manifest, i = found
        keys, values = self._tensors(manifest)
        cols = slice(i * manifest.page_size, (i + 1) * manifest.page_size)
        return keys[:, :, cols], values[:, :, cols]

    def _tensors(self, manifest: Manifest) -> tuple[torch.Tensor, torch.Tensor]:
        if manifest.path in self._open:
            self._open.move_to_end(manifest.path)
            return self._open[manifest.path]
        tensors = read_context(manifest)
        self._open[manifest.path] = tensors
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return tensors


def read_context(manifest: Manifest) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys, values [layers, kv_heads, tokens, head_dim] of a context, checked against its
    manifest (sha256 of the file, names, shapes, dtype) before anything is returned."""
    path = manifest.tensor_path
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise PageFormatError(f"{path} (named by {manifest.path.name}) cannot be read: {err}") from err
    sha = hashlib.sha256(raw).hexdigest()
    if sha != manifest.sha256:
        raise PageFormatError(f"{path} has sha256 {sha[:16]}..., its manifest says {manifest.sha256[:16]}...")
    try:
        tensors = load_safetensors(raw)
    except (SafetensorError, ValueError) as err:
        raise PageFormatError(f"{path} is not a readable safetensors file: {err}") from err
    expected = (manifest.num_layers, manifest.num_kv_heads, manifest.num_tokens, manifest.head_dim)
    dtype = _torch_dtype(manifest.dtype)
    for name in ("keys", "values"):
        t = tensors.get(name)
        if t is None or tuple(t.shape) != expected or t.dtype != dtype:
            got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise PageFormatError(f"{path}: tensor {name!r} is {got}; expected {expected} {dtype}")
    return tensors["keys"], tensors["values"]


def write_new_file(path: str | os.PathLike, data: bytes | memoryview) -> Path:
    """Write `data` to `path` so that no reader sees half of it and nothing planted is followed.

    The bytes go to `.tmp-<random>.part` beside `path`, created with O_EXCL | O_NOFOLLOW (an
    existing file or symlink under that name is an error, never written through) and mode 0666
    minus the umask; then one rename replaces `path` (a symlink at `path` is replaced, not
    followed). On any error the temporary file is removed."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    tmp = path.parent / f"{TEMP_PREFIX}{secrets.token_hex(16)}.part"
    fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_engine(
    manifest: Manifest,
    *,
    engine: str,
    num_layers: int,
    num_kv_heads: int | None,
    head_dim: int,
    dtype: torch.dtype,
    page_size: int,
    model_type: str | None = None,
    model_names: tuple[str, ...] = (),
) -> None:
    """Raise EngineMismatchError naming every field where the pages do not fit the engine.

    num_kv_heads: the model's TOTAL KV heads (before tensor-parallel splitting); None when the
    engine only knows its rank's heads (check those with `keys.head_range`). model_names: the
    names the engine serves the model under (SGLang: one; vLLM: --served-model-name's); empty
    when the engine does not say."""
    wanted = {
        "num_layers": (manifest.num_layers, num_layers),
        "head_dim": (manifest.head_dim, head_dim),
        "dtype": (manifest.dtype, dtype_name(dtype)),
        "page_size": (manifest.page_size, page_size),
    }
    if num_kv_heads is not None:
        wanted["num_kv_heads"] = (manifest.num_kv_heads, num_kv_heads)
    if model_type is not None:
        wanted["model_type"] = (manifest.model_type, model_type)
    diffs = [f"{k}: pages have {a!r}, the engine has {b!r}" for k, (a, b) in wanted.items() if a != b]
    if model_names and manifest.model_name not in model_names:
        diffs.append(f"model_name: pages have {manifest.model_name!r}, the engine serves {list(model_names)}")
    if diffs:
        raise EngineMismatchError(
            f"{manifest.path} was published for another model than {engine} serves: " + "; ".join(diffs)
        )
