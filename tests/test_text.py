"""Calibration/evaluation text: fixed split, disjoint, reproducible windows."""

from __future__ import annotations

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
