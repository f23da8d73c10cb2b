"""Shared plumbing of the kernels: backend choice, lazy Triton compilation, source-layer tables.

- `resolve_backend`: "triton" on CUDA tensors, "torch" elsewhere; a call's `backend=` argument,
  then a `use_backend(...)` block around it (this thread or task only), then the environment
  variable BRIDGECACHE_KERNELS ("auto" | "triton" | "torch") override it.
- `LazyKernel`: a Triton kernel decorated on first launch; Triton itself is imported then, not
  when bridgecache.kernels is. Triton reads TRITON_INTERPRET when it is imported (its own
  library functions) and when a kernel is decorated, so importing bridgecache never fixes that
  choice. On CPU tensors the kernels run only under TRITON_INTERPRET=1 (a few ms per program).
- `source_view`: several source layers addressed as one virtual stack of heads, without a copy:
  the first layer's tensor plus each layer's element offset from it.

Knows nothing about models, tokenizers or what the kernels compute.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "ENV_VAR",
    "LazyKernel",
    "SourceView",
    "device_of",
    "interpreting",
    "next_pow2",
    "resolve_backend",
    "sm_count",
    "source_view",
    "triton_available",
    "use_backend",
]

ENV_VAR = "BRIDGECACHE_KERNELS"
_CHOICES = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """Triton is installed (it ships for Linux only; the PyTorch references run everywhere)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_SCOPED: contextvars.ContextVar[str | None] = contextvars.ContextVar("bridgecache_kernels", default=None)


@contextlib.contextmanager
def use_backend(choice: str):
    """Within the block, kernel calls that pass no `backend=` use `choice` ("auto" | "triton" |
    "torch"); other threads and the process environment are untouched."""
    if choice not in _CHOICES:
        raise ValueError(f"backend must be one of {_CHOICES}, got {choice!r}")
    token = _SCOPED.set(choice)
    try:
        yield
    finally:
        _SCOPED.reset(token)


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """ "triton" or "torch" for tensors on `device`; see the module docstring for the order."""
    choice = (backend or _SCOPED.get() or os.environ.get(ENV_VAR) or "auto").lower()
    if choice not in _CHOICES:
        raise ValueError(f"backend must be one of {_CHOICES}, got {choice!r} (argument or ${ENV_VAR})")
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' asked for, but Triton is not installed")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(
                f"Triton kernels run on CUDA tensors (got {device}); set TRITON_INTERPRET=1 for CPU"
            )
    return choice


def device_of(t: torch.Tensor):
    """Context that makes `t`'s GPU current: Triton launches on the current device, not the tensor's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# helper function -> its triton.jit: one JITFunction per helper, whichever kernels call it
_JITTED: dict = {}


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent and statistics grids)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


class LazyKernel:
    """`triton.jit(fn)` built on first use; `autotune` wraps it on CUDA (never in the interpreter).

    kernel[grid](...) launches the plain kernel; `autotuned` is it wrapped in triton.autotune, for
    CUDA launches (configs: a function returning triton.Config objects; key: argument names;
    prune: autotune's early_config_prune); never used in the interpreter. helpers: plain
    functions the kernel calls, jitted on first use too (once each) and rebound under their names
    in their module and in the kernel's (which imported them), where calls find them; the module's
    `tl` is bound to triton.language then.
    do_not_specialize: integer arguments Triton should not specialise on (divisibility by 16):
    ones that follow the token count, so a new context length does not compile a new variant.
    """

    def __init__(self, fn: Callable, configs: Callable[[], list] | None = None, key: Sequence[str] = (),
                 helpers: Sequence[Callable] = (), prune: Callable | None = None,
                 do_not_specialize: Sequence[str] = ()):  # fmt: skip
        self.fn = fn
        self._do_not_specialize = list(do_not_specialize)
        self._configs = configs
        self._key = list(key)
        self._helpers = tuple(helpers)
        self._prune = prune

    def _jit(self):
        import triton
        import triton.language as tl

        self.fn.__globals__["tl"] = tl
        for helper in self._helpers:
            jitted = _JITTED.get(helper)
            if jitted is None:
                jitted = _JITTED[helper] = triton.jit(helper)
            helper.__globals__["tl"] = tl
            helper.__globals__[helper.__name__] = jitted  # where other helpers of its module call it
            self.fn.__globals__[helper.__name__] = jitted  # and where the kernel does (an import)
        if self._do_not_specialize:
            return triton.jit(self.fn, do_not_specialize=self._do_not_specialize)
        return triton.jit(self.fn)

    @functools.cached_property
    def jitted(self):
        return self._jit()

    @functools.cached_property
    def autotuned(self):
        import triton

        prune = {"early_config_prune": self._prune} if self._prune else None
        # wraps the same jitted kernel that plain launches use: each configuration compiles once
        return triton.autotune(configs=self._configs(), key=self._key, prune_configs_by=prune)(self.jitted)

    def __getitem__(self, grid):
        return self.jitted[grid]


class SourceView:
    """Ls source layers [B, Hs, S, Ds] seen as one stack of Ls * Hs heads (virtual head v =
    layer * Hs + head). base: the first layer; offsets: int64 [Ls] element offset of each layer's
    data from base's (on base's device); aligned: every offset is a multiple of 16 elements."""

    def __init__(self, base: torch.Tensor, offsets: torch.Tensor, aligned: bool, layers: int):
        self.base, self.offsets, self.aligned, self.layers = base, offsets, aligned, layers

    @property
    def heads_per_layer(self) -> int:
        return self.base.shape[1]


_OFFSETS_CACHE: dict[tuple, torch.Tensor] = {}


def source_view(src: Sequence[torch.Tensor]) -> SourceView:
    """The layers of `src` (same shape, strides, dtype and device; last axis contiguous) as one
    SourceView. The offset table is cached by address, so a cache translated again costs no copy."""
    base = src[0]
    for t in src:
        if (
            t.shape != base.shape
            or t.stride() != base.stride()
            or t.dtype != base.dtype
            or t.device != base.device
        ):
            raise ValueError("source layers must share shape, strides, dtype and device")
    size = base.element_size()
    deltas = []
    for t in src:
        delta = t.data_ptr() - base.data_ptr()
        if delta % size:
            raise ValueError("source layers are not element-aligned with each other")
        deltas.append(delta // size)
    key = (base.device, tuple(deltas))
    offsets = _OFFSETS_CACHE.get(key)
    if offsets is None:
        if len(_OFFSETS_CACHE) > 64:
            _OFFSETS_CACHE.clear()
        offsets = torch.tensor(deltas, dtype=torch.int64).to(base.device, non_blocking=True)
        _OFFSETS_CACHE[key] = offsets
    aligned = all(d % 16 == 0 for d in deltas)
    return SourceView(base, offsets, aligned, len(src))
