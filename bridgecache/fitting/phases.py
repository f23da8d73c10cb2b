"""Where a fit's time goes: seconds and tokens per phase, and the progress bars that show them.

Phases: "text" (reading and tokenizing the calibration text), "forwards" (both models over it,
KV capture, attention weights),
"probes" (layer-probe rows and their scores), "statistics" (the maps' moments), "solve", and
"scoring" (the held-out attention cosine). On CUDA each phase's end synchronises the device, so
a phase is charged for its own kernels only.

Knows clocks and tqdm; nothing about models or statistics.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["PhaseClock"]


class PhaseClock:
    """seconds[phase], tokens[phase]: what a fit spent; `report()` rounds them for a table."""

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else None
        self.seconds: dict[str, float] = defaultdict(float)
        self.tokens: dict[str, int] = defaultdict(int)
        self.passes = 0

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str, tokens: int = 0):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start
            self.tokens[name] += tokens

    def timed(self, items: Iterable, name: str, tokens_of=None) -> Iterator:
        """`items`, the time spent producing each one charged to phase `name`."""
        it = iter(items)
        while True:
            with self.phase(name):
                try:
                    item = next(it)
                except StopIteration:
                    return
            if tokens_of is not None:
                self.tokens[name] += tokens_of(item)
            yield item

    def report(self) -> dict:
        """{phase: {"s": seconds, "tokens_per_s": rate or None}} plus "passes" over the text."""
        out: dict = {}
        for name, seconds in self.seconds.items():
            tokens = self.tokens.get(name, 0)
            out[name] = {
                "s": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds) if tokens and seconds else None,
            }
        out["passes"] = self.passes
        return out
