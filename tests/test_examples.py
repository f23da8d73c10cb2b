"""The examples run and produce what they claim, on CPU with the small built-in models.

Notebooks are executed with nbclient (a python3 kernel); a probe cell appended in memory reads
their variables back. Scripts are called in-process through their `main()` (their printed lines
are checked too), except the Accelerate one, launched as users launch it. Bridges are fitted on
tiny calibration sets: the maps are poor, but every step of every example runs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from bridgecache import FitConfig, SpecMismatchError, fit_bridge, load_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SOURCE, AGENTS = "smollm2-135m", ("qwen2.5-coder-0.5b", "gemma3-270m")
# What the notebooks fit with EXAMPLE_TINY=1: 2 sequences x 32 tokens, one source layer by depth.
TINY_FIT = FitConfig(
    method="fullhead", layer_support="depth", layers_k=1, num_sequences=2, seq_len=32, heldout_every=2
)


def example(name: str):
    """Import examples/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def execute(name: str, probe: str, monkeypatch, **env) -> tuple[nbformat.NotebookNode, dict]:
    """Run examples/<name> top to bottom; returns the notebook and the JSON value of `probe`."""
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(f"import json\nprint(json.dumps({probe}))"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    client = NotebookClient(
        notebook, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(EXAMPLES)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, if a cell fails
    stdout = [out["text"] for out in notebook.cells[-1].outputs if out.get("name") == "stdout"]
    return notebook, json.loads(stdout[-1].strip().splitlines()[-1])


@pytest.fixture(scope="session")
def bridges(tmp_path_factory, smollm2):
    """Tiny-calibration bridges SOURCE -> each agent, saved as <dir>/<source>-to-<agent>."""
    root = tmp_path_factory.mktemp("bridges")
    source, source_tok = smollm2
    for name in AGENTS:
        target, target_tok = load_model(name)
        bridge = fit_bridge(source, target, source_tok, target_tok, TINY_FIT, source_name=SOURCE,
                            target_name=name, progress=False)  # fmt: skip
        bridge.save_pretrained(root / f"{SOURCE}-to-{name}")
    return root


def test_notebooks_are_committed_without_outputs():
    notebooks = sorted(EXAMPLES.glob("*.ipynb"))
    assert [p.name for p in notebooks] == ["cross_family.ipynb", "quickstart.ipynb"]
    for path in notebooks:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs"


@pytest.mark.real_model
def test_quickstart_notebook(bridges, monkeypatch):
    probe = """{
        "source_type": source.config.model_type, "target_type": target.config.model_type,
        "target_layers": target.config.num_hidden_layers, "bridge_layers": len(bridge.layers),
        "r2_keys": r2_keys, "r2_values": r2_values,
        "lines": {line.get_label(): len(line.get_xdata()) for line in ax.lines},
        "native_ids": native_ids.tolist(), "bridged_ids": bridged_ids.tolist(),
        "text": result.text, "translated": result.cache.materialized_layers,
        "native_first_s": native_first_s, "source_prefill_s": first.source_prefill_s,
        "bridged_first_s": first.generate_s, "first_tokens": first.output_ids.shape[1],
    }"""
    # SmolLM2 -> Gemma 3 (lighter than the default Qwen target), loading the session's bridge:
    # the cross-family notebook runs the fitting branch.
    env = dict(EXAMPLE_TARGET="gemma3-270m", EXAMPLE_BRIDGE=str(bridges / f"{SOURCE}-to-gemma3-270m"))
    notebook, got = execute("quickstart.ipynb", probe, monkeypatch, **env)
    assert (got["source_type"], got["target_type"]) == ("llama", "gemma3_text")  # across families
    n = got["target_layers"]
    assert got["bridge_layers"] == n and got["translated"] == list(range(n))
    assert len(got["r2_keys"]) == len(got["r2_values"]) == n
    assert all(math.isfinite(x) and x <= 1 for x in got["r2_keys"] + got["r2_values"])
    assert got["lines"]["keys"] == got["lines"]["values"] == n  # the plot: one point per target layer
    outputs = [out for cell in notebook.cells for out in cell.get("outputs", [])]
    assert any("image/png" in out.get("data", {}) for out in outputs)
    assert 1 <= len(got["bridged_ids"]) <= 16 and 1 <= len(got["native_ids"]) <= 16
    assert got["first_tokens"] == 1
    assert got["native_first_s"] > 0 and got["source_prefill_s"] > 0 and got["bridged_first_s"] > 0


@pytest.mark.real_model
def test_cross_family_notebook(monkeypatch):
    probe = """{
        "table": [[t, token, reads] for t, token, reads, _ in table], "target_ids": list(target_ids),
        "source_tokens": len(source_ids), "policy": bridge.alignment_policy,
        "native_rows": native_rows, "context_target_tokens": context_target_ids.shape[1],
        "text": result.text, "new_tokens": result.output_ids.shape[1],
        "translated": result.cache.materialized_layers, "target_layers": target.config.num_hidden_layers,
    }"""
    _, got = execute("cross_family.ipynb", probe, monkeypatch, EXAMPLE_TINY="1")
    table = got["table"]
    assert len(table) == len(got["target_ids"]) and [row[0] for row in table] == list(range(len(table)))
    assert table[0][1:] == ["<bos>", "NATIVE"]  # Gemma's BOS has no source text
    reads = [row[2] for row in table[1:]]
    assert reads == sorted(reads) and reads[-1] == got["source_tokens"] - 1  # monotone, up to the end
    assert got["policy"] == "last" and got["native_rows"] == 1
    assert 1 <= got["new_tokens"] <= 8
    assert got["translated"] == list(range(got["target_layers"]))


@pytest.mark.real_model
def test_generate_handoff_script(bridges, capsys):
    bridge = bridges / f"{SOURCE}-to-gemma3-270m"
    args = ["--source", SOURCE, "--target", "gemma3-270m", "--bridge", str(bridge)]
    got = example("generate_handoff").main([*args, "--max-new-tokens", "6"])
    printed = capsys.readouterr().out
    assert got["translated_layers"] == got["target_layers"] == 18
    assert got["cached_positions"] == got["context_tokens"] - 1  # the last context token is held back
    assert 1 <= got["new_tokens"] <= 6
    assert "(18/18 layers translated)" in printed and f"answer: {got['text'].strip()!r}" in printed

    wrong = ["--source", SOURCE, "--target", SOURCE, "--bridge", str(bridge)]
    with pytest.raises(SpecMismatchError, match="target"):
        example("generate_handoff").main(wrong)


@pytest.mark.real_model
def test_multi_agent_script(bridges, capsys):
    got = example("multi_agent").main(["--ships", "8", "--questions", "1", "--bridge-dir", str(bridges)])
    printed = capsys.readouterr().out
    assert "fitting" not in printed  # both bridges were loaded from --bridge-dir
    assert set(got["own_s"]) == set(got["bridged_s"]) == set(AGENTS)
    assert got["read_s"] > 0 and min(got["own_s"].values()) > 0 and min(got["bridged_s"].values()) > 0
    assert got["answers"] == 2  # one question per agent
    assert f"time saved: {got['saved_s']:.2f} s" in printed
    assert f"answers right: {got['correct']}/2" in printed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.real_model  # random-weight models, with the built-in SmolLM2 tokenizer
def test_accelerate_multi_gpu_script_on_two_cpu_processes(tmp_path):
    # `accelerate launch --cpu` starts one process (several CPU processes need mpirun);
    # --multi_gpu starts them with torchrun, and the script falls back to CPU (gloo).
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(_free_port())]
    script = [str(EXAMPLES / "accelerate_multi_gpu.py"), "--random-config", "tiny", "--tokenizer", SOURCE]
    script += ["--requests", "5"]
    script += ["--workdir", str(tmp_path), "--calib-seqs", "3", "--seq-len", "32", "--context-chars", "300"]
    script += ["--max-new-tokens", "4", "--batch-size", "2"]
    run = subprocess.run(launch + script, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout
    assert f"2 processes, 5 requests, bridge {tmp_path}/tiny-source -> {tmp_path}/tiny-target" in out
    shares = re.findall(r"process (\d): source on cpu, target layers 3 on cpu; (\d) requests", out)
    assert sorted(shares) == [("0", "3"), ("1", "2")]  # split_between_processes: 3 + 2
    assert len(re.findall(r"handoffs/s; native batched prefill [\d.]+ s, [\d.]+ requests/s\)", out)) == 2
    assert "all: 5 handoffs in" in out and "native batched prefill: " in out
    assert "translated layers on their target layer's device: 5/5 requests" in out
    assert (tmp_path / "bridge" / "bridge.json").exists()  # fitted once, by the main process
