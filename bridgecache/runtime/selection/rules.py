"""Which context columns a refresh recomputes: selection rules, each a small class.

    SourceAttention   the source has read the context: it reads the prompt over its own cache and
                      the tokens its attention picks out score highest (CacheClip's helper-model
                      criterion; the default: it picks answers' tokens best, benchmarks/reports/quality.md)
    KeyDeviation      how far translated keys are from the target's own at a cheap check layer
                      (CacheBlend's criterion, as LMCache recomputes)
    GivenScores       scores the caller computed

A rule is a `Selector`: `scores(request)` -> [batch, prefix] float32, higher first;
`native_layers` names layers it needs computed natively first; `reading_flops` what choosing
costs (for the report). Write your own by subclassing `Selector`.

Knows the translator's row plan and the models it is given; nothing about tokenizers.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bridgecache.runtime.fields import FieldTypeError, count
from bridgecache.runtime.report import reading_flops
from bridgecache.runtime.selection.words import pool_words

__all__ = [
    "Selector",
    "SelectionRequest",
    "SourceAttention",
    "KeyDeviation",
    "GivenScores",
    "checked_scores",
    "selector_named",
]


@dataclass(frozen=True)
class SelectionRequest:
    """What a selection rule may read for one cache: a read-only view, nothing behind it to write.

    target_ids: [batch, T] the context in the target's tokens; prefix_length: the cached columns
        a rule scores (its scores are [batch, prefix_length]).
    reading_rows: [batch, prefix_length] int64 (on the device): the source token each cached
        column reads in `source_kv` (-1: none).
    source_kv: the source's `SourceKV` of the context, as captured (never mutated).
    prompt_ids: [batch, q] the prompt in the SOURCE's tokens (None: no prompt known yet).
    words: the context's words on both sides (`bridgecache.runtime.selection.words.ContextWords`), given
        only when the refresh takes whole words: a rule that scores source tokens pools them over
        the source's words before they cross to the target's columns.
    source_config, target_config: the models' configs (source_config None without a source model).
    `read_source(...)` lets the source read (the engine's view of it: our attention, graphs where
    allowed); `translated_keys(layer)` / `native_keys(layer)` give one target layer's keys.
    """

    target_ids: torch.Tensor
    prefix_length: int
    reading_rows: torch.Tensor
    source_kv: object
    prompt_ids: torch.Tensor | None
    words: object | None
    source_config: object | None
    target_config: object
    _reader: Callable | None = field(default=None, repr=False)
    _keys: Callable | None = field(default=None, repr=False)

    @property
    def has_source(self) -> bool:
        """Whether the source model is there to read with."""
        return self._reader is not None

    def read_source(
        self, query_ids: torch.Tensor, context_tokens: int, *, reduce: str = "max", layers: int | None = None
    ) -> torch.Tensor:
        """[batch, context_tokens] float32: the attention the source's reading of `query_ids` [batch,
        q], right after its first `context_tokens` cached tokens, gives each of them (reduced over
        layers, heads and queries by `reduce`; `layers`: read with the first this many only)."""
        if self._reader is None:
            raise ValueError(
                "this rule reads with the source model, which this cache was not given: pass "
                "source_model= (handoff() does), or choose another rule: RefreshConfig(by='deviation')"
            )
        return self._reader(query_ids, context_tokens, reduce, layers)

    def source_layers_read(self, layers: int | None) -> int:
        """How many source layers a reading with `layers` runs (the whole stack where the model
        cannot stop early)."""
        return self._reader.layers_read(layers)

    def translated_keys(self, layer: int) -> torch.Tensor:
        """[batch, kv_heads, prefix_length, head_dim] target layer `layer`'s translated keys."""
        return self._keys(layer, True)

    def native_keys(self, layer: int) -> torch.Tensor:
        """[batch, kv_heads, prefix_length, head_dim] the target's own keys of a layer the rule
        asked for natively (`Selector.native_layers`)."""
        return self._keys(layer, False)


class Selector(ABC):
    """A selection rule (see the module docstring)."""

    name: str = "custom"

    def native_layers(self, num_layers: int) -> tuple[int, ...]:
        """Target layers computed natively before `scores` runs (default: none)."""
        return ()

    @abstractmethod
    def scores(self, request: SelectionRequest) -> torch.Tensor:
        """[batch, prefix] float32 per cached column, higher refreshed first."""

    def reading_flops(self, request: SelectionRequest) -> float:
        """FLOPs of choosing (a model reading something), for `HandoffReport.guide_cost_fraction`."""
        return 0.0


