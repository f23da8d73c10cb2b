"""LMCache 0.5.6 (vLLM + LMCache fleets): bridged chunks stored through LMCache's own engine
(token database keys, storage manager, backends, serialisation) and read back by LMCache's own
lookup and retrieve in a fresh process, per tensor-parallel rank, bit-identical to BridgedCache.

What stands in for the engine: vLLM's GPU copy kernel (LMCache has no CPU connector for vLLM),
here a connector that copies LMCache's memory objects into a CPU buffer [2, layers, tokens,
heads * head_dim]; everything between the request's tokens and that copy is LMCache's code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import require_engine, require_program
from tiny_models import tiny_model

from bridgecache.bridge.maps import Bridge
from bridgecache.integrations.publish import publish
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # no usage reports from tests (and its probe thread crashed here)
require_engine("lmcache")
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402

from bridgecache.integrations.lmcache import TAG, LMCachePublisher, lmcache_kv  # noqa: E402

CHUNK = 4

READER = textwrap.dedent(
    """
    import json, sys, torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata
    from bridgecache.integrations.lmcache import close_engine

    class Capture(GPUConnectorInterface):  # stands in for vLLM's GPU copy
        def __init__(self, shape): self.out = torch.full(shape, float("nan"))
        def get_shape(self, n): return torch.Size([2, self.out.shape[1], n, self.out.shape[3]])
        def to_gpu(self, m, s, e, **kw): self.out[:, :, s:e] = m.tensor
        def batched_to_gpu(self, ms=None, ss=None, es=None, **kw):
            for m, s, e in zip(ms, ss, es): self.to_gpu(m, s, e)
        def from_gpu(self, *a, **kw): raise NotImplementedError
        def batched_from_gpu(self, *a, **kw): raise NotImplementedError

    args = json.loads(sys.argv[1])
    tokens = torch.tensor(args["tokens"])
    result = {}
    for rank in range(args["world_size"]):
        config = LMCacheEngineConfig.from_defaults(**args["config"])
        L, H, D = args["layers"], args["heads"] // args["world_size"], args["head_dim"]
        metadata = LMCacheMetadata(model_name=args["model_name"], world_size=args["world_size"],
            local_world_size=args["world_size"], worker_id=rank, local_worker_id=rank,
            kv_dtype=torch.float32, kv_shape=(L, 2, args["chunk"], H, D), chunk_size=args["chunk"])
        capture = Capture((2, L, len(tokens), H * D))
        name = f"reader-{rank}"
        noop = lambda *a: None
        engine = LMCacheEngineBuilder.get_or_create(name, config, metadata, capture, noop, noop)
        engine.post_init()
        tagged = {args["tag"]: args["salt"]}
        result[f"lookup_tagged_{rank}"] = engine.lookup(tokens, request_configs=tagged)
        result[f"lookup_plain_{rank}"] = engine.lookup(tokens)
        other = {args["tag"]: "bridgecache-other"}
        result[f"lookup_other_{rank}"] = engine.lookup(tokens, request_configs=other)
        result[f"retrieved_{rank}"] = int(engine.retrieve(tokens, request_configs=tagged).sum())
        torch.save(capture.out, f"{args['out']}.{rank}.pt")
        close_engine(name)
    print("RESULT " + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def handoff():
    source, target = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=0)
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (1, 25))
    cache = BridgedCache(Bridge.identity(target), capture_kv(source, ids), target, ids).materialize()
    return cache, ids


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server (Debian's package; .ci/run installs it) on a free loopback port."""
    server = require_program("redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


def _read_in_fresh_process(tmp_path, config, cache, ids, salt, world_size):
    args = {
        "config": config, "tokens": ids[0, :24].tolist(), "world_size": world_size, "layers": 3, "heads": 2,
        "head_dim": 16, "chunk": CHUNK, "model_name": "org/tiny-qwen2", "tag": TAG, "salt": salt,
        "out": str(tmp_path / "retrieved"),
    }  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-c", READER, json.dumps(args)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path,  # not the checkout: its top-level kernels/ would shadow Hugging Face's `kernels`
    )  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    return result, [torch.load(tmp_path / f"retrieved.{r}.pt") for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("backend", ["fs", "redis"])
def test_lmcache_reads_back_the_bridged_chunks_bit_identical(handoff, tmp_path, request, backend, world_size):
    cache, ids = handoff
    url = f"fs://localhost:0{tmp_path}/lmcache/" if backend == "fs" else request.getfixturevalue("redis_url")
    config = dict(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, remote_url=url, remote_serde="naive"
    )
    if backend == "fs":
        (tmp_path / "lmcache").mkdir()
    with LMCachePublisher(LMCacheEngineConfig.from_defaults(**config), world_size=world_size) as lmcache:
        pub = publish(
            cache, ids, lmcache, page_size=CHUNK, model_name="org/tiny-qwen2", salt=f"{backend}-{world_size}"
        )
    assert pub.num_tokens == 24
    result, retrieved = _read_in_fresh_process(tmp_path, config, cache, ids, pub.cache_salt, world_size)
    heads = 2 // world_size
    for rank in range(world_size):
        assert result[f"lookup_tagged_{rank}"] == 24 and result[f"retrieved_{rank}"] == 24
        assert result[f"lookup_plain_{rank}"] == 0  # a request without the salt never matches
        assert result[f"lookup_other_{rank}"] == 0
        h = slice(rank * heads, (rank + 1) * heads)
        expected = lmcache_kv(
            torch.stack([layer.keys[0, h, :24] for layer in cache.layers]),
            torch.stack([layer.values[0, h, :24] for layer in cache.layers]),
        )
        assert torch.equal(retrieved[rank], expected)
    if (
        backend == "fs"
    ):  # LMCache's own key strings name the files: model, world size, worker, hash, dtype, tag
        names = sorted(p.name for p in (tmp_path / "lmcache").iterdir())
        assert len(names) == 6 * world_size
        tail = f"@float@bridgecache%{pub.cache_salt}.data"
        assert all(n.startswith(f"org-SEP-tiny-qwen2@{world_size}@") and n.endswith(tail) for n in names), (
            names
        )


def test_lmcache_local_disk_backend_holds_and_returns_the_chunks(handoff, tmp_path):
    """LMCache's local disk backend indexes its files in the writing process only (it does not
    rescan at start), so the read is LMCache's retrieve in the publishing process."""
    cache, ids = handoff
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
        local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=0.05,
    )  # fmt: skip
    lmcache = LMCachePublisher(config)
    try:
        pub = publish(cache, ids, lmcache, page_size=CHUNK, model_name="org/tiny-qwen2")
        engine = LMCacheEngineBuilder.get(lmcache._engines[0])
        out = torch.full((2, 3, 24, 32), float("nan"))

        class Capture(type(engine.gpu_connector)):
            def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
                for m, s, e in zip(memory_objs, starts, ends):
                    out[:, :, s:e] = m.tensor

        engine.gpu_connector.__class__ = Capture
        tokens = ids[0, :24]
        for _ in range(50):  # LMCache writes to disk asynchronously
            if len(list((tmp_path / "disk").rglob("*.pt"))) == 6:
                break
            time.sleep(0.1)
        assert len(list((tmp_path / "disk").rglob("*.pt"))) == 6
        assert engine.lookup(tokens) == 0
        assert int(engine.retrieve(tokens, request_configs={TAG: pub.cache_salt}).sum()) == 24
        expected = lmcache_kv(
            torch.stack([layer.keys[0, :, :24] for layer in cache.layers]),
            torch.stack([layer.values[0, :, :24] for layer in cache.layers]),
        )
        assert torch.equal(out, expected)
    finally:
        lmcache.close()


def test_the_publisher_refuses_pages_of_another_size_than_the_chunk(handoff):
    cache, ids = handoff
    with (
        LMCachePublisher(LMCacheEngineConfig.from_defaults(chunk_size=8, local_cpu=False)) as lmcache,
        pytest.raises(ValueError, match="chunk_size is 8"),
    ):
        publish(cache, ids, lmcache, page_size=CHUNK, model_name="org/tiny-qwen2")
