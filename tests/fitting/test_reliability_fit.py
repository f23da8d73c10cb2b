"""`bridgecache fit` and `fit_bridge`: bad options, models and destinations fail before any work;
a finished fit is never lost and never silently replaces an existing bridge."""

from __future__ import annotations

import json
import os
import re

import pytest
from tiny_models import byte_tokenizer, tiny_model

from bridgecache.bridge import Bridge, tensors_path
from bridgecache.cli import main
from bridgecache.files import STAGING_PREFIX, current_umask
from bridgecache.fitting import FitConfig, fit_bridge
from bridgecache.models import zoo

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two tiny llama checkpoints (same architecture, other weights) with a byte tokenizer."""
    root = tmp_path_factory.mktemp("fit_cli")
    dirs = []
    for seed in (0, 1):
        path = root / f"llama-{seed}"
        tiny_model("llama", seed=seed).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
        dirs.append(str(path))
    return dirs


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything tries to load a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although the arguments were bad")

    monkeypatch.setattr(zoo, "load_model", refuse)


def _fit(tmp_path, *extra, source="smollm2-135m", target="smollm2-135m"):
    out = tmp_path / "out"
    return ["fit", "--source", source, "--target", target, "--out", str(out), *extra]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--calib-seqs", "0"], r"--calib-seqs is 0; expected an integer >= 2"),
        (["--calib-seqs", "-1"], r"--calib-seqs is -1; expected an integer >= 2"),
        (["--seq-len", "0"], r"--seq-len is 0; expected an integer >= 3"),
        (["--seq-len", "-5"], r"--seq-len is -5; expected an integer >= 3"),
        (["--native-head", "-1"], r"--native-head is -1; expected an integer >= 0"),
        (["--lam", "-0.5"], r"--lam is -0.5; expected a finite number > 0"),
        (["--lam", "0"], r"--lam is 0.0; expected a finite number > 0"),
        (["--lam", "nan"], r"--lam is nan; expected a finite number > 0"),
        (["--layers-k", "0"], r"--layers-k is 0; expected an integer >= 1"),
    ],
)
def test_bad_numbers_fail_before_any_model_loads(tmp_path, capsys, no_model_loads, extra, message):
    assert main(_fit(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert "bridgecache fit: error:" in err
    assert re.search(message, err), err
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.parametrize(
    "source,message",
    [
        (
            "/no/such/dir",
            r"--source: '/no/such/dir' is neither a built-in name .* an existing model directory",
        ),
        ("./relative/nowhere", r"--source: './relative/nowhere' is neither"),
        ("qwen-typo", r"--source: 'qwen-typo' is neither a built-in name \(smollm2-135m"),
    ],
)
def test_a_model_that_cannot_exist_fails_before_any_model_loads(
    tmp_path, capsys, no_model_loads, source, message
):
    assert main(_fit(tmp_path, source=source)) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_directory_without_a_model_is_named(tmp_path, capsys, no_model_loads):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(_fit(tmp_path, target=str(empty))) == 2
    assert "--target" in (err := capsys.readouterr().err) and "without config.json" in err


def test_out_that_is_a_file_fails_before_any_model_loads(tmp_path, capsys, no_model_loads):
    blocker = tmp_path / "out"
    blocker.write_text("my notes")
    assert main(_fit(tmp_path)) == 2
    assert "--out:" in (err := capsys.readouterr().err) and "is a file, not a directory" in err
    assert blocker.read_text() == "my notes"


def test_out_under_a_file_fails_before_any_model_loads(tmp_path, capsys, no_model_loads):
    (tmp_path / "notes").write_text("x")
    argv = ["fit", "--source", "smollm2-135m", "--target", "smollm2-135m"]
    assert main([*argv, "--out", str(tmp_path / "notes" / "bridge")]) == 2
    assert "is a file, so" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_fails_before_any_model_loads(tmp_path, capsys, no_model_loads):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    argv = ["fit", "--source", "smollm2-135m", "--target", "smollm2-135m"]
    assert main([*argv, "--out", str(locked / "b")]) == 2
    assert "cannot write in" in capsys.readouterr().err


def test_fit_api_checks_its_options_before_reading_text(model_dirs):
    model, tok = zoo.load_model(model_dirs[0])
    other, _ = zoo.load_model(model_dirs[1])
    with pytest.raises(ValueError, match=r"layers_k is 9; expected at most the source model's 3 layers"):
        fit_bridge(model, other, tok, tok, FitConfig(layers_k=9))
    with pytest.raises(ValueError, match=r"lam is -1.0; expected a finite number > 0"):
        fit_bridge(model, other, tok, tok, FitConfig(lam=-1.0))
    with pytest.raises(
        ValueError,
        match=r"stats_precision is 'fp8'; expected one of \('bf16-gemm', 'tf32x3', 'tf32', 'bf16'\)",
    ):
        fit_bridge(model, other, tok, tok, FitConfig(stats_precision="fp8"))


def test_an_existing_bridge_is_kept_unless_force(model_dirs, tmp_path, capsys):
    small = ["--calib-seqs", "2", "--seq-len", "12", "--layers-k", "1"]
    argv = ["fit", "--source", model_dirs[0], "--target", model_dirs[1], "--out", str(tmp_path / "b"), *small]
    assert main(argv) == 0
    saved = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    assert sorted(saved) == sorted(["README.md", "bridge.json", tensors_path(tmp_path / "b").name])
    # files and folder carry the umask's mode (not safetensors' 0600)
    mask = current_umask()
    assert os.stat(tensors_path(tmp_path / "b")).st_mode & 0o777 == 0o666 & ~mask
    assert os.stat(tmp_path / "b").st_mode & 0o777 == 0o777 & ~mask
    assert json.loads(saved["bridge.json"])["fingerprints"].keys() == {"source", "target"}
    capsys.readouterr()

    assert main([*argv[:-6], "--calib-seqs", "3", "--seq-len", "12"]) == 2
    assert "already holds a bridge; pass --force" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == saved

    assert main([*argv[:-6], "--calib-seqs", "3", "--seq-len", "12", "--force"]) == 0
    again = json.loads((tmp_path / "b" / "bridge.json").read_text())
    assert again["calibration"]["num_sequences"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no staging folder left
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(
        ["README.md", "bridge.json", tensors_path(tmp_path / "b").name]  # README.md: the card
    )
    Bridge.from_pretrained(tmp_path / "b")


def test_a_destination_broken_during_the_fit_keeps_the_work(model_dirs, tmp_path, capsys, monkeypatch):
    from bridgecache import fitting
    from bridgecache.cli import fit as fit_cli

    out = tmp_path / "b"
    real_fit = fitting.fit_bridge

    def fit_then_block(*args, **kwargs):
        bridge = real_fit(*args, **kwargs)
        out.write_text("someone else's file")  # appears while the fit ran
        return bridge

    monkeypatch.setattr(fitting, "fit_bridge", fit_then_block)
    monkeypatch.setattr(fit_cli.tempfile, "tempdir", str(tmp_path))
    argv = ["fit", "--source", model_dirs[0], "--target", model_dirs[1], "--out", str(out)]
    assert main([*argv, "--calib-seqs", "2", "--seq-len", "12", "--layers-k", "1"]) == 1
    err = capsys.readouterr().err
    assert f"could not save to {out}" in err and "saved to" in err
    rescued = [p for p in tmp_path.iterdir() if p.name.startswith("bridgecache-unsaved-")]
    assert len(rescued) == 1 and Bridge.from_pretrained(rescued[0]).method == "fullhead"
    assert out.read_text() == "someone else's file"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_demo_with_a_bridge_uses_the_bridges_models(model_dirs, tmp_path, capsys, monkeypatch):
    from bridgecache.models.spec import model_spec

    model, tok = zoo.load_model(model_dirs[0])
    Bridge.identity(model_spec(model, tok, name=model_dirs[0])).save_pretrained(tmp_path / "b")
    loaded = []
    real = zoo.load_model
    monkeypatch.setattr(zoo, "load_model", lambda name, **kw: loaded.append(name) or real(name, **kw))
    argv = [
        "demo",
        "--bridge",
        str(tmp_path / "b"),
        "--context",
        "the ship lost its mast. ",
        "--question",
        "What did the ship lose?",
    ]
    assert main([*argv, "--max-new-tokens", "2"]) == 0
    assert loaded == [model_dirs[0], model_dirs[0]]  # not the built-in defaults
    assert f"source {model_dirs[0]}  ->  target {model_dirs[0]}" in capsys.readouterr().out


def test_demo_with_a_bridge_whose_models_cannot_load_says_so(tmp_path, capsys, no_model_loads):
    Bridge.identity(tiny_model("qwen2")).save_pretrained(tmp_path / "b")  # names its model "qwen2"
    assert main(["demo", "--bridge", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "no --source given, and the bridge's source model cannot be loaded: 'qwen2' is neither" in err
