"""A chat that the target carries on over one cache, after a handoff or from its own prefill.

    chat = Conversation.handoff(bridge, source, target, messages, source_tokenizer=..., target_tokenizer=...)
    turn = chat.ask("And who towed it in?", max_new_tokens=48)    # appended to the same cache
    turn = chat.ask("Thanks. What was the Marigold carrying?")

`handoff`: the source has read the earlier turns (`messages`, rendered by ITS chat template); the
target's cache of the same turns (rendered by the target's template) is translated from it, with
tokenalign's chat alignment across tokenizers (template scaffolding is computed by the target).
The cache is built at the first `ask` (or `score`), with the `HandoffConfig` given (default: as
`handoff()`): the source reads that first question to choose the refreshed tokens, and their
native work joins the first answer's forward.
`native`: the target reads the turns itself (the reference a handoff is measured against).
Each `ask` renders the whole chat with the target's template plus the generation prompt, keeps
the cached tokens that the rendering still starts with (crop), feeds the rest and generates:
earlier turns are never recomputed (only tokens the template renders differently, such as a
re-tokenized reply, are fed again). `score` measures answer choices the same way and adds nothing
to the chat.

Knows chat templates (through tokenalign), the cache and generate(); nothing about fitting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

import bridgecache.checks as checks
from bridgecache.compat import cache_kwargs
from bridgecache.runtime.cache import BridgedCache
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.engine import engine_for
from bridgecache.runtime.entry.likelihood import Prefix, score
from bridgecache.runtime.inputs import (
    check_config,
    check_contexts,
    check_engine,
    check_generate_kwargs,
    check_messages,
    check_setup,
    check_text,
)
from bridgecache.runtime.request import HandoffRequest, pad_token_id, prompt_ids, rendered_ids

__all__ = ["Conversation", "Turn"]


@dataclass
class Turn:
    """One user message and the target's reply.

    reused: tokens of the rendering already in the cache; fed: tokens the target read this turn
    (the rest of the rendering); new_tokens: tokens it generated.
    """

    question: str
    answer: str
    reused: int
    fed: int
    new_tokens: int
    seconds: float


@dataclass(frozen=True)
class _Handoff:
    """What the first question builds a conversation's bridged cache from: the engine and the
    request of the earlier turns (the source's KV already read)."""

    engine: object
    request: HandoffRequest
    config: HandoffConfig | None

    def cache(self, question: str) -> BridgedCache:
        """The bridged cache of the earlier turns; the source reads `question` to choose the
        refreshed tokens."""
        engine = self.engine
        prompt = prompt_ids(engine.source_tokenizer, question).to(_device(engine.source))
        return engine.cache(replace(self.request, source_prompt=prompt), self.config)


@dataclass
class Conversation:
    """messages: the chat so far; ids: [1, N] its target rendering (plus generated tokens), of which
    the first `cache.get_seq_length()` are in `cache` (None until the first question of a
    handoff, which builds it)."""

    target: object
    tokenizer: object
    messages: list[dict]
    cache: DynamicCache | None
    ids: torch.Tensor
    turns: list[Turn] = field(default_factory=list)
    _handoff: _Handoff | None = None
    _engine: object = None

    def _check_fits(self, tokens: int) -> None:
        """Refuse a turn that would take the chat past the target's window (before it runs)."""
        limit = getattr(self.target.config.get_text_config(), "max_position_embeddings", None)
        if limit and tokens > limit:
            raise ValueError(
                f"this turn would take the conversation to {tokens} target tokens (the chat so far and "
                f"the new message); the target model reads at most {limit}"
            )

    @classmethod
    @torch.no_grad()
    def handoff(
        cls,
        bridge,
        source,
        target,
        messages,
        *,
        source_tokenizer,
        target_tokenizer,
        config: HandoffConfig | None = None,
        engine=None,
    ) -> Conversation:
        """The source reads `messages` (its chat template); the target continues on a bridged
        cache of them, made with `config` (default `HandoffConfig()`, as `handoff()`) by `engine`
        (a `HandoffEngine` of exactly these models; None: the setup's shared one)."""
        messages = [dict(m) for m in check_messages(messages)]
        config = None if config is None else check_config(config)
        check_setup(bridge, source, target, source_tokenizer, target_tokenizer)
        if engine is None:
            engine = engine_for(bridge, source, target, source_tokenizer, target_tokenizer)
        else:  # compared, never assumed: the engine's plans are of its own models
            check_engine(engine, bridge, target, None)
            checks.same(engine.source, source, "engine", "source model")
            checks.same(engine.source_tokenizer, source_tokenizer, "engine", "source tokenizer")
            checks.same(engine.target_tokenizer, target_tokenizer, "engine", "target tokenizer")
        wants_words = (config or HandoffConfig()).wants_words
        request = HandoffRequest.from_chat(
            bridge,
            messages,
            source_tokenizer,
            target_tokenizer,
            same=engine.same_tokenizer,
            words=wants_words,
        )
        engine.check_fits(request)
        request.read_source(source)
        request.target_ids = request.target_ids.to(_device(target))
        parts = _Handoff(engine, request, config)
        return cls(
            target, target_tokenizer, messages, None, request.target_ids, _handoff=parts, _engine=engine
        )

    @classmethod
    def native(cls, target, target_tokenizer, messages) -> Conversation:
        """The target reads `messages` itself, on its first `ask` (the reference for a handoff)."""
        checks.model(target, "target")
        checks.tokenizer(target_tokenizer, "target_tokenizer")
        messages = [dict(m) for m in check_messages(messages)]
        ids = _render(messages, target_tokenizer).to(_device(target))
        return cls(target, target_tokenizer, messages, DynamicCache(config=target.config), ids)

    @torch.no_grad()
    def ask(self, content: str, **generate_kwargs) -> Turn:
        """Add a user message, generate the reply on the same cache, add it; returns the Turn."""
        check_text(content, "content")
        check_generate_kwargs(
            generate_kwargs, getattr(self.target.config.get_text_config(), "max_position_embeddings", None)
        )
        start = time.perf_counter()
        ids, reused = self._prompt(content)
        generate_kwargs.setdefault("max_new_tokens", 64)
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", pad_token_id(self.tokenizer))
        self._check_fits(ids.shape[1])
        if self._engine is not None:  # its first forward does a bridged cache's native work
            output = self._engine.generate(self.cache, ids, torch.ones_like(ids), **generate_kwargs)
        else:
            output = self.target.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                **cache_kwargs(self.target, self.cache),
                **generate_kwargs,
            )
        seconds = time.perf_counter() - start
        if not isinstance(output, torch.Tensor):  # the chat keeps ids; return_dict_in_generate is allowed
            output = output.sequences
        new = output[:, ids.shape[1] :]
        answer = self.tokenizer.decode(new[0], skip_special_tokens=True).strip()
        self.messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        self.ids = output
        turn = Turn(content, answer, reused, ids.shape[1] - reused, new.shape[1], seconds)
        self.turns.append(turn)
        return turn

    @torch.no_grad()
    def score(self, content: str, replies: list[str]) -> list[float]:
        """Mean log-likelihood per token of each reply to a user message; the chat is left unchanged
        (the cache keeps no trace of the message; it may drop tokens the next turn would not reuse)."""
        check_text(content, "content")
        replies = check_contexts(replies, "replies")
        rows = [self.tokenizer(r.strip(), add_special_tokens=False)["input_ids"] for r in replies]
        empty = next((i for i, row in enumerate(rows) if not row), None)
        if empty is not None:  # before the forward: nothing of it would be scored
            raise ValueError(
                f"replies[{empty}]={checks.shown(replies[empty])} has no tokens; expected some text"
            )
        ids, reused = self._prompt(content)
        length = self.cache.get_seq_length()
        out = self.target(
            input_ids=ids[:, reused:],
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(self.target, self.cache),
        )
        prefix = Prefix(self.cache, out.logits[:, -1].float(), ids.shape[1], 0.0)
        scores = [total / count for total, count in score(self.target, prefix.copy(), rows)]
        _crop(self.cache, length)  # forget the message: the chat is as it was
        return scores

    def _prompt(self, content: str) -> tuple[torch.Tensor, int]:
        """The rendering with `content` added and the generation prompt; the cache cropped to the
        tokens it shares with what is cached (after a handoff, first built from `content`).
        Returns (ids [1, N], tokens reused)."""
        if self.cache is None:
            self.cache, self._handoff = self._handoff.cache(content), None
        messages = self.messages + [{"role": "user", "content": content}]
        ids = _render(messages, self.tokenizer, add_generation_prompt=True).to(self.ids.device)
        cached = self.cache.get_seq_length()
        known = self.ids[0, :cached]
        width = min(len(known), ids.shape[1] - 1)  # at least one token is fed
        differs = (known[:width] != ids[0, :width]).nonzero()
        reused = int(differs[0]) if len(differs) else width
        if reused < cached:
            _crop(self.cache, reused)  # the template re-rendered something (a reply re-tokenized)
        return ids, reused


def _crop(cache, length: int) -> None:
    # A negative count removes that many tokens on every transformers 5.x (5.24 rejects a length).
    removed = cache.get_seq_length() - length
    if removed > 0:
        cache.crop(-removed)


def _render(messages, tokenizer, add_generation_prompt: bool = False) -> torch.Tensor:
    """[1, N] the tokenizer's chat-template rendering of `messages` (tokenalign's, for alignment)."""
    from tokenalign import render_chat

    return rendered_ids(
        render_chat(messages, tokenizer, add_generation_prompt=add_generation_prompt), tokenizer
    )


def _device(model) -> torch.device:
    return model.get_input_embeddings().weight.device
