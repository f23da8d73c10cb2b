"""Translated pages as LMCache chunks, for vLLM + LMCache fleets (LMCache 0.5.6).

    with LMCachePublisher(LMCacheEngineConfig.from_defaults(chunk_size=256,
            remote_url="redis://cache:6379", remote_serde="naive")) as lmcache:
        published = publish(cache, ids, lmcache, page_size=256, model_name="Qwen/Qwen2.5-0.5B")
    # request: "kv_transfer_params": {"lmcache.tag.bridgecache": published.cache_salt}

The publisher stores through LMCache's own engine (`LMCacheEngine.store`): its token database
computes the chunk hashes, `CacheEngineKey` carries the served model name, world size, worker id,
KV dtype and the tag `bridgecache=<cache_salt>`, and its storage manager writes every configured
backend (local disk, `fs://`, `redis://`, ...) with its own serialisation. The one piece that is
ours is the connector that, where vLLM's connector would copy from GPU pages, copies from the
translated pages. A vLLM request finds the chunks only when it carries the same tag in
`kv_transfer_params` (LMCache puts every `lmcache.tag.*` into the key): a request without it
hashes to untagged keys, so bridged chunks never answer an exact lookup.

Key agreement with the engine: LMCache hashes chunks with vLLM's hash function and NONE_HASH
when vLLM is importable, else Python's `hash` from NONE_HASH = 0. Publish from an environment
like the engine's (vLLM installed, the same PYTHONHASHSEED, the same `pre_caching_hash_algorithm`
and `chunk_size`), with one rank per vLLM tensor-parallel worker (`world_size`).

Imports lmcache.
"""

from __future__ import annotations

import itertools
import os
import time

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

from bridgecache.integrations.keys import head_range

__all__ = ["TAG", "LMCachePublisher", "request_configs"]

TAG = "lmcache.tag.bridgecache"
_instances = itertools.count()


def request_configs(cache_salt: str) -> dict[str, str]:
    """The LMCache request configs (vLLM: `kv_transfer_params`) that select bridged chunks."""
    return {TAG: cache_salt}


class _PagesConnector(GPUConnectorInterface):
    """LMCache's connector seam, fed from translated pages instead of GPU KV.

    source: [2, layers, tokens, heads * head_dim] (LMCache's KV_2LTD memory format)."""

    def __init__(self, source: torch.Tensor):
        self.source = source

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.source.shape[1], num_tokens, self.source.shape[3]])

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        memory_obj.tensor.copy_(self.source[:, :, start:end])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(memory_obj, start, end)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        raise NotImplementedError("a publisher only stores")

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        raise NotImplementedError("a publisher only stores")


def lmcache_kv(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """keys, values [layers, heads, tokens, head_dim] -> LMCache's KV_2LTD [2, layers, tokens,
    heads * head_dim] (per token, heads side by side: vLLM's [tokens, heads, head_dim] flattened)."""
    kv = torch.stack([keys, values]).permute(0, 1, 3, 2, 4)  # [2, layers, tokens, heads, dim]
    return kv.reshape(*kv.shape[:3], -1).contiguous()


def close_engine(instance_id: str) -> None:
    """Destroy an LMCache engine after its queued writes are done.

    LMCache 0.5.6's Redis connectors await `AsyncPQExecutor.shutdown` (a blocking call that waits
    on the connector's own event loop) from inside that loop, which never returns; their
    executors are pointed at `shutdown_async` (what the await expects) first."""
    engine = LMCacheEngineBuilder.get(instance_id)
    manager = getattr(engine, "storage_manager", None)
    for backend in getattr(manager, "storage_backends", {}).values():
        connector = getattr(backend, "connection", None)
        connector = getattr(connector, "_connector", connector)
        executor = getattr(connector, "pq_executor", None)
        if executor is not None and hasattr(executor, "shutdown_async"):
            executor.shutdown = executor.shutdown_async
    LMCacheEngineBuilder.destroy(instance_id)


def _wait_for_puts(engine, keys: list, timeout: float) -> None:
    """Block until every backend but the CPU buffer holds `keys` (LMCache writes asynchronously;
    closing an engine with writes in flight frees their buffers under the writer)."""
    every = engine.storage_manager.storage_backends
    # the CPU buffer is LMCache's staging, not storage, unless it is all there is
    backends = [b for name, b in every.items() if name != "LocalCPUBackend"] or list(every.values())
    if not backends:
        raise RuntimeError("the LMCache engine has no storage backend: nothing would hold the chunks")
    deadline = time.monotonic() + timeout
    for backend in backends:
        for key in keys:
            while backend.exists_in_put_tasks(key) or not backend.contains(key):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"LMCache backend {type(backend).__name__} did not store chunk {key.to_string()} "
                        f"within {timeout} s"
                    )
                time.sleep(0.01)


