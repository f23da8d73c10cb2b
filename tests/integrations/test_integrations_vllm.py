"""vLLM KV connector: engine-order driver on a tiny model, isolation, refusals, and the interface
against vLLM 0.33.0 (its real classes and factory where vLLM is importable; CI has no vLLM:
the connector then runs on bridgecache.integrations._vllm_api, whose signatures the drift test
compares with the installed vLLM's)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_model
from transformers import DynamicCache

from bridgecache.bridge.maps import Bridge
from bridgecache.compat import cache_kwargs
from bridgecache.integrations import _vllm_api
from bridgecache.integrations.keys import EngineMismatchError
from bridgecache.integrations.publish import publish
from bridgecache.integrations.vllm import VLLM_INSTALLED, BridgedKVConnector, KVConnectorRole
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache

BLOCK = 4
TOKENS = 25
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


class _TransferConfig:
    """The KVTransferConfig fields the connector and vLLM's base read."""

    def __init__(self, **extra):
        self.kv_connector_extra_config = extra
        self.kv_role = "kv_consumer"
        self.is_kv_producer = False

    def get_from_extra_config(self, key, default):
        return self.kv_connector_extra_config.get(key, default)


class _ModelConfig:
    def __init__(self, heads=2, head_dim=16, layers=3, dtype=torch.float32, model_type="qwen2"):
        self.dtype, self.hf_text_config = dtype, SimpleNamespace(model_type=model_type)
        self._heads, self._dim, self._layers = heads, head_dim, layers

    def get_num_layers(self, parallel_config):
        return self._layers

    def get_total_num_kv_heads(self):
        return self._heads

    def get_head_size(self):
        return self._dim


def _vllm_config(store, tp=1, cache_dtype="auto", **model):
    return SimpleNamespace(
        kv_transfer_config=_TransferConfig(page_store=str(store)),
        model_config=_ModelConfig(**model),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    )


@pytest.fixture(scope="module")
def handoff():
    source, target = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=0)
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (1, TOKENS))
    return source, target, Bridge.identity(target), ids


def _cache(handoff):
    source, target, bridge, ids = handoff
    return BridgedCache(bridge, capture_kv(source, ids), target, ids)


@pytest.fixture
def published(handoff, tmp_path):
    cache = _cache(handoff).materialize()
    return cache, publish(cache, handoff[3], tmp_path / "store", page_size=BLOCK, model_name="tiny-qwen2")


def _request(ids, salt, rid="req-0"):
    return SimpleNamespace(request_id=rid, prompt_token_ids=ids[0].tolist(), cache_salt=salt)


def _blocks(block_ids):
    return SimpleNamespace(get_block_ids=lambda: (list(block_ids),))


def _paged_cache(heads=2, head_dim=16, blocks=16):
    return {
        name: SimpleNamespace(kv_cache=torch.full((blocks, heads, BLOCK, 2 * head_dim), float("nan")))
        for name in LAYERS
    }


def _run(store_dir, request, block_ids, local_tokens=0, layers=None, config=None):
    """Scheduler then worker, in vLLM's order. Returns (matched tokens, layers, worker)."""
    config = config or _vllm_config(store_dir)
    scheduler = BridgedKVConnector(config, KVConnectorRole.SCHEDULER, None)
    worker = BridgedKVConnector(config, KVConnectorRole.WORKER, None)
    matched, is_async = scheduler.get_num_new_matched_tokens(request, local_tokens)
    assert is_async is False
    scheduler.update_state_after_alloc(request, _blocks(block_ids), matched)
    meta = scheduler.build_connector_meta(SimpleNamespace())
    layers = layers if layers is not None else _paged_cache()
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace(no_compile_layers=layers, attn_metadata={}))
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return matched, layers, worker


