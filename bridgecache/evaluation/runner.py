"""Run an evaluation: every condition for every item, with the work they share done once.

Conditions per item, each scoring the same target tokens (the continuation, or every choice):
    native         the target prefills the context itself
    no_context     the target reads only the bare prompt (see prompts.py)
    other_native   the target prefills ANOTHER item's context (the next item that is not skipped),
                   cut to this context's length in target tokens (its whole text if shorter)
    bridged        per variant: the source's KV of the context, translated by the variant's bridge
    other_bridged  per variant, ppl only: the same for the other item's (cut) context
and the extra arms asked for (`arms=`; evaluation.arms says what each feeds the target): the source
alone, and per variant translation only, the chosen tokens alone, the wrong document's source KV
and a random map (choice and ppl tasks).
A `Variant` is a bridge with its native-anchor options, so several bridges share one pass over the
data: the source prefill, the target's native prefills and the controls are computed once.

Generation items (task "generate") are answered instead: a greedy reply after native prefill,
after no context, after the target's prefill of another item's context (`others`, or the next
item evaluated; none when one item is evaluated alone) and after each variant's bridged cache
(evaluation.decoding); the replies are kept as text (`ItemResult.replies`, scored by evaluation.answers), with
the CPU seconds of each prefill and handoff (`cpu_s`, process time) and the refreshed columns.

Timings per item: `native_prefill_s` (target prefill of the context up to the first logits after
it), `source_prefill_s` (the source reading the context), and per variant `handoff_s` (translate
every layer + native head + native tail and held-back token, up to the same logits) and `align_s`
(tokenizing and aligning the context for both models, and finding its words when the variant's
refresh takes whole words). Both models run once on a few tokens before anything is timed. Items
whose context + prompt + scored text exceed a model's window are skipped with a message and
counted.

This module knows nothing about data files, metrics or output formats.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from bridgecache.evaluation.arms import check_arms, chosen_columns, score_arms, source_alone
from bridgecache.evaluation.controls import ControlScores
from bridgecache.evaluation.decoding import reply_ids, stop_ids
from bridgecache.evaluation.items import EvaluationError, GenerationItem, PplItem
from bridgecache.evaluation.prompts import Context, Prompts
from bridgecache.evaluation.scoring import Prefix, bridged_prefix, native_prefix, score
from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.engine import HandoffEngine

__all__ = ["Variant", "ItemResult", "Evaluation", "evaluate", "ControlScores"]


@dataclass(frozen=True)
class Variant:
    """A bridge applied with a `HandoffConfig` (what the target computes itself; see BridgedCache).

    label: tells it apart in tables (default: the bridge's method and what the config changes).
    """

    bridge: object
    config: HandoffConfig = field(default_factory=HandoffConfig)
    label: str | None = None

    @property
    def name(self) -> str:
        name = f"{self.bridge.method} {self.config.label}"
        return f"{self.label}: {name}" if self.label else name


@dataclass
class ItemResult:
    """One evaluated item.

    scores: condition -> per scored string (sum of log p, tokens). Conditions: "native",
        "no_context", "other_native", "source_alone" (its own tokens), and per variant
        "bridged[NAME]" / "other_bridged[NAME]", and the extra arms "translation[NAME]",
        "chosen_only[NAME]", "wrong_document[NAME]", "random_map[NAME]" (evaluation.arms).
    context_tokens / source_tokens: the context's length in each model's own tokenization.
    """

    index: int
    other_index: int | None  # the unrelated context's item; None: none, or the caller's (`others`)
    context_tokens: int
    source_tokens: int
    answer: int | tuple[str, ...] | None  # choice: the index; generate: the answers
    scores: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    replies: dict[str, str] = field(default_factory=dict)  # generate: condition -> reply text
    cpu_s: dict[str, float] = field(default_factory=dict)  # generate: process seconds per stage
    refreshed: dict[str, list[int]] = field(default_factory=dict)  # the refresh's columns (first row)
    native_prefill_s: float = 0.0
    source_prefill_s: float = 0.0
    handoff_s: dict[str, float] = field(default_factory=dict)
    align_s: dict[str, float] = field(default_factory=dict)
    native_cost: dict[str, float] = field(default_factory=dict)  # handoff FLOPs / native prefill FLOPs
    guide_cost: dict[str, float] = field(default_factory=dict)  # choosing refreshed tokens, same unit
    fallback: dict[str, str | None] = field(default_factory=dict)  # the quality gate's reason, if any
    chosen_share: dict[str, float] = field(default_factory=dict)  # chosen_only: columns read / context


@dataclass
class Evaluation:
    """Results of every evaluated item; `skipped` holds (item index, reason)."""

    task: str
    variants: list[Variant]
    items: list[ItemResult]
    skipped: list[tuple[int, str]]
    arms: tuple[str, ...] = ()  # the extra arms computed (evaluation.arms.EXTRA_ARMS)


class _Prefixes:
    """Source KV and native target prefixes of the last few contexts, with the seconds their first
    computation took: context i is also the unrelated context of item i - 1, so it is computed once."""

    def __init__(self, source, target, size: int = 4):
        self.source, self.target, self.size = source, target, size
        self.entries: OrderedDict = OrderedDict()
        self.engines: dict = {}  # id(bridge) -> (bridge, HandoffEngine): each variant's plans and graphs

    def engine(self, bridge) -> HandoffEngine:
        """The evaluation's engine of `bridge` over its source and target (built once per bridge)."""
        known = self.engines.get(id(bridge))
        if known is None or known[0] is not bridge:
            known = self.engines[id(bridge)] = (bridge, HandoffEngine(bridge, self.source, self.target))
        return known[1]

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
        """(SourceKV of the source over ids [1, S], seconds): read only, so shared as is."""
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
        reply = max(map(len, p.scored), default=0) + getattr(item, "max_new_tokens", 0)
        target_total = p.context.target_ids.shape[1] + len(p.prompt) + reply
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
    others: list | None = None,
    arms=None,
) -> Evaluation:
    """Score `items` under every condition; see the module docstring.

    source, target: transformers causal LMs (the bridges' source and target).
    items: PplItem (task "ppl"), ChoiceItem ("choice") or GenerationItem ("generate") objects.
    log: where skip messages go (default: stderr).
    controls: a `ControlScores` file that remembers the native, no-context and unrelated-context
        scores of (target, item) across runs, so that comparing variants repeats only bridged work.
    others: generation only, one item per item of `items` whose context is that item's unrelated
        context (so one item evaluated alone still gets the control); default: the next item
        evaluated.
    arms: the extra arms to compute besides native, bridged, no context and unrelated context
        (evaluation.arms.EXTRA_ARMS): None, "all" (every one the task allows) or a list of names;
        a name the task cannot take is a ValueError before any model runs.
    """
    if others is not None and (task != "generate" or len(others) != len(items)):
        raise ValueError(
            f"others: {len(others)} items for {len(items)} items of task {task!r}; expected one per item, "
            "and only for generation tasks"
        )
    log = log or (lambda message: print(message, file=sys.stderr))
    if not variants:
        raise ValueError("give at least one variant (a bridge and its native anchors)")
    prompts = Prompts(source_tokenizer, target_tokenizer, chat)
    extra = check_arms(arms, task, prompts.same, chat)
    prepared, skipped = _prepare(items, prompts, variants[0].bridge, source, target, log)
    controls = controls if controls is not None else ControlScores(None)
    # generation works on one item (its unrelated control is then skipped); the others need two
    needed, why = (
        (1, "")
        if task == "generate"
        else (2, " (the unrelated-context control reads another item's context)")
    )
    if len(prepared) < needed:
        raise EvaluationError(
            f"{len(prepared)} of {len(items)} items fit the models' windows; the evaluation needs at least "
            f"{needed}{why}"
        )
    _warm_up(source, target)
    prefixes = _Prefixes(source, target, size=1 if task == "generate" else 4)  # generate reads each once
    run = _ItemRun(task, variants, prompts, prefixes, target, controls, extra)
    order = sorted(prepared)
    results = []
    for position, i in enumerate(tqdm(order, desc="eval", disable=not progress)):
        j = _next_other(items, order, position)
        if others is None:
            results.append(run(i, items[i], prepared[i], j, items[j]))
        else:  # the caller's item: no index among those evaluated
            results.append(run(i, items[i], prepared[i], None, others[i]))
    return Evaluation(task, list(variants), results, skipped, extra)


