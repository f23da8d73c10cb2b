"""Translated pages into any SGLang HiCache L3 store, through that store's own code.

`write_hicache(pages, storages, layout=...)` stages the pages in a host pool of SGLang's MHA
geometry (`HostPages`) and hands them to each storage the way SGLang's cache controller would
write back its own pages (managers/cache_controller.py, 0.5.23): `batch_set_v1(keys,
host_indices)` for the backends the controller drives zero-copy (3FS, Mooncake, NIXL, SeaweedFS,
..., or a `dynamic` backend with `"interface_v1": 1`), `batch_set(keys, flat pages)` for the
others (the file backend among them). What a storage says it stored is then checked before
success is reported: read back through its own `batch_get` and compared byte for byte (flat
pages), or found by its `batch_exists` (zero-copy). Keys, namespace, layout and tensor-parallel split are the
ones an engine looks up, so a fleet's store serves bridged prefixes to every node.

Build each storage as the engine does, from SGLang's `HiCacheStorageConfig` with the engine's
model name, tp_rank and tp_size; pass one storage per rank, in rank order. A storage used for
publishing gets our staging pool registered (`register_mem_pool_host`): use a publishing
instance, not the engine's own.

A flat page, per `--hicache-mem-layout` (pool_host/mha.py, `set_from_flat_data_page`):
    layer_first        [2, layers, page_size, heads, head_dim]
    page_first         [2, page_size, layers, heads, head_dim]
    page_first_direct  [2, 1, layers, page_size, heads, head_dim]
    page_head          [2, 1, heads, page_size, layers, head_dim]
where 2 is (keys, values) and heads are those of one tensor-parallel rank.

Imports sglang (its storage interface only, which imports on a CPU).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from bridgecache.integrations.keys import EngineMismatchError, check_page_key, head_range

__all__ = ["LAYOUTS", "HostPages", "flat_page", "is_hicache_storage", "write_hicache"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
# Backends SGLang 0.5.23's cache controller drives through batch_get_v1 / batch_set_v1 (by class).
ZERO_COPY_CLASSES = frozenset(
    {
        "HiCacheHF3FS", "MooncakeStore", "NpuMemcacheStore", "EICStorage", "HiCacheNixl",
        "HiCacheSiMM", "UMBPStore", "TensorcastStore", "SeaweedFSStore",
    }
)  # fmt: skip


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


class HostPages:
    """A host pool holding `num_pages` pages, with the storage-facing methods and geometry of
    SGLang 0.5.23's `MHATokenToKVPoolHost` (what L3 backends call on the engine's pool).

    kv_buffer by layout: layer_first [2, layers, size, heads, dim]; page_first [2, size, layers,
    heads, dim]; page_first_direct [2, pages, layers, page, heads, dim]; page_head [2, pages,
    heads, page, layers, dim]; size = pages * page_size token slots."""

    def __init__(self, layout, num_pages, page_size, layers, heads, head_dim, dtype):
        if layout not in LAYOUTS:
            raise ValueError(f"unsupported --hicache-mem-layout {layout!r}; expected one of {LAYOUTS}")
        self.layout, self.page_size, self.page_num = layout, page_size, num_pages
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = layers, heads, head_dim, head_dim
        self.dtype, self.device, self.pin_memory = dtype, "cpu", False
        self.size = num_pages * page_size
        dims = {
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first": (2, self.size, layers, heads, head_dim),
            "page_first_direct": (2, num_pages, layers, page_size, heads, head_dim),
            "page_head": (2, num_pages, heads, page_size, layers, head_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_size_per_token(self) -> int:
        return (self.head_dim + self.v_head_dim) * self.head_num * self.layer_num * self.dtype.itemsize

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // 2

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index : index + self.page_size]
        else:
            page = self.kv_buffer[:, index // self.page_size : index // self.page_size + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            (2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype
        ).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        L, H, P, D = self.layer_num, self.head_num, self.page_size, self.head_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + P] = data_page.reshape(2, L, P, H, D)
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + P] = data_page.reshape(2, P, L, H, D)
        elif self.layout == "page_first_direct":
            self.kv_buffer[:, index // P : index // P + 1] = data_page.reshape(2, 1, L, P, H, D)
        else:
            self.kv_buffer[:, index // P : index // P + 1] = data_page.reshape(2, 1, H, P, L, D)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """(address, bytes) of each buffer of each page, keys then values (mha.py's rule)."""
        item, L, H, D, P = self.dtype.itemsize, self.layer_num, self.head_num, self.head_dim, self.page_size
        base, v_offset = self.kv_buffer.data_ptr(), L * self.size * H * D * item
        starts = indices.tolist()[:: self.page_size]
        ptrs = []
        if self.layout == "layer_first":
            for start in starts:
                for layer in range(L):
                    k = base + start * H * D * item + layer * self.size * H * D * item
                    ptrs += [k, k + v_offset]
            return ptrs, [item * P * H * D] * len(ptrs)
        for start in starts:
            k = base + start * L * H * D * item
            ptrs += [k, k + v_offset]
        return ptrs, [L * item * P * H * D] * len(ptrs)


def is_hicache_storage(destination) -> bool:
    items = destination if isinstance(destination, (list, tuple)) else [destination]
    return bool(items) and all(isinstance(s, HiCacheStorage) for s in items)


def _check_rank(storage: HiCacheStorage, rank: int, tp_size: int) -> None:
    config = getattr(storage, "storage_config", None)
    got = (getattr(config, "tp_rank", None), getattr(config, "tp_size", None))
    if config is None:
        got = (getattr(storage, "tp_rank", None), getattr(storage, "tp_size", None))
    if got != (None, None) and got != (rank, tp_size):
        raise EngineMismatchError(
            f"storage {rank} of {tp_size} ({type(storage).__name__}) was built for tp_rank={got[0]}, "
            f"tp_size={got[1]}; pass one storage per rank, in rank order"
        )


def _zero_copy(storage: HiCacheStorage) -> bool:
    if type(storage).__name__ in ZERO_COPY_CLASSES:
        return True
    extra = getattr(getattr(storage, "storage_config", None), "extra_config", None) or {}
    return bool(extra.get("interface_v1", 0))


def _per_page(results, num_pages: int) -> list[bool]:
    """One flag per page from what batch_set_v1 answered: one flag per page, or one per buffer
    (HiCacheHF3FS's zero-copy layouts store keys and values apart: 2 per page, in page order);
    SGLang's controller takes all() of either. Anything else counts as nothing stored."""
    results = list(results) if results is not None else []
    if not results or len(results) % num_pages:
        return [False] * num_pages
    per = len(results) // num_pages
    return [all(results[i * per : (i + 1) * per]) for i in range(num_pages)]


def write_hicache(pages, storages, *, layout: str) -> list[HiCacheStorage]:
    """Write `pages` (a `publish.BridgedPages`) through each storage's own batch_set(_v1).

    storages: one HiCacheStorage, or a list with one per tensor-parallel rank in rank order
    (rank r gets `head_range(kv_heads, r, len(storages))`). Raises RuntimeError naming the
    pages a storage did not take. Returns the storages."""
    storages = list(storages) if isinstance(storages, (list, tuple)) else [storages]
    if not is_hicache_storage(storages):
        raise TypeError(
            f"expected SGLang HiCacheStorage instances, got {[type(s).__name__ for s in storages]}"
        )
    keys = [check_page_key(k) for k in pages.page_keys]
    layers, total_heads, _, head_dim = pages.keys.shape
    for rank, storage in enumerate(storages):
        _check_rank(storage, rank, len(storages))
        heads = head_range(total_heads, rank, len(storages))
        pool = HostPages(
            layout, pages.num_pages, pages.page_size, layers, len(heads), head_dim, pages.keys.dtype
        )
        for i in range(pages.num_pages):
            k, v = pages.page(i)
            pool.set_from_flat_data_page(
                i * pages.page_size,
                flat_page(k[:, heads.start : heads.stop], v[:, heads.start : heads.stop], layout),
            )
        storage.register_mem_pool_host(pool)
        if _zero_copy(storage):
            ok = _per_page(storage.batch_set_v1(keys, torch.arange(pool.size)), len(keys))
            stored = storage.batch_exists(keys) if all(ok) else 0  # what it claims: exists, at least
            ok = [good and i < stored for i, good in enumerate(ok)]
        else:
            flat = [pool.get_data_page(i * pages.page_size) for i in range(pages.num_pages)]
            ok = [bool(storage.batch_set(keys, flat))] * len(keys)
            if all(ok):
                ok = _read_back(storage, keys, flat)
        failed = [key for key, good in zip(keys, ok) if not good]
        if failed:
            raise RuntimeError(
                f"{type(storage).__name__} (rank {rank} of {len(storages)}) did not store "
                f"{len(failed)} of {len(keys)} pages whole (first: {failed[:1]}): a full disk, a short "
                "write or an older copy under the same key"
            )
    return storages


def _read_back(storage: HiCacheStorage, keys: list[str], flat: list[torch.Tensor]) -> list[bool]:
    """One flag per page: whether the storage's own batch_get returns the bytes just written.
    SGLang's HiCacheFile reports success for a short write (a full disk) and skips a key whose
    file exists (an earlier truncated copy): only reading it back tells."""
    into = [torch.empty_like(page) for page in flat]
    try:
        got = storage.batch_get(keys, into)
    except Exception:  # e.g. HiCacheFile's IOError("Short read"): nothing whole was stored
        return [False] * len(keys)
    got = list(got) if got is not None else [None] * len(keys)
    if len(got) != len(keys):
        return [False] * len(keys)
    return [
        isinstance(page, torch.Tensor)
        and page.numel() == want.numel()
        and torch.equal(page.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        for page, want in zip(got, flat)
    ]
