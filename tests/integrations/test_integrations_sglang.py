"""SGLang HiCache adapter against sglang 0.5.23's own code (installed --no-deps; see .ci/run).

The engine side of these tests is SGLang's: its StorageBackendFactory builds our backend, its
get_hash_str computes the page keys a request looks up, its HiCacheFile reads exported files, and
its host pool's own set_from_flat_data_page / get_dummy_flat_data_page / get_page_buffer_meta
(read from the installed pool_host/mha.py: importing that module needs SGLang's GPU stack) place
each page."""

from __future__ import annotations

import pytest
import torch
from conftest import require_engine
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs
from bridgecache.integrations.keys import EngineMismatchError
from bridgecache.integrations.publish import publish

sglang = require_engine("sglang")
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang_pool import PAGE, HostPool, _config, _engine_keys, _load, _read_back  # noqa: E402
from sglang_pool import bridged_cache as _cache  # noqa: E402

from bridgecache.integrations.sglang import LAYOUTS, BridgedHiCacheStorage, export_hicache_file  # noqa: E402


@pytest.fixture
def published(handoff, tmp_path):
    cache = _cache(handoff).materialize()
    return cache, publish(cache, handoff[3], tmp_path / "store", page_size=PAGE, model_name="tiny-qwen2")


def _backend(store, pool, **config):
    backend = StorageBackendFactory.create_backend(
        "dynamic",
        _config(
            store, backend_name="bridgecache", module_path="bridgecache.integrations.sglang",
            class_name="BridgedHiCacheStorage", **config,
        ),
        pool,
    )  # fmt: skip
    backend.register_mem_pool_host(pool)
    return backend


def test_sglang_factory_builds_our_backend_as_dynamic(published, tmp_path):
    cache, pub = published
    pool = HostPool("page_first", 3, 2, 16, torch.float32)
    backend = _backend(pub.manifest_path.parent, pool)
    assert isinstance(backend, BridgedHiCacheStorage)
    assert backend.layout == "page_first"


