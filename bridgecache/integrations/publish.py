"""Publishing: translate a context once and put its full pages where an engine will find them.

    published = publish(cache, target_ids, "/srv/kv-pages", page_size=64,
                        model_name="Qwen/Qwen2.5-Coder-0.5B-Instruct", dtype=torch.bfloat16)
    # send `published.cache_salt` with the request (SGLang and vLLM: `cache_salt`)

`destination` is one of
- a directory: the page store (`pages.py`), read by bridgecache's SGLang backend and vLLM
  connector;
- a SGLang `HiCacheStorage` (or a list of them, one per tensor-parallel rank, each built from
  SGLang's own `HiCacheStorageConfig`), with `layout=` the engine's `--hicache-mem-layout`: the
  pages go through that backend's own `batch_set` / `batch_set_v1` (`hicache.py`), so a fleet's
  file, 3FS, Mooncake, ... store serves them with no bridgecache code in the engine;
- any object with `write_pages(pages)`, e.g. `lmcache.LMCachePublisher` (vLLM + LMCache fleets).

Only positions [0, prefix_length) of the BridgedCache are ever published (the native head is in
there, computed by the target itself); the held-back last token and any native tail are not in
the cache, so the engine computes them, and a partial last page is left to the engine too.

`translate_context` is the one place where a BridgedCache is built from text for publishing.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from bridgecache.integrations.keys import bridge_fingerprint, bridge_salt, namespace_seed, page_keys
from bridgecache.integrations.pages import (
    FORMAT,
    VERSION,
    Manifest,
    PageFormatError,
    dtype_name,
    read_context,
    read_manifest,
    write_new_file,
)
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.engine import engine_for

_HICACHE_STORAGE_MODULE = "sglang.srt.mem_cache.hicache_storage"  # where HiCacheStorage lives (hicache.py)

__all__ = [
    "BridgedPages",
    "Published",
    "bridged_pages",
    "publish",
    "publish_context",
    "stored_pages",
    "translate_context",
    "write_page_store",
]


@dataclass(frozen=True)
class BridgedPages:
    """A translated context cut into whole engine pages (CPU tensors, the engine's dtype).

    keys, values: [layers, kv_heads, pages * page_size, head_dim], all KV heads.
    page_keys[i]: SGLang's chained key of page i in the namespace of `cache_salt`."""

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: tuple[int, ...]
    page_size: int
    cache_salt: str
    page_keys: tuple[str, ...]
    model_name: str
    meta: dict = field(default_factory=dict)

    @property
    def num_pages(self) -> int:
        return len(self.page_keys)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def page(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [layers, kv_heads, page_size, head_dim] of page i."""
        cols = slice(i * self.page_size, (i + 1) * self.page_size)
        return self.keys[:, :, cols], self.values[:, :, cols]


@dataclass(frozen=True)
class Published:
    """What `publish` wrote: send `cache_salt` with the request; `num_tokens` = pages * page_size
    positions the engine may load; it computes the rest of the prompt itself. `location`: the
    manifest for a page store, else what the destination reported."""

    cache_salt: str
    page_keys: tuple[str, ...]
    page_size: int
    num_tokens: int
    location: object

    @property
    def manifest_path(self) -> Path:
        if not isinstance(self.location, Path):
            raise AttributeError(f"published to {type(self.location).__name__}, not to a page store")
        return self.location


def check_publish_arguments(*, page_size, model_name=None, salt="", dtype=None, accept=None) -> None:
    """Refuse a bad publishing argument before anything is translated or written."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size is {page_size!r}; expected an integer >= 1 (the engine's page size)")
    if not isinstance(salt, str):
        raise TypeError(f"salt is {salt!r}; expected a str (the empty string for no user salt)")
    if model_name is not None and (not isinstance(model_name, str) or not model_name):
        raise ValueError(
            f"model_name is {model_name!r}; expected the name the engine serves the target under "
            "(or None: the target model's own name)"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(
            f"dtype is {dtype!r}; expected a floating torch.dtype (the engine's KV dtype) or None"
        )
    if accept is not None and not callable(accept):
        raise TypeError(f"accept is a {type(accept).__name__}; expected a callable (cache) -> bool, or None")


def bridged_pages(
    cache,
    target_ids: torch.Tensor,
    *,
    page_size: int,
    model_name: str | None = None,
    salt: str = "",
    dtype: torch.dtype | None = None,
    accept: Callable[[object], bool] | None = None,
) -> BridgedPages | None:
    """Materialise `cache` (a BridgedCache, batch 1) and cut its full pages.

    target_ids: [1, tokens] the context in the target's tokenization (as given to the cache).
    model_name: the engine's served model name (SGLang `--served-model-name`, else
    `--model-path`); default: the target model's own name (`config._name_or_path`); an error
    when neither exists, since the engine's served-model check needs it. Returns None when
    `accept(cache)` says no (then nothing is published)."""
    check_publish_arguments(page_size=page_size, model_name=model_name, salt=salt, dtype=dtype, accept=accept)
    if not isinstance(target_ids, torch.Tensor):
        raise TypeError(f"target_ids is a {type(target_ids).__name__}; expected a tensor [1, tokens]")
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
    model_name = model_name or getattr(translator.target_config, "_name_or_path", "") or ""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(
            "publish needs model_name: the name the engine serves the target under (SGLang "
            "--served-model-name, else --model-path); the target model has no name to derive it from"
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
    cache_salt = bridge_salt(bridge, salt, config=cache.handoff_config)
    tokens = tuple(int(t) for t in target_ids[0, :n].tolist())
    meta = {
        "target": spec.to_dict(),
        "source": bridge.source.to_dict(),
        "bridge": {"fingerprint": bridge_fingerprint(bridge), "method": bridge.method},
        "recipe": cache.handoff_config.kv_recipe,
        # the cost gate's route: "native" pages hold the target's own (exact) KV of the context
        "route": cache.report().route,
        "positions": {"native_head": int(translator.head_end[0]), "prefix_length": prefix, "published": n},
    }
    chain = page_keys(tokens, page_size, namespace_seed(None, cache_salt))
    return BridgedPages(keys, values, tokens, page_size, cache_salt, tuple(chain), model_name, meta)


def stored_pages(manifest: Manifest) -> BridgedPages:
    """The pages of one page-store context (read and verified: `pages.read_context`)."""
    keys, values = read_context(manifest)
    meta = {k: manifest.meta[k] for k in ("target", "source", "bridge", "positions") if k in manifest.meta}
    return BridgedPages(
        keys, values, manifest.token_ids, manifest.page_size, manifest.cache_salt, manifest.page_keys,
        manifest.model_name, meta,
    )  # fmt: skip


def write_page_store(pages: BridgedPages, directory: str | os.PathLike) -> Path:
    """Write `pages` as one context of the page store in `directory`; returns its manifest."""
    raw = save_safetensors({"keys": pages.keys, "values": pages.values}, metadata={"format": FORMAT})
    layers, heads, _, head_dim = pages.keys.shape
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "cache_salt": pages.cache_salt,
        "page_size": pages.page_size,
        "page_keys": list(pages.page_keys),
        "token_ids": list(pages.token_ids),
        "num_layers": layers,
        "num_kv_heads": heads,
        "head_dim": head_dim,
        "dtype": dtype_name(pages.keys.dtype),
        "model_name": pages.model_name,
        **pages.meta,
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    directory = check_output_directory(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / publication_name(pages)
    write_new_file(stem.with_suffix(".safetensors"), raw)
    path = write_new_file(stem.with_suffix(".json"), json.dumps(manifest, indent=1).encode())  # commits
    _read_back(path, manifest)
    return path


def publication_name(pages: BridgedPages) -> str:
    """The file stem of one publication in a page store: the last page key (it chains the
    namespace, which names the bridge, the recipe and the user salt, and every token and the
    page size), then what the key does not carry: the KV dtype and the served model name. Two
    publications of one context for other engines never share files."""
    served = hashlib.sha256(pages.model_name.encode("utf-8")).hexdigest()[:12]
    return f"{pages.page_keys[-1]}-{dtype_name(pages.keys.dtype)}-{served}"  # hex and a dtype: never a path


def _read_back(path: Path, manifest: dict) -> None:
    """Read what was just published as an engine will (manifest, then tensors, verified) and
    check it is what was written: another writer of the same name, a short write or a full disk
    is an error here, never a success reported over pages nothing can read."""
    try:
        stored = read_manifest(path)
        read_context(stored)
    except PageFormatError as err:
        raise OSError(f"the page store did not keep what was published: {err}") from err
    if stored.sha256 != manifest["sha256"]:
        raise OSError(
            f"{path} was replaced by another publisher while it was written (sha256 {stored.sha256[:16]}..., "
            f"this publish wrote {manifest['sha256'][:16]}...); publish again"
        )


def publish(
    cache,
    target_ids: torch.Tensor,
    destination,
    *,
    page_size: int,
    model_name: str | None = None,
    salt: str = "",
    dtype: torch.dtype | None = None,
    accept: Callable[[object], bool] | None = None,
    layout: str | None = None,
) -> Published | None:
    """Translate `cache` (a BridgedCache, batch 1) and write its full pages to `destination`.

    Args:
        cache: BridgedCache of the context; its bridge names the namespace.
        target_ids: [1, tokens] the context in the target's tokenization (as given to the cache).
        destination: a page store directory, a SGLang HiCacheStorage (or a list, one per TP
            rank), or an object with `write_pages(pages)` (see the module docstring).
        page_size: the engine's page size (SGLang `--page-size`, vLLM `--block-size`, LMCache
            `chunk_size`).
        model_name: the engine's served model name (checked by the engine); default: the
            target model's `config._name_or_path`, an error when it has none.
        salt: user salt mixed into the namespace (e.g. a tenant or a document version).
        dtype: the engine's KV dtype (default: the target model's dtype).
        accept: quality gate: called with the materialised cache; False publishes nothing and
            returns None (the engine then computes the context itself).
        layout: SGLang's `--hicache-mem-layout`, needed for a HiCacheStorage destination only.
    Returns:
        `Published`, or None when `accept` said no.
    """
    write = _writer(destination, layout)  # a bad destination is refused before the translation
    pages = bridged_pages(
        cache, target_ids, page_size=page_size, model_name=model_name, salt=salt, dtype=dtype, accept=accept
    )
    if pages is None:
        return None
    location = write(pages)
    return Published(pages.cache_salt, pages.page_keys, pages.page_size, pages.num_tokens, location)


def _writer(destination, layout):
    """The function that writes pages to `destination` and verifies them (see `publish`)."""
    if isinstance(destination, (str, os.PathLike)):
        if layout is not None:
            raise ValueError("layout= is for a HiCacheStorage destination; a page store keeps every layout")
        check_output_directory(destination)
        return lambda pages: write_page_store(pages, destination)
    if hasattr(destination, "write_pages"):
        return destination.write_pages
    if not _is_hicache_storage(destination):
        raise TypeError(
            f"destination is a {type(destination).__name__}; expected a page store directory, a SGLang "
            "HiCacheStorage (or a list, one per TP rank) or an object with write_pages(pages)"
        )
    from bridgecache.integrations.hicache import LAYOUTS, write_hicache  # SGLang is imported already

    if layout not in LAYOUTS:
        raise ValueError(
            f"layout is {layout!r}; publishing to a HiCacheStorage needs layout= (the engine's "
            f"--hicache-mem-layout: one of {LAYOUTS})"
        )
    return lambda pages: write_hicache(pages, destination, layout=layout)


def _is_hicache_storage(destination) -> bool:
    """Whether `destination` is a SGLang HiCacheStorage (or a list of them), asked without
    importing SGLang: no object is an instance of a class whose module was never imported, so
    refusing a bad destination never needs the engine installed."""
    if _HICACHE_STORAGE_MODULE not in sys.modules:
        return False
    from bridgecache.integrations.hicache import is_hicache_storage

    return is_hicache_storage(destination)


def check_output_directory(directory) -> Path:
    """A page store directory: absent (it is made) or a directory; a file there is refused."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"page store {directory} is a file, not a directory")
    return directory


def translate_context(
    bridge,
    context: str,
    target,
    target_tokenizer,
    source_tokenizer,
    *,
    source=None,
    source_kv=None,
    config: HandoffConfig | None = None,
) -> tuple[BridgedCache, torch.Tensor]:
    """Tokenize and align `context` for both models (as `handoff` does), run the source over it
    (or take its `source_kv`: a cache, a SourceKV or a KV file of exactly this context) and build
    the BridgedCache with `config` (default `HandoffConfig()`, as on every path; no prompt is known
    yet, so the refresh is chosen by the source's reading of the context's last tokens).
    Returns (cache, target_ids [1, T]).

    The one place where publishing builds a BridgedCache: a thin call over the setup's
    `HandoffEngine` (bridgecache.runtime.engine)."""
    engine = engine_for(bridge, source, target, source_tokenizer, target_tokenizer)
    return engine.translate_context(context, source_kv=source_kv, config=config)


def publish_context(
    bridge,
    context: str,
    target,
    target_tokenizer,
    source_tokenizer,
    destination,
    *,
    page_size: int,
    source=None,
    source_kv=None,
    config: HandoffConfig | None = None,
    **publish_kwargs,
) -> Published | None:
    """`publish` from text: `translate_context`, then `publish` to `destination`.

    The engine's prompt must start with `target_tokenizer(context)`'s ids; the request sends
    `Published.cache_salt` (it names the bridge and `config`'s recipe). publish_kwargs:
    model_name, salt, dtype, accept, layout (see `publish`). Every publishing argument is
    checked before the source reads the context."""
    unknown = sorted(set(publish_kwargs) - {"model_name", "salt", "dtype", "accept", "layout"})
    if unknown:
        raise TypeError(f"publish_context got unexpected arguments {unknown}")
    layout = publish_kwargs.get("layout")
    checked = {k: v for k, v in publish_kwargs.items() if k != "layout"}
    check_publish_arguments(page_size=page_size, **checked)
    _writer(destination, layout)
    cache, target_ids = translate_context(
        bridge, context, target, target_tokenizer, source_tokenizer,
        source=source, source_kv=source_kv, config=config,
    )  # fmt: skip
    return publish(cache, target_ids, destination, page_size=page_size, **publish_kwargs)