@dataclass(frozen=True)
class SourceAttention(Selector):
    """The source reads the prompt over its own cache of the context; each target column scores
    what the source token it reads was given.

    With a prompt: `reduce` "max" (the largest attention any layer, head and prompt token gives a
    token) and each score reaches the `after` tokens that follow it (what a text says about
    something follows its mention). Without one, the context's last `recent` tokens read the
    context before them ("sum", no reach) and score highest themselves. None picks those
    defaults (measured on fact questions and on prose: benchmarks/reports/quality.md).
    `layers`: read with the source's first layers only, its forward stopping there: an int
    counts them, a float in (0, 1] is their share of the source's layers (rounded up); None: all
    (what fewer cost: benchmarks/reports/quality.md).
    """

    reduce: str | None = None
    after: int | None = None
    recent: int = 16
    layers: int | float | None = None
    name = "source attention"

    def __post_init__(self):
        if self.reduce not in (None, "max", "sum"):
            raise ValueError(f"SourceAttention.reduce={self.reduce!r}; expected None, 'max' or 'sum'")
        if self.after is not None:
            count(self.after, "SourceAttention.after", what="a reach in tokens")
        count(self.recent, "SourceAttention.recent", low=1, what="a number of recent tokens")
        layers, expected = self.layers, "an integer >= 1, a share in (0, 1], or None (all)"
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, (int, float))):
            raise TypeError(f"layers is {layers!r}; expected {expected}")
        if isinstance(layers, int) and layers < 1 or isinstance(layers, float) and not 0 < layers <= 1:
            raise ValueError(f"layers is {layers}; expected {expected}")

    def layer_count(self, config) -> int | None:
        """How many layers of the model with `config` (or of the model) this rule reads with (None: all)."""
        if not isinstance(self.layers, float):
            return self.layers
        config = getattr(config, "config", config)
        return math.ceil(self.layers * config.get_text_config().num_hidden_layers)

    def scores(self, request: SelectionRequest) -> torch.Tensor:
        kv = request.source_kv
        if not request.has_source:
            raise ValueError(
                "refresh by the source's attention needs the source model: pass source_model= (handoff() "
                "does), or choose another rule: HandoffConfig(refresh=RefreshConfig(by='deviation'))"
            )
        if any(kv.first_token):
            raise ValueError(
                "source-guided refresh needs every source row: capture the source with capture_kv"
            )
        prompted = request.prompt_ids is not None and request.prompt_ids.shape[1] > 0
        reduce = self.reduce or ("max" if prompted else "sum")
        after = (4 if prompted else 0) if self.after is None else self.after
        tokens = kv.num_tokens
        layers = self.layer_count(request.source_config)
        if prompted:
            scores = request.read_source(request.prompt_ids, tokens, reduce=reduce, layers=layers)
        else:
            ids = _context_ids(kv)
            recent = min(self.recent, tokens - 1 - int(kv.padding.max()))
            if recent <= 0:
                return torch.zeros(request.reading_rows.shape)
            queries, context = ids[:, tokens - recent :], tokens - recent
            scores = request.read_source(queries, context, reduce=reduce, layers=layers)
            top = scores.amax() + 1.0
            scores = torch.cat([scores, top.expand(scores.shape[0], recent)], dim=1)
        if after > 0:  # a running max over the `after` tokens before each one, on the source's tokens
            padded = torch.nn.functional.pad(scores[:, None], (after, 0), value=float("-inf"))
            scores = torch.nn.functional.max_pool1d(padded, after + 1, stride=1)[:, 0]
        if request.words is not None:  # whole words on the source's side, before the crossing
            scores = pool_words(scores, request.words.source)
        rows = request.reading_rows.to(scores.device)
        return torch.where(rows >= 0, scores.gather(1, rows.clamp(min=0)), 0.0)

    def reading_flops(self, request: SelectionRequest) -> float:
        prompt = request.prompt_ids
        queries = prompt.shape[1] if prompt is not None and prompt.shape[1] else self.recent
        config = request.source_config
        read = request.source_layers_read(self.layer_count(config))
        share = read / config.get_text_config().num_hidden_layers
        return share * reading_flops(config, queries, request.source_kv.num_tokens)


def _context_ids(kv) -> torch.Tensor:
    ids = kv.input_ids
    if ids is None:
        raise ValueError(
            "refresh by the source's attention without a prompt needs the source's context token ids: "
            "capture the source with bridgecache.capture_kv (it records them), or pass a prompt"
        )
    return ids.to(kv.position_ids.device)


