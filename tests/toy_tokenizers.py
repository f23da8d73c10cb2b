"""Toy tokenizers built with the `tokenizers` library, mimicking the real families (no download).
The fixtures `byte_bpe`, `sp_bpe` and `words` (tests/conftest.py) build them once per module."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


def _merges_spelling(words: list[str]) -> list[tuple[str, str]]:
    """Left-to-right merges that make each word one token."""
    merges = []
    for word in words:
        for k in range(2, len(word) + 1):
            if (word[: k - 1], word[k - 1]) not in merges:
                merges.append((word[: k - 1], word[k - 1]))
    return merges


def _bpe_vocab(base: list[str], merges) -> dict[str, int]:
    vocab = {}
    for token in [*base, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    return vocab


def byte_bpe():
    """GPT-2 style byte-level BPE (SmolLM2, Qwen2.5): "Ġ" spaces, characters split into bytes."""
    merges = _merges_spelling(["hello", "Ġworld", "ðŁ", "Ġthe"])
    model = models.BPE(vocab=_bpe_vocab(sorted(pre_tokenizers.ByteLevel.alphabet()), merges), merges=merges)
    tk = Tokenizer(model)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def sp_bpe():
    """SentencePiece style (Gemma): "▁" spaces, "<0xNN>" byte fallback, a BOS post-processor."""
    base = ["<unk>", "<s>", *(f"<0x{b:02X}>" for b in range(256)), *"abcdefghijklmnopqrstuvwxyz▁"]
    merges = _merges_spelling(["he", "llo", "▁wor", "ld", "▁the"])
    tk = Tokenizer(
        models.BPE(vocab=_bpe_vocab(base, merges), merges=merges, byte_fallback=True, unk_token="<unk>")
    )
    tk.normalizer = normalizers.Replace(" ", "▁")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", unk_token="<unk>")


def words():
    """Word level with an unknown token and no spaces in any token."""
    tk = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
