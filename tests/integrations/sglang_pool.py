"""SGLang's host pool and page helpers for the engine tests, from sglang's own installed code
(tests/integrations/test_integrations_sglang.py and test_integrations_hicache_backends.py).

Importing it needs sglang (`require_engine`: skipped where absent, failed where .ci/run installed it).
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import torch
from conftest import require_engine
from tiny_models import tiny_model

from bridgecache.bridge.maps import Bridge
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache

sglang = require_engine("sglang")
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed  # noqa: E402

PAGE = 4
TOKENS = 25  # prefix_length 24 = 6 full pages; the held-back last token is the engine's


def _engine_pool_methods():
    """MHATokenToKVPoolHost's page methods, compiled from the installed sglang source."""
    path = Path(sglang.__file__).parent / "srt/mem_cache/pool_host/mha.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MHATokenToKVPoolHost")
    wanted = {"set_from_flat_data_page", "get_dummy_flat_data_page", "get_data_page", "get_page_buffer_meta"}
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in funcs} == wanted, "sglang's host pool lost a page method"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in wanted}


class HostPool:
    """SGLang's MHA host pool geometry (init_kv_buffer dims of 0.5.23) with its page methods."""

    def __init__(self, layout, layers, heads, head_dim, dtype, pages=16):
        self.layout, self.layer_num, self.head_num, self.head_dim = layout, layers, heads, head_dim
        self.dtype, self.page_size, self.device, self.pin_memory = dtype, PAGE, "cpu", False
        self.page_num, self.size = pages, pages * PAGE
        dims = {
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first": (2, self.size, layers, heads, head_dim),
            "page_first_direct": (2, pages, layers, PAGE, heads, head_dim),
            "page_head": (2, pages, heads, PAGE, layers, head_dim),
        }[layout]
        self.kv_buffer = torch.full(dims, float("nan"), dtype=dtype)
        for name, fn in _engine_pool_methods().items():
            setattr(self, name, types.MethodType(fn, self))

    def read(self, slots: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [heads, len(slots), head_dim] of one layer at host token slots."""
        kv = []
        for b in self.kv_buffer:  # keys, then values
            rows = []
            for s in slots:
                page, off = divmod(s, PAGE)
                if self.layout == "layer_first":
                    rows.append(b[layer, s])
                elif self.layout == "page_first":
                    rows.append(b[s, layer])
                elif self.layout == "page_first_direct":
                    rows.append(b[page, layer, off])
                else:  # page_head
                    rows.append(b[page, :, off, layer])
            kv.append(torch.stack(rows, dim=1))  # [heads, tokens, dim]
        return kv[0], kv[1]


def _config(store=None, tp_rank=0, tp_size=1, model_name="tiny-qwen2", **extra):
    extra_config = {"page_store": str(store)} | extra if store is not None else extra
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model_name, extra_config=extra_config,
    )  # fmt: skip


def tiny_handoff():
    """A context read by one tiny qwen2 and translated into another's cache space."""
    source, target = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=0)
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (1, TOKENS))
    bridge = Bridge.identity(target)
    return source, target, bridge, ids


def bridged_cache(handoff):
    source, target, bridge, ids = handoff
    return BridgedCache(bridge, capture_kv(source, ids), target, ids)


def _engine_keys(ids, cache_salt):
    """The page keys SGLang's controller computes for a request (utils.get_storage_hash_str)."""
    return get_hash_str(ids[0].tolist(), storage_namespace_seed(None, cache_salt), page_size=PAGE)


def _load(backend, pool, keys, host_pages):
    """The controller's generic page get (_generic_page_get): dummy flat pages, batch_get, copy
    each into the host pool. Returns the host token slots of the loaded positions in order."""
    dst = [pool.get_dummy_flat_data_page() for _ in keys]
    data = backend.batch_get(keys, dst)
    for i, page in enumerate(data):
        assert page is not None
        pool.set_from_flat_data_page(host_pages[i] * PAGE, page)
    return [p * PAGE + o for p in host_pages[: len(keys)] for o in range(PAGE)]


def _read_back(storage, layout, heads, keys, host_pages):
    """What the engine loads: SGLang's generic page get (batch_get into dummy flat pages, then
    its own set_from_flat_data_page). Returns per layer (keys, values) [heads, tokens, head_dim]."""
    pool = HostPool(layout, 3, heads, 16, torch.float32)
    assert storage.batch_exists(keys) == len(keys)
    slots = _load(storage, pool, keys, host_pages=host_pages)
    return [pool.read(slots, layer) for layer in range(3)]
