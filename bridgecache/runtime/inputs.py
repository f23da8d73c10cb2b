"""Validators for what a caller hands the entry points, run before any model runs.

    config = check_config(config)               None -> HandoffConfig(); a HandoffConfig as is
    contexts = check_contexts(contexts)         a list of non-empty texts (never one str)
    text = check_text(prompt, "prompt")         a str (empty allowed with allow_empty=True)
    messages = check_messages(messages)         chat messages: dicts with role and content strings
    check_fits(tokens, limit, "the context")    a context longer than the target's window, refused
    selector_layers(config, num_layers)         a refresh rule's native_layers(): target layers

`handoff`, `handoff_batch`, `Conversation`, the engine, `BridgedCache` and the publishers call
these (and bridgecache.checks, the boundary's primitives and error types) where their arguments
enter, so that a wrong argument fails in microseconds with a message naming it, not after the
source's prefill (or, for a str where a list belongs, by running one context per character).

Knows the configuration's type, the Bridge and ContextWords types and plain Python values; models,
tokenizers and engines only by what they must offer.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence

import torch

import bridgecache.checks as checks
from bridgecache.bridge.maps import Bridge
from bridgecache.runtime.config import HandoffConfig
from bridgecache.runtime.selection.words import ContextWords

__all__ = [
    "check_arguments",
    "check_config",
    "check_contexts",
    "check_engine",
    "check_fits",
    "check_generate_kwargs",
    "check_lengths",
    "check_messages",
    "check_setup",
    "check_text",
    "saved_costs_for",
    "selector_layers",
]


_SURROGATE = re.compile("[\ud800-\udfff]")


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
    lone = _SURROGATE.search(text)  # no tokenizer encodes one (UTF-8 has no form for it)
    if lone is not None:
        raise ValueError(
            f"{name} holds a lone surrogate {lone.group()!r} at character {lone.start()}; expected text "
            "that UTF-8 can encode (decode bytes with errors='replace')"
        )
    return text


def check_contexts(contexts, name: str = "contexts") -> list[str]:
    """`contexts` as a list of non-empty texts. A str is refused (iterating it would give one
    context per character); so are an empty list and any item that is not a non-empty str."""
    if isinstance(contexts, (str, bytes)):
        raise TypeError(
            f"{name} is a {type(contexts).__name__} ({len(contexts)} characters); expected a list of "
            "texts (one context: [text], or handoff() for a single one)"
        )
    if not isinstance(contexts, Sequence):
        raise TypeError(f"{name} is a {type(contexts).__name__}; expected a list of texts")
    if len(contexts) == 0:
        raise ValueError(f"{name} is empty; expected at least one text")
    return [check_text(text, f"{name}[{i}]") for i, text in enumerate(contexts)]


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


def selector_layers(config: HandoffConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers `config`'s refresh rule asks computed natively (its `native_layers()`),
    checked: ints in 0..num_layers-1 (a custom rule's -1 or 99 is refused here, not reported as a
    layer or indexed later); () without a refresh."""
    if config.refresh is None:
        return ()
    selector = config.refresh.selector
    name = f"selector {type(selector).__name__}.native_layers({num_layers})"
    return checks.layer_indices(selector.native_layers(num_layers), name, num_layers)


def check_setup(bridge, source, target, source_tokenizer=None, target_tokenizer=None) -> None:
    """The types of a handoff setup, before anything reads them (bridgecache.checks): a Bridge,
    transformers models (the source may be None), tokenizers or None."""
    checks.instance(bridge, "bridge", Bridge, "a bridgecache Bridge (Bridge.load, 'builtin:...' names)")
    checks.model(source, "source", optional=True)
    checks.model(target, "target")
    checks.tokenizer(source_tokenizer, "source_tokenizer", optional=True)
    checks.tokenizer(target_tokenizer, "target_tokenizer", optional=True)


def check_lengths(lengths, limit: int) -> list[int]:
    """Route-timing lengths: a non-empty list of context token counts, each 1..`limit` (both
    models' windows less the prompt), checked before any tensor of that length is made."""
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise checks.FieldTypeError(
            f"lengths={checks.shown(lengths)}; expected a list of context lengths in tokens, "
            f"not a {type(lengths).__name__}"
        )
    lengths = list(lengths)
    if not lengths or len(lengths) > 64:
        raise ValueError(f"lengths has {len(lengths)} entries; expected 1 to 64 context lengths")
    return [
        checks.integer(n, f"lengths[{i}]", low=1, high=limit, what="a context length in tokens (the windows)")
        for i, n in enumerate(lengths)
    ]


