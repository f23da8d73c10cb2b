"""HandoffEngine: one handoff setup (bridge, source, target, tokenizers, config) and what it owns.

    with HandoffEngine(bridge, source, target, source_tokenizer=s, target_tokenizer=t) as engine:
        result = engine.handoff(context, prompt, max_new_tokens=32)
        batch = engine.handoff_batch(contexts, prompt)
        cache, ids = engine.translate_context(context)            # publishing: no prompt yet
        plan = engine.plan(engine.request([context], prompt))     # the frozen HandoffPlan
        cache = BridgedCache.from_plan(plan)                      # = engine.cache(request)
        logits = engine.prefill(cache, ids[:, cache.get_seq_length():])  # scoring after a cache

Who calls what, when:
- `HandoffEngine(...)` checks the models and tokenizers against the bridge ONCE (their specs, the
  tokenizers' vocabularies, the weights' fingerprints: `ModelIdentity`, runtime/identity.py) and
  creates its `EngineState`
  (bridgecache.runtime.state): plans of the bridge's maps per device, rotary tables, key-norm
  scales, views of both models that run our attention (bridgecache.runtime.interop.views), and captured
  CUDA graphs, at most `graph_bytes` of them (least recently used dropped first).
- Each request (`handoff`, `handoff_batch`, `translate_context`; `Conversation`, the publishers
  and the evaluation runner go through these) builds one `HandoffRequest` (runtime/request.py:
  tokenized, aligned, words, the source's KV), checks its sizes against both models' windows
  before the source reads anything, runs a cheap per-request check that the weights the engine
  derived state from are unchanged, turns it into a frozen `HandoffPlan` (`plan`: route, gates,
  layout, native layers and their KV, pending work, groups, report; runtime/native_work/plan.py),
  builds a `BridgedCache` that only reads that plan (`cache`: it runs no model), and calls
  transformers' own `generate()` on a view of the target whose first forward does the cache's
  native work (runtime/native_work/forward.py).
- The cost gate (`HandoffConfig.route`, bridgecache.runtime.route): before a request with
  route="auto" builds its cache, the engine times both routes where it has not: on CUDA at the
  missing lengths of a ladder up to the request's, on the CPU at a few short calibration lengths
  once, scaled by FLOPs to the others (route_timing.py; seconds, once per device, pair and config:
  kept in the cache directory), so each later request takes the faster route. `measure_route()`
  does it up front (a server's start); a `BridgedCache` built directly only reads what is kept.
- `close()` (or leaving the `with` block) frees everything the engine made; the engine then
  refuses new requests. Caches it built stay usable: each holds what it still needs.

Threads: requests on one engine may run concurrently; each has its own request, cache, translator
and generate view, and the engine's memos are locked. Replaying a captured CUDA graph (its buffers
are shared) is serialised by `EngineState.replay_lock`; eager forwards run side by side. The user's
models, configs and modules are never changed, so a plain `target.generate()` in another thread
runs exactly as it would alone.

The module-level `handoff()`, `handoff_batch()`, `Conversation.handoff()` and `publish_context()`
keep a small cache of engines (`engine_for`: the 2 most recently used setups), which
`bridgecache.clear_engines()` empties.

Knows requests, caches, views and generate(); nothing about fitting or serving engines.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

import bridgecache.checks as checks
from bridgecache.compat import cache_kwargs
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.identity import ModelIdentity
from bridgecache.runtime.inputs import (
    check_config,
    check_contexts,
    check_fits,
    check_generate_kwargs,
    check_lengths,
    check_setup,
    check_text,
    selector_layers,
)
from bridgecache.runtime.native_work.forward import forward_with_pass
from bridgecache.runtime.native_work.generation import generate
from bridgecache.runtime.native_work.plan import HandoffPlan, plan_handoff
from bridgecache.runtime.request import HandoffRequest, pad_token_id, same_tokenization
from bridgecache.runtime.route import RouteCosts, save_costs
from bridgecache.runtime.route_timing import (
    PROMPT_TOKENS,
    calibration_lengths,
    measure_route_costs,
    route_lengths,
)
from bridgecache.runtime.state import EngineState

__all__ = [
    "DEFAULT_GRAPH_BYTES",
    "BatchHandoffResult",
    "HandoffEngine",
    "HandoffResult",
    "clear_engines",
    "engine_for",
    "generate",
]

DEFAULT_GRAPH_BYTES = 3 << 29  # CUDA graphs an engine keeps: 1.5 GiB of buffers and capture pools


@dataclass
class HandoffResult:
    """What a handoff produced and what each stage cost (seconds)."""

    text: str
    output_ids: torch.Tensor  # [batch, new_tokens] generated by the target
    cache: BridgedCache
    source_prefill_s: float  # 0.0 when the caller passed the source's KV
    generate_s: float  # the source's reading of the prompt, translation, the native work, decoding
    # what generate() returned when asked for more than ids (return_dict_in_generate=True:
    # scores, logits, ...), else None
    generation: object = None


@dataclass
class BatchHandoffResult:
    """What a batched handoff produced and what each stage cost (seconds, for the whole batch)."""

    texts: list[str]
    output_ids: torch.Tensor  # [batch, new_tokens] generated by the target (padding after EOS)
    cache: BridgedCache
    source_prefill_s: float
    generate_s: float
    generation: object = None  # generate()'s output under return_dict_in_generate=True, else None


class HandoffEngine:
    """A handoff setup and everything it owns (see the module docstring).

    Args:
        bridge: a Bridge fitted for (source, target).
        source, target: transformers causal LMs (source may be None when every request passes the
            source's KV and the configuration's selection rule does not read with it).
        source_tokenizer, target_tokenizer: needed by the requests that start from text.
        config: the default `HandoffConfig` of this engine's requests (each may pass its own).
        graph_bytes: device memory the engine's captured CUDA graphs may hold (0: none kept).
    """

    def __init__(
        self,
        bridge,
        source,
        target,
        *,
        source_tokenizer=None,
        target_tokenizer=None,
        config: HandoffConfig | None = None,
        graph_bytes: int = DEFAULT_GRAPH_BYTES,
    ):
        self.config = check_config(config)
        checks.integer(graph_bytes, "graph_bytes", low=0, what="a byte count")
        check_setup(bridge, source, target, source_tokenizer, target_tokenizer)
        self.identity = ModelIdentity(bridge, source, target, source_tokenizer, target_tokenizer)
        self.bridge, self.source, self.target = bridge, source, target
        self.source_tokenizer, self.target_tokenizer = source_tokenizer, target_tokenizer
        self.same_tokenizer = (
            same_tokenization(source_tokenizer, target_tokenizer)
            if source_tokenizer is not None and target_tokenizer is not None
            else None
        )
        self.state = EngineState(bridge, source, target, graph_bytes=graph_bytes)
        self._closed = False
        self._timing_lock = threading.Lock()  # one measurement of the routes at a time

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free every plan, table, view and CUDA graph this engine made; later requests raise."""
        self._closed = True
        self.state.clear()

    def __enter__(self) -> HandoffEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def device_bytes(self) -> int:
        """Device memory the engine holds now (plans and captured graphs), in bytes."""
        return self.state.device_bytes

    # ------------------------------------------------------------------ requests
    def request(
        self,
        contexts: list[str],
        prompt: str | None = "",
        *,
        config: HandoffConfig | None = None,
        source_kv=None,
    ) -> HandoffRequest:
        """The `HandoffRequest` of `contexts` and `prompt` (None: no prompt yet), sizes checked
        against both models' windows, then the source's KV (read now, or `source_kv` checked)."""
        self._check_open()
        if self.source_tokenizer is None or self.target_tokenizer is None:
            raise ValueError(
                "this engine was built without tokenizers: pass source_tokenizer= and target_tokenizer="
            )
        config = self.config if config is None else check_config(config)
        selector_layers(config, self.bridge.target.num_layers)  # a custom rule's answer, before any work
        request = HandoffRequest.from_texts(
            self.bridge, contexts, prompt, self.source_tokenizer, self.target_tokenizer,
            same=self.same_tokenizer, words=config.wants_words,
        )  # fmt: skip
        self.check_fits(request)
        return request.read_source(self.source, source_kv, fingerprint=self.identity.source_fingerprint)

    def check_fits(self, request: HandoffRequest) -> None:
        """Refuse a request longer than either model's window, before any model runs."""
        checks.instance(request, "request", HandoffRequest, "a HandoffRequest (engine.request)")
        prompt = 0 if request.target_prompt is None else request.target_prompt.shape[1]
        sides = (
            ("target", request.target_ids.shape[1] + prompt, self.bridge.target.max_position_embeddings),
            ("source", _source_tokens(request), self.bridge.source.max_position_embeddings),
        )
        for role, tokens, limit in sides:
            what = f"the context{' and prompt' if role == 'target' and prompt else ''} in the {role}'s tokens"
            check_fits(tokens, limit, what)

    def plan(self, request: HandoffRequest, config: HandoffConfig | None = None) -> HandoffPlan:
        """The frozen `HandoffPlan` of a request over this engine's state (runtime/native_work/
        plan.py): the routes timed first where route="auto" needs it, then the gates, the native
        layers' KV, the selection rule's reading and the pending work."""
        self._check_open()
        checks.instance(request, "request", HandoffRequest, "a HandoffRequest (engine.request)")
        self.identity.check()  # the cheap per-request check: the weights are the ones checked
        config = self.config if config is None else check_config(config)
        mask = request.target_mask
        tokens = request.target_ids.shape[1] if mask is None else int(mask.sum(1).max())
        self.time_routes(config.with_words(request.words is not None), tokens)
        return plan_handoff(
            self.bridge, request.source_kv, self.target, request.target_ids, config=config,
            alignment=request.alignment, target_attention_mask=request.target_mask,
            source_attention_mask=request.source_mask, source_model=self.source,
            prompt_ids=request.source_prompt, words=request.words, engine=self,
        )  # fmt: skip

    def cache(self, request: HandoffRequest, config: HandoffConfig | None = None) -> BridgedCache:
        """The BridgedCache of a request's plan (`plan`), nothing translated yet."""
        return BridgedCache.from_plan(self.plan(request, config))

    def generate(self, cache: BridgedCache, input_ids, attention_mask, **generate_kwargs):
        """transformers' `generate()` over `cache`, its first forward doing the cache's native
        work; returns what generate() returns."""
        checks.instance(cache, "cache", BridgedCache, "a BridgedCache (engine.cache)")
        checks.ids(input_ids, "input_ids", vocab=self.target.config.get_text_config().vocab_size)
        checks.mask(attention_mask, "attention_mask", input_ids)
        check_generate_kwargs(generate_kwargs, self.bridge.target.max_position_embeddings)
        if self.target_tokenizer is not None:
            generate_kwargs.setdefault("pad_token_id", pad_token_id(self.target_tokenizer))
        return generate(self.target, cache, input_ids, attention_mask, **generate_kwargs)

    @torch.no_grad()
    def prefill(self, cache: BridgedCache, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's forward over `input_ids` [batch, m], the tokens after `cache`'s columns (the
        native tail, the held-back last token, a prompt), that also does the cache's native work;
        returns the last token's logits [batch, vocab] (what generate()'s first forward samples
        from; scoring reads them). The cache then holds those tokens too."""
        checks.instance(cache, "cache", BridgedCache, "a BridgedCache (engine.cache)")
        checks.ids(input_ids, "input_ids", vocab=self.target.config.get_text_config().vocab_size)
        kwargs = cache_kwargs(self.target, cache)
        out = forward_with_pass(self.target, input_ids=input_ids, use_cache=True, logits_to_keep=1, **kwargs)
        return out.logits[:, -1]

    @torch.no_grad()
    def handoff(
        self, context: str, prompt: str = "", *, config: HandoffConfig | None = None, source_kv=None,
        **generate_kwargs,
    ) -> HandoffResult:  # fmt: skip
        """Let the target continue `context + prompt` from the source's KV of `context`
        (`bridgecache.handoff`'s arguments; `source_kv`: the source's KV if already computed)."""
        check_text(context, "context", allow_empty=True)
        check_text(prompt, "prompt", allow_empty=True)
        check_generate_kwargs(generate_kwargs, self.bridge.target.max_position_embeddings)
        request = self.request([context], prompt, config=config, source_kv=source_kv)
        if request.target_ids.shape[1] + request.target_prompt.shape[1] == 0:
            raise ValueError("context and prompt are both empty (0 target tokens): nothing to continue from")
        new_tokens, generation, seconds, cache = self._run(request, config, generate_kwargs)
        text = self.target_tokenizer.decode(new_tokens[0], skip_special_tokens=True)
        return HandoffResult(text, new_tokens, cache, request.source_prefill_s, seconds, generation)

    @torch.no_grad()
    def handoff_batch(
        self, contexts: list[str], prompt: str = "", *, config: HandoffConfig | None = None, **generate_kwargs
    ) -> BatchHandoffResult:
        """Every `context + prompt` continued in one batch (`bridgecache.handoff_batch`)."""
        contexts = check_contexts(contexts)
        check_text(prompt, "prompt", allow_empty=True)
        check_generate_kwargs(generate_kwargs, self.bridge.target.max_position_embeddings)
        request = self.request(contexts, prompt, config=config)
        new_tokens, generation, seconds, cache = self._run(request, config, generate_kwargs)
        texts = self.target_tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        return BatchHandoffResult(texts, new_tokens, cache, request.source_prefill_s, seconds, generation)

    def translate_context(
        self, context: str, *, source_kv=None, config: HandoffConfig | None = None
    ) -> tuple[BridgedCache, torch.Tensor]:
        """(BridgedCache, target_ids [1, T]) of `context` with no prompt known yet (publishing:
        the refresh is chosen by the source's reading of the context's last tokens)."""
        check_text(context, "context")
        request = self.request([context], None, config=config, source_kv=source_kv)
        return self.cache(request, config), request.target_ids

    def _run(self, request: HandoffRequest, config, generate_kwargs: dict):
        device = self.target.get_input_embeddings().weight.device
        input_ids, attention_mask = request.inputs(device)
        start = time.perf_counter()
        cache = self.cache(request, config)
        output = self.generate(cache, input_ids, attention_mask, **generate_kwargs)
        seconds = time.perf_counter() - start
        if isinstance(output, torch.Tensor):
            sequences, generation = output, None
        else:  # a ModelOutput under return_dict_in_generate=True
            sequences, generation = output.sequences, output
        return sequences[:, input_ids.shape[1] :], generation, seconds, cache

    # ------------------------------------------------------------------ the cost gate
    def measure_route(
        self, config: HandoffConfig | None = None, lengths=None, *, repeats: int = 3, progress: bool = True
    ) -> RouteCosts:
        """Time both routes (the handoff, the target's own prefill) under `config` at `lengths`
        context tokens (default: 256 to 32K on CUDA, as far as both models' windows allow; the
        calibration lengths elsewhere, scaled by FLOPs to the others), keep them for this engine's
        route="auto" requests and save them in the cache directory for later processes on this
        device (bridgecache.runtime.route). Returns the costs, merged with any measured before."""
        self._check_open()
        config = self.config if config is None else check_config(config)
        checks.integer(repeats, "repeats", low=1, high=1000, what="a number of timed runs")
        checks.instance(progress, "progress", bool, "True or False")
        if lengths is None:
            limit = self._route_limit()
            lengths = route_lengths(32768, limit) if self._on_cuda else calibration_lengths(limit)
        lengths = check_lengths(lengths, self._route_limit())
        with self._timing_lock:
            return self._measure(config, lengths, repeats, progress)

    def route_costs(self, config: HandoffConfig | None = None) -> RouteCosts | None:
        """The costs the cost gate uses for `config` on this device (None: not measured)."""
        return self.state.route_costs(self.config if config is None else check_config(config))

    @property
    def _on_cuda(self) -> bool:
        return self.target.get_input_embeddings().weight.is_cuda

    def _route_limit(self) -> int:
        windows = (self.bridge.target.max_position_embeddings, self.bridge.source.max_position_embeddings)
        return min(windows) - PROMPT_TOKENS - 1

    def time_routes(self, config: HandoffConfig, tokens: int) -> None:
        """Before a request's cache is built (`cache`), with route="auto": time what its route
        needs and is not kept (CUDA: the ladder up to `tokens`; elsewhere the calibration, once)."""
        checks.integer(tokens, "tokens", low=0, what="a count of context tokens")
        if config.route != "auto" or self.source is None or not self._untimed(config, tokens):
            return
        with self._timing_lock:
            missing = self._untimed(config, tokens)  # another thread may have measured meanwhile
            if missing:
                self._measure(config, missing, repeats=3, progress=True)

    def _untimed(self, config: HandoffConfig, tokens: int) -> list[int]:
        """The lengths a request of `tokens` context tokens needs timed and this engine has not."""
        costs, limit = self.state.route_costs(config), self._route_limit()
        if not self._on_cuda:  # the calibration lengths, once: FLOPs scale them to the others
            return [] if costs is not None else calibration_lengths(limit)
        return route_lengths(tokens, limit, costs.lengths if costs is not None else ())

    def _measure(self, config, lengths, repeats: int, progress: bool) -> RouteCosts:
        new = measure_route_costs(self, config, lengths, repeats=repeats, progress=progress)
        old = self.state.route_costs(config)
        costs = old.merged(new) if old is not None else new
        self.state.set_route_costs(costs)
        save_costs(costs)
        return costs

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this handoff engine is closed: build a new one")


def _source_tokens(request: HandoffRequest) -> int:
    """The source's context tokens of a request (its KV's where it came without ids: from_kv)."""
    return request.source_kv.num_tokens if request.source_ids is None else request.source_ids.shape[1]


# ---------------------------------------------------------------------- the module-level engines
# The one module-level cache of the runtime (tests/test_structure.py allow-lists it): the module-
# level entry points reuse an engine per setup, as a process reuses one model. Bounded, and
# emptied by `clear_engines()`; it holds its models until then or until evicted.
_ENGINES: OrderedDict = OrderedDict()  # (id of bridge, source, target, tokenizers) -> HandoffEngine
_ENGINES_KEPT = 2
_ENGINES_LOCK = threading.Lock()


def engine_for(bridge, source, target, source_tokenizer=None, target_tokenizer=None) -> HandoffEngine:
    """The engine of this setup (the same objects), built on first use; the 2 most recent kept."""
    parts = (bridge, source, target, source_tokenizer, target_tokenizer)
    key = tuple(id(part) for part in parts)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is not None and all(
            a is b for a, b in zip(parts, (engine.bridge, engine.source, engine.target,
                                           engine.source_tokenizer, engine.target_tokenizer))
        ) and not engine._closed:  # fmt: skip
            _ENGINES.move_to_end(key)
            return engine
    engine = HandoffEngine(
        bridge, source, target, source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer
    )
    with _ENGINES_LOCK:
        _ENGINES[key] = engine
        while len(_ENGINES) > _ENGINES_KEPT:  # dropped, not closed: a request may still be using it
            _ENGINES.popitem(last=False)[1].state.clear()
    return engine


def clear_engines() -> None:
    """Forget the engines the module-level handoff functions made, freeing their plans, graphs and
    the models they hold (a request still running on one finishes; its caches stay usable)."""
    with _ENGINES_LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        engine.state.clear()
