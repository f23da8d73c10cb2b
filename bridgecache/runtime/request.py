"""One request of a handoff: the contexts as each model reads them, the prompt, the source's KV.

    request = HandoffRequest.from_texts(bridge, contexts, prompt, source_tok, target_tok, same=s, words=True)
    request = HandoffRequest.from_chat(bridge, messages, source_tok, target_tok, words=True)
    request = HandoffRequest.from_kv(source_kv, target_ids, alignment)  # ids and KV already in hand
    request.source_kv                       SourceKV of the contexts (captured, or the caller's)
    request.input_ids, request.attention_mask    what generate() reads: contexts + prompt, left-padded

Every path that starts from text (handoff, handoff_batch, Conversation, publishing, evaluation)
builds one of these the same way (a chat: `from_chat`, for Conversation and evaluation's chat
mode): each context tokenized once per tokenizer (once in all when they agree), the two
tokenizations aligned otherwise, the words found from the same tokenizer calls, the rows
left-padded on both sides; the prompt in each tokenizer; the source's KV captured or checked.

Knows tokenizers (through tokenalign), SourceKV and capture; nothing about caches or generate().
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

import bridgecache.checks as checks
from bridgecache.bridge.maps import Bridge
from bridgecache.kv.capture import capture_kv
from bridgecache.kv.files import as_source
from bridgecache.models.spec import tokenizer_fingerprint
from bridgecache.runtime.inputs import check_text
from bridgecache.runtime.selection.words import ContextWords, word_groups

__all__ = [
    "HandoffRequest",
    "TokenizedContext",
    "context_ids",
    "left_pad",
    "pad_token_id",
    "prompt_ids",
    "rendered_ids",
    "same_tokenization",
    "tokenize_context",
]


def context_ids(tokenizer, text: str) -> torch.Tensor:
    """[1, tokens] the context as the model would read it (with its BOS where it uses one)."""
    return tokenizer(text, return_tensors="pt")["input_ids"]


def prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """[1, tokens] text read after a context (no special tokens)."""
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def pad_token_id(tokenizer) -> int | None:
    """The tokenizer's pad id, else its eos id (a pad id of 0 is a real id, not a missing one)."""
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def same_tokenization(source_tokenizer, target_tokenizer) -> bool:
    """Whether both tokenizers produce the same ids (their vocabularies' fingerprints agree)."""
    if source_tokenizer is target_tokenizer:
        return True
    return tokenizer_fingerprint(source_tokenizer) == tokenizer_fingerprint(target_tokenizer)


def rendered_ids(chat, tokenizer) -> torch.Tensor:
    """[1, N] the ids of a chat-template rendering (tokenalign.render_chat's `Rendered`)."""
    return _row(tokenizer(chat.text, add_special_tokens=chat.add_special_tokens)["input_ids"])


