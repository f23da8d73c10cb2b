"""SGLang HiCache: serve translated pages as an L3 storage backend, or as `HiCacheFile` files.

Tested against sglang 0.5.23. Launch (see docs/serving.md):

    python -m sglang.launch_server --model-path TARGET --page-size 64 \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "bridgecache",
            "module_path": "bridgecache.integrations.sglang", "class_name": "BridgedHiCacheStorage",
            "page_store": "/srv/kv-pages"}'

and send `"cache_salt": published.cache_salt` with the request. SGLang hashes the request's pages
(`get_hash_str`, seeded by the salt), asks `batch_exists` for the leading run of stored pages,
then `batch_get`s each into a flat host page and copies it into its host pool; from there the
device loads it layer by layer.

A flat page, per `--hicache-mem-layout` (pool_host/mha.py, `set_from_flat_data_page`):
    layer_first        [2, layers, page_size, heads, head_dim]
    page_first         [2, page_size, layers, heads, head_dim]
    page_first_direct  [2, 1, layers, page_size, heads, head_dim]
    page_head          [2, 1, heads, page_size, layers, head_dim]
where 2 is (keys, values) and heads are those of this tensor-parallel rank. Both of SGLang's
page paths work: the generic one (batch_get into flat pages, the default for a dynamic backend)
and the zero-copy one (`"interface_v1": 1`: batch_get_v1 writes into the host pool).

The engine's own pages (write-back of natively computed prefixes) go to a `HiCacheFile` beside
the store (`native_file_path`, default `<page_store>/engine`); a published page is never
overwritten or cleared by the engine.

This module imports sglang; `bridgecache.integrations.pages` does not.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, HiCacheStorageConfig

from bridgecache.integrations.pages import (
    EngineMismatchError,
    Manifest,
    PageStore,
    check_engine,
    head_range,
)

__all__ = ["LAYOUTS", "BridgedHiCacheStorage", "export_hicache_file", "flat_page"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
logger = logging.getLogger(__name__)


def flat_page(keys: torch.Tensor, values: torch.Tensor, layout: str) -> torch.Tensor:
    """One page in SGLang's flat host-page format for `layout`.

    keys, values: [layers, heads, page_size, head_dim] (this rank's heads). Returns a 1-D
    contiguous tensor of 2 * layers * heads * page_size * head_dim elements."""
    kv = torch.stack([keys, values])  # [2, layers, heads, page, dim]
    if layout in ("layer_first", "page_first_direct"):
        page = kv.permute(0, 1, 3, 2, 4)  # [2, layers, page, heads, dim]
    elif layout == "page_first":
        page = kv.permute(0, 3, 1, 2, 4)  # [2, page, layers, heads, dim]
    elif layout == "page_head":
        page = kv.permute(0, 2, 3, 1, 4)  # [2, heads, page, layers, dim]
    else:
        raise ValueError(f"unsupported --hicache-mem-layout {layout!r}; expected one of {LAYOUTS}")
    return page.contiguous().reshape(-1)


class BridgedHiCacheStorage(HiCacheStorage):
    """A HiCache L3 backend serving the pages of a `PageStore` (plus a HiCacheFile for the
    engine's own pages). Built by SGLang's StorageBackendFactory as a `dynamic` backend.

    extra_config keys: page_store (required), native_file_path (default <page_store>/engine),
    refresh_seconds (how often a miss rescans the store for newly published contexts, default 1).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = dict(storage_config.extra_config or {})
        if "page_store" not in extra:
            raise ValueError(
                'bridgecache backend: --hicache-storage-backend-extra-config needs "page_store": '
                "the directory that bridgecache.integrations.pages.publish writes"
            )
        if storage_config.is_mla_model:
            raise EngineMismatchError("bridgecache backend: MLA models are not supported (per-head KV only)")
        if storage_config.pp_size > 1 or storage_config.attn_cp_size > 1:
            raise EngineMismatchError(
                f"bridgecache backend: pipeline/context parallel serving is not supported "
                f"(pp_size={storage_config.pp_size}, attn_cp_size={storage_config.attn_cp_size})"
            )
        self.storage_config = storage_config
        self.store = PageStore(extra["page_store"])
        self.refresh_seconds = float(extra.get("refresh_seconds", 1.0))
        self._last_refresh = time.monotonic()
        native = extra.get("native_file_path") or os.path.join(extra["page_store"], "engine")
        native_config = dataclasses.replace(storage_config, extra_config={"file_storage_path": native})
        self.native = HiCacheFile(native_config, file_path=native)
        self.layout: str | None = None
        self._verdicts: dict[Path, bool] = {}

    # ------------------------------------------------------------------ engine geometry

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Called by SGLang with its host pool; every published context must fit it."""
        super().register_mem_pool_host(mem_pool_host)
        self.native.register_mem_pool_host(mem_pool_host)
        if mem_pool_host.layout not in LAYOUTS:
            raise EngineMismatchError(
                f"bridgecache backend: --hicache-mem-layout {mem_pool_host.layout!r} is not supported; "
                f"use one of {LAYOUTS}"
            )
        self.layout = mem_pool_host.layout
        for manifest in self.store.manifests:
            self._check(manifest)  # at startup a misfit is an error, not a silent miss

    def _check(self, manifest: Manifest) -> None:
        pool, cfg = self.mem_pool_host, self.storage_config
        check_engine(
            manifest,
            engine="SGLang",
            num_layers=pool.layer_num,
            num_kv_heads=None,
            head_dim=pool.head_dim,
            dtype=pool.dtype,
            page_size=pool.page_size,
            model_name=cfg.model_name,
        )
        heads = head_range(manifest.num_kv_heads, cfg.tp_rank, cfg.tp_size)
        if len(heads) != pool.head_num:
            raise EngineMismatchError(
                f"{manifest.path}: {manifest.num_kv_heads} KV heads over tp_size={cfg.tp_size} give "
                f"{len(heads)} per rank; the engine's host pool holds {pool.head_num}"
            )

    def _usable(self, manifest: Manifest) -> bool:
        verdict = self._verdicts.get(manifest.path)
        if verdict is None:
            try:
                self._check(manifest)
                verdict = True
            except EngineMismatchError as err:
                logger.error("bridgecache backend ignores %s", err)
                verdict = False
            self._verdicts[manifest.path] = verdict
        return verdict

    def _bridged(self, key: str) -> Manifest | None:
        found = self.store.locate(key)
        if found is None and time.monotonic() - self._last_refresh >= self.refresh_seconds:
            self._last_refresh = time.monotonic()
            self.store.refresh(strict=False)
            found = self.store.locate(key)
        if found is None or self.layout is None or not self._usable(found[0]):
            return None
        return found[0]

    def _flat(self, key: str, manifest: Manifest) -> torch.Tensor:
        keys, values = self.store.page(key)
        heads = head_range(manifest.num_kv_heads, self.storage_config.tp_rank, self.storage_config.tp_size)
        return flat_page(keys[:, heads.start : heads.stop], values[:, heads.start : heads.stop], self.layout)

    # ------------------------------------------------------------------ HiCacheStorage

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None):
        manifest = self._bridged(key)
        if manifest is None:
            if target_location is None:
                return None
            return self.native.get(key, target_location, target_sizes)
        page = self._flat(key, manifest)
        if target_location is None:
            return page
        if target_location.numel() != page.numel() or target_location.dtype != page.dtype:
            raise EngineMismatchError(
                f"page {key}: the engine's buffer holds {target_location.numel()} {target_location.dtype}, "
                f"the page {page.numel()} {page.dtype}"
            )
        target_location.copy_(page.view(target_location.shape))
        return target_location

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ):
        locations = target_locations or [None] * len(keys)
        return [self.get(key, location) for key, location in zip(keys, locations)]

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any | None = None
    ) -> list[bool]:
        """The zero-copy path (`"interface_v1": 1` in the extra config): pages straight into the
        registered host pool, page i at host_indices[i * page_size]."""
        results = []
        for i, key in enumerate(keys):
            page = self.get(key, self.mem_pool_host.get_dummy_flat_data_page())
            if page is None:
                results.extend([False] * (len(keys) - i))
                break
            self.mem_pool_host.set_from_flat_data_page(
                int(host_indices[i * self.mem_pool_host.page_size]), page
            )
            results.append(True)
        return results

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any | None = None
    ) -> list[bool]:
        page_size = self.mem_pool_host.page_size
        return [
            self.set(key, self.mem_pool_host.get_data_page(int(host_indices[i * page_size]), flat=True))
            for i, key in enumerate(keys)
        ]

    def set(self, key: str, value: Any | None = None, target_location=None, target_sizes=None) -> bool:
        if self._bridged(key) is not None:
            return True  # a published page stays as published
        return self.native.set(key, value, target_location, target_sizes)

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations=None, target_sizes=None):
        return all(self.set(key, value) for key, value in zip(keys, values))

    def exists(self, key: str) -> bool:
        return self._bridged(key) is not None or self.native.exists(key)

    def clear(self) -> None:
        self.native.clear()  # the engine's pages only; published contexts are the publisher's


def export_hicache_file(
    store: PageStore | str | os.PathLike,
    directory: str | os.PathLike,
    *,
    layout: str,
    model_name: str,
    tp_size: int = 1,
    manifests: list[Manifest] | None = None,
) -> list[Path]:
    """Write published pages as SGLang `HiCacheFile` files (`--hicache-storage-backend file`,
    no bridgecache code in the engine): `<key>_<model>_<tp_rank>_<tp_size>.bin` per page and
    rank, raw bytes of the flat page in `layout`. model_name: the engine's served model name
    (`--served-model-name`, else `--model-path`). Returns the files written."""
    store = store if isinstance(store, PageStore) else PageStore(store)
    model = "-".join(model_name.split("/"))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for manifest in manifests or store.manifests:
        for key in manifest.page_keys:
            keys, values = store.page(key)
            for rank in range(tp_size):
                heads = head_range(manifest.num_kv_heads, rank, tp_size)
                page = flat_page(
                    keys[:, heads.start : heads.stop], values[:, heads.start : heads.stop], layout
                )
                path = directory / f"{key}_{model}_{rank}_{tp_size}.bin"
                tmp = path.with_name(f".{path.name}.tmp")
                page.view(torch.uint8).numpy().tofile(tmp)
                os.replace(tmp, path)
                written.append(path)
    return written
