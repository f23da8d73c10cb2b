"""The quality gate: which layers a bridged cache computes natively, or whether it falls back.

A bridge records held-out scores per target layer when it is fitted (`Bridge.layer_scores`:
attention-output cosine where measured, which predicts transfer quality far better than key R^2
in Full-Head's study; else held-out value R^2). `QualityPolicy` turns a threshold into a plan:
    layers scoring below `min_quality`          -> computed natively by the target
    too many such layers, or too little of the  -> fall back to the target's own prefill of the
    context aligned to source tokens               whole context (exact), and say so
What a cache then did is its `HandoffReport` (bridgecache.runtime.report).

This module knows nothing about tokenizers; it reads model configs and bridge scores only.
"""

from __future__ import annotations

from dataclasses import dataclass

from bridgecache.runtime.fields import real

__all__ = ["QualityPolicy", "GateDecision", "layer_scores", "layer_score_metric"]


def layer_score_metric(bridge) -> str | None:
    """Which held-out score `layer_scores` returns: "attention_cosine" (measured after fitting,
    bridgecache.fitting.heldout), "value_r2" (older bridges), "identity" or None (nothing recorded)."""
    if bridge.method == "identity":
        return "identity"
    if (bridge.calibration or {}).get("heldout_scores", {}).get("attention_cosine"):
        return "attention_cosine"
    if any(layer.r2_value == layer.r2_value for layer in bridge.layers):  # not NaN
        return "value_r2"
    return None


def layer_scores(bridge) -> list[float] | None:
    """Held-out quality per target layer (higher is better, 1.0 = exact), or None."""
    metric = layer_score_metric(bridge)
    if metric == "identity":
        return [1.0] * len(bridge.layers)
    if metric == "attention_cosine":
        return [float(x) for x in bridge.calibration["heldout_scores"]["attention_cosine"]]
    if metric == "value_r2":
        return [float(layer.r2_value) for layer in bridge.layers]
    return None


@dataclass(frozen=True)
class GateDecision:
    """native_layers: layers the gate sends to native compute; fallback: why the whole context is
    computed natively instead (None: it is not)."""

    native_layers: tuple[int, ...] = ()
    fallback: str | None = None


@dataclass(frozen=True)
class QualityPolicy:
    """min_quality: layers scoring below it are computed natively (None: no gate).
    max_native_fraction: exact KV of layer k need the target's forward through layers 0..k, so
        when the deepest low layer lies past this share of the depth, the native work would cost
        about as much as the target's own prefill: fall back to that (exact) instead.
    min_coverage: fall back when less than this share of translated target tokens have source text
        (across tokenizers: alignment coverage)."""

    min_quality: float | None = None
    max_native_fraction: float = 0.5
    min_coverage: float = 0.9

    def __post_init__(self):
        if self.min_quality is not None:  # scores are cosines or R^2: at most 1 (R^2 has no floor)
            real(self.min_quality, "QualityPolicy.min_quality (None: no gate)", high=1.0)
        real(self.max_native_fraction, "QualityPolicy.max_native_fraction", 0.0, 1.0)
        real(self.min_coverage, "QualityPolicy.min_coverage", 0.0, 1.0)

    def decide(self, layer_scores: list[float] | None, coverage: float) -> GateDecision:
        if self.min_quality is None:
            return GateDecision()
        if layer_scores is None:
            return GateDecision(fallback="the bridge records no held-out layer scores to gate on")
        if coverage < self.min_coverage:
            return GateDecision(
                fallback=f"only {coverage:.0%} of the context's target tokens align to source tokens "
                f"(min_coverage {self.min_coverage:.0%})"
            )
        low = tuple(i for i, s in enumerate(layer_scores) if not s >= self.min_quality)  # NaN counts as low
        depth = len(layer_scores)
        if low and low[-1] + 1 > self.max_native_fraction * depth:
            return GateDecision(
                fallback=f"{len(low)} of {depth} layers score below min_quality {self.min_quality}, the "
                f"deepest at layer {low[-1]}: computing it natively costs a forward through {low[-1] + 1} "
                f"of {depth} layers (more than {self.max_native_fraction:.0%})"
            )
        return GateDecision(native_layers=low)
