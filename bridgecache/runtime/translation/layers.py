"""Translate source KV into one target layer's KV through a bridge's LayerMap.

Per target head: gather the source rows named by `rows`, un-rotate source keys at their source
positions, apply the affine map, re-rotate at target positions, cast. The arithmetic is one call
of `bridgecache.kernels.map_heads` (fused Triton kernel on CUDA, PyTorch reference elsewhere);
this module only prepares its inputs: it stacks the source layers a target layer reads along the
head axis (as a list: no copy) and builds the rope tables. `translate_layers` does several target
layers in one launch per keys / values (`map_layers`): one kernel launch for a whole cache, so the
host cost of a handoff no longer grows with the number of layers.

Knows nothing about tokenizers or transformers caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridgecache.kernels import map_heads, map_layers
from bridgecache.kv.keynorm import project_to_key_norm
from bridgecache.kv.rope import RopeTables, rotate
from bridgecache.kv.source import SourceKV

__all__ = [
    "LayerPlan",
    "SourceRope",
    "StackedPlan",
    "layer_sources",
    "source_rows_kept",
    "translate_layer",
    "translate_layers",
]


class SourceRope:
    """Source cos/sin per source layer type, computed once per context.

    cos/sin: [batch, tokens, src_head_dim] float32 at the source's position ids.
    tables: the source's rotary tables, on `device` (`EngineState.rope_on`).
    """

    def __init__(self, tables: RopeTables, source: SourceKV, device: torch.device):
        self.tables = tables
        self.positions = source.position_ids.to(device)
        self._by_type: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer_type = self.tables.layer_types[layer]
        if layer_type not in self._by_type:  # computed where the tables live, kept on the device
            cos, sin = self.tables.cos_sin(layer, self.positions)
            self._by_type[layer_type] = (cos.to(self.positions.device), sin.to(self.positions.device))
        return self._by_type[layer_type]


@dataclass(frozen=True)
class LayerPlan:
    """A LayerMap made ready for one device: which source layers it reads, and its tensors there.

    heads: [tgt_heads, n_in] int64 index into the used source layers stacked on the head axis.
    """

    used: tuple[int, ...]
    heads: torch.Tensor
    key_weight: torch.Tensor
    key_bias: torch.Tensor
    value_weight: torch.Tensor
    value_bias: torch.Tensor

    @classmethod
    def build(cls, layer_map, heads_per_layer: int, device: torch.device) -> LayerPlan:
        inputs = layer_map.inputs.cpu()
        used = sorted({int(layer) for layer in inputs[..., 0].unique()})
        position_of_layer = torch.zeros(used[-1] + 1, dtype=torch.long)
        position_of_layer[torch.tensor(used)] = torch.arange(len(used))
        heads = _shared_if_equal(position_of_layer[inputs[..., 0]] * heads_per_layer + inputs[..., 1], device)
        move = lambda t: t.to(device=device, dtype=torch.float32).contiguous()
        # The fused kernel reads W [Ht, n*Ds, Dt] input-axis-contiguous; lay it out so once here.
        weight = lambda t: move(t).transpose(-1, -2).contiguous().transpose(-1, -2)
        return cls(
            used=tuple(used),
            heads=heads,
            key_weight=weight(layer_map.key_weight),
            key_bias=move(layer_map.key_bias),
            value_weight=weight(layer_map.value_weight),
            value_bias=move(layer_map.value_bias),
        )


def _shared_if_equal(heads: torch.Tensor, device: torch.device) -> torch.Tensor:
    """heads [..., Ht, n] on `device`; when every target head reads the same inputs (Full-Head
    maps), a stride-0 view over Ht: the kernel tiles the heads together and the reference does
    one GEMM for all of them instead of gathering the inputs once per head."""
    if bool((heads == heads[..., :1, :]).all()):
        # moved before expanding: .to() of an expanded tensor makes it contiguous again
        return heads[..., :1, :].to(device).expand(heads.shape)
    return heads.to(device)


def translate_layer(
    plan: LayerPlan,
    source: SourceKV,
    source_rope: SourceRope | None,
    rows: torch.Tensor,
    target_cos: torch.Tensor,
    target_sin: torch.Tensor,
    dtype: torch.dtype,
    key_norm_scale: torch.Tensor | None = None,
    target_rotary: tuple[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target keys and values of one layer for the target positions `rows` describes.

    Args:
        plan: the bridge's map of this target layer, on the output device.
        source: the source context's KV (read only).
        source_rope: source cos/sin tables of this context; None when the source keys are
            already un-rotated (rows pooled under the alignment policy `mean`).
        rows: [batch, tgt_tokens] int64 on the plan's device: context-token index of the source
            row feeding each target position; -1 where the target computes the position itself
            (output rows are zero). Callers check the rows against `source_rows_kept`.
        target_cos, target_sin: [batch, tgt_tokens, tgt_head_dim] float32, target positions.
        dtype: of the returned tensors (the target layer's).
        key_norm_scale: [tgt_head_dim] float32 on the device, the scale of the target layer's key
            norm (see bridgecache.kv.keynorm), or None: mapped keys are rescaled onto what the norm
            produces before RoPE is applied (unfused: map, rescale, then rotate).
        target_rotary: the target keys' RotaryLayout (None: half-split over the whole head); the
            source's is its tables' (`source_rope.tables.layout`).
    Returns:
        keys, values: [batch, tgt_heads, tgt_tokens, tgt_head_dim] (keys post-RoPE).
    """
    # The kernel addresses a list of layers as one stack of heads: no concatenation copy.
    src_k, src_v, rows, src_cos, src_sin = layer_sources(plan, source, source_rope, rows)
    src_rotary = None if source_rope is None else source_rope.tables.layout
    if key_norm_scale is None:
        keys = map_heads(
            src_k,
            rows=rows,
            heads=plan.heads,
            weight=plan.key_weight,
            bias=plan.key_bias,
            src_cos=src_cos,
            src_sin=src_sin,
            tgt_cos=target_cos,
            tgt_sin=target_sin,
            out_dtype=dtype,
            src_rotary=src_rotary,
            tgt_rotary=target_rotary,
        )
    else:
        keys = map_heads(
            src_k,
            rows=rows,
            heads=plan.heads,
            weight=plan.key_weight,
            bias=plan.key_bias,
            src_cos=src_cos,
            src_sin=src_sin,
            out_dtype=torch.float32,
            src_rotary=src_rotary,
        )
        keys = project_to_key_norm(keys, key_norm_scale)
        keys = rotate(keys, target_cos, target_sin, target_rotary).to(dtype)
    values = map_heads(
        src_v, rows=rows, heads=plan.heads, weight=plan.value_weight, bias=plan.value_bias, out_dtype=dtype
    )
    return keys, values


