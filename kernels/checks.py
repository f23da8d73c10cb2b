"""Argument checks the kernels' public entry points share.

Knows tensors only.
"""

from __future__ import annotations

import torch

__all__ = ["FLOATS", "expect", "last_contiguous"]

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def expect(t: torch.Tensor, shape: tuple, dtypes: tuple, name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")
