"""ControlScores: remember the scores that do not change between bridge variants.

The native, no-context and unrelated-context conditions of an item depend only on the target
model and the item's token ids, not on any bridge; each costs a prefill of the target. Keyed by a
sha256 of the target's weights fingerprint and every id involved, they are stored in one JSON
file, so that comparing a new variant on the same items repeats only the bridged work.

This module knows nothing about tasks or bridges.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from bridgecache.files import clean_leftovers, publish, staging_folder

__all__ = ["ControlScores"]


def _model_fingerprint(model) -> str:
    """A cheap identity of a model's weights: config plus a few values of every parameter."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        picks = flat[:: max(1, flat.numel() // 16)][:16].float().cpu()
        digest.update(name.encode() + str(tuple(param.shape)).encode() + picks.numpy().tobytes())
    return digest.hexdigest()


class ControlScores:
    """A JSON file of {key: {condition: [[logp_sum, tokens], ...], "native_prefill_s": s}}.

    path None: nothing is remembered (every control is computed).
    """

    def __init__(self, path: str | Path | None):
        self.path = None if path is None else Path(path)
        self.entries: dict = {}
        self._fingerprints: dict[int, str] = {}
        if self.path is not None and self.path.is_file():
            try:
                entries = json.loads(self.path.read_text())
            except (ValueError, RecursionError):  # bad JSON, bad UTF-8, a nesting bomb
                entries = {}
            # a damaged or foreign file costs a recomputation, never a wrong score or a crash
            self.entries = entries if isinstance(entries, dict) else {}

    def key(self, target, *ids) -> str:
        """The entry of (target weights, every id sequence given)."""
        model_id = id(target)
        if model_id not in self._fingerprints:
            self._fingerprints[model_id] = _model_fingerprint(target)
        digest = hashlib.sha256(self._fingerprints[model_id].encode())
        for part in ids:
            values = part.reshape(-1).tolist() if isinstance(part, torch.Tensor) else part
            digest.update(json.dumps(values).encode() + b"|")
        return digest.hexdigest()

    def get(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        return None if entry is None else json.loads(json.dumps(entry))  # a copy the caller may edit

    def put(self, key: str, scores: dict) -> None:
        self.entries[key] = scores
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # write then rename: a killed run never leaves a half-written file behind, and what it
        # leaves in its staging folder the next write removes
        clean_leftovers(self.path.parent)
        with staging_folder(self.path.parent) as staging:
            (staging / self.path.name).write_text(json.dumps(self.entries))
            publish(staging / self.path.name, self.path)  # the umask's mode, one rename
