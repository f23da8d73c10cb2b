"""Triton runs CPU tensors only in its interpreter, which it picks when it is first imported.

This conftest is imported before the kernel test modules, so on a machine without CUDA it turns
the interpreter on first. When another test package already imported triton compiled (a full
`pytest` run), a module's tests cannot interpret here: the `interpreted_triton` fixture skips
them, and the module's `test_in_fresh_process` runs the whole module again in a new process
(`run_in_fresh_process`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
