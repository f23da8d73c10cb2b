"""A model reads a prompt over a context it has cached, and says which context tokens it looked at.

    scores = attention_scores(view, keys, values, positions, first, prompt_ids, n)   # [batch, n]
    reader = SourceReader(state, source, source_kv, graphs=True)   # as a selection rule calls it

One forward of the prompt's tokens, the context's KV read where they lie (no copy of the cache to
append the prompt), the probabilities reduced to one score per context token inside the attention
itself (bridgecache.runtime.interop.attention.ReadingMask): no per-layer recomputation, no probability
tensor kept beyond the layer that made it.

Knows transformers' forward conventions; nothing about bridges or tokenizers.
"""

from __future__ import annotations

import torch

from bridgecache.runtime.interop.attention import ReadingMask, attending, layers_read, read_without_logits
from bridgecache.runtime.interop.graphs import ReadingGraph, as_view, bucket, reading_bytes

__all__ = ["SourceReader", "attention_scores"]


@torch.no_grad()
def attention_scores(
    view,
    keys,
    values,
    positions: torch.Tensor,
    first_column: torch.Tensor,
    query_ids: torch.Tensor,
    context_tokens: int,
    *,
    reduce: str = "max",
    counted: int | None = None,
    layers: int | None = None,
    graphs=None,
    replay_lock=None,
) -> torch.Tensor:
    """How much a model's attention from `query_ids`, read right after the first `context_tokens`
    cached columns, falls on each of those columns.

    Args:
        view: the model's `ModelView` (bridgecache.runtime.interop.views: our attention, the user's model
            untouched), or the model itself (a view is made for this call).
        keys, values: per layer [batch, kv_heads, >= context_tokens, head_dim] the model's cache of
            the context (every row kept; read, never modified).
        positions: [batch, >= context_tokens] the context's position ids; first_column: [batch]
            each row's first real column (left padding before it).
        query_ids: [batch, q] what the model reads after the context.
        reduce: "max" (the largest probability any layer, head and counted query gives a token) or
            "sum" (their sum). counted: count only the last this many queries (None: all).
        layers: read with the model's first this many layers only (None: all); the forward stops
            after them where the model allows it.
        graphs: a `GraphStore` to replay a CUDA graph from, captured per shape bucket
            (bridgecache.runtime.interop.graphs; CUDA models, counted=None): the same scores without a
            thousand kernel launches per reading. None: eager.
        replay_lock: held while a captured graph's buffers are loaded, replayed and read.
    Returns:
        [batch, context_tokens] float32 on the model's device.
    """
    if reduce not in ("max", "sum"):
        raise ValueError(f"reduce={reduce!r}; expected 'max' or 'sum'")
    view = as_view(view)
    model = view.original
    device = model.get_input_embeddings().weight.device
    batch, q = query_ids.shape
    if graphs is not None and counted is None and device.type == "cuda":
        shape = (batch, bucket(q), bucket(context_tokens, 256), reduce, layers)
        graph = graphs.get(
            ("reading", *shape),
            lambda: ReadingGraph(view, *shape[:4], captured=True, layers=layers),
            reading_bytes(model, batch, shape[2], layers),
            share=1.0,  # launches bound a reading at every length: a long one is worth its buffers
        )
        if graph is not None:
            with replay_lock:
                return graph.run(
                    keys, values, positions, first_column.to(device), query_ids.to(device), context_tokens
                )
    context_positions = positions[:, :context_tokens].to(device)
    start = context_positions[:, -1:] + 1  # left padding: the last column is a real token
    query_positions = start + torch.arange(q, device=device)[None]
    mask = ReadingMask(
        keys=tuple(k[:, :, :context_tokens] for k in keys),
        values=tuple(v[:, :, :context_tokens] for v in values),
        context_positions=context_positions,
        first_column=first_column.to(device),
        query_positions=query_positions,
        scores=torch.zeros(batch, context_tokens, device=device),
        reduce=reduce,
        counted=counted,
        layers=layers,
    )
    with attending(mask):
        read_without_logits(
            view, layers, input_ids=query_ids.to(device), position_ids=query_positions, use_cache=False
        )
    return mask.scores


class SourceReader:
    """The source reading queries over its own cache of a context (`SelectionRequest.read_source`):
    through the engine's view of the source, replaying its captured graphs where `graphs`."""

    def __init__(self, state, source, source_kv, graphs: bool):
        self.state, self.kv, self.graphs = state, source_kv, graphs
        self.view = state.view_of(source)

    def __call__(self, query_ids, context_tokens: int, reduce: str, layers: int | None) -> torch.Tensor:
        kv = self.kv
        first = (kv.attention_mask == 0).sum(1)  # on the device: no host round trip
        return attention_scores(
            self.view, kv.keys, kv.values, kv.position_ids, first, query_ids, context_tokens,
            reduce=reduce, layers=layers, graphs=self.state.graphs if self.graphs else None,
            replay_lock=self.state.replay_lock,
        )  # fmt: skip

    def layers_read(self, layers: int | None) -> int:
        return layers_read(self.view.original, layers)