def layer_sources(plan, source: SourceKV, source_rope: SourceRope | None, rows: torch.Tensor):
    """(src_k, src_v, rows, src_cos, src_sin): what `translate_layer` hands the kernel for one layer:
    the plan's used source layers on its device, `rows` offset to the rows they keep, their rope
    tables (None when `source_rope` is)."""
    device = plan.heads.device
    offset = source_rows_kept(source, plan.used)
    if offset:
        rows = torch.where(rows >= 0, rows - offset, rows)
    src_k = [source.keys[layer].to(device) for layer in plan.used]
    src_v = [source.values[layer].to(device) for layer in plan.used]
    src_cos = src_sin = None
    if source_rope is not None:
        src_cos, src_sin = _source_tables(
            source_rope, plan.used, src_k[0].shape[1], offset, src_k[0].shape[2], device
        )
    return src_k, src_v, rows, src_cos, src_sin


def source_rows_kept(source: SourceKV, used) -> int:
    """The first context token the used source layers hold (0 unless they are sliding layers)."""
    first = {source.first_token[layer] for layer in used}
    if len(first) != 1:
        raise ValueError(
            f"source layers {list(used)} keep different token ranges; capture the source with capture_kv"
        )
    return first.pop()


def _source_tables(source_rope: SourceRope, used, heads_per_layer, offset, tokens, device):
    """cos/sin of the kept source rows: [batch, tokens, dim] when every used layer shares a rope
    (the usual case), else [batch, len(used) * heads, tokens, dim] broadcast over heads."""
    tables = []
    for layer in used:
        cos, sin = source_rope.cos_sin(layer)
        tables.append(
            (cos[:, offset : offset + tokens].to(device), sin[:, offset : offset + tokens].to(device))
        )
    if len({source_rope.tables.layer_types[layer] for layer in used}) == 1:
        return tables[0]
    per_head = lambda t: t.unsqueeze(1).expand(-1, heads_per_layer, -1, -1)  # noqa: E731
    cos = torch.cat([per_head(c) for c, _ in tables], dim=1)
    sin = torch.cat([per_head(s) for _, s in tables], dim=1)
    return cos, sin


