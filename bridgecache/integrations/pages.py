"""Translated KV as engine pages: page keys, namespaces, the page store, engine checks.

A serving engine caches KV in fixed-size pages (SGLang `--page-size`, vLLM `--block-size`) and
finds a prefix by a chain of page hashes over the token ids. `publish` translates a context once
(a `BridgedCache`), cuts the positions the cache holds into full pages and writes them to a
`PageStore` directory under the target's page-hash chain, seeded by a bridge namespace:

    published = publish(cache, target_ids, "/srv/kv-pages", page_size=64, dtype=torch.bfloat16)
    # send `published.cache_salt` with the request (SGLang `cache_salt`, vLLM `cache_salt`)

Only positions [0, prefix_length) of the BridgedCache are ever published (the native head is in
there, computed by the target itself); the held-back last token and any native tail are not in
the cache, so the engine computes them, and a partial last page is left to the engine too.

Keys: SGLang 0.5.23's chain (mem_cache/utils.py `get_hash_str`, `storage_namespace_seed`): page
i's key is sha256(key of page i-1, or the namespace seed, || token ids as little-endian u32),
in hex. The seed comes from the request's (extra_key, cache_salt); our cache_salt names the
source, target, bridge and a user salt, so bridged pages can only answer a request that asked
for that translation, never another request's exact prefix lookup.

Store layout: per context `<id>.safetensors` (tensors "keys", "values": [layers, kv_heads,
pages * page_size, head_dim], all KV heads, in the engine's dtype) and `<id>.json` (the manifest:
page keys, page size, shapes, dtype, model specs, sha256 of the tensor file). The manifest is
written last, so a reader never indexes a half-written context; a tensor file whose sha256 or
shapes differ from its manifest is refused, never loaded.

This module knows nothing about any engine's classes: `sglang.py` and `vllm.py` adapt it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from bridgecache.bridge.builtin import check_models
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.handoff import align_context

__all__ = [
    "EngineMismatchError",
    "PageFormatError",
    "PageStore",
    "Published",
    "bridge_fingerprint",
    "bridge_salt",
    "check_engine",
    "head_range",
    "namespace_seed",
    "page_keys",
    "publish",
    "publish_context",
]

logger = logging.getLogger(__name__)
FORMAT = "bridgecache-kv-pages"
VERSION = 1
_U32_MAX = 2**32 - 1


class PageFormatError(ValueError):
    """A page store file is missing, truncated, corrupted or not ours."""


class EngineMismatchError(ValueError):
    """Published pages do not fit the engine's model (architecture, heads, head dim, dtype...)."""


# ---------------------------------------------------------------------------------- page keys


def namespace_seed(extra_key: str | None = None, cache_salt: str | None = None) -> str | None:
    """SGLang's `storage_namespace_seed`: the hex seed of a request's page-hash chain.

    None when the request carries neither field (then the chain starts unseeded)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def page_keys(token_ids: Sequence[int], page_size: int, seed: str | None = None) -> list[str]:
    """Hex keys of the FULL pages of `token_ids`, chained from `seed` (SGLang `get_hash_str`).

    A trailing partial page gets no key: only whole pages are ever published or looked up."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    tokens = [int(t) for t in token_ids]
    prior = bytes.fromhex(seed) if seed else None
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start : start + page_size]
        digest = hashlib.sha256()
        if prior is not None:
            digest.update(prior)
        if any(t < 0 for t in page):
            raise ValueError(f"token ids must be >= 0; page {start // page_size} has {min(page)}")
        if any(t > _U32_MAX for t in page):
            # SGLang's "wide" pages: a 0xff tag, then the ids as little-endian u64.
            digest.update(b"\xff" + struct.pack(f"<{len(page)}Q", *page))
        else:
            digest.update(struct.pack(f"<{len(page)}I", *page))
        prior = digest.digest()
        keys.append(prior.hex())
    return keys