def _read(layers, block_ids, tokens):
    """What vLLM's attention reads: per layer keys, values [heads, tokens, head_dim]."""
    slots = torch.tensor([block_ids[t // BLOCK] * BLOCK + t % BLOCK for t in range(tokens)])
    out = []
    for name in LAYERS:
        kv = layers[name].kv_cache[slots // BLOCK, :, slots % BLOCK].transpose(0, 1)  # [heads, tokens, 2d]
        d = kv.shape[-1] // 2
        out.append((kv[..., :d], kv[..., d:]))
    return out


def test_engine_order_driver_generates_what_bridgedcache_generates(published, handoff):
    cache, pub = published
    _, target, _, ids = handoff
    block_ids = [7, 2, 9, 0, 4, 11, 5]
    matched, layers, _ = _run(pub.manifest_path.parent, _request(ids, pub.cache_salt), block_ids)
    assert matched == 24  # six pages; the last prompt token is the engine's
    device = DynamicCache()
    for i, (k, v) in enumerate(_read(layers, block_ids, matched)):
        assert torch.equal(k, cache.layers[i].keys[0, :, :24]) and torch.equal(
            v, cache.layers[i].values[0, :, :24]
        )
        device.update(k[None], v[None], i)
    engine = target.generate(
        ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **cache_kwargs(target, device)
    )
    reference = target.generate(
        ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **cache_kwargs(target, _cache(handoff))
    )
    native = target.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(engine, reference)
    assert not torch.equal(reference, native)


def test_a_local_prefix_hit_loads_only_the_pages_after_it(published, handoff):
    cache, pub = published
    ids = handoff[3]
    block_ids = [3, 1, 8, 6, 12, 10, 14]
    layers = _paged_cache()
    matched, layers, _ = _run(pub.manifest_path.parent, _request(ids, pub.cache_salt), block_ids, 8, layers)
    assert matched == 16
    assert torch.isnan(layers[LAYERS[0]].kv_cache[block_ids[:2]]).all()  # vLLM's own blocks untouched
    for i, (k, _) in enumerate(_read(layers, block_ids[2:], 16)):
        assert torch.equal(k, cache.layers[i].keys[0, :, 8:24])


def test_a_prompt_ending_on_a_page_boundary_leaves_its_last_page_to_the_engine(published, handoff):
    _, pub = published
    ids = handoff[3][:, :24]
    matched, _, _ = _run(pub.manifest_path.parent, _request(ids, pub.cache_salt), list(range(6)))
    assert matched == 20


def test_bridged_pages_never_answer_another_request(published, handoff):
    _, pub = published
    ids = handoff[3]
    for salt in (None, "", "tenant-a", "bridgecache-0000000000000000000000000000000"):
        matched, layers, _ = _run(pub.manifest_path.parent, _request(ids, salt), list(range(7)))
        assert matched == 0
        assert torch.isnan(layers[LAYERS[0]].kv_cache).all()


def test_tensor_parallel_ranks_get_their_heads(published, handoff, monkeypatch):
    cache, pub = published
    ids = handoff[3]
    for rank in range(2):
        monkeypatch.setattr(BridgedKVConnector, "tp_rank", lambda self, r=rank: r)
        layers = _paged_cache(heads=1)
        config = _vllm_config(pub.manifest_path.parent, tp=2)
        matched, layers, _ = _run(
            None, _request(ids, pub.cache_salt), list(range(7)), layers=layers, config=config
        )
        for i, (k, v) in enumerate(_read(layers, list(range(7)), matched)):
            assert torch.equal(k, cache.layers[i].keys[0, rank : rank + 1, :24])
            assert torch.equal(v, cache.layers[i].values[0, rank : rank + 1, :24])


def test_a_page_that_fails_to_load_is_reported_for_recompute(published, handoff):
    _, pub = published
    ids = handoff[3]
    config = _vllm_config(pub.manifest_path.parent)
    scheduler = BridgedKVConnector(config, KVConnectorRole.SCHEDULER, None)
    worker = BridgedKVConnector(config, KVConnectorRole.WORKER, None)
    request = _request(ids, pub.cache_salt)
    matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, _blocks(range(7)), matched)
    raw = bytearray(pub.manifest_path.with_suffix(".safetensors").read_bytes())
    raw[-1] ^= 0xFF  # corrupted after the lookup
    pub.manifest_path.with_suffix(".safetensors").write_bytes(bytes(raw))
    worker.bind_connector_metadata(scheduler.build_connector_meta(SimpleNamespace()))
    layers = _paged_cache()
    worker.start_load_kv(SimpleNamespace(no_compile_layers=layers, attn_metadata={}))
    assert worker.get_block_ids_with_load_errors() == set(range(6))
    assert torch.isnan(layers[LAYERS[0]].kv_cache).all()  # nothing of a corrupted file was written


@pytest.mark.parametrize(
    "model, field",
    [
        (dict(head_dim=32), "head_dim"),
        (dict(heads=4), "num_kv_heads"),
        (dict(dtype=torch.bfloat16), "dtype"),
        (dict(model_type="llama"), "model_type"),
        (dict(layers=4), "num_layers"),
        (dict(cache_dtype="fp8"), "kv-cache-dtype"),
    ],
)
def test_a_bridge_that_does_not_fit_the_engine_model_is_refused(published, model, field):
    _, pub = published
    with pytest.raises(EngineMismatchError, match=field):
        BridgedKVConnector(_vllm_config(pub.manifest_path.parent, **model), KVConnectorRole.WORKER, None)


def test_a_paged_cache_in_another_layout_is_refused_at_startup_and_reported_while_serving(published, handoff):
    _, pub = published
    worker = BridgedKVConnector(_vllm_config(pub.manifest_path.parent), KVConnectorRole.WORKER, None)
    other = {name: torch.zeros(16, 2, 2, BLOCK, 16) for name in LAYERS}  # [2, blocks, ...]: not ours
    with pytest.raises(EngineMismatchError, match="2 \\* head_dim"):
        worker.register_kv_caches(other)
    worker.register_kv_caches({name: torch.zeros(16, 2, BLOCK, 32) for name in LAYERS})
    layers = {name: SimpleNamespace(kv_cache=kv) for name, kv in other.items()}
    _, layers, worker = _run(
        pub.manifest_path.parent, _request(handoff[3], pub.cache_salt), list(range(7)), layers=layers
    )
    assert worker.get_block_ids_with_load_errors() == set(range(6))
    assert not layers[LAYERS[0]].kv_cache.any()  # nothing written


@pytest.mark.parametrize("bad_block", [16, 99, -1])
def test_block_ids_beyond_the_cache_are_a_reported_load_error_not_an_exception(published, handoff, bad_block):
    _, pub = published
    block_ids = [3, 1, 8, bad_block, 12, 10, 14]  # one block the cache (16 blocks) does not have
    matched, layers, worker = _run(pub.manifest_path.parent, _request(handoff[3], pub.cache_salt), block_ids)
    assert matched == 24
    assert worker.get_block_ids_with_load_errors() == set(block_ids[:6])
    assert torch.isnan(layers[LAYERS[0]].kv_cache).all()  # a load that fails writes nothing


# ---------------------------------------------------------------------------------- vLLM itself


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed here (CI: see docs/serving.md)")
def test_the_copied_interface_matches_the_installed_vllm():
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    assert vllm.__version__ == "0.33.0", (
        f"bridgecache's vLLM interface copy is of 0.33.0; installed {vllm.__version__}"
    )
    for name in ("KVConnectorBase_V1", "SupportsHMA"):
        ours, real = getattr(_vllm_api, name), getattr(base, name)
        for attr, fn in vars(ours).items():
            if callable(fn) and not attr.startswith("__") or attr == "__init__":
                assert _params(fn) == _params(getattr(real, attr)), f"{name}.{attr} changed in vLLM"
    assert [r.name for r in _vllm_api.KVConnectorRole] == [r.name for r in base.KVConnectorRole]
    assert issubclass(BridgedKVConnector, base.KVConnectorBase_V1)
    assert not BridgedKVConnector.__abstractmethods__


@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed here (CI: see docs/serving.md)")
def test_vllms_request_validation_accepts_our_salt(published):
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    validate_cache_salt(published[1].cache_salt)  # raises on a salt vLLM's API would reject


@pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed here (CI: see docs/serving.md)")
def test_vllms_factory_loads_and_builds_the_connector(published):
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _, pub = published
    transfer = KVTransferConfig(
        kv_connector="BridgedKVConnector",
        kv_connector_module_path="bridgecache.integrations.vllm",
        kv_role="kv_consumer",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"page_store": str(pub.manifest_path.parent)},
    )
    assert KVConnectorFactory.get_connector_class(transfer) is BridgedKVConnector
    assert KVConnectorFactory.supports_hma_config(transfer)
    config = _vllm_config(pub.manifest_path.parent)
    config.kv_transfer_config = transfer
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
    assert isinstance(connector, BridgedKVConnector)
