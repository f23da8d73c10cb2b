"""What a bridged cache did, and what it cost: `HandoffReport` and the FLOP counts behind it.

`HandoffReport` says which layers were translated or computed natively, how many context tokens
were translated, computed natively or refreshed, the estimated quality, and the cost of the
target's own work (and of choosing the refreshed tokens) as a share of its own prefill, in FLOPs.
A FLOP share is not a time: benchmarks/ measures time.

Reads model configs only; knows nothing about bridges, tokenizers or caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["HandoffReport", "prefill_flops", "reading_flops", "reading_fraction", "handoff_flops"]


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
    # FLOPs of choosing the refreshed tokens (the selection rule's `reading_flops`: the source
    # reading the prompt over its cache for SourceAttention) / the target's own prefill
    guide_cost_fraction: float = 0.0
    # the cost gate (bridgecache.runtime.route): "handoff", or "native" (the target's own prefill of
    # the whole context: the cost gate's choice, a forced route or the quality gate's fallback)
    route: str = "handoff"
    route_reason: str = ""

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
        elif self.route_reason:
            lines.insert(0, f"route: handoff ({self.route_reason})")
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
        "ffn": _ffn_width(config, hidden),
    }


def _ffn_width(config, hidden: int) -> int:
    """The MLP's inner width, for an estimate: named otherwise by some families (Falcon's
    `ffn_hidden_size`, GPT-2's `n_inner`) or absent (GPT-NeoX-Japanese, ERGO: a multiple, or
    per layer kind); then the usual 4 x hidden."""
    for name in ("intermediate_size", "ffn_hidden_size", "n_inner"):
        width = getattr(config, name, None)
        if isinstance(width, int) and width > 0:
            return width
    return 4 * hidden


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