def bridge_fingerprint(bridge) -> str:
    """sha256 over a bridge's specs, settings and every mapping tensor (hex)."""
    digest = hashlib.sha256()
    head = {
        "source": bridge.source.to_dict(),
        "target": bridge.target.to_dict(),
        "method": bridge.method,
        "alignment_policy": bridge.alignment_policy,
        "native_head": bridge.native_head,
    }
    digest.update(json.dumps(head, sort_keys=True).encode())
    for layer in bridge.layers:
        for tensor in (layer.inputs, layer.key_weight, layer.key_bias, layer.value_weight, layer.value_bias):
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def bridge_salt(bridge, salt: str = "") -> str:
    """The `cache_salt` a request sends to be served pages translated by `bridge`.

    Names the source, the target, the bridge (all its tensors) and a user salt (e.g. a tenant)."""
    digest = hashlib.sha256(b"bridgecache-namespace-v1\x00")
    digest.update(bridge_fingerprint(bridge).encode() + b"\x00" + salt.encode("utf-8"))
    return "bridgecache-" + digest.hexdigest()[:32]


def head_range(total_kv_heads: int, tp_rank: int, tp_size: int) -> range:
    """The KV heads tensor-parallel rank `tp_rank` of `tp_size` holds (both engines' rule:
    contiguous slices, or whole heads replicated when there are more ranks than heads)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside [0, tp_size={tp_size})")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise EngineMismatchError(f"{total_kv_heads} KV heads do not split over tp_size={tp_size}")
        per = total_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_kv_heads:
        raise EngineMismatchError(f"tp_size={tp_size} is not a multiple of the {total_kv_heads} KV heads")
    head = tp_rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


# ---------------------------------------------------------------------------------- the store


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
    model_name: str | None
    sha256: str
    meta: dict

    @property
    def tensor_path(self) -> Path:
        return self.path.with_suffix(".safetensors")

    @property
    def num_tokens(self) -> int:
        return len(self.page_keys) * self.page_size


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PageFormatError(f"unknown dtype {name!r}")
    return dtype


def _read_manifest(path: Path) -> Manifest:
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
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
            page_keys=tuple(str(k) for k in d["page_keys"]),
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
                manifest = _read_manifest(path)
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
        """keys, values [layers, kv_heads, page_size, head_dim] of the page stored under `key`."""
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


# ---------------------------------------------------------------------------------- publishing


@dataclass(frozen=True)
class Published:
    """What `publish` wrote: send `cache_salt` with the request; `num_tokens` = pages * page_size
    positions the engine may load; it computes the rest of the prompt itself."""

    cache_salt: str
    page_keys: tuple[str, ...]
    page_size: int
    num_tokens: int
    manifest_path: Path


def publish(
    cache,
    target_ids: torch.Tensor,
    directory: str | os.PathLike,
    *,
    page_size: int,
    salt: str = "",
    dtype: torch.dtype | None = None,
    model_name: str | None = None,
    accept: Callable[[object], bool] | None = None,
) -> Published | None:
    """Translate `cache` (a BridgedCache, batch 1) and write its full pages to `directory`.

    Args:
        cache: BridgedCache of the context; its bridge names the namespace.
        target_ids: [1, tokens] the context in the target's tokenization (as given to the cache).
        page_size: the engine's page size (SGLang `--page-size`, vLLM `--block-size`).
        salt: user salt mixed into the namespace (e.g. a tenant or a document version).
        dtype: the engine's KV dtype (default: the target model's dtype).
        model_name: the engine's served model name; SGLang's backend refuses other models.
        accept: quality gate: called with the materialised cache; False publishes nothing and
            returns None (the engine then computes the context itself). A BridgedCache built with
            a `min_quality` that refuses raises before anything is written.
    Returns:
        `Published`, or None when `accept` said no.
    """
    translator = cache.translator
    bridge = translator.bridge
    if target_ids.dim() != 2 or target_ids.shape[0] != 1:
        raise ValueError(
            f"target_ids has shape {tuple(target_ids.shape)}; publish takes one context [1, tokens]"
        )
    if translator.batch_size != 1:
        raise ValueError(
            f"the BridgedCache holds a batch of {translator.batch_size}; publish one context at a time"
        )
    sliding = [i for i, window in enumerate(translator.windows) if window is not None]
    if sliding:
        raise ValueError(
            f"target layers {sliding} use sliding-window attention: engine pools keep those layers "
            "apart and the cache keeps only the window, so pages cannot be published for this target"
        )
    prefix = translator.prefix_length
    num_pages = prefix // page_size
    if num_pages < 1:
        raise ValueError(
            f"the cache holds {prefix} positions (prefix_length), fewer than one page of {page_size}: "
            "nothing to publish"
        )
    cache.materialize()
    if accept is not None and not accept(cache):
        return None
    spec = bridge.target
    dtype = dtype or translator.home_dtype
    n = num_pages * page_size
    keys = torch.stack([layer.keys[0, :, :n] for layer in cache.layers]).to("cpu", dtype).contiguous()
    values = torch.stack([layer.values[0, :, :n] for layer in cache.layers]).to("cpu", dtype).contiguous()
    expected = (spec.num_layers, spec.num_kv_heads, n, spec.head_dim)
    if tuple(keys.shape) != expected:
        raise ValueError(f"materialised cache has shape {tuple(keys.shape)}; expected {expected}")

    cache_salt = bridge_salt(bridge, salt)
    tokens = [int(t) for t in target_ids[0, :n].tolist()]
    page_chain = page_keys(tokens, page_size, namespace_seed(None, cache_salt))
    raw = save_safetensors({"keys": keys, "values": values}, metadata={"format": FORMAT})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "cache_salt": cache_salt,
        "page_size": page_size,
        "page_keys": page_chain,
        "token_ids": tokens,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": _dtype_name(dtype),
        "model_name": model_name,
        "target": spec.to_dict(),
        "source": bridge.source.to_dict(),
        "bridge": {"fingerprint": bridge_fingerprint(bridge), "method": bridge.method},
        "positions": {"native_head": int(translator.head_end[0]), "prefix_length": prefix, "published": n},
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / page_chain[-1]
    _atomic_write(stem.with_suffix(".safetensors"), raw)
    _atomic_write(stem.with_suffix(".json"), json.dumps(manifest, indent=1).encode())  # last: commits
    return Published(cache_salt, tuple(page_chain), page_size, n, stem.with_suffix(".json"))


def publish_context(
    bridge,
    context: str,
    target,
    target_tokenizer,
    source_tokenizer,
    directory: str | os.PathLike,
    *,
    page_size: int,
    source=None,
    source_kv=None,
    config: HandoffConfig | None = None,
    **publish_kwargs,
) -> Published | None:
    """`publish` from text: tokenize and align the context for both models (as `handoff` does),
    run the source over it (or take its `source_kv`), translate once with `config` (default
    `HandoffConfig()`, as every path: no prompt is known yet, so the refresh is chosen by the
    source's reading of the context's last tokens) and publish.

    The engine's prompt must start with `target_tokenizer(context)`'s ids. publish_kwargs: salt,
    dtype, model_name, accept (see `publish`)."""
    check_models(bridge, source, target, source_tokenizer, target_tokenizer)
    alignment, source_ids, target_ids = align_context(bridge, context, source_tokenizer, target_tokenizer)
    if source_kv is None:
        if source is None:
            raise ValueError("pass either the source model or its KV of the context (source_kv=)")
        source_kv = capture_kv(source, source_ids)
    cache = BridgedCache(
        bridge, source_kv, target, target_ids, config=config, alignment=alignment, source_model=source
    )
    return publish(cache, target_ids, directory, page_size=page_size, **publish_kwargs)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".part")  # never *.json
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------- engine checks


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
    model_name: str | None = None,
) -> None:
    """Raise EngineMismatchError naming every field where the pages do not fit the engine.

    num_kv_heads: the model's TOTAL KV heads (before tensor-parallel splitting); None when the
    engine only knows its rank's heads (check those with `head_range`)."""
    wanted = {
        "num_layers": (manifest.num_layers, num_layers),
        "head_dim": (manifest.head_dim, head_dim),
        "dtype": (manifest.dtype, _dtype_name(dtype)),
        "page_size": (manifest.page_size, page_size),
    }
    if num_kv_heads is not None:
        wanted["num_kv_heads"] = (manifest.num_kv_heads, num_kv_heads)
    if model_type is not None:
        wanted["model_type"] = (manifest.model_type, model_type)
    if model_name is not None and manifest.model_name is not None:
        wanted["model_name"] = (manifest.model_name, model_name)
    diffs = [f"{k}: pages have {a!r}, the engine has {b!r}" for k, (a, b) in wanted.items() if a != b]
    if diffs:
        raise EngineMismatchError(
            f"{manifest.path} was published for another model than {engine} serves: " + "; ".join(diffs)
        )