def check_arguments(
    bridge, target, target_ids, target_mask, source_model, prompt_ids, words, alignment=None, source_mask=None
):
    """A BridgedCache's arguments checked where they enter (bridgecache.checks): the types, the
    ids' shape and vocabulary, the mask's shape and values, the alignment's type (one per row),
    the words' shapes and order."""
    checks.instance(bridge, "bridge", Bridge, "a bridgecache Bridge (Bridge.load, 'builtin:...' names)")
    checks.model(target, "target")
    checks.model(source_model, "source_model", optional=True)
    checks.ids(target_ids, "target_ids", vocab=_vocab(target))
    checks.mask(target_mask, "target_attention_mask", target_ids)
    checks.instance(
        source_mask, "source_attention_mask", torch.Tensor, "a 0/1 tensor [batch, tokens]", optional=True
    )
    _check_alignment(alignment, target_ids.shape[0])
    vocab = _vocab(source_model) if source_model is not None else None
    checks.ids(prompt_ids, "prompt_ids", vocab=vocab, optional=True)
    checks.instance(
        words, "words", ContextWords, "ContextWords (selection.words.context_words)", optional=True
    )
    if words is None:
        return
    for side in ("source", "target"):
        groups = getattr(words, side)
        checks.ids(groups, f"words.{side}", batch=target_ids.shape[0])
        if groups.shape[1] > 1 and bool((groups.diff(dim=1) < 0).any()):
            raise ValueError(f"words.{side} decreases within a row; expected non-decreasing word groups")
    if tuple(words.target.shape) != tuple(target_ids.shape):
        raise ValueError(
            f"words.target has shape {tuple(words.target.shape)}; expected the target_ids' shape "
            f"{tuple(target_ids.shape)} (one group per target column; words of another context?)"
        )


def check_engine(engine, bridge, target, source_model) -> None:
    """`engine` is a HandoffEngine built for exactly this bridge, target and (when given) source:
    its plans, views and graphs are of those objects (compared by identity, never assumed)."""
    parts = ("state", "bridge", "source", "target", "time_routes")  # what a HandoffEngine offers
    if not all(hasattr(engine, part) for part in parts) or isinstance(engine, type):
        raise checks.FieldTypeError(
            f"engine={checks.shown(engine)}; expected a bridgecache HandoffEngine or None, "
            f"not a {type(engine).__name__}"
        )
    checks.same(engine.bridge, bridge, "engine", "bridge")
    checks.same(engine.target, target, "engine", "target model")
    if source_model is not None:
        checks.same(engine.source, source_model, "engine", "source model")
    if getattr(engine, "_closed", False):
        raise ValueError("engine is closed: build a new HandoffEngine")


def _check_alignment(alignment, batch: int) -> None:
    from tokenalign import Alignment

    expected = "a tokenalign.Alignment (batch 1), a list of them (one per row) or None"
    rows = alignment if isinstance(alignment, (list, tuple)) else [alignment]
    if alignment is None:
        return
    if len(rows) != batch:
        raise ValueError(f"alignment has {len(rows)} rows; expected {batch}, one per row of target_ids")
    for i, row in enumerate(rows):
        checks.instance(row, f"alignment[{i}]" if rows is alignment else "alignment", Alignment, expected)


def check_generate_kwargs(kwargs: dict, window: int | None = None) -> dict:
    """The counts a caller passes on to generate(), checked before any model runs (a NaN or a
    negative count would otherwise fail inside transformers, or in our room for decoded tokens);
    new tokens at most the target's `window` (its max_position_embeddings: a million new tokens
    would grow the cache until memory runs out, far past what the model was trained to read)."""
    for key in ("max_new_tokens", "min_new_tokens", "num_beams", "num_return_sequences"):
        # None is "the generation config's" for the lengths; generate() has no None for the others
        if key in kwargs and (kwargs[key] is not None or key in ("num_beams", "num_return_sequences")):
            low = 0 if key == "min_new_tokens" else 1
            high = window if window and key.endswith("new_tokens") else 1 << 16
            what = "a count (the target's window)" if high == window else "a count"
            checks.integer(kwargs[key], key, low=low, high=high, what=what)
    return kwargs


def saved_costs_for(costs, key: str, device: str):
    """`costs` (a route cost table read back from the cache directory, or None) if it was measured
    for this setup (`key`) on this device; else None, with a warning naming what differs (a table
    copied from another machine or edited by hand is measured again, never used for this one)."""
    if costs is None or (costs.key == key and costs.device == device):
        return costs
    warnings.warn(
        f"the saved route costs for {key} were measured for {checks.shown(costs.key, 30)} on "
        f"{checks.shown(costs.device, 60)}, not for this setup on {device}: not used (measured again)",
        stacklevel=3,
    )
    return None


def _vocab(model) -> int | None:
    return getattr(model.config.get_text_config(), "vocab_size", None)
