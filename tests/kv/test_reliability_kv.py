"""KV files and source KV: a checksum catches any flipped byte; every malformed header gets a
KVFileError naming the field and what was expected, bounded by what the file holds; KV know the
model and the tokens they belong to, and are refused elsewhere; saves are atomic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import Bridge, BridgedCache, HandoffConfig, capture_kv, handoff
from bridgecache.files import STAGING_PREFIX, current_umask
from bridgecache.kv.files import _kv_digest, as_source, load_kv, save_kv
from bridgecache.kv.source import KVFileError, KVMismatchError
from bridgecache.models.fingerprint import weight_fingerprint
from bridgecache.models.spec import SpecMismatchError, model_spec


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _kv(layers: int = 2, tokens: int = 5):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(1, 2, tokens, 4, generator=g), torch.randn(1, 2, tokens, 4, generator=g))
        for _ in range(layers)
    ]


def _header(layers: int = 2, **fields) -> dict:
    spec = model_spec(tiny_model("llama")).to_dict()
    header = {
        "format": "bridgecache.kv/3",
        "num_layers": str(layers),
        "first_token": json.dumps([0] * layers),
        "model": json.dumps(spec),
        "model_fingerprint": "0123456789abcdef",
    }
    return {k: v for k, v in (header | fields).items() if v is not None}


def _raw(path, header: dict, layers: int = 2, tokens: int = 5, digest: bool = True, **replace):
    """A safetensors file with the given header (a valid checksum added unless digest=False)."""
    tensors = {
        "position_ids": torch.arange(tokens)[None],
        "attention_mask": torch.ones(1, tokens, dtype=torch.long),
    }
    tensors["input_ids"] = torch.arange(tokens)[None] + 40
    for i, (k, v) in enumerate(_kv(layers, tokens)):
        tensors[f"keys.{i}"], tensors[f"values.{i}"] = k, v
    tensors |= replace
    if digest:
        header = {"sha256": _kv_digest(tensors)} | header
    save_file(tensors, str(path), metadata=header)
    return path


def _save(path, llama, tokens: int = 5, **metadata):
    ids = torch.arange(tokens)[None] + 40
    return save_kv(path, _kv(tokens=tokens), model=llama, input_ids=ids, **metadata)


def test_roundtrip_is_exact_records_where_the_kv_came_from_and_leaves_the_source_alone(tmp_path, llama):
    kv = _kv()
    copies = [(k.clone(), v.clone()) for k, v in kv]
    ids = torch.arange(5)[None] + 40
    loaded = load_kv(save_kv(tmp_path / "c.safetensors", kv, model=llama, input_ids=ids, note="hello"))
    for (k, v), (k0, v0), k1, v1 in zip(kv, copies, loaded.keys, loaded.values):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # source untouched
        assert torch.equal(k1, k0) and torch.equal(v1, v0)
    assert loaded.model == model_spec(llama) and loaded.fingerprint == weight_fingerprint(llama)
    assert torch.equal(loaded.input_ids, ids)


def test_save_kv_refuses_kv_that_do_not_say_where_they_came_from(tmp_path, llama):
    with pytest.raises(ValueError, match=r"pass model= \(the source model\) and input_ids="):
        save_kv(tmp_path / "c.safetensors", _kv())
    with pytest.raises(KVMismatchError, match=r"hold \(1, 5\) tokens .*; the context given has \(1, 4\)"):
        save_kv(tmp_path / "c.safetensors", _kv(), model=llama, input_ids=torch.arange(4)[None])
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("offset", [8 + 50, -1, -40])  # inside the tensors, at the very end, near the end
def test_any_flipped_byte_in_the_tensors_is_refused(tmp_path, llama, offset):
    path = _save(tmp_path / "c.safetensors", llama)
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    index = 8 + header_len + 50 if offset > 0 else len(data) + offset
    data[index] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(KVFileError, match="checksum mismatch"):
        load_kv(path)


@pytest.mark.parametrize(
    "header,message",
    [
        (_header(num_layers=None), r"'num_layers' is None; expected a positive"),
        (_header(num_layers="abc"), r"'num_layers' is 'abc'"),
        (_header(num_layers="0", first_token="[]"), r"'num_layers' is '0'"),
        (_header(first_token=None), r"'first_token' is None; expected a JSON list of 2"),
        (_header(first_token="[0,"), r"'first_token' is '\[0,'"),
        (_header(first_token="[0]"), r"'first_token' is '\[0\]'"),
        (_header(first_token="[0, -1]"), r"integers >= 0"),
        (_header(first_token="[0, 9]"), r"layer 1 holds rows 9"),
        (_header(3, first_token="[0, 0, 0]"), r"'num_layers' is 3, but the file holds keys of 2 layers"),
        (_header(model_fingerprint=None), r"'model_fingerprint' is None; expected 16 hex digits"),
        (_header(model="{}"), r"'model' is not a model spec: field 'model.num_layers' is None"),
        (_header(model='{"num_layers": 10000000000}'), r"'model.num_layers' is 10000000000 \(int\)"),
        (_header(model="[[[["), r"'model' is not a model spec"),
        ({"format": "something/else"}, r"not a bridgecache KV file \(format 'something/else'"),
        ({}, r"not a bridgecache KV file \(format None"),
        (_header(format="bridgecache.kv/1"), r"older bridgecache without a checksum"),
        (_header(format="bridgecache.kv/2"), r"older bridgecache without the model and the tokens"),
    ],
)
def test_malformed_headers_are_named(tmp_path, header, message):
    path = _raw(tmp_path / "c.safetensors", header)
    with pytest.raises(KVFileError, match=message) as info:
        load_kv(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "replace,message",
    [
        ({"keys.1": torch.ones(1, 2, 5, 4, dtype=torch.int64)}, r"layer 1 keys are torch.int64"),
        ({"values.0": torch.full((1, 2, 5, 4), float("nan"))}, r"layer 0 values hold 40 NaN or infinite"),
        ({"keys.1": torch.full((1, 2, 5, 4), float("inf"))}, r"layer 1 keys hold 40 NaN or infinite"),
        (
            {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
            r"input_ids is a torch.int64 tensor of shape \(1, 4\)",
        ),
        ({"position_ids": torch.zeros(1, 5)}, r"position_ids is a torch.float32 tensor"),
        ({"extra": torch.zeros(1)}, r"holds unexpected tensors \['extra'\]"),
    ],
)
def test_tensors_of_the_wrong_dtype_or_not_finite_are_refused(tmp_path, replace, message):
    path = _raw(tmp_path / "c.safetensors", _header(), **replace)
    with pytest.raises(KVFileError, match=message):
        load_kv(path)


def test_a_header_claiming_millions_of_layers_costs_nothing_and_says_so_briefly(tmp_path):
    """The header format allows ~100 MB of metadata; counts are bounded by the tensors held first."""
    layers = 5_000_000
    path = _raw(
        tmp_path / "c.safetensors", _header(num_layers=str(layers), first_token=json.dumps([0] * layers))
    )
    tracemalloc.start()
    with pytest.raises(
        KVFileError, match=r"'num_layers' is 5,000,000, but the file holds keys of 2 layers"
    ) as info:
        load_kv(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(str(info.value)) < 300
    assert peak < 3 * path.stat().st_size  # the header string itself, not lists of millions


def test_a_first_token_list_too_long_for_its_layers_is_not_parsed(tmp_path):
    path = _raw(tmp_path / "c.safetensors", _header(first_token=json.dumps([0] * 2_000_000)))
    with pytest.raises(
        KVFileError, match=r"'first_token' is '\[0, 0, 0.*\.\.\..*'; expected a JSON list of 2"
    ) as info:
        load_kv(path)
    assert len(str(info.value)) < 300


def test_a_missing_checksum_is_named(tmp_path):
    path = _raw(tmp_path / "c.safetensors", _header(), digest=False)
    with pytest.raises(KVFileError, match=r"'sha256' is None; expected 64 hex digits"):
        load_kv(path)


def test_reserved_metadata_is_refused_and_files_get_the_umask_mode(tmp_path, llama):
    for key in ("format", "model_fingerprint"):
        with pytest.raises(ValueError, match=rf"\['{key}'\] are reserved"):
            _save(tmp_path / "c.safetensors", llama, **{key: "mine"})
    assert not (tmp_path / "c.safetensors").exists()
    path = _save(tmp_path / "c.safetensors", llama)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~current_umask()


def test_header_is_json_readable_by_others(tmp_path, llama):
    path = _save(tmp_path / "c.safetensors", llama, note="tiny")
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    meta = header["__metadata__"]
    assert meta["note"] == "tiny" and len(meta["sha256"]) == 64
    assert json.loads(meta["model"])["model_type"] == "llama" and len(meta["model_fingerprint"]) == 16


# ---------------------------------------------------------------------- KV that know their model


def test_a_kv_file_of_another_checkpoint_or_another_document_is_refused(tmp_path, llama):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    path = save_kv(tmp_path / "c.safetensors", capture_kv(llama, ids))
    load_kv(path, model=llama, input_ids=ids)  # its own model and tokens: fine
    other = tiny_model("llama", seed=1)  # same architecture and shapes, other weights
    with pytest.raises(KVMismatchError, match=r"c.safetensors were computed by a model with weights \w{16}"):
        load_kv(path, model=other)
    with pytest.raises(
        KVMismatchError, match=r"another document of the same length \(first difference at token 2"
    ):
        load_kv(path, input_ids=torch.tensor([[5, 6, 0, 8, 9, 10]]))
    with pytest.raises(KVMismatchError, match=r"hold \(1, 6\) tokens"):
        load_kv(path, input_ids=ids[:, :4])
    with pytest.raises(KVMismatchError, match="computed by a model with weights"):  # as_source binds too
        as_source(str(path), model=other)


def test_source_kv_objects_are_bound_to_their_model_and_tokens(llama):
    ids = torch.tensor([[5, 6, 7, 8]])
    kv = capture_kv(llama, ids)
    assert kv.model == model_spec(llama) and kv.fingerprint == weight_fingerprint(llama)
    with pytest.raises(KVMismatchError, match="computed by a model with weights"):
        as_source(kv, model=tiny_model("llama", seed=1))
    with pytest.raises(KVMismatchError, match="another document of the same length"):
        as_source(kv, input_ids=torch.tensor([[5, 6, 7, 9]]))
    bare = as_source([(k, v) for k, v in zip(kv.keys, kv.values)], model=llama, input_ids=ids)
    assert bare.fingerprint == kv.fingerprint and torch.equal(bare.input_ids, ids)  # bound from here on


@pytest.mark.parametrize(
    "pairs,message",
    [
        (
            [(torch.ones(1, 2, 5, 4, dtype=torch.long), torch.ones(1, 2, 5, 4))],
            r"layer 0 keys are a torch.int64",
        ),
        ([(torch.ones(1, 2, 5, 4), "x")], r"layer 0 values are a str"),
        (
            [(torch.ones(2, 5, 4), torch.ones(2, 5, 4))],
            r"layer 0 keys are a torch.float32 tensor of shape \(2, 5, 4\)",
        ),
    ],
)
def test_per_layer_tensors_of_the_wrong_kind_are_refused_where_they_enter(pairs, message):
    with pytest.raises(TypeError, match=message):
        as_source(pairs)


def test_kv_of_another_family_with_the_same_shapes_are_refused_by_every_bridge(llama):
    qwen = tiny_model("qwen2")  # 3 layers x 2 KV heads x 16, like the tiny llama
    kv = capture_kv(llama, torch.tensor([[5, 6, 7, 8, 9]]))
    assert [k.shape for k in kv.keys] == [
        k.shape for k in capture_kv(qwen, torch.tensor([[5, 6, 7, 8, 9]])).keys
    ]
    bridge = Bridge.identity(qwen)  # a bridge whose source is the qwen2 model
    with pytest.raises(
        SpecMismatchError, match=r"source KV were computed by a model other than .*model_type"
    ):
        BridgedCache(bridge, kv, qwen, torch.tensor([[5, 6, 7, 8, 9]]), config=HandoffConfig(refresh=None))
    tok = byte_tokenizer()
    with pytest.raises(SpecMismatchError, match=r"fitted for source model .* differs: model_type"):
        handoff(bridge, llama, qwen, "hello", source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=1)


def test_handoff_refuses_a_kv_file_of_another_document(tmp_path, llama):
    tok = byte_tokenizer()
    ids = tok("the cat sat", return_tensors="pt")["input_ids"]
    path = save_kv(tmp_path / "c.safetensors", capture_kv(llama, ids))
    bridge = Bridge.identity(llama)
    kwargs = dict(
        source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=1, config=HandoffConfig(refresh=None)
    )
    handoff(bridge, None, llama, "the cat sat", source_kv=path, **kwargs)  # its own document: fine
    with pytest.raises(KVMismatchError, match="another document of the same length"):
        handoff(bridge, None, llama, "the dog sat", source_kv=path, **kwargs)
    with pytest.raises(KVMismatchError, match="computed by a model with weights"):
        handoff(bridge, tiny_model("llama", seed=1), llama, "the cat sat", source_kv=path, **kwargs)


# ---------------------------------------------------------------------- interrupted saves


def test_a_killed_save_kv_leaves_the_old_file_and_the_next_load_removes_what_it_left(tmp_path, llama):
    path = save_kv(tmp_path / "c.safetensors", capture_kv(llama, torch.tensor([[5, 6, 7, 8]])))
    before = path.read_bytes()
    (tmp_path / "new").mkdir()
    new = save_kv(tmp_path / "new" / "n.safetensors", capture_kv(llama, torch.tensor([[1, 2, 3]])))
    marker = tmp_path / "stopped"
    worker = Path(__file__).resolve().parents[1] / "save_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, str(worker), "kv", str(new), str(path), str(marker)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while not marker.exists():
        assert child.poll() is None, child.communicate()[1][-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]
    assert left and sum(f.stat().st_size for f in left[0].iterdir()) > 0  # the half-written file
    assert path.read_bytes() == before  # the old file, whole
    assert torch.equal(load_kv(path).input_ids, torch.tensor([[5, 6, 7, 8]]))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]  # removed by the load


def test_every_entry_point_refuses_a_source_model_of_another_family_with_the_same_shapes(tmp_path, llama):
    """Bridge.check would refuse it; the entry points once checked only built-in bridges."""
    from bridgecache import handoff_batch
    from bridgecache.integrations.publish import publish_context
    from bridgecache.runtime.entry.conversation import Conversation

    qwen, tok = tiny_model("qwen2"), byte_tokenizer()
    bridge = Bridge.identity(qwen)  # fitted (exactly) for qwen2 -> qwen2; llama has the same KV shapes
    models = dict(source_tokenizer=tok, target_tokenizer=tok)
    calls = {
        "handoff": lambda: handoff(bridge, llama, qwen, "hello there", **models, max_new_tokens=1),
        "handoff_batch": lambda: handoff_batch(
            bridge, llama, qwen, ["hi", "hello"], **models, max_new_tokens=1
        ),
        "Conversation.handoff": lambda: Conversation.handoff(
            bridge, llama, qwen, [{"role": "user", "content": "hi"}], **models
        ),
        "publish_context": lambda: publish_context(
            bridge, "hello there", qwen, tok, tok, tmp_path / "pages", page_size=4, source=llama
        ),
    }
    for name, call in calls.items():
        with pytest.raises(SpecMismatchError, match="model_type") as info:
            call()
        assert "llama" in str(info.value) and "qwen2" in str(info.value), name
    assert not (tmp_path / "pages").exists() or not any((tmp_path / "pages").iterdir())


def test_kv_of_another_checkpoint_warn_like_a_model_of_another_checkpoint(llama):
    from bridgecache.models.spec import WeightMismatchWarning

    ids = torch.tensor([[5, 6, 7, 8]])
    bridge = Bridge.identity(llama)
    bridge.fingerprints = {"source": weight_fingerprint(llama), "target": weight_fingerprint(llama)}
    BridgedCache(
        bridge, capture_kv(llama, ids), llama, ids, config=HandoffConfig(refresh=None)
    )  # the fitted checkpoint: silent
    tuned = tiny_model("llama", seed=4)
    with pytest.warns(WeightMismatchWarning, match="source KV were computed by a model with weights"):
        BridgedCache(bridge, capture_kv(tuned, ids), llama, ids, config=HandoffConfig(refresh=None))
