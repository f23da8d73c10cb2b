"""Publishing into a second SGLang HiCache L3 backend: SGLang 0.5.23's own `SeaweedFSStore`, built
by its StorageBackendFactory as the engine builds it (one per TP rank), talking S3 through boto3 to
a real HTTP endpoint on loopback: moto's S3 server, standing in for SeaweedFS's S3 gateway (no
SeaweedFS binary can be installed here). SGLang's cache controller drives this backend zero-copy,
so publish writes through its batch_set_v1 from our staging pool's buffers, and a fresh instance
per rank reads through its batch_exists and batch_get_v1 into a host pool whose page methods and
buffer addresses are SGLang's own (test_integrations_sglang.HostPool).

Why this backend and not 3FS, shm, mmap, sim or Mooncake: docs/serving.md,
"Fleet recipe: SGLang + an L3 store".
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import require_engine

require_engine("sglang")
require_engine("boto3")  # SeaweedFSStore's S3 client (.ci/run installs it)
require_engine("moto.server")  # the S3 endpoint the test starts (.ci/run installs it)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.storage.seaweedfs.seaweedfs_store import SeaweedFSStore  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang_pool import PAGE, HostPool, _config, _engine_keys, _read_back  # noqa: E402
from sglang_pool import bridged_cache as _cache  # noqa: E402

from bridgecache.integrations.hicache import LAYOUTS, _per_page  # noqa: E402
from bridgecache.integrations.publish import publish  # noqa: E402

MODEL = "org/tiny-qwen2"
STORES: list[SeaweedFSStore] = []  # their request threads finish before the server stops


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """An S3 endpoint on a free loopback port (moto's server, in its own process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("s3") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"the S3 server exited ({proc.returncode}): {log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail(f"the S3 server did not listen on port {port} within 30 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        for store in STORES:  # batch_exists returns at the first miss; its other lookups run on
            store._executor.shutdown(wait=True)
        proc.terminate()
        proc.wait(timeout=10)


def _seaweedfs(endpoint, rank, tp_size, prefix, pool=None, model_name=MODEL):
    """SGLang's SeaweedFS backend for one TP rank, built by its factory from the engine's config
    (`--hicache-storage-backend seaweedfs` and this extra config); the engine then registers its
    host pool."""
    config = _config(
        tp_rank=rank, tp_size=tp_size, model_name=model_name, endpoint=endpoint, prefix=prefix,
        access_key="bridgecache", secret_key="test", max_workers=2,
    )  # fmt: skip
    storage = StorageBackendFactory.create_backend("seaweedfs", config, pool)
    assert isinstance(storage, SeaweedFSStore)
    STORES.append(storage)
    if pool is not None:
        storage.register_mem_pool_host(pool)
    return storage


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_publish_through_seaweedfs_reads_back_bit_identical(handoff, s3_endpoint, layout, tp_size):  # noqa: F811
    """publish() into SGLang's SeaweedFSStore (one per TP rank, zero-copy batch_set_v1); a fresh
    store per rank finds the request's salted keys and its batch_get_v1 fills SGLang's host pool
    (SGLang's own buffer addresses) with exactly what BridgedCache holds."""
    ids = handoff[3]
    cache = _cache(handoff).materialize()
    prefix = f"{layout}-tp{tp_size}"  # one deployment per case in the shared bucket
    ranks = [_seaweedfs(s3_endpoint, r, tp_size, prefix) for r in range(tp_size)]
    pub = publish(cache, ids, ranks, page_size=PAGE, model_name=MODEL, layout=layout)
    keys = _engine_keys(ids, pub.cache_salt)[:6]
    assert list(pub.page_keys) == keys
    host_pages = [4, 0, 5, 1, 3, 2]
    slots = [p * PAGE + o for p in host_pages for o in range(PAGE)]
    heads = 2 // tp_size
    for rank in range(tp_size):
        own = slice(rank * heads, (rank + 1) * heads)
        pool = HostPool(layout, 3, heads, 16, torch.float32)
        reader = _seaweedfs(s3_endpoint, rank, tp_size, prefix, pool)  # a fresh engine-side instance
        assert reader.batch_exists(keys) == 6
        assert reader.batch_get_v1(keys, torch.tensor(slots)) == [True] * 6  # the controller's path
        for layer in range(3):
            k, v = pool.read(slots, layer)
            assert torch.equal(k, cache.layers[layer].keys[0, own, :24])
            assert torch.equal(v, cache.layers[layer].values[0, own, :24])
        if layout != "layer_first":  # SeaweedFS: there an object is also the flat page of batch_get
            for layer, (k, v) in enumerate(_read_back(reader, layout, heads, keys, host_pages)):
                assert torch.equal(k, cache.layers[layer].keys[0, own, :24])
                assert torch.equal(v, cache.layers[layer].values[0, own, :24])
    # without the salt (or with another) the engine's keys find nothing; nor does another served
    # model or another TP split (SeaweedFS scopes its objects by both)
    reader = _seaweedfs(s3_endpoint, 0, tp_size, prefix)
    assert reader.batch_exists(get_hash_str(ids[0].tolist(), None, page_size=PAGE)) == 0
    assert reader.batch_exists(_engine_keys(ids, "bridgecache-someone-else")) == 0
    assert _seaweedfs(s3_endpoint, 0, tp_size, prefix, model_name="org/other").batch_exists(keys) == 0
    assert _seaweedfs(s3_endpoint, 0, 3 - tp_size, prefix).batch_exists(keys) == 0


def test_a_store_that_answers_per_buffer_counts_per_page():
    """HiCacheHF3FS's zero-copy batch_set_v1 answers one flag per buffer (keys, values: 2 per page);
    SGLang's controller takes all() of the list, and so does publish, per page."""
    assert _per_page([True] * 12, 6) == [True] * 6
    assert _per_page([True, True, True, False, True, True], 3) == [True, False, True]
    assert _per_page([True, False], 2) == [True, False]
    assert _per_page([True] * 5, 6) == [False] * 6  # a length that fits no page count: nothing stored
    assert _per_page(None, 2) == [False, False]
