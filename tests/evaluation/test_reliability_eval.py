"""`bridgecache eval` never writes over what it reads: --json or --controls pointed at the data,
the bridge (or into its folder), each other, or a file that holds something else is refused
before a model loads, and the file is left as it was; a damaged --controls file is a one-line
error before a model loads, never a KeyError mid-run and never overwritten."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_model

from bridgecache.bridge.maps import Bridge
from bridgecache.cli import main
from bridgecache.evaluation.controls import ControlScores
from bridgecache.evaluation.items import EvaluationError
from bridgecache.models import zoo
from bridgecache.models.spec import model_spec

KEY = "ab" * 32


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(zoo, "load_model", refuse)


@pytest.fixture(scope="module")
def bridge_dir(tmp_path_factory):
    spec = model_spec(tiny_model("qwen2"), name="qwen2.5-coder-0.5b")
    return Bridge.identity(spec).save_pretrained(tmp_path_factory.mktemp("eval") / "bridge")


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"context": "a b c", "continuation": "d"}) + "\n")
    return path


def _eval(bridge_dir, data, *extra):
    return ["eval", "--bridge", str(bridge_dir), "--data", str(data), "--task", "ppl", *extra]


def _contents(*paths):
    return {p: p.read_bytes() for p in paths}


def _refused(argv, capsys, expected):
    assert main(argv) == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bridgecache eval: error: "), lines
    assert expected in lines[0], lines[0]


def test_outputs_that_are_inputs_are_refused_and_left_alone(
    bridge_dir, data, tmp_path, capsys, no_model_loads
):
    bridge_json = bridge_dir / "bridge.json"
    tensors = next(bridge_dir.glob("*.safetensors"))
    before = _contents(data, bridge_json, tensors)
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    cases = [
        (["--json", str(data)], "--json"),
        (["--json", str(bridge_json)], "is --bridge"),
        (["--json", str(tensors)], "is --bridge"),
        (["--json", str(bridge_dir / "new.json")], "lies inside it"),
        (["--controls", str(data)], "--controls"),
        (["--controls", str(bridge_json)], "is --bridge"),
        (["--json", str(tmp_path / "x.json"), "--controls", str(tmp_path / "x.json")], "the same file"),
        (["--json", str(other)], "holds something else than an eval result"),
    ]
    for extra, expected in cases:
        _refused(_eval(bridge_dir, data, *extra), capsys, expected)
    assert _contents(data, bridge_json, tensors) == before
    assert other.read_text() == '{"mine": 1}' and not (tmp_path / "x.json").exists()


def test_a_link_to_an_input_is_the_input(bridge_dir, data, tmp_path, capsys, no_model_loads):
    link = tmp_path / "results.json"
    link.symlink_to(data)
    _refused(_eval(bridge_dir, data, "--json", str(link)), capsys, "is --data")


def test_an_earlier_result_may_be_replaced(bridge_dir, data, tmp_path, no_model_loads):
    earlier = tmp_path / "result.json"
    earlier.write_text(json.dumps({"task": "ppl", "n": 1, "variant": "default", "method": "identity"}))
    with pytest.raises(AssertionError, match="a model was loaded"):  # every check passed
        main(_eval(bridge_dir, data, "--json", str(earlier), "--controls", str(tmp_path / "new.json")))


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{not json", "JSONDecodeError"),
        ("[1, 2]", "a JSON list"),
        (json.dumps({KEY: {"native": "x", "native_prefill_s": 0.1}}), "condition 'native' is not a list"),
        (json.dumps({KEY: {"native": [[-1.0]], "native_prefill_s": 0.1}}), "condition 'native'"),
        (json.dumps({KEY: {"native": [[-1.0, 2]]}}), "no 'native_prefill_s'"),
        (json.dumps({KEY: {"native": [[-1.0, 2]], "native_prefill_s": -1}}), "no 'native_prefill_s'"),
        (json.dumps({KEY: [1]}), "a list, not an object"),
        (json.dumps({KEY: {"reply": 3}}), "'reply' is not a text"),
        (json.dumps({KEY: {"native_prefill_s": 0.1, "replies": {}}}), "expected native_prefill_s"),
        (
            json.dumps({KEY: {"native_prefill_s": 0.1, "native_prefill_cpu_s": 0.1, "replies": {"a": 1}}}),
            "'replies' is not an object of texts",
        ),
        (json.dumps({"../x": {"reply": "a"}}), "the key is not a sha256"),
    ],
)
def test_a_damaged_controls_file_is_one_clear_error_before_any_model(
    bridge_dir, data, tmp_path, capsys, no_model_loads, content, expected
):
    controls = tmp_path / "controls.json"
    controls.write_text(content)
    with pytest.raises(EvaluationError, match=expected):
        ControlScores(controls)
    _refused(
        _eval(bridge_dir, data, "--controls", str(controls)), capsys, "is not a bridgecache controls file"
    )
    assert controls.read_text() == content  # never overwritten


def test_controls_of_every_shape_the_runner_writes_are_read():
    from tiny_models import tiny_model as model_of

    entries = {
        "a" * 64: {"native": [[-1.5, 2]], "no_context": [[-3.0, 2], [-2.0, 1]], "native_prefill_s": 0.1},
        "b" * 64: {"native_prefill_s": 0.1, "native_prefill_cpu_s": 0.2, "replies": {"native": "42"}},
        "c" * 64: {"reply": "an answer"},
    }
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "controls.json"
        path.write_text(json.dumps(entries))
        controls = ControlScores(path)
        assert controls.get("c" * 64) == {"reply": "an answer"}
        key = controls.key(model_of("qwen2"), torch.tensor([[1, 2]]))
        controls.put(key, {"reply": "x"})
        assert ControlScores(path).get(key) == {"reply": "x"}
