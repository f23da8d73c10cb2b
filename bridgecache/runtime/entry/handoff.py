"""One call for the common case: the source has read a context; the target continues from it.

    result = handoff(bridge, source, target, context, prompt, source_tokenizer=..., target_tokenizer=...)
    print(result.text)

A thin call over the setup's `HandoffEngine` (bridgecache.runtime.engine; `engine_for` keeps the
two most recently used, `bridgecache.clear_engines()` frees them): it tokenizes the context once
per tokenizer (once in all when both models share one), aligns the two tokenizations when they
differ and finds its words from the same tokenizer calls, runs the source's prefill (or takes
`source_kv`), builds a `BridgedCache` with the given `HandoffConfig` (default: 20% of the context
refreshed in whole words, chosen by the source's attention from the prompt) and calls the target's
own `generate()`, whose first forward also does the cache's native work.
"""

from __future__ import annotations

import torch

from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.engine import HandoffResult, engine_for
from bridgecache.runtime.request import (
    TokenizedContext,
    context_ids,
    pad_token_id,
    prompt_ids,
    same_tokenization,
    tokenize_context,
)

__all__ = [
    "HandoffResult",
    "TokenizedContext",
    "handoff",
    "align_context",
    "context_ids",
    "prompt_ids",
    "pad_token_id",
    "same_tokenization",
    "tokenize_context",
]


def align_context(bridge, text: str, source_tokenizer, target_tokenizer):
    """(alignment or None, source_ids [1, S], target_ids [1, T]) for one context text; the same
    ids tensor for both when the tokenizers agree (tokenized once)."""
    return tokenize_context(bridge, text, source_tokenizer, target_tokenizer)[:3]


@torch.no_grad()
def handoff(
    bridge,
    source,
    target,
    context: str,
    prompt: str = "",
    *,
    source_tokenizer,
    target_tokenizer,
    config: HandoffConfig | None = None,
    source_kv=None,
    **generate_kwargs,
) -> HandoffResult:
    """Let `target` continue `context + prompt` from the KV that `source` computed for `context`.

    Args:
        bridge: a Bridge fitted for (source, target).
        source, target: transformers causal LMs (source may be None when `source_kv` is given and
            the configuration's selection rule does not read with it).
        context: the text the source has read; prompt: text the target reads after it natively
            (and the source reads to choose the refreshed tokens).
        config: a `HandoffConfig` (default `HandoffConfig()`: the defaults of every path).
        source_kv: the source's KV of `context` if already computed (a SourceKV, a transformers
            cache, per-layer tensors or a save_kv path); else the source prefills it here.
        generate_kwargs: passed to target.generate (max_new_tokens, do_sample, num_beams, ...).
    """
    engine = engine_for(bridge, source, target, source_tokenizer, target_tokenizer)
    return engine.handoff(context, prompt, config=config, source_kv=source_kv, **generate_kwargs)
