"""BridgedCache: a drop-in transformers cache whose layers are translated on first access.

    cache = BridgedCache(bridge, source_cache, target, target_ids)
    out = target.generate(target_ids, past_key_values=cache)   # or cache=cache

The cache reports the target-side prefix length at once. Target layer i is translated from the
source KV only when the target's attention at layer i first calls `update` (or something reads
its tensors), so a layer never touched is never translated and translation of layer i+1 follows
the compute of layer i. Layers are transformers' own `DynamicLayer` / `DynamicSlidingWindowLayer`
with a lazy hook, so masks, beam search, crop and every other cache operation behave as usual.

Prefix layout (target context of T tokens, in columns of `target_ids`):
    [0, native_prefix)       computed natively by the target (attention sink / BOS; exact: one
                             short forward); `native_head=` asks for it
    [native_prefix, prefix)  translated from the source through the bridge
    [prefix, T)      not in the cache: generate() feeds them (native_tail tokens + the held-back
                     last token), so generation starts from the target's own logits.
Sliding-window target layers translate only the rows their window keeps. A context of 0 or 1
target tokens has nothing to translate: the cache starts empty and the target computes it all.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from functools import lru_cache

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from bridgecache.capture import cache_to_layers
from bridgecache.compat import cache_kwargs
from bridgecache.gate import HandoffReport, QualityPolicy, handoff_flops, layer_scores, prefill_flops
from bridgecache.graphs import check_graphs_apply
from bridgecache.grouped import LayerGroups, groups_apply
from bridgecache.guides import deviation_scores
from bridgecache.keynorm import key_norm_scales
from bridgecache.modelinfo import model_spec
from bridgecache.native import native_layer_kv, resolve_native_layers
from bridgecache.refresh import refresh_budget, refresh_columns, select_columns
from bridgecache.rope import RopeTables
from bridgecache.rows import leading_native, plan_rows, pool_source
from bridgecache.source import SourceKV, _check_mask, as_source, position_ids_from_mask
from bridgecache.static import fill_static
from bridgecache.translate import LayerPlan, SourceRope, source_rows_kept, translate_layer

__all__ = ["BridgedCache"]


class _LazyLayerMixin:
    """Turns a transformers cache layer into one that translates itself on first use.

    `keys`/`values` are properties: the first read (by `update`, `reorder_cache`, anything)
    materialises the layer. Batch operations before that are recorded as an index into the
    source batch, so beam search expansion does not translate the same rows several times.
    """

    def _bind(self, translator: _Translator, layer_idx: int) -> None:
        self._translator = translator
        self._layer_idx = layer_idx
        self._batch_index: torch.Tensor | None = None
        self._prefix_length = translator.prefix_length
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

    def _materialize(self, device=None, dtype=None, batch_size=None) -> None:
        translator, self._translator = self._translator, None
        keys, values = translator.layer(self._layer_idx, device, dtype)
        index = self._batch_index
        if index is None and batch_size is not None and batch_size != keys.shape[0]:
            # generate() expands inputs for beams / num_return_sequences but not a user's cache
            if batch_size % keys.shape[0]:
                raise ValueError(
                    f"target batch {batch_size} is not a multiple of the context batch {keys.shape[0]}"
                )
            index = torch.arange(keys.shape[0]).repeat_interleave(batch_size // keys.shape[0])
        if index is not None:
            keys, values = (
                keys.index_select(0, index.to(keys.device)),
                values.index_select(0, index.to(keys.device)),
            )
        self.device = keys.device
        self._keys, self._values = keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_materialized:
            self._materialize(key_states.device, key_states.dtype, key_states.shape[0])
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        if not self.is_materialized:
            return self._prefix_length
        return super().get_seq_length()

    def _compose_batch(self, index: torch.Tensor) -> None:
        current = self._batch_index
        base = current if current is not None else torch.arange(self._translator.batch_size)
        self._batch_index = base.index_select(0, index.cpu())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_materialized:
            return super().reorder_cache(beam_idx)
        self._compose_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_materialized:
            return super().batch_repeat_interleave(repeats)
        base = (
            self._batch_index if self._batch_index is not None else torch.arange(self._translator.batch_size)
        )
        self._batch_index = base.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_materialized:
            return super().batch_select_indices(indices)
        self._compose_batch(indices)

    def reset(self) -> None:
        """Empty the layer, translated or not (the same on every transformers version)."""
        self._translator = None  # a reset layer never translates
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

    def _bind(self, translator, layer_idx):
        super()._bind(translator, layer_idx)
        self.cumulative_length = translator.prefix_length


# transformers' layer class -> the bridged subclass that replaces it. Exact types: any other
# layer upstream dispatches (linear attention, indexed, shared-KV dummies) is refused by name.
_BRIDGED_LAYER_TYPES = {DynamicLayer: BridgedLayer, DynamicSlidingWindowLayer: BridgedSlidingLayer}


class BridgedCache(DynamicCache):
    """A target-model cache holding a context that a SOURCE model read, translated lazily.

    Args:
        bridge: a `Bridge` fitted for (source model, target model).
        source: the source's KV of the context: a transformers cache after the source's forward
            pass, a `CapturedKV`, per-layer (keys, values) [batch, kv_heads, tokens, head_dim],
            or a path written by `save_kv`. Never mutated.
        target: the target model (used for its rope tables and the native head positions).
        target_ids: [batch, tokens] the context in the TARGET's tokenization (left-padded for
            batch > 1). Pass the same ids (or ids that start with them) to generate().
        target_attention_mask, source_attention_mask: [batch, tokens] 0/1 for left padding.
        alignment: which source token feeds each target token: a `tokenalign.Alignment` (batch 1)
            or a list of them (one per row, over the unpadded tokens). None when both sides share
            a tokenizer and the source context is the same token sequence (identity).
        native_head: context tokens the target computes itself at the start (default: the
            bridge's, usually 1, the attention sink; leading tokens without source text are added).
        native_tail: context tokens before the held-back last token that generate() prefills
            natively on top of the translated cache (default 0).
        key_norm: for a target that normalises its keys (Gemma 3, Qwen3: a `k_norm` per
            attention), rescale each mapped key onto what that norm produces (default True; see
            bridgecache.keynorm). No effect on other targets.
        native_layers: target layers the target computes itself over the whole cached context
            (exact; a forward stopped after the deepest one): an int n (the first n layers), a
            list of layer indices, or "all" (the target's own prefill). Default: none.
        refresh: context tokens recomputed through every target layer over the bridged cache
            and written over their translated rows (bridgecache.refresh): a fraction in [0, 1]
            of the translated tokens or a token count. Default: none.
        refresh_by: how refreshed tokens are chosen: "deviation" (translated vs native keys at
            `check_layer`; layers 0..check_layer then come out native too, at no extra cost) or
            a [batch, target tokens] tensor of scores (higher first), e.g. from
            `bridgecache.handoff.source_guided_scores` (the source's attention from the prompt),
            or a scorer called with (target, this cache, target_ids) once the native layers are
            set, e.g. `bridgecache.guides.target_guided(prompt_ids)` (the target's own
            attention from the prompt over the translated cache).
        check_layer: the deviation check's layer (default 1, as CacheBlend).
        min_quality: quality gate (bridgecache.gate): layers whose held-out score is below it
            are computed natively; too many such layers, or a context whose target tokens align
            poorly to source tokens, fall back to the target's own prefill. `report()` says
            what was done. Or a `QualityPolicy` for the other thresholds.
        one_launch: translate layers in groups, one kernel launch per group for keys and one for
            values, on the first read of a group's layer (bridgecache.grouped); None (default): on
            CUDA targets. Layers still materialise lazily, one by one.
        cuda_graph: replay the group translation from a CUDA graph captured once per shape
            (bridgecache.graphs): each handoff copies its inputs into the graph's buffers and
            replays it, with no per-launch Python. Needs a CUDA target and the one-launch path
            (ValueError otherwise, e.g. on the CPU). Default False.
    """

    def __init__(
        self,
        bridge,
        source,
        target,
        target_ids: torch.Tensor,
        *,
        target_attention_mask: torch.Tensor | None = None,
        source_attention_mask: torch.Tensor | None = None,
        alignment=None,
        native_head: int | None = None,
        native_tail: int = 0,
        key_norm: bool = True,
        native_layers=None,
        refresh=None,
        refresh_by="deviation",
        check_layer: int = 1,
        min_quality=None,
        one_launch: bool | None = None,
        cuda_graph: bool = False,
    ):
        layers = _bridged_layers(target.config)
        translator = _Translator(
            bridge,
            as_source(source, source_attention_mask),
            target,
            target_ids,
            target_mask=target_attention_mask,
            alignment=alignment,
            native_head=native_head,
            native_tail=native_tail,
            key_norm=key_norm,
            windows=[getattr(layer, "sliding_window", None) for layer in layers],
        )
        super().__init__()
        self.layers = layers
        if translator.prefix_length:  # else nothing to translate: plain empty layers
            for i, layer in enumerate(self.layers):
                layer._bind(translator, i)
        self.layer_class_to_replicate = None
        self.translator = translator
        grouped = groups_apply(translator, target, one_launch)
        if cuda_graph:
            check_graphs_apply(translator.home_device, grouped)
        make_groups = (lambda: LayerGroups(translator, cuda_graph=cuda_graph)) if grouped else None
        self._native_work(
            target, target_ids, native_layers, refresh, refresh_by, check_layer, min_quality, make_groups
        )

    def _native_work(
        self, target, target_ids, native_layers, refresh, refresh_by, check_layer, min_quality, make_groups
    ):
        """Gate, native layers and token refresh: the target's own compute over the context.
        make_groups: None, or builds the grouped translation, set up once the native layers are
        known (the groups skip them) and before a refresh reads every layer."""
        tr = self.translator
        num_layers = len(self.layers)
        policy = min_quality if isinstance(min_quality, QualityPolicy) else QualityPolicy(min_quality)
        cached = tr.target_mask[:, : tr.prefix_length]
        translated = torch.zeros_like(cached, dtype=torch.bool)
        translated[:, tr.native_prefix :] = cached[:, tr.native_prefix :].bool()
        has_source = (tr.rows >= 0) & translated
        coverage = float(has_source.sum() / translated.sum().clamp(min=1))
        scores = layer_scores(tr.bridge)
        decision = policy.decide(scores, coverage)
        native = set(resolve_native_layers(native_layers, num_layers)) | set(decision.native_layers)
        if decision.fallback:
            native = set(range(num_layers))
        budget = 0 if len(native) == num_layers else refresh_budget(refresh, int(translated.sum(1).min()))
        by_deviation = budget > 0 and isinstance(refresh_by, str)
        if by_deviation:
            if refresh_by != "deviation":
                raise ValueError(f"refresh_by={refresh_by!r}; expected 'deviation' or a tensor of scores")
            if not 0 <= check_layer < num_layers:
                raise ValueError(f"check_layer={check_layer}; expected 0..{num_layers - 1}")
            native |= set(range(check_layer + 1))
        ids = target_ids[:, : tr.prefix_length]
        tr.native_layers = native
        tr.native_kv = native_layer_kv(target, ids, cached, native)
        if make_groups is not None:
            tr.groups = make_groups()
        columns = torch.empty(ids.shape[0], 0, dtype=torch.long)
        guide_flops = 0.0
        if budget:
            if by_deviation:
                translated_keys, _ = tr.translate(check_layer, start=0)  # [batch, heads, prefix, dim]
                column_scores = deviation_scores(translated_keys, tr.native_kv[check_layer][0])
            elif callable(refresh_by):  # e.g. refresh.target_guided: reads the translated layers
                column_scores = torch.as_tensor(refresh_by(target, self, target_ids))[:, : tr.prefix_length]
                guide_flops = getattr(refresh_by, "flops", 0.0)
            else:
                column_scores = torch.as_tensor(refresh_by)[:, : tr.prefix_length]
                if column_scores.shape != cached.shape:
                    raise ValueError(
                        f"refresh_by scores have shape {tuple(torch.as_tensor(refresh_by).shape)}; expected "
                        f"[batch={cached.shape[0]}, target tokens >= {tr.prefix_length}]"
                    )
            columns = select_columns(column_scores.cpu(), translated, budget)
            refresh_columns(target, self.layers, ids, cached, columns, read_columns=tr.columns)
        self.refreshed_columns = columns
        self._report = self._build_report(
            target,
            native=sorted(native),
            scores=scores,
            fallback=decision.fallback,
            refreshed=budget,
            refresh_by=None if not budget else _refresh_by_name(refresh_by),
            check_layer=check_layer if by_deviation else None,
            guide_flops=guide_flops,
        )

    def _build_report(
        self, target, *, native, scores, fallback, refreshed, refresh_by, check_layer, guide_flops=0.0
    ):
        tr = self.translator
        translated = [i for i in range(len(self.layers)) if i not in native]
        quality = None
        if scores is not None:
            kept = [scores[i] for i in translated]
            quality = sum(kept) / len(kept) if kept else 1.0
        context = tr.target_mask.shape[1]
        real = int(tr.target_mask[0].sum())
        pad = context - real
        work = handoff_flops(
            target.config,
            context_tokens=real,
            prefix=tr.prefix_length - pad,
            native_prefix=tr.native_prefix - pad,
            native_layers=tuple(native),
            refreshed=refreshed,
            check_layer=check_layer,
        )
        return HandoffReport(
            layers_translated=translated,
            layers_native=list(native),
            tokens_translated=max(0, tr.prefix_length - tr.native_prefix),
            tokens_native=tr.native_prefix - pad,
            tokens_refreshed=refreshed,
            refresh_by=refresh_by,
            estimated_quality=quality,
            fallback=fallback,
            native_cost_fraction=work / prefill_flops(target.config, real) if real else 0.0,
            guide_cost_fraction=guide_flops / prefill_flops(target.config, real) if real else 0.0,
        )

    def report(self) -> HandoffReport:
        """What this cache computed natively, what it translated, and why (row 0 of a batch)."""
        return self._report

    @property
    def translated_positions(self) -> range:
        """Context positions whose KV come from the source; the target computes the others
        (native head, native tail, the held-back last token) itself."""
        return range(self.translator.native_prefix, self.translator.prefix_length)

    @property
    def materialized_layers(self) -> list[int]:
        """Indices of the target layers translated so far."""
        return [i for i, layer in enumerate(self.layers) if layer.is_materialized]

    def materialize(self) -> BridgedCache:
        """Translate every layer now (e.g. to time translation on its own); returns self."""
        for layer in self.layers:
            if not layer.is_materialized:
                layer._materialize()
        return self

    def to_static(self, max_cache_len: int, *, into=None):
        """This cache's KV (translated now) in a transformers `StaticCache` of `max_cache_len`
        tokens, for `torch.compile` / CUDA-graph decoding; `into=` refills an earlier one in
        place. Full-attention targets only (bridgecache.static)."""
        if any(window is not None for window in self.translator.windows):
            raise ValueError(
                "to_static needs full-attention target layers; this target has sliding-window layers"
            )
        layers_kv = [(layer.keys, layer.values) for layer in self.layers]
        return fill_static(layers_kv, self.translator.target_config, max_cache_len, into=into)


class _Translator:
    """Everything shared by the layers of one BridgedCache: the source KV, the row plan, the
    target's rope tables and the KV of the native prefix. Produces one target layer's tensors on
    request (`layer`)."""

    def __init__(
        self,
        bridge,
        source: SourceKV,
        target,
        target_ids,
        *,
        target_mask,
        alignment,
        native_head,
        native_tail,
        key_norm,
        windows,
    ):
        spec = bridge.source
        source.check(spec, bridge.fingerprints.get("source"))  # shapes; the KV's model, if recorded
        bridge.target.check(model_spec(target), "target")
        self.bridge = bridge
        self.source = source
        self.target_config = target.config
        self.batch_size = source.batch_size
        self.windows = windows  # per target layer: None (keeps every row) or its sliding window
        self.home_device = target.get_input_embeddings().weight.device
        self.home_dtype = target.get_input_embeddings().weight.dtype

        if target_ids.dim() != 2 or target_ids.shape[0] != self.batch_size:
            raise ValueError(
                f"target_ids has shape {tuple(target_ids.shape)}; expected [batch={self.batch_size}, tokens] "
                "(the source context's batch size)"
            )
        # Planning runs on the CPU (small integer work); tensors move to the device once.
        if target_mask is None:
            target_mask = torch.ones_like(target_ids, device="cpu")
        _check_mask(target_mask, tuple(target_ids.shape), "target_attention_mask")
        target_mask = target_mask.cpu().long()
        self.target_mask = target_mask
        self.native_kv: dict = {}  # layer -> the target's own (keys, values), until the layer reads them
        self.native_layers: set[int] = set()
        positions = position_ids_from_mask(target_mask)
        self.target_positions = positions.to(self.home_device)
        total = target_ids.shape[1]
        max_positions = bridge.target.max_position_embeddings
        if total and int(positions.max()) + 1 > max_positions:  # on the CPU copy: no device sync
            raise ValueError(
                f"the context has {total} target tokens; the target model allows {max_positions}"
            )
        policy = bridge.alignment_policy
        if policy == "mean" and alignment is not None:
            # Each target row averages several un-rotated source rows: pool them once, up front,
            # so translation then reads one (already un-rotated) row per target position.
            source = pool_source(source, alignment, target_mask, _rope_of(spec))
            self.source = source
        rows = plan_rows(source, target_mask, alignment, policy)
        target_pad = (target_mask == 0).sum(1)
        self.native_prefix, self.prefix_length = _prefix_layout(
            native_head=native_head,
            native_tail=native_tail,
            default_head=bridge.native_head,
            target_pad=target_pad,
            leading=leading_native(rows, target_pad),
            total=total,
        )
        self.rows = rows[:, : self.prefix_length]
        self._min_source_rows = None  # built on first need (a sliding-window source only)
        self._target_tables: dict = {}
        self._device_rows: dict = {}
        weights = _weights_version(target)  # one walk of the model per cache, for both memos below
        self.native_keys, self.native_values = _native_prefix_kv(
            target, target_ids, target_mask, self.native_prefix, weights=weights
        )
        self.target_rope = RopeTables.from_model(target)
        self.key_norm_scales = _key_norm_scales(target, weights) if key_norm else None
        self.groups = None  # LayerGroups when layers are translated in groups (set by BridgedCache)
        self.source_rope = None
        if not (policy == "mean" and alignment is not None):
            self.source_rope = SourceRope(_rope_of(spec), source, self.home_device)

    def layer(self, idx: int, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [batch, tgt_heads, kept_rows, tgt_head_dim] of target layer `idx`:
        the target's own where the layer is native, else translated."""
        if idx in self.native_kv:
            device = torch.device(device or self.home_device)
            keys, values = self.native_kv.pop(idx)  # read once: the cache layer then owns them
            start = self.window_start(idx)
            return keys[:, :, start:].to(device, dtype or keys.dtype), values[:, :, start:].to(
                device, dtype or values.dtype
            )
        return self.translate(idx, device, dtype)

    def window_start(self, idx: int) -> int:
        """The first cached column a layer keeps (a sliding-window layer keeps window - 1)."""
        if self.windows[idx] is not None:
            return max(0, self.prefix_length - (self.windows[idx] - 1))
        return 0

    def columns(self, idx: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [batch, tgt_heads, stop - start, tgt_head_dim] of target layer `idx` for
        context columns [start, stop), also those a sliding-window layer no longer keeps (a
        refreshed token's window reads them); the target's own where the layer is native."""
        if idx in self.native_kv:
            keys, values = self.native_kv[idx]
            return keys[:, :, start:stop], values[:, :, start:stop]
        if idx in self.native_layers:
            raise RuntimeError(f"target layer {idx} is native and was read already: its columns are gone")
        keys, values = self.translate(idx, start=start)
        return keys[:, :, : stop - start], values[:, :, : stop - start]

    def translate(self, idx: int, device=None, dtype=None, start=None) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [batch, tgt_heads, kept_rows, tgt_head_dim] of target layer `idx`, translated
        (from context column `start` on if given, else from the first one the layer keeps)."""
        device = torch.device(device or self.home_device)
        dtype = dtype or self.home_dtype
        if (
            start is None
            and self.groups is not None
            and self.groups.covers(idx)
            and (device, dtype) == (self.home_device, self.home_dtype)
        ):
            return self.groups.layer(idx)
        start = self.window_start(idx) if start is None else start
        parts_k, parts_v = [], []
        if start < self.native_prefix:
            parts_k.append(self.native_keys[idx][:, :, start : self.native_prefix].to(device, dtype))
            parts_v.append(self.native_values[idx][:, :, start : self.native_prefix].to(device, dtype))
        begin = max(start, self.native_prefix)
        if begin < self.prefix_length:
            plan = self._plan(idx, device)
            kept = source_rows_kept(self.source, plan.used)
            if kept and self.min_source_row(begin) < kept:
                raise ValueError(
                    f"target layer {idx} reads source token {self.min_source_row(begin)}, but source layers "
                    f"{list(plan.used)} keep only tokens >= {kept} (a sliding-window source cache): "
                    "capture the source with bridgecache.capture_kv"
                )
            cos, sin = self._target_cos_sin(idx, begin, device)
            rows = self._rows_from(begin, device)
            scale = None if self.key_norm_scales is None else self.key_norm_scales[idx]
            scale = None if scale is None else scale.to(device)
            keys, values = translate_layer(plan, self.source, self.source_rope, rows, cos, sin, dtype, scale)
            parts_k.append(keys)
            parts_v.append(values)
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    def min_source_row(self, begin: int) -> int:
        """The lowest source token read from cached column `begin` on (checked against what a
        sliding source layer keeps, on the CPU: no device sync)."""
        if self._min_source_rows is None:
            masked = torch.where(self.rows >= 0, self.rows, torch.iinfo(torch.long).max).min(dim=0).values
            self._min_source_rows = masked.flip(0).cummin(0).values.flip(0)
        if begin >= len(self._min_source_rows):
            return torch.iinfo(torch.long).max
        return int(self._min_source_rows[begin])

    def _plan(self, idx: int, device: torch.device) -> LayerPlan:
        # Kept on the LayerMap itself, per device: every cache a bridge serves reuses it.
        plans = vars(self.bridge.layers[idx]).setdefault("_plans_by_device", {})
        if device not in plans:
            plans[device] = LayerPlan.build(self.bridge.layers[idx], self.bridge.source.num_kv_heads, device)
        return plans[device]

    def _rows_from(self, begin: int, device: torch.device) -> torch.Tensor:
        key = (begin, device)
        if key not in self._device_rows:
            self._device_rows[key] = self.rows[:, begin:].to(device)
        return self._device_rows[key]

    def _target_cos_sin(self, idx: int, begin: int, device: torch.device):
        """Target cos/sin [batch, rows, dim] from `begin` on; shared by layers of one rope type."""
        key = (self.target_rope.layer_types[idx], begin, device)
        if key not in self._target_tables:
            cos, sin = self.target_rope.cos_sin(idx, self.target_positions[:, begin : self.prefix_length])
            self._target_tables[key] = (cos.to(device), sin.to(device))
        return self._target_tables[key]


def _refresh_by_name(refresh_by) -> str:
    if isinstance(refresh_by, str):
        return refresh_by
    return getattr(refresh_by, "label", "given scores")


def _bridged_layers(config) -> list[_LazyLayerMixin]:
    """One bridged layer per target layer, of the type transformers' `DynamicCache(config=...)`
    dispatches for `config` (full or sliding window); any other layer type raises ValueError."""
    layers = []
    for i, layer in enumerate(DynamicCache(config=config).layers):
        bridged = _BRIDGED_LAYER_TYPES.get(type(layer))
        if bridged is None:
            raise ValueError(
                f"target layer {i} is a {type(layer).__name__} cache layer; BridgedCache supports "
                f"{sorted(t.__name__ for t in _BRIDGED_LAYER_TYPES)}"
            )
        kwargs = {"sliding_window": layer.sliding_window} if bridged is BridgedSlidingLayer else {}
        layers.append(bridged(**kwargs))
    return layers


@lru_cache(maxsize=16)
def _rope_of(spec) -> RopeTables:
    """The rotary tables of a bridge's source spec (built once: it constructs a config and module)."""
    return RopeTables.from_spec(spec)


def _prefix_layout(*, native_head, native_tail, default_head, target_pad, leading, total) -> tuple[int, int]:
    """(native_prefix, prefix_length): the cache holds columns [0, prefix_length) of the target
    context, of which [0, native_prefix) the target computes itself; generate() feeds the rest.

    native_head: as asked (None: the bridge's `default_head`, clipped to short contexts);
    target_pad, leading: [batch] left padding and leading tokens without source text per row.
    A context of 0 or 1 real tokens has nothing to translate: the cache starts empty.
    """
    for name, value in (("native_head", native_head), ("native_tail", native_tail)):
        if value is not None and value < 0:
            raise ValueError(f"{name}={value}; expected a count of context tokens >= 0")
    shortest = total - int(target_pad.max()) if total else 0
    if shortest <= 1:
        return 0, 0
    if native_head is not None and native_head > shortest - 1:
        raise ValueError(
            f"native_head={native_head}, but the context has {shortest} target tokens (shortest row): "
            f"expected 0 <= native_head <= {shortest - 1} (generate() always computes the last one)"
        )
    head = default_head if native_head is None else native_head
    native_prefix = min(int((target_pad + torch.clamp(leading, min=head)).max()), total - 1)
    prefix_length = max(total - 1 - native_tail, native_prefix)
    return native_prefix, prefix_length


# Native prefix KV depend only on the prefix tokens themselves (nothing precedes them), so they
# are computed once per (target model, prefix tokens) and reused by every later cache: a BOS or a fixed
# system prompt then costs nothing. Bounded, dropped with the model, and forgotten when any
# weight is replaced or edited in place (see `_weights_version`), as keynorm.py does.
_NATIVE_PREFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (weights, memo)
_NATIVE_PREFIXES_PER_MODEL = 32


def _weights_version(model) -> tuple:
    """Identity, storage and autograd version of every parameter and buffer: changes when one is
    replaced or written in place through autograd-visible ops (optimizer steps, load_state_dict,
    merges under no_grad). Writes through `.data` bypass the version counter and are not seen."""
    # A plain walk of the module tree: `model.parameters()` builds names and a visited set for
    # every module, 4x the host time on a 28-layer model (once per BridgedCache).
    version, modules = [], [model]
    while modules:
        module = modules.pop()
        for tensors in (module._parameters, module._buffers):
            version.extend((id(t), t.data_ptr(), t._version) for t in tensors.values() if t is not None)
        modules.extend(m for m in module._modules.values() if m is not None)
    return tuple(version)


_KEY_NORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (weights, scales)


def _key_norm_scales(target, weights: tuple):
    """keynorm.key_norm_scales(target), looked up again only when `weights` (the target's
    `_weights_version`) changed: its module walk cost as much as the rest of a cache's planning."""
    known = _KEY_NORMS.get(target)
    if known is None or known[0] != weights:
        known = (weights, key_norm_scales(target))
        _KEY_NORMS[target] = known
    return known[1]


def _native_prefix_kv(target, target_ids, target_mask, length: int, *, weights: tuple):
    """Per-layer native keys/values [batch, tgt_heads, length, head_dim] of the first `length`
    columns; `weights`: the target's `_weights_version`."""
    if length == 0:
        return None, None
    key = (
        tuple(target_ids[:, :length].flatten().tolist()),
        tuple(target_mask[:, :length].flatten().tolist()),
    )
    known_weights, memo = _NATIVE_PREFIXES.get(target, (None, None))
    if known_weights != weights:  # first use, or the weights changed (training step, LoRA merge, load)
        memo = OrderedDict()
        _NATIVE_PREFIXES[target] = (weights, memo)
    if key not in memo:
        memo[key] = _run_native_prefix(target, target_ids, target_mask, length)
        if len(memo) > _NATIVE_PREFIXES_PER_MODEL:
            memo.popitem(last=False)
    memo.move_to_end(key)
    return memo[key]


@torch.no_grad()
def _run_native_prefix(target, target_ids, target_mask, length: int):
    device = target.get_input_embeddings().weight.device
    cache = DynamicCache()  # config-less: every layer keeps every token
    mask = target_mask[:, :length].to(device)
    target(
        input_ids=target_ids[:, :length].to(device),
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=True,
        **cache_kwargs(target, cache),
    )
    return cache_to_layers(cache)
