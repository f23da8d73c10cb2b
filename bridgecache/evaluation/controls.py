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
import math
import re
from pathlib import Path

import torch

from bridgecache.evaluation.items import EvaluationError
from bridgecache.files import clean_leftovers, publish, staging_folder
from bridgecache.models.fingerprint import weight_fingerprint

__all__ = ["ControlScores"]

_HEX64 = re.compile(r"[0-9a-f]{64}")


def _read_entries(path: Path) -> dict:
    def damaged(why: str) -> EvaluationError:
        return EvaluationError(
            f"--controls {path} is not a bridgecache controls file ({why}); it is left as it is: "
            "pass another path (a new file is created) or delete it"
        )

    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as err:  # unreadable, bad JSON or UTF-8, a nesting bomb
        raise damaged(f"{type(err).__name__}: {str(err)[:200]}") from None
    if not isinstance(entries, dict):
        raise damaged(f"a JSON {type(entries).__name__}, not an object of entries")
    for key, entry in entries.items():
        problem = _entry_problem(entry)
        if problem or not _HEX64.fullmatch(key):
            raise damaged(f"entry {key[:80]!r}: {problem or 'the key is not a sha256 in hex'}")
    return entries


def _entry_problem(entry) -> str | None:
    """Why `entry` is none of the shapes ControlScores writes (None: it is one)."""
    if not isinstance(entry, dict):
        return f"a {type(entry).__name__}, not an object"
    if set(entry) == {"reply"}:
        return None if isinstance(entry["reply"], str) else "its 'reply' is not a text"
    if not _is_seconds(entry.get("native_prefill_s")):
        return "no 'native_prefill_s' in seconds"
    if "replies" in entry:
        replies = entry["replies"]
        if set(entry) != {"native_prefill_s", "native_prefill_cpu_s", "replies"}:
            return f"fields {sorted(entry)}; expected native_prefill_s, native_prefill_cpu_s, replies"
        if not _is_seconds(entry["native_prefill_cpu_s"]):
            return "no 'native_prefill_cpu_s' in seconds"
        if not isinstance(replies, dict) or not all(isinstance(v, str) for v in replies.values()):
            return "'replies' is not an object of texts"
        return None
    for condition, rows in entry.items():
        if condition == "native_prefill_s":
            continue
        pairs = isinstance(rows, list) and all(
            isinstance(row, list) and len(row) == 2 and _is_number(row[0]) and _is_count(row[1])
            for row in rows
        )
        if not pairs:
            return f"condition {condition[:80]!r} is not a list of [log-probability, tokens] pairs"
    return None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_seconds(x) -> bool:
    return _is_number(x) and math.isfinite(x) and x >= 0


def _model_fingerprint(model) -> str:
    """The target's identity in the controls' keys: its config, its weights' fingerprint
    (bridgecache.models.fingerprint, the library's one) and its parameters' dtypes (scores of a
    bfloat16 copy are not a float32 model's, though their weights share a fingerprint)."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    dtypes = sorted({str(param.dtype) for param in model.parameters()})
    digest.update(f"{weight_fingerprint(model)}|{','.join(dtypes)}".encode())
    return digest.hexdigest()


class ControlScores:
    """A JSON file of {key: entry}, an entry one of
        {condition: [[logp_sum, tokens], ...], "native_prefill_s": s}     (ppl, choice)
        {"native_prefill_s": s, "native_prefill_cpu_s": s, "replies": {condition: text}}
        {"reply": text}                                                   (an unrelated context)

    path None: nothing is remembered (every control is computed). A file at `path` that is not
    such a file (not JSON, not an object, an entry of another shape) is an EvaluationError when
    it is opened, before any model runs: it is never read as scores, and never overwritten (it may
    be something else the user pointed at)."""

    def __init__(self, path: str | Path | None):
        self.path = None if path is None else Path(path)
        self.entries: dict = {}
        self._fingerprints: dict[int, str] = {}
        if self.path is not None and self.path.exists():
            self.entries = _read_entries(self.path)

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
