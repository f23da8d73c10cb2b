"""Every `bridgecache` command with bad input: one line on stderr, exit status 2, no traceback, and
nothing loaded or written first; text from files is escaped before it reaches the terminal;
output paths are checked before the work; finished work is never lost to a late failure."""

from __future__ import annotations

import json
import sys
import tracemalloc

import pytest
from tiny_models import byte_tokenizer, tiny_model

from bridgecache.bridge.maps import Bridge, BridgeFormatError
from bridgecache.cli import main
from bridgecache.models import zoo
from bridgecache.models.spec import model_spec


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although the input was bad")

    monkeypatch.setattr(zoo, "load_model", refuse)


@pytest.fixture(scope="module")
def bridge_dir(tmp_path_factory):
    """An identity bridge between built-in names (on a tiny model's shapes): nothing is fetched."""
    spec = model_spec(tiny_model("qwen2"), name="qwen2.5-coder-0.5b")
    return Bridge.identity(spec).save_pretrained(tmp_path_factory.mktemp("cli") / "bridge")


def _bad(tmp_path, bridge_dir):
    """(argv, expected text in the one error line) for every command."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    missing, b = str(tmp_path / "missing"), str(bridge_dir)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"context": "a b c", "continuation": "d"}) + "\n")
    out = str(tmp_path / "out")
    evl = ["eval", "--bridge", b, "--data", str(data), "--task", "ppl"]
    demo = ["demo", "--bridge", b, "--context", "a b c", "--question", "q?"]
    return [
        (["inspect", missing], "no bridge metadata at"),
        (["inspect", str(a_file)], "no bridge metadata at"),
        (["inspect", "builtin:no-such->pair"], "no built-in bridge 'no-such->pair'"),
        (["inspect", "builtin:nonsense"], "expected 'SOURCE->TARGET'"),
        (["inspect", b, "--plot", str(tmp_path / "p.xyz")], "--plot: .*matplotlib cannot write .xyz"),
        (["inspect", b, "--plot", str(a_file / "p.png")], "--plot: .*is a file, so"),
        (["inspect", b, "--plot", str(tmp_path)], "--plot: .*is a directory, not a file"),
        (["export-builtin", missing], "no bridge metadata at"),
        (["export-builtin", b, "a->b"], "cannot be shipped as 'a->b'"),
        (["export-builtin", b, "nonsense"], "NAME 'nonsense': expected SOURCE->TARGET"),
        (["export-builtin", b, "--root", str(a_file)], "--root: .*is a file, not a directory"),
        (["fit", "--recipe", missing, "--out", out], "--recipe: no bridge metadata at"),
        (["fit", "--recipe", b, "--out", out], "--recipe: .* records no fit recipe"),
        (["fit", "--recipe", b, "--source", "x", "--out", out], "drop --source/--target"),
        ([*evl[:2], missing, *evl[3:]], "no bridge metadata at"),
        ([*evl[:2], "builtin:no-such->pair", *evl[3:]], "no built-in bridge"),
        ([*evl, "--json", str(a_file / "r.json")], "--json: .*is a file, so"),
        ([*evl, "--json", str(tmp_path)], "--json: .*is a directory, not a file"),
        ([*evl, "--controls", str(tmp_path)], "--controls: .*is a directory"),
        ([*evl, "--limit", "0"], "--limit is 0; expected an integer >= 1"),
        ([*evl, "--native-head", "-1"], "--native-head is -1; expected an integer >= 0"),
        ([*evl, "--native-head", str(10**12)], "--native-head is 1000000000000; expected"),
        ([*evl, "--native-layers", "99"], "--native-layers: native_layers=99; expected 0..3"),
        ([*evl, "--native-layers", "0+7"], r"--native-layers: native_layers \[7\] are not target layers"),
        ([*evl, "--min-quality", "nan"], "--min-quality is nan; expected a finite number"),
        ([*evl, "--source", "no-such-model"], "--source: 'no-such-model' is neither a built-in name"),
        (["demo", "--bridge", missing], "--bridge: no bridge metadata at"),
        (["demo", "--bridge", b, "--context", "a b c"], "--context needs --question"),
        ([*demo, "--refresh", "2.0"], r"--refresh is 2.0; expected a share of the context in \(0, 1\]"),
        ([*demo, "--max-new-tokens", "0"], "--max-new-tokens is 0"),
        ([*demo, "--native-layers", "all", "--native-tail", "-3"], "--native-tail is -3"),
        ([*demo, "--native-layers", "9"], "--native-layers: native_layers=9; expected 0..3"),
        (
            ["demo", "--bridge", b, "--context-tokens", "5"],
            r"--context-tokens is 5; expected an integer in \[64",
        ),
        ([*demo, "--source", "/no/such/model"], "--source: '/no/such/model' is neither"),
    ]


def test_every_command_reports_bad_input_in_one_line_before_loading_anything(
    tmp_path, bridge_dir, capsys, no_model_loads
):
    import re

    for argv, expected in _bad(tmp_path, bridge_dir):
        before = sorted(p.name for p in tmp_path.iterdir())
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"bridgecache {argv[0]}: error: "), (
            argv,
            captured.err,
        )
        assert re.search(expected, lines[0]), (argv, lines[0])
        assert sorted(p.name for p in tmp_path.iterdir()) == before, argv  # nothing created


def test_inspect_escapes_what_a_bridge_file_says(tmp_path, capsys):
    spec = model_spec(tiny_model("qwen2"), name="evil\x1b]0;pwned\x07\x1b[31mred\u202e")
    directory = Bridge.identity(spec).save_pretrained(tmp_path / "b")
    assert main(["inspect", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "evil\\x1b]0;pwned\\x07\\x1b[31mred\\u202e" in out  # shown, escaped
    assert "\x1b" not in repr(Bridge.from_pretrained(directory))
    assert "\x1b" not in Bridge.from_pretrained(directory).summary()


def test_errors_quoting_a_file_are_escaped_and_short(tmp_path, capsys):
    directory = Bridge.identity(tiny_model("qwen2")).save_pretrained(tmp_path / "b")
    meta = json.loads((directory / "bridge.json").read_text())
    meta["method"] = "\x1b[2J" + "x" * 1_000_000
    (directory / "bridge.json").write_text(json.dumps(meta))
    assert main(["inspect", str(directory)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and len(err) < 400 and "field 'method' is '\\x1b[2J" in err


def test_a_bridge_claiming_thousands_of_layers_is_refused_before_anything_is_built(tmp_path, capsys):
    """inspect --plot once cost +1.8 GB on an 8 MB bridge of 6,000 x 6,000 layers."""
    directory = Bridge.identity(tiny_model("qwen2")).save_pretrained(tmp_path / "b")
    meta = json.loads((directory / "bridge.json").read_text())
    for role in ("source", "target"):
        meta[role]["num_layers"] = 6000
        meta[role]["layer_types"] = ["full_attention"] * 6000
    meta["layers"] = meta["layers"] * 2000
    (directory / "bridge.json").write_text(json.dumps(meta))
    tracemalloc.start()
    assert main(["inspect", str(directory), "--plot", str(tmp_path / "p.png")]) == 2
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (
        "field 'source.num_layers' is 6000 (int); expected an integer in [1, 1,024]"
        in capsys.readouterr().err
    )
    assert peak < 20 * (directory / "bridge.json").stat().st_size  # parsing the JSON, nothing quadratic
    assert not (tmp_path / "p.png").exists()


def test_non_finite_maps_are_refused_at_load(tmp_path):
    """NaN weights with matching checksums once loaded, and every generated token became 0."""
    bridge = Bridge.identity(tiny_model("qwen2"))
    bridge.layers[1].value_weight[0, 3, 3] = float("nan")
    bridge.layers[2].key_bias[0, 0] = float("inf")
    directory = bridge.save_pretrained(tmp_path / "b")  # the checksums are of these values
    with pytest.raises(BridgeFormatError, match=r"tensor 'layers.1.value_weight' holds 1 NaN or infinite"):
        Bridge.from_pretrained(directory)


def test_eval_json_to_a_place_that_breaks_late_keeps_the_records(tmp_path, capsys, monkeypatch):
    model, tok = tiny_model("qwen2"), byte_tokenizer()
    monkeypatch.setattr(zoo, "load_model", lambda name, **kw: (model, tok))
    directory = Bridge.identity(model_spec(model, tok, name="qwen2.5-coder-0.5b")).save_pretrained(
        tmp_path / "b"
    )
    data = tmp_path / "data.jsonl"
    items = [("the ship lost its mast", " at sea"), ("a dog ran over the hill", " and back")]
    data.write_text("".join(json.dumps({"context": c, "continuation": x}) + "\n" for c, x in items))
    out = tmp_path / "results" / "r.json"
    import bridgecache.cli.evaluate as eval_cli

    real = eval_cli._json_safe

    def break_destination(summary):  # the destination turns into a file while the run goes on
        (tmp_path / "results").write_text("someone else's file")
        return real(summary)

    monkeypatch.setattr(eval_cli, "_json_safe", break_destination)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    argv = ["eval", "--bridge", str(directory), "--data", str(data), "--task", "ppl", "--json", str(out)]
    assert main([*argv, "--no-progress"]) == 1
    err = capsys.readouterr().err
    rescued = [p for p in tmp_path.iterdir() if p.name.startswith("bridgecache-unsaved-")]
    assert f"could not write {out}" in err and len(rescued) == 1
    saved = json.loads(rescued[0].read_text())
    assert saved["task"] == "ppl" and saved["n"] == 2 and saved["method"] == "identity"


def test_fit_recipe_keeps_a_finished_fit_when_the_destination_breaks(tmp_path, capsys, monkeypatch):
    from bridgecache.fitting import FitConfig, fit_bridge

    source, target, tok = tiny_model("llama", seed=1), tiny_model("qwen2", seed=2), byte_tokenizer()
    dirs = {}
    for role, model in (("source", source), ("target", target)):
        dirs[role] = tmp_path / f"tiny-{role}"
        model.save_pretrained(dirs[role])
        tok.save_pretrained(dirs[role])
    names = dict(source_name=str(dirs["source"]), target_name=str(dirs["target"]))
    fit = FitConfig(method="cachebridge", num_sequences=2, seq_len=12, heldout_every=2)
    fit_bridge(source, target, tok, tok, fit, **names, progress=False).save_pretrained(tmp_path / "made")
    out = tmp_path / "again"
    import bridgecache.fitting.refit as refit_module

    real = refit_module.refit

    def refit_then_block(*args, **kwargs):
        bridge = real(*args, **kwargs)
        out.write_text("someone else's file")  # appears while the fit ran
        return bridge

    monkeypatch.setattr(refit_module, "refit", refit_then_block)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(["fit", "--recipe", str(tmp_path / "made"), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    rescued = [p for p in tmp_path.iterdir() if p.name.startswith("bridgecache-unsaved-")]
    assert f"could not save to {out}" in err and len(rescued) == 1
    made, kept = Bridge.from_pretrained(tmp_path / "made"), Bridge.from_pretrained(rescued[0])
    assert kept.calibration["recipe"] == made.calibration["recipe"]  # the refit, whole
    assert out.read_text() == "someone else's file"


def test_inspect_plot_without_matplotlib_is_refused_in_one_line(bridge_dir, tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails, as where it is not installed
    assert main(["inspect", str(bridge_dir), "--plot", str(tmp_path / "p.png")]) == 2
    printed = capsys.readouterr()
    assert "--plot: needs matplotlib, which is not installed here" in printed.err
    assert "Traceback" not in printed.err and not printed.out  # refused before the summary
    assert not any(tmp_path.iterdir())
