"""`TextMap`: carry token spans from one text onto another, nearly identical, text.

Two tokenizers rarely reproduce the same bytes for one text: one normalises (NFC, NFKC), one adds a
SentencePiece dummy-prefix space, one writes a placeholder for text it cannot represent, a chat
template surrounds the messages with its own scaffolding. A `TextMap` from text `a` to text `b`
(UTF-8 bytes) is three monotone maps of span boundaries:

    starts  [len(a) + 1]   where a span that starts at byte p of `a` starts in `b`
    ends    [len(a) + 1]   where a span that ends at byte p of `a` ends in `b`
    reaches [len(a) + 1]   the same for a span's reach (spans.py): like `ends`, except that a block
                           only `b` has (text the tokenizer dropped) joins the span ending before it

built from runs of bytes the two texts share. Bytes of `a` outside every run (a replaced or deleted
block) map onto the corresponding block of `b` as a whole; a span lying entirely inside a deleted
block maps to an empty span (it has no text in `b`).

`TextMap.diff(a, b)` finds the runs by a two-pointer walk that re-synchronises after each mismatch
at the nearest point where the next `_CONFIRM` bytes agree: O(len) for texts with local differences.
This module knows nothing about tokenizers or models.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["TextMap"]

_CONFIRM = 8  # bytes that must agree to call two texts re-synchronised
_WINDOW = 1024  # furthest re-synchronisation point searched, in bytes of each text


@dataclass(frozen=True, eq=False)
class TextMap:
    """Monotone maps of span boundaries from text `a` to text `b` (byte offsets, see module doc)."""

    starts: np.ndarray  # int64 [len(a) + 1]
    ends: np.ndarray  # int64 [len(a) + 1]
    reaches: np.ndarray  # int64 [len(a) + 1]

    @classmethod
    def identity(cls, n: int) -> TextMap:
        positions = np.arange(n + 1, dtype=np.int64)
        return cls(positions, positions, positions)

    @classmethod
    def from_runs(cls, len_a: int, len_b: int, runs: Iterable[tuple[int, int, int]]) -> TextMap:
        """Map from shared runs `(a_start, b_start, length)`, increasing in both texts."""
        starts = np.empty(len_a + 1, dtype=np.int64)
        ends = np.empty(len_a + 1, dtype=np.int64)
        ends[0] = 0
        joins = []  # (position in a, end in b) of blocks only b has
        pa = pb = 0  # end of the previous run in a and b
        for a0, b0, n in [*runs, (len_a, len_b, 0)]:
            if a0 < pa or b0 < pb:
                raise ValueError(f"runs must increase in both texts; got {(a0, b0, n)} after ({pa}, {pb})")
            # The block a[pa:a0] <-> b[pb:b0] before this run maps as a whole.
            starts[pa:a0] = pb
            ends[pa + 1 : a0 + 1] = b0
            if a0 == pa and b0 > pb and 0 < a0 < len_a:
                joins.append((a0, b0))
            steps = np.arange(n, dtype=np.int64)
            starts[a0 : a0 + n] = b0 + steps
            ends[a0 + 1 : a0 + n + 1] = b0 + 1 + steps
            pa, pb = a0 + n, b0 + n
        starts[len_a] = len_b
        reaches = ends.copy()
        for at, end in joins:
            reaches[at] = end
        return cls(starts, ends, reaches)

    @classmethod
    def diff(cls, a: bytes, b: bytes) -> TextMap:
        """Map between two texts that differ in local places (normalisation, spaces, placeholders)."""
        if a == b:
            return cls.identity(len(a))
        runs = []
        i = j = 0
        while i < len(a) and j < len(b):
            k = _common_prefix(a, i, b, j)
            if k:
                runs.append((i, j, k))
                i, j = i + k, j + k
            else:
                da, db = _resync(a, i, b, j)
                i, j = i + da, j + db
        return cls.from_runs(len(a), len(b), runs)

    def project(self, start: np.ndarray, end: np.ndarray, reach: np.ndarray) -> tuple[np.ndarray, ...]:
        """Spans `[start, end)` with reaches, of `a` -> of `b` (ends never below starts)."""
        new_start = self.starts[start]
        new_end = np.maximum(self.ends[end], new_start)
        return new_start, new_end, np.maximum(self.reaches[reach], new_end)


def _common_prefix(a: bytes, i: int, b: bytes, j: int) -> int:
    """Length of the common prefix of a[i:] and b[j:], by galloping slice comparisons (C speed)."""
    limit = min(len(a) - i, len(b) - j)
    k, step = 0, 64
    while k < limit:
        n = min(step, limit - k)
        if a[i + k : i + k + n] == b[j + k : j + k + n]:
            k += n
            step *= 2
        elif n == 1:
            break
        else:
            step = max(1, n // 2)
    return k


def _resync(a: bytes, i: int, b: bytes, j: int) -> tuple[int, int]:
    """Smallest skip (da, db), by da + db, after which a and b agree again for _CONFIRM bytes.

    Near the ends, agreeing means the two remaining tails are equal. If nothing agrees within
    _WINDOW bytes the rest of both texts is one block.
    """
    best = (len(a) - i, len(b) - j)
    for da in range(min(_WINDOW, len(a) - i) + 1):
        if da >= sum(best):
            break
        key = a[i + da : i + da + _CONFIRM]
        if len(key) == _CONFIRM:
            stop = min(len(b), j + min(sum(best) - da, _WINDOW) + _CONFIRM)
            pos = b.find(key, j, stop)
            if pos >= 0 and da + pos - j < sum(best):
                best = (da, pos - j)
        else:
            db = len(b) - j - len(key)
            if db >= 0 and b.endswith(key) and da + db < sum(best):
                best = (da, db)
    return best
