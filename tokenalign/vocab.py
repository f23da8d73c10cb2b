"""`Vocab`: what text each token id of one tokenizer stands for.

Three questions about a tokenizer's ids, answered without offsets:
- which ids are control tokens (BOS/EOS, padding, chat markers like <|im_start|>): they stand for no
  text, so a target token of that kind is computed natively;
- which id is the "unknown" token (text the tokenizer cannot represent): it stands for text we do
  not know, written as the placeholder byte 0xFF, which never occurs in UTF-8, so that comparing
  texts (textmap.py) pairs it with whatever the other side has there;
- the exact UTF-8 bytes of every other token (`piece`), and the text of a whole id sequence with
  each token's byte span in it (`reconstruct`).

Bytes come from the vocabulary itself where its scheme is known, because decoding one token at a
time loses bytes when a token ends inside a UTF-8 character:
- byte-level BPE (GPT-2, SmolLM2, Qwen2.5): each character of a token is one byte ("Ġ" = space);
- SentencePiece-style (Llama, Gemma): "▁" is a space and "<0xNN>" is the byte NN (byte fallback).
The reconstruction is checked against the tokenizer's own `decode`; when the scheme is unknown or
the check fails it decodes incrementally instead, which works for any tokenizer.

Duck-typed on the transformers tokenizer API (`decode`, `convert_ids_to_tokens`, `all_special_ids`,
`added_tokens_decoder`, `backend_tokenizer`). Knows nothing about alignment, KV caches or models.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from itertools import chain

import numpy as np

__all__ = ["UNKNOWN_PIECE", "Vocab"]

UNKNOWN_PIECE = b"\xff"  # stands for the unknown token's text; never valid UTF-8, so never matches text

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CONTEXT = 8  # tokens of left context when decoding incrementally (decoders join tokens by context)
_MAX_PENDING = 8  # longest run of tokens allowed to build one character (UTF-8 needs at most 4)

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte, inverted (character -> byte)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in table.values())
    table |= {chr(256 + n): b for n, b in enumerate(shifted)}
    return table


_BYTE_DECODER = _gpt2_byte_decoder()


class Vocab:
    """Token ids of one tokenizer -> text (see module doc). Build with `Vocab.of(tokenizer)`."""

    def __init__(self, tokenizer, scheme: str | None = "auto"):
        """`scheme`: "byte_level", "sentencepiece", None (always decode incrementally) or "auto"."""
        self.tokenizer = tokenizer
        self.unk_id = _unk_id(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        control = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or []}
        control |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
        control.discard(self.unk_id)
        self.control_ids = np.array(sorted(control), dtype=np.int64)
        self._is_control = np.zeros(int(self.control_ids.max(initial=0)) + 1, dtype=bool)  # id -> control
        self._is_control[self.control_ids] = True
        # Non-special added tokens ("\n\n" in Gemma, "<tool_call>" in Qwen) are text, written as is.
        self._added = {
            int(i): str(getattr(tok, "content", tok)).encode()
            for i, tok in added.items()
            if int(i) not in control
        }
        self.scheme = _scheme(tokenizer) if scheme == "auto" else scheme
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def of(cls, tokenizer) -> Vocab:
        """The (cached) `Vocab` of a tokenizer."""
        try:
            vocab = _cache.get(tokenizer)
        except TypeError:  # not weak-referenceable or not hashable: build every time
            return cls(tokenizer)
        if vocab is None:  # a proxy: the cached Vocab must not keep its tokenizer alive
            vocab = _cache[tokenizer] = cls(weakref.proxy(tokenizer))
        return vocab

    def control_mask(self, ids: list[int]) -> np.ndarray:
        """bool `[tokens]`: True for control tokens (no text)."""
        ids = np.asarray(ids, dtype=np.int64)
        return self._is_control[np.minimum(ids, len(self._is_control) - 1)] & (ids < len(self._is_control))

    def piece(self, token_id: int) -> bytes | None:
        """UTF-8 bytes of one text token from the vocabulary; None when the scheme is unknown."""
        if token_id == self.unk_id:
            return UNKNOWN_PIECE
        if self.scheme is None:
            return None
        if token_id not in self._pieces:
            self._fill([token_id])
        return self._pieces[token_id]

    def reconstruct(self, ids: list[int]) -> tuple[bytes, np.ndarray, np.ndarray]:
        """The text of an id sequence, and each token's byte span in it.

        Returns (text, start, end): start, end int64 `[tokens]`. Control tokens write their own
        marker ("<|im_start|>") into the text, so it lines up with a text holding that marker, but
        get empty spans. Tokens that together build one character may share that character's span.
        """
        control = self.control_mask(ids)
        if self.scheme is not None:
            self._fill([i for i in set(ids) if i not in self._pieces and i != self.unk_id])
            pieces = [None if c else self.piece(i) for i, c in zip(ids, control.tolist(), strict=True)]
            if self._decodes_to(ids, pieces):
                return self._join(ids, control, pieces)
        return self._lay_out(ids, control, self._decode_incrementally(ids, control))

    def _join(self, ids, control, pieces) -> tuple[bytes, np.ndarray, np.ndarray]:
        """Pieces (None for control tokens) and control markers end to end; one token each."""
        parts = [self._marker(ids[k]) if p is None else p for k, p in enumerate(pieces)]
        sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        end = np.cumsum(sizes)
        start = end - sizes
        start[control], end[control] = 0, 0
        return b"".join(parts), start, end

    def _lay_out(self, ids, control, groups) -> tuple[bytes, np.ndarray, np.ndarray]:
        """Write text groups and control markers end to end, in token order.

        A group is `(token positions, bytes, where each token starts within the bytes)`; its tokens
        all end at the group's end (they build its last character together)."""
        markers = [([k], self._marker(ids[k]), None) for k in np.flatnonzero(control).tolist()]
        units = sorted([*groups, *markers], key=lambda unit: unit[0][-1])
        sizes = np.array([len(piece) for _, piece, _ in units], dtype=np.int64)
        begins = np.cumsum(sizes) - sizes
        text = [u for u, (_, _, offsets) in enumerate(units) if offsets is not None]
        owner = np.repeat(np.array(text, dtype=np.int64), [len(units[u][0]) for u in text])
        positions = np.fromiter(chain.from_iterable(units[u][0] for u in text), dtype=np.int64)
        within = np.fromiter(chain.from_iterable(units[u][2] for u in text), dtype=np.int64)
        start = np.zeros(len(ids), dtype=np.int64)
        end = np.zeros(len(ids), dtype=np.int64)
        start[positions] = begins[owner] + within
        end[positions] = begins[owner] + sizes[owner]
        return b"".join(piece for _, piece, _ in units), start, end

    def _marker(self, token_id: int) -> bytes:
        token = self.tokenizer.convert_ids_to_tokens(int(token_id))
        return (token or "").encode("utf-8", "surrogatepass")

    def _fill(self, ids: list[int]) -> None:
        tokens = self.tokenizer.convert_ids_to_tokens(ids) if ids else []
        for token_id, token in zip(ids, tokens, strict=True):
            if token_id in self._added:
                self._pieces[token_id] = self._added[token_id]
            elif self.scheme == "byte_level":
                try:
                    self._pieces[token_id] = bytes(_BYTE_DECODER[c] for c in token)
                except KeyError:  # not a byte-level token: its characters are its text
                    self._pieces[token_id] = token.encode()
            else:
                fallback = _BYTE_FALLBACK.fullmatch(token)
                piece = bytes([int(fallback[1], 16)]) if fallback else token.replace("▁", " ").encode()
                self._pieces[token_id] = piece

    def _decodes_to(self, ids: list[int], pieces: list[bytes | None]) -> bool:
        """Do the pieces spell what the tokenizer's own decode says (up to a stripped leading space)?"""
        text_ids = [i for i, p in zip(ids, pieces, strict=True) if p is not None and i != self.unk_id]
        if not text_ids:
            return True
        got = b"".join(self._pieces[i] for i in text_ids).decode("utf-8", "replace")
        want = self._decode(text_ids)
        return got == want or (got.startswith(" ") and got[1:] == want)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _decode_incrementally(self, ids: list[int], control: np.ndarray) -> list[tuple]:
        """Text groups (see `_lay_out`) of any tokenizer: a token's text is what it adds to a decode
        of the `_CONTEXT` text tokens before it (O(n * _CONTEXT) short decodes). A token whose decode
        ends in U+FFFD stops inside a UTF-8 character: it waits for the token that completes the
        character, and the group shares that character, as fast tokenizers' offsets do; the
        complete characters each token adds before it ("Ġå" adds a space) stay its own."""
        positions = np.flatnonzero(~control).tolist()
        text_ids = [int(ids[k]) for k in positions]
        groups, first, offsets = [], 0, []  # first: first text token whose text is not yet written
        for n, token_id in enumerate(text_ids):
            if token_id == self.unk_id:
                groups.append(([positions[n]], UNKNOWN_PIECE, [0]))
                first, offsets = n + 1, []
                continue
            lo = max(0, first - _CONTEXT)
            if not offsets:
                before = self._decode(text_ids[lo:first]) if first > lo else ""
                complete = 0  # bytes of whole characters the group has so far
            after = self._decode(text_ids[lo : n + 1])
            shared = len(before if after.startswith(before) else os.path.commonprefix([before, after]))
            added = after[shared:]
            offsets.append(complete)
            complete = len(added.rstrip("\ufffd").encode("utf-8", "surrogatepass"))
            waiting = added.endswith("\ufffd") and n + 1 < len(text_ids) and n + 1 - first < _MAX_PENDING
            if waiting and text_ids[n + 1] != self.unk_id:
                continue
            groups.append((positions[first : n + 1], added.encode("utf-8", "surrogatepass"), offsets))
            first, offsets = n + 1, []
        return groups


def _unk_id(tokenizer) -> int | None:
    """Id of the token that stands for unrepresentable text, if the tokenizer can produce one.

    transformers may name an unk token the model never emits (SmolLM2 calls <|endoftext|> its unk);
    the backend model's own unk_token is the reliable answer where there is a backend.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is not None and hasattr(model, "unk_token"):
        token = model.unk_token
        return None if token is None else int(tokenizer.convert_tokens_to_ids(token))
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if unk is None else int(unk)


def _scheme(tokenizer) -> str | None:
    """ "byte_level", "sentencepiece" or None (unknown: decode incrementally), from the decoder."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return None
    types = set()
    _collect(json.loads(decoder.__getstate__()), types)
    if "ByteLevel" in types:
        return "byte_level"
    if types & {"ByteFallback", "Metaspace", "Replace▁"}:
        return "sentencepiece"
    return None


def _collect(node, types: set) -> None:
    """Decoder types in a decoder's JSON state ("Replace▁" for a Replace of "▁")."""
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "Replace" and node.get("pattern", {}).get("String") == "▁":
            kind = "Replace▁"
        types.add(kind)
        for child in node.get("decoders") or []:
            _collect(child, types)
