"""BridgedCache: a drop-in transformers cache holding a context that another model read.

    cache = BridgedCache(bridge, source_kv, target, target_ids, source_model=source, prompt_ids=q)
    out = target.generate(ids, past_key_values=cache)     # `cache=cache` on transformers >= 5.24

The cache reports the target-side prefix length at once (on the native route, where the cost or
quality gate leaves the whole context to the target's own prefill, it starts empty instead, so
generate() computes the context in its first forward). Target layer i is translated from the
source KV (bridgecache.runtime.translation.translator) only when something first reads it, usually the
target's attention at layer i. The columns the target computes itself (the native head, columns
without source text, the tokens a refresh picks) wait as pending work and join the target's first
forward over the cache (bridgecache.runtime.native_work.forward): handoff time = the source's reading of the
prompt + translation + one target forward. Layers are transformers' own `DynamicLayer` /
`DynamicSlidingWindowLayer` with a lazy hook, so masks, beam search, crop and every other cache
operation behave as usual.

This module is the container: it only reads its frozen `HandoffPlan` (bridgecache.runtime.
native_work.plan: the layout, what is computed natively and why, the pending work, the report).
`BridgedCache.from_plan(plan)` (what `HandoffEngine.cache` does) runs no model; the constructor
above builds a throwaway plan the same way first (`plan_handoff`), for generate() used directly.
"""

from __future__ import annotations

import copy
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import bridgecache.checks as checks
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.interop.static import fill_static
from bridgecache.runtime.native_work import forward as native_forward
from bridgecache.runtime.native_work.plan import HandoffPlan, layer_windows, plan_handoff, read_context
from bridgecache.runtime.report import HandoffReport

__all__ = ["BridgedCache", "BridgedLayer", "BridgedSlidingLayer"]


