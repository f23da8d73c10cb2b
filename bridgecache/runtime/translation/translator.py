"""Translator: the one place that produces a bridged cache's per-layer KV from the source's.

    translator = Translator(bridge, source_kv, target, target_ids, target_mask=..., alignment=...)
    keys, values = translator.translate(idx)               # the columns target layer idx keeps
    keys, values = translator.translate(idx, start=a, stop=b)  # [a, b), also those a window dropped

Layout of a target context of T tokens (left-padded rows; columns of `target_ids`):
    [pad_b, head_end_b)     row b's native head (the attention sink / BOS, leading tokens without
                            source text): computed by the target itself in the native-work pass
                            (bridgecache.runtime.native_work.forward); translated rows there are placeholders
    [head_end_b, prefix)    translated from the source through the bridge
    [prefix, T)             not cached: the target reads them after the cache (native tail, the
                            held-back last token)
Columns before `begin` (the smallest head end) are never translated (zeros until the pass writes
the head rows; padding stays zero and masked).

Translation runs layer by layer here (`translate_layer`); `LayerGroups` (translation.grouped)
reads a translator to translate groups of layers in one launch. Which layers are native and which
go in groups is the plan's to say (bridgecache.runtime.native_work.plan.HandoffPlan), not this
object's: it is built once and only read from then on.

Knows bridges, KV and the target model's config; nothing about generate() or token selection.
"""

from __future__ import annotations

import torch

from bridgecache.kv.rope import RopeTables, rotate, unrotate
from bridgecache.kv.rows import leading_native, plan_rows, pool_source
from bridgecache.kv.source import SourceKV, check_mask, position_ids_from_mask
from bridgecache.runtime.translation.layers import SourceRope, source_rows_kept, translate_layer

__all__ = ["Translator", "prefix_layout"]


