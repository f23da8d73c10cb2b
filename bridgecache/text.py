"""Calibration and evaluation text that every Python install ships: no download.

Two domains:
- "prose": the topic pages of `pydoc_data.topics` (the language reference behind `help()`).
- "code": the standard library's own `.py` sources.
And one for independent evaluation only (never calibration, never tuning):
- "manual": Vim's help files (Debian's vim-runtime, /usr/share/vim/vim*/doc/*.txt): prose of
  another domain and style than the calibration text. Every document is in the "eval" split.

The split is by document, fixed and documented so calibration and evaluation never share text:
a document belongs to "eval" when the first byte of sha256(its name) is < 77 (about 30%), and to
"calib" otherwise. Names are the topic key ("prose") or the path relative to the stdlib
directory ("code"), so the split is the same on every machine with the same Python.

This module knows nothing about models; token helpers only call `tokenizer(text)`.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import torch

__all__ = ["DOMAINS", "SPLITS", "documents", "split_of", "text_chunks", "token_sequences"]

DOMAINS = ("prose", "code")
EVAL_ONLY_DOMAINS = ("manual",)
_MANUAL_GLOB = "/usr/share/vim/vim*/doc/*.txt"
SPLITS = ("calib", "eval")
_EVAL_BYTE_BELOW = 77  # ~30% of documents go to evaluation
_MIN_DOC_CHARS = 400


def split_of(name: str, domain: str | None = None) -> str:
    """'eval' or 'calib': the fixed split a document of this name belongs to."""
    if domain in EVAL_ONLY_DOMAINS:
        return "eval"
    return "eval" if hashlib.sha256(name.encode()).digest()[0] < _EVAL_BYTE_BELOW else "calib"


def documents(domain: str, split: str) -> list[tuple[str, str]]:
    """(name, text) of every document of a domain and split, sorted by name."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if domain in EVAL_ONLY_DOMAINS and split != "eval":
        raise ValueError(
            f"the {domain!r} text is reserved for independent evaluation: it has no {split!r} split"
        )
    return [(n, t) for n, t in _all_documents(domain) if split_of(n, domain) == split]


@cache
def _all_documents(domain: str) -> tuple[tuple[str, str], ...]:
    if domain == "prose":
        from pydoc_data.topics import topics

        docs = [(k, v) for k, v in topics.items()]
    elif domain == "code":
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = []
        for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
            if "site-packages" in path.parts or "test" in path.parts[len(root.parts) :]:
                continue
            try:
                docs.append((str(path.relative_to(root)), path.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, OSError):
                continue
    elif domain == "manual":
        import glob

        paths = sorted(glob.glob(_MANUAL_GLOB))
        if not paths:
            raise ValueError(
                f"the 'manual' evaluation text is Vim's help ({_MANUAL_GLOB}); none found: "
                "install Debian's vim-runtime (apt-get install vim-runtime)"
            )
        docs = [(Path(path).name, Path(path).read_text(encoding="utf-8", errors="replace")) for path in paths]
    else:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS + EVAL_ONLY_DOMAINS}")
    return tuple(sorted((n, t) for n, t in docs if len(t) >= _MIN_DOC_CHARS))


def text_chunks(domain: str, split: str, n: int, chars: int, seed: int = 0) -> list[str]:
    """`n` reproducible chunks of about `chars` characters each (cut at whitespace).

    Chunks come from distinct documents while there are enough, each from a random offset.
    Domain "mixed" alternates prose and code.
    """
    if domain == "mixed":
        half = (n + 1) // 2
        prose, code = (
            text_chunks("prose", split, half, chars, seed),
            text_chunks("code", split, half, chars, seed),
        )
        return [c for pair in zip(prose, code) for c in pair][:n]
    rng = random.Random(f"{domain}/{split}/{seed}")
    docs = [t for _, t in documents(domain, split) if len(t) >= chars]
    if not docs:
        docs = [t for _, t in documents(domain, split)]
    order = list(range(len(docs)))
    rng.shuffle(order)
    chunks = []
    for i in range(n):
        text = docs[order[i % len(order)]]
        start = rng.randrange(0, max(1, len(text) - chars))
        start = text.find(" ", start) + 1 if start else 0  # start at a word boundary
        chunk = text[start : start + chars]
        end = chunk.rfind(" ")
        chunks.append(chunk[: end if end > chars // 2 else len(chunk)].strip())
    return chunks


def token_sequences(
    tokenizer, n: int, seq_len: int, domain: str = "prose", split: str = "calib", seed: int = 0
) -> torch.Tensor:
    """[n, seq_len] int64 token ids: windows over the split's documents, no special tokens.

    Documents are shuffled with `seed`, concatenated with a blank line between them, tokenized,
    and cut into consecutive windows, so every window is real text of the requested length.
    """
    rows: list[list[int]] = []
    for ids in _token_windows(tokenizer, seq_len, domain, split, seed):
        rows.append(ids)
        if len(rows) == n:
            break
    if len(rows) < n:
        raise ValueError(
            f"the {domain}/{split} text holds only {len(rows)} windows of {seq_len} tokens, asked for {n}"
        )
    return torch.tensor(rows, dtype=torch.long)


def _token_windows(tokenizer, seq_len: int, domain: str, split: str, seed: int) -> Iterator[list[int]]:
    docs = [t for _, t in documents(domain, split)]
    random.Random(f"{domain}/{split}/{seed}").shuffle(docs)
    buffer: list[int] = []
    for text in docs:
        buffer.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]