class _LazyLayerMixin:
    """Turns a transformers cache layer into one that translates itself on first use.

    `keys`/`values` are properties: the first read (by `update`, `reorder_cache`, anything)
    materialises the layer; a read outside the cache's first forward runs its pending native work
    first. Batch operations before that are recorded as an index into the source batch, so beam
    search expansion does not translate the same rows several times.
    """

    def _bind(self, cache: BridgedCache, layer_idx: int) -> None:
        # A weak reference: the cache holds its layers, so a strong one back would be a cycle that
        # keeps the cache's GPU memory until Python's cyclic collector runs, not when it is dropped.
        self._cache = weakref.ref(cache)
        self._translator = cache.translator
        self._layer_idx = layer_idx
        self._batch_index: torch.Tensor | None = None
        self._prefix_length = cache.translator.prefix_length
        self.is_initialized = True  # so update() does not reset the (lazy) tensors

    @property
    def is_materialized(self) -> bool:
        return getattr(self, "_translator", None) is None

    @property
    def keys(self):
        if not self.is_materialized:
            self._materialize()
        return self._keys

    @keys.setter
    def keys(self, value):
        self._keys = value

    @property
    def values(self):
        if not self.is_materialized:
            self._materialize()
        return self._values

    @values.setter
    def values(self, value):
        self._values = value

    def _materialize(self, device=None, dtype=None, batch_size=None, new_tokens: int = 0) -> None:
        cache = self._cache()
        if cache is None:
            raise RuntimeError("this layer's BridgedCache is gone: a lazy layer translates through it")
        if cache.pending_work is not None:
            # read before the first forward (or in it: `new_tokens` after the prefix, whose length
            # picks some rope types' tables): the native work comes first
            cache.run_pending(batch_size, new_tokens)
            if self.is_materialized:
                return
        index = self.batch_index_for(batch_size)
        self._translator = None
        keys, values = cache.plan.layer(self._layer_idx, device, dtype)
        if index is not None:
            keys = keys.index_select(0, index.to(keys.device))
            values = values.index_select(0, index.to(keys.device))
        self.device = keys.device
        self._keys, self._values = keys, values

    def batch_index_for(self, batch_size: int | None) -> torch.Tensor | None:
        """The context rows this (lazy) layer's rows will be: the recorded batch operations, or
        generate()'s expansion of the inputs for beams / several sequences (it expands the inputs
        but not a user's cache) to `batch_size`; None: the context's rows as they are."""
        index = self._batch_index
        rows = self._translator.batch_size
        if index is None and batch_size is not None and batch_size != rows:
            if batch_size % rows:
                raise ValueError(f"target batch {batch_size} is not a multiple of the context batch {rows}")
            index = torch.arange(rows).repeat_interleave(batch_size // rows)
        return index

    def settle(self, keys: torch.Tensor, values: torch.Tensor, room=None) -> None:
        """Hold `keys`, `values` [batch, heads, rows, dim] from now on, as a translated layer would
        (the native-work pass hands over its buffers this way). room: (keys, values) [batch,
        heads, > rows, dim] whose first `rows` columns `keys`, `values` are: update() writes new
        tokens there in place while they fit, where transformers' layer concatenates (a copy of
        the whole layer per step, and until every layer has copied, the pass's buffers twice)."""
        self._translator = None
        self._batch_index = None
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True  # an unbound layer (the native route) too: update() appends
        self._keys, self._values = keys, values
        self._room = room

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_materialized:
            self._materialize(key_states.device, key_states.dtype, key_states.shape[0], key_states.shape[-2])
        if getattr(self, "_room", None) is not None and self._append_in_room(key_states, value_states):
            return self._keys, self._values
        return super().update(key_states, value_states, *args, **kwargs)

    def _append_in_room(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Write the new [batch, heads, new, dim] states after the layer's columns, in its room,
        if they fit and the layer is still the room's first columns (no batch operation or
        user's assignment replaced it); else drop the room and say False."""
        room_keys, room_values = self._room
        keys, values = self._keys, self._values
        rows, new = keys.shape[-2], key_states.shape[-2]
        fits = rows + new <= room_keys.shape[-2] and key_states.shape[0] == room_keys.shape[0]
        ours = keys.data_ptr() == room_keys.data_ptr() and values.data_ptr() == room_values.data_ptr()
        ours = ours and keys.stride() == room_keys.stride() and key_states.dtype == room_keys.dtype
        if not (fits and ours):
            self._room = None
            return False
        room_keys[:, :, rows : rows + new].copy_(key_states)
        room_values[:, :, rows : rows + new].copy_(value_states)
        self._keys, self._values = room_keys[:, :, : rows + new], room_values[:, :, : rows + new]
        return True

    def get_seq_length(self) -> int:
        if not self.is_materialized:
            return self._prefix_length
        return super().get_seq_length()

    def _compose_batch(self, index: torch.Tensor) -> None:
        base = (
            self._batch_index if self._batch_index is not None else torch.arange(self._translator.batch_size)
        )
        self._batch_index = base.index_select(0, index.cpu())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_materialized:
            self._room = None  # the batch operation makes new tensors: the room is no longer theirs
            return super().reorder_cache(beam_idx)
        self._compose_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_materialized:
            self._room = None  # the batch operation makes new tensors: the room is no longer theirs
            return super().batch_repeat_interleave(repeats)
        base = (
            self._batch_index if self._batch_index is not None else torch.arange(self._translator.batch_size)
        )
        self._batch_index = base.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_materialized:
            self._room = None  # the batch operation makes new tensors: the room is no longer theirs
            return super().batch_select_indices(indices)
        self._compose_batch(indices)

    def reset(self) -> None:
        """Empty the layer, translated or not (the same on every transformers version)."""
        self._translator = None  # a reset layer never translates
        self._room = None
        self._batch_index = None
        self._keys = self._values = None
        self.is_initialized = False  # the next update() starts from empty tensors
        if hasattr(self, "cumulative_length"):
            self.cumulative_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_materialized:
            self._materialize()
        return super().crop(tokens_to_remove)


class BridgedLayer(_LazyLayerMixin, DynamicLayer):
    """A full-attention target layer, translated on first use."""


class BridgedSlidingLayer(_LazyLayerMixin, DynamicSlidingWindowLayer):
    """A sliding-window target layer, translated on first use (only the rows its window keeps)."""

    def _bind(self, cache, layer_idx):
        super()._bind(cache, layer_idx)
        self.cumulative_length = cache.translator.prefix_length


# transformers' layer class -> the bridged subclass that replaces it. Exact types: any other
# layer upstream dispatches (linear attention, indexed, shared-KV dummies) is refused by name.
_BRIDGED_LAYER_TYPES = {DynamicLayer: BridgedLayer, DynamicSlidingWindowLayer: BridgedSlidingLayer}


class BridgedCache(DynamicCache):
    """A target-model cache holding a context that a SOURCE model read, translated lazily.

    Args:
        bridge: a `Bridge` fitted for (source model, target model).
        source_kv: the source's KV of the context: a `SourceKV` (`capture_kv`), a transformers
            cache after the source's forward pass, per-layer (keys, values) [batch, kv_heads,
            tokens, head_dim], or a path written by `save_kv`. Never mutated.
        target: the target model.
        target_ids: [batch, tokens] the context in the TARGET's tokenization (left-padded for
            batch > 1). Pass the same ids (or ids that start with them) to generate().
        config: a `HandoffConfig` (default: `HandoffConfig()`, the defaults of every path: a 20%
            refresh chosen by the source's attention, in whole words when `words` is given).
        alignment: which source token feeds each target token: a `tokenalign.Alignment` (batch 1)
            or a list of them (one per row, over the unpadded tokens). None when both sides share
            a tokenizer and the source context is the same token sequence (identity).
        target_attention_mask, source_attention_mask: [batch, tokens] 0/1 for left padding.
        source_model: the source model, for selection rules that read with it (the default).
        prompt_ids: [batch, q] the prompt in the SOURCE's tokens: what the source reads to choose
            the refreshed tokens (None: the context's last tokens read it).
        words: the context's words on both sides (`bridgecache.runtime.selection.words.ContextWords`): the
            refresh takes whole words with them unless `RefreshConfig(whole_words=False)`; without
            them it refreshes token by token (the default, whole_words=None) or raises (True).
            `handoff_config` records what was done: whole_words resolved to True or False.
        engine: the `HandoffEngine` whose plans, views, CUDA graphs and route costs this cache
            uses (and reuses across caches; the engine times the routes before its own requests,
            never here: bridgecache.runtime.route); None: a private set, made for this cache and
            freed with it. Its models are checked against the bridge when it is built, not here.

    The arguments go to `plan_handoff`, which runs what the plan needs (the native layers'
    forward, the selection rule's reading); the cache then only reads the plan (`plan`).
    """

    def __init__(
        self,
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
    ):
        plan = plan_handoff(
            bridge, source_kv, target, target_ids, config=config, alignment=alignment,
            target_attention_mask=target_attention_mask, source_attention_mask=source_attention_mask,
            source_model=source_model, prompt_ids=prompt_ids, words=words, engine=engine,
        )  # fmt: skip
        self._adopt(plan)

    @classmethod
    def from_plan(cls, plan: HandoffPlan) -> BridgedCache:
        """The cache of a `HandoffPlan` (`HandoffEngine.plan`): runs no model, only reads the plan."""
        checks.instance(plan, "plan", HandoffPlan, "a HandoffPlan (HandoffEngine.plan)")
        cache = cls.__new__(cls)
        cache._adopt(plan)
        return cache

    def _adopt(self, plan: HandoffPlan) -> None:
        DynamicCache.__init__(self)
        self.layers = _bridged_layers(plan.target.config)
        self.layer_class_to_replicate = None
        self._plan = plan
        self._pending = plan.pending  # until the target's first forward (or run_pending) runs it
        # Bound layers report the context and translate on first use. Unbound ones are plain empty
        # layers: no context (nothing to translate) or the native route, where generate() feeds the
        # whole context to the target's own first forward.
        if plan.translator.prefix_length and not plan.native_route:
            self._bind_layers()

    @property
    def plan(self) -> HandoffPlan:
        """The frozen `HandoffPlan` this cache reads (shared with its copies)."""
        return self._plan

    @property
    def translator(self):
        """The plan's `Translator`: the context's layout and its translation."""
        return self._plan.translator

    @property
    def state(self):
        """The `EngineState` the plan was made over (the engine's, or a private one)."""
        return self._plan.state

    @property
    def handoff_config(self) -> HandoffConfig:
        """The `HandoffConfig` as decided (whole_words resolved)."""
        return self._plan.config

    @property
    def pending_work(self):
        """The plan's `PendingWork` until the target's first forward (or `run_pending`) runs it;
        then None."""
        return self._pending

    def finish_pending(self) -> None:
        """Called by the native-work pass once its forward ran: nothing is pending any more."""
        self._pending = None

    def _bind_layers(self) -> None:
        for i, layer in enumerate(self.layers):
            layer._bind(self, i)

    def __deepcopy__(self, memo):
        """A copy whose layers are copied; the read-only parts (the target model, the translator
        with the source KV and the bridge, the plan) are shared, not copied."""
        plan = self._plan
        for shared in (plan.target, plan.target_ids, plan.translator, plan, plan.pending, plan.state):
            memo[id(shared)] = shared
        new = copy.copy(self)
        memo[id(self)] = new
        new.layers = copy.deepcopy(self.layers, memo)
        for layer in new.layers:  # a weak reference is copied as it is: point it at the copy
            if getattr(layer, "_cache", None) is not None:
                layer._cache = weakref.ref(new)
        return new

    # ------------------------------------------------------------------ the native work
    def run_pending(self, batch: int | None = None, new_tokens: int = 0) -> None:
        """Run the pending native work now, in a forward of its own (no-op when there is none), for
        `batch` rows (None: the context's; generate() may have expanded them for beams), before a
        forward of `new_tokens` after the cached prefix (0: none known)."""
        if self._pending is not None:
            native_forward.run_alone(self, batch, new_tokens=new_tokens)

    def pending_for_batch(self, batch: int):
        """The pending work for a forward of `batch` rows: generate() may have expanded the
        cache's rows (beams, several sequences per prompt) before its first forward."""
        work = self._pending
        rows = work.columns.shape[0]
        index = next((layer._batch_index for layer in self.layers if not layer.is_materialized), None)
        if index is None and batch != rows:
            if batch % rows:
                raise ValueError(f"target batch {batch} is not a multiple of the context batch {rows}")
            index = torch.arange(rows).repeat_interleave(batch // rows)
        return work if index is None else work.select(index)

    # ------------------------------------------------------------------ reports and views
    def report(self) -> HandoffReport:
        """What this cache computed natively, what it translated, and why (row 0 of a batch)."""
        return self._plan.report

    @property
    def refreshed_columns(self) -> torch.Tensor:
        """[batch, n] int64 (CPU) the context columns the refresh picked, ascending."""
        return self._plan.refreshed_columns()

    @property
    def translated_positions(self) -> range:
        """Context columns translated in row 0 (refreshed ones included); the target computes
        the others (native head, native tail, the held-back last token) itself; none on the
        native route."""
        if self.native_route:
            return range(0)
        return range(int(self.translator.head_end[0]), self.translator.prefix_length)

    @property
    def materialized_layers(self) -> list[int]:
        """Indices of the target layers translated so far."""
        return [i for i, layer in enumerate(self.layers) if layer.is_materialized]

    @property
    def native_route(self) -> bool:
        """Whether the whole context is the target's own prefill (`report().route == "native"`):
        the cache starts empty, so generate(), given the whole context as always, computes it in
        its first forward; `materialize()` computes it now instead."""
        return self._plan.native_route

    def materialize(self) -> BridgedCache:
        """Run the native work and translate every layer now (e.g. to time translation on its
        own); on the native route, compute the context with the target now if no forward has
        (the cache then holds it as a handoff's would). Returns self."""
        tr = self.translator
        if self.native_route and tr.prefix_length and self.get_seq_length() == 0:
            context = read_context(tr, self._plan.target, self._plan.target_ids, range(len(self.layers)))
            for i, layer in enumerate(self.layers):
                keys, values = context[i]
                start = tr.window_start(i)
                if isinstance(layer, BridgedSlidingLayer):
                    layer.cumulative_length = tr.prefix_length
                layer.settle(keys[:, :, start:], values[:, :, start:])
        self.run_pending()
        for layer in self.layers:
            if not layer.is_materialized:
                layer._materialize()
        return self

    def to_static(self, max_cache_len: int, *, into=None):
        """This cache's KV (completed now) in a transformers `StaticCache` of `max_cache_len`
        tokens, for `torch.compile` / CUDA-graph decoding; `into=` refills an earlier one in
        place. Full-attention targets only (bridgecache.runtime.interop.static)."""
        if any(window is not None for window in self.translator.windows):
            raise ValueError(
                "to_static needs full-attention target layers; this target has sliding-window layers"
            )
        self.materialize()
        layers_kv = [(layer.keys, layer.values) for layer in self.layers]
        return fill_static(layers_kv, self.translator.target_config, max_cache_len, into=into)


def _bridged_layers(config) -> list[_LazyLayerMixin]:
    """One bridged layer per target layer, of the type transformers' `DynamicCache(config=...)`
    dispatches for `config` (full or sliding window; `layer_windows` refuses any other)."""
    layer_windows(config)
    layers = []
    for layer in DynamicCache(config=config).layers:
        bridged = _BRIDGED_LAYER_TYPES[type(layer)]
        kwargs = {"sliding_window": layer.sliding_window} if bridged is BridgedSlidingLayer else {}
        layers.append(bridged(**kwargs))
    return layers