class Translator:
    """Everything the layers of one bridged cache share; produces one target layer's tensors.

    Attributes read by the cache and the native work:
        rows [batch, prefix] int64 (CPU): the source row feeding each cached column (-1: none).
        reading_source, reading_rows: the source's own KV (as captured, not pooled) and the source
            token each cached column reads in it ([batch, prefix] on the device): what a model
            reading the source's cache scores.
        target_mask [batch, T] int64 (CPU); target_positions [batch, T] on the target's device.
        head_end [batch] int64 (CPU): each row's first translated column; begin = its minimum.
        prefix_length: cached columns; windows: per target layer, its sliding window or None.
    """

    def __init__(
        self, bridge, source: SourceKV, target, target_ids, *, target_mask, alignment, config, windows, state
    ):
        self.bridge = bridge
        self.state = state  # the engine's EngineState: plans, rope tables, key-norm scales
        self.source = source
        self.target_config = target.config
        self.batch_size = source.batch_size
        self.windows = windows
        embeddings = target.get_input_embeddings().weight
        self.home_device, self.home_dtype = embeddings.device, embeddings.dtype
        if target_ids.dim() != 2 or target_ids.shape[0] != self.batch_size:
            raise ValueError(
                f"target_ids has shape {tuple(target_ids.shape)}; expected [batch={self.batch_size}, tokens] "
                "(the source context's batch size)"
            )
        # Planning runs on the CPU (small integer work); tensors move to the device once.
        if target_mask is None:
            target_mask = torch.ones_like(target_ids, device="cpu")
        check_mask(target_mask, tuple(target_ids.shape), "target_attention_mask")
        self.target_mask = target_mask.cpu().long()
        positions = position_ids_from_mask(self.target_mask)
        self.target_positions = positions.to(self.home_device)
        total = target_ids.shape[1]
        limit = bridge.target.max_position_embeddings
        if total and int(positions.max()) + 1 > limit:  # the CPU copy: no device sync
            raise ValueError(f"the context has {total} target tokens; the target model allows {limit}")
        policy = bridge.alignment_policy
        source_tables = state.source_rope
        pooled = policy == "mean" and alignment is not None
        self.reading_source = source
        if pooled:
            # Each target row averages several un-rotated source rows: pool them once, up front,
            # so translation then reads one (already un-rotated) row per target position.
            self.source = source = pool_source(source, alignment, self.target_mask, source_tables)
        rows = plan_rows(source, self.target_mask, alignment, policy)
        self.target_pad = (self.target_mask == 0).sum(1)
        self.head_end, self.prefix_length = prefix_layout(
            native_head=config.native_head,
            native_tail=config.native_tail,
            default_head=bridge.native_head,
            target_pad=self.target_pad,
            leading=leading_native(rows, self.target_pad),
            total=total,
        )
        self.begin = int(self.head_end.min()) if self.prefix_length else 0
        self.rows = rows[:, : self.prefix_length]
        # Moved now, before this cache queues any device work: a later copy would wait for it.
        reading = plan_rows(self.reading_source, self.target_mask, alignment, "last") if pooled else rows
        self.reading_rows = reading[:, : self.prefix_length].to(self.home_device, non_blocking=True)
        self._min_source_rows = None  # built on first need (a sliding-window source only)
        self._target_tables: dict = {}
        self._retables: dict = {}
        self._by_length: bool | None = None  # whether the target's tables depend on the forward's length
        self._device_rows: dict = {
            (self.begin, self.home_device): self.rows[:, self.begin :].to(self.home_device)
        }
        self.target_rope = RopeTables.from_model(target)
        # The key-norm projection restores the norm a fitted map loses; an identity bridge loses
        # nothing, and its keys are the target's own, which sit sqrt(ms / (ms + eps)) off unit RMS
        # where the pre-norm keys are small: projecting them would move exact keys. Decided here,
        # once per cache, for every path (BridgedCache, the engine, evaluation, publishing).
        project = config.key_norm and bridge.method != "identity"
        self.key_norm_scales = state.key_norm_scales() if project else None
        self.source_rope = (
            None
            if pooled
            else SourceRope(state.rope_on(source_tables, self.home_device), source, self.home_device)
        )

    def window_start(self, idx: int) -> int:
        """The first cached column a layer keeps (a sliding-window layer keeps window - 1)."""
        if self.windows[idx] is not None:
            return max(0, self.prefix_length - (self.windows[idx] - 1))
        return 0

    def translate(
        self, idx: int, device=None, dtype=None, start=None, stop=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [batch, tgt_heads, stop - start, tgt_head_dim] of target layer `idx`,
        translated for context columns [start, stop) (default: the columns the layer keeps).
        Columns before `begin` are zeros (native head placeholders and padding)."""
        device = torch.device(device or self.home_device)
        dtype = dtype or self.home_dtype
        start = self.window_start(idx) if start is None else start
        stop = self.prefix_length if stop is None else stop
        begin = min(max(start, self.begin), stop)
        spec = self.bridge.target
        parts_k, parts_v = [], []
        if start < begin:
            shape = (self.batch_size, spec.num_kv_heads, begin - start, spec.head_dim)
            parts_k.append(torch.zeros(shape, device=device, dtype=dtype))
            parts_v.append(torch.zeros(shape, device=device, dtype=dtype))
        if begin < stop:
            plan = self.state.plan(idx, device)
            self.check_source_rows(plan.used, begin)
            cos, sin = self.target_cos_sin(idx, begin, device)
            rows = self.device_rows(begin, device)
            if stop < self.prefix_length:
                count = stop - begin
                cos, sin, rows = cos[:, :count], sin[:, :count], rows[:, :count]
            scale = None if self.key_norm_scales is None else self.key_norm_scales[idx]
            scale = None if scale is None else scale.to(device)
            keys, values = translate_layer(
                plan, self.source, self.source_rope, rows, cos, sin, dtype, scale, self.target_rope.layout
            )
            parts_k.append(keys)
            parts_v.append(values)
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)

    def check_source_rows(self, used, begin: int) -> None:
        """Raise ValueError when cached columns from `begin` on read source rows that the source
        layers `used` no longer keep (a sliding-window source cache); on the CPU: no device sync."""
        kept = source_rows_kept(self.source, used)
        if not kept:
            return
        if self._min_source_rows is None:
            masked = torch.where(self.rows >= 0, self.rows, torch.iinfo(torch.long).max).min(dim=0).values
            self._min_source_rows = masked.flip(0).cummin(0).values.flip(0)
        lowest = int(self._min_source_rows[begin]) if begin < len(self._min_source_rows) else kept
        if lowest < kept:
            raise ValueError(
                f"the cache reads source token {lowest}, but source layers {list(used)} keep only tokens "
                f">= {kept} (a sliding-window source cache): capture the source with bridgecache.capture_kv"
            )

    def device_rows(self, begin: int, device: torch.device) -> torch.Tensor:
        """[batch, prefix - begin] the planned source rows from column `begin` on, on `device`."""
        key = (begin, device)
        if key not in self._device_rows:
            self._device_rows[key] = self.rows[:, begin:].to(device)
        return self._device_rows[key]

    def target_cos_sin(self, idx: int, begin: int, device: torch.device):
        """Target cos/sin [batch, rows, dim] from `begin` on; shared by layers of one rope type."""
        key = (self.target_rope.layer_types[idx], begin, device)
        if key not in self._target_tables:
            cos, sin = self.target_rope.cos_sin(idx, self.target_positions[:, begin : self.prefix_length])
            self._target_tables[key] = (cos.to(device), sin.to(device))
        return self._target_tables[key]

    def by_length(self) -> bool:
        """Whether the target's rotary tables depend on the length of the forward that computes
        them (longrope, dynamic NTK): its tables at positions 0, 1 for a forward over the context
        against those for one over twice the target's window (dynamic NTK rescales past it)."""
        if self._by_length is None:
            positions = self.target_positions[:1, :2]
            limit = 2 * self.bridge.target.max_position_embeddings
            layers = {t: idx for idx, t in enumerate(self.target_rope.layer_types)}.values()  # one per type
            self._by_length = self.prefix_length > 0 and any(
                not torch.equal(a, b)
                for idx in layers
                for a, b in zip(
                    self.target_rope.cos_sin(idx, positions, self.prefix_length),
                    self.target_rope.cos_sin(idx, positions, limit),
                )
            )
        return self._by_length

    def retable(self, idx: int, length: int, device: torch.device):
        """Moving the cached keys of layer `idx` to a forward over `length` positions: (cos, sin)
        of the tables they were rotated with (translated keys, and the target's own from
        `native_layer_kv`: a forward over the cached prefix alone) and (cos, sin) of that forward's,
        each [batch, prefix, head_dim]; None where they are the same.

        The pass computes its fresh rows in one forward with the prompt, whose length picks the
        tables of such rope types: the target's own prefill of context + prompt rotates every key
        with those, so the cached ones are moved to them (`NativePass.load`)."""
        key = (self.target_rope.layer_types[idx], length, device)
        if key not in self._retables:
            positions = self.target_positions[:, : self.prefix_length]
            own = self.target_rope.cos_sin(idx, positions)
            wanted = self.target_rope.cos_sin(idx, positions, length)
            same = all(torch.equal(a, b) for a, b in zip(own, wanted))
            self._retables[key] = None if same else tuple(t.to(device) for t in (*own, *wanted))
        return self._retables[key]

    def move_keys(self, keys: torch.Tensor, idx: int, length: int, index: torch.Tensor | None = None) -> None:
        """Move layer `idx`'s cached keys [batch, heads, prefix, head_dim] (in place) to the tables of
        a forward over `length` positions (`retable`); index: the context row of each of their rows
        (None: the context's rows)."""
        tables = self.retable(idx, length, keys.device)
        if tables is not None:
            if index is not None:
                tables = tuple(t.index_select(0, index.to(keys.device)) for t in tables)
            layout = self.target_rope.layout
            keys.copy_(rotate(unrotate(keys, *tables[:2], layout), *tables[2:], layout))


def prefix_layout(
    *, native_head, native_tail, default_head, target_pad, leading, total
) -> tuple[torch.Tensor, int]:
    """(head_end [batch], prefix_length): the cache holds columns [0, prefix_length) of the target
    context; row b's columns [target_pad[b], head_end[b]) are its native head.

    native_head: as asked (None: the bridge's `default_head`, clipped to short contexts);
    target_pad, leading: [batch] left padding and leading tokens without source text per row.
    A context of 0 or 1 real tokens has nothing to translate: the cache starts empty.
    """
    for name, value in (("native_head", native_head), ("native_tail", native_tail)):
        if value is not None and value < 0:
            raise ValueError(f"{name}={value}; expected a count of context tokens >= 0")
    shortest = total - int(target_pad.max()) if total else 0
    if shortest <= 1:
        return torch.zeros_like(target_pad), 0
    if native_head is not None and native_head > shortest - 1:
        raise ValueError(
            f"native_head={native_head}, but the context has {shortest} target tokens (shortest row): "
            f"expected 0 <= native_head <= {shortest - 1} (the target always computes the last one)"
        )
    head = default_head if native_head is None else native_head
    head_end = (target_pad + torch.clamp(leading, min=head)).clamp(max=total - 1)
    return head_end, max(total - 1 - native_tail, int(head_end.max()))
