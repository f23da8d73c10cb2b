"""CUDA-graph replay of a group's translation (`BridgedCache(..., cuda_graph=True)`).

The one-launch path (bridgecache.runtime.grouped) still runs Python around its two kernel launches on
every handoff: argument checks, the source-layer offset table, the rope-table views. Here the
whole translation of one shape (keys and values of every layer of a group) is captured once in a
CUDA graph over static input buffers; each later handoff of that shape copies its inputs into
those buffers (`torch._foreach_copy_`: a few launches for all layers) and replays the graph.

    graph = translation_graph(bridge, plan, source, ...)   # captured on first use of a shape
    keys, values = graph.run(source, rows, cos, sin)       # [layers, batch, heads, rows, dim]

The outputs are the graph's own buffers, rewritten by the next replay: the caller copies them out
(LayerGroups copies them into the group buffer, behind the native head rows). Graphs are kept on
the bridge, per shape, the most recent `_GRAPHS_PER_BRIDGE`; each holds its static buffers (the
source KV of one context, twice the translated KV) until it is dropped.

CUDA only: `check_graphs_apply` names what prevents it elsewhere. Knows nothing about generate().
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from bridgecache.kernels._dispatch import source_view
from bridgecache.kv.source import SourceKV
from bridgecache.runtime.translate import StackedPlan, translate_layers

__all__ = ["TranslationGraph", "check_graphs_apply", "translation_graph"]

_GRAPHS_PER_BRIDGE = 4


def check_graphs_apply(device: torch.device, groups_apply: bool) -> None:
    """Raise ValueError unless `cuda_graph=True` can be honoured for a cache on `device` whose
    layers translate in groups (`groups_apply`)."""
    if device.type != "cuda":
        raise ValueError(
            f"cuda_graph=True needs a CUDA target (this one is on {device}); leave it off on the CPU, "
            "where translation runs the PyTorch reference eagerly"
        )
    if not groups_apply:
        raise ValueError(
            "cuda_graph=True captures the one-launch translation, which this cache cannot use "
            "(one_launch=False, a key-normed target with key_norm=True, a source whose layers differ "
            "in rows or layout, or a target spread over several devices): pass cuda_graph=False"
        )


class TranslationGraph:
    """One captured `translate_layers` call: static inputs in, static outputs out.

    Static buffers: source keys/values [batch, src_heads, src_tokens, src_dim] per source layer,
    rows [batch, rows] int64, target cos/sin [batch, rows, tgt_dim] float32, source cos/sin
    [batch, src_tokens, src_dim] float32 (absent when the source keys are already un-rotated),
    outputs keys/values [layers, batch, tgt_heads, rows, tgt_dim] in the target's dtype.
    """

    def __init__(self, plan: StackedPlan, source: SourceKV, source_rope, rows, cos, sin, out_shape, dtype):
        device = rows.device
        like = lambda t: torch.empty_like(t, device=device, memory_format=torch.contiguous_format)  # noqa: E731
        # One buffer per kind, layer by layer: the kernels see evenly spaced, aligned layers.
        stacked = lambda ts: list(torch.empty((len(ts), *ts[0].shape), dtype=ts[0].dtype, device=device))  # noqa: E731
        self.keys_in = stacked(source.keys)
        self.values_in = stacked(source.values)
        self.rows, self.cos, self.sin = like(rows), like(cos), like(sin)
        self.source_tables = None
        if source_rope is not None:
            self.source_tables = tuple(like(t) for t in source_rope.cos_sin(0))
        self.keys_out = torch.empty(out_shape, dtype=dtype, device=device)
        self.values_out = torch.empty(out_shape, dtype=dtype, device=device)
        self._static_source = SourceKV(
            self.keys_in, self.values_in, attention_mask=source.attention_mask,
            position_ids=source.position_ids, first_token=source.first_token,
        )  # fmt: skip
        self._plan = plan
        self._fill(source, source_rope, rows, cos, sin)
        # Warm-up outside the capture: compiles the kernel and runs its autotuner (which times
        # candidates with device syncs, not allowed while capturing).
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._launch()
        torch.cuda.current_stream(device).wait_stream(stream)
        # The kernels address the source layers through an offset table cached by address in
        # bridgecache.kernels; the graph reads the one made during warm-up: hold it for its life.
        self._offset_tables = (source_view(self.keys_in).offsets, source_view(self.values_in).offsets)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._launch()

    def _launch(self) -> None:
        rope = None
        if self.source_tables is not None:
            rope = _StaticRope(self.source_tables)
        translate_layers(
            self._plan, self._static_source, rope, self.rows, self.cos, self.sin,
            out_keys=self.keys_out, out_values=self.values_out,
        )  # fmt: skip

    def _fill(self, source: SourceKV, source_rope, rows, cos, sin) -> None:
        destinations = [*self.keys_in, *self.values_in, self.rows, self.cos, self.sin]
        sources = [*source.keys, *source.values, rows, cos, sin]
        if self.source_tables is not None:
            destinations += list(self.source_tables)
            sources += list(source_rope.cos_sin(0))
        torch._foreach_copy_(destinations, sources)

    def run(self, source: SourceKV, source_rope, rows, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy this handoff's inputs in, replay; returns the graph's output buffers (views the
        next replay overwrites): keys, values [layers, batch, tgt_heads, rows, tgt_dim]."""
        self._fill(source, source_rope, rows, cos, sin)
        self.graph.replay()
        return self.keys_out, self.values_out


class _StaticRope:
    """A SourceRope stand-in whose tables are the graph's static buffers (one rope type)."""

    def __init__(self, tables: tuple[torch.Tensor, torch.Tensor]):
        self._tables = tables
        self.tables = _OneType()

    def cos_sin(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._tables


class _OneType:
    layer_types = ("one",)


def translation_graph(
    bridge, plan: StackedPlan, source: SourceKV, source_rope, rows, cos, sin, out_shape, dtype
):
    """The TranslationGraph of this shape, captured on first use and kept on the bridge.

    Only sources whose layers share one rope type (every source layer's tables are the same) are
    captured; `source_rope` None (pooled, un-rotated keys) is captured too.
    """
    if source_rope is not None and len(set(source_rope.tables.layer_types)) != 1:
        raise ValueError(
            "cuda_graph=True supports sources with one rope type per model (no per-layer rope "
            "types): pass cuda_graph=False"
        )
    graphs = vars(bridge).setdefault("_translation_graphs", OrderedDict())
    key = (
        plan.layers, rows.device, dtype, tuple(out_shape), tuple(rows.shape),
        tuple(source.keys[0].shape), source.keys[0].dtype, source.num_layers, source_rope is None,
        source.num_tokens, source.first_token[0],  # the row offset is fixed in the captured launch
    )  # fmt: skip
    graph = graphs.get(key)
    if graph is None:
        graph = TranslationGraph(plan, source, source_rope, rows, cos, sin, out_shape, dtype)
        graphs[key] = graph
        if len(graphs) > _GRAPHS_PER_BRIDGE:
            graphs.popitem(last=False)
    graphs.move_to_end(key)
    return graph
