"""`match`: pair two tokenizations of one text into an `Alignment`.

Given source and target `TokenSpans` over the same bytes, target token t with text [a, b) reads

    span        the source tokens with text overlapping [a, b): those reaching past a and starting
                before b (a source token reaches over the uncovered text after it, spans.py).
                Spans never decrease, so the first is the first source token reaching past a and
                the last is the last one starting before b: two monotone pointers, found for all
                targets at once by binary search in C (`np.searchsorted`).
    source_index the last token of the span: it covers byte b - 1 (or, where the source has no
                text there, is the last source token before it), so it never starts after the
                target token's text ends: causal.

A target token without text, or whose text no source token overlaps, is NATIVE. Source tokens
without text (control tokens) are never read: a span that would run across one is cut to the
contiguous run of text tokens ending at source_index.

Knows nothing about tokenizers, KV caches or models.
"""

from __future__ import annotations

import numpy as np

from .alignment import NATIVE, Alignment
from .spans import TokenSpans

__all__ = ["match"]


def match(source: TokenSpans, target: TokenSpans, policy: str = "last") -> Alignment:
    """Alignment of target tokens onto source tokens (both spans over one text's bytes)."""
    has_text = source.has_text()
    readable = np.flatnonzero(has_text)  # source tokens that can be read, in order
    if len(readable) == 0:
        empty = np.zeros(len(target), dtype=np.int64)
        return Alignment(empty + NATIVE, empty, empty, num_source=len(source), policy=policy)
    begin = np.searchsorted(source.reach[readable], target.start, side="right")  # first reaching past a
    stop = np.searchsorted(source.start[readable], target.end, side="left")  # first starting at/after b
    aligned = target.has_text() & (begin < stop)
    last = readable[np.maximum(stop - 1, 0)]
    first = readable[np.minimum(begin, len(readable) - 1)]
    # A control token inside [first, last] would be averaged by `mean`: start after the last one.
    control_before = np.maximum.accumulate(np.where(has_text, -1, np.arange(len(source))))
    first = np.maximum(first, control_before[last] + 1)
    return Alignment(
        source_index=np.where(aligned, last, NATIVE),
        span_start=np.where(aligned, first, 0),
        span_end=np.where(aligned, last + 1, 0),
        num_source=len(source),
        policy=policy,
    )
