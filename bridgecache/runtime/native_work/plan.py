"""What the target computes itself over a bridged context, decided once per cache.

    plan = plan_native_work(translator, target, target_ids, config, source_model, prompt_ids, groups, words)

In order: the cost gate (bridgecache.runtime.route: the handoff, or the target's own prefill of
the whole context where that reaches the first token sooner); the quality gate (layers scoring
below `min_quality` run natively, or the whole context falls back to the target's own prefill).
Either native route ends the plan there: nothing is translated or computed, the cache starts
empty and the target's first forward is its own prefill of the whole context. Otherwise:
layers a selection rule needs natively; those layers' exact KV (one forward stopped after the
deepest, bridgecache.runtime.native_work.layers); the refresh budget per row and the selection
rule's scores (pooled over the target's words when the refresh takes whole words:
bridgecache.runtime.selection.words); then the pending columns (native head, columns without
source text, the budget's best) that the target's first forward computes
(bridgecache.runtime.native_work.forward), and the report of it all.

Knows the translator's layout, the config and the selection rules; runs no generate().
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridgecache.runtime.gate import GateDecision, layer_scores
from bridgecache.runtime.inputs import selector_layers
from bridgecache.runtime.native_work.layers import native_layer_kv, resolve_native_layers
from bridgecache.runtime.native_work.pending import PendingPlan, PendingWork, mass_budgets, refresh_budget
from bridgecache.runtime.report import HandoffReport, handoff_flops, prefill_flops
from bridgecache.runtime.route import RouteDecision, decide_route
from bridgecache.runtime.selection.reading import SourceReader
from bridgecache.runtime.selection.rules import SelectionRequest, checked_scores
from bridgecache.runtime.selection.words import word_ranking

__all__ = ["NativePlan", "plan_native_work", "read_context", "selection_request"]


def selection_request(
    tr, target, target_ids, source_model, prompt_ids, words=None, graphs: bool = False
) -> SelectionRequest:
    """The read-only view a selection rule gets of one cache (translator `tr`)."""
    reader = None if source_model is None else SourceReader(tr.state, source_model, tr.reading_source, graphs)
    return SelectionRequest(
        target_ids=target_ids,
        prefix_length=tr.prefix_length,
        reading_rows=tr.reading_rows,
        source_kv=tr.reading_source,
        prompt_ids=prompt_ids,
        words=words,
        source_config=None if source_model is None else source_model.config,
        target_config=target.config,
        _reader=reader,
        _keys=lambda layer, translated: (
            tr.translate(layer, start=0)[0] if translated else tr.native_kv[layer][0]
        ),
    )


@dataclass
class NativePlan:
    """pending: the work of the target's first forward (None: nothing pending); always: [batch,
    prefix] bool (CPU), columns computed natively whatever the budget; budgets: refreshed columns
    per row; report: for `BridgedCache.report()`; native_route: the whole context is left to the
    target's own prefill (the cost gate's or the quality gate's choice): nothing is translated or
    computed here, the cache starts empty (`read_context` computes it when something needs it
    before a forward)."""

    pending: PendingWork | None
    always: torch.Tensor
    budgets: list[int]
    report: HandoffReport
    native_route: bool = False

    def refreshed_columns(self) -> torch.Tensor:
        """[batch, max budget] int64 (CPU) the columns the refresh picked, ascending; rows with a
        smaller budget repeat their last one (reads the device: not for the hot path)."""
        top = max(self.budgets, default=0)
        if self.pending is None or not top:
            return torch.empty(len(self.budgets), 0, dtype=torch.long)
        columns = self.pending.columns.cpu()
        rows = []
        for b, budget in enumerate(self.budgets):
            chosen = [c for c in dict.fromkeys(columns[b].tolist()) if not self.always[b, c]][:budget]
            rows.append(chosen + chosen[-1:] * (top - len(chosen)) if chosen else [0] * top)
        return torch.tensor(rows, dtype=torch.long)


def plan_native_work(
    tr, target, target_ids, config, source_model, prompt_ids, make_groups, words=None
) -> NativePlan:
    """Decide and prepare the native work of one cache (see the module docstring); `words`: the
    context's `ContextWords`, read only under `RefreshConfig(whole_words=True)` (the cache has decided
    whole_words: `HandoffConfig.with_words`)."""
    num_layers = len(tr.windows)
    prefix = tr.prefix_length
    real = tr.target_mask[:, :prefix].bool()
    columns = torch.arange(prefix)[None]
    head = real & (columns < tr.head_end[:, None])
    translated = real & ~head
    has_source = tr.rows >= 0
    coverage = float((has_source & translated).sum() / translated.sum().clamp(min=1))
    scores = layer_scores(tr.bridge)
    tokens = int(tr.target_mask.sum(1).max()) if prefix else 0  # the longest row's context
    route = route_of(tr, target, config, source_model, prompt_ids, tokens)
    if route.route == "native":
        decision = GateDecision(fallback=route.reason)
    else:
        decision = config.quality.decide(scores, coverage)
        if decision.fallback:
            route = RouteDecision("native", f"the quality gate: {decision.fallback}")
    native = set(resolve_native_layers(config.native_layers, num_layers)) | set(decision.native_layers)
    if decision.fallback:  # the native route: the target's own prefill, in its first forward
        native = set(range(num_layers))
        always = torch.zeros_like(real)
        report = _report(tr, target, native, scores, decision.fallback, [0] * len(real), None, 0.0, always)
        report.route, report.route_reason = route.route, route.reason
        return NativePlan(None, always, [0] * len(real), report, native_route=True)
    all_native = len(native) == num_layers
    refresh = config.refresh if not all_native and tr.bridge.method != "identity" else None
    selector = refresh.selector if refresh is not None else None
    words = words if refresh is not None and refresh.whole_words else None
    if selector is not None:  # checked: a custom rule's answer is the caller's input
        native |= set(selector_layers(config, num_layers))
    read_context(tr, target, target_ids, native)
    eligible = translated & has_source
    budgets = [refresh_budget(refresh.amount, int(n)) if refresh else 0 for n in eligible.sum(1).tolist()]
    always = head | (translated & ~has_source)  # the native head; columns without source text
    if all_native:
        always = torch.zeros_like(always)
    pending = None
    if bool(always.any()) or any(budgets):
        # Everything the host knows goes to the device before any scoring is queued: the
        # device then never waits for a host-to-device copy between two of its own steps.
        device = tr.home_device
        plan = PendingPlan.prepare(always, eligible, budgets, device)
        ids = target_ids[:, :prefix].to(device, non_blocking=True)
        first_column = tr.target_pad.to(device, non_blocking=True)
        graphs = config.cuda_graphs
        if graphs is None:
            graphs = source_model is not None and source_model.get_input_embeddings().weight.is_cuda
        request = selection_request(tr, target, target_ids, source_model, prompt_ids, words, graphs)
        chosen_by = (
            checked_scores(selector.scores(request), len(budgets), prefix, selector) if any(budgets) else None
        )
        if chosen_by is not None and refresh.mass is not None:  # sized per row by the scores' mass
            counts = eligible.sum(1).tolist()
            floors = [min(b, refresh_budget(refresh.floor, n)) for b, n in zip(budgets, counts)]
            budgets = mass_budgets(chosen_by, eligible, refresh.mass, floors, budgets)
            plan = PendingPlan.prepare(always, eligible, budgets, device)
        if chosen_by is not None and words is not None:  # whole words on the target's side
            # padding lends nothing: a padded row picks what it picks alone
            chosen_by = word_ranking(
                chosen_by, words.target[:, :prefix], ends=refresh.word_ends, first_column=first_column
            )
        cols, valid = plan.select(chosen_by)
        pending = PendingWork(
            columns=cols,
            valid=valid,
            ids=ids.gather(1, cols),
            positions=tr.target_positions[:, :prefix].gather(1, cols),
            first_column=first_column,
        )
    if make_groups is not None:  # translated lazily; every column when the pass will read them all
        tr.groups = make_groups(pending is not None)
    guide = selector.reading_flops(request) if any(budgets) else 0.0
    report = _report(tr, target, native, scores, decision.fallback, budgets, refresh, guide, always)
    report.route, report.route_reason = route.route, route.reason
    if config.refresh is not None and tr.bridge.method == "identity":
        report.notes.append("no refresh: an identity bridge translates exactly")
    return NativePlan(pending, always, budgets, report)


def read_context(tr, target, target_ids, layers) -> None:
    """The target's own KV of the context (`target_ids` [batch, tokens], its first
    `tr.prefix_length` columns) at `layers`, handed to the translator, which gives them to those
    layers instead of translating them."""
    prefix = tr.prefix_length
    tr.native_layers = set(layers)
    tr.native_kv = native_layer_kv(target, target_ids[:, :prefix], tr.target_mask[:, :prefix], layers)


def route_of(tr, target, config, source_model, prompt_ids, tokens: int) -> RouteDecision:
    """The cost gate's decision for this cache's `tokens` context tokens (its longest row)."""
    if not tokens:
        return RouteDecision("handoff", "nothing to translate: an empty context")
    state = tr.state
    costs = state.route_costs(config) if config.route == "auto" else None
    models = (tr.bridge, None if source_model is None else source_model.config, target.config)
    prompt = 16 if prompt_ids is None else int(prompt_ids.shape[1])
    return decide_route(config, costs, tokens=tokens, prompt_tokens=prompt, models=models)


def _report(tr, target, native, scores, fallback, budgets, refresh, guide_flops, always) -> HandoffReport:
    translated_layers = [i for i in range(len(tr.windows)) if i not in native]
    quality = None
    if scores is not None:
        kept = [scores[i] for i in translated_layers]
        quality = sum(kept) / len(kept) if kept else 1.0
    context = tr.target_mask.shape[1]
    real = int(tr.target_mask[0].sum())
    pad = context - real
    head = int(always[0].sum())
    work = handoff_flops(
        target.config,
        context_tokens=real,
        prefix=tr.prefix_length - pad,
        native_prefix=head,
        native_layers=tuple(sorted(native)),
        refreshed=budgets[0],
    )
    whole = prefill_flops(target.config, real) if real else 0.0
    translated = max(0, tr.prefix_length - pad - head) if translated_layers else 0
    return HandoffReport(
        layers_translated=translated_layers,
        layers_native=sorted(native),
        tokens_translated=translated,
        tokens_native=head if translated_layers else tr.prefix_length - pad,
        tokens_refreshed=budgets[0],
        refresh_by=None if not budgets[0] else refresh.selector.name,
        estimated_quality=quality,
        fallback=fallback,
        native_cost_fraction=work / whole if whole else 0.0,
        guide_cost_fraction=guide_flops / whole if whole else 0.0,
    )