class LMCachePublisher:
    """Stores `publish.BridgedPages` as LMCache chunks through LMCache's own engine.

    config: LMCache's `LMCacheEngineConfig` as the engine uses it (chunk_size, backends, serde).
    world_size: vLLM's tensor-parallel size; each rank's chunks hold its KV heads and go under
    its worker id. `write_pages` returns when every configured backend holds every chunk (or
    raises TimeoutError after `timeout` seconds). Use as a context manager, or call `close()`."""

    def __init__(self, config, *, world_size: int = 1, timeout: float = 60.0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"world_size is {world_size!r}; expected vLLM's tensor-parallel size, an int >= 1"
            )
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 < timeout < float("inf")
        ):
            raise ValueError(f"timeout is {timeout!r}; expected seconds, a finite number > 0")
        chunk = getattr(config, "chunk_size", None)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"config.chunk_size is {chunk!r}; expected LMCache's chunk size, an int >= 1")
        if config.save_unfull_chunk:
            config.save_unfull_chunk = False  # a partial chunk can never answer a longer prompt
        self.config, self.world_size, self.timeout = config, world_size, timeout
        self._engines: list[str] = []

    def write_pages(self, pages) -> list[str]:
        """Store every whole chunk of `pages` (page_size must equal LMCache's chunk_size) for
        each rank; returns the LMCache engine instance ids used (closed by `close`)."""
        if pages.page_size != self.config.chunk_size:
            raise ValueError(
                f"pages of {pages.page_size} tokens; LMCache's chunk_size is {self.config.chunk_size}: "
                "publish with page_size=chunk_size"
            )
        layers, total_heads, tokens, head_dim = pages.keys.shape
        ids = []
        for rank in range(self.world_size):
            heads = head_range(total_heads, rank, self.world_size)
            metadata = LMCacheMetadata(
                model_name=pages.model_name, world_size=self.world_size, local_world_size=self.world_size,
                worker_id=rank, local_worker_id=rank, kv_dtype=pages.keys.dtype,
                kv_shape=(layers, 2, self.config.chunk_size, len(heads), head_dim),
                chunk_size=self.config.chunk_size,
            )  # fmt: skip
            source = lmcache_kv(
                pages.keys[:, heads.start : heads.stop], pages.values[:, heads.start : heads.stop]
            )
            instance = f"bridgecache-publisher-{os.getpid()}-{next(_instances)}"
            engine = LMCacheEngineBuilder.get_or_create(
                instance, self.config, metadata, _PagesConnector(source), lambda *a: None, lambda *a: None
            )
            self._engines.append(instance)
            engine.post_init()
            tokens, configs = torch.tensor(pages.token_ids), request_configs(pages.cache_salt)
            engine.store(tokens, request_configs=configs)
            stored = [
                key for _, _, key in engine.token_database.process_tokens(tokens, request_configs=configs)
            ]
            if len(stored) != len(pages.token_ids) // self.config.chunk_size:
                raise RuntimeError(
                    f"LMCache chunked {len(pages.token_ids)} tokens into {len(stored)} chunks of "
                    f"{self.config.chunk_size}; expected {len(pages.token_ids) // self.config.chunk_size}"
                )
            _wait_for_puts(engine, stored, self.timeout)
            ids.append(instance)
        return ids

    def close(self) -> None:
        while self._engines:
            close_engine(self._engines.pop())

    def __enter__(self) -> LMCachePublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
