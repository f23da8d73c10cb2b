"""tokenalign on small hand-built tokenizers: exact expected alignments, nothing downloaded.

Three toy tokenizers (tests/toy_tokenizers.py, fixtures in tests/conftest.py) mimic the real families:
- `byte_bpe`: GPT-2 style byte-level BPE (SmolLM2, Qwen2.5): "Ġ" spaces, characters split into bytes;
- `sp_bpe`: SentencePiece style (Gemma): "▁" spaces, "<0xNN>" byte fallback, a BOS post-processor;
- `words`: word level with an unknown token and no spaces in any token (text it cannot represent).
`Slow(tok)` hides a tokenizer's offsets and backend, forcing the incremental-decoding fallback.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenalign import (
    NATIVE,
    POLICIES,
    Alignment,
    TokenSpans,
    align,
    align_chat,
    align_ids,
    match,
    render_chat,
)
from tokenalign.spans import token_spans
from tokenalign.textmap import TextMap
from tokenalign.vocab import UNKNOWN_PIECE, Vocab


class Slow:
    """A tokenizer without offsets or backend: what a slow (Python) tokenizer offers."""

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


def _pairs(aligned) -> list[tuple[str, str | None]]:
    """(target token, source token it reads or None for NATIVE) for readable assertions."""
    alignment, source_ids, target_ids = aligned
    return [
        (t, None if s == NATIVE else source_ids[s])
        for t, s in zip(target_ids, alignment.source_index, strict=True)
    ]


def _tokens(tok, aligned) -> list[tuple[str, str | None]]:
    """Like `_pairs` but as token strings; the source tokenizer is passed as tok[0], target as tok[1]."""
    source_tok, target_tok = tok
    return [
        (target_tok.convert_ids_to_tokens(t), None if s is None else source_tok.convert_ids_to_tokens(s))
        for t, s in _pairs(aligned)
    ]


# ---------------------------------------------------------------- Alignment


def test_identity_and_native_mask():
    al = Alignment.identity(4)
    assert len(al) == 4 and al.num_source == 4 and al.policy == "last"
    np.testing.assert_array_equal(al.source_index, [0, 1, 2, 3])
    np.testing.assert_array_equal(al.span_end - al.span_start, [1, 1, 1, 1])
    assert not al.native_mask().any()
    al = Alignment([NATIVE, 0, 2], [0, 0, 1], [0, 1, 3], num_source=3, policy="mean")
    np.testing.assert_array_equal(al.native_mask(), [True, False, False])
    assert al.source_index.dtype == np.int64


def test_alignment_round_trips_through_json():
    al = Alignment([NATIVE, 0, 2], [0, 0, 1], [0, 1, 3], num_source=3, policy="mean")
    back = Alignment.from_dict(json.loads(json.dumps(al.to_dict())))
    for name in ("source_index", "span_start", "span_end"):
        np.testing.assert_array_equal(getattr(back, name), getattr(al, name))
    assert (back.num_source, back.policy) == (3, "mean")
    assert al.with_policy("first").policy == "first"


@pytest.mark.parametrize(
    "index, start, end, num_source",
    [
        ([0, 3], [0, 3], [1, 4], 3),  # index out of range
        ([1], [0], [1], 2),  # span does not end at source_index
        ([NATIVE], [0], [1], 2),  # NATIVE with a non-empty span
        ([1], [2], [2], 2),  # span_start after source_index
        ([0, 1], [0], [1], 2),  # ragged
    ],
)
def test_alignment_rejects_inconsistent_arrays(index, start, end, num_source):
    with pytest.raises(ValueError):
        Alignment(index, start, end, num_source=num_source)


def test_alignment_rejects_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        Alignment.identity(2, policy="median")
    assert POLICIES[0] == "last"


# ---------------------------------------------------------------- match on hand-made spans


def test_match_finer_and_coarser_targets():
    coarse = TokenSpans([0, 5], [5, 11])  # "hello", " world"
    fine = TokenSpans([0, 2, 5, 6], [2, 5, 6, 11])  # "he", "llo", " ", "world"
    al = match(coarse, fine)
    np.testing.assert_array_equal(al.source_index, [0, 0, 1, 1])
    np.testing.assert_array_equal(al.span_start, [0, 0, 1, 1])
    al = match(fine, coarse)
    np.testing.assert_array_equal(al.source_index, [1, 3])  # each reads the piece with its last byte
    np.testing.assert_array_equal(al.span_start, [0, 2])


def test_match_straddling_target_and_policies_recorded():
    source = TokenSpans([0, 3, 6], [3, 6, 9])
    target = TokenSpans([0, 2], [2, 9])  # second target overlaps all three source tokens
    al = match(source, target, policy="mean")
    np.testing.assert_array_equal(al.source_index, [0, 2])
    np.testing.assert_array_equal(al.span_start, [0, 0])
    np.testing.assert_array_equal(al.span_end, [1, 3])
    assert al.policy == "mean"


def test_match_control_and_missing_text_are_native():
    source = TokenSpans([0, 0, 3, 3], [0, 3, 3, 6])  # BOS, "abc", <marker>, "def"
    target = TokenSpans([0, 0, 0, 6], [0, 6, 0, 8])  # BOS, "abcdef", <marker>, "gh" (not in source)
    al = match(source, target)
    np.testing.assert_array_equal(al.source_index, [NATIVE, 3, NATIVE, NATIVE])
    # the span is cut after the control token so `mean` never averages a marker row
    np.testing.assert_array_equal(al.span_start, [0, 3, 0, 0])
    np.testing.assert_array_equal(al.span_end, [0, 4, 0, 0])


def test_match_with_no_readable_source():
    al = match(TokenSpans([0], [0]), TokenSpans([0, 1], [1, 2]))
    np.testing.assert_array_equal(al.source_index, [NATIVE, NATIVE])


def test_token_spans_are_tidied():
    spans = TokenSpans([0, 4, 2, 9], [3, 6, 5, 9])  # non-monotone offsets, one empty token
    np.testing.assert_array_equal(spans.start, [0, 4, 4, 0])
    np.testing.assert_array_equal(spans.end, [3, 6, 6, 0])
    np.testing.assert_array_equal(spans.has_text(), [True, True, True, False])


# ---------------------------------------------------------------- TextMap


def test_textmap_identity_and_normalisation():
    same = TextMap.diff(b"abc", b"abc")
    np.testing.assert_array_equal(same.starts, [0, 1, 2, 3])
    nfd, nfc = "xe\u0301yz".encode(), "x\u00e9yz".encode()  # 1+3+2 bytes vs 1+2+2
    tm = TextMap.diff(nfd, nfc)
    # "x" stays, the decomposed é (bytes 1..4) maps to the composed é (bytes 1..3) as a whole
    start, end, _ = tm.project(np.array([0, 1, 2, 4]), np.array([1, 2, 4, 6]), np.array([1, 2, 4, 6]))
    np.testing.assert_array_equal(start, [0, 1, 1, 3])
    np.testing.assert_array_equal(end, [1, 3, 3, 5])


def test_textmap_prefix_space_and_deleted_scaffolding():
    tm = TextMap.diff(b" hello world", b"hello world")  # SentencePiece dummy prefix
    start, end, _ = tm.project(np.array([0, 0, 6]), np.array([1, 6, 12]), np.array([1, 6, 12]))
    np.testing.assert_array_equal(start, [0, 0, 5])
    np.testing.assert_array_equal(end, [0, 5, 11])  # the lone dummy space has no text
    tm = TextMap.from_runs(10, 4, [(2, 0, 2), (7, 2, 2)])  # keep a[2:4] and a[7:9]
    start, end, _ = tm.project(np.array([0, 2, 4, 6]), np.array([2, 4, 6, 9]), np.array([2, 4, 6, 9]))
    np.testing.assert_array_equal(end - start, [0, 2, 0, 2])  # scaffolding tokens lose their text


def test_textmap_inserted_text_joins_previous_reach():
    tm = TextMap.diff(b"ab cd xyz", b"ab Q cd xyz")
    ends = np.array([2, 3, 5])
    start, end, reach = tm.project(np.array([0, 2, 3]), ends, ends)
    np.testing.assert_array_equal(start, [0, 2, 5])
    np.testing.assert_array_equal(end, [2, 3, 7])
    np.testing.assert_array_equal(reach, [2, 5, 7])  # " " reaches over the inserted "Q "


def test_textmap_unrelated_texts_are_one_block():
    tm = TextMap.diff(b"aaaa", b"zzzzzz")
    np.testing.assert_array_equal(tm.starts, [0, 0, 0, 0, 6])
    np.testing.assert_array_equal(tm.ends, [0, 6, 6, 6, 6])
    np.testing.assert_array_equal(tm.reaches, tm.ends)


# ---------------------------------------------------------------- Vocab


def test_vocab_schemes_and_pieces(byte_bpe, sp_bpe, words):
    bb, sp, wl = Vocab(byte_bpe), Vocab(sp_bpe), Vocab(words)
    assert (bb.scheme, sp.scheme, wl.scheme) == ("byte_level", "sentencepiece", None)
    assert bb.piece(byte_bpe.convert_tokens_to_ids("Ġworld")) == b" world"
    assert bb.piece(byte_bpe.convert_tokens_to_ids("ðŁ")) == b"\xf0\x9f"
    assert sp.piece(sp_bpe.convert_tokens_to_ids("<0xF0>")) == b"\xf0"
    assert sp.piece(sp_bpe.convert_tokens_to_ids("▁wor")) == b" wor"
    assert wl.piece(0) == UNKNOWN_PIECE and wl.unk_id == 0
    assert set(sp.control_ids.tolist()) == {1}  # <s>; <unk> is text it cannot spell
    assert set(bb.control_ids.tolist()) == set(byte_bpe.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))


def test_vocab_reconstructs_split_characters(byte_bpe, sp_bpe):
    text = "a😀 the"
    for tok in (byte_bpe, sp_bpe):
        ids = tok(text)["input_ids"]
        own, start, end = Vocab(tok).reconstruct(ids)
        bos = b"<s>" if tok is sp_bpe else b""  # control tokens write their marker but cover nothing
        assert own == bos + text.encode()
        assert (end - start).sum() == len(text.encode())
        slow_own, slow_start, slow_end = Vocab(tok, scheme=None).reconstruct(ids)
        assert slow_own == own
        # decoding token by token cannot split the emoji: its byte tokens share its 4 bytes
        emoji = (start >= len(bos) + 1) & (end <= len(bos) + 5) & (end > start)
        assert emoji.sum() > 1
        assert set(zip(slow_start[emoji], slow_end[emoji], strict=True)) == {(len(bos) + 1, len(bos) + 5)}


# ---------------------------------------------------------------- align on toy tokenizers


def test_align_words_across_families(byte_bpe, sp_bpe):
    aligned = align("hello world", byte_bpe, sp_bpe)
    assert _tokens((byte_bpe, sp_bpe), aligned) == [
        ("<s>", None),
        ("he", "hello"),
        ("llo", "hello"),
        ("▁wor", "Ġworld"),
        ("ld", "Ġworld"),
    ]
    aligned = align("hello world", sp_bpe, byte_bpe)
    assert _tokens((sp_bpe, byte_bpe), aligned) == [("hello", "llo"), ("Ġworld", "ld")]
    np.testing.assert_array_equal(aligned.alignment.span_start, [1, 3])  # after <s>


def test_align_emoji_bytes_exactly(byte_bpe, sp_bpe):
    # byte_bpe writes 😀 as "ðŁ" (F0 9F) + "ĺ" (98) + "Ģ" (80); sp_bpe as four <0xNN> tokens.
    aligned = align("a😀b", byte_bpe, sp_bpe)
    assert _tokens((byte_bpe, sp_bpe), aligned) == [
        ("<s>", None),
        ("a", "a"),
        ("<0xF0>", "ðŁ"),
        ("<0x9F>", "ðŁ"),
        ("<0x98>", "ĺ"),
        ("<0x80>", "Ģ"),
        ("b", "b"),
    ]
    aligned = align("a😀b", sp_bpe, byte_bpe)
    # "ðŁ" holds the first two bytes: it reads <0x9F>, not the emoji's last byte
    assert _tokens((sp_bpe, byte_bpe), aligned) == [
        ("a", "a"),
        ("ðŁ", "<0x9F>"),
        ("ĺ", "<0x98>"),
        ("Ģ", "<0x80>"),
        ("b", "b"),
    ]
    np.testing.assert_array_equal(aligned.alignment.span_start, [1, 2, 4, 5, 6])


def test_special_tokens_in_text_are_native(byte_bpe, sp_bpe):
    text = "hello<|im_start|>the"
    aligned = align(text, byte_bpe, sp_bpe)
    got = _tokens((byte_bpe, sp_bpe), aligned)
    assert got[:3] == [("<s>", None), ("he", "hello"), ("llo", "hello")]
    # sp_bpe spells the marker in 12 byte/letter tokens; the source saw a control token there
    assert [t for t, _ in got[3:15]] == ["<0x3C>", "<0x7C>", *"im", "<0x5F>", *"start", "<0x7C>", "<0x3E>"]
    assert all(src is None for _, src in got[3:15])
    assert got[15:] == [("t", "t"), ("he", "he")]
    back = align(text, sp_bpe, byte_bpe)
    assert ("<|im_start|>", None) in _tokens((sp_bpe, byte_bpe), back)


def test_unknown_token_reads_and_is_read(byte_bpe, words):
    text = "hello  wörld"
    aligned = align(text, byte_bpe, words)
    assert _tokens((byte_bpe, words), aligned) == [("hello", "hello"), ("[UNK]", "d")]
    aligned = align(text, words, byte_bpe)
    got = _tokens((words, byte_bpe), aligned)
    # the spaces are in no word token: the source "hello" reaches over them (causal), so "Ġ" reads
    # it; "Ġw" ends in "w", which only [UNK] holds
    assert got == [("hello", "hello"), ("Ġ", "hello"), ("Ġw", "[UNK]"), *((t, "[UNK]") for t, _ in got[3:])]
    assert len(got) == 8  # hello, Ġ, Ġw, Ã, ¶, r, l, d


def test_same_tokenizer_is_identity_on_text(sp_bpe):
    aligned = align("hello world the", sp_bpe, sp_bpe)
    assert aligned.source_ids == aligned.target_ids
    np.testing.assert_array_equal(aligned.alignment.source_index, [NATIVE, 1, 2, 3, 4, 5, 6])


def test_align_ids_matches_align(byte_bpe, sp_bpe):
    for text in ["hello world the", "a😀b the", "x\u00e9 world"]:
        for source, target in [(byte_bpe, sp_bpe), (sp_bpe, byte_bpe)]:
            want, source_ids, target_ids = align(text, source, target)
            got = align_ids(np.array(source_ids), source, target_ids, target)
            np.testing.assert_array_equal(got.source_index, want.source_index)
            np.testing.assert_array_equal(got.span_start, want.span_start)


def test_given_ids_that_differ_from_encoding(byte_bpe, sp_bpe):
    text = "hello world"
    plain = sp_bpe(text, add_special_tokens=False)["input_ids"]
    al, _, target_ids = align(text, byte_bpe, sp_bpe, target_ids=plain)  # no BOS: rebuilt from ids
    assert target_ids == plain and not al.native_mask().any()
    extra = [1, 1, *plain]  # two BOS: not what the tokenizer makes, so the text is rebuilt
    al, _, _ = align(text, byte_bpe, sp_bpe, target_ids=extra)
    np.testing.assert_array_equal(al.source_index, [NATIVE, NATIVE, 0, 0, 1, 1])


def test_slow_tokenizers_fall_back_to_decoding(byte_bpe, sp_bpe, words):
    for source, target in [(byte_bpe, sp_bpe), (sp_bpe, words), (words, byte_bpe)]:
        text = "hello world the"
        fast = align(text, source, target).alignment
        slow = align(text, Slow(source), Slow(target)).alignment
        np.testing.assert_array_equal(slow.source_index, fast.source_index)
        if source is not words:  # decoded, a word's space is in the next word; offsets leave it out
            np.testing.assert_array_equal(slow.span_start, fast.span_start)
    # through a split emoji the slow side can only say "these tokens build this character"
    slow = align("a😀b", Slow(sp_bpe), byte_bpe)
    assert _tokens((sp_bpe, byte_bpe), slow)[1:4] == [("ðŁ", "<0x80>"), ("ĺ", "<0x80>"), ("Ģ", "<0x80>")]


def test_ids_must_be_one_sequence(byte_bpe):
    with pytest.raises(ValueError, match="1-D"):
        token_spans("hello", byte_bpe, ids=[[1, 2]])


# ---------------------------------------------------------------- chat


def test_chat_without_template_joins_contents(sp_bpe, byte_bpe):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the world"}]
    chat = render_chat(messages, sp_bpe)
    assert chat.text == "hello\n\nthe world" and chat.contents == ((0, 5), (7, 16))
    aligned = align_chat(messages, byte_bpe, sp_bpe)
    got = _tokens((byte_bpe, sp_bpe), aligned)
    assert got[0] == ("<s>", None)
    assert ("<0x0A>", None) in got  # the separator is scaffolding
    assert got[-2:] == [("▁wor", "Ġworld"), ("ld", "Ġworld")]


def test_chat_template_scaffolding_is_native(byte_bpe, sp_bpe):
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    byte_bpe.chat_template = template
    try:
        messages = [{"role": "user", "content": "user"}, {"role": "assistant", "content": "hello world"}]
        chat = render_chat(messages, byte_bpe, add_generation_prompt=True)
        # the content "user" is found as the content, not as the role name before it
        assert [chat.text[a:b] for a, b in chat.contents] == ["user", "hello world"]
        assert chat.contents[0][0] == len("<|im_start|>user\n")
        aligned = align_chat(messages, sp_bpe, byte_bpe, add_generation_prompt=True)
        got = _tokens((sp_bpe, byte_bpe), aligned)
        readers = [pair for pair in got if pair[1] is not None]
        assert readers == [("u", "u"), ("s", "s"), ("e", "e"), ("r", "r"), ("hello", "llo"), ("Ġworld", "ld")]
        assert got[:6] == [("<|im_start|>", None), *((c, None) for c in "user"), ("Ċ", None)]  # role header
        assert got[-11:] == [("<|im_start|>", None), *((c, None) for c in "assistant"), ("Ċ", None)]  # prompt
    finally:
        byte_bpe.chat_template = None
