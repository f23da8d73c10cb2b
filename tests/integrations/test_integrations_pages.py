"""The engine-neutral page store: keys, namespaces, publishing rules, verified reads."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import subprocess
import sys

import pytest
import torch
from tiny_models import tiny_model

from bridgecache import HandoffConfig, KVMismatchError, QualityPolicy, RefreshConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.integrations.keys import (
    EngineMismatchError,
    bridge_salt,
    head_range,
    namespace_seed,
    page_keys,
)
from bridgecache.integrations.pages import PageFormatError, PageStore
from bridgecache.integrations.publish import publish, publish_context
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.cache import BridgedCache


@pytest.fixture(scope="module")
def handoff():
    source, target = tiny_model("qwen2", seed=1), tiny_model("qwen2", seed=0)
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (1, 25))
    return source, target, Bridge.identity(target), ids


def _cache(handoff, ids=None, **config):
    source, target, bridge, default = handoff
    ids = default if ids is None else ids
    return BridgedCache(bridge, capture_kv(source, ids), target, ids, config=HandoffConfig(**config))


def test_page_keys_chain_full_pages_from_the_seed():
    seed = namespace_seed(None, "s")
    keys = page_keys([1, 2, 3, 4, 5], page_size=2, seed=seed)
    first = hashlib.sha256(bytes.fromhex(seed) + struct.pack("<2I", 1, 2)).digest()
    second = hashlib.sha256(first + struct.pack("<2I", 3, 4)).digest()
    assert keys == [first.hex(), second.hex()]  # the partial page [5] gets no key
    assert page_keys([1, 2, 3, 4], 2)[0] != keys[0]  # unseeded chains differ
    wide = page_keys([2**40, 1], 2)[0]
    assert wide == hashlib.sha256(b"\xff" + struct.pack("<2Q", 2**40, 1)).hexdigest()
    with pytest.raises(ValueError, match=">= 0"):
        page_keys([1, -1], 2)


def test_namespace_seed_separates_absent_empty_and_joined_parts():
    seeds = {
        namespace_seed(None, None),
        namespace_seed("", None),
        namespace_seed(None, ""),
        namespace_seed("a", "b"),
    }
    seeds |= {namespace_seed("ab", None), namespace_seed(None, "ab")}
    assert len(seeds) == 6 and None in seeds


def test_the_salt_names_the_bridge_and_the_user_salt(handoff):
    _, target, bridge, _ = handoff
    other = Bridge.identity(target)
    other.layers[1].key_bias[0, 0] = 0.5  # one number of one map differs
    salts = {bridge_salt(bridge), bridge_salt(bridge, "tenant-a"), bridge_salt(other)}
    assert len(salts) == 3 and all(s.startswith("bridgecache-") for s in salts)
    assert bridge_salt(bridge) == bridge_salt(Bridge.identity(target))  # deterministic


def test_the_salt_names_what_of_the_config_changes_the_kv(handoff):
    bridge = handoff[2]
    refreshed, other_share = HandoffConfig(), HandoffConfig(refresh=RefreshConfig(0.1))
    assert bridge_salt(bridge) == bridge_salt(bridge, config=refreshed)  # the default is every path's
    salts = {bridge_salt(bridge, config=c) for c in (refreshed, other_share, HandoffConfig(refresh=None))}
    assert len(salts) == 3
    # launch and graph choices change no KV value: same namespace; the gate can
    assert bridge_salt(bridge, config=HandoffConfig(one_launch=False, cuda_graphs=False)) == bridge_salt(
        bridge
    )
    gated = HandoffConfig(quality=QualityPolicy(min_quality=0.9))
    assert bridge_salt(bridge, config=gated) != bridge_salt(bridge)


def test_head_range_splits_or_replicates_heads():
    assert [head_range(4, r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [head_range(2, r, 4) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(EngineMismatchError, match="tp_size=3"):
        head_range(2, 0, 3)


def test_publish_writes_only_full_pages_before_the_prefix(handoff, tmp_path):
    cache = _cache(handoff, native_tail=5)  # prefix_length 19: four pages of 4, three positions left over
    pub = publish(cache, handoff[3], tmp_path, page_size=4, model_name="tiny", dtype=torch.bfloat16)
    assert pub.num_tokens == 16 and len(pub.page_keys) == 4
    store = PageStore(tmp_path)
    keys, values = store.page(pub.page_keys[3])
    assert keys.dtype == torch.bfloat16 and tuple(keys.shape) == (3, 2, 4, 16)
    assert torch.equal(keys[1], cache.layers[1].keys[0, :, 12:16].to(torch.bfloat16))
    assert torch.equal(values[2], cache.layers[2].values[0, :, 12:16].to(torch.bfloat16))
    manifest = json.loads(pub.manifest_path.read_text())
    assert manifest["positions"] == {"native_head": 1, "prefix_length": 19, "published": 16}


def test_the_quality_gate_can_refuse_and_then_nothing_is_written(handoff, tmp_path):
    seen = []
    assert (
        publish(
            _cache(handoff),
            handoff[3],
            tmp_path,
            page_size=4,
            model_name="tiny",
            accept=lambda c: seen.append(c) or False,
        )
        is None
    )
    assert len(seen) == 1 and seen[0].materialized_layers == [0, 1, 2]
    assert list(tmp_path.iterdir()) == []


def test_publish_refuses_what_it_cannot_serve(handoff, tmp_path):
    with pytest.raises(ValueError, match="fewer than one page"):
        publish(_cache(handoff), handoff[3], tmp_path, page_size=32, model_name="tiny")
    ids = handoff[3].repeat(2, 1)
    with pytest.raises(ValueError, match="one context"):
        publish(_cache(handoff, ids), ids, tmp_path, page_size=4, model_name="tiny")
    gemma = tiny_model("gemma3")
    ids = torch.randint(3, 300, (1, 20))
    cache = BridgedCache(Bridge.identity(gemma), capture_kv(gemma, ids), gemma, ids)
    with pytest.raises(ValueError, match="sliding-window"):
        publish(cache, ids, tmp_path, page_size=4, model_name="tiny")


def test_a_corrupted_or_foreign_context_is_never_loaded(handoff, tmp_path):
    pub = publish(_cache(handoff), handoff[3], tmp_path, page_size=4, model_name="tiny")
    tensors = pub.manifest_path.with_suffix(".safetensors")
    good = tensors.read_bytes()
    tensors.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(PageFormatError, match="sha256"):
        PageStore(tmp_path).page(pub.page_keys[0])
    tensors.write_bytes(good[: len(good) // 2])
    with pytest.raises(PageFormatError, match="sha256"):
        PageStore(tmp_path).page(pub.page_keys[0])
    tensors.write_bytes(good)
    assert PageStore(tmp_path).page(pub.page_keys[0])[0].shape == (3, 2, 4, 16)
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(PageFormatError, match="other.json.*something-else"):
        PageStore(tmp_path)
    (tmp_path / "other.json").write_text("{not json")
    with pytest.raises(PageFormatError, match="other.json"):
        PageStore(tmp_path)


def test_the_source_cache_is_not_mutated_by_publishing(handoff, tmp_path):
    source, target, bridge, ids = handoff
    kv = capture_kv(source, ids)
    before = [k.clone() for k in kv.keys]
    publish(BridgedCache(bridge, kv, target, ids), ids, tmp_path, page_size=4, model_name="tiny")
    assert all(torch.equal(a, b) for a, b in zip(before, kv.keys))


def test_while_serving_a_bad_manifest_is_skipped_and_partial_writes_are_never_read(handoff, tmp_path):
    pub = publish(_cache(handoff), handoff[3], tmp_path, page_size=4, model_name="tiny")
    store = PageStore(tmp_path)
    (tmp_path / ".tmp-half-written.json").write_text("{")  # a writer's temporary file: ignored
    (tmp_path / "late.json").write_text("{not json")
    assert store.refresh(strict=False) == []
    assert pub.page_keys[0] in store and store.page(pub.page_keys[0])[0].shape == (3, 2, 4, 16)
    with pytest.raises(PageFormatError, match="late.json"):
        PageStore(tmp_path)  # at startup the same file is an error


def test_publish_context_from_text_matches_publishing_the_cache(handoff, tmp_path):
    from tiny_models import byte_tokenizer

    from bridgecache.runtime.entry.handoff import context_ids
    from bridgecache.runtime.selection.words import context_words

    source, target, bridge, _ = handoff
    tok = byte_tokenizer()
    text = "the ship lost its mast near the rocks"
    pub = publish_context(
        bridge, text, target, tok, tok, tmp_path / "a", page_size=8, model_name="tiny", source=source
    )
    ids = context_ids(tok, text)
    words = context_words(text, tok, tok, ids, ids)  # publish_context knows them: the default takes them
    manual = publish(
        BridgedCache(bridge, capture_kv(source, ids), target, ids, source_model=source, words=words),
        ids,
        tmp_path / "b",
        page_size=8,
        model_name="tiny",
    )
    assert pub.page_keys == manual.page_keys and pub.num_tokens == 32
    a, b = PageStore(tmp_path / "a"), PageStore(tmp_path / "b")
    assert all(torch.equal(a.page(k)[0], b.page(k)[0]) for k in pub.page_keys)


def test_publish_context_refuses_kv_of_another_document(handoff, tmp_path):
    from tiny_models import byte_tokenizer

    from bridgecache.runtime.entry.handoff import context_ids

    source, target, bridge, _ = handoff
    tok = byte_tokenizer()
    text, other = "the ship lost its mast near the rocks", "the cat lost its hat near the docks"
    wrong_kv = capture_kv(source, context_ids(tok, other))  # same length, another document
    with pytest.raises(KVMismatchError, match="another document"):
        publish_context(
            bridge, text, target, tok, tok, tmp_path, page_size=8, model_name="tiny", source=source,
            source_kv=wrong_kv,
        )  # fmt: skip
    assert not any(tmp_path.iterdir())  # nothing published


# ---------------------------------------------------------------------------------- hostile files


def _manifest_with(path, **fields):
    d = json.loads(path.read_text())
    d.update(fields)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize(
    "bad", ["../../../x", "/etc/passwd", "a" * 63, "A" * 64, "g" * 64, "", "a" * 64 + "/..", 7, None]
)
def test_page_keys_that_are_not_hex_digests_are_refused(handoff, tmp_path, bad):
    pub = publish(_cache(handoff), handoff[3], tmp_path, page_size=4, model_name="tiny")
    keys = list(pub.page_keys)
    keys[2] = bad
    _manifest_with(pub.manifest_path, page_keys=keys)
    with pytest.raises(PageFormatError, match=r"page_keys\[2\] is .*expected 64 lowercase hex digits"):
        PageStore(tmp_path)
    (tmp_path / "empty").mkdir()  # while serving: skipped, logged, never indexed
    live = PageStore(tmp_path / "empty")
    pub.manifest_path.rename(tmp_path / "empty" / pub.manifest_path.name)
    assert live.refresh(strict=False) == [] and all(k not in live for k in pub.page_keys)


def test_check_page_key_names_what_is_wrong():
    from bridgecache.integrations.keys import check_page_key

    assert check_page_key("ab" * 32) == "ab" * 32
    with pytest.raises(ValueError, match=r"manifest key is '\.\./x'; expected 64 lowercase hex digits"):
        check_page_key("../x", "manifest key")


def test_temp_files_never_write_through_a_planted_symlink(tmp_path, monkeypatch):
    from bridgecache.integrations import pages

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    store = tmp_path / "store"
    store.mkdir()
    monkeypatch.setattr(pages.secrets, "token_hex", lambda n: "0" * 32)  # make the name guessable
    (store / ".tmp-00000000000000000000000000000000.part").symlink_to(victim)
    with pytest.raises(FileExistsError):
        pages.write_new_file(store / "x.json", b"attacker gets nothing")
    assert victim.read_bytes() == b"precious" and not (store / "x.json").exists()
    monkeypatch.undo()
    (store / "y.json").symlink_to(victim)  # a symlink at the final name is replaced, not followed
    pages.write_new_file(store / "y.json", b"new")
    assert victim.read_bytes() == b"precious"
    assert not (store / "y.json").is_symlink() and (store / "y.json").read_bytes() == b"new"


@pytest.mark.parametrize("umask, mode", [(0o002, 0o664), (0o022, 0o644), (0o077, 0o600)])
def test_published_files_follow_the_umask(handoff, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        pub = publish(_cache(handoff), handoff[3], tmp_path / "s", page_size=4, model_name="tiny")
    finally:
        os.umask(old)
    for path in (pub.manifest_path, pub.manifest_path.with_suffix(".safetensors")):
        assert stat.S_IMODE(path.stat().st_mode) == mode


WRITER = """
import sys
from bridgecache.integrations.pages import write_new_file
me, target = sys.argv[1], sys.argv[2]
for i in range(150):
    write_new_file(target, (me * 5000 + str(i)).encode())