@dataclass(frozen=True)
class StackedPlan:
    """The LayerMaps of several target layers made ready for one `map_layers` launch on a device.

    layers: the target layers, in order. heads: [layers, tgt_heads, n_in] int64 virtual source
    heads (source layer * src_kv_heads + head) over EVERY source layer; stride 0 over tgt_heads when
    every head of every layer reads the same inputs (full-head maps: the kernel shares the gathered
    rows). Weights [layers, tgt_heads, n_in * src_dim, tgt_dim] input-axis-contiguous; biases
    [layers, tgt_heads, tgt_dim]; all float32.
    """

    layers: tuple[int, ...]
    heads: torch.Tensor
    key_weight: torch.Tensor
    key_bias: torch.Tensor
    value_weight: torch.Tensor
    value_bias: torch.Tensor

    @classmethod
    def build(cls, layer_maps, layers, heads_per_layer: int, device: torch.device) -> StackedPlan:
        maps = [layer_maps[i] for i in layers]
        if len({m.inputs.shape for m in maps}) != 1:
            raise ValueError(f"target layers {list(layers)} read different numbers of source heads")
        inputs = torch.stack([m.inputs.cpu() for m in maps])  # [L, Ht, n, 2]
        heads = _shared_if_equal(inputs[..., 0] * heads_per_layer + inputs[..., 1], device)
        stack = lambda name: torch.stack([getattr(m, name) for m in maps]).to(device, torch.float32)  # noqa: E731
        weight = lambda name: stack(name).transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731
        return cls(
            layers=tuple(layers),
            heads=heads,
            key_weight=weight("key_weight"),
            key_bias=stack("key_bias").contiguous(),
            value_weight=weight("value_weight"),
            value_bias=stack("value_bias").contiguous(),
        )


def translate_layers(
    plan: StackedPlan,
    source: SourceKV,
    source_rope: SourceRope | None,
    rows: torch.Tensor,
    target_cos: torch.Tensor,
    target_sin: torch.Tensor,
    out_keys: torch.Tensor,
    out_values: torch.Tensor,
    target_rotary: tuple[str, int] | None = None,
) -> None:
    """Translate the target layers of `plan` at once: one kernel launch for keys, one for values.

    Args:
        plan: the stacked maps, on the output device.
        source: the source context's KV (read only); every source layer keeps the same rows.
        source_rope: as in `translate_layer` (None: keys already un-rotated).
        rows: [batch, tgt_tokens] int64 on the device, as in `translate_layer`.
        target_cos, target_sin: [batch, tgt_tokens, tgt_head_dim] float32, shared by the layers.
        out_keys, out_values: [layers, batch, tgt_heads, tgt_tokens, tgt_head_dim] written in
            place (keys post-RoPE); any strides with the last axis contiguous, e.g. a slice of a
            larger buffer that also holds native rows.
        target_rotary: as in `translate_layer`.
    """
    device = out_keys.device
    every = range(source.num_layers)
    offset = source_rows_kept(source, every)
    if offset:
        rows = torch.where(rows >= 0, rows - offset, rows)
    src_k = [source.keys[layer].to(device) for layer in every]
    src_v = [source.values[layer].to(device) for layer in every]
    src_cos = src_sin = None
    if source_rope is not None:
        src_cos, src_sin = _all_source_tables(
            source_rope, src_k[0].shape[1], offset, src_k[0].shape[2], device
        )
    map_layers(
        src_k,
        rows=rows,
        heads=plan.heads,
        weight=plan.key_weight,
        bias=plan.key_bias,
        src_cos=src_cos,
        src_sin=src_sin,
        tgt_cos=target_cos,
        tgt_sin=target_sin,
        out=out_keys,
        src_rotary=None if source_rope is None else source_rope.tables.layout,
        tgt_rotary=target_rotary,
    )
    map_layers(
        src_v, rows=rows, heads=plan.heads, weight=plan.value_weight, bias=plan.value_bias, out=out_values
    )


def _all_source_tables(source_rope: SourceRope, heads_per_layer, offset, tokens, device):
    """cos/sin of every source layer's kept rows: [batch, tokens, dim] when all share one rope,
    else [batch, layers, heads, tokens, dim] (stride 0 over heads)."""
    types = source_rope.tables.layer_types
    layers = range(len(types))
    if len(set(types)) == 1:
        cos, sin = source_rope.cos_sin(0)
        return cos[:, offset : offset + tokens].to(device), sin[:, offset : offset + tokens].to(device)
    tables = [source_rope.cos_sin(layer) for layer in layers]
    stack = lambda i: torch.stack([t[i][:, offset : offset + tokens] for t in tables], dim=1).to(device)  # noqa: E731
    cos, sin = stack(0), stack(1)  # [batch, layers, tokens, dim]
    b, ls, s, d = cos.shape
    return cos[:, :, None].expand(b, ls, heads_per_layer, s, d), sin[:, :, None].expand(
        b, ls, heads_per_layer, s, d
    )
