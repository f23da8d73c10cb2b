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

The user's own calibration text (`UserText`, made by `user_text`): text files, a list of
strings, or a Hugging Face `datasets` Dataset / IterableDataset read by column (duck-typed: rows
are mappings; `datasets` is never imported here). Its documents are read in order, never stored;
`Digest` hashes the documents a fit actually read, which is what a bridge records of them.

This module knows nothing about models; token helpers only call `tokenizer(text)`.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

__all__ = [
    "DOMAINS",
    "SPLITS",
    "Digest",
    "UserText",
    "documents",
    "split_of",
    "text_chunks",
    "token_sequences",
    "user_text",
    "window_ids",
    "builtin_windows",
    "chunks_of",
    "pieces",
    "PIECE_CHARS",
]

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
    for ids in builtin_windows(tokenizer, seq_len, domain, split, seed):
        rows.append(ids)
        if len(rows) == n:
            break
    if len(rows) < n:
        raise ValueError(
            f"the {domain}/{split} text holds only {len(rows)} windows of {seq_len} tokens, asked for {n}"
            + (
                "; the 'code' (or 'mixed') text holds more, or fit on your own text (FitConfig(text=...))"
                if split == "calib"
                else ""
            )
        )
    return torch.tensor(rows, dtype=torch.long)


def builtin_windows(tokenizer, seq_len: int, domain: str, split: str, seed: int) -> Iterator[list[int]]:
    """The windows `token_sequences` takes from: the split's documents shuffled with `seed`."""
    docs = [t for _, t in documents(domain, split)]
    random.Random(f"{domain}/{split}/{seed}").shuffle(docs)
    return window_ids(docs, tokenizer, seq_len)


def window_ids(docs: Iterable[str], tokenizer, seq_len: int) -> Iterator[list[int]]:
    """Consecutive windows of `seq_len` token ids over `docs` joined by blank lines (no specials).

    Tokenized piece by piece, as windows are taken: a document longer than `PIECE_CHARS` is cut
    into pieces at word boundaries (`pieces`), so the memory and time spent are those of the
    windows asked for plus one piece, not of the file (a 20 MB line once cost 4.5 GB to fill one
    window). A cut between a word and the space before the next keeps the tokens of whitespace-
    splitting tokenizers; a piece with no space in its second half is cut at its length."""
    buffer: list[int] = []
    for text in docs:
        for piece in pieces(text + "\n\n"):
            buffer.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
            taken = 0
            while len(buffer) - taken >= seq_len:
                yield buffer[taken : taken + seq_len]
                taken += seq_len
            del buffer[:taken]  # once per piece: never quadratic in the windows


PIECE_CHARS = 1 << 18  # above every built-in calibration document: their windows are as before


def pieces(text: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most `limit` characters, each cut just before a space
    that follows a non-space (in the second half of the piece) where there is one."""
    start = 0
    while len(text) - start > limit:
        end = start + limit
        cut = text.rfind(" ", start + limit // 2, end)
        while cut > start + limit // 2 and text[cut - 1].isspace():  # keep runs of spaces whole
            cut = text.rfind(" ", start + limit // 2, cut)
        end = cut if cut > start + limit // 2 else end
        yield text[start:end]
        start = end
    yield text[start:]


def chunks_of(docs: Iterable[str], chars: int) -> Iterator[str]:
    """Consecutive chunks of about `chars` characters over `docs` joined by blank lines, cut at
    whitespace where one is in the second half of a chunk (linear in the text: a long document
    is walked by position, never copied once per chunk)."""
    carry = ""
    for text in docs:
        buffer, start = carry + text + "\n\n", 0
        while len(buffer) - start >= chars:
            end = buffer.rfind(" ", start + chars // 2, start + chars)
            end = end if end > start else start + chars
            chunk = buffer[start:end].strip()
            start = end
            if chunk:
                yield chunk
        carry = buffer[start:]


# ----------------------------------------------------------------------------------------------
# The user's own text


@dataclass(frozen=True, eq=False)
class UserText:
    """The user's calibration documents. read(): a fresh iterator over them, in order;
    description: what they are, in words (for messages; never the text itself)."""

    read: Callable[[], Iterator[str]]
    description: str

    def __repr__(self) -> str:
        return f"UserText({self.description})"


class Digest:
    """sha256 of the documents drawn through `wrap` (each as its length and UTF-8 bytes)."""

    def __init__(self):
        self._hash, self.documents = hashlib.sha256(), 0

    def wrap(self, docs: Iterable[str]) -> Iterator[str]:
        for doc in docs:
            data = doc.encode("utf-8")
            self._hash.update(len(data).to_bytes(8, "little") + data)
            self.documents += 1
            yield doc

    @property
    def value(self) -> str:
        return "sha256:" + self._hash.hexdigest()


def user_text(value, column: str = "text") -> UserText:
    """`value` as UserText: a file or folder (its *.txt and *.md files, sorted) path, a list of
    strings (the documents) or of paths, or a dataset: an iterable of mappings with a `column`
    of strings (a Hugging Face Dataset / IterableDataset). ValueError/TypeError saying what is
    wrong and what was expected, before anything is read but the paths' existence."""
    if isinstance(value, UserText):
        return value
    if isinstance(value, (str, os.PathLike)):
        return _files([Path(value)])
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("text is an empty list; expected strings (documents) or file paths")
        if all(isinstance(v, os.PathLike) for v in value):
            return _files([Path(v) for v in value])
        bad = next((v for v in value if not isinstance(v, str)), None)
        if bad is not None:
            raise TypeError(
                f"text holds {type(bad).__name__} {bad!r:.60}; expected only strings or only paths"
            )
        docs = tuple(value)
        return UserText(lambda: iter(docs), f"{len(docs)} strings")
    names = getattr(value, "column_names", None)
    if names is not None or (hasattr(value, "__iter__") and not isinstance(value, Mapping)):
        if names is not None and column not in names:
            raise ValueError(
                f"text_column {column!r} is not a column of the dataset (columns: {list(names)})"
            )
        return UserText(lambda: _column(value, column), f"dataset column {column!r}")
    raise TypeError(
        f"text is {type(value).__name__}; expected a file or folder path, a list of strings or paths, "
        "or a dataset with a text column"
    )


def _files(paths: list[Path]) -> UserText:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
            if not found:
                raise ValueError(f"text folder {path} holds no .txt or .md files")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"text file {path} does not exist (for text itself, pass a list of strings)")
    names = files[0].name if len(files) == 1 else f"{len(files)} files"
    return UserText(lambda: (f.read_text(encoding="utf-8", errors="replace") for f in files), names)


def _column(dataset, column: str) -> Iterator[str]:
    for i, row in enumerate(dataset):
        if not isinstance(row, Mapping) or column not in row:
            raise ValueError(f"dataset row {i} has no column {column!r} (text_column names the text column)")
        text = row[column]
        if not isinstance(text, str):
            raise TypeError(f"dataset row {i}: column {column!r} is {type(text).__name__}; expected a string")
        yield text