@dataclass
class _ItemRun:
    """Scores one item under every condition."""

    task: str
    variants: list[Variant]
    prompts: Prompts
    prefixes: _Prefixes
    target: object
    controls: ControlScores
    arms: tuple[str, ...] = ()
    random_bridges: dict = field(default_factory=dict)  # id(bridge) -> its random map (made once)

    def __call__(self, i: int, item, own: _Prepared, j: int | None, other_item) -> ItemResult:
        prompts, target = self.prompts, self.target
        result = ItemResult(
            index=i,
            other_index=j,
            context_tokens=own.context.target_ids.shape[1],
            source_tokens=own.context.source_ids.shape[1],
            answer=None if isinstance(item, (PplItem, GenerationItem)) else item.answer,
        )
        if isinstance(item, GenerationItem):
            unrelated = other_item if other_item.context != item.context else None
            if unrelated is None:
                result.other_index = None
            return self._generate(item, own, result, unrelated)
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
        if "source_alone" in self.arms:
            result.scores["source_alone"] = source_alone(self.prefixes.source, self.prompts, item, own)

        for variant in self.variants:
            start = time.perf_counter()
            context = prompts.context(item.context, variant.bridge, words=variant.config.wants_words)
            result.align_s[variant.name] = time.perf_counter() - start
            prefix = self.bridged(variant, context, item)
            result.handoff_s[variant.name] = prefix.seconds
            report = prefix.cache.report()
            result.native_cost[variant.name] = report.native_cost_fraction
            result.guide_cost[variant.name] = report.guide_cost_fraction
            result.fallback[variant.name] = report.fallback
            result.refreshed[variant.name] = prefix.cache.refreshed_columns[0].tolist()
            columns = None
            if "chosen_only" in self.arms:  # before scoring: the score's forward extends the cache
                columns = chosen_columns(prefix.cache, result.context_tokens)
            result.scores[f"bridged[{variant.name}]"] = score(target, prefix, own.rows(), len(own.prompt))
            score_arms(self, variant, context, item, own, other_item, columns, result)
            if self.task == "ppl":
                other = prompts.context(other_text, variant.bridge, words=variant.config.wants_words)
                prefix = self.bridged(variant, other, item)
                result.scores[f"other_bridged[{variant.name}]"] = score(
                    target, prefix, own.rows(other_prompt), len(other_prompt)
                )
        return result

    def _generate(self, item: GenerationItem, own: _Prepared, result: ItemResult, other_item) -> ItemResult:
        """Greedy replies after native prefill, no context, the unrelated context (`other_item`'s,
        cut to this context's length; skipped when None) and each variant's bridged cache."""
        prompts, target, tok = self.prompts, self.target, self.prompts.target_tok
        result.answer = item.answers
        stop = stop_ids(tok)

        def reply(prefix: Prefix, prompt: list[int]) -> str:
            one_line = len(item.answers) == 1
            ids = reply_ids(
                target, prefix, prompt, item.max_new_tokens, stop=stop, tokenizer=tok, one_line=one_line
            )
            return tok.decode(ids, skip_special_tokens=True)

        clock = time.process_time()
        _, result.source_prefill_s = self.prefixes.source_kv(own.context.source_ids)
        result.cpu_s["source_prefill"] = time.process_time() - clock
        bare = prompts.bare(item)
        key = self.controls.key(
            target, own.context.target_ids, own.prompt, bare, [item.max_new_tokens, len(item.answers)]
        )
        known = self.controls.get(key)
        if known is None:
            clock = time.process_time()
            native = native_prefix(target, own.context.target_ids)
            known = {"native_prefill_s": native.seconds, "native_prefill_cpu_s": time.process_time() - clock}
            replies = {"native": reply(native, own.prompt)}
            replies["no_context"] = reply(native_prefix(target, torch.tensor([bare])), [])
            self.controls.put(key, known | {"replies": replies})
            known["replies"] = replies
        result.native_prefill_s = known["native_prefill_s"]
        result.cpu_s["native_prefill"] = known["native_prefill_cpu_s"]
        result.replies |= known["replies"]
        if other_item is not None:
            # Its own entry: the native and no-context replies stay valid whatever the other is.
            other_text = prompts.cut(other_item.context, prompts.content_length(item.context))
            other_ids = prompts.context(other_text, self.variants[0].bridge).target_ids
            limits = [item.max_new_tokens, len(item.answers)]
            key = self.controls.key(target, other_ids, own.prompt, "unrelated", limits)
            unrelated = self.controls.get(key)
            if unrelated is None:
                unrelated = {"reply": reply(native_prefix(target, other_ids), own.prompt)}
                self.controls.put(key, unrelated)
            result.replies["other_native"] = unrelated["reply"]
        for variant in self.variants:
            start = time.perf_counter()
            context = prompts.context(item.context, variant.bridge, words=variant.config.wants_words)
            result.align_s[variant.name] = time.perf_counter() - start
            clock = time.process_time()
            prefix = self.bridged(variant, context, item)
            result.cpu_s[f"handoff[{variant.name}]"] = time.process_time() - clock
            result.handoff_s[variant.name] = prefix.seconds
            report = prefix.cache.report()
            result.native_cost[variant.name] = report.native_cost_fraction
            result.guide_cost[variant.name] = report.guide_cost_fraction
            result.fallback[variant.name] = report.fallback
            result.refreshed[variant.name] = prefix.cache.refreshed_columns[0].tolist()
            result.replies[f"bridged[{variant.name}]"] = reply(prefix, own.prompt)
        return result

    def bridged(
        self, variant: Variant, context: Context, item, *, bridge=None, source_ids=None, config=None
    ) -> Prefix:
        """The variant's bridged prefix of `context`; an arm may swap the bridge (a random map),
        the source ids the map reads (another document's) or the config (translation only)."""
        bridge = variant.bridge if bridge is None else bridge
        config = variant.config if config is None else config
        source_ids = context.source_ids if source_ids is None else source_ids
        source_kv, _ = self.prefixes.source_kv(source_ids)
        prompt = torch.tensor([self.prompts.source_prompt(item)], dtype=torch.long)
        return bridged_prefix(
            bridge,
            source_kv,
            self.target,
            context.target_ids,
            context.alignment,
            config=config,
            source_model=self.prefixes.source,
            prompt_ids=prompt,
            words=context.words,
            engine=self.prefixes.engine(bridge),
        )


def _next_other(items, order: list[int], position: int) -> int:
    """The next evaluated item after order[position] whose context is another text (several
    questions may share one context); the next item itself when every context is the same."""
    own = items[order[position]].context
    for step in range(1, len(order)):
        j = order[(position + step) % len(order)]
        if items[j].context != own:
            return j
    return order[(position + 1) % len(order)]


def _warm_up(*models) -> None:
    """One small forward per model: the first call pays one-off costs that must not be timed."""
    for model in models:
        device = model.get_input_embeddings().weight.device
        model(input_ids=torch.ones(1, 8, dtype=torch.long, device=device))
