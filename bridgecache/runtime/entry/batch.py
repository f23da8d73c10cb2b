"""Many handoffs in one pass: a batch of contexts of different lengths, one prompt.

    result = handoff_batch(bridge, source, target, contexts, prompt, source_tokenizer=s, target_tokenizer=t)
    print(result.texts)

A thin call over the setup's `HandoffEngine`: each context is tokenized (and aligned, when the
tokenizers differ) on its own, then the batch is left-padded on both sides (`HandoffRequest`): the
source reads every context in one forward pass and the prompt in one more (choosing each row's
refreshed tokens), one `BridgedCache` translates every row (per-row alignments, attention masks,
native heads and refresh budgets), and the target answers all of them in one `generate()`, whose
first forward also does every row's native work. Row b of the result is what `handoff()` gives
for contexts[b] alone, up to the rounding of padded attention (the same `HandoffConfig`, the same
selection rule, the same budget per row).

Knows nothing about how requests arrive or are split across processes.
"""

from __future__ import annotations

import torch

from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.engine import BatchHandoffResult, engine_for
from bridgecache.runtime.request import left_pad

__all__ = ["BatchHandoffResult", "handoff_batch", "left_pad"]


@torch.no_grad()
def handoff_batch(
    bridge,
    source,
    target,
    contexts: list[str],
    prompt: str = "",
    *,
    source_tokenizer,
    target_tokenizer,
    config: HandoffConfig | None = None,
    **generate_kwargs,
) -> BatchHandoffResult:
    """Let `target` continue each `context + prompt` from the KV `source` computes for the contexts.

    Args:
        bridge: a Bridge fitted for (source, target).
        source, target: transformers causal LMs.
        contexts: the texts (a list of str), any lengths; prompt: text the target reads after each.
        config: a `HandoffConfig` (default `HandoffConfig()`, as `handoff()`).
        generate_kwargs: passed to target.generate (max_new_tokens, do_sample, ...).
    """
    engine = engine_for(bridge, source, target, source_tokenizer, target_tokenizer)
    return engine.handoff_batch(contexts, prompt, config=config, **generate_kwargs)
