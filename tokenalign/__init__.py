"""tokenalign: which source token feeds each target token, for two tokenizers of one text.

    from tokenalign import align
    alignment, source_ids, target_ids = align(text, source_tokenizer, target_tokenizer)
    alignment.source_index  # int64 [len(target_ids)]: source token to read, or NATIVE (-1)

Modules, one job each:
    alignment.py  `Alignment` (the result), `NATIVE`, `POLICIES`
    vocab.py      what text each token id stands for (control tokens, unknown token, bytes)
    textmap.py    carry spans from one text onto a nearly identical one
    spans.py      each token's byte span in a text (offsets, or rebuilt text)
    match.py      two tokenizations' spans -> `Alignment`
    text.py       `align` (one text), `align_ids` (two id sequences)
    chat.py       `align_chat`: each model's own chat template, scaffolding NATIVE

tokenalign knows nothing about KV caches, models or torch: it sees text and tokenizers only.
bridgecache reads alignments through `bridgecache.kv.align` (gather_rows, pair_rows).
"""

from .alignment import NATIVE, POLICIES, Alignment
from .chat import RenderedChat, align_chat, render_chat
from .match import match
from .spans import TokenSpans, token_spans
from .text import Aligned, align, align_ids

__all__ = [
    "NATIVE",
    "POLICIES",
    "Aligned",
    "Alignment",
    "RenderedChat",
    "TokenSpans",
    "align",
    "align_chat",
    "align_ids",
    "match",
    "render_chat",
    "token_spans",
]
