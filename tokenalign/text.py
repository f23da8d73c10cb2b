"""`align` and `align_ids`: align two tokenizations of one text.

    align(text, source_tokenizer, target_tokenizer)          tokenizes the text with both
    align_ids(source_ids, source_tok, target_ids, target_tok) ids already made; the text is rebuilt
                                                              from each side's own vocabulary

Both put every token's span on one coordinate system (bytes of one text) and `match` them.
This module knows nothing about KV caches or models; tokenizers are used through their own API.
"""

from __future__ import annotations

from typing import NamedTuple

from .alignment import Alignment
from .match import match
from .spans import TokenSpans, as_ids, token_spans
from .textmap import TextMap
from .vocab import Vocab

__all__ = ["Aligned", "align", "align_ids"]


class Aligned(NamedTuple):
    """An alignment and the two id sequences it describes (unpacks as a 3-tuple)."""

    alignment: Alignment
    source_ids: list[int]
    target_ids: list[int]


def align(
    text: str,
    source_tokenizer,
    target_tokenizer,
    *,
    policy: str = "last",
    source_ids=None,
    target_ids=None,
    add_special_tokens: bool = True,
) -> Aligned:
    """Align the target's tokenization of `text` onto the source's.

    Args:
        text: the context both models read.
        source_tokenizer, target_tokenizer: transformers tokenizers (fast ones use their offsets;
            others are decoded token by token).
        policy: recorded in the alignment (one of `POLICIES`); the arrays serve every policy.
        source_ids, target_ids: ids the caller already has for `text` (1-D list, array or CPU
            tensor), e.g. with or without BOS; each side is tokenized here when None.
        add_special_tokens: passed to a tokenizer that tokenizes here (BOS for Gemma, say); the
            special tokens it adds are NATIVE.
    Returns:
        Aligned(alignment [len(target_ids)], source_ids, target_ids).
    """
    source_ids, source = token_spans(
        text, source_tokenizer, source_ids, add_special_tokens=add_special_tokens
    )
    target_ids, target = token_spans(
        text, target_tokenizer, target_ids, add_special_tokens=add_special_tokens
    )
    return Aligned(match(source, target, policy), source_ids, target_ids)


def align_ids(
    source_ids, source_tokenizer, target_ids, target_tokenizer, *, policy: str = "last"
) -> Alignment:
    """Align two id sequences of one text without the text: each side's text is rebuilt from its own
    vocabulary (vocab.py) and the source's is mapped onto the target's where they differ
    (normalisation, dummy-prefix spaces, unknown tokens). Returns an alignment `[len(target_ids)]`."""
    source_ids, target_ids = as_ids(source_ids), as_ids(target_ids)
    source_text, *source_span = Vocab.of(source_tokenizer).reconstruct(source_ids)
    target_text, *target_span = Vocab.of(target_tokenizer).reconstruct(target_ids)
    source = TokenSpans(*source_span).project(TextMap.diff(source_text, target_text))
    return match(source, TokenSpans(*target_span), policy)
