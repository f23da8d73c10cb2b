"""The plan of one handoff: decided once, frozen, then only read.

    plan = plan_handoff(bridge, source_kv, target, target_ids, config=..., engine=...)
    cache = BridgedCache.from_plan(plan)                 # what HandoffEngine.cache does

`plan_handoff` checks its inputs, builds the `Translator` (the context's layout: which source row
feeds each cached column, the native head, the prefix; bridgecache.runtime.translation) and decides,
in order: the cost gate (bridgecache.runtime.route: the handoff, or the target's own prefill of
the whole context where that reaches the first token sooner); the quality gate (layers scoring
below `min_quality` run natively, or the whole context falls back to the target's own prefill).
Either native route ends the plan there: nothing is translated or computed, the cache starts
empty and the target's first forward is its own prefill of the whole context. Otherwise:
layers a selection rule needs natively; those layers' exact KV (one forward stopped after the
deepest, bridgecache.runtime.native_work.layers); the refresh budget per row and the selection
rule's scores (pooled over the target's words when the refresh takes whole words:
bridgecache.runtime.selection.words); then the pending columns (native head, columns without
source text, the budget's best) that the target's first forward computes
(bridgecache.runtime.native_work.forward), the groups of layers translated in one launch, and
the report of it all. This is where a handoff runs models before generate(): the native layers'
forward and the selection rule's reading.

The result is a `HandoffPlan`, frozen: the cache, the native-work pass and the publishers read
it (`layer`, `columns`) and never write it back. Who builds it: `HandoffEngine.plan` (and the
low-level `BridgedCache(...)` constructor, for a throwaway plan of its own); who holds it: the
caches built from it; freed with the last of them.

Knows the translator's layout, the config and the selection rules; runs no generate().
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from bridgecache.kv.files import as_source
from bridgecache.models.layout import check_supported
from bridgecache.models.spec import model_spec
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.gate import GateDecision, layer_scores
from bridgecache.runtime.inputs import check_arguments, check_config, check_engine, selector_layers
from bridgecache.runtime.native_work.layers import native_layer_kv, resolve_native_layers
from bridgecache.runtime.native_work.pending import PendingPlan, PendingWork, mass_budgets, refresh_budget
from bridgecache.runtime.report import HandoffReport, handoff_flops, prefill_flops
from bridgecache.runtime.route import RouteDecision, decide_route
from bridgecache.runtime.selection.reading import SourceReader
from bridgecache.runtime.selection.rules import SelectionRequest, checked_scores
from bridgecache.runtime.selection.words import word_ranking
from bridgecache.runtime.state import EngineState
from bridgecache.runtime.translation.grouped import LayerGroups, groups_apply
from bridgecache.runtime.translation.translator import Translator

__all__ = ["HandoffPlan", "layer_windows", "plan_handoff", "read_context", "selection_request"]

# The cache layer types transformers dispatches that a bridged cache replaces (runtime.cache).
CACHE_LAYER_TYPES = (DynamicLayer, DynamicSlidingWindowLayer)


@dataclass(frozen=True, eq=False)
class HandoffPlan:
    """The decision of one handoff, built once (`plan_handoff`) and only read from then on.

    translator: the context's layout (rows, head_end, prefix_length, windows) and its translation.
    config: the `HandoffConfig` as decided (whole_words resolved: `HandoffConfig.with_words`).
    route: the cost gate's (or the quality gate's) route; gate: the quality gate's decision.
    native_layers: target layers the target computes itself; native_kv: their (keys, values)
        [batch, kv_heads, prefix, head_dim] over the cached columns (read-only mapping).
    pending: the work of the target's first forward (None: nothing pending); always: [batch,
        prefix] bool (CPU), columns computed natively whatever the budget; budgets: refreshed
        columns per row.
    groups: `LayerGroups` when layers are translated in one launch per group, else None.
    report: for `BridgedCache.report()`.
    native_route: the whole context is left to the target's own prefill (the cost gate's or the
        quality gate's choice): nothing is translated or computed here, the cache starts empty
        (`read_context` computes it when something needs it before a forward).
    target, target_ids, state: the target model, the context's ids [batch, T] and the
        `EngineState` (the engine's, or a private one) that the plan was made for.
    """

    translator: Translator
    config: HandoffConfig
    route: RouteDecision
    gate: GateDecision
    native_layers: frozenset
    native_kv: Mapping
    pending: PendingWork | None
    always: torch.Tensor
    budgets: tuple
    groups: LayerGroups | None
    report: HandoffReport
    target: object
    target_ids: torch.Tensor
    state: EngineState
    native_route: bool = False

    def layer(self, idx: int, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [batch, tgt_heads, kept_rows, tgt_head_dim] of target layer `idx`: the
        target's own where the layer is native, a group's slice where one covers it, else
        translated now."""
        tr = self.translator
        if idx in self.native_kv:
            device = torch.device(device or tr.home_device)
            keys, values = self.native_kv[idx]
            start = tr.window_start(idx)
            return (
                keys[:, :, start:].to(device, dtype or keys.dtype),
                values[:, :, start:].to(device, dtype or values.dtype),
            )
        home = (torch.device(device or tr.home_device), dtype or tr.home_dtype) == (
            tr.home_device,
            tr.home_dtype,
        )
        if home and self.groups is not None and self.groups.covers(idx):
            return self.groups.layer(idx)
        return tr.translate(idx, device, dtype)

    def columns(self, idx: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [batch, tgt_heads, stop - start, tgt_head_dim] of target layer `idx` for
        context columns [start, stop), also those a sliding-window layer no longer keeps (a
        refreshed token's window reads them); the target's own where the layer is native."""
        if idx in self.native_kv:
            keys, values = self.native_kv[idx]
            return keys[:, :, start:stop], values[:, :, start:stop]
        groups, tr = self.groups, self.translator
        if (
            groups is not None
            and groups.covers(idx)
            and (start, stop) == (groups.start(idx), tr.prefix_length)
        ):
            return groups.layer(idx)
        return tr.translate(idx, start=start, stop=stop)

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


def layer_windows(config) -> list[int | None]:
    """Per target layer, its sliding window or None, from the cache layers transformers'
    `DynamicCache(config=...)` dispatches for `config`; any type a bridged cache cannot replace
    (linear attention, indexed, shared-KV dummies) raises ValueError by name."""
    check_supported(config)  # an architecture no bridge translates exactly: refused by name
    windows = []
    for i, layer in enumerate(DynamicCache(config=config).layers):
        if type(layer) not in CACHE_LAYER_TYPES:
            raise ValueError(
                f"target layer {i} is a {type(layer).__name__} cache layer; BridgedCache supports "
                f"{sorted(t.__name__ for t in CACHE_LAYER_TYPES)}"
            )
        windows.append(getattr(layer, "sliding_window", None))
    return windows


def plan_handoff(
    bridge,
    source_kv,
    target,
    target_ids: torch.Tensor,
    *,
    config: HandoffConfig | None = None,
    alignment=None,
    target_attention_mask: torch.Tensor | None = None,
    source_attention_mask: torch.Tensor | None = None,
    source_model=None,
    prompt_ids: torch.Tensor | None = None,
    words=None,
    engine=None,
) -> HandoffPlan:
    """The `HandoffPlan` of one context (`BridgedCache`'s arguments, checked here before any
    work; engine: the `HandoffEngine` whose state to use, None: a private one)."""
    config = check_config(config)
    check_arguments(
        bridge, target, target_ids, target_attention_mask, source_model, prompt_ids, words, alignment,
        source_attention_mask,
    )  # fmt: skip
    if engine is not None:
        check_engine(engine, bridge, target, source_model)
    selector_layers(config, bridge.target.num_layers)  # a custom rule's answer, before any work
    source_kv = as_source(source_kv, source_attention_mask)
    source_kv.check(bridge.source, bridge.fingerprints.get("source"))  # shapes; the KV's model, if recorded
    if words is not None and words.source.shape != (source_kv.batch_size, source_kv.num_tokens):
        raise ValueError(
            f"words.source has shape {tuple(words.source.shape)}; expected one group per source KV "
            f"row [{source_kv.batch_size}, {source_kv.num_tokens}] (words of another context?)"
        )
    windows = layer_windows(target.config)
    if prompt_ids is not None and source_model is not None:  # on its device before any work is queued
        prompt_ids = prompt_ids.to(source_model.get_input_embeddings().weight.device, non_blocking=True)
    if words is not None:  # likewise: a copy from the host later would wait for the queued work
        words = words.to(target.get_input_embeddings().weight.device)
    config = config.with_words(words is not None)
    if engine is not None:
        state = engine.state
    else:  # a private state: the target's spec is checked here, as an engine checks it once
        bridge.target.check(model_spec(target), "target")
        state = EngineState(bridge, source_model, target, graph_bytes=0)
    translator = Translator(
        bridge, source_kv, target, target_ids, target_mask=target_attention_mask, alignment=alignment,
        config=config, windows=windows, state=state,
    )  # fmt: skip
    return plan_native_work(translator, target, target_ids, config, source_model, prompt_ids, words)


def selection_request(
    tr, target, target_ids, source_model, prompt_ids, words=None, graphs: bool = False, native_kv=None
) -> SelectionRequest:
    """The read-only view a selection rule gets of one context (translator `tr`; native_kv: the
    target's own (keys, values) of its native layers)."""
    reader = None if source_model is None else SourceReader(tr.state, source_model, tr.reading_source, graphs)
    native_kv = {} if native_kv is None else native_kv
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
            tr.translate(layer, start=0)[0] if translated else native_kv[layer][0]
        ),
    )


def plan_native_work(tr, target, target_ids, config, source_model, prompt_ids, words=None) -> HandoffPlan:
    """Decide and prepare the native work of one context (see the module docstring); `words`: the
    context's `ContextWords`, read only under `RefreshConfig(whole_words=True)` (decided already:
    `HandoffConfig.with_words`)."""
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
    parts = dict(
        translator=tr, config=config, route=route, gate=decision, target=target, target_ids=target_ids,
        state=tr.state,
    )  # fmt: skip
    if decision.fallback:  # the native route: the target's own prefill, in its first forward
        native = set(range(num_layers))
        always = torch.zeros_like(real)
        budgets = (0,) * len(real)
        report = _report(tr, target, native, scores, decision.fallback, budgets, None, 0.0, always)
        report.route, report.route_reason = route.route, route.reason
        return HandoffPlan(
            **parts, native_layers=frozenset(), native_kv=MappingProxyType({}), pending=None,
            always=always, budgets=budgets, groups=None, report=report, native_route=True,
        )  # fmt: skip
    all_native = len(native) == num_layers
    refresh = config.refresh if not all_native and tr.bridge.method != "identity" else None
    selector = refresh.selector if refresh is not None else None
    words = words if refresh is not None and refresh.whole_words else None
    if selector is not None:  # checked: a custom rule's answer is the caller's input
        native |= set(selector_layers(config, num_layers))
    native_kv = read_context(tr, target, target_ids, native)
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
        request = selection_request(
            tr, target, target_ids, source_model, prompt_ids, words, graphs, native_kv
        )
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
    groups = None
    if groups_apply(tr, target, config.one_launch):  # every column when the pass will read them all
        groups = LayerGroups(tr, native, whole=pending is not None)
    guide = selector.reading_flops(request) if any(budgets) else 0.0
    report = _report(tr, target, native, scores, decision.fallback, budgets, refresh, guide, always)
    report.route, report.route_reason = route.route, route.reason
    if config.refresh is not None and tr.bridge.method == "identity":
        report.notes.append("no refresh: an identity bridge translates exactly")
    if config.key_norm and tr.bridge.method == "identity" and tr.state.key_norm_scales() is not None:
        report.notes.append("no key-norm projection: an identity bridge's keys are the target's own")
    return HandoffPlan(
        **parts, native_layers=frozenset(native), native_kv=MappingProxyType(native_kv), pending=pending,
        always=always, budgets=tuple(budgets), groups=groups, report=report,
    )  # fmt: skip


def read_context(tr, target, target_ids, layers) -> dict:
    """{layer: (keys, values)} the target's own KV of the context (`target_ids` [batch, tokens],
    its first `tr.prefix_length` columns) at `layers`: what those layers hold instead of a
    translation."""
    prefix = tr.prefix_length
    return native_layer_kv(target, target_ids[:, :prefix], tr.target_mask[:, :prefix], layers)


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
