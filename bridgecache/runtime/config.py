"""One handoff configuration for every path: what the target computes itself, and how it is chosen.

    HandoffConfig()                                          the defaults every path shares
    HandoffConfig(refresh=RefreshConfig(amount=0.1))         refresh 10% of the translated tokens
    HandoffConfig(refresh=RefreshConfig(mass=0.5))           as many as hold half the rule's score
                                                             mass, per request (at most 20%)
    HandoffConfig(refresh=RefreshConfig(whole_words=False))  token by token, words known or not
    HandoffConfig(refresh=None)                              translation only (loses facts)
    HandoffConfig(quality=QualityPolicy(min_quality=0.7))    gate on the bridge's held-out scores
    HandoffConfig(route="handoff")                           hand off even where the target's own
                                                             prefill is faster (default "auto")

`BridgedCache`, `handoff`, `handoff_batch`, `Conversation.handoff`, `publish_context`, the
evaluation runner, the demo and the CLI's handoff flags all take one `HandoffConfig`, validated
once where it is built. Per-request inputs (the source model, the prompt) travel beside it.

Knows the selection rules and the gate's policy; nothing about models or caches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bridgecache.runtime.fields import FieldTypeError, count, flag
from bridgecache.runtime.gate import QualityPolicy
from bridgecache.runtime.selection.rules import Selector, selector_named

__all__ = [
    "HandoffConfig",
    "RefreshConfig",
    "QualityPolicy",
    "DEFAULT_REFRESH",
    "refresh_budget",
    "resolve_native_layers",
]

ROUTES = ("auto", "handoff", "native")  # HandoffConfig.route
DEFAULT_REFRESH = 0.2  # share of translated tokens refreshed by default (benchmarks/reports/quality.md)
DEFAULT_FLOOR = 0.02  # RefreshConfig.floor: the fewest refreshed when sized by the scores' mass
_TOKENS = "a count of context tokens"


@dataclass(frozen=True)
class RefreshConfig:
    """Context tokens the target recomputes through every layer over the bridged cache.

    amount: a fraction in (0, 1] of the translated tokens, or an int token count >= 1.
    by: the selection rule: "source" (the source's attention from the prompt; the default),
        "deviation" (translated vs native keys at a check layer, CacheBlend's rule), or a
        `bridgecache.Selector` instance (your own rule, or `GivenScores(tensor)`).
    whole_words: a chosen token brings the rest of its word or number with it, on both sides of
        the tokenizer alignment (bridgecache.runtime.selection.words), so a refresh never stops inside a
        number. It needs the context's words, which every path that tokenizes a text computes
        (handoff, handoff_batch, Conversation.handoff, publish_context, the evaluation runner,
        the demo and the CLI). None (the default): whole words wherever the words are known;
        a `BridgedCache` built from ids without `words=` refreshes token by token. True: whole
        words, and a cache without words raises. False: token by token everywhere.
    mass: None (the default): refresh `amount` tokens. A share in (0, 1): size the refresh per
        request (per row) from the rule's scores: the fewest best-scored tokens whose scores hold
        this share of the scores' sum over the translated tokens (negative scores count 0), at
        most `amount` and at least `floor`. A request whose question points at a few tokens
        refreshes few; one that spreads its attention refreshes up to `amount`.
    floor: with `mass`, the fewest tokens refreshed: a fraction in [0, 1] of the translated
        tokens or an int token count (capped at `amount`'s count). Default 0.02.
    word_ends: with whole words, each chosen word also brings the token after it (the target's
        side, within the same budget), so a refreshed number ends where the context ends it,
        and the word that token opens comes whole (bridgecache.runtime.selection.words). On by default: on
        RULER's needles at 4K tokens across tokenizers it took a 20% refresh from 66.7% to 86.7%
        (native 93.3%; the long-context report). No effect token by token.
    """

    amount: float | int = DEFAULT_REFRESH
    by: str | Selector = "source"
    whole_words: bool | None = None
    word_ends: bool = True
    mass: float | None = None
    floor: float | int = DEFAULT_FLOOR

    def __post_init__(self):
        amount = self.amount
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise FieldTypeError(
                f"RefreshConfig.amount={amount!r}; expected a fraction in (0, 1] or a token count, "
                f"not a {type(amount).__name__}"
            )
        if isinstance(amount, float) and not 0.0 < amount <= 1.0:  # NaN too
            raise ValueError(
                f"RefreshConfig.amount={amount}; a fraction must lie in (0, 1] (an int is a token count; "
                "no refresh: HandoffConfig(refresh=None))"
            )
        if isinstance(amount, int) and amount < 1:
            raise ValueError(f"RefreshConfig.amount={amount}; expected a token count >= 1")
        if not isinstance(self.by, (str, Selector)):
            raise FieldTypeError(
                f"RefreshConfig.by={self.by!r}; expected a rule's name or a bridgecache Selector, "
                f"not a {type(self.by).__name__}"
            )
        selector_named(self.by)  # raises for an unknown rule
        mass = self.mass
        if mass is not None and (isinstance(mass, bool) or not isinstance(mass, (int, float))):
            raise FieldTypeError(
                f"RefreshConfig.mass={mass!r}; expected None or a share in (0, 1), "
                f"not a {type(mass).__name__}"
            )
        if mass is not None and not 0.0 < mass < 1.0:  # NaN too
            raise ValueError(f"RefreshConfig.mass={mass}; expected None or a share of the scores in (0, 1)")
        floor = self.floor
        if isinstance(floor, bool) or not isinstance(floor, (int, float)):
            raise FieldTypeError(
                f"RefreshConfig.floor={floor!r}; expected a fraction in [0, 1] or a token count, "
                f"not a {type(floor).__name__}"
            )
        if isinstance(floor, float) and not 0.0 <= floor <= 1.0 or isinstance(floor, int) and floor < 0:
            raise ValueError(
                f"RefreshConfig.floor={floor}; expected a fraction in [0, 1] or a token count >= 0"
            )
        flag(self.word_ends, "RefreshConfig.word_ends")
        flag(self.whole_words, "RefreshConfig.whole_words (None: where the words are known)", optional=True)

    @property
    def selector(self) -> Selector:
        return selector_named(self.by)

    @property
    def label(self) -> str:
        """amount[@massM>=F]:rule[:words|:no-words][+whole-ends], the rule by its name or, for an instance,
        its repr (two rules with other parameters never share a label); whole_words=None (the
        default) adds nothing; +whole-ends: word_ends, unless token by token (the tag "+ends"
        named the earlier rule, whose ends could split the word they entered: pages made by it
        never answer for this one)."""
        by = self.by if isinstance(self.by, str) else repr(self.by)
        words = {None: "", True: ":words", False: ":no-words"}[self.whole_words]
        ends = "+whole-ends" if self.word_ends and self.whole_words is not False else ""
        sized = "" if self.mass is None else f"@mass{self.mass}>={self.floor}"
        return f"{self.amount}{sized}:{by}{words}{ends}"


@dataclass(frozen=True)
class HandoffConfig:
    """How a bridged cache is made (see the module docstring).

    native_head: context tokens the target computes itself at the start (None: the bridge's,
        usually 1, the attention sink; leading tokens without source text are added).
    native_tail: context tokens before the held-back last token that the target reads itself,
        after the cache (default 0).
    native_layers: target layers computed natively over the whole context (exact; a forward
        stopped after the deepest): an int n (the first n), a tuple of indices, or "all".
    key_norm: for targets that normalise keys (Gemma 3, Qwen3: `k_norm`), put each mapped key on
        the norm the target produces (no effect on other targets, nor through an identity bridge,
        whose keys are the target's own).
    refresh: a `RefreshConfig` (default: 20% chosen by the source's attention, whole words where
        the context's words are known), or None.
    quality: the quality gate (`QualityPolicy`; default: no gate).
    one_launch: translate layers in groups, one kernel launch per group for keys and one for
        values (None: on CUDA targets).
    cuda_graphs: replay the source's reading of the prompt and the target's native-work pass from
        CUDA graphs captured per shape bucket (None: on CUDA; bridgecache.runtime.interop.graphs).
    route: the cost gate (bridgecache.runtime.route): "auto" hands off only where the handoff is
        expected to reach the first token sooner than the target's own prefill of the context
        and computes the context natively (exact) elsewhere; "handoff" or "native" forces a side.
        `BridgedCache.report()` says which was taken and why.
    """

    native_head: int | None = None
    native_tail: int = 0
    native_layers: int | tuple[int, ...] | str | None = None
    key_norm: bool = True
    refresh: RefreshConfig | None = field(default_factory=RefreshConfig)
    quality: QualityPolicy = field(default_factory=QualityPolicy)
    one_launch: bool | None = None
    cuda_graphs: bool | None = None
    route: str = "auto"

    def __post_init__(self):
        if self.native_head is not None:
            object.__setattr__(
                self, "native_head", count(self.native_head, "HandoffConfig.native_head", what=_TOKENS)
            )
        object.__setattr__(
            self, "native_tail", count(self.native_tail, "HandoffConfig.native_tail", what=_TOKENS)
        )
        object.__setattr__(self, "native_layers", _native_layers(self.native_layers))
        flag(self.key_norm, "HandoffConfig.key_norm")
        if self.refresh is not None and not isinstance(self.refresh, RefreshConfig):
            raise FieldTypeError(
                f"HandoffConfig.refresh={self.refresh!r}; expected a RefreshConfig or None, not a "
                f"{type(self.refresh).__name__} (from a dict: RefreshConfig(**options))"
            )
        if not isinstance(self.quality, QualityPolicy):
            raise FieldTypeError(
                f"HandoffConfig.quality={self.quality!r}; expected a QualityPolicy, not a "
                f"{type(self.quality).__name__}"
            )
        for name in ("one_launch", "cuda_graphs"):
            flag(getattr(self, name), f"HandoffConfig.{name}", optional=True)
        if not isinstance(self.route, str) or self.route not in ROUTES:
            kind = "" if isinstance(self.route, str) else f", not a {type(self.route).__name__}"
            error = ValueError if isinstance(self.route, str) else FieldTypeError
            raise error(f"HandoffConfig.route={self.route!r}; expected one of {', '.join(ROUTES)}{kind}")

    def replace(self, **changes) -> HandoffConfig:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def label(self) -> str:
        """A short description for tables: only what differs from the defaults."""
        default = HandoffConfig()
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                shown = value.label if isinstance(value, RefreshConfig) else value
                parts.append(f"{f.name}={shown}")
        return " ".join(parts) or "default"

    @property
    def wants_words(self) -> bool:
        """Whether a path that tokenizes the context computes its words (`BridgedCache(words=)`):
        the refresh takes whole words, always (whole_words=True) or where known (None)."""
        return self.refresh is not None and self.refresh.whole_words is not False

    def with_words(self, known: bool) -> HandoffConfig:
        """This config for a cache whose context's words are `known` or not: whole_words=None
        becomes `known` (what the cache then does); whole_words=True without them raises."""
        refresh = self.refresh
        if refresh is None or refresh.whole_words is False or (refresh.whole_words and known):
            return self
        if refresh.whole_words is None:
            return self.replace(refresh=dataclasses.replace(refresh, whole_words=known))
        raise ValueError(
            "RefreshConfig(whole_words=True) needs the context's words on both sides: pass "
            "words=bridgecache.runtime.selection.words.context_words(...) to BridgedCache (handoff, "
            "handoff_batch, "
            "Conversation and publish_context compute them), or leave whole_words=None to refresh "
            "token by token where they are not known"
        )

    @property
    def kv_recipe(self) -> str:
        """What of this config changes the cache's KV values, as text: published pages are
        namespaced by it (the gate can send layers native; launch and graph choices change no
        value; the route neither: a context routed to the target's own prefill holds its exact
        KV, which any recipe's page may hold). whole_words=None reads as True: every path that
        publishes from text knows the words, and a `BridgedCache` built without them records
        whole_words=False."""
        refresh = self.with_words(True).refresh
        refresh = refresh.label if refresh is not None else "none"
        return (
            f"native_head={self.native_head} native_tail={self.native_tail} "
            f"native_layers={self.native_layers} key_norm={self.key_norm} refresh={refresh} "
            f"quality={self.quality}"
        )


def _native_layers(layers):
    """HandoffConfig.native_layers checked: None, "all", an int >= 0, or layer indices (a list
    becomes a tuple of ints >= 0); bounds against the model: resolve_native_layers."""
    name = "HandoffConfig.native_layers"
    if layers is None or layers == "all":
        return layers
    if isinstance(layers, (list, tuple)):
        return tuple(count(i, f"{name}[{k}]", what="a layer index") for k, i in enumerate(layers))
    if isinstance(layers, str):
        raise ValueError(f"{name}={layers!r}; expected an int, a tuple of layer indices or 'all'")
    try:
        return count(layers, name, what="a number of first layers")
    except FieldTypeError:
        raise FieldTypeError(
            f"{name}={layers!r}; expected an int, a tuple of layer indices or 'all', "
            f"not a {type(layers).__name__}"
        ) from None


# What the config's fields mean for one model and context (the planner and the cost gate read them).
def resolve_native_layers(native_layers, num_layers: int) -> tuple[int, ...]:
    """Sorted target layer indices from `native_layers`: an int n (the first n layers), an
    iterable of indices, "all", or None (none). Raises ValueError for out-of-range values."""
    if native_layers is None:
        return ()
    if isinstance(native_layers, str):
        if native_layers != "all":
            raise ValueError(f"native_layers={native_layers!r}; expected an int, a list of layers or 'all'")
        return tuple(range(num_layers))
    if isinstance(native_layers, bool):
        raise ValueError("native_layers must be an int, a list of layer indices or 'all', not a bool")
    if isinstance(native_layers, int):
        if not 0 <= native_layers <= num_layers:
            raise ValueError(f"native_layers={native_layers}; expected 0..{num_layers} (the target's layers)")
        return tuple(range(native_layers))
    layers = sorted({int(i) for i in native_layers})
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"native_layers {bad} are not target layers; expected indices in 0..{num_layers - 1}"
        )
    return tuple(layers)


def refresh_budget(amount, eligible: int) -> int:
    """Tokens to refresh: `amount` is a fraction in [0, 1] of the `eligible` (translated) tokens,
    or an int token count (capped at `eligible`); None refreshes nothing."""
    if amount is None:
        return 0
    if isinstance(amount, float):
        return min(eligible, round(amount * eligible))
    return min(eligible, amount)
