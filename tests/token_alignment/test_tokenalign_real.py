"""tokenalign with the real tokenizers of SmolLM2, Qwen2.5 and Gemma 3.

Property tests (hypothesis, random Unicode) check every alignment against an oracle built straight
from the tokenizers' own character offsets, independent of tokenalign's byte arithmetic:
- total: every target token reads a source token in [0, num_source) or is NATIVE;
- NATIVE exactly where the target token has no text or no source text overlaps it;
- monotone: source_index and span_start never decrease over aligned target tokens;
- causal: the source token read never starts after the target token's text ends;
- `last`: it covers the target token's last character whenever some source token does;
- spans: every source token in [span_start, span_end) overlaps the target token's text.
A source token's text reaches over characters no token covers up to the next token (spans.py).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenalign import NATIVE, align, align_chat, align_ids

pytestmark = pytest.mark.real_model

NAMES = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")
DIRECTIONS = [(a, b) for a in NAMES for b in NAMES if a != b]  # all six, both ways for every pair


@cache
def tokenizer(name: str):
    """Loaded once per session (a function, not a fixture: hypothesis prints fixture arguments)."""
    from bridgecache.models.zoo import load_tokenizer

    return load_tokenizer(name)


class Slow:
    """A tokenizer without offsets or backend, forcing tokenalign's incremental-decoding path."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        if return_offsets_mapping:
            raise NotImplementedError("no offsets")
        return self._tokenizer(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self._tokenizer, name)


# ---------------------------------------------------------------- oracle


