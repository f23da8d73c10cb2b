"""Publishers check their arguments before any translation, and what they claim to have stored
is read back before they report success: a short write, a replaced file, two publications of
one context in other dtypes, an LMCache publisher with no ranks."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch
from conftest import require_engine
from tiny_models import byte_tokenizer, tiny_model

from bridgecache.bridge.maps import Bridge
from bridgecache.integrations.pages import PageStore, read_context
from bridgecache.integrations.publish import publish, publish_context
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache

publishing = importlib.import_module("bridgecache.integrations.publish")  # the module, not the function
pytestmark = pytest.mark.usefixtures("one_thread")
PAGE = 4


@pytest.fixture(scope="module")
def handoff():
    source, target = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=0)
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (1, 25))
    return source, target, Bridge.identity(target), ids


def _cache(handoff):
    source, target, bridge, ids = handoff
    return BridgedCache(bridge, capture_kv(source, ids), target, ids)


class _NoWork:
    """A cache stand-in that fails the test if anything translates it."""

    def __getattr__(self, name):
        raise AssertionError(f"publish read the cache ({name}) before refusing its arguments")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(salt=None), TypeError, "salt is None; expected a str"),
        (dict(salt=3), TypeError, "salt is 3"),
        (dict(page_size=0), ValueError, "page_size is 0"),
        (dict(page_size=True), ValueError, "page_size is True"),
        (dict(page_size="4"), ValueError, "page_size is '4'"),
        (dict(model_name=""), ValueError, "model_name is ''"),
        (dict(model_name=7), ValueError, "model_name is 7"),
        (dict(dtype="bfloat16"), TypeError, "dtype is 'bfloat16'"),
        (dict(dtype=torch.int8), TypeError, "dtype is torch.int8"),
        (dict(accept=True), TypeError, "accept is a bool"),
        (dict(layout="page_first"), ValueError, "layout= is for a HiCacheStorage"),
    ],
)
def test_bad_publishing_arguments_are_refused_before_any_work(tmp_path, kwargs, error, message):
    arguments = dict(page_size=PAGE, model_name="tiny") | kwargs
    with pytest.raises(error, match=message):
        publish(_NoWork(), torch.zeros(1, 8, dtype=torch.long), tmp_path / "store", **arguments)
    assert not any(tmp_path.iterdir())


def test_a_bad_destination_is_refused_before_any_work(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        publish(_NoWork(), ids, a_file, page_size=PAGE, model_name="tiny")
    with pytest.raises(TypeError, match="destination is a dict"):
        publish(_NoWork(), ids, {}, page_size=PAGE, model_name="tiny")
    assert a_file.read_text() == "x"


# Optional engines and store clients (pyproject's extras, .ci/run's installs): none is needed to
# refuse a bad argument, and a refusal never imports one.
ENGINES = ("sglang", "lmcache", "vllm", "redis", "boto3", "botocore", "moto", "lm_eval")
WITHOUT_ENGINES = r"""
import json, sys

sys.modules.update(dict.fromkeys(ENGINES))  # None: imports fail and find_spec says None, as if not installed
import torch
from bridgecache.integrations import publish, publish_context
from bridgecache.integrations.vllm import VLLM_INSTALLED

ids, refused = torch.zeros(1, 8, dtype=torch.long), []
for destination, layout in [({}, None), ([], None), (object(), None), (DIRECTORY, "page_first")]:
    try:
        publish(None, ids, destination, page_size=4, model_name="tiny", layout=layout)
    except (TypeError, ValueError) as err:
        refused.append(str(err))
try:
    publish_context(None, "a b c", None, None, None, {"pages": []}, page_size=4)
except TypeError as err:
    refused.append(str(err))
