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

Pages are served in SGLang's flat host-page format of the engine's `--hicache-mem-layout`
(`hicache.flat_page`), with this tensor-parallel rank's heads. Both of SGLang's
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

from bridgecache.integrations.hicache import LAYOUTS, flat_page, write_hicache
from bridgecache.integrations.keys import EngineMismatchError, head_range
from bridgecache.integrations.pages import Manifest, PageFormatError, PageStore, check_engine
from bridgecache.integrations.publish import stored_pages

__all__ = ["LAYOUTS", "BridgedHiCacheStorage", "export_hicache_file", "flat_page"]

logger = logging.getLogger(__name__)


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
                "the directory that bridgecache.integrations.publish writes"
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
            model_names=(cfg.model_name,) if cfg.model_name else (),
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

    def _unreadable(self, manifest: Manifest, key: str, err: Exception) -> None:
        """A page that fails to load is a miss; its context is not offered again."""
        logger.error("bridgecache backend: page %s of %s cannot be served: %s", key, manifest.path, err)
        self._verdicts[manifest.path] = False

    def _flat(self, key: str, manifest: Manifest) -> torch.Tensor:
        keys, values = self.store.page(key)
        heads = head_range(manifest.num_kv_heads, self.storage_config.tp_rank, self.storage_config.tp_size)
        return flat_page(keys[:, heads.start : heads.stop], values[:, heads.start : heads.stop], self.layout)

    # ------------------------------------------------------------------ HiCacheStorage

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None):
        """The flat page under `key` (into `target_location` when given), or None: a miss."""
        manifest = self._bridged(key)
        if manifest is None:
            if target_location is None:
                return None
            return self.native.get(key, target_location, target_sizes)
        try:
            page = self._flat(key, manifest)
            if target_location is None:
                return page
            if target_location.numel() != page.numel() or target_location.dtype != page.dtype:
                raise EngineMismatchError(
                    f"the engine's buffer holds {target_location.numel()} {target_location.dtype}, "
                    f"the page {page.numel()} {page.dtype}"
                )
            target_location.copy_(page.view(target_location.shape))
            return target_location
        except (PageFormatError, EngineMismatchError, KeyError, OSError, RuntimeError) as err:
            self._unreadable(manifest, key, err)
            return None

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
    model_name: str | None = None,
    tp_size: int = 1,
    manifests: list[Manifest] | None = None,
) -> list[Path]:
    """Write published pages through SGLang's own `HiCacheFile` (`--hicache-storage-backend
    file`, no bridgecache code in the engine): one `HiCacheFile` per tensor-parallel rank,
    built from SGLang's `HiCacheStorageConfig` with `model_name` and the rank, fed by its own
    `batch_set`. model_name: the engine's served model name (`--served-model-name`, else
    `--model-path`), default the name each context was published for; a context published for
    another name is refused. Returns the files that now hold the pages (`<key>_<model>_<rank>_
    <tp_size>.bin`)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size is {tp_size!r}; expected the engine's tensor-parallel size, an int >= 1")
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout is {layout!r}; expected the engine's --hicache-mem-layout, one of {LAYOUTS}"
        )
    store = store if isinstance(store, PageStore) else PageStore(store)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for manifest in manifests or store.manifests:
        name = model_name or manifest.model_name
        if manifest.model_name != name:
            raise EngineMismatchError(
                f"{manifest.path} was published for model {manifest.model_name!r}; the export is for {name!r}"
            )
        pages = stored_pages(manifest)
        files = []
        for rank in range(tp_size):
            config = HiCacheStorageConfig(
                tp_rank=rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                model_name=name, extra_config={"file_storage_path": str(directory)},
            )  # fmt: skip
            files.append(HiCacheFile(config, file_path=str(directory)))
            if Path(files[-1].file_path).resolve() != directory.resolve():
                raise RuntimeError(
                    f"SGLang's HiCacheFile writes to {files[-1].file_path}, not {directory} "
                    "(SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR is set): unset it to export"
                )
        write_hicache(pages, files, layout=layout)
        for storage in files:
            written += [directory / f"{key}{storage.config_suffix}.bin" for key in pages.page_keys]
    return written