"""


def test_concurrent_writers_in_real_processes_leave_one_whole_file_and_no_temp_files(tmp_path):
    target = tmp_path / "page.json"
    procs = [
        subprocess.Popen(  # not from the checkout: its kernels/ would shadow Hugging Face's `kernels`
            [sys.executable, "-c", WRITER, name, str(target)], stderr=subprocess.PIPE, cwd=tmp_path
        )
        for name in ("a", "b", "c")
    ]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-2000:]
    data = target.read_text()
    assert data[:5000] in {"a" * 5000, "b" * 5000, "c" * 5000} and data[5000:] == "149"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.json"]


def test_publish_needs_the_served_model_name(handoff, tmp_path):
    source, target, bridge, ids = handoff
    with pytest.raises(ValueError, match="publish needs model_name"):
        publish(_cache(handoff), ids, tmp_path, page_size=4)
    target.config._name_or_path = "org/named-target"
    try:
        pub = publish(_cache(handoff), ids, tmp_path, page_size=4)
    finally:
        target.config._name_or_path = ""
    assert json.loads(pub.manifest_path.read_text())["model_name"] == "org/named-target"
    _manifest_with(pub.manifest_path, model_name=None)  # e.g. written by an older bridgecache
    with pytest.raises(PageFormatError, match="names no served model"):
        PageStore(tmp_path)
