"""Translate the layers of a BridgedCache in groups: one kernel launch per group for keys, one for
values, instead of two per layer.

A group is every target layer that keeps the same rows (same layer type, hence the same sliding
window start) and reads the same number of source heads: for most targets, the whole cache. The
first layer of a group that the target reads translates the whole group into one buffer
[layers, batch, tgt_heads, rows, tgt_head_dim] (zeros before the first translated column); each layer
then takes its own slice, a view. Layers are still materialised one by one, lazily, by the cache;
only the arithmetic is batched, so the host cost of a handoff no longer grows with the number of
layers (benchmarks/reports/cpu-and-gpu.md times both).

Knows nothing about tokenizers or generate(); reads a `Translator`
(bridgecache.runtime.translation.translator).
"""

from __future__ import annotations

import torch

from bridgecache.runtime.translation.layers import translate_layers

__all__ = ["LayerGroups", "groups_apply"]


def groups_apply(translator, target, one_launch: bool | None) -> bool:
    """Whether `translator` (a BridgedCache's) can translate its layers in groups.

    one_launch: True / False force it on / off where possible; None: on for CUDA targets. Never
    for key-normed targets (their keys are
    rescaled per layer), sources whose layers keep different
    rows or have different layouts, or targets spread over several devices.
    """
    if one_launch is False or (one_launch is None and translator.home_device.type != "cuda"):
        return False
    scales = translator.key_norm_scales
    if scales is not None and any(s is not None for s in scales):
        return False
    source = translator.source
    if len(set(source.first_token)) != 1:
        return False
    first = source.keys[0]
    for t in (*source.keys, *source.values):
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            return False
        if t.device != first.device:
            return False
    device_map = getattr(target, "hf_device_map", None) or {}
    return len(set(device_map.values())) <= 1


class LayerGroups:
    """The grouped translation of one BridgedCache on its home device and dtype."""

    def __init__(self, translator, native_layers=(), whole: bool = False):
        """native_layers: layers the target computes itself (in no group); whole: translate every
        column of every layer (the native-work pass reads them all); else the columns each layer
        keeps."""
        self.translator = tr = translator
        self._group_of: dict[int, tuple] = {}
        members: dict[tuple, list[int]] = {}
        for idx, window in enumerate(tr.windows):
            start = 0 if whole else tr.window_start(idx)
            if max(start, tr.begin) >= tr.prefix_length:  # nothing to translate: native rows only
                continue
            if idx in native_layers:  # the target computes this layer itself
                continue
            key = (start, window, tuple(tr.bridge.layers[idx].inputs.shape))
            members.setdefault(key, []).append(idx)
        for key, layers in members.items():
            for idx in layers:
                self._group_of[idx] = (key[0], tuple(layers))
        self._done: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._waiting: dict[tuple, set[int]] = {}  # layers of a translated group not yet handed out
        self.translations = 0  # groups translated so far (each launch pair counts once)

    def covers(self, idx: int) -> bool:
        return idx in self._group_of

    def start(self, idx: int) -> int:
        """The first column the group of layer `idx` translates."""
        return self._group_of[idx][0]

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [batch, tgt_heads, kept_rows, tgt_head_dim] of target layer `idx` (views)."""
        start, layers = self._group_of[idx]
        if layers not in self._done:
            self._done[layers] = self._translate(start, layers)
            self._waiting[layers] = set(layers)
            self.translations += 1
        keys, values = self._done[layers]
        self._waiting[layers].discard(idx)
        if not self._waiting[layers]:  # every layer holds its view: drop the group's reference
            del self._done[layers], self._waiting[layers]
        pos = layers.index(idx)
        return keys[pos], values[pos]

    def translate_into(self, idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, ...]:
        """Translate the group of target layer `idx` straight into `keys`, `values`
        [target_layers, batch, tgt_heads, >= prefix_length, tgt_head_dim] (a native-work pass's
        buffers, indexed by target layer), columns [start, prefix_length): no buffer of the group's
        own, so a pass holds one copy of the translated cache, not two. Returns the group's layers,
        written; () where it cannot (a group handed out already, layers not evenly spaced, other
        devices or dtypes): the caller copies `layer(idx)` instead."""
        tr = self.translator
        start, layers = self._group_of[idx]
        step = layers[1] - layers[0] if len(layers) > 1 else 1
        spaced = step > 0 and layers == tuple(range(layers[0], layers[-1] + 1, step))
        home = all((t.device, t.dtype) == (tr.home_device, tr.home_dtype) for t in (keys, values))
        if layers in self._done or not spaced or not home:
            return ()
        rows = slice(layers[0], layers[-1] + 1, step)
        stop = tr.prefix_length
        self._fill(start, layers, keys[rows, :, :, start:stop], values[rows, :, :, start:stop])
        self.translations += 1
        return layers

    def _translate(self, start: int, layers: tuple[int, ...]):
        tr = self.translator
        batch, heads, dim = tr.batch_size, tr.bridge.target.num_kv_heads, tr.bridge.target.head_dim
        shape = (len(layers), batch, heads, tr.prefix_length - start, dim)
        keys = torch.empty(shape, dtype=tr.home_dtype, device=tr.home_device)
        values = torch.empty(shape, dtype=tr.home_dtype, device=tr.home_device)
        self._fill(start, layers, keys, values)
        return keys, values

    def _fill(self, start: int, layers: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the group's columns [start, prefix_length) into keys, values [layers, batch,
        tgt_heads, prefix_length - start, tgt_head_dim] (any strides, the last axis contiguous)."""
        tr = self.translator
        device = tr.home_device
        begin = max(start, tr.begin)
        tr.check_source_rows(range(tr.source.num_layers), begin)
        plan = tr.state.stacked_plan(layers, device)
        if start < begin:  # native head placeholders and padding: written by the native work, or masked
            keys[:, :, :, : begin - start].zero_()
            values[:, :, :, : begin - start].zero_()
        cos, sin = tr.target_cos_sin(layers[0], begin, device)
        rows = tr.device_rows(begin, device)
        out_keys, out_values = keys[:, :, :, begin - start :], values[:, :, :, begin - start :]
        translate_layers(
            plan, tr.source, tr.source_rope, rows, cos, sin, out_keys=out_keys, out_values=out_values,
            target_rotary=tr.target_rope.layout,
        )  # fmt: skip
