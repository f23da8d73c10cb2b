"""Chat contexts: each model reads the messages through its own chat template.

`render_chat(messages, tokenizer)` renders a list of `{"role", "content"}` messages with the
tokenizer's chat template and finds where each message's content sits in the rendering. A
tokenizer without a template (a base model such as Gemma-3-270M) gets the contents joined by
`separator` ("\\n\\n"), encoded with the tokenizer's own special tokens (its BOS): there is no
scaffolding then, only the separators, which are NATIVE like any scaffolding.

`align_chat(messages, source_tokenizer, target_tokenizer)` aligns the two renderings on the text
they share, the message contents: both renderings are mapped onto the contents laid end to end, so a
content token reads the source tokens of the same content, and every scaffolding token (role
headers, markers, default system prompts, separators) has no text there and is NATIVE.

Contents are located by rendering the messages once more with unique placeholder contents, which
gives the template's scaffolding exactly; a template that rewrites contents (strips them, say)
falls back to searching each content in order after the previous one.
Knows nothing about KV caches or models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .match import match
from .spans import token_spans
from .text import Aligned
from .textmap import TextMap

__all__ = ["RenderedChat", "align_chat", "render_chat"]


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation and where each message's content is in it (character offsets)."""

    text: str
    contents: tuple[tuple[int, int], ...]  # [messages] (start, end) character offsets into text
    add_special_tokens: bool  # whether to encode with the tokenizer's own specials (no template)


def render_chat(
    messages: Sequence[dict], tokenizer, *, add_generation_prompt: bool = False, separator: str = "\n\n"
) -> RenderedChat:
    """Render `messages` with the tokenizer's chat template (or join the contents by `separator`)."""
    contents = [m["content"] for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        text, cursor, spans = separator.join(contents), 0, []
        for content in contents:
            spans.append((cursor, cursor + len(content)))
            cursor += len(content) + len(separator)
        return RenderedChat(text, tuple(spans), add_special_tokens=True)

    def render(msgs) -> str:
        return tokenizer.apply_chat_template(
            list(msgs), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    text = render(messages)
    markers = [f"\ue000{k}\ue001" for k in range(len(messages))]  # private-use: no template alters them
    scaffold = render([{**m, "content": marker} for m, marker in zip(messages, markers, strict=True)])
    spans = _spans_from_scaffold(text, scaffold, markers, contents) or _spans_by_search(text, contents)
    return RenderedChat(text, spans, add_special_tokens=False)


def _spans_from_scaffold(text, scaffold, markers, contents) -> tuple[tuple[int, int], ...] | None:
    """Content spans if `text` is the scaffold with each marker replaced by its content, else None."""
    spans, rebuilt, cursor = [], [], 0
    for marker, content in zip(markers, contents, strict=True):
        at = scaffold.find(marker, cursor)
        if at < 0:
            return None
        rebuilt.append(scaffold[cursor:at])
        start = sum(map(len, rebuilt))
        spans.append((start, start + len(content)))
        rebuilt.append(content)
        cursor = at + len(marker)
    rebuilt.append(scaffold[cursor:])
    return tuple(spans) if "".join(rebuilt) == text else None


def _spans_by_search(text: str, contents: list[str]) -> tuple[tuple[int, int], ...]:
    spans, cursor = [], 0
    for k, content in enumerate(contents):
        found = content if content in text[cursor:] else content.strip()
        at = text.find(found, cursor)
        if at < 0:
            raise ValueError(f"message {k}'s content does not appear in the rendered chat: {content[:60]!r}")
        spans.append((at, at + len(found)))
        cursor = at + len(found)
    return tuple(spans)


def align_chat(
    messages: Sequence[dict],
    source_tokenizer,
    target_tokenizer,
    *,
    policy: str = "last",
    add_generation_prompt: bool = False,
    separator: str = "\n\n",
) -> Aligned:
    """Align the target's rendering of a chat onto the source's; scaffolding tokens are NATIVE.

    Returns Aligned(alignment [len(target_ids)], source_ids, target_ids): the ids of each side's
    own rendering, ready to feed that model.
    """
    sides = []
    for tokenizer in (source_tokenizer, target_tokenizer):
        chat = render_chat(
            messages, tokenizer, add_generation_prompt=add_generation_prompt, separator=separator
        )
        ids, spans = token_spans(chat.text, tokenizer, add_special_tokens=chat.add_special_tokens)
        onto_contents, contents = _onto_contents(chat)
        sides.append((ids, spans.project(onto_contents), contents))
    (source_ids, source, source_contents), (target_ids, target, target_contents) = sides
    # Equal unless a template rewrote a content (stripped it, say): then map one onto the other.
    source = source.project(TextMap.diff(source_contents, target_contents))
    return Aligned(match(source, target, policy), source_ids, target_ids)


def _onto_contents(chat: RenderedChat) -> tuple[TextMap, bytes]:
    """Map from bytes of the rendering to bytes of its contents laid end to end; and those bytes."""
    runs, laid = [], []
    for start, end in chat.contents:
        at = len(chat.text[:start].encode("utf-8", "surrogatepass"))
        content = chat.text[start:end].encode("utf-8", "surrogatepass")
        runs.append((at, sum(map(len, laid)), len(content)))
        laid.append(content)
    laid = b"".join(laid)
    return TextMap.from_runs(len(chat.text.encode("utf-8", "surrogatepass")), len(laid), runs), laid
