"""How an evaluation item becomes token ids for each model: plain text or each model's chat template.

An item is read in three parts:
    context  what the source has read; the target gets it as a cache (bridged) or prefills it
    prompt   what the target then reads natively: "" (ppl) or "\\nQuestion: {q}\\nAnswer:" (choice)
    scored   the strings whose log-likelihood is measured: the continuation, or " {choice}" each
Plain: the context is `tokenizer(context)` (with the model's own BOS where it adds one), in each
    model's own tokenization, as `handoff()` reads it (`bridgecache.runtime.request.tokenize_context`:
    across tokenizers tokenalign pairs them).
Chat (`chat=True`): the context is the first user message in each model's own chat template, as
    `Conversation` reads a chat (`HandoffRequest.from_chat`: tokenalign.align_chat where the
    tokenizers or templates differ; template scaffolding is computed by the target); the prompt is a second
    user message (the question, or CHAT_PPL_INSTRUCTION for ppl) and the assistant header; the
    scored strings are the assistant's reply, leading whitespace stripped.
No context: plain: the model's start token (BOS, else EOS: lm-evaluation-harness's convention) and
    the prompt; chat: the conversation without the context message. Scored strings are the same.

This module knows nothing about KV caches or metrics; it calls tokenizers, tokenalign and the
runtime's `tokenize_context` and `HandoffRequest.from_chat` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridgecache.evaluation.items import ChoiceItem, EvaluationError, GenerationItem, PplItem
from bridgecache.runtime.request import HandoffRequest, rendered_ids, same_tokenization, tokenize_context

__all__ = ["CHAT_PPL_INSTRUCTION", "Context", "Prompts"]

CHAT_PPL_INSTRUCTION = "Continue the text."


@dataclass
class Context:
    """One context for one (source, target) pair and bridge.

    source_ids [1, S], target_ids [1, T] int64, each model's own tokenization; alignment: the
    tokenalign.Alignment of target onto source, or None when both share a tokenizer (identity);
    text: the context's text; words: its `ContextWords` (each side's words in what that model
    reads) when asked for, else None."""

    alignment: object
    source_ids: torch.Tensor
    target_ids: torch.Tensor
    text: str = ""
    words: object = None


class Prompts:
    """Token ids of an item's parts for one (source tokenizer, target tokenizer) pair."""

    def __init__(self, source_tokenizer, target_tokenizer, chat: bool = False):
        self.source_tok, self.target_tok, self.chat = source_tokenizer, target_tokenizer, chat
        # Once: comparing vocabularies takes seconds for a 150K-token vocabulary.
        self.same = same_tokenization(source_tokenizer, target_tokenizer)

    def context(self, text: str, bridge, *, words: bool = False) -> Context:
        """The context as each model reads it, aligned for `bridge` (its alignment policy);
        words=True adds its words on each side (for a whole-word refresh)."""
        if not self.chat:
            alignment, source_ids, target_ids, found = tokenize_context(
                bridge, text, self.source_tok, self.target_tok, words=words
            )
            return Context(alignment, source_ids, target_ids.clone(), text, found)
        messages = [{"role": "user", "content": text}]
        request = HandoffRequest.from_chat(
            bridge, messages, self.source_tok, self.target_tok, same=self.same, words=words
        )
        return Context(request.alignment, request.source_ids, request.target_ids.clone(), text, request.words)

    def prompt(self, item: PplItem | ChoiceItem, context_text: str | None = None) -> list[int]:
        """Target ids read natively right after the context (`context_text`: chat needs it)."""
        if not self.chat:
            return self._ids(_plain_prompt(item))
        from tokenalign import render_chat

        first = [{"role": "user", "content": context_text if context_text is not None else item.context}]
        both = first + [{"role": "user", "content": _chat_message(item)}]
        head = render_chat(first, self.target_tok).text
        full = render_chat(both, self.target_tok, add_generation_prompt=True).text
        if not full.startswith(head):
            raise EvaluationError(
                "the target's chat template renders a conversation differently once a message follows "
                "the context, so the context cannot be cached on its own: evaluate without --chat"
            )
        return self._ids(full[len(head) :])

    def source_prompt(self, item: PplItem | ChoiceItem) -> list[int]:
        """The prompt in the SOURCE's tokens (plain text; chat: the question alone): what the source
        reads over its own cache to pick the context tokens a source-guided refresh recomputes."""
        text = _chat_message(item) if self.chat else _plain_prompt(item)
        if isinstance(item, PplItem):
            return []
        return self.source_tok(text, add_special_tokens=False)["input_ids"]

    def source_prompt_and_scored(self, item: PplItem | ChoiceItem) -> tuple[list[int], list[list[int]]]:
        """The prompt and the scored strings in the SOURCE's tokens (plain text): what the source
        reads and is scored on when it answers alone (evaluation.arms "source_alone")."""
        plain = isinstance(item, PplItem)
        texts = [item.continuation] if plain else [" " + c.strip() for c in item.choices]
        ids = [self.source_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        return self.source_prompt(item), ids

    def scored(self, item: PplItem | ChoiceItem) -> list[list[int]]:
        """Target ids of each scored string: [continuation] or one per choice ([]: a generation
        item's reply is generated, not scored)."""
        if isinstance(item, GenerationItem):
            return []
        if isinstance(item, PplItem):
            texts = [item.continuation.lstrip() if self.chat else item.continuation]
        else:
            texts = [c.strip() if self.chat else " " + c.strip() for c in item.choices]
        return [self._ids(t) for t in texts]

    def bare(self, item: PplItem | ChoiceItem) -> list[int]:
        """Target ids read INSTEAD of context + prompt in the no-context condition."""
        if not self.chat:
            return [_start_token(self.target_tok)] + self._ids(_plain_prompt(item))
        from tokenalign import render_chat

        messages = [{"role": "user", "content": _chat_message(item)}]
        return self._chat_ids(render_chat(messages, self.target_tok, add_generation_prompt=True))[0].tolist()

    def content_length(self, text: str) -> int:
        """Target tokens of a context's text alone (no BOS, no template): the length `cut` keeps."""
        return len(self._ids(text))

    def cut(self, text: str, tokens: int) -> str:
        """The first `tokens` target tokens' worth of `text` (the whole text if it is shorter)."""
        offsets = self.target_tok(text, add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
        if len(offsets) <= tokens:
            return text
        return text[: offsets[tokens - 1][1]]

    def _ids(self, text: str) -> list[int]:
        return self.target_tok(text, add_special_tokens=False)["input_ids"] if text else []

    def _chat_ids(self, rendered) -> torch.Tensor:
        return rendered_ids(rendered, self.target_tok)


def _plain_prompt(item: PplItem | ChoiceItem) -> str:
    return "" if isinstance(item, PplItem) else f"\nQuestion: {item.question}\nAnswer:"


def _chat_message(item: PplItem | ChoiceItem) -> str:
    return CHAT_PPL_INSTRUCTION if isinstance(item, PplItem) else item.question


def _start_token(tokenizer) -> int:
    """BOS if the tokenizer has one, else EOS: the start of a text with nothing before it."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("the target tokenizer has neither a BOS nor an EOS token to start a bare text")
    return int(token)
