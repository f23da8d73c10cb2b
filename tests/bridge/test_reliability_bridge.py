"""Bridge files: every bad field named with what was expected, saves that never leave half a
bridge, umask modes, and weight fingerprints that catch a fine-tuned copy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from tiny_models import tiny_model

from bridgecache.bridge import Bridge, BridgeFormatError, WeightMismatchWarning, storage, tensors_path
from bridgecache.files import STAGING_PREFIX, current_umask
from bridgecache.fitting import FitConfig, PairedKV, fit_layer_maps
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
        lambda w: seqs,
        (3, 2, 16),
        (4, 1, 32),
        FitConfig(method="cachebridge", layers_k=1, weighting="uniform"),
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
        ("native_head", "abc", r"field 'native_head' is 'abc' \(str\); expected an integer in \[0, 512\]"),
        ("native_head", -5, r"field 'native_head' is -5 \(int\); expected an integer in \[0, 512\]"),
        ("native_head", 1.5, r"field 'native_head' is 1.5 \(float\); expected an integer in \[0, "),
        ("native_head", True, r"field 'native_head' is True \(bool\); expected an integer in \[0, "),
        (
            "native_head",
            10**30,
            r"'native_head' is 1000000000000000000000000000000 \(int\); expected an integer in \[0, 512\]",
        ),
        (
            "target.num_layers",
            "3",
            r"field 'target.num_layers' is '3' \(str\); expected an integer in \[1, 1,024\]",
        ),
        (
            "target.num_layers",
            6000,
            r"field 'target.num_layers' is 6000 \(int\); expected an integer in \[1, 1,024\]",
        ),
        (
            "source.num_kv_heads",
            0,
            r"field 'source.num_kv_heads' is 0 \(int\); expected an integer in \[1, 4,096\]",
        ),
        (
            "source.max_position_embeddings",
            2**40,
            r"'source.max_position_embeddings' is 1099511627776 \(int\)",
        ),
        (
            "source.rope",
            "{not json",
            r"'source.rope' is '\{not json' \(str\); expected the JSON text of an object",
        ),
        (
            "source.name",
            "x" * 5000,
            r"'source.name' is 'xxx.*\.\.\..*\(str\); expected a string of at most 4,096",
        ),
        (
            "tensors_file",
            "../../escape.safetensors",
            r"'tensors_file' is '\.\./\.\./escape.safetensors' \(str\); expected a file name",
        ),
        ("tensors_file", _DELETE, r"'tensors_file' is None \(NoneType\); expected a file name"),
        ("source.head_dim", _DELETE, r"field 'source.head_dim' is None \(NoneType\); expected an integer in"),
        ("target.model_type", 7, r"field 'target.model_type' is 7 \(int\); expected a string"),
        ("target.layer_types", ["full_attention"], r"'target.layer_types'.*expected a list of 4 of"),
        (
            "target.sliding_window",
            -1,
            r"'target.sliding_window' is -1 \(int\); expected null or an integer in \[1, ",
        ),
        (
            "source.bos_token_id",
            "x",
            r"'source.bos_token_id' is 'x' \(str\); expected null or an integer in \[0, ",
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
        # The calibration block: every entry bridgecache reads back later.
        (
            "calibration.heldout_scores",
            {"attention_cosine": [0.9, 0.8]},
            r"'calibration.heldout_scores.attention_cosine' is \[0.9, 0.8\] \(list\); expected a list of 4",
        ),
        (
            "calibration.heldout_scores",
            {"attention_cosine": [0.9, 0.8, 7.0, 0.1]},
            r"attention_cosine' .*expected a list of 4 numbers in \[-1, 1\]",
        ),
        (
            "calibration.heldout_scores",
            {"attention_cosine": None, "sequences": 16, "heldout_sequences": -62},
            r"'calibration.heldout_scores.heldout_sequences' is -62 \(int\)",
        ),
        ("calibration.seed", 10**30, r"'calibration.seed' is 10+ \(int\); expected an integer in \[0, "),
        ("calibration.rows", "x", r"'calibration.rows' is 'x' \(str\); expected an object"),
        ("calibration.num_sequences", -3, r"'calibration.num_sequences' is -3 \(int\)"),
        ("calibration.stored_dtype", "int8", r"'calibration.stored_dtype' is 'int8' \(str\)"),
        (
            "calibration.fingerprints",
            {"source": {"zoo": "a", "gguf": "sha256:" + "0" * 64, "tokenizer": "0" * 16}},
            r"'calibration.fingerprints' .*expected an object with 'source' and 'target'",
        ),
        (
            "calibration.recipe",
            {"source": "a", "target": "b", "evil": 1},
            r"'calibration.recipe' is \['evil'\]",
        ),
        (
            "calibration.recipe",
            {"source": "a", "target": "b", "seed": -1},
            r"'calibration.recipe.seed' is -1",
        ),
        ("calibration.recipe", {"source": "", "target": "b"}, r"'calibration.recipe.source' is '' \(str\)"),
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
    old_tensors = tensors_path(out)
    (out / "notes.txt").write_text("mine")
    fitted.save_pretrained(out)
    assert Bridge.from_pretrained(out).method == "cachebridge"
    assert (out / "notes.txt").read_text() == "mine"
    assert not old_tensors.exists()  # the replaced bridge's tensors are gone
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["README.md", "bridge.json", "notes.txt", tensors_path(out).name]
    )
    with pytest.raises(FileExistsError, match="already holds a bridge; refusing to overwrite"):
        fitted.save_pretrained(out, overwrite=False)


# ---------------------------------------------------------------------- real kills and races

_WORKER = Path(__file__).resolve().parents[1] / "save_worker.py"


def _worker(mode: str, source, dest, marker) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(_WORKER), mode, str(source), str(dest), str(marker)]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_at_marker(child: subprocess.Popen, marker: Path) -> None:
    """Wait until the worker stops at its step, then SIGKILL it (no cleanup code runs)."""
    deadline = time.time() + 300
    while not marker.exists():
        if child.poll() is not None:
            raise AssertionError(f"the worker ended before its step: {child.communicate()[1][-2000:]}")
        assert time.time() < deadline, "the worker never reached its step"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    assert child.returncode == -signal.SIGKILL


def _same_maps(a: Bridge, b: Bridge) -> bool:
    return a.method == b.method and all(
        torch.equal(getattr(x, name), getattr(y, name))
        for x, y in zip(a.layers, b.layers)
        for name in ("inputs", "key_weight", "key_bias", "value_weight", "value_bias")
    )


def _tidy(directory: Path) -> bool:
    """No temporary files, no staging folders and exactly the one tensors file bridge.json names."""
    names = [p.name for p in directory.iterdir()]
    tensors = [n for n in names if n.startswith("bridge") and n.endswith(".safetensors")]
    return not [n for n in names if n.startswith(STAGING_PREFIX)] and tensors == [
        tensors_path(directory).name
    ]


@pytest.mark.parametrize(
    "step,survivor",
    [("tensors", "old"), ("pointer", "old"), ("cleanup", "new")],
)
def test_a_save_killed_at_any_step_leaves_one_whole_bridge_and_the_next_load_cleans_up(
    fitted, tmp_path, step, survivor
):
    out, new = tmp_path / "b", fitted.save_pretrained(tmp_path / "new")
    old = Bridge.identity(tiny_model("gemma3"))
    old.save_pretrained(out)
    (out / "notes.txt").write_text("mine")
    old_json = (out / "bridge.json").read_bytes()
    _kill_at_marker(_worker(step, new, out, tmp_path / "stopped"), tmp_path / "stopped")
    assert not _tidy(out)  # the kill left something behind: temporary files or the old tensors
    loaded = Bridge.from_pretrained(out)  # the next load: one whole bridge, and it cleans up
    assert _same_maps(loaded, old if survivor == "old" else fitted)
    if survivor == "old":
        assert (out / "bridge.json").read_bytes() == old_json
    assert _tidy(out) and (out / "notes.txt").read_text() == "mine"


def test_a_save_killed_midway_is_cleaned_by_the_next_save(fitted, tmp_path):
    out, new = tmp_path / "b", fitted.save_pretrained(tmp_path / "new")
    Bridge.identity(tiny_model("gemma3")).save_pretrained(out)
    _kill_at_marker(_worker("tensors", new, out, tmp_path / "stopped"), tmp_path / "stopped")
    assert [p for p in out.iterdir() if p.name.startswith(STAGING_PREFIX)]
    fitted.save_pretrained(out)
    assert _tidy(out) and _same_maps(Bridge.from_pretrained(out), fitted)


def test_two_processes_creating_one_bridge_exactly_one_wins(fitted, tmp_path):
    sources = [
        fitted.save_pretrained(tmp_path / "a"),
        Bridge.identity(tiny_model("gemma3")).save_pretrained(tmp_path / "i"),
    ]
    (tmp_path / "sync").mkdir()
    out = tmp_path / "out"
    workers = [_worker("create", src, out, tmp_path / "sync" / f"ready-{i}") for i, src in enumerate(sources)]
    results = [(w.wait(timeout=300), w.communicate()[1]) for w in workers]
    codes = [code for code, _ in results]
    assert sorted(codes) == [0, 3], results  # one saved, the other was refused
    winner, loser = codes.index(0), codes.index(3)
    assert "already holds a bridge" in results[loser][1]
    assert _same_maps(Bridge.from_pretrained(out), Bridge.from_pretrained(sources[winner]))
    assert _tidy(out)


def test_two_processes_replacing_one_bridge_leave_one_of_theirs(fitted, tmp_path):
    sources = [
        fitted.save_pretrained(tmp_path / "a"),
        Bridge.identity(tiny_model("gemma3")).save_pretrained(tmp_path / "i"),
    ]
    out = tmp_path / "out"
    Bridge.identity(tiny_model("gemma3", seed=3)).save_pretrained(out)
    (tmp_path / "sync").mkdir()
    workers = [
        _worker("replace", src, out, tmp_path / "sync" / f"ready-{i}") for i, src in enumerate(sources)
    ]
    results = [(w.wait(timeout=300), w.communicate()[1]) for w in workers]
    assert [code for code, _ in results] == [0, 0], results
    loaded = Bridge.from_pretrained(out)
    assert any(_same_maps(loaded, Bridge.from_pretrained(src)) for src in sources)
    assert _tidy(out)


def test_a_reader_always_sees_a_whole_bridge_while_another_process_replaces_it(fitted, tmp_path):
    a = fitted.save_pretrained(tmp_path / "a")
    b = Bridge.identity(tiny_model("gemma3")).save_pretrained(tmp_path / "i")
    expected = [Bridge.from_pretrained(a), Bridge.from_pretrained(b)]
    out = tmp_path / "out"
    Bridge.from_pretrained(a).save_pretrained(out)
    writer = _worker("flip", a, out, b)
    loads = 0
    while writer.poll() is None or loads == 0:
        loaded = Bridge.from_pretrained(out)  # never half of one, never a missing file
        assert any(_same_maps(loaded, e) for e in expected)
        loads += 1
    assert writer.returncode == 0, writer.communicate()[1][-2000:]
    assert _tidy(out)


def test_a_tensors_file_gone_at_one_open_and_back_at_the_next_is_read_again(fitted, tmp_path, monkeypatch):
    # A writer flipping between two bridges removes a tensors file between the loader's opens and
    # may bring the same content-named file back before the loader looks again.
    out = fitted.save_pretrained(tmp_path / "b")
    real_open, failures = storage.safe_open, []

    def gone_once(path, *args, **kwargs):
        if not failures:
            failures.append(path)
            raise SafetensorError(
                f"unable to open file <{path}> in read-only mode: No such file or directory (2)"
            )
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(storage, "safe_open", gone_once)
    assert _same_maps(Bridge.from_pretrained(out), fitted)
    assert failures  # the race really happened


def test_a_damaged_tensors_file_is_refused_after_the_retries(fitted, tmp_path):
    out = fitted.save_pretrained(tmp_path / "b")
    path = tensors_path(out)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(BridgeFormatError, match="not a readable safetensors file"):
        Bridge.from_pretrained(out)


def test_a_save_that_fails_midway_leaves_the_old_bridge_and_nothing_else(fitted, tmp_path, monkeypatch):
    out = tmp_path / "b"
    Bridge.identity(tiny_model("gemma3")).save_pretrained(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("bridgecache.bridge.storage.save_file", disk_full)
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
    for path in (tmp_path / "b" / "bridge.json", tensors_path(tmp_path / "b"), tmp_path / "b" / "README.md"):
        assert os.stat(path).st_mode & 0o777 == 0o664
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


def test_a_tensors_file_holding_what_bridge_json_does_not_describe_is_refused_before_loading(
    fitted, tmp_path
):
    from safetensors.torch import load_file, save_file

    directory = fitted.save_pretrained(tmp_path / "b")
    path = tensors_path(directory)
    tensors = load_file(str(path))
    save_file({**tensors, "junk": torch.zeros(1)}, str(path))
    with pytest.raises(BridgeFormatError, match=r"tensors \[\] are missing and 1 are not described .*'junk'"):
        Bridge.from_pretrained(directory)
    save_file({**tensors, **{f"junk.{i}": torch.zeros(0) for i in range(50_000)}}, str(path))
    with pytest.raises(BridgeFormatError, match=r"its header has [\d,]+ bytes; 20 tensors need at most"):
        Bridge.from_pretrained(directory)  # a header of megabytes is not even parsed