def test_our_page_keys_are_sglangs_for_the_request_salt(published, handoff):
    cache, pub = published
    keys = _engine_keys(handoff[3], pub.cache_salt)
    assert list(pub.page_keys) == keys[: len(pub.page_keys)]
    assert len(pub.page_keys) == 6 and len(keys) == 7  # the last, partial page is the engine's


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_returns_exactly_the_bridged_kv_in_every_layout(published, handoff, layout, tp_size):
    cache, pub = published
    keys = _engine_keys(handoff[3], pub.cache_salt)
    for rank in range(tp_size):
        pool = HostPool(layout, 3, 2 // tp_size, 16, torch.float32)
        backend = _backend(pub.manifest_path.parent, pool, tp_rank=rank, tp_size=tp_size)
        hit = backend.batch_exists(keys)
        assert hit == 6
        slots = _load(backend, pool, keys[:hit], host_pages=[9, 2, 14, 0, 5, 11])
        heads = slice(rank * pool.head_num, (rank + 1) * pool.head_num)
        for layer in range(3):
            k, v = pool.read(slots, layer)
            assert torch.equal(k, cache.layers[layer].keys[0, heads, :24])
            assert torch.equal(v, cache.layers[layer].values[0, heads, :24])


def test_engine_order_driver_generates_what_bridgedcache_generates(published, handoff):
    """lookup (batch_exists on the request's keys), allocate host pages, load (batch_get, host
    pool), then the device cache per layer; the target prefills the rest and decodes."""
    _, target, _, ids = handoff
    cache, pub = published
    pool = HostPool("page_head", 3, 2, 16, torch.float32)
    backend = _backend(pub.manifest_path.parent, pool)
    keys = _engine_keys(ids, pub.cache_salt)
    hit = backend.batch_exists(keys)
    slots = _load(backend, pool, keys[:hit], host_pages=[3, 7, 1, 12, 4, 8])
    device = DynamicCache()
    for layer in range(3):
        k, v = pool.read(slots, layer)
        device.update(k[None], v[None], layer)
    engine = target.generate(
        ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **cache_kwargs(target, device)
    )
    reference = target.generate(
        ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **cache_kwargs(target, _cache(handoff))
    )
    native = target.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(engine, reference)
    assert not torch.equal(reference, native)  # the pages carry the source's reading, not the target's


def _hicachefile(directory, rank, tp_size, model_name="org/tiny-qwen2"):
    """SGLang's own file backend, built from its own config, as the engine builds it."""
    return HiCacheFile(
        _config(tp_rank=rank, tp_size=tp_size, model_name=model_name, file_storage_path=str(directory))
    )


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_publish_through_sglangs_hicachefile_reads_back_bit_identical(handoff, tmp_path, layout, tp_size):
    """publish() straight into SGLang's HiCacheFile (one per TP rank) in every layout; SGLang's
    batch_get with the request's salted keys returns exactly what BridgedCache holds."""
    cache = _cache(handoff).materialize()
    ranks = [_hicachefile(tmp_path / "hicache", r, tp_size) for r in range(tp_size)]
    pub = publish(cache, handoff[3], ranks, page_size=PAGE, model_name="org/tiny-qwen2", layout=layout)
    keys = _engine_keys(handoff[3], pub.cache_salt)[:6]
    assert list(pub.page_keys) == keys
    files = sorted(p.name for p in (tmp_path / "hicache").glob("*.bin"))
    assert len(files) == 6 * tp_size and all("_org-tiny-qwen2_" in f for f in files)
    for rank in range(tp_size):
        heads = slice(rank * 2 // tp_size, (rank + 1) * 2 // tp_size)
        reader = _hicachefile(tmp_path / "hicache", rank, tp_size)  # a fresh engine-side instance
        for layer, (k, v) in enumerate(_read_back(reader, layout, 2 // tp_size, keys, [4, 0, 5, 1, 3, 2])):
            assert torch.equal(k, cache.layers[layer].keys[0, heads, :24])
            assert torch.equal(v, cache.layers[layer].values[0, heads, :24])
    # without the salt (or with another) the engine's keys find nothing
    reader = _hicachefile(tmp_path / "hicache", 0, tp_size)
    assert reader.batch_exists(get_hash_str(handoff[3][0].tolist(), None, page_size=PAGE)) == 0
    assert reader.batch_exists(_engine_keys(handoff[3], "bridgecache-someone-else")) == 0
    # another served model's HiCacheFile (the file names carry the name) finds nothing either
    assert _hicachefile(tmp_path / "hicache", 0, tp_size, model_name="org/other").batch_exists(keys) == 0


def test_export_hicache_file_is_publishing_through_hicachefile(published, handoff, tmp_path):
    cache, pub = published
    files = export_hicache_file(
        pub.manifest_path.parent, tmp_path / "hicache", layout="page_first", tp_size=2
    )
    assert len(files) == 6 * 2 and all(f.is_file() for f in files)
    keys = _engine_keys(handoff[3], pub.cache_salt)[:6]
    for rank in range(2):
        reader = _hicachefile(tmp_path / "hicache", rank, 2, model_name="tiny-qwen2")
        for layer, (k, v) in enumerate(_read_back(reader, "page_first", 1, keys, list(range(6)))):
            assert torch.equal(k, cache.layers[layer].keys[0, rank : rank + 1, :24])
            assert torch.equal(v, cache.layers[layer].values[0, rank : rank + 1, :24])
    with pytest.raises(EngineMismatchError, match="published for model 'tiny-qwen2'"):
        export_hicache_file(
            pub.manifest_path.parent, tmp_path / "x", layout="page_first", model_name="org/other"
        )


def test_bridged_pages_never_answer_another_namespace(published, handoff, tmp_path):
    cache, pub = published
    source, target, bridge, ids = handoff
    pool = HostPool("page_first", 3, 2, 16, torch.float32)
    backend = _backend(pub.manifest_path.parent, pool, refresh_seconds=0)
    assert backend.batch_exists(get_hash_str(ids[0].tolist(), None, page_size=PAGE)) == 0  # no salt
    assert backend.batch_exists(_engine_keys(ids, "someone-else")) == 0
    other = publish(
        _cache(handoff), ids, tmp_path / "store", page_size=PAGE, salt="tenant-b", model_name="tiny-qwen2"
    )
    assert other.cache_salt != pub.cache_salt
    assert backend.batch_exists(_engine_keys(ids, other.cache_salt)) == 6  # found after a rescan
    # the engine's own write-back never replaces a published page, and clear() keeps them
    page = pool.get_dummy_flat_data_page()
    assert backend.set(pub.page_keys[0], torch.zeros_like(page))
    backend.clear()
    assert backend.batch_exists(_engine_keys(ids, pub.cache_salt)) == 6
    assert torch.equal(backend.get(pub.page_keys[0], page), backend.get(pub.page_keys[0]))
    assert not torch.equal(page, torch.zeros_like(page))


def test_engine_pages_go_to_a_hicachefile_beside_the_store(published):
    cache, pub = published
    pool = HostPool("layer_first", 3, 2, 16, torch.float32)
    backend = _backend(pub.manifest_path.parent, pool)
    page = torch.arange(pool.get_dummy_flat_data_page().numel(), dtype=torch.float32)
    assert backend.batch_set(["native-key"], [page])
    assert backend.exists("native-key")
    assert torch.equal(backend.get("native-key", torch.empty_like(page)), page)
    assert (pub.manifest_path.parent / "engine").is_dir()


@pytest.mark.parametrize(
    "geometry, field",
    [
        (dict(head_dim=64), "head_dim"),
        (dict(dtype=torch.bfloat16), "dtype"),
        (dict(layers=4), "num_layers"),
        (dict(heads=1), "KV heads"),
    ],
)
def test_a_bridge_that_does_not_fit_the_engine_model_is_refused(published, geometry, field):
    cache, pub = published
    args = dict(layers=3, heads=2, head_dim=16, dtype=torch.float32) | geometry
    pool = HostPool("page_first", args["layers"], args["heads"], args["head_dim"], args["dtype"])
    with pytest.raises(EngineMismatchError, match=field):
        _backend(pub.manifest_path.parent, pool)


def test_another_served_model_and_bad_configs_are_refused(published):
    cache, pub = published
    pool = HostPool("page_first", 3, 2, 16, torch.float32)
    with pytest.raises(EngineMismatchError, match="model_name"):
        _backend(pub.manifest_path.parent, pool, model_name="another-model")
    with pytest.raises(ValueError, match="page_store"):
        BridgedHiCacheStorage(_config(None))
    bad = HostPool("page_first", 3, 2, 16, torch.float32)
    bad.layout = "page_unified"
    with pytest.raises(EngineMismatchError, match="page_unified"):
        _backend(pub.manifest_path.parent, bad)


def test_the_zero_copy_interface_fills_the_host_pool_the_same_way(published, handoff):
    cache, pub = published
    pool = HostPool("page_first_direct", 3, 2, 16, torch.float32)
    backend = _backend(pub.manifest_path.parent, pool, interface_v1=1)
    keys = _engine_keys(handoff[3], pub.cache_salt)
    host_pages = [5, 0, 9, 2, 7, 3]
    host_indices = torch.tensor([p * PAGE + o for p in host_pages for o in range(PAGE)])
    assert backend.batch_get_v1(keys[:6], host_indices) == [True] * 6
    assert backend.batch_get_v1(["missing", keys[0]], host_indices[: 2 * PAGE]) == [False, False]
    slots = host_indices.tolist()
    for layer in range(3):
        k, v = pool.read(slots, layer)
        assert torch.equal(k, cache.layers[layer].keys[0, :, :24])
        assert torch.equal(v, cache.layers[layer].values[0, :, :24])
    assert backend.batch_set_v1(["native-page"], host_indices[:PAGE]) == [True]
    assert torch.equal(
        backend.native.get("native-page", pool.get_dummy_flat_data_page()), pool.get_data_page(5 * PAGE)
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_page_file_damaged_after_startup_is_a_miss_never_an_exception(published, handoff, damage):
    cache, pub = published
    pool = HostPool("page_first", 3, 2, 16, torch.float32)
    backend = _backend(pub.manifest_path.parent, pool, interface_v1=1)
    keys = _engine_keys(handoff[3], pub.cache_salt)[:6]
    assert backend.batch_exists(keys) == 6  # the engine's lookup, before the damage
    tensors = pub.manifest_path.with_suffix(".safetensors")
    raw = tensors.read_bytes()
    if damage == "flip":
        tensors.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif damage == "truncate":
        tensors.write_bytes(raw[: len(raw) // 2])
    else:
        tensors.unlink()
    dst = [pool.get_dummy_flat_data_page() for _ in keys]
    assert backend.batch_get(keys, dst) == [None] * 6  # SGLang: a failed prefetch, recomputed
    host_indices = torch.arange(6 * PAGE)
    assert backend.batch_get_v1(keys, host_indices) == [False] * 6
    assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])  # not offered again


def test_keys_that_are_not_hex_digests_never_name_a_file(published, handoff, tmp_path):
    import dataclasses

    from bridgecache.integrations.pages import PageStore

    cache, pub = published
    manifest = PageStore(pub.manifest_path.parent).manifests[0]
    hostile = dataclasses.replace(manifest, page_keys=("../../../escaped",) + manifest.page_keys[1:])
    out = tmp_path / "deep" / "er" / "hicache"
    with pytest.raises(ValueError, match="'../../../escaped'; expected 64 lowercase hex digits"):
        export_hicache_file(pub.manifest_path.parent, out, layout="page_first", manifests=[hostile])
    assert not list(tmp_path.rglob("*escaped*"))
    storage = _hicachefile(tmp_path / "h", 0, 1, model_name="tiny-qwen2")
    from bridgecache.integrations.hicache import write_hicache
    from bridgecache.integrations.publish import stored_pages

    pages = dataclasses.replace(stored_pages(manifest), page_keys=("a/b",) * 6)
    with pytest.raises(ValueError, match="'a/b'"):
        write_hicache(pages, storage, layout="page_first")
    assert not list((tmp_path / "h").rglob("*.bin"))
