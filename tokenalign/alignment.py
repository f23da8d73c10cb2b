"""`Alignment`: which source token(s) feed each target token of one text.

An alignment is three int64 arrays indexed by TARGET token, plus the name of the pooling policy
that fitting and application agree to use:

    source_index [tgt_tokens]  the source token covering the target token's last character
                               (policy `last`), or NATIVE when the target token has no source text
    span_start   [tgt_tokens]  half-open range [span_start, span_end) of the contiguous source
    span_end     [tgt_tokens]  tokens whose text overlaps the target token's text; empty for NATIVE
                               (made as (0, 0)); span_end - 1 == source_index otherwise

Every policy reads from these arrays (`last`: source_index, `first`: span_start, `mean`: the span),
so one alignment serves all policies; `policy` only records the one chosen.

This module knows nothing about tokenizers, KV caches or models.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["NATIVE", "POLICIES", "Alignment"]

NATIVE = -1
"""Marks a target token with no source text (BOS, chat-template markers): the target computes it."""

POLICIES = ("last", "first", "mean")
"""How a target row is read from its source span:
`last`  the source token covering the target token's last character (default). It has read all of
        the target token's text and, at most, the rest of the source token holding its last
        character: the closest causal counterpart of the target's own row.
`first` the source token covering the target token's first character.
`mean`  the mean over all source tokens overlapping the target token's text.
"""


@dataclass(frozen=True, eq=False)
class Alignment:
    """Per target token: source row(s) to read. Arrays are int64 `[tgt_tokens]` (see module doc)."""

    source_index: np.ndarray
    span_start: np.ndarray
    span_end: np.ndarray
    num_source: int
    policy: str = field(default="last")

    def __post_init__(self):
        for name in ("source_index", "span_start", "span_end"):
            object.__setattr__(self, name, np.ascontiguousarray(getattr(self, name), dtype=np.int64))
        object.__setattr__(self, "num_source", int(self.num_source))
        self._check()

    def _check(self) -> None:
        index, start, end = self.source_index, self.span_start, self.span_end
        if index.ndim != 1 or start.shape != index.shape or end.shape != index.shape:
            raise ValueError(
                f"source_index, span_start, span_end must be 1-D of one length; got shapes "
                f"{index.shape}, {start.shape}, {end.shape}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; expected one of {POLICIES}")
        native = index == NATIVE
        if np.any(index < NATIVE) or np.any(index >= self.num_source):
            raise ValueError(f"source_index outside [0, {self.num_source}) and not NATIVE")
        if np.any(start[native] != end[native]):
            raise ValueError("NATIVE target tokens must have an empty span (span_start == span_end)")
        aligned_start, aligned_index = start[~native], index[~native]
        if np.any(end[~native] - 1 != aligned_index) or np.any(aligned_start > aligned_index):
            raise ValueError(
                "each span must end at its source_index: span_start <= source_index == span_end - 1"
            )
        if np.any(aligned_start < 0):
            raise ValueError("span_start must be >= 0")

    @classmethod
    def identity(cls, n: int, policy: str = "last") -> Alignment:
        """Same tokenizer on both sides: target token t reads source token t."""
        index = np.arange(n, dtype=np.int64)
        return cls(index, index.copy(), index + 1, num_source=n, policy=policy)

    def __len__(self) -> int:
        return len(self.source_index)

    def native_mask(self) -> np.ndarray:
        """bool `[tgt_tokens]`: True where the target computes the row itself."""
        return self.source_index == NATIVE

    def with_policy(self, policy: str) -> Alignment:
        """The same alignment recorded under another policy."""
        return replace(self, policy=policy)

    def to_dict(self) -> dict:
        """JSON-able form (lists of ints)."""
        return {
            "source_index": self.source_index.tolist(),
            "span_start": self.span_start.tolist(),
            "span_end": self.span_end.tolist(),
            "num_source": self.num_source,
            "policy": self.policy,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Alignment:
        """Inverse of `to_dict`; validates the arrays."""
        return cls(
            np.asarray(data["source_index"], dtype=np.int64),
            np.asarray(data["span_start"], dtype=np.int64),
            np.asarray(data["span_end"], dtype=np.int64),
            num_source=data["num_source"],
            policy=data.get("policy", "last"),
        )
