"""Our `kernels/` folder ships as `bridgecache.kernels` and never shadows Hugging Face's `kernels`.

transformers probes an importable `kernels` (Hugging Face's kernel hub client) and branches on
it, the GGUF loader included. These tests install that package beside ours, in subprocesses
started outside the repository and in its root (where the folder is importable as `kernels`),
and check that each import resolves to its own package and that transformers still loads a GGUF
model and generates; and that a wheel of bridgecache, installed normally, imports from both places.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
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


def _run(code: str, cwd: Path, extra_path: Path | None = None, *, args: tuple[str, ...] = ()) -> str:
    """The last line `python [args] -c code` printed (args: e.g. ("-S",))."""
    return _output([*args, "-c", code], cwd, extra_path).splitlines()[-1]


def _output(args: list[str], cwd: Path, extra_path: Path | None = None) -> str:
    """What `python *args` printed, in `cwd`, with a clean environment (`extra_path`: PYTHONPATH)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONNOUSERSITE": "1"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    import os

    env |= {k: v for k, v in os.environ.items() if k.startswith(("BRIDGECACHE_", "HF_", "VIRTUAL_ENV"))}
    out = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_no_top_level_kernels_is_installed_by_us(tmp_path):
    code = (
        "import importlib.util, bridgecache.kernels as k; "
        "s = importlib.util.find_spec('kernels'); print(k.__name__, s and s.origin)"
    )
    name, origin = _run(code, cwd=tmp_path).split(" ", 1)
    assert name == "bridgecache.kernels"
    assert origin == "None" or not Path(origin).is_relative_to(REPO)  # a path prefix is not a folder


@pytest.fixture(scope="module")
def hf_kernels(tmp_path_factory):
    target = tmp_path_factory.mktemp("hf_kernels")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), "kernels"]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("Hugging Face's kernels package could not be installed (no network?)")
    return target


def test_both_kernels_packages_import_side_by_side(hf_kernels, tmp_path):
    seen = json.loads(_run(PROBE, cwd=tmp_path, extra_path=hf_kernels))
    assert Path(seen["ours"]).is_relative_to(REPO / "kernels")
    assert Path(seen["theirs"]).is_relative_to(hf_kernels)
    assert Path(seen["spec"]).is_relative_to(hf_kernels)
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


# Started in the repository root, Python finds the checkout's bridgecache/ and kernels/ first.
ROOT_PROBE = r"""
import json, bridgecache, bridgecache.kernels as ours, kernels as theirs, transformers
from transformers.integrations import hub_kernels  # runs `from kernels import ...` when it accepts theirs
from transformers.utils import import_utils
print(json.dumps({
    "bridgecache": bridgecache.__file__, "ours": ours.__file__, "theirs": theirs.__file__,
    "transformers_sees": import_utils._is_package_available("kernels", return_version=True),
}))
"""


def test_the_repository_root_imports_bridgecache_beside_hugging_faces_kernels(hf_kernels):
    seen = json.loads(_run(ROOT_PROBE, cwd=REPO, extra_path=hf_kernels))
    assert seen["bridgecache"] == str(REPO / "bridgecache" / "__init__.py")
    assert seen["ours"] == str(REPO / "kernels" / "__init__.py")
    assert Path(seen["theirs"]).is_relative_to(hf_kernels)  # not ours, though first on sys.path
    assert seen["transformers_sees"][0] is True and seen["transformers_sees"][1] != "N/A"
    usage = _output(["-m", "bridgecache.cli", "--help"], cwd=REPO, extra_path=hf_kernels)
    assert usage.startswith("usage: bridgecache") and "export-builtin" in usage


def test_without_hugging_faces_kernels_the_root_kernels_is_an_empty_namespace():
    """As a folder without __init__.py would be: transformers reads no __file__ and no
    __version__ as "not installed"; using it says what is missing. -S: no site-packages, so no
    Hugging Face's kernels (and none of our code runs: nothing of torch is imported)."""
    code = r"""
import importlib.util, json, sys
import kernels
seen = {"file": getattr(kernels, "__file__", None), "version": getattr(kernels, "__version__", "N/A"),
        "origin": importlib.util.find_spec("kernels").origin, "torch": "torch" in sys.modules}
try:
    kernels.get_kernel
except AttributeError as err:
    seen["attribute"] = str(err)
try:
    import kernels.attention
except ImportError as err:
    seen["submodule"] = str(err)
print(json.dumps(seen))
"""
    seen = json.loads(_run(code, cwd=REPO, args=("-S",)))
    assert seen["file"] is None and seen["version"] == "N/A" and seen["origin"] is None
    assert not seen["torch"]
    assert "Hugging Face's kernels package is not installed" in seen["attribute"]
    assert "import it as bridgecache.kernels" in seen["attribute"]
    assert "'kernels' is not a package" in seen["submodule"]


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    """bridgecache installed from its wheel (a pure-Python wheel unpacks to its installed form)."""
    build = tmp_path_factory.mktemp("wheel")
    checkout = build / "checkout"  # a copy: building writes build/ and *.egg-info beside the sources
    checkout.mkdir()
    for name in ("pyproject.toml", "README.md", "bridgecache", "kernels", "tokenalign"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, checkout / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(build / "dist"), str(checkout)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if "Could not find a version that satisfies the requirement setuptools" in out.stderr:
        pytest.skip("pip cannot fetch setuptools to build the wheel (no network?)")
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (build / "dist").glob("bridgecache-*.whl")
    site = build / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _installed_only(site: Path) -> str:
    """Code that puts `site` and this interpreter's site-packages on sys.path without running their
    .pth files (run under -S): no editable install's finder, as with a normal install."""
    packages = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return f"import sys; sys.path[1:1] = {[str(site), *packages]!r}\n"


def test_a_wheel_install_imports_from_elsewhere_and_from_the_root(wheel_site, tmp_path):
    assert not (wheel_site / "kernels").exists()  # ours ships as bridgecache/kernels/ only
    code = _installed_only(wheel_site) + "import bridgecache.kernels as k; print(k.__file__)"
    installed = wheel_site / "bridgecache" / "kernels" / "__init__.py"
    assert _run(code, cwd=tmp_path, args=("-S",)) == str(installed)
    # In the root the checkout's bridgecache/ comes first (it has no kernels/ of its own).
    code = _installed_only(wheel_site) + "import bridgecache, kernels; print(bridgecache.kernels.__file__)"
    assert _run(code, cwd=REPO, args=("-S",)) == str(REPO / "kernels" / "__init__.py")
