"""Calibration/evaluation text: fixed split, disjoint, reproducible windows."""

from __future__ import annotations

import os
import random
import time

import pytest

from bridgecache import text


@pytest.mark.parametrize("domain", text.DOMAINS)
def test_calibration_and_evaluation_documents_are_disjoint(domain):
    calib = dict(text.documents(domain, "calib"))
    evaluation = dict(text.documents(domain, "eval"))
    assert calib and evaluation
    assert not set(calib) & set(evaluation)
    assert not set(calib.values()) & set(evaluation.values())
    assert all(text.split_of(name) == "eval" for name in evaluation)


def test_chunks_are_reproducible_and_come_from_their_split():
    a = text.text_chunks("prose", "eval", 4, 600, seed=3)
    assert a == text.text_chunks("prose", "eval", 4, 600, seed=3)
    assert a != text.text_chunks("prose", "eval", 4, 600, seed=4)
    eval_docs = [t for _, t in text.documents("prose", "eval")]
    for chunk in a:
        assert 300 <= len(chunk) <= 600
        assert any(chunk in doc for doc in eval_docs)


class _CharTokenizer:
    """One token per character: enough to test windowing without a real tokenizer."""

    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [ord(c) % 1000 for c in s]}


def test_token_sequences_have_the_requested_shape_and_seed():
    seqs = text.token_sequences(_CharTokenizer(), n=5, seq_len=64, domain="code", split="calib", seed=1)
    assert seqs.shape == (5, 64)
    again = text.token_sequences(_CharTokenizer(), n=5, seq_len=64, domain="code", split="calib", seed=1)
    assert (seqs == again).all()
    with pytest.raises(ValueError, match="holds only"):
        text.token_sequences(_CharTokenizer(), n=10**6, seq_len=4096, domain="prose", split="eval")


def test_manual_text_is_reserved_for_evaluation():
    import glob

    from bridgecache.text import _MANUAL_GLOB, documents

    with pytest.raises(ValueError, match="reserved for independent evaluation"):
        documents("manual", "calib")
    if glob.glob(_MANUAL_GLOB):
        docs = documents("manual", "eval")
        assert len(docs) > 50 and all(name.endswith(".txt") for name, _ in docs)
    else:
        with pytest.raises(ValueError, match="vim-runtime"):
            documents("manual", "eval")


# ---------------------------------------------------------------- long documents, bounded work


def _vm(field: str) -> int:
    """This process's VmRSS / VmHWM (peak) in MB, from /proc (Rust allocations included)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise KeyError(field)


def test_pieces_cut_long_text_at_word_boundaries_and_keep_every_character():
    line = "the ship  came in at dawn " * 4000 + "x" * 30000  # a run of spaces; an unbroken tail
    parts = list(text.pieces(line, limit=1000))
    assert "".join(parts) == line
    assert all(len(p) <= 1000 for p in parts) and len(parts) > 100
    for a, b in zip(parts, parts[1:]):
        if b[0] == " ":  # cut before the spaces that follow a word: " came" stays one pre-token
            assert not a[-1].isspace()
    assert list(text.pieces("short text", limit=1000)) == ["short text"]


def test_a_cut_keeps_the_tokens_of_a_byte_level_tokenizer(byte_bpe):
    line = " ".join(["hello world the ship"] * 3000)
    whole = byte_bpe(line, add_special_tokens=False)["input_ids"]
    cut = [
        i for p in text.pieces(line, limit=997) for i in byte_bpe(p, add_special_tokens=False)["input_ids"]
    ]
    assert cut == whole


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak memory read from Linux /proc")
def test_a_20_mb_single_line_calibration_file_costs_the_windows_not_the_file(byte_bpe, tmp_path):
    """The user's calibration text: a 20 MB file without a newline. Filling 3 windows of 72
    tokens tokenizes one piece of it, not the whole line (which costs gigabytes and minutes)."""
    from bridgecache.fitting.calibration import calibration_sequences

    rng = random.Random(0)
    words = ["hello", "world", "the", "ship", "came", "in", "at", "dawn", "rope", "salt"]
    path = tmp_path / "one-line.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(4_400_000)))
    assert path.stat().st_size > 20_000_000 and b"\n" not in path.read_bytes()[:1_000_000]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident memory
    before, start = _vm("VmRSS"), time.perf_counter()
    seqs, policy = calibration_sequences(byte_bpe, byte_bpe, 3, 72, text=text.user_text(path))
    seconds, grown = time.perf_counter() - start, _vm("VmHWM") - before
    assert policy == "identity" and [tuple(s.target_ids.shape) for s in seqs] == [(72,)] * 3
    assert grown < 400, f"peak memory grew by {grown} MB (the file is 22 MB; tokenized whole it is ~5 GB)"
    assert seconds < 8, f"{seconds:.1f} s to fill 3 windows"
