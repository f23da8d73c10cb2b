"""Translate source KV into one target layer's KV through a bridge's LayerMap.

Per target head: gather the source rows named by `rows`, un-rotate source keys at their source
positions, apply the affine map, re-rotate at target positions, cast. The arithmetic is one call
of `bridgecache.kernels.map_heads` (fused Triton kernel on CUDA, PyTorch reference elsewhere);
this module only prepares its inputs: it stacks the source layers a target layer reads along the
head axis (as a list: no copy) and builds the rope tables.

Knows nothing about tokenizers or transformers caches.
"""

from __future__ import annotations

import torch

from bridgecache.kernels import map_heads
from bridgecache.rope import RopeTables
from bridgecache.source import SourceKV

__all__ = ["SourceRope", "translate_layer"]


class SourceRope:
    """Source cos/sin per source layer type, computed once per context.

    cos/sin: [batch, tokens, src_head_dim] float32 at the source's position ids.
    """

    def __init__(self, tables: RopeTables, source: SourceKV, device: torch.device):
        self.tables = tables
        self.positions = source.position_ids.to(device)
        self._by_type: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer_type = self.tables.layer_types[layer]
        if layer_type not in self._by_type:
            self._by_type[layer_type] = self.tables.cos_sin(layer, self.positions)
        return self._by_type[layer_type]


def translate_layer(
    layer_map,
    source: SourceKV,
    source_rope: SourceRope,
    rows: torch.Tensor,
    target_cos: torch.Tensor,
    target_sin: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target keys and values of one layer for the target positions `rows` describes.

    Args:
        layer_map: the bridge's `LayerMap` for this target layer.
        source: the source context's KV (read only).
        source_rope: source cos/sin tables of this context.
        rows: [batch, tgt_tokens] int64 context-token index of the source row feeding each target
            position; -1 where the target computes the position itself (output rows are zero).
        target_cos, target_sin: [batch, tgt_tokens, tgt_head_dim] float32, target positions.
        dtype, device: of the returned tensors (the target layer's).
    Returns:
        keys, values: [batch, tgt_heads, tgt_tokens, tgt_head_dim] (keys post-RoPE).
    """
    used = sorted({int(layer) for layer in layer_map.inputs[..., 0].unique()})
    heads_per_layer = source.keys[used[0]].shape[1]
    # Input slot (layer, head) -> index into the head axis of the stacked source tensor.
    position_of_layer = torch.zeros(used[-1] + 1, dtype=torch.long)
    position_of_layer[torch.tensor(used)] = torch.arange(len(used))
    layer_pos = position_of_layer[layer_map.inputs[..., 0].cpu()]
    heads = (layer_pos * heads_per_layer + layer_map.inputs[..., 1].cpu()).to(device)

    first = {source.first_token[layer] for layer in used}
    if len(first) != 1:
        raise ValueError(
            f"source layers {used} keep different token ranges; capture the source with capture_kv"
        )
    offset = first.pop()
    valid = rows >= 0
    if valid.any() and int(rows[valid].min()) < offset:
        raise ValueError(
            f"target rows read source token {int(rows[valid].min())}, but source layers {used} keep only "
            f"tokens >= {offset} (a sliding-window source cache): capture it with capture_kv"
        )
    local_rows = torch.where(valid, rows - offset, rows).to(device)

    # The kernel addresses a list of layers as one stack of heads: no concatenation copy.
    src_k = [source.keys[layer].to(device) for layer in used]
    src_v = [source.values[layer].to(device) for layer in used]
    src_cos, src_sin = _source_tables(source_rope, used, heads_per_layer, offset, src_k[0].shape[2], device)
    keys = map_heads(
        src_k, local_rows, heads, layer_map.key_weight.to(device), layer_map.key_bias.to(device),
        src_cos=src_cos, src_sin=src_sin, tgt_cos=target_cos.to(device), tgt_sin=target_sin.to(device),
        out_dtype=dtype,
    )  # fmt: skip
    values = map_heads(
        src_v, local_rows, heads, layer_map.value_weight.to(device), layer_map.value_bias.to(device),
        out_dtype=dtype,
    )  # fmt: skip
    return keys, values


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
