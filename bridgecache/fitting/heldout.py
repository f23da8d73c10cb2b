"""Held-out quality of a fitted bridge per target layer: attention-output cosine.

For each held-out calibration sequence (the ones the maps were never fitted on), the target
reads the context natively; at up to 32 query rows per layer, its own queries attend (a) to its
own keys/values and (b) to the bridged keys/values of the same context, and the cosine between
the two attention outputs is averaged over rows and query heads. Full-Head's study found this
predicts transfer quality far better than key R^2 (r = +0.57 vs -0.20). The quality gate
(bridgecache.runtime.gate) reads the result from `bridge.calibration["heldout_scores"]`.

Knows models and bridges; tokenizers only through `bridgecache.fitting.calibration`.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from bridgecache.compat import cache_kwargs
from bridgecache.fitting.attention import QueryRecorder, attention_modules, softmax_with_sinks
from bridgecache.fitting.calibration import calibration_sequences
from bridgecache.kernels import use_backend
from bridgecache.kv.capture import capture_kv
from bridgecache.models.code import decoder_of
from bridgecache.models.layout import layer_chunk, layer_sinks, layer_window
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.engine import HandoffEngine
from bridgecache.runtime.request import HandoffRequest

__all__ = ["attention_cosine", "score_bridge"]


def _outputs(queries, keys, values, rows, columns, module) -> torch.Tensor:
    """Attention outputs [q_heads, rows, d] of `queries` [1, q_heads, rows, d] over keys/values
    [1, kv_heads, columns, d] whose absolute columns are `columns` [columns]."""
    group = queries.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    logits = (queries.float() @ k.transpose(-1, -2)) * module.scaling
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    allowed = columns[None, :] <= rows[:, None]
    window = layer_window(module)
    if window:
        allowed &= rows[:, None] - columns[None, :] < window
    chunk = layer_chunk(module)
    if chunk:
        allowed &= rows[:, None] // chunk == columns[None, :] // chunk
    return (softmax_with_sinks(logits.masked_fill(~allowed, float("-inf")), layer_sinks(module)) @ v)[0]


# Scores the maps: never the native route, and no CUDA graphs (captured per held-out shape, they
# cost more than they save: on an H100, 500 x 1,024 tokens of Qwen2.5-7B -> 1.5B, the scoring took
# 43.7 s through an engine that captured them, 26.4 s through a private state per sequence).
_MAPS_ONLY = HandoffConfig(refresh=None, route="handoff", cuda_graphs=False)
# ... and through the kernels' PyTorch references: on a machine whose Triton cache is cold, the
# Triton kernels' compilation and autotuning outweigh the scoring itself (H100, 64 x 1,024 tokens of
# Qwen2.5-7B -> 1.5B: the scoring took 27.7 s in a fresh process, 2.9 s when run again after it).
_SCORING_KERNELS = "torch"


@torch.no_grad()
def attention_cosine(bridge, source, target, contexts, rows_per_context: int = 32, progress: bool = False):
    """Per target layer, the mean cosine between attention outputs over native and bridged KV.

    contexts: (source_ids [1, S], target_ids [1, T], alignment or None) triples, on any device
        (each model reads its ids on its own device; the comparison runs on the target's).
    Returns a list of floats, one per target layer (1.0 = the bridged cache attends exactly alike).
    """
    modules = attention_modules(target)
    device = target.get_input_embeddings().weight.device
    # On the target's device: a copy to the host per layer would wait for the GPU every time.
    totals = torch.zeros(len(modules), dtype=torch.float64, device=device)
    counts = torch.zeros(len(modules), dtype=torch.float64)
    # One engine for every context: the target's views and plans are made once, not per context.
    engine = HandoffEngine(bridge, source, target, config=_MAPS_ONLY, graph_bytes=0)
    with engine, use_backend(_SCORING_KERNELS):
        for source_ids, target_ids, alignment in tqdm(contexts, desc="held-out scores", disable=not progress):
            _score_context(bridge, source, target, engine, modules, source_ids, target_ids.to(device),
                           alignment, rows_per_context, totals, counts)  # fmt: skip
    totals = totals.cpu()
    return [round(float(t / c), 4) if c else float("nan") for t, c in zip(totals, counts)]


def _score_context(bridge, source, target, engine, modules, source_ids, target_ids, alignment,
                   rows_per_context, totals, counts) -> None:  # fmt: skip
    """Add one context's per-layer cosine sums to `totals` and their counts to `counts`."""
    device = target_ids.device
    # Decoders only: the KV and queries without the vocabulary projection (a quarter of Qwen 0.5B's work).
    source_kv = capture_kv(source, source_ids)
    # The maps alone: no refresh (the native head, as every handoff computes it, included).
    cache = engine.cache(HandoffRequest.from_kv(source_kv, target_ids, alignment))  # engine: _MAPS_ONLY
    cache.materialize()
    prefix, first = cache.get_seq_length(), cache.translated_positions.start
    if prefix - first < 2:
        return
    count = min(rows_per_context, prefix - first - 1)
    host_rows = torch.linspace(first + 1, prefix - 1, count).round().long().unique()  # [rows], ascending
    rows = host_rows.to(device)
    native = DynamicCache()
    with QueryRecorder(target, rows) as recorder:
        decoder = decoder_of(target) or target
        decoder(input_ids=target_ids[:, :prefix], use_cache=True, **cache_kwargs(decoder, native))
    for i, module in enumerate(modules):
        bridged_k, bridged_v = cache.layers[i].keys, cache.layers[i].values
        start = prefix - bridged_k.shape[2]
        columns = torch.arange(start, prefix, device=bridged_k.device)
        # A sliding layer holds only its window's rows: skip the rows before it (counted on the
        # host, the rows ascending, so no GPU wait)
        skip = int((host_rows < start).sum())
        if skip == len(host_rows):
            continue
        layer_rows = rows[skip:].to(bridged_k.device)
        queries = recorder.queries[i][:, :, skip:].to(bridged_k.device)
        native_k = native.layers[i].keys[:, :, start:].to(bridged_k.device)
        native_v = native.layers[i].values[:, :, start:].to(bridged_k.device)
        a = _outputs(queries, native_k, native_v, layer_rows, columns, module)
        b = _outputs(queries, bridged_k, bridged_v, layer_rows, columns, module)
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # [q_heads, rows]
        totals[i] += cosine.double().sum().to(device)
        counts[i] += cosine.numel()


def score_bridge(
    bridge,
    source,
    target,
    source_tokenizer,
    target_tokenizer,
    progress: bool = True,
    *,
    sequences=None,
    limit: int | None = None,
) -> dict:
    """Score `bridge` on held-out sequences; stores and returns `bridge.calibration["heldout_scores"]`
    = {"attention_cosine": [...], "mean": x, "sequences": n} (and "heldout_sequences", how many
    there were, when `limit` left some out).

    sequences: the fit's own `CalibSequence`s (fit_bridge passes them: user text cannot be read
        back from the recipe); None: rebuilt from the bridge's built-in calibration recipe.
    limit: score at most this many held-out sequences, spread evenly over them (None: all).
    """
    if sequences is None:
        heldout = recipe_contexts(bridge, source_tokenizer, target_tokenizer, heldout=True, lazy=True)
    else:
        heldout = [s for s in sequences if s.heldout]
    chosen = spread(len(heldout), limit)
    policy = bridge.alignment_policy if bridge.alignment_policy != "identity" else None
    contexts = [_context(heldout[i], source_tokenizer, target_tokenizer, policy) for i in chosen]
    scores = attention_cosine(bridge, source, target, contexts, progress=progress)
    finite = [s for s in scores if s == s]
    result = {
        "attention_cosine": scores,
        "mean": round(sum(finite) / len(finite), 4) if finite else float("nan"),
        "sequences": len(contexts),
    }
    if len(contexts) < len(heldout):
        result["heldout_sequences"] = len(heldout)
    bridge.calibration["heldout_scores"] = result
    return result


def spread(available: int, limit: int | None) -> list[int]:
    """Indices of up to `limit` of `available` items, evenly spaced from the first (all for None):
    a "mixed" text alternates prose and code, so the first few alone would not be typical."""
    if limit is None or limit >= available:
        return list(range(available))
    return sorted({round(i * available / limit) for i in range(limit)})


def recipe_contexts(
    bridge, source_tokenizer, target_tokenizer, *, heldout: bool, lazy: bool = False
) -> list[tuple]:
    """The held-out (or the training) sequences of the bridge's own calibration recipe, each as
    (source_ids [1, S], target_ids [1, T], alignment or None); lazy: the `CalibSequence`s
    themselves (nothing aligned yet)."""
    c = bridge.calibration
    missing = [k for k in ("num_sequences", "seq_len", "domain") if k not in c]
    if missing:
        raise ValueError(f"the bridge records no calibration recipe ({missing} missing): pass texts")
    if c.get("text_sha256"):
        raise ValueError(
            "the bridge was fitted on the user's own text (recorded by its hash only): score it on "
            "contexts of that text with attention_cosine"
        )
    policy = bridge.alignment_policy if bridge.alignment_policy != "identity" else None
    seqs, _ = calibration_sequences(
        source_tokenizer,
        target_tokenizer,
        num_sequences=c["num_sequences"],
        seq_len=c["seq_len"],
        domain=c["domain"],
        policy=policy,
        native_head=bridge.native_head,
        heldout_every=c.get("heldout_every", 8),
        seed=c.get("seed", 0),
    )
    seqs = [s for s in seqs if s.heldout == heldout]
    return seqs if lazy else [_context(s, source_tokenizer, target_tokenizer, policy) for s in seqs]


def _context(seq, source_tokenizer, target_tokenizer, policy):
    """(source_ids [1, S], target_ids [1, T], alignment or None) of a held-out sequence; across
    tokenizers its text is aligned again (calibration keeps only the row pairs)."""
    if policy is None:
        return seq.source_ids[None], seq.target_ids[None], None
    import tokenalign

    text = target_tokenizer.decode(seq.target_ids, skip_special_tokens=True)
    alignment, source_ids, target_ids = tokenalign.align(
        text, source_tokenizer, target_tokenizer, policy=policy
    )
    as_row = lambda ids: torch.as_tensor(ids, dtype=torch.long)[None]  # noqa: E731
    return as_row(source_ids), as_row(target_ids), alignment