def _row(ids) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long).reshape(1, -1)


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, n_b] id rows -> ids [batch, max n] left-padded with pad_id, attention mask [batch, max n]."""
    width = max(row.shape[-1] for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        n = row.shape[-1]
        ids[b, width - n :] = row.reshape(-1)
        mask[b, width - n :] = 1
    return ids, mask


class TokenizedContext(NamedTuple):
    """One context as each model reads it (`tokenize_context`)."""

    alignment: object  # tokenalign.Alignment of the target's tokens onto the source's; None: one tokenization
    source_ids: torch.Tensor  # [1, S]
    target_ids: torch.Tensor  # [1, T]
    words: object = None  # its ContextWords (batch 1) when asked for, else None


def tokenize_context(
    bridge, text: str, source_tokenizer, target_tokenizer, *, words: bool = False, same: bool | None = None
) -> TokenizedContext:
    """The `TokenizedContext` of one context text: the same ids tensor for both sides when the
    tokenizers agree (tokenized once), else both tokenizations aligned with `bridge`'s policy;
    words=True adds the text's words on each side, from the byte spans of the same tokenizer calls.
    same: whether the tokenizers agree, if known (an engine knows; None: compared here)."""
    from tokenalign import match, token_spans

    check_text(text, "text", allow_empty=True)
    checks.instance(bridge, "bridge", Bridge, "a bridgecache Bridge")
    checks.tokenizer(source_tokenizer, "source_tokenizer")
    checks.tokenizer(target_tokenizer, "target_tokenizer")
    as_batch = lambda ids: torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)  # noqa: E731
    if same is None:
        same = same_tokenization(source_tokenizer, target_tokenizer)
    if same:
        if not words:
            ids = context_ids(target_tokenizer, text)
            return TokenizedContext(None, ids, ids)
        ids, spans = token_spans(text, target_tokenizer)
        groups = word_groups(text, spans=spans)
        ids = as_batch(ids)
        return TokenizedContext(None, ids, ids, ContextWords.rows([groups], [groups]))
    policy = bridge.alignment_policy if bridge.alignment_policy != "identity" else "last"
    source_ids, source_spans = token_spans(text, source_tokenizer)  # tokenalign.align, spans kept
    target_ids, target_spans = token_spans(text, target_tokenizer)
    alignment = match(source_spans, target_spans, policy)
    found = None
    if words:
        source_groups, target_groups = (word_groups(text, spans=x) for x in (source_spans, target_spans))
        found = ContextWords.rows([source_groups], [target_groups])
    return TokenizedContext(alignment, as_batch(source_ids), as_batch(target_ids), found)


@dataclass
class HandoffRequest:
    """One request's inputs, as every path hands them to the cache and to generate().

    source_ids, source_mask: [batch, S] the contexts in the source's tokens (left-padded; source_ids
        None where the caller holds the source's KV and not its ids: `from_kv`);
    target_ids, target_mask: [batch, T] the same in the target's tokens;
    alignment: None (one tokenization), a tokenalign.Alignment (batch 1) or one per row;
    words: the contexts' ContextWords on both sides, or None;
    source_prompt: [batch, q_s] the prompt in the source's tokens (what it reads to choose the
        refreshed tokens; None: no prompt known yet); target_prompt: [batch, q_t];
    source_kv: the source's SourceKV of the contexts; source_prefill_s: what capturing it took
        (0.0 when the caller gave it).
    """

    source_ids: torch.Tensor
    source_mask: torch.Tensor | None
    target_ids: torch.Tensor
    target_mask: torch.Tensor | None
    alignment: object
    words: ContextWords | None
    source_prompt: torch.Tensor | None
    target_prompt: torch.Tensor | None
    source_kv: object = None
    source_prefill_s: float = 0.0

    @property
    def batch_size(self) -> int:
        return self.target_ids.shape[0]

    @classmethod
    def from_texts(
        cls, bridge, contexts: list[str], prompt: str | None, source_tokenizer, target_tokenizer, *,
        same: bool, words: bool,
    ) -> HandoffRequest:  # fmt: skip
        """The request of `contexts` (one row each) and `prompt` (None: no prompt yet); a batch of
        one keeps its tensors unpadded (no masks)."""
        rows = [
            tokenize_context(bridge, t, source_tokenizer, target_tokenizer, words=words, same=same)
            for t in contexts
        ]
        alignments, source_rows, target_rows, row_words = (list(side) for side in zip(*rows, strict=True))
        batch = len(contexts)
        if batch == 1:
            source_ids, target_ids, source_mask, target_mask = source_rows[0], target_rows[0], None, None
            alignment, found = alignments[0], row_words[0]
        else:
            pad_id = pad_token_id(target_tokenizer)
            source_ids, source_mask = left_pad(source_rows, pad_id=0)
            target_ids, target_mask = left_pad(target_rows, pad_id=0 if pad_id is None else pad_id)
            alignment = None if same else alignments
            found = ContextWords.stack(row_words) if words else None
        target_prompt = source_prompt = None
        if prompt is not None:
            target_prompt = prompt_ids(target_tokenizer, prompt).expand(batch, -1)
            source_prompt = target_prompt if same else prompt_ids(source_tokenizer, prompt).expand(batch, -1)
        return cls(
            source_ids, source_mask, target_ids, target_mask, alignment, found, source_prompt, target_prompt
        )

    @classmethod
    def from_chat(
        cls, bridge, messages: list[dict], source_tokenizer, target_tokenizer, *, same: bool | None = None,
        words: bool = False,
    ) -> HandoffRequest:  # fmt: skip
        """The request of a chat (batch 1, no prompt yet, no source KV): `messages` in each model's
        own chat template (tokenalign.render_chat), one rendering read by both when the tokenizers
        (`same`, None: compared here) and their templates agree, else both aligned with `bridge`'s
        policy (tokenalign.align_chat); words=True adds each rendering's words."""
        from tokenalign import align_chat, render_chat

        checks.instance(bridge, "bridge", Bridge, "a bridgecache Bridge")
        checks.tokenizer(source_tokenizer, "source_tokenizer")
        checks.tokenizer(target_tokenizer, "target_tokenizer")
        if same is None:
            same = same_tokenization(source_tokenizer, target_tokenizer)
        template = getattr(source_tokenizer, "chat_template", None)
        target_chat = render_chat(messages, target_tokenizer)
        if same and template == getattr(target_tokenizer, "chat_template", None):
            alignment, source_chat = None, target_chat
            source_ids = target_ids = rendered_ids(target_chat, target_tokenizer)
        else:
            policy = bridge.alignment_policy if bridge.alignment_policy != "identity" else "last"
            alignment, source_ids, target_ids = align_chat(
                messages, source_tokenizer, target_tokenizer, policy=policy
            )
            source_ids, target_ids = _row(source_ids), _row(target_ids)
            source_chat = render_chat(messages, source_tokenizer)
        found = None
        if words:
            texts = [source_chat.text], [target_chat.text]
            found = ContextWords.of(*texts, source_tokenizer, target_tokenizer, [source_ids], [target_ids])
        return cls(source_ids, None, target_ids, None, alignment, found, None, None)

    @classmethod
    def from_kv(
        cls, source_kv, target_ids: torch.Tensor, alignment=None, *, target_mask=None, source_mask=None,
        words=None, source_prompt=None,
    ) -> HandoffRequest:  # fmt: skip
        """The request of a context whose source KV and target ids the caller holds already
        (evaluation, held-out scoring): no tokenizer, no source ids, nothing read again."""
        request = cls(None, source_mask, target_ids, target_mask, alignment, words, source_prompt, None)
        return request.read_source(None, source_kv)

    def read_source(self, source, source_kv=None, *, fingerprint: str | None = None) -> HandoffRequest:
        """Take the source's KV of the contexts: `source_kv` checked against the contexts (KV of
        another model or another document is refused), or `source`'s prefill of them, timed
        (fingerprint: the source's weight fingerprint where the caller holds it, `capture_kv`)."""
        if source_kv is not None:
            self.source_kv = as_source(source_kv, self.source_mask, model=source, input_ids=self.source_ids)
            return self
        if source is None:
            raise ValueError("pass either the source model or its KV of the context (source_kv=)")
        device = source.get_input_embeddings().weight.device
        start = time.perf_counter()
        mask = None if self.source_mask is None else self.source_mask.to(device)
        self.source_kv = capture_kv(
            source, self.source_ids.to(device), attention_mask=mask, fingerprint=fingerprint
        )
        self.source_prefill_s = time.perf_counter() - start
        return self

    def inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) [batch, T + q_t] on `device`: contexts then the prompt."""
        prompt = self.target_prompt
        if prompt is None:
            prompt = self.target_ids[:, :0]
        ids = torch.cat([self.target_ids, prompt.to(self.target_ids.dtype)], dim=1)
        mask = torch.ones_like(ids) if self.target_mask is None else torch.cat(
            [self.target_mask, torch.ones_like(prompt)], dim=1
        )  # fmt: skip
        return ids.to(device), mask.to(device)