def _char_view(text: str, tokenizer, ids: list[int]):
    """Per token, from the tokenizer's own offsets: char start, end, reach, and whether it has text."""
    enc = tokenizer(text, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    start, end = offsets[:, 0], offsets[:, 1]
    control = set(tokenizer.all_special_ids)
    control |= {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    unk = tokenizer.backend_tokenizer.model.unk_token  # "<unk>" is text Gemma could not spell
    control.discard(tokenizer.convert_tokens_to_ids(unk) if unk else None)
    covers = end > start
    has_text = covers & ~np.isin(ids, sorted(control))
    reach = end.copy()
    covering = np.flatnonzero(covers)
    for k, following in zip(covering[:-1], covering[1:], strict=True):
        reach[k] = max(reach[k], start[following])
    return start, end, reach, has_text


def check_against_offsets(text: str, source_tok, target_tok, alignment, source_ids, target_ids) -> None:
    s_start, _, s_reach, s_text = _char_view(text, source_tok, source_ids)
    t_start, t_end, _, t_text = _char_view(text, target_tok, target_ids)
    index = alignment.source_index
    aligned = index != NATIVE
    assert len(alignment) == len(target_ids) and alignment.num_source == len(source_ids)
    assert np.all((index >= 0) & (index < len(source_ids)) | ~aligned)
    assert np.all(np.diff(index[aligned]) >= 0)
    assert np.all(np.diff(alignment.span_start[aligned]) >= 0)
    for t in range(len(target_ids)):
        overlaps = s_text & (s_start < t_end[t]) & (s_reach > t_start[t])
        if not aligned[t]:
            assert not (t_text[t] and overlaps.any()), f"target {t} has source text but is NATIVE"
            continue
        s = index[t]
        assert t_text[t], f"target {t} has no text but reads source {s}"
        assert s_text[s] and s_start[s] < t_end[t], f"target {t} reads source {s}, which starts after it"
        last = t_end[t] - 1
        covering = s_text & (s_start <= last) & (s_reach > last)
        assert covering[s] or not covering.any(), f"source {s} does not cover target {t}'s last character"
        assert overlaps[alignment.span_start[t] : alignment.span_end[t]].all()


# ---------------------------------------------------------------- random text

_pieces = st.one_of(
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
    st.characters(min_codepoint=0x0300, max_codepoint=0x036F),  # combining marks
    st.characters(min_codepoint=0x1100, max_codepoint=0x11FF),  # Hangul jamo (NFC composes them)
    st.sampled_from("0123456789"),
    st.sampled_from(list("(){}[]<>=+-*/_.,;:'\"#@!?\\|&^%$~`")),
    st.sampled_from([" ", "  ", "    ", "\n", "\n\n", "\t", "\r\n", "\u3000", "\u00a0", " \n "]),
    st.sampled_from(["the", " cat", "def f(x):", "return", "Hello", "naïve", "ﬁ", "e\u0301", "Å", "한국어"]),
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<0xF0>", "<unk>"]),
    st.characters(exclude_categories=("Cs",)),  # anything, unassigned and control characters too
)
texts = st.lists(_pieces, min_size=1, max_size=40).map("".join)
_settings = settings(max_examples=40, deadline=None)


@pytest.mark.parametrize("source_name, target_name", DIRECTIONS)
@_settings
@given(text=texts)
def test_alignment_properties(source_name, target_name, text):
    source_tok, target_tok = tokenizer(source_name), tokenizer(target_name)
    alignment, source_ids, target_ids = align(text, source_tok, target_tok)
    check_against_offsets(text, source_tok, target_tok, alignment, source_ids, target_ids)


@pytest.mark.parametrize("source_name, target_name", [DIRECTIONS[0], DIRECTIONS[-1]])
@_settings
@given(text=texts)
def test_align_ids_agrees_with_align(source_name, target_name, text):
    source_tok, target_tok = tokenizer(source_name), tokenizer(target_name)
    want, source_ids, target_ids = align(text, source_tok, target_tok)
    got = align_ids(source_ids, source_tok, target_ids, target_tok)  # validated by Alignment itself
    assert np.all(np.diff(got.source_index[got.source_index != NATIVE]) >= 0)
    spelled = [
        tok.decode(ids, skip_special_tokens=True)
        for tok, ids in ((source_tok, source_ids), (target_tok, target_ids))
    ]
    if spelled == [text, text] and "<" not in text:
        # both sides rebuild exactly this text (no normalisation, no dropped bytes): the routes agree
        np.testing.assert_array_equal(got.source_index, want.source_index)
        np.testing.assert_array_equal(got.span_start, want.span_start)


@pytest.mark.parametrize("source_name, target_name", [("gemma3-270m", "smollm2-135m")])
@settings(max_examples=15, deadline=None)
@given(text=texts)
def test_slow_path_properties(source_name, target_name, text):
    source_tok, target_tok = tokenizer(source_name), tokenizer(target_name)
    alignment, source_ids, target_ids = align(text, Slow(source_tok), Slow(target_tok))
    spelled = [
        tok.decode(ids, skip_special_tokens=True)
        for tok, ids in ((source_tok, source_ids), (target_tok, target_ids))
    ]
    if spelled == [text, text]:  # the oracle's offsets are only exact where no character was dropped
        check_against_offsets(text, source_tok, target_tok, alignment, source_ids, target_ids)


# ---------------------------------------------------------------- exact cases


def _read(source_name, target_name, text):
    """[(target token, source token read or None)] as token strings."""
    source_tok, target_tok = tokenizer(source_name), tokenizer(target_name)
    alignment, source_ids, target_ids = align(text, source_tok, target_tok)
    source_tokens = source_tok.convert_ids_to_tokens(source_ids)
    return [
        (t, None if s == NATIVE else source_tokens[s])
        for t, s in zip(target_tok.convert_ids_to_tokens(target_ids), alignment.source_index, strict=True)
    ]


def test_exact_words_and_bos():
    assert _read("smollm2-135m", "gemma3-270m", "Hello world") == [
        ("<bos>", None),
        ("Hello", "Hello"),
        ("▁world", "Ġworld"),
    ]
    # Gemma writes two spaces as one "▁▁" token; SmolLM2 as "Ġ" + the space of "Ġworld"
    assert _read("gemma3-270m", "smollm2-135m", "Hello  world") == [
        ("Hello", "Hello"),
        ("Ġ", "▁▁"),
        ("Ġworld", "world"),
    ]


def test_exact_split_characters():
    text = "你好😀"
    # Qwen2.5 has one token for 你好 and one for 😀; SmolLM2 splits both into byte tokens
    assert _read("smollm2-135m", "qwen2.5-coder-0.5b", text) == [("ä½łå¥½", "½"), ("ðŁĺĢ", "Ģ")]
    assert _read("qwen2.5-coder-0.5b", "smollm2-135m", text) == [
        ("ä½", "ä½łå¥½"),
        ("ł", "ä½łå¥½"),
        ("å¥", "ä½łå¥½"),
        ("½", "ä½łå¥½"),
        ("ðŁ", "ðŁĺĢ"),
        ("ĺ", "ðŁĺĢ"),
        ("Ģ", "ðŁĺĢ"),
    ]
    # Gemma's byte fallback for 𝔘 (F0 9D 94 98) against SmolLM2's "ðĿ" (F0 9D) "Ķ" (94) "ĺ" (98)
    got = _read("smollm2-135m", "gemma3-270m", "𝔘")
    assert got == [("<bos>", None), ("<0xF0>", "ðĿ"), ("<0x9D>", "ðĿ"), ("<0x94>", "Ķ"), ("<0x98>", "ĺ")]


def test_exact_normalisation():
    # Qwen2.5 composes "e" + U+0301 into "é" (NFC); its offsets give " é" the characters " e" only
    text = "x e\u0301 y"
    assert _read("smollm2-135m", "qwen2.5-coder-0.5b", text) == [("x", "x"), ("ĠÃ©", "Ġe"), ("Ġy", "Ġy")]
    # as a source, " é" reaches over the combining mark no Qwen token covers: SmolLM2's mark reads it
    assert _read("qwen2.5-coder-0.5b", "smollm2-135m", text) == [
        ("x", "x"),
        ("Ġe", "ĠÃ©"),
        ("Ì", "ĠÃ©"),
        ("ģ", "ĠÃ©"),
        ("Ġy", "Ġy"),
    ]


def test_special_tokens_are_native():
    text = "a<|im_start|>b"
    got = _read("smollm2-135m", "gemma3-270m", text)
    assert got[0] == ("<bos>", None) and got[1] == ("a", "a") and got[-1] == ("b", "b")
    assert all(source is None for _, source in got[2:-1])  # Gemma spells the marker; SmolLM2 saw a control
    got = _read("gemma3-270m", "qwen2.5-coder-0.5b", text)
    assert got == [("a", "a"), ("<|im_start|>", None), ("b", "b")]


def test_same_tokenizer_reads_itself():
    text = "def f(x):\n    return x ** 2  # 平方 🧮"
    for name in NAMES:
        alignment, source_ids, target_ids = align(text, tokenizer(name), tokenizer(name))
        text_rows = alignment.source_index != NATIVE
        assert source_ids == target_ids
        np.testing.assert_array_equal(alignment.source_index[text_rows], np.flatnonzero(text_rows))


def test_long_text_alignment():
    """A few thousand tokens of documentation, every direction: the oracle still holds."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))[:6000]
    for source_name, target_name in DIRECTIONS:
        source_tok, target_tok = tokenizer(source_name), tokenizer(target_name)
        alignment, source_ids, target_ids = align(text, source_tok, target_tok)
        check_against_offsets(text, source_tok, target_tok, alignment, source_ids, target_ids)
        assert alignment.native_mask().sum() <= 1  # only Gemma's <bos>


# ---------------------------------------------------------------- chat


MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Capital of France? 答えて"},
    {"role": "assistant", "content": "Paris"},
]


def test_chat_contents_align_and_scaffolding_is_native():
    for source_name, target_name in DIRECTIONS:
        source_tok, target_tok = tokenizer(source_name), tokenizer(target_name)
        alignment, source_ids, target_ids = align_chat(
            MESSAGES, source_tok, target_tok, add_generation_prompt=True
        )
        target_tokens = target_tok.convert_ids_to_tokens(target_ids)
        read = {t: s for t, s in enumerate(alignment.source_index) if s != NATIVE}
        decoded = target_tok.decode([target_ids[t] for t in sorted(read)])
        # exactly the contents are read (Gemma has no template: contents joined by blank lines)
        assert decoded.replace(" ", "") == "".join(m["content"] for m in MESSAGES).replace(" ", "")
        for t, token in enumerate(target_tokens):
            if token in ("<|im_start|>", "<|im_end|>", "<bos>", "system", "user", "assistant"):
                assert alignment.source_index[t] == NATIVE, (target_name, t, token)
        assert np.all(np.diff(alignment.source_index[alignment.source_index != NATIVE]) >= 0)
        # the last content token on each side ends "Paris", and one reads the other
        last = max(read)
        assert target_tok.decode(target_ids[: last + 1]).endswith("Paris")
        assert source_tok.decode(source_ids[: alignment.source_index[last] + 1]).endswith("Paris")
