"""A cheap fingerprint of a model's weights: which checkpoint, not merely which architecture.

A bridge records the fingerprint of both models at fit time; `Bridge.check` compares it with
the models it is given, so a bridge fitted for one checkpoint is not silently applied to a
fine-tuned copy of the same architecture (same shapes, same rope, same tokenizer).

The fingerprint hashes every parameter's name and shape and 64 of its values at fixed,
evenly spaced positions. The values are rounded to bfloat16 first, so a float32 model and its
bfloat16 copy share a fingerprint; a fine-tune changes almost every value, so it does not.
One pass costs a few hundred tiny reads (milliseconds); the result is remembered per model
until a parameter is replaced, moved or written in place (`weights_version`).

`weights_version(tensors)` is the library's one definition of "these weights changed": a tensor
replaced (its id), written in place (`Tensor._version`), given other storage (`.data = ...`,
`module.to(...)` swap storage without bumping `_version`: its pointer), dtype or device. The
fingerprint's memo keys on it, and so does a handoff engine's per-request check
(bridgecache.runtime.identity).

Knows nothing about bridges or caches.
"""

from __future__ import annotations

import hashlib
import weakref

import torch

__all__ = ["weight_fingerprint", "weights_version"]

_SAMPLES = 64  # values read per parameter
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (versions, fingerprint)


def weights_version(tensors) -> tuple:
    """What changes when any of `tensors` (None entries allowed) is replaced, written in place,
    or moved to other storage, dtype or device (see the module docstring); compare two of them."""
    return tuple(None if t is None else (id(t), t._version, t.data_ptr(), t.dtype, t.device) for t in tensors)


def weight_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits identifying `model`'s weights (names, shapes and sampled values)."""
    params = sorted(model.named_parameters(), key=lambda item: item[0])
    versions = weights_version(p for _, p in params)
    known = _MEMO.get(model)
    if known is not None and known[0] == versions:
        return known[1]
    hasher = hashlib.sha256()
    with torch.no_grad():
        for name, p in params:
            hasher.update(f"{name}:{tuple(p.shape)};".encode())
            if p.device.type == "meta" or p.numel() == 0:  # offloaded or empty: shape only
                continue
            flat = p.detach().reshape(-1)
            count = min(_SAMPLES, flat.numel())
            # integer steps (a float linspace rounds past the end above 2**24 elements); first and last kept
            index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
            sample = flat[index].to(torch.bfloat16).cpu()
            hasher.update(sample.view(torch.int16).numpy().tobytes())
    fingerprint = hasher.hexdigest()[:16]
    _MEMO[model] = (versions, fingerprint)
    return fingerprint
