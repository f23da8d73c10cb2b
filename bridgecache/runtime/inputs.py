"""Validators for what a caller hands the entry points, run before any model runs.

    config = check_config(config)               None -> HandoffConfig(); a HandoffConfig as is
    contexts = check_contexts(contexts)         a list of non-empty texts (never one str)
    text = check_text(prompt, "prompt")         a str (empty allowed with allow_empty=True)
    messages = check_messages(messages)         chat messages: dicts with role and content strings
    check_fits(tokens, limit, "the context")    a context longer than the target's window, refused

`handoff`, `handoff_batch`, `Conversation` and the publishers call these where their arguments
enter, so that a wrong argument fails in microseconds with a message naming it, not after the
source's prefill (or, for a str where a list belongs, by running one context per character).

Knows the configuration's type and plain Python values; nothing about models or tokenizers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bridgecache.runtime.config import HandoffConfig

__all__ = ["check_config", "check_contexts", "check_fits", "check_messages", "check_text"]


def check_config(config) -> HandoffConfig:
    """`config` if it is a HandoffConfig; None -> the default HandoffConfig(); anything else
    (a dict from a config file, a RefreshConfig alone) -> TypeError naming its type."""
    if config is None:
        return HandoffConfig()
    if isinstance(config, HandoffConfig):
        return config
    hint = ""
    if isinstance(config, Mapping):
        hint = " (build one from a dict: HandoffConfig(**options), with RefreshConfig(...) for refresh=)"
    elif type(config).__name__ in ("RefreshConfig", "QualityPolicy"):
        field = "refresh" if type(config).__name__ == "RefreshConfig" else "quality"
        hint = f" (wrap it: HandoffConfig({field}=...))"
    raise TypeError(
        f"config is a {type(config).__name__}; expected a bridgecache HandoffConfig or None{hint}"
    )


def check_text(text, name: str, *, allow_empty: bool = False) -> str:
    """`text` if it is a str (non-empty unless `allow_empty`); else TypeError / ValueError naming
    `name`."""
    if not isinstance(text, str):
        raise TypeError(f"{name} is a {type(text).__name__}; expected a str")
    if not text and not allow_empty:
        raise ValueError(f"{name} is empty; expected some text")
    return text


def check_contexts(contexts) -> list[str]:
    """`contexts` as a list of non-empty texts. A str is refused (iterating it would give one
    context per character); so are an empty list and any item that is not a non-empty str."""
    if isinstance(contexts, (str, bytes)):
        raise TypeError(
            f"contexts is a {type(contexts).__name__} ({len(contexts)} characters); expected a list of "
            "texts (one context: [text], or handoff() for a single one)"
        )
    if not isinstance(contexts, Sequence):
        raise TypeError(f"contexts is a {type(contexts).__name__}; expected a list of texts")
    if len(contexts) == 0:
        raise ValueError("contexts is empty; expected at least one text")
    return [check_text(text, f"contexts[{i}]") for i, text in enumerate(contexts)]


def check_messages(messages, name: str = "messages") -> list[dict]:
    """`messages` as a list of chat messages: each a dict with a "role" and a "content", both
    str (the roles are the chat template's to judge). A str, an empty list or a message without
    its role or content is refused, naming the message."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"{name} is a {type(messages).__name__}; expected a list of chat messages "
            '[{"role": "user", "content": "..."}, ...]'
        )
    if len(messages) == 0:
        raise ValueError(f"{name} is empty; expected at least one chat message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(
                f"{name}[{i}] is a {type(message).__name__}; expected a dict with 'role' and 'content'"
            )
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{name}[{i}] has no {key!r}; expected a dict with 'role' and 'content'")
            if not isinstance(message[key], str):
                raise TypeError(f"{name}[{i}][{key!r}] is a {type(message[key]).__name__}; expected a str")
        if not message["role"]:
            raise ValueError(f"{name}[{i}] has an empty 'role'")
    return [dict(message) for message in messages]


def check_fits(tokens: int, limit: int | None, what: str) -> int:
    """`tokens` if a model whose window is `limit` tokens can read that many; else ValueError with
    both numbers (`bridge.target.max_position_embeddings` is the target's window, known before
    any model runs). limit None: no window stated (nothing to check)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise TypeError(f"token count for {what} is {tokens!r}; expected an int >= 0")
    if limit is not None and tokens > limit:
        raise ValueError(
            f"{what} is {tokens} tokens; the model reads at most {limit} (its max_position_embeddings): "
            "shorten it or split it"
        )
    return tokens
