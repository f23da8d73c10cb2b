"""Greedy replies after a prefix: the generation task's model-level primitive.

    reply_ids(target, prefix, prompt, max_new_tokens, stop_ids=..., one_line=..., until=...)

The prompt is fed after the prefix's cache in one forward, then one token at a time, always the
most likely (greedy, as RULER scores). It stops at a stop id (the tokenizer's EOS and the chat
template's end-of-turn), after `max_new_tokens`, with `one_line` once the reply holds a
complete non-empty line (`line_done`), or once its text holds one of the `until` strings
(lm-evaluation-harness's stop sequences; the caller cuts the text there). It consumes the
prefix's cache, as `scoring.score` does.

This module knows nothing about tasks or metrics; tokenizers only decode.
"""

from __future__ import annotations

import torch

from bridgecache.compat import cache_kwargs
from bridgecache.evaluation.scoring import Prefix

__all__ = ["reply_ids", "line_done", "stop_ids"]


def stop_ids(tokenizer) -> set[int]:
    """Ids that end a reply: EOS and, where the vocabulary has them, chat end-of-turn markers."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    for marker in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>"):
        if marker in vocab:
            ids.add(vocab[marker])
    return ids


def line_done(text: str) -> bool:
    """Whether `text` holds a non-empty line followed by a line break."""
    stripped = text.lstrip()
    return bool(stripped) and "\n" in stripped


@torch.no_grad()
def reply_ids(
    target,
    prefix: Prefix,
    prompt: list[int],
    max_new_tokens: int,
    *,
    stop: set[int] = frozenset(),
    tokenizer=None,
    one_line: bool = False,
    until: tuple[str, ...] = (),
) -> list[int]:
    """The target's greedy reply (token ids, stop id excluded) to `prompt` fed after `prefix`.

    prompt: target ids read after the prefix (may be empty: the prefix's own logits start).
    tokenizer: decodes the reply for `one_line` and `until` (needed only then).
    """
    if (one_line or until) and tokenizer is None:
        raise ValueError("one_line and until need the tokenizer to read the reply's text")
    device = target.get_input_embeddings().weight.device
    cache = prefix.cache
    logits = prefix.last_logits
    if prompt:
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        out = target(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(target, cache))
        logits = out.logits[:, -1].float()
    reply: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0].argmax())
        if token in stop:
            break
        reply.append(token)
        if one_line or until:
            text = tokenizer.decode(reply, skip_special_tokens=True)
            if (one_line and line_done(text)) or any(u in text for u in until):
                break
        if len(reply) == max_new_tokens:
            break
        ids = torch.tensor([[token]], dtype=torch.long, device=device)
        logits = target(input_ids=ids, use_cache=True, **cache_kwargs(target, cache)).logits[:, -1].float()
    return reply
