"""Scoring generated answers: exact match, partial credit, Wilson intervals (pure arithmetic).

A reply is the target's greedy continuation after "Question: ... Answer:". What it is held to:
    one answer       `exact_match`: the reply's FIRST answer-shaped span equals the answer. A number
                     is compared with the first whole number of the reply (maximal digit run), so
                     "916375" and "9163758" are different answers, never a prefix of one another;
                     text is compared with the first non-empty line, lower-cased, outer quotes,
                     spaces and a final full stop removed.
    several answers  each must appear as a whole number (or, for text, a whole word or phrase,
                     case-insensitive) anywhere in the reply: `correct` needs all of them,
                     `partial` is the share found (RULER's string_match_all, arXiv 2404.06654,
                     with whole numbers instead of substrings).
Per condition: accuracy with its Wilson 95% interval; retention (bridged / native) with a paired
percentile bootstrap over items (metrics.bootstrap_ci); for items with several answers, the mean
partial credit beside the strict accuracy.

This module knows nothing about models, tokenizers or data files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from bridgecache.evaluation.metrics import bootstrap_ci, ratio

__all__ = [
    "numbers",
    "first_line",
    "exact_match",
    "found",
    "correct",
    "partial",
    "wilson",
    "generation_metrics",
]

_DIGITS = re.compile(r"\d+")


def numbers(text: str) -> list[str]:
    """The whole numbers of `text` in order (maximal digit runs: "a 12, 345" -> ["12", "345"])."""
    return _DIGITS.findall(text)


def first_line(text: str) -> str:
    """The first non-empty line, normalised: outer spaces, quotes and final full stops removed,
    inner spaces collapsed, lower-cased."""
    line = next((x for x in text.splitlines() if x.strip()), "")
    line = re.sub(r"\s+", " ", line).strip().strip("\"'`").rstrip(".").strip().lower()
    return line


def _is_number(answer: str) -> bool:
    return answer.strip().isdigit()


def exact_match(reply: str, answer: str) -> bool:
    """Whether the reply's first answer-shaped span is exactly `answer` (see the module docstring)."""
    answer = answer.strip()
    if _is_number(answer):
        found_numbers = numbers(reply)
        return bool(found_numbers) and found_numbers[0] == answer
    return first_line(reply) == first_line(answer)


def found(reply: str, answer: str) -> bool:
    """Whether `answer` appears in the reply as a whole number, or as whole words (case-insensitive)."""
    answer = answer.strip()
    if _is_number(answer):
        return answer in numbers(reply)
    pattern = r"(?<!\w)" + re.escape(answer.lower()) + r"(?!\w)"
    return re.search(pattern, reply.lower()) is not None


def correct(reply: str, answers: Sequence[str]) -> bool:
    """One answer: exact match; several: every one found."""
    if len(answers) == 1:
        return exact_match(reply, answers[0])
    return all(found(reply, a) for a in answers)


def partial(reply: str, answers: Sequence[str]) -> float:
    """The share of `answers` found in the reply (1 answer: 1.0 or 0.0, as `correct`)."""
    if len(answers) == 1:
        return float(exact_match(reply, answers[0]))
    return sum(found(reply, a) for a in answers) / len(answers)


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% by default); (nan, nan) when n is 0."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # All right (none right) reaches 1 (0) exactly; in floats centre + half can fall an ulp short,
    # and an interval that misses its own point breaks every plot's error bars.
    lower = 0.0 if successes == 0 else max(0.0, centre - half)
    upper = 1.0 if successes == n else min(1.0, centre + half)
    return (lower, upper)


def generation_metrics(replies: dict[str, Sequence[str]], answers: Sequence[Sequence[str]]) -> dict:
    """Metrics of the generation task.

    replies: condition -> per-item reply text, for "native", "bridged", "no_context",
        "other_native" (those present are reported). answers: per item, the answers its reply must hold.
    Returns acc_X, acc_X_ci (Wilson 95%), correct_X (count), partial_X and partial_X_n (mean share
    of answers found over items with several answers; NaN and 0 when there are none), retention
    (acc_bridged / acc_native) with a paired bootstrap retention_ci, and n.
    """
    out: dict = {"n": len(answers)}
    hits = {c: [correct(r, a) for r, a in zip(rs, answers, strict=True)] for c, rs in replies.items()}
    several = [i for i, a in enumerate(answers) if len(a) > 1]
    for condition, row in hits.items():
        k = sum(row)
        out[f"correct_{condition}"] = k
        out[f"acc_{condition}"] = k / len(row) if row else math.nan
        out[f"acc_{condition}_ci"] = list(wilson(k, len(row)))
        shares = [partial(replies[condition][i], answers[i]) for i in several]
        out[f"partial_{condition}"] = sum(shares) / len(shares) if shares else math.nan
        out[f"partial_{condition}_n"] = len(shares)
    if "bridged" in hits and "native" in hits:
        out["retention"] = ratio(out["acc_bridged"], out["acc_native"])

        def retention(indices: list[int]) -> float:
            return ratio(
                sum(hits["bridged"][i] for i in indices) / len(indices),
                sum(hits["native"][i] for i in indices) / len(indices),
            )

        out["retention_ci"] = list(bootstrap_ci(len(answers), retention))
    return out