@dataclass(frozen=True)
class KeyDeviation(Selector):
    """Squared distance between translated and native keys at `check_layer` (layers 0..check_layer
    are then computed natively, at no extra cost for the refresh)."""

    check_layer: int = 1
    name = "key deviation"

    def __post_init__(self):
        count(self.check_layer, "KeyDeviation.check_layer", what="a layer index")

    def native_layers(self, num_layers: int) -> tuple[int, ...]:
        if not 0 <= self.check_layer < num_layers:
            raise ValueError(f"check_layer={self.check_layer}; expected 0..{num_layers - 1}")
        return tuple(range(self.check_layer + 1))

    def scores(self, request: SelectionRequest) -> torch.Tensor:
        translated = request.translated_keys(self.check_layer)  # [batch, heads, prefix, dim]
        native = request.native_keys(self.check_layer)
        return (translated.float() - native.float()).pow(2).sum(dim=(1, 3))


@dataclass(frozen=True, eq=False)
class GivenScores(Selector):
    """Scores computed elsewhere: [batch, >= prefix] per target column, higher first."""

    values: torch.Tensor
    name = "given scores"

    def __post_init__(self):  # checked once here: the plan then trusts them
        try:
            values = torch.as_tensor(self.values)
        except (TypeError, ValueError, RuntimeError) as err:
            raise FieldTypeError(
                f"GivenScores.values is a {type(self.values).__name__} ({err}); "
                "expected a tensor [batch, tokens]"
            ) from None
        if values.dim() != 2 or values.dtype == torch.bool or values.is_complex():
            raise ValueError(
                f"GivenScores.values has shape {tuple(values.shape)} and dtype {values.dtype}; "
                "expected [batch, tokens] of real numbers"
            )
        _refuse_non_finite(values.float(), self)
        object.__setattr__(self, "values", values)

    def scores(self, request: SelectionRequest) -> torch.Tensor:
        prefix = request.prefix_length
        scores = self.values
        if scores.shape[0] != request.target_ids.shape[0] or scores.shape[1] < prefix:
            batch = request.target_ids.shape[0]
            raise ValueError(
                f"given scores have shape {tuple(scores.shape)}; "
                f"expected [batch={batch}, target tokens >= {prefix}]"
            )
        return scores[:, :prefix].float()


_BUILT_IN = (SourceAttention, KeyDeviation, GivenScores)


def checked_scores(scores, batch: int, prefix: int, selector: Selector) -> torch.Tensor:
    """The scores `selector.scores` returned, checked before anything ranks them: a floating
    tensor of shape [batch, prefix] (one per cached column), returned as float32. A wrong shape
    is never broadcast over the columns; NaN or +inf is refused (NaN would sort first), -inf is
    allowed (a column ranked last). A built-in rule's scores stay on the device, unread (the
    device never waits on the host here), a NaN among them ranked last as -inf; any other rule's
    scores are read once to check them."""
    name = f"{type(selector).__name__} ({selector.name!r})"
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"selector {name} returned a {type(scores).__name__}; expected a torch.Tensor")
    if tuple(scores.shape) != (batch, prefix) or not scores.is_floating_point():
        raise ValueError(
            f"selector {name} returned scores of shape {tuple(scores.shape)} and dtype {scores.dtype}; "
            f"expected [batch={batch}, prefix={prefix}] of floats (one score per cached column)"
        )
    scores = scores.float()
    if isinstance(selector, _BUILT_IN):
        return scores.masked_fill(scores.isnan(), float("-inf"))
    _refuse_non_finite(scores, selector)
    return scores


def _refuse_non_finite(scores: torch.Tensor, selector: Selector) -> None:
    bad = torch.isnan(scores) | torch.isposinf(scores)
    if bool(bad.any()):
        raise ValueError(
            f"selector {type(selector).__name__} ({selector.name!r}) gave {int(bad.sum())} of "
            f"{scores.numel()} scores NaN or +inf; expected finite scores, or -inf for a column ranked last"
        )


_NAMED = {"source": SourceAttention, "deviation": KeyDeviation}


def selector_named(by) -> Selector:
    """A Selector from a name ("source", "deviation") or a Selector itself."""
    if isinstance(by, Selector):
        return by
    if isinstance(by, str) and by in _NAMED:
        return _NAMED[by]()
    raise ValueError(f"refresh by {by!r}; expected one of {sorted(_NAMED)} or a bridgecache Selector")
