"""Run an evaluation: every condition for every item, with the work they share done once.

Conditions per item, each scoring the same target tokens (the continuation, or every choice):
    native         the target prefills the context itself
    no_context     the target reads only the bare prompt (see prompts.py)
    other_native   the target prefills ANOTHER item's context (the next item that is not skipped),
                   cut to this context's length in target tokens (its whole text if shorter)
    bridged        per variant: the source's KV of the context, translated by the variant's bridge
    other_bridged  per variant, ppl only: the same for the other item's (cut) context
A `Variant` is a bridge with its native-anchor options, so several bridges share one pass over the
data: the source prefill, the target's native prefills and the controls are computed once.

Timings per item: `native_prefill_s` (target prefill of the context up to the first logits after
it), `source_prefill_s` (the source reading the context), and per variant `handoff_s` (translate
every layer + native head + native tail and held-back token, up to the same logits) and `align_s`
(tokenizing and aligning the context for both models). Both models run once on a few tokens
before anything is timed. Items whose context + prompt + scored text exceed a model's window are
skipped with a message and counted.

This module knows nothing about data files, metrics or output formats.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from bridgecache.evaluation.controls import ControlScores
from bridgecache.evaluation.items import EvaluationError, PplItem
from bridgecache.evaluation.prompts import Context, Prompts
from bridgecache.evaluation.scoring import Prefix, bridged_prefix, native_prefix, score
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.gate import reading_fraction
from bridgecache.runtime.guides import blend_scores, target_guided
from bridgecache.runtime.handoff import source_guided_scores

__all__ = ["Variant", "ItemResult", "Evaluation", "evaluate", "ControlScores"]


GUIDED = ("source", "target", "source+target")  # refresh_by values resolved per item from its prompt


@dataclass(frozen=True)
class Variant:
    """A bridge applied with given native compute (see BridgedCache).

    native_layers: int, tuple of layers, "all" or None; refresh: fraction or token count;
    refresh_by: "deviation", "source" (the source reads the item's prompt over its own cache; ppl
    items have none, so the context's last tokens read it), "target" (the target reads the
    prompt over the translated cache) or "source+target" (both, each normalised to sum 1);
    min_quality: the quality gate.
    """

    bridge: object
    native_head: int = 1
    native_tail: int = 0
    key_norm: bool = True
    native_layers: object = None
    refresh: float | int | None = None
    refresh_by: str = "deviation"
    min_quality: float | None = None
    refresh_spread: int = 0  # source-guided: scores reach this many neighbours (spans)
    refresh_last: int | None = None  # source-guided: only the prompt's last this many tokens look
    refresh_reduce: str | None = None  # source-guided: "sum" or "max" (None: handoff's default)
    refresh_after: int | None = None  # source-guided: scores reach this many following tokens
    label: str | None = None  # told apart from other bridges of the same method (e.g. a tag)

    @property
    def name(self) -> str:
        name = f"{self.bridge.method} head={self.native_head} tail={self.native_tail}"
        if self.label:
            name = f"{self.label}: {name}"
        if self.native_layers is not None:
            name += f" layers={self.native_layers}"
        if self.refresh:
            name += f" refresh={self.refresh}:{self.refresh_by}"
            name += f" spread={self.refresh_spread}" if self.refresh_spread else ""
            name += f" last={self.refresh_last}" if self.refresh_last else ""
            name += f" reduce={self.refresh_reduce}" if self.refresh_reduce is not None else ""
            name += f" after={self.refresh_after}" if self.refresh_after is not None else ""
        if self.min_quality is not None:
            name += f" min_quality={self.min_quality}"
        return name if self.key_norm else name + " key_norm=off"

    def cache_options(self) -> dict:
        """BridgedCache keywords of this variant (guided refresh_by is resolved per item)."""
        options = dict(
            native_head=self.native_head,
            native_tail=self.native_tail,
            key_norm=self.key_norm,
            native_layers=self.native_layers,
            refresh=self.refresh,
            min_quality=self.min_quality,
        )
        if self.refresh_by not in GUIDED:
            options["refresh_by"] = self.refresh_by
        return options


@dataclass
class ItemResult:
    """One evaluated item.

    scores: condition -> per scored string (sum of log p, tokens). Conditions: "native",
        "no_context", "other_native", and "bridged[NAME]" / "other_bridged[NAME]" per variant.
    context_tokens / source_tokens: the context's length in each model's own tokenization.
    """

    index: int
    other_index: int
    context_tokens: int
    source_tokens: int
    answer: int | None
    scores: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    native_prefill_s: float = 0.0
    source_prefill_s: float = 0.0
    handoff_s: dict[str, float] = field(default_factory=dict)
    align_s: dict[str, float] = field(default_factory=dict)
    native_cost: dict[str, float] = field(default_factory=dict)  # handoff FLOPs / native prefill FLOPs
    guide_cost: dict[str, float] = field(default_factory=dict)  # choosing refreshed tokens, same unit
    fallback: dict[str, str | None] = field(default_factory=dict)  # the quality gate's reason, if any


@dataclass
class Evaluation:
    """Results of every evaluated item; `skipped` holds (item index, reason)."""

    task: str
    variants: list[Variant]
    items: list[ItemResult]
    skipped: list[tuple[int, str]]


class _Prefixes:
    """Source KV and native target prefixes of the last few contexts, with the seconds their first
    computation took: context i is also the unrelated context of item i - 1, so it is computed once."""

    def __init__(self, source, target, size: int = 4):
        self.source, self.target, self.size = source, target, size
        self.entries: OrderedDict = OrderedDict()

    def _get(self, key, compute):
        if key not in self.entries:
            start = time.perf_counter()
            value = compute()
            self.entries[key] = (value, time.perf_counter() - start)
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return self.entries[key]

    def source_kv(self, ids: torch.Tensor):
        """(CapturedKV of the source over ids [1, S], seconds): read only, so shared as is."""
        return self._get(("source", _key(ids)), lambda: capture_kv(self.source, ids))

    def native(self, ids: torch.Tensor) -> tuple[Prefix, float]:
        """(a fresh copy of the target's native prefix of ids [1, T], seconds of the prefill)."""
        prefix, seconds = self._get(("target", _key(ids)), lambda: native_prefix(self.target, ids))
        return prefix.copy(), seconds


def _window(model) -> int:
    return int(model.config.get_text_config().max_position_embeddings)


def _key(ids: torch.Tensor) -> tuple[int, ...]:
    return tuple(ids.reshape(-1).tolist())


@dataclass
class _Prepared:
    """An item's target-side ids: context, prompt after it, scored strings."""

    context: Context
    prompt: list[int]
    scored: list[list[int]]

    def rows(self, prompt: list[int] | None = None) -> list[list[int]]:
        """What follows a context: the prompt then each scored string."""
        prompt = self.prompt if prompt is None else prompt
        return [prompt + s for s in self.scored]


def _prepare(items, prompts: Prompts, bridge, source, target, log) -> tuple[dict[int, _Prepared], list]:
    """Tokenize every item; skip (and report) those longer than a model's window."""
    prepared, skipped = {}, []
    for i, item in enumerate(items):
        p = _Prepared(prompts.context(item.context, bridge), prompts.prompt(item), prompts.scored(item))
        target_total = p.context.target_ids.shape[1] + len(p.prompt) + max(map(len, p.scored))
        source_total = p.context.source_ids.shape[1]
        reason = None
        if target_total > _window(target):
            reason = f"{target_total} target tokens exceed the target's window of {_window(target)}"
        elif source_total > _window(source):
            reason = f"{source_total} source tokens exceed the source's window of {_window(source)}"
        if reason:
            log(f"item {i}: {reason}; skipped")
            skipped.append((i, reason))
        else:
            prepared[i] = p
    return prepared, skipped


@torch.no_grad()
def evaluate(
    source,
    source_tokenizer,
    target,
    target_tokenizer,
    items: list,
    task: str,
    variants: list[Variant],
    *,
    chat: bool = False,
    progress: bool = True,
    log=None,
    controls: ControlScores | None = None,
) -> Evaluation:
    """Score `items` under every condition; see the module docstring.

    source, target: transformers causal LMs (the bridges' source and target).
    items: PplItem (task "ppl") or ChoiceItem (task "choice") objects.
    log: where skip messages go (default: stderr).
    controls: a `ControlScores` file that remembers the native, no-context and unrelated-context
        scores of (target, item) across runs, so that comparing variants repeats only bridged work.
    """
    log = log or (lambda message: print(message, file=sys.stderr))
    if not variants:
        raise ValueError("give at least one variant (a bridge and its native anchors)")
    prompts = Prompts(source_tokenizer, target_tokenizer, chat)
    prepared, skipped = _prepare(items, prompts, variants[0].bridge, source, target, log)
    controls = controls if controls is not None else ControlScores(None)
    if len(prepared) < 2:
        raise EvaluationError(
            f"{len(prepared)} of {len(items)} items fit the models' windows; the evaluation needs at least "
            "2 (the unrelated-context control reads another item's context)"
        )
    _warm_up(source, target)
    run = _ItemRun(task, variants, prompts, _Prefixes(source, target), target, controls)
    order = sorted(prepared)
    results = []
    for position, i in enumerate(tqdm(order, desc="eval", disable=not progress)):
        j = order[(position + 1) % len(order)]
        results.append(run(i, items[i], prepared[i], j, items[j]))
    return Evaluation(task, list(variants), results, skipped)


@dataclass
class _ItemRun:
    """Scores one item under every condition."""

    task: str
    variants: list[Variant]
    prompts: Prompts
    prefixes: _Prefixes
    target: object
    controls: ControlScores

    def __call__(self, i: int, item, own: _Prepared, j: int, other_item) -> ItemResult:
        prompts, target = self.prompts, self.target
        result = ItemResult(
            index=i,
            other_index=j,
            context_tokens=own.context.target_ids.shape[1],
            source_tokens=own.context.source_ids.shape[1],
            answer=None if isinstance(item, PplItem) else item.answer,
        )
        source_kv, result.source_prefill_s = self.prefixes.source_kv(own.context.source_ids)
        # The unrelated context: the other item's, cut to this one's length in target tokens.
        other_text = prompts.cut(other_item.context, prompts.content_length(item.context))
        other_prompt = prompts.prompt(item, other_text)
        other = prompts.context(other_text, self.variants[0].bridge)
        key = self.controls.key(
            target, own.context.target_ids, own.rows(), other.target_ids, prompts.bare(item)
        )
        known = self.controls.get(key)
        if known is not None:
            result.native_prefill_s = known.pop("native_prefill_s")
            result.scores |= {name: [tuple(x) for x in rows] for name, rows in known.items()}
        else:
            native, result.native_prefill_s = self.prefixes.native(own.context.target_ids)
            result.scores["native"] = score(target, native, own.rows(), len(own.prompt))
            bare = native_prefix(target, torch.tensor([prompts.bare(item)]))
            result.scores["no_context"] = score(target, bare, own.scored)
            other_native, _ = self.prefixes.native(other.target_ids)
            result.scores["other_native"] = score(
                target, other_native, own.rows(other_prompt), len(other_prompt)
            )
            self.controls.put(key, {**result.scores, "native_prefill_s": result.native_prefill_s})

        for variant in self.variants:
            start = time.perf_counter()
            context = prompts.context(item.context, variant.bridge)
            result.align_s[variant.name] = time.perf_counter() - start
            prefix = self._bridged(variant, context, item)
            result.handoff_s[variant.name] = prefix.seconds
            report = prefix.cache.report()
            result.native_cost[variant.name] = report.native_cost_fraction
            result.guide_cost[variant.name] = report.guide_cost_fraction + self._source_reading(
                variant, context, item
            )
            result.fallback[variant.name] = report.fallback
            result.scores[f"bridged[{variant.name}]"] = score(target, prefix, own.rows(), len(own.prompt))
            if self.task == "ppl":
                prefix = self._bridged(variant, prompts.context(other_text, variant.bridge), item)
                result.scores[f"other_bridged[{variant.name}]"] = score(
                    target, prefix, own.rows(other_prompt), len(other_prompt)
                )
        return result

    def _source_reading(self, variant: Variant, context: Context, item) -> float:
        """FLOPs share of the source reading the prompt for a source-guided refresh (0 if none)."""
        if not (variant.refresh and variant.refresh_by in ("source", "source+target")):
            return 0.0
        query = len(self.prompts.source_prompt(item)) or min(16, context.source_ids.shape[1] - 1)
        return reading_fraction(
            self.prefixes.source.config,
            query,
            context.source_ids.shape[1],
            self.target.config,
            context.target_ids.shape[1],
        )

    def _bridged(self, variant: Variant, context: Context, item) -> Prefix:
        source_kv, _ = self.prefixes.source_kv(context.source_ids)
        guide = None
        by = variant.refresh_by if variant.refresh else None
        if by in ("source", "source+target"):
            query = torch.tensor([self.prompts.source_prompt(item)], dtype=torch.long)

            def from_source():
                return source_guided_scores(
                    source=self.prefixes.source,
                    source_cache=source_kv,
                    alignment=context.alignment,
                    target_ids=context.target_ids,
                    source_ids=context.source_ids,
                    query_ids=query,
                    spread=variant.refresh_spread,
                    last_queries=variant.refresh_last,
                    reduce=variant.refresh_reduce,
                    after=variant.refresh_after,
                )

            guide = from_source
        if by in ("target", "source+target"):
            scorer = target_guided(
                torch.tensor([self.prompts.prompt(item)], dtype=torch.long), variant.refresh_last
            )
            guide = (lambda: scorer) if by == "target" else (lambda: blend_scores(from_source(), scorer))

        return bridged_prefix(
            variant.bridge,
            source_kv,
            self.target,
            context.target_ids,
            context.alignment,
            guide=guide,
            **variant.cache_options(),
        )


def _warm_up(*models) -> None:
    """One small forward per model: the first call pays one-off costs that must not be timed."""
    for model in models:
        device = model.get_input_embeddings().weight.device
        model(input_ids=torch.ones(1, 8, dtype=torch.long, device=device))
