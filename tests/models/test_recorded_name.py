"""Bridges record a built-in model by its built-in name, never its cache folder's path; a folder the
user loaded stays a path; `bridgecache eval --bridge DIR` then loads the models by those names."""

from __future__ import annotations

import json

import pytest
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import FitConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.cli import evaluate as eval_cli
from bridgecache.cli import main
from bridgecache.fitting import fit_bridge
from bridgecache.models import zoo
from bridgecache.models.spec import model_spec

pytestmark = pytest.mark.usefixtures("one_thread")


def _zoo_folder(root, name: str):
    """A folder laid out as the zoo builds one: <root>/models/<name> with its `.complete` marker."""
    folder = root / "models" / name
    folder.mkdir(parents=True)
    entry = zoo.BUILTIN_MODELS[name]
    (folder / ".complete").write_text(entry.sha256 or "verified chunks\n")
    return folder


def _loaded_from(model, folder):
    model.config._name_or_path = model.name_or_path = str(folder)  # as zoo._load_builtin names it
    return model


def test_a_zoo_folder_is_recorded_by_its_builtin_name(tmp_path):
    folder = _zoo_folder(tmp_path, "smollm2-135m")
    model, tok = _loaded_from(tiny_model("llama"), folder), byte_tokenizer()
    assert zoo.builtin_name(folder) == "smollm2-135m"
    assert model_spec(model, tok).name == "smollm2-135m"
    bridge = Bridge.identity(model, tok)
    assert bridge.source.name == bridge.target.name == "smollm2-135m"
    bridge.save_pretrained(tmp_path / "bridge")
    written = (tmp_path / "bridge" / "bridge.json").read_text()
    assert str(tmp_path) not in written  # no machine path travels with a shared bridge
    assert model_spec(model, tok, name="mine").name == "mine"  # a given name still wins


@pytest.mark.parametrize("case", ["no marker", "another file", "not under models", "unknown name"])
def test_a_folder_that_is_not_a_zoo_folder_stays_a_path(tmp_path, case):
    if case == "not under models":
        folder = tmp_path / "mine" / "smollm2-135m"
        folder.mkdir(parents=True)
        (folder / ".complete").write_text(zoo.BUILTIN_MODELS["smollm2-135m"].sha256 or "verified chunks")
    elif case == "unknown name":
        folder = tmp_path / "models" / "my-model"
        folder.mkdir(parents=True)
        (folder / ".complete").write_text("0" * 64)
    else:
        folder = _zoo_folder(tmp_path, "qwen2.5-coder-0.5b")
        if case == "no marker":
            (folder / ".complete").unlink()
        else:
            (folder / ".complete").write_text("f" * 64)
    model = _loaded_from(tiny_model("qwen2"), folder)
    assert zoo.builtin_name(folder) is None
    assert model_spec(model).name == str(folder)


def test_fit_bridge_records_builtin_names_in_the_bridge_and_its_recipe(tmp_path):
    source = _loaded_from(tiny_model("llama", seed=1), _zoo_folder(tmp_path, "smollm2-135m"))
    target = _loaded_from(tiny_model("qwen2", seed=2), _zoo_folder(tmp_path, "qwen2.5-coder-0.5b"))
    tok = byte_tokenizer()
    config = FitConfig(num_sequences=4, seq_len=32, score_heldout=False, layer_support="depth")
    bridge = fit_bridge(source, target, tok, tok, config, progress=False)
    assert (bridge.source.name, bridge.target.name) == ("smollm2-135m", "qwen2.5-coder-0.5b")
    recipe = bridge.calibration["recipe"]
    assert (recipe["source"], recipe["target"]) == ("smollm2-135m", "qwen2.5-coder-0.5b")


def test_eval_of_a_bridge_built_in_python_needs_no_model_arguments(tmp_path, monkeypatch, capsys):
    folder = _zoo_folder(tmp_path, "smollm2-135m")
    model, tok = _loaded_from(tiny_model("llama", vocab_size=258), folder), byte_tokenizer()
    Bridge.identity(model, tok).save_pretrained(tmp_path / "bridge")
    asked = []

    def load_model(name):
        asked.append(name)
        return model, tok

    monkeypatch.setattr(zoo, "load_model", load_model)
    data = tmp_path / "data.jsonl"
    lines = [
        {"context": f"the ship number {i} lost its mast", "continuation": " near the rocks"} for i in range(3)
    ]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = [
        "eval",
        "--bridge",
        str(tmp_path / "bridge"),
        "--data",
        str(data),
        "--task",
        "ppl",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert asked == ["smollm2-135m"]  # by the built-in name, not a cache path; one load for both sides
    assert "smollm2-135m -> smollm2-135m" in capsys.readouterr().out
    assert eval_cli.check_model_names([("--source", "smollm2-135m")]) is None


@pytest.mark.real_model
def test_identity_of_a_loaded_builtin_model_records_its_name(tmp_path):
    model, tok = zoo.load_model("smollm2-135m")
    bridge = Bridge.identity(model, tok)
    assert bridge.source.name == "smollm2-135m"
    bridge.save_pretrained(tmp_path / "bridge")
    assert str(zoo.cache_root()) not in (tmp_path / "bridge" / "bridge.json").read_text()
    argv = [
        "eval",
        "--bridge",
        str(tmp_path / "bridge"),
        "--data",
        "builtin:facts-choice-256",
        "--limit",
        "2",
    ]
    assert main([*argv, "--no-progress"]) == 0
