"""vLLM KV connector (kv_consumer): load published pages into vLLM's paged cache.

Tested against vLLM 0.33.0's interface (see _vllm_api.py for where vLLM is absent). Launch (see
docs/serving.md):

    vllm serve TARGET --block-size 16 --kv-transfer-config '{"kv_connector": "BridgedKVConnector",
        "kv_connector_module_path": "bridgecache.integrations.vllm", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"page_store": "/srv/kv-pages"}}'

and send `"cache_salt": published.cache_salt` with the request. Only requests whose cache_salt
is a bridgecache salt are looked up; their pages are keyed by the same salted chain as SGLang's
(`pages.page_keys`), so a page answers only the request that asked for that translation, and
vLLM's own prefix cache keeps the loaded blocks under that salt too (its block hashes include
cache_salt), never under another request's prefix.

Engine order: the scheduler calls `get_num_new_matched_tokens` (lookup: leading run of stored
pages of the prompt, never its last token), allocates blocks, calls `update_state_after_alloc`
(which blocks get which pages) and `build_connector_meta`; the worker calls `start_load_kv`
before the forward, which writes each page into every layer's cache through the slot mapping
(slot = block_id * block_size + offset) and `wait_for_layer_load` per layer (a no-op: loads are
synchronous). Per-layer cache view: [blocks, kv_heads, block_size, 2 * head_dim], keys in the
first head_dim channels, values in the rest (FlashAttention's layout).

Inside the engine a load that fails (a file corrupted or removed after the lookup, a block id
beyond the cache, a cache view of another shape) writes nothing more for that request, is
logged, and its blocks are reported through `get_block_ids_with_load_errors` (vLLM then
recomputes them under `kv_load_failure_policy: recompute`); it never raises out of
`start_load_kv`. A cache view of another layout is refused once, at `register_kv_caches`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from bridgecache.integrations.keys import EngineMismatchError, head_range, namespace_seed, page_keys
from bridgecache.integrations.pages import Manifest, PageFormatError, PageStore, check_engine

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    VLLM_INSTALLED = True
except ImportError:  # CPU machines without vLLM: the same interface, copied (see _vllm_api.py)
    from bridgecache.integrations._vllm_api import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    VLLM_INSTALLED = False

__all__ = ["VLLM_INSTALLED", "BridgedConnectorMetadata", "BridgedKVConnector", "PageLoad"]

SALT_PREFIX = "bridgecache-"
logger = logging.getLogger(__name__)


@dataclass
class PageLoad:
    """Pages to write for one request: page_keys[i] goes to block block_ids[i]."""

    req_id: str
    page_keys: list[str]
    block_ids: list[int]


@dataclass
class BridgedConnectorMetadata(KVConnectorMetadata):
    loads: list[PageLoad] = field(default_factory=list)


class BridgedKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Serves the pages of a `PageStore` to requests that carry their bridgecache salt."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        store = self._kv_transfer_config.get_from_extra_config("page_store", None)
        if not store:
            raise ValueError(
                'BridgedKVConnector: kv_connector_extra_config needs "page_store": the directory '
                "that bridgecache.integrations.publish writes"
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise EngineMismatchError("BridgedKVConnector: pipeline-parallel serving is not supported")
        model, cache = vllm_config.model_config, vllm_config.cache_config
        self.block_size = cache.block_size
        self.tp_size = parallel.tensor_parallel_size
        self.engine = dict(
            num_layers=model.get_num_layers(parallel),
            num_kv_heads=model.get_total_num_kv_heads(),
            head_dim=model.get_head_size(),
            dtype=_kv_dtype(model.dtype, cache.cache_dtype),
            page_size=self.block_size,
            model_type=model.hf_text_config.model_type,
            model_names=_served_names(model),
        )
        self.store = PageStore(store)
        for manifest in self.store.manifests:
            self._check(manifest)  # at startup a misfit is an error, not a silent miss
        self._usable_paths: dict[Any, bool] = {}
        self._lookups: dict[str, tuple[list[str], int]] = {}  # req_id -> (keys, local tokens)
        self._pending: dict[str, PageLoad] = {}
        self._failed_blocks: set[int] = set()

    def _check(self, manifest: Manifest) -> None:
        check_engine(manifest, engine="vLLM", **self.engine)
        head_range(manifest.num_kv_heads, 0, self.tp_size)  # raises if the heads do not split

    def _usable(self, manifest: Manifest) -> bool:
        verdict = self._usable_paths.get(manifest.path)
        if verdict is None:
            try:
                self._check(manifest)
                verdict = True
            except EngineMismatchError as err:
                logger.error("BridgedKVConnector ignores %s", err)
                verdict = False
            self._usable_paths[manifest.path] = verdict
        return verdict

    def _leading_hits(self, keys: list[str]) -> int:
        refreshed = False
        for i, key in enumerate(keys):
            found = self.store.locate(key)
            if found is None and not refreshed:
                refreshed = True
                self.store.refresh(strict=False)
                found = self.store.locate(key)
            if found is None or not self._usable(found[0]):
                return i
        return len(keys)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        salt = getattr(request, "cache_salt", None)
        if not salt or not salt.startswith(SALT_PREFIX):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        usable_pages = max(0, len(prompt) - 1) // self.block_size  # the last prompt token is the engine's
        keys = page_keys(
            prompt[: usable_pages * self.block_size], self.block_size, namespace_seed(None, salt)
        )
        hit_tokens = self._leading_hits(keys) * self.block_size
        self._lookups[request.request_id] = (keys, num_computed_tokens)
        return max(0, hit_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        lookup = self._lookups.pop(request.request_id, None)
        if num_external_tokens == 0 or lookup is None:
            return
        keys, local = lookup
        first, count = local // self.block_size, num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        self._pending[request.request_id] = PageLoad(
            request.request_id, keys[first : first + count], list(block_ids[first : first + count])
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = BridgedConnectorMetadata(loads=list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._lookups.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ------------------------------------------------------------------ worker side

    def tp_rank(self) -> int:
        """This worker's tensor-parallel rank (its slice of the KV heads)."""
        if self.tp_size == 1 or not VLLM_INSTALLED:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """At startup: every attention layer's cache must be the view the connector writes."""
        for name, kv_cache in kv_caches.items():
            if isinstance(kv_cache, torch.Tensor):
                _layer_index(name)
                heads = len(head_range(self.engine["num_kv_heads"], self.tp_rank(), self.tp_size))
                _check_view(kv_cache, heads, self.block_size, self.engine["head_dim"])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, BridgedConnectorMetadata) or not meta.loads:
            return
        layers = {}
        for name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, torch.Tensor):
                layers[_layer_index(name)] = kv
        for load in meta.loads:
            try:
                self._load(load, layers)
            except (PageFormatError, EngineMismatchError, KeyError, IndexError, OSError, RuntimeError) as err:
                # vLLM recomputes these blocks (kv_load_failure_policy="recompute")
                logger.error("BridgedKVConnector could not load request %s: %s", load.req_id, err)
                self._failed_blocks.update(load.block_ids)

    def _load(self, load: PageLoad, layers: dict[int, torch.Tensor]) -> None:
        """Read and check every page and block of `load` first, then write: a load that fails
        writes nothing."""
        rank = self.tp_rank()
        slot_offsets = torch.arange(self.block_size)
        pages = []
        for key, block in zip(load.page_keys, load.block_ids):
            keys, values = self.store.page(key)  # [layers, kv_heads, block_size, head_dim]
            manifest = self.store.locate(key)[0]
            heads = head_range(manifest.num_kv_heads, rank, self.tp_size)
            if sorted(layers) != list(range(manifest.num_layers)):
                raise EngineMismatchError(
                    f"attention layers {sorted(layers)} in the engine; page {key} has {manifest.num_layers}"
                )
            for kv_cache in layers.values():
                _check_view(kv_cache, len(heads), self.block_size, manifest.head_dim)
                if not 0 <= block < kv_cache.shape[0]:
                    raise IndexError(f"block id {block} is outside the engine's {kv_cache.shape[0]} blocks")
            pages.append((keys[:, heads.start : heads.stop], values[:, heads.start : heads.stop], block))
        for keys, values, block in pages:
            slots = block * self.block_size + slot_offsets
            for idx, kv_cache in layers.items():
                page = torch.cat([keys[idx], values[idx]], -1)  # [heads, block_size, 2 * head_dim]
                page = page.transpose(0, 1).to(kv_cache.device, kv_cache.dtype)  # [block_size, heads, 2*dim]
                slot = slots.to(kv_cache.device)
                kv_cache[slot // self.block_size, :, slot % self.block_size] = page

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv already wrote every layer

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a consumer: the engine's own KV is never published as bridged pages

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


def _kv_dtype(model_dtype: torch.dtype, cache_dtype: str) -> torch.dtype:
    if cache_dtype in (None, "auto"):
        return model_dtype
    dtype = getattr(torch, str(cache_dtype), None)
    if not isinstance(dtype, torch.dtype) or dtype.is_floating_point is False or dtype.itemsize < 2:
        raise EngineMismatchError(
            f"BridgedKVConnector: --kv-cache-dtype {cache_dtype!r} is not supported (quantised KV); use auto"
        )
    return dtype


def _served_names(model_config: Any) -> tuple[str, ...]:
    """The names vLLM serves the model under (--served-model-name, else --model); () if unknown."""
    names = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None)
    if isinstance(names, str):
        return (names,)
    return tuple(n for n in (names or ()) if isinstance(n, str))


def _layer_index(name: str) -> int:
    ints = [int(part) for part in name.split(".") if re.fullmatch(r"\d+", part)]
    if len(ints) != 1:
        raise EngineMismatchError(f"cannot tell the layer index of attention layer {name!r}")
    return ints[0]


def _check_view(kv_cache: torch.Tensor, heads: int, block_size: int, head_dim: int) -> None:
    if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (heads, block_size, 2 * head_dim):
        raise EngineMismatchError(
            f"the engine's per-layer KV cache has shape {tuple(kv_cache.shape)}; BridgedKVConnector writes "
            f"[blocks, {heads} kv_heads, {block_size} block_size, {2 * head_dim} (2 * head_dim)] "
            "(FlashAttention's layout, with the kernel block size equal to --block-size)"
        )