loaded = sorted(m for m, module in sys.modules.items() if module and m.partition(".")[0] in ENGINES)
print(json.dumps({"refused": refused, "loaded": loaded, "vllm": VLLM_INSTALLED}))
"""


def test_bad_destinations_are_refused_without_any_engine_installed(tmp_path):
    code = f"ENGINES, DIRECTORY = {ENGINES!r}, {str(tmp_path)!r}\n" + WITHOUT_ENGINES
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert [message.split(";")[0] for message in seen["refused"]] == [
        "destination is a dict",
        "destination is a list",
        "destination is a object",
        "layout= is for a HiCacheStorage destination",
        "destination is a dict",
    ]
    assert seen["loaded"] == [] and seen["vllm"] is False  # the connector's module imports without vLLM
    assert not any(tmp_path.iterdir())


def test_publish_context_checks_config_text_and_window_before_the_source_runs(handoff, tmp_path):
    source, target, bridge, _ = handoff
    tok = byte_tokenizer()

    def ran(*args, **kwargs):
        raise AssertionError("the source ran before the input was refused")

    hook = source.model.register_forward_pre_hook(ran)  # capture_kv runs the decoder alone
    try:
        common = dict(page_size=PAGE, model_name="tiny", source=source)
        with pytest.raises(TypeError, match="config is a dict"):
            publish_context(bridge, "a b c", target, tok, tok, tmp_path, config={"refresh": None}, **common)
        with pytest.raises(TypeError, match="context is a list"):
            publish_context(bridge, ["a b c"], target, tok, tok, tmp_path, **common)
        window = bridge.target.max_position_embeddings
        with pytest.raises(ValueError, match=f"{window + 1} .*reads at most {window}"):
            publish_context(bridge, "x" * (window + 1), target, tok, tok, tmp_path, **common)
        with pytest.raises(TypeError, match="salt is None"):
            publish_context(bridge, "a b c d e f g h", target, tok, tok, tmp_path, salt=None, **common)
    finally:
        hook.remove()
    assert not any(tmp_path.iterdir())


def test_two_dtypes_of_one_context_are_two_readable_publications(handoff, tmp_path):
    cache = _cache(handoff)
    ids = handoff[3]
    a = publish(cache, ids, tmp_path, page_size=PAGE, model_name="tiny", dtype=torch.float32)
    b = publish(cache, ids, tmp_path, page_size=PAGE, model_name="tiny", dtype=torch.bfloat16)
    c = publish(cache, ids, tmp_path, page_size=PAGE, model_name="other", dtype=torch.float32)
    assert a.page_keys == b.page_keys == c.page_keys  # one context, one namespace
    assert len({a.manifest_path, b.manifest_path, c.manifest_path}) == 3
    store = PageStore(tmp_path)
    dtypes = sorted(m.dtype for m in store.manifests)
    assert dtypes == ["bfloat16", "float32", "float32"]
    for manifest in store.manifests:
        keys, _ = read_context(manifest)  # every one whole
        assert keys.dtype == getattr(torch, manifest.dtype)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3


def test_a_tensor_file_replaced_during_the_publish_is_an_error(handoff, tmp_path, monkeypatch):
    real = publishing.write_new_file

    def racing(path, data):
        out = real(path, data)
        if path.suffix == ".safetensors":  # another writer of the same name, between our two files
            real(path, bytes(data[:-8]) + b"\0" * 8)
        return out

    monkeypatch.setattr(publishing, "write_new_file", racing)
    with pytest.raises(OSError, match="did not keep what was published"):
        publish(_cache(handoff), handoff[3], tmp_path, page_size=PAGE, model_name="tiny")


# ---------------------------------------------------------------------------------- engines


def _hicachefile(directory, storage_class=None):
    require_engine("sglang")
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="tiny",
        extra_config={"file_storage_path": str(directory)},
    )  # fmt: skip
    return (storage_class or HiCacheFile)(config)


def test_hicache_file_short_writes_are_detected(handoff, tmp_path):
    require_engine("sglang")
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    class FullDisk(HiCacheFile):
        """numpy's tofile on a full disk: half the page lands, and set() still says True."""

        def set(self, key, value=None, target_location=None, target_sizes=None):
            return super().set(key, value.reshape(-1)[: value.numel() // 2])

    cache = _cache(handoff)
    with pytest.raises(RuntimeError, match="did not store 6 of 6 pages whole"):
        publish(
            cache,
            handoff[3],
            _hicachefile(tmp_path, FullDisk),
            page_size=PAGE,
            model_name="tiny",
            layout="layer_first",
        )
    # an earlier truncated copy is skipped by HiCacheFile's set ("exists"), and found on read-back
    with pytest.raises(RuntimeError, match="did not store"):
        publish(
            cache, handoff[3], _hicachefile(tmp_path), page_size=PAGE, model_name="tiny", layout="layer_first"
        )
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    published = publish(
        cache, handoff[3], _hicachefile(fresh), page_size=PAGE, model_name="tiny", layout="layer_first"
    )
    assert published.num_tokens == 24


def test_hicache_needs_a_known_layout_before_any_work(tmp_path):
    storage = _hicachefile(tmp_path)
    for layout in (None, "rows"):
        with pytest.raises(ValueError, match=f"layout is {layout!r}; publishing to a HiCacheStorage"):
            publish(_NoWork(), torch.zeros(1, 8, dtype=torch.long), storage, page_size=PAGE, layout=layout)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=0), "world_size is 0"),
        (dict(world_size=-1), "world_size is -1"),
        (dict(world_size=True), "world_size is True"),
        (dict(world_size=2.0), "world_size is 2.0"),
        (dict(timeout=0), "timeout is 0"),
        (dict(timeout=float("nan")), "timeout is nan"),
    ],
)
def test_lmcache_publisher_sizes_are_checked_when_built(kwargs, message):
    require_engine("lmcache")
    from lmcache.v1.config import LMCacheEngineConfig

    from bridgecache.integrations.lmcache import LMCachePublisher

    with pytest.raises(ValueError, match=message):
        LMCachePublisher(LMCacheEngineConfig.from_defaults(chunk_size=PAGE), **kwargs)


def test_the_manifest_names_the_dtype_it_was_written_in(handoff, tmp_path):
    pub = publish(
        _cache(handoff), handoff[3], tmp_path, page_size=PAGE, model_name="tiny", dtype=torch.float16
    )
    assert json.loads(pub.manifest_path.read_text())["dtype"] == "float16"
    assert "-float16-" in pub.manifest_path.name


@pytest.mark.parametrize(
    "kwargs, message", [(dict(tp_size=0), "tp_size is 0"), (dict(layout="rows"), "layout is 'rows'")]
)
def test_export_hicache_file_checks_its_sizes_first(tmp_path, kwargs, message):
    require_engine("sglang")
    from bridgecache.integrations.sglang import export_hicache_file

    arguments = dict(layout="layer_first") | kwargs
    with pytest.raises(ValueError, match=message):
        export_hicache_file(tmp_path / "no-store", tmp_path / "out", **arguments)
    assert not (tmp_path / "out").exists()
