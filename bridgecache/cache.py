"""BridgedCache: a drop-in transformers cache whose layers are translated on first access.

    cache = BridgedCache(bridge, source_cache, target, target_ids)
    out = target.generate(target_ids, past_key_values=cache)   # or cache=cache

The cache reports the target-side prefix length at once. Target layer i is translated from the
source KV only when the target's attention at layer i first calls `update` (or something reads
its tensors), so a layer never touched is never translated and translation of layer i+1 follows
the compute of layer i. Layers are transformers' own `DynamicLayer` / `DynamicSlidingWindowLayer`
with a lazy hook, so masks, beam search, crop and every other cache operation behave as usual.

Prefix layout (target context of T tokens, in columns of `target_ids`):
    [0, head)        computed natively by the target (attention sink / BOS; exact: one short forward)
    [head, prefix)   translated from the source through the bridge
    [prefix, T)      not in the cache: generate() feeds them (native_tail tokens + the held-back
                     last token), so generation starts from the target's own logits.
Sliding-window target layers translate only the rows their window keeps.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from functools import lru_cache

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from bridgecache.align import gather_rows
from bridgecache.capture import cache_to_layers, position_ids_from_mask
from bridgecache.compat import cache_kwargs
from bridgecache.grouped import LayerGroups, groups_apply
from bridgecache.keynorm import key_norm_scales
from bridgecache.modelinfo import model_spec
from bridgecache.rope import RopeTables, unrotate
from bridgecache.source import SourceKV, as_source
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
        one_launch: translate layers in groups, one kernel launch per group for keys and one for
            values, on the first read of a group's layer (bridgecache.grouped); None (default): on
            CUDA targets. Layers still materialise lazily, one by one.
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
        one_launch: bool | None = None,
    ):
        native_head = bridge.native_head if native_head is None else native_head
        translator = _Translator(
            bridge, as_source(source, source_attention_mask), target, target_ids, target_attention_mask,
            alignment, native_head, native_tail, key_norm,
        )  # fmt: skip
        if groups_apply(translator, target, one_launch):
            translator.groups = LayerGroups(translator)
        layers = []
        for i, layer_type in enumerate(translator.target_layer_types):
            if layer_type == "sliding_attention":
                layer = BridgedSlidingLayer(sliding_window=translator.sliding_window)
            else:
                layer = BridgedLayer()
            layer._bind(translator, i)
            layers.append(layer)
        super().__init__()
        self.layers = layers
        self.layer_class_to_replicate = None
        self.translator = translator

    @property
    def translated_positions(self) -> range:
        """Context positions whose KV come from the source; the target computes the others
        (native head, native tail, the held-back last token) itself."""
        return range(self.translator.head, self.translator.prefix_length)

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


class _Translator:
    """Everything shared by the layers of one BridgedCache: the source KV, the row plan, the
    target's rope tables and native head KV. Produces one target layer's tensors on request."""

    def __init__(
        self, bridge, source: SourceKV, target, target_ids, target_mask, alignment, head, tail, key_norm=True
    ):
        spec = bridge.source
        source.check(spec.num_layers, spec.num_kv_heads, spec.head_dim)
        bridge.target.check(model_spec(target), "target")
        self.bridge = bridge
        self.source = source
        self.batch_size = source.batch_size
        config = target.config.get_text_config()
        self.target_layer_types = list(
            getattr(config, "layer_types", None) or ["full_attention"] * spec.num_layers
        )
        self.target_layer_types = self.target_layer_types[: bridge.target.num_layers]
        self.sliding_window = getattr(config, "sliding_window", None)
        self.home_device = target.get_input_embeddings().weight.device
        self.home_dtype = target.get_input_embeddings().weight.dtype

        if target_ids.dim() != 2 or target_ids.shape[0] != self.batch_size:
            raise ValueError(
                f"target_ids has shape {tuple(target_ids.shape)}; expected [batch={self.batch_size}, tokens] "
                "(the source context's batch size)"
            )
        # Planning runs on the CPU (small integer work); tensors move to the device once.
        target_mask = torch.ones_like(target_ids, device="cpu") if target_mask is None else target_mask.cpu()
        positions = position_ids_from_mask(target_mask)
        self.target_positions = positions.to(self.home_device)
        total = target_ids.shape[1]
        max_positions = bridge.target.max_position_embeddings
        if int(positions.max()) + 1 > max_positions:  # on the CPU copy: no device sync
            raise ValueError(
                f"the context has {total} target tokens; the target model allows {max_positions}"
            )
        policy = bridge.alignment_policy
        if policy == "mean" and alignment is not None:
            # Each target row averages several un-rotated source rows: pool them once, up front,
            # so translation then reads one (already un-rotated) row per target position.
            source = _pool_source(source, alignment, target_mask, _rope_of(spec))
            self.source = source
        rows = _plan_rows(source, target_mask, alignment, policy)
        pad = (target_mask == 0).sum(1)
        leading_native = _leading_native(rows, pad)
        self.head = int((pad + torch.maximum(torch.tensor(head), leading_native)).max()) if total > 1 else 0
        self.prefix_length = max(total - 1 - tail, self.head)
        self.head = min(self.head, self.prefix_length)
        self.rows = rows[:, : self.prefix_length]
        # min_source_row[c]: the lowest source token read from column c on (checked per layer
        # against what a sliding source layer keeps, without a device sync).
        masked = torch.where(self.rows >= 0, self.rows, torch.iinfo(torch.long).max).min(dim=0).values
        self.min_source_row = masked.flip(0).cummin(0).values.flip(0).tolist() + [torch.iinfo(torch.long).max]
        self._target_tables: dict = {}
        self._device_rows: dict = {}
        self.native_keys, self.native_values = _native_head(target, target_ids, target_mask, self.head)
        self.target_rope = RopeTables.from_model(target)
        self.key_norm_scales = key_norm_scales(target) if key_norm else None
        self.groups = None  # LayerGroups when layers are translated in groups (set by BridgedCache)
        self.source_rope = None
        if not (policy == "mean" and alignment is not None):
            self.source_rope = SourceRope(_rope_of(spec), source, self.home_device)

    def layer(self, idx: int, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [batch, tgt_heads, kept_rows, tgt_head_dim] of target layer `idx`."""
        device = torch.device(device or self.home_device)
        dtype = dtype or self.home_dtype
        if (
            self.groups is not None
            and self.groups.covers(idx)
            and (device, dtype) == (self.home_device, self.home_dtype)
        ):
            return self.groups.layer(idx)
        start = self.window_start(idx)
        parts_k, parts_v = [], []
        if start < self.head:
            parts_k.append(self.native_keys[idx][:, :, start : self.head].to(device, dtype))
            parts_v.append(self.native_values[idx][:, :, start : self.head].to(device, dtype))
        begin = max(start, self.head)
        if begin < self.prefix_length:
            plan = self._plan(idx, device)
            kept = source_rows_kept(self.source, plan.used)
            if self.min_source_row[begin] < kept:
                raise ValueError(
                    f"target layer {idx} reads source token {self.min_source_row[begin]}, but source layers "
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

    def window_start(self, idx: int) -> int:
        """First context column target layer `idx` keeps (what a sliding window keeps; else 0)."""
        if self.target_layer_types[idx] == "sliding_attention":
            return max(0, self.prefix_length - (self.sliding_window - 1))
        return 0

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
        key = (self.target_layer_types[idx], begin, device)
        if key not in self._target_tables:
            cos, sin = self.target_rope.cos_sin(idx, self.target_positions[:, begin : self.prefix_length])
            self._target_tables[key] = (cos.to(device), sin.to(device))
        return self._target_tables[key]


@lru_cache(maxsize=16)
def _rope_of(spec) -> RopeTables:
    """The rotary tables of a bridge's source spec (built once: it constructs a config and module)."""
    return RopeTables.from_spec(spec)


def _alignments(alignment, batch: int) -> list:
    alignments = list(alignment) if isinstance(alignment, (list, tuple)) else [alignment]
    if len(alignments) != batch:
        raise ValueError(f"got {len(alignments)} alignments for a batch of {batch}")
    return alignments


def _pool_source(source: SourceKV, alignment, target_mask, tables: RopeTables) -> SourceKV:
    """Source KV re-indexed by TARGET column: row c = mean of the un-rotated source rows that
    overlap target token c (policy `mean`); keys come back un-rotated, NATIVE rows zero."""
    batch, total = target_mask.shape
    source_pad = ((source.position_ids == 0).sum(1) - 1).tolist()
    target_pad = (target_mask == 0).sum(1).tolist()
    if any(source.first_token):
        raise ValueError(
            "policy 'mean' needs every source row: capture the source with bridgecache.capture_kv"
        )
    keys, values = [], []
    for layer in range(source.num_layers):
        cos, sin = tables.cos_sin(layer, source.position_ids)
        unrotated = unrotate(
            source.keys[layer].float(), cos.to(source.keys[layer].device), sin.to(source.keys[layer].device)
        )
        pooled_k, pooled_v = [], []
        for b, al in enumerate(_alignments(alignment, batch)):
            pad = (0, 0, target_pad[b], 0)  # left-pad the target columns back
            rows_k = gather_rows(unrotated[b : b + 1, :, source_pad[b] :], al, "mean")
            rows_v = gather_rows(source.values[layer][b : b + 1, :, source_pad[b] :].float(), al, "mean")
            pooled_k.append(torch.nn.functional.pad(rows_k, pad))
            pooled_v.append(torch.nn.functional.pad(rows_v, pad))
        keys.append(torch.cat(pooled_k))
        values.append(torch.cat(pooled_v))
    positions = position_ids_from_mask(target_mask).to(source.position_ids.device)
    return SourceKV(tuple(keys), tuple(values), positions, (0,) * source.num_layers)


def _plan_rows(source: SourceKV, target_mask, alignment, policy) -> torch.Tensor:
    """[batch, target tokens] int64: the source column feeding each target column (-1: native).

    With an alignment, policy `last` reads the source token covering the target token's last
    character, `first` the one covering its first; `mean` sources are already pooled per target
    column (see `_pool_source`), so they are read one to one.
    """
    batch, total = target_mask.shape
    source_pad = (source.position_ids == 0).sum(1).cpu() - 1  # left padding has position 0 too
    target_pad = (target_mask == 0).sum(1).cpu()
    if alignment is None:
        n_source = source.num_tokens - source_pad
        n_target = total - target_pad
        if not torch.equal(n_source, n_target):
            raise ValueError(
                f"source and target contexts have {n_source.tolist()} and {n_target.tolist()} tokens: "
                "pass an alignment (tokenalign.align) when the tokenizations differ"
            )
        rows = torch.arange(total).expand(batch, total) - target_pad[:, None] + source_pad[:, None]
        return torch.where(torch.arange(total)[None] < target_pad[:, None], -1, rows)
    rows = torch.full((batch, total), -1, dtype=torch.long)
    for b, al in enumerate(_alignments(alignment, batch)):
        index = torch.as_tensor(al.source_index, dtype=torch.long)
        if policy == "first":
            index = torch.where(index >= 0, torch.as_tensor(al.span_start, dtype=torch.long), -1)
        elif policy == "mean":
            index = torch.where(index >= 0, torch.arange(len(index)), -1)  # pooled: target column order
        if len(index) != total - int(target_pad[b]):
            raise ValueError(
                f"alignment of row {b} covers {len(index)} target tokens; the target context has "
                f"{total - int(target_pad[b])}"
            )
        rows[b, int(target_pad[b]) :] = torch.where(index >= 0, index + source_pad[b], -1)
    return rows


def _leading_native(rows: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """[batch] number of leading real target tokens without a source row (template markers, BOS)."""
    counts = []
    for b in range(rows.shape[0]):
        real = rows[b, int(pad[b]) :]
        mapped = (real >= 0).nonzero()
        counts.append(int(mapped[0]) if len(mapped) else len(real))
    return torch.tensor(counts)


# Native head KV depend only on the head tokens themselves (nothing precedes them), so they are
# computed once per (target model, head tokens) and reused by every later cache: a BOS or a fixed
# system prompt then costs nothing. Bounded, and dropped with the model.
_NATIVE_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NATIVE_HEADS_PER_MODEL = 32


def _native_head(target, target_ids, target_mask, head: int):
    """Per-layer native keys/values [batch, tgt_heads, head, head_dim] of the first `head` columns."""
    if head == 0:
        return None, None
    key = (tuple(target_ids[:, :head].flatten().tolist()), tuple(target_mask[:, :head].flatten().tolist()))
    memo = _NATIVE_HEADS.setdefault(target, OrderedDict())
    if key not in memo:
        memo[key] = _run_native_head(target, target_ids, target_mask, head)
        if len(memo) > _NATIVE_HEADS_PER_MODEL:
            memo.popitem(last=False)
    memo.move_to_end(key)
    return memo[key]


@torch.no_grad()
def _run_native_head(target, target_ids, target_mask, head: int):
    device = target.get_input_embeddings().weight.device
    cache = DynamicCache()  # config-less: every layer keeps every token
    mask = target_mask[:, :head].to(device)
    target(
        input_ids=target_ids[:, :head].to(device),
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=True,
        **cache_kwargs(target, cache),
    )
    return cache_to_layers(cache)
