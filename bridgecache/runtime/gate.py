"""The quality gate and the handoff report: what a bridged cache computed natively, and why.

A bridge records held-out scores per target layer when it is fitted (`Bridge.layer_scores`:
attention-output cosine where measured, which predicts transfer quality far better than key R^2
in Full-Head's study; else held-out value R^2). `QualityPolicy` turns a threshold into a plan:
    layers scoring below `min_quality`          -> computed natively by the target
    too many such layers, or too little of the  -> fall back to the target's own prefill of the
    context aligned to source tokens               whole context (exact), and say so
`HandoffReport` says what a cache did: layers translated / native, tokens refreshed, the estimated
quality and the cost of the native work as a share of the target's own prefill (FLOPs counted).

This module knows nothing about tokenizers; it reads model configs and bridge scores only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "QualityPolicy",
    "GateDecision",
    "HandoffReport",
    "layer_scores",
    "layer_score_metric",
    "prefill_flops",
    "handoff_flops",
]


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


@dataclass
class HandoffReport:
    """What one bridged cache did. Tokens are context columns of the cached prefix."""

    layers_translated: list[int]
    layers_native: list[int]
    tokens_translated: int
    tokens_native: int  # native head (sink/BOS) + padding-free native columns
    tokens_refreshed: int
    refresh_by: str | None
    estimated_quality: float | None  # mean layer score over translated layers (1.0 if none)
    fallback: str | None
    native_cost_fraction: float  # FLOPs of the handoff's native work / the target's own prefill
    notes: list[str] = field(default_factory=list)
    # FLOPs of choosing the refreshed tokens (a model reading the prompt over the context: the
    # source for refresh_by="source", the target for "target") / the target's own prefill
    guide_cost_fraction: float = 0.0

    @property
    def cost_fraction(self) -> float:
        """All the handoff's compute beyond translation, as a share of the target's own prefill."""
        return self.native_cost_fraction + self.guide_cost_fraction

    def __str__(self) -> str:
        lines = [
            f"layers: {len(self.layers_translated)} translated, {len(self.layers_native)} native"
            + (f" {self.layers_native}" if self.layers_native and len(self.layers_native) < 12 else ""),
            f"context tokens: {self.tokens_translated} translated ({self.tokens_refreshed} of them refreshed"
            + (f" by {self.refresh_by}" if self.refresh_by else "")
            + f"), {self.tokens_native} native",
            "estimated quality: "
            + ("n/a" if self.estimated_quality is None else f"{self.estimated_quality:.3f}"),
            f"native work: {self.native_cost_fraction:.1%} of the target's own prefill (FLOPs)"
            + (
                f"; choosing the refreshed tokens: {self.guide_cost_fraction:.1%} more"
                if self.guide_cost_fraction
                else ""
            ),
        ]
        if self.fallback:
            lines.insert(0, f"FALLBACK to native prefill: {self.fallback}")
        return "\n".join(lines + self.notes)


def _dims(config) -> dict:
    config = config.get_text_config()
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", heads)
    return {
        "layers": config.num_hidden_layers,
        "hidden": hidden,
        "q": heads * head_dim,
        "kv": kv_heads * head_dim,
        "ffn": config.intermediate_size,
    }


def _token_layer_flops(d: dict) -> float:
    """Matmul FLOPs of one token through one decoder layer (q, k, v, o projections; gated MLP)."""
    h = d["hidden"]
    return 2.0 * (h * d["q"] + 2 * h * d["kv"] + d["q"] * h + 3 * h * d["ffn"])


def _attention_flops(d: dict, pairs: float) -> float:
    """Scores and weighted values for `pairs` (query, key) pairs in one layer."""
    return 4.0 * d["q"] * pairs


def prefill_flops(config, tokens: int) -> float:
    """FLOPs of the target's own prefill of `tokens` (causal attention; no vocabulary head)."""
    d = _dims(config)
    per_layer = tokens * _token_layer_flops(d) + _attention_flops(d, tokens * (tokens + 1) / 2)
    return d["layers"] * per_layer


def reading_flops(config, tokens: int, context: int) -> float:
    """FLOPs of a model (`config`) reading `tokens` new tokens after `context` cached ones (no
    vocabulary head): what choosing tokens by a model's attention from the prompt costs."""
    d = _dims(config)
    return d["layers"] * (
        tokens * _token_layer_flops(d) + _attention_flops(d, tokens * (context + tokens / 2))
    )


def reading_fraction(reader_config, tokens: int, context: int, target_config, target_context: int) -> float:
    """`reading_flops` of a reader over the target's own prefill of its `target_context` tokens."""
    return reading_flops(reader_config, tokens, context) / prefill_flops(target_config, target_context)


def handoff_flops(
    config,
    *,
    context_tokens: int,
    prefix: int,
    native_prefix: int,
    native_layers: tuple[int, ...],
    refreshed: int,
    check_layer: int | None = None,
) -> float:
    """FLOPs of the target-side native work of a handoff of a `context_tokens` context.

    prefix: cached columns; [prefix, context_tokens) are fed natively by generate() (held-back
    token and native tail); native_prefix: leading columns computed natively (sink/BOS);
    native_layers: layers computed for every cached column (the forward through the deepest);
    refreshed: columns recomputed through every layer; check_layer: deepest layer a deviation
    check computed for every column (None: no check).
    """
    d = _dims(config)
    layer = _token_layer_flops(d)
    kv_only = 2.0 * 2 * d["hidden"] * d["kv"]
    total = native_prefix * d["layers"] * layer + _attention_flops(d, native_prefix**2 / 2) * d["layers"]
    deepest = max([*native_layers, -1] + ([check_layer] if check_layer is not None else []))
    if deepest >= 0:  # full layers below the deepest, k/v projections of the deepest
        total += prefix * (deepest * layer + kv_only) + deepest * _attention_flops(d, prefix * prefix / 2)
    total += refreshed * d["layers"] * layer + d["layers"] * _attention_flops(d, refreshed * prefix)
    tail = context_tokens - prefix
    total += tail * d["layers"] * layer + d["layers"] * _attention_flops(d, tail * context_tokens)
    return total
