"""Calibration sequences: token ids for both models and the (source row, target row) pairing.

Same tokenizer (equal fingerprints): windows of `seq_len` tokens from `bridgecache.text` (or the
user's own text, `FitConfig.text`, read in order), fed to both models; the pairing is the
identity alignment. "mixed" alternates prose and code windows while the prose lasts, then code.
Different tokenizers: text chunks aligned
with `tokenalign.align`, paired with `bridgecache.kv.align.pair_rows` (policy "mean": target rows
paired with source rows pooled over each target token's span). If the target's tokenizer
adds a BOS token, every target sequence starts with it (as at inference); it is never fitted.
Target rows < native_head are removed from the pairing (the target computes them itself).
Every `heldout_every`-th sequence is held out to score the maps (at least one).

This is the only place in fitting that touches tokenizers; it knows nothing about KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridgecache.models.spec import tokenizer_fingerprint
from bridgecache.text import (
    Digest,
    UserText,
    builtin_windows,
    chunks_of,
    text_chunks,
    token_sequences,
    window_ids,
)

__all__ = ["CalibSequence", "calibration_sequences", "same_tokenizer"]


@dataclass
class CalibSequence:
    """source_ids [S], target_ids [T] int64; src_rows, tgt_rows int64 [n]: the pairs to fit.

    pool: for policy "mean", the alignment whose spans pool the source rows into one row per
    target token (`bridgecache.kv.align.gather_rows`); src_rows then index those pooled rows.
    """

    source_ids: torch.Tensor
    target_ids: torch.Tensor
    src_rows: torch.Tensor
    tgt_rows: torch.Tensor
    heldout: bool
    pool: object | None = None


def same_tokenizer(a, b) -> bool:
    return a is b or tokenizer_fingerprint(a) == tokenizer_fingerprint(b)


def calibration_sequences(
    source_tokenizer,
    target_tokenizer,
    num_sequences: int,
    seq_len: int,
    domain: str = "prose",
    policy: str | None = None,
    native_head: int = 1,
    heldout_every: int = 8,
    seed: int = 0,
    *,
    text: UserText | None = None,
    digest: Digest | None = None,
) -> tuple[list[CalibSequence], str]:
    """The calibration sequences and the alignment policy they use ("identity" if same tokenizer).

    text: the user's documents instead of the built-in `domain`; `digest` (if given) hashes the
    documents read.
    """
    if num_sequences < 2:
        raise ValueError("calibration needs at least 2 sequences (one is held out to score the maps)")
    docs = None
    if text is not None:
        docs = (digest or Digest()).wrap(text.read())
    if same_tokenizer(source_tokenizer, target_tokenizer):
        if docs is None:
            seqs = _same(target_tokenizer, num_sequences, seq_len, domain, native_head, seed)
        else:
            seqs = _same_user(target_tokenizer, num_sequences, seq_len, docs, text, native_head)
        policy = "identity"
    else:
        policy = policy or "last"
        if docs is None:
            texts = text_chunks(domain, "calib", num_sequences, chars=seq_len * 6, seed=seed)
        else:
            texts = list(
                _take(
                    chunks_of(docs, seq_len * 6), num_sequences, text, f"chunks of {seq_len * 6} characters"
                )
            )
        seqs = _cross(source_tokenizer, target_tokenizer, texts, seq_len, policy, native_head)
    held = {i for i in range(len(seqs)) if (i + 1) % heldout_every == 0} or {len(seqs) - 1}
    for i, seq in enumerate(seqs):
        seq.heldout = i in held
    return seqs, policy


def _same(tokenizer, n: int, seq_len: int, domain: str, native_head: int, seed: int) -> list[CalibSequence]:
    prefix = _bos_prefix(tokenizer)
    body = seq_len - len(prefix)
    if domain == "mixed":
        ids = _mixed(tokenizer, n, body, seed)
    else:
        ids = token_sequences(tokenizer, n, body, domain, "calib", seed)
    return _identity_pairs(ids, prefix, seq_len, native_head)


def _mixed(tokenizer, n: int, body: int, seed: int) -> torch.Tensor:
    """Prose and code windows alternating, prose first; code fills in once the prose runs out."""
    prose = list(_take(builtin_windows(tokenizer, body, "prose", "calib", seed), (n + 1) // 2))
    code = token_sequences(tokenizer, n - len(prose), body, "code", "calib", seed).tolist()
    rows = [row for pair in zip(prose, code) for row in pair]
    rows += prose[len(code) :] + code[len(prose) :]
    return torch.tensor(rows, dtype=torch.long)


def _same_user(tokenizer, n, seq_len, docs, text: UserText, native_head) -> list[CalibSequence]:
    prefix = _bos_prefix(tokenizer)
    body = seq_len - len(prefix)
    ids = torch.tensor(list(_take(window_ids(docs, tokenizer, body), n, text, f"windows of {body} tokens")))
    return _identity_pairs(ids, prefix, seq_len, native_head)


def _take(items, n: int, text: UserText | None = None, what: str = ""):
    """The first n of `items`; with `text`, fewer is an error naming what the text holds."""
    out = []
    for item in items:
        out.append(item)
        if len(out) == n:
            break
    if text is not None and len(out) < n:
        raise ValueError(
            f"the calibration text ({text.description}) holds only {len(out)} {what}, asked for {n}"
        )
    return out


def _identity_pairs(
    ids: torch.Tensor, prefix: list[int], seq_len: int, native_head: int
) -> list[CalibSequence]:
    out = []
    rows = torch.arange(native_head, seq_len)
    for row in ids:
        full = torch.cat([torch.tensor(prefix, dtype=torch.long), row])
        out.append(CalibSequence(full, full, rows.clone(), rows.clone(), False))
    return out


def _cross(src_tok, tgt_tok, texts: list[str], seq_len, policy, native_head) -> list[CalibSequence]:
    """texts: ~6 characters per target token (generous for prose and code); cut at seq_len."""
    import tokenalign
    from bridgecache.kv.align import pair_rows, target_rows

    out = []
    for text in texts:
        text = _cut_to_tokens(text, tgt_tok, seq_len)
        alignment, src_ids, tgt_ids = tokenalign.align(text, src_tok, tgt_tok, policy=policy)
        src_ids, tgt_ids = (
            torch.as_tensor(src_ids, dtype=torch.long),
            torch.as_tensor(tgt_ids, dtype=torch.long),
        )
        if policy == "mean":  # several source rows per target row: pooled by the runner
            tgt_rows = target_rows(alignment)
            src_rows, pool = tgt_rows, alignment
        else:
            src_rows, tgt_rows = pair_rows(alignment)
            pool = None
        keep = tgt_rows >= native_head
        out.append(CalibSequence(src_ids, tgt_ids, src_rows[keep].long(), tgt_rows[keep].long(), False, pool))
    return out


def _cut_to_tokens(text: str, tokenizer, limit: int) -> str:
    """The longest prefix of `text` whose target tokenization (with specials) fits in `limit`."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    budget = limit - len(_bos_prefix(tokenizer))
    if len(enc["input_ids"]) <= budget:
        return text
    return text[: enc["offset_mapping"][budget - 1][1]]


def _bos_prefix(tokenizer) -> list[int]:
    """Token ids the tokenizer puts in front of a text (e.g. Gemma's <bos>); [] for most."""
    with_specials = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return (
        list(with_specials[: len(with_specials) - len(without)])
        if with_specials[-len(without) :] == without
        else []
    )
