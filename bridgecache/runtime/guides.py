"""Which context tokens a refresh recomputes: scores per target column, higher first.

    deviation_scores       how far translated keys are from the target's own keys at a cheap
                           check layer (CacheBlend's criterion; LMCache recomputes by it)
    source_guided_scores   the source has read the context: it reads the prompt (or the
                           context's last tokens) over its own cache, and the context tokens its
                           attention picks out score highest (CacheClip's helper-model criterion);
                           `attention_maps` / `source_attention_scores` are its parts,
                           `scores_on_target` carries source-token scores to target columns
    target_guided          a BridgedCache scorer: the target reads the prompt over the translated
                           cache and its own attention scores the columns (no source model)
    blend_scores           two guides added, each normalised

Knows nothing about bridges or tokenizers (an alignment is read as index arrays).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs
from bridgecache.fitting.attention import QueryRecorder, attention_modules
from bridgecache.runtime.gate import reading_flops

__all__ = [
    "deviation_scores",
    "attention_maps",
    "source_attention_scores",
    "scores_on_target",
    "source_guided_scores",
    "target_guided",
    "blend_scores",
]


def deviation_scores(translated_keys: torch.Tensor, native_keys: torch.Tensor) -> torch.Tensor:
    """[batch, tokens] squared distance between translated and native keys of one layer, summed
    over heads and dimensions. Both [batch, kv_heads, tokens, head_dim] (post-RoPE: RoPE is a
    rotation, so the distance is that of the un-rotated keys)."""
    return (translated_keys.float() - native_keys.float()).pow(2).sum(dim=(1, 3))


@torch.no_grad()
def attention_maps(
    model, keys, values, positions: torch.Tensor, query_ids: torch.Tensor, context_tokens: int
) -> list[torch.Tensor]:
    """The attention of `model` from `query_ids` onto the first `context_tokens` cached columns.

    The model reads `query_ids` [batch, q] right after the first `context_tokens` rows of a cache
    (keys/values per layer [batch, kv_heads, >= context_tokens, head_dim], positions
    [batch, >= context_tokens]); the caller's tensors are never modified (a fresh cache holds
    views). Returns per layer [batch, q_heads, q, context_tokens] float32 attention probabilities
    (softmax over the context and the queries' own causal prefix, of which the context part).
    """
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[:, :, :context_tokens], v[:, :, :context_tokens], layer)
    device = model.get_input_embeddings().weight.device
    q = query_ids.shape[1]
    start = positions[:, context_tokens - 1 : context_tokens].to(device) + 1
    query_positions = start + torch.arange(q, device=device)[None]
    rows = torch.arange(q)
    with QueryRecorder(model, rows) as recorder:
        model(
            input_ids=query_ids.to(device),
            position_ids=query_positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(model, cache),
        )
    maps = []
    # Query j sits at column context_tokens + j: causal over the prompt's own keys (built once).
    query_col = context_tokens + torch.arange(q, device=device)[:, None]
    key_col = torch.arange(context_tokens + q, device=device)[None, :]
    causal = key_col <= query_col
    for module in attention_modules(model):
        queries = recorder.queries[module.layer_idx]  # [batch, q_heads, q, d]
        k = cache.layers[module.layer_idx].keys.float()  # [batch, kv_heads, context + q, d]
        group = queries.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        logits = (queries @ k.transpose(-1, -2)) * module.scaling
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        allowed = causal
        window = getattr(module, "sliding_window", None)
        if window:
            allowed = causal & (query_col - key_col < window)
        attn = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        maps.append(attn[..., :context_tokens])
    return maps


def source_attention_scores(
    source,
    keys,
    values,
    positions: torch.Tensor,
    query_ids: torch.Tensor,
    context_tokens: int,
    last_queries: int | None = None,
    reduce: str = "sum",
) -> torch.Tensor:
    """How much the source's attention from `query_ids` falls on each context token.

    Arguments as `attention_maps`; last_queries: count only the last this many query tokens
    (None: all). reduce: "sum" of the attention probabilities over layers, query heads and the
    counted queries, or "max": the largest any (layer, head, query) gives the token (a token one
    head looks at hard outranks one that many heads glance at). Returns [batch, context_tokens]
    float32.
    """
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce={reduce!r}; expected 'sum' or 'max'")
    maps = attention_maps(source, keys, values, positions, query_ids, context_tokens)
    total = torch.zeros(query_ids.shape[0], context_tokens, device=maps[0].device)
    for attn in maps:
        counted = attn if last_queries is None else attn[:, :, -last_queries:]
        if reduce == "sum":
            total += counted.sum(dim=(1, 2))
        else:
            total = torch.maximum(total, counted.amax(dim=(1, 2)))
    return total


def scores_on_target(source_scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Source-token scores [batch, S] carried to target columns: [batch, T] where rows [batch, T]
    names the source token read by each target column (-1: none, score 0)."""
    gathered = source_scores.gather(1, rows.clamp(min=0).to(source_scores.device))
    return torch.where(rows.to(source_scores.device) >= 0, gathered, 0.0)


def source_guided_scores(
    source,
    source_kv,
    source_rows: torch.Tensor,
    *,
    query_ids: torch.Tensor | None = None,
    context_ids: torch.Tensor | None = None,
    recent: int = 16,
    spread: int = 0,
    last_queries: int | None = None,
    reduce: str = "sum",
    after: int = 0,
) -> torch.Tensor:
    """Scores per TARGET column from the source's attention (for `BridgedCache(refresh_by=...)`).

    Args:
        source: the source model; source_kv: its `SourceKV` of the context (every row kept).
        source_rows: [batch, target tokens] the source token each target column reads (-1: none).
        query_ids: [batch, q] what the source reads after the context (the prompt, in the source's
            tokens). Without it, the source's last `recent` context tokens (`context_ids`
            [1, source tokens]) read the context before them, and those recent tokens score
            highest themselves (a continuation depends on them most).
        spread: each token's score also reaches its `spread` neighbours on either side (a running
            max), so a refresh picks whole spans around what the source attended to.
        last_queries: count the attention of only the prompt's last this many tokens (where an
            answer is read out, e.g. "Answer:"); None: every prompt token.
        reduce: "sum" or "max" over layers, heads and queries (see source_attention_scores).
        after: each token's score also reaches the `after` tokens that follow it: what a text
            says about something tends to follow its mention ("X lives in Y"), and the source's
            attention from a question finds the mention (docs/results.md measures it).
    Returns:
        [batch, target tokens] float32 on the CPU.
    """
    if any(source_kv.first_token):
        raise ValueError("source-guided refresh needs every source row: capture the source with capture_kv")
    tokens = source_kv.num_tokens
    if query_ids is not None and query_ids.shape[1] > 0:
        scores = source_attention_scores(
            source,
            source_kv.keys,
            source_kv.values,
            source_kv.position_ids,
            query_ids,
            tokens,
            last_queries,
            reduce,
        )
    else:
        if context_ids is None or context_ids.shape != (1, tokens):
            raise ValueError(
                "source-guided refresh without a prompt needs the source's context ids [1, source tokens]"
            )
        recent = min(recent, tokens - 1)
        if recent <= 0:
            return torch.zeros(source_rows.shape)
        scores = source_attention_scores(
            source,
            source_kv.keys,
            source_kv.values,
            source_kv.position_ids,
            query_ids=context_ids[:, tokens - recent :],
            context_tokens=tokens - recent,
            reduce=reduce,
        )
        top = float(scores.max()) + 1.0
        scores = torch.nn.functional.pad(scores, (0, recent), value=top)
    if after > 0:  # a running max over the `after` tokens before each one, on the source's tokens
        padded = torch.nn.functional.pad(scores.float()[:, None], (after, 0), value=float("-inf"))
        scores = torch.nn.functional.max_pool1d(padded, after + 1, stride=1)[:, 0]
    scores = scores_on_target(scores.float().cpu(), source_rows.cpu())
    if spread > 0:
        scores = torch.nn.functional.max_pool1d(scores[:, None], 2 * spread + 1, stride=1, padding=spread)[
            :, 0
        ]
    return scores


def target_guided(prompt_ids: torch.Tensor, last_queries: int | None = None):
    """A `BridgedCache(refresh_by=...)` scorer: the target reads what follows the cached prefix
    (the context's held-back tokens, then `prompt_ids` [batch, q] in the target's tokens) over the
    translated cache, and its attention on each cached column is that column's score.

    It needs no source model and costs a forward of the target over a few tokens. Measured on
    fact questions (docs/results.md) it chose worse than the source's attention, even for a
    135M source and a 0.5B target: it reads the approximate cache it is meant to repair. Returns a callable
    (target, cache, target_ids) -> [batch, prefix] float32, called by BridgedCache once its
    native layers are set (translated layers materialise as the scorer reads them).
    """

    def scores(target, cache, target_ids: torch.Tensor) -> torch.Tensor:
        tr = cache.translator
        prefix = tr.prefix_length
        device = tr.target_positions.device
        query = torch.cat([target_ids[:, prefix:].to(device), prompt_ids.to(device, torch.long)], dim=1)
        if any(window is not None for window in tr.windows):  # its layers keep only a window
            raise ValueError(
                "refresh_by='target' reads every cached column of every layer; this target has "
                "sliding-window layers: use refresh_by='source' or 'deviation'"
            )
        layers = list(cache.layers)
        scores.flops = reading_flops(target.config, query.shape[1], prefix)  # for cache.report()
        return source_attention_scores(
            target,
            [layer.keys for layer in layers],
            [layer.values for layer in layers],
            tr.target_positions,
            query,
            prefix,
            last_queries,
        )

    scores.label = "target attention"
    scores.flops = 0.0
    return scores


def blend_scores(given: torch.Tensor, scorer):
    """A scorer adding two guides, each normalised to sum 1 per row: `given` [batch, tokens]
    scores (e.g. the source's attention) and a scorer such as `target_guided(...)`."""

    def normalised(x: torch.Tensor) -> torch.Tensor:
        x = x.float().cpu().clamp(min=0)
        return x / x.sum(dim=1, keepdim=True).clamp(min=1e-12)

    def scores(target, cache, target_ids: torch.Tensor) -> torch.Tensor:
        own = scorer(target, cache, target_ids)
        scores.flops = getattr(scorer, "flops", 0.0)  # the given scores' cost is their maker's to add
        return normalised(own) + normalised(torch.as_tensor(given)[:, : own.shape[1]])

    scores.label = f"source attention + {getattr(scorer, 'label', 'given scores')}"
    scores.flops = 0.0
    return scores
