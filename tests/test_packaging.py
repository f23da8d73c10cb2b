"""Our `kernels/` folder ships as `bridgecache.kernels` and never shadows Hugging Face's `kernels`.

transformers probes an importable `kernels` (Hugging Face's kernel hub client) and branches on
it, the GGUF loader included. These tests install that package beside ours, in a subprocess
started outside the repository, and check that each import resolves to its own package and that
transformers still loads a GGUF model and generates.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib.util, json, sys
import bridgecache.kernels as ours
import kernels as theirs
from transformers.utils import import_utils
available, version = import_utils._is_package_available("kernels", return_version=True)
print(json.dumps({
    "ours": ours.__file__, "theirs": theirs.__file__,
    "spec": importlib.util.find_spec("kernels").origin,
    "transformers_sees": [available, version],
}))
"""


def _run(code: str, cwd: Path, extra_path: Path | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONNOUSERSITE": "1"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    import os

    env |= {k: v for k, v in os.environ.items() if k.startswith(("BRIDGECACHE_", "HF_", "VIRTUAL_ENV"))}
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_no_top_level_kernels_is_installed_by_us(tmp_path):
    code = (
        "import importlib.util, bridgecache.kernels as k; "
        "s = importlib.util.find_spec('kernels'); print(k.__name__, s and s.origin)"
    )
    name, origin = _run(code, cwd=tmp_path).split(" ", 1)
    assert name == "bridgecache.kernels"
    assert origin == "None" or not origin.startswith(str(REPO))


@pytest.fixture(scope="module")
def hf_kernels(tmp_path_factory):
    target = tmp_path_factory.mktemp("hf_kernels")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), "kernels"]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("Hugging Face's kernels package could not be installed (no network?)")
    return target


def test_both_kernels_packages_import_side_by_side(hf_kernels, tmp_path):
    seen = json.loads(_run(PROBE, cwd=tmp_path, extra_path=hf_kernels))
    assert seen["ours"].startswith(str(REPO / "kernels"))
    assert seen["theirs"].startswith(str(hf_kernels))
    assert seen["spec"].startswith(str(hf_kernels))
    assert seen["transformers_sees"][0] is True and seen["transformers_sees"][1] != "N/A"


@pytest.mark.real_model
def test_gguf_model_loads_and_generates_with_both_installed(hf_kernels, tmp_path, smollm2):
    from bridgecache.models.zoo import GGUF_FILE, cache_root, model_dir

    gguf = model_dir("smollm2-135m") / GGUF_FILE  # the zoo keeps the GGUF as the model's one copy
    code = f"""
import torch, bridgecache.kernels, kernels
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(
    {str(gguf.parent)!r}, gguf_file={gguf.name!r}, dtype=torch.float32
)
tok = AutoTokenizer.from_pretrained({str(cache_root() / "models" / "smollm2-135m")!r})
ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.eos_token_id)
print(tok.decode(out[0, ids.shape[1]:]).replace(chr(10), " "))
"""
    assert "Paris" in _run(code, cwd=tmp_path, extra_path=hf_kernels)
