"""Bridge files: every bad field named with what was expected, saves that never leave half a
bridge, umask modes, and weight fingerprints that catch a fine-tuned copy."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from bridgecache.bridge.maps import Bridge, BridgeFormatError, WeightMismatchWarning
from bridgecache.files import STAGING_PREFIX, current_umask
from bridgecache.fitting import PairedKV, fit_layer_maps
from bridgecache.models.fingerprint import weight_fingerprint
from bridgecache.models.spec import SpecMismatchError, model_spec


@pytest.fixture(scope="module")
def models():
    return tiny_model("llama"), tiny_model("gemma3")


@pytest.fixture(scope="module")
def fitted(models):
    src, tgt = models
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(3):
        sk = [torch.randn(1, 2, 20, 16, generator=g) for _ in range(3)]
        tk = [torch.randn(1, 1, 20, 32, generator=g) for _ in range(4)]
        rows = torch.arange(1, 20)
        seqs.append(PairedKV(sk, sk, tk, tk, rows, rows, heldout=i == 2))
    layers, info = fit_layer_maps(
        lambda w: seqs, (3, 2, 16), (4, 1, 32), "cachebridge", layers_k=1, weighting="uniform"
    )
    prints = {"source": weight_fingerprint(src), "target": weight_fingerprint(tgt)}
    return Bridge(model_spec(src), model_spec(tgt), "cachebridge", "last", layers, 1, info, prints)


def _set(path: str, value):
    """An edit of bridge.json setting the field at a dotted path (list indices as integers)."""

    def edit(meta):
        *parents, last = path.split(".")
        node = meta
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if isinstance(node, list) else last] = value

    return edit


_DELETE = object()


@pytest.mark.parametrize(
    "path,value,message",
    [
        ("native_head", "abc", r"field 'native_head' is 'abc' \(str\); expected an integer >= 0"),
        ("native_head", -5, r"field 'native_head' is -5 \(int\); expected an integer >= 0"),
        ("native_head", 1.5, r"field 'native_head' is 1.5 \(float\); expected an integer >= 0"),
        ("native_head", True, r"field 'native_head' is True \(bool\); expected an integer >= 0"),
        ("target.num_layers", "3", r"field 'target.num_layers' is '3' \(str\); expected an integer >= 1"),
        ("source.num_kv_heads", 0, r"field 'source.num_kv_heads' is 0 \(int\); expected an integer >= 1"),
        ("source.head_dim", _DELETE, r"field 'source.head_dim' is missing"),
        ("target.model_type", 7, r"field 'target.model_type' is 7 \(int\); expected a string"),
        ("target.layer_types", ["full_attention"], r"'target.layer_types'.*expected a list of 4 of"),
        (
            "target.sliding_window",
            -1,
            r"'target.sliding_window' is -1 \(int\); expected null or an integer >= 1",
        ),
        (
            "source.bos_token_id",
            "x",
            r"'source.bos_token_id' is 'x' \(str\); expected null or an integer >= 0",
        ),
        (
            "alignment_policy",
            "nearest",
            r"'alignment_policy' is 'nearest' \(str\); expected one of \('identity', 'last'",
        ),
        ("method", "magic", r"'method' is 'magic' \(str\); expected one of"),
        ("calibration", [], r"'calibration' is \[\] \(list\); expected an object"),
        ("layers", [], r"'layers' is \[\] \(list\); expected a list of 4 layer entries"),
        (
            "layers.2.source_layers",
            [7],
            r"'layers\[2\].source_layers' is \[7\] \(list\); expected a list of source",
        ),
        (
            "layers.1.r2_key",
            "high",
            r"'layers\[1\].r2_key' is 'high' \(str\); expected null or a finite number <= 1",
        ),
        ("layers.0.r2_value", 3.5, r"'layers\[0\].r2_value' is 3.5 \(float\)"),
        ("layers.0.inputs", "x", r"'layers\[0\].inputs' is 'x' \(str\); expected a nested list"),
        ("fingerprints", "abc", r"'fingerprints' is 'abc' \(str\); expected an object"),
        ("fingerprints.source", 5, r"'fingerprints.source' is 5 \(int\); expected a string"),
        ("tensors", [], r"'tensors' is \[\] \(list\); expected an object of tensor descriptions"),
    ],
)
def test_every_bad_field_is_named_with_what_was_expected(fitted, tmp_path, path, value, message):
    fitted.save_pretrained(tmp_path / "b")
    meta_path = tmp_path / "b" / "bridge.json"
    meta = json.loads(meta_path.read_text())
    _set(path, value)(meta)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(BridgeFormatError, match=message) as info:
        Bridge.from_pretrained(tmp_path / "b")
    assert str(meta_path) in str(info.value)  # the file is named too


@pytest.mark.parametrize("sha,shown", [(_DELETE, "None"), ("not-a-checksum", "'not-a-checksum'")])
def test_a_missing_or_malformed_tensor_checksum_is_named(fitted, tmp_path, sha, shown):
    fitted.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "bridge.json").read_text())
    entry = meta["tensors"]["layers.3.value_bias"]  # tensor names contain dots: edited directly
    entry.pop("sha256") if sha is _DELETE else entry.update(sha256=sha)
    (tmp_path / "bridge.json").write_text(json.dumps(meta))
    with pytest.raises(
        BridgeFormatError, match=rf"'tensors.layers.3.value_bias.sha256' is {shown}.*16 lowercase hex"
    ):
        Bridge.from_pretrained(tmp_path)


def test_save_replaces_a_bridge_whole_and_keeps_other_files(fitted, tmp_path):
    out = tmp_path / "b"
    Bridge.identity(tiny_model("gemma3")).save_pretrained(out)
    (out / "notes.txt").write_text("mine")
    fitted.save_pretrained(out)
    assert Bridge.from_pretrained(out).method == "cachebridge"
    assert (out / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(STAGING_PREFIX)]
    with pytest.raises(FileExistsError, match="already holds a bridge; refusing to overwrite"):
        fitted.save_pretrained(out, overwrite=False)


def test_two_processes_saving_the_same_new_bridge_both_succeed(fitted, tmp_path, monkeypatch):
    import bridgecache.files as files

    out, real_replace, raced = tmp_path / "b", os.replace, []

    def other_process_first(src, dst):
        if Path(dst) == out and not raced:  # the other writer's folder lands just before ours
            raced.append(True)
            out.mkdir()
            (out / "notes.txt").write_text("theirs")
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", other_process_first)
    fitted.save_pretrained(out)
    monkeypatch.undo()
    assert Bridge.from_pretrained(out).method == "cachebridge"  # the later writer wins, file by file
    assert (out / "notes.txt").read_text() == "theirs"
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(STAGING_PREFIX)]


def test_a_save_that_fails_midway_leaves_the_old_bridge_and_nothing_else(fitted, tmp_path, monkeypatch):
    out = tmp_path / "b"
    Bridge.identity(tiny_model("gemma3")).save_pretrained(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("bridgecache.bridge.maps.save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        fitted.save_pretrained(out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(OSError, match="No space left"):
        fitted.save_pretrained(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no half-written directory


def test_files_get_the_umask_mode(fitted, tmp_path):
    old = os.umask(0o002)  # a group-shared cache
    try:
        fitted.save_pretrained(tmp_path / "b")
    finally:
        os.umask(old)
    assert current_umask() == old
    for name in ("bridge.json", "bridge.safetensors"):
        assert os.stat(tmp_path / "b" / name).st_mode & 0o777 == 0o664
    assert os.stat(tmp_path / "b").st_mode & 0o777 == 0o775


def test_fingerprint_tells_checkpoints_apart_not_dtypes():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert weight_fingerprint(a) != weight_fingerprint(b)
    assert weight_fingerprint(a) == weight_fingerprint(tiny_model("llama", seed=0).to(torch.bfloat16))
    before = weight_fingerprint(a)
    with torch.no_grad():  # a "fine-tune": every weight moves a little
        for p in a.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    assert weight_fingerprint(a) != before  # in-place writes bump the version: not served stale
    before = weight_fingerprint(a)
    a.lm_head.weight.data = torch.randn_like(a.lm_head.weight)  # swapped storage, same version counter
    assert weight_fingerprint(a) != before


def test_fingerprint_reads_the_last_value_of_a_large_parameter():
    big = torch.nn.Module()
    big.weight = torch.nn.Parameter(torch.zeros(49152 * 576, dtype=torch.bfloat16), requires_grad=False)
    before = weight_fingerprint(big)  # SmolLM2's embedding: a float linspace overran it
    with torch.no_grad():
        big.weight[-1] = 1.0
    assert weight_fingerprint(big) != before


def test_check_warns_on_other_weights_and_refuses_under_strict(fitted, models, tmp_path):
    src, tgt = models
    fitted.save_pretrained(tmp_path)
    bridge = Bridge.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bridge.check(src, tgt, strict=True)  # the fitted checkpoints: silent
    tuned = tiny_model("gemma3", seed=5)  # same architecture, other weights
    with pytest.warns(
        WeightMismatchWarning, match=r"target model's weights \(fingerprint \w+\) are not the ones"
    ):
        bridge.check(src, tuned)
    with pytest.raises(
        SpecMismatchError, match=r"target model's weights .* \(expected " + bridge.fingerprints["target"]
    ):
        bridge.check(src, tuned, strict=True)
    bridge.check(model_spec(src), model_spec(tuned), strict=True)  # specs carry no weights: not compared
