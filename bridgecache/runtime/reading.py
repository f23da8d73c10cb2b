"""A model reads a prompt over a context it has cached, and says which context tokens it looked at.

    scores = attention_scores(source, kv, prompt_ids)           # [batch, context tokens]

One forward of the prompt's tokens, the context's KV read where they lie (no copy of the cache to
append the prompt), the probabilities reduced to one score per context token inside the attention
itself (bridgecache.runtime.attention.ReadingMask): no per-layer recomputation, no probability
tensor kept beyond the layer that made it.

Knows transformers' forward conventions; nothing about bridges or tokenizers.
"""

from __future__ import annotations

import torch

from bridgecache.runtime.attention import KEYWORD, ReadingMask, attention_override, read_without_logits
from bridgecache.runtime.graphs import bucket
from bridgecache.runtime.memo import MEMO

__all__ = ["attention_scores"]


@torch.no_grad()
def attention_scores(
    model,
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
    graphs: bool = False,
) -> torch.Tensor:
    """How much `model`'s attention from `query_ids`, read right after the first `context_tokens`
    cached columns, falls on each of those columns.

    Args:
        keys, values: per layer [batch, kv_heads, >= context_tokens, head_dim] the model's cache of
            the context (every row kept; read, never modified).
        positions: [batch, >= context_tokens] the context's position ids; first_column: [batch]
            each row's first real column (left padding before it).
        query_ids: [batch, q] what the model reads after the context.
        reduce: "max" (the largest probability any layer, head and counted query gives a token) or
            "sum" (their sum). counted: count only the last this many queries (None: all).
        layers: read with the model's first this many layers only (None: all); the forward stops
            after them where the model allows it.
        graphs: replay a CUDA graph captured per shape bucket (bridgecache.runtime.graphs; CUDA
            models, counted=None): the same scores without a thousand kernel launches per reading.
    Returns:
        [batch, context_tokens] float32 on the model's device.
    """
    if reduce not in ("max", "sum"):
        raise ValueError(f"reduce={reduce!r}; expected 'max' or 'sum'")
    device = model.get_input_embeddings().weight.device
    batch, q = query_ids.shape
    if graphs and counted is None and device.type == "cuda":
        graph = MEMO.reading_graph(model, batch, bucket(q), bucket(context_tokens, 256), reduce, layers)
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
    with attention_override(model):
        read_without_logits(
            model,
            layers,
            input_ids=query_ids.to(device),
            position_ids=query_positions,
            **{KEYWORD: mask},
            use_cache=False,
        )
    return mask.scores
