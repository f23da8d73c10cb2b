"""Quality metrics of a handoff from per-item log-likelihoods: pure arithmetic, no models.

Perplexity task (per item: summed NLL of the continuation tokens under each condition):
    nll_X                   token-weighted mean NLL per continuation token, sum(nll) / sum(tokens)
    ppl_X                   exp(nll_X)
    context_gain_recovered  (nll_no_context - nll_bridged) / (nll_no_context - nll_native)
    content_gain_recovered  (nll_other_native - nll_bridged) / (nll_other_native - nll_native)
Ratios of log-likelihoods, not of perplexities: a perplexity ratio flatters (PAPERS.md lesson 3).
A gain ratio is NaN when its denominator is <= 0 (the native context did not help: nothing to
recover). Both can exceed 1 (the bridged cache beat native prefill) or fall below 0 (it hurt).

Choice task: each choice is scored by its LENGTH-NORMALISED log-likelihood, the mean log-prob per
target token of the choice text, mean_t log p(c_t | context, question, c_<t); the target picks
the highest (ties: the lowest index). Unnormalised sums favour short choices.
    acc_X                   fraction of items whose pick is the answer
    retention               acc_bridged / acc_native (NaN when acc_native is 0)
    retention_above_chance  (acc_bridged - chance) / (acc_native - chance), chance = mean 1/choices

Arms (evaluation.arms), from a per-item quality where higher is better (choice: correct 0/1;
ppl: minus the token-weighted NLL):
    gap_recovered           (bridged - source_alone) / (native - source_alone): the share of what the
                            target adds over the source alone that the handoff keeps (NaN unless
                            native beats the source alone: there is no gap to recover)
    diff_A_B                quality of arm A minus arm B (paired), e.g. diff_bridged_chosen_only,
                            diff_translation_wrong_document, diff_translation_random_map

Confidence intervals: percentile bootstrap over items (paired: one resample of items serves every
condition), seeded, so a ratio over 16 items is not read as more exact than it is.

This module knows nothing about models, tokenizers or data files.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

__all__ = [
    "mean_nll",
    "gain_recovered",
    "pick_choice",
    "accuracy",
    "ratio",
    "bootstrap_ci",
    "ppl_metrics",
    "choice_metrics",
    "COMPARISONS",
    "arm_metrics",
    "map_uses_input",
]


def mean_nll(nll_sums: Sequence[float], token_counts: Sequence[int]) -> float:
    """Token-weighted mean NLL per token over items: sum(nll_sums) / sum(token_counts)."""
    total = sum(token_counts)
    if total <= 0:
        return math.nan
    return sum(nll_sums) / total


def gain_recovered(nll_baseline: float, nll_bridged: float, nll_native: float) -> float:
    """(baseline - bridged) / (baseline - native); NaN when native is not better than the baseline."""
    gap = nll_baseline - nll_native
    if not gap > 0:
        return math.nan
    return (nll_baseline - nll_bridged) / gap


def pick_choice(logprob_sums: Sequence[float], token_counts: Sequence[int]) -> int:
    """Index of the choice with the highest mean log-prob per token (ties: the lowest index)."""
    scores = [s / n for s, n in zip(logprob_sums, token_counts)]
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def accuracy(picks: Sequence[int], answers: Sequence[int]) -> float:
    if not picks:
        return math.nan
    return sum(int(p == a) for p, a in zip(picks, answers)) / len(picks)


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is 0 or NaN."""
    if not denominator or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def bootstrap_ci(
    n_items: int,
    statistic: Callable[[list[int]], float],
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic(item_indices)` over items resampled with replacement."""
    if n_items < 2:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        value = statistic([rng.randrange(n_items) for _ in range(n_items)])
        if not math.isnan(value):
            values.append(value)
    if len(values) < resamples // 2:  # the statistic is undefined on most resamples
        return (math.nan, math.nan)
    values.sort()
    lo = values[int((1 - level) / 2 * (len(values) - 1))]
    hi = values[int((1 + level) / 2 * (len(values) - 1))]
    return (lo, hi)


def ppl_metrics(nll: dict[str, Sequence[float]], tokens: Sequence[int]) -> dict:
    """Metrics of the perplexity task.

    nll: condition -> per-item summed NLL, for the conditions "native", "bridged", "no_context",
        "other_native", "other_bridged" (those present are reported).
    tokens: per-item number of scored continuation tokens.
    """
    out: dict = {}
    for condition, sums in nll.items():
        out[f"nll_{condition}"] = mean_nll(sums, tokens)
        out[f"ppl_{condition}"] = math.exp(out[f"nll_{condition}"])

    def gains(indices: list[int]) -> tuple[float, float]:
        m = {c: mean_nll([s[i] for i in indices], [tokens[i] for i in indices]) for c, s in nll.items()}
        return (
            gain_recovered(m["no_context"], m["bridged"], m["native"]),
            gain_recovered(m["other_native"], m["bridged"], m["native"]),
        )

    everyone = list(range(len(tokens)))
    out["context_gain_recovered"], out["content_gain_recovered"] = gains(everyone)
    out["context_gain_recovered_ci"] = list(bootstrap_ci(len(tokens), lambda ix: gains(ix)[0]))
    out["content_gain_recovered_ci"] = list(bootstrap_ci(len(tokens), lambda ix: gains(ix)[1]))
    return out


def choice_metrics(picks: dict[str, Sequence[int]], answers: Sequence[int], n_choices: Sequence[int]) -> dict:
    """Metrics of the choice task.

    picks: condition -> per-item picked choice, for "native", "bridged", "no_context",
        "other_native". answers: per-item correct index; n_choices: per-item number of choices.
    """
    out: dict = {f"acc_{c}": accuracy(p, answers) for c, p in picks.items()}
    out["chance"] = sum(1 / n for n in n_choices) / len(n_choices) if n_choices else math.nan
    out["retention"] = ratio(out["acc_bridged"], out["acc_native"])
    above = out["acc_native"] - out["chance"]
    # Floor-normalised (PAPERS.md): undefined when native prefill itself is at or below chance.
    out["retention_above_chance"] = (out["acc_bridged"] - out["chance"]) / above if above > 0 else math.nan

    def retention(indices: list[int]) -> float:
        sub = lambda c: accuracy([picks[c][i] for i in indices], [answers[i] for i in indices])  # noqa: E731
        return ratio(sub("bridged"), sub("native"))

    out["retention_ci"] = list(bootstrap_ci(len(answers), retention))
    out["acc_bridged_ci"] = list(
        bootstrap_ci(
            len(answers), lambda ix: accuracy([picks["bridged"][i] for i in ix], [answers[i] for i in ix])
        )
    )
    return out


# (A, B) pairs whose paired difference is reported when both arms were computed.
COMPARISONS = (
    ("bridged", "native"),
    ("bridged", "chosen_only"),
    ("bridged", "translation"),
    ("bridged", "source_alone"),
    ("translation", "wrong_document"),
    ("translation", "random_map"),
    ("translation", "no_context"),
)


def arm_metrics(quality: Callable[[str, list[int]], float], arms: Sequence[str], n_items: int) -> dict:
    """Gap recovered and paired differences between arms, each with a paired bootstrap interval.

    quality(arm, item_indices): the arm's quality on those items, higher better (the same
    resample of items serves every arm). arms: the arms computed."""
    out: dict = {}
    everyone = list(range(n_items))
    if {"native", "bridged", "source_alone"} <= set(arms):

        def gap(ix: list[int]) -> float:
            source = quality("source_alone", ix)
            return ratio(quality("bridged", ix) - source, _positive(quality("native", ix) - source))

        out["gap_recovered"] = gap(everyone)
        out["gap_recovered_ci"] = list(bootstrap_ci(n_items, gap))
    for a, b in COMPARISONS:
        if a in arms and b in arms:
            diff = lambda ix, a=a, b=b: quality(a, ix) - quality(b, ix)  # noqa: E731
            out[f"diff_{a}_{b}"] = diff(everyone)
            out[f"diff_{a}_{b}_ci"] = list(bootstrap_ci(n_items, diff))
    return out


def map_uses_input(summary: dict) -> bool | None:
    """Whether translation only with the right document beats both the wrong document and the
    random map, each paired interval above zero (None when either arm was not computed). A map
    that ignores its input scores the same with any document and fails this."""
    intervals = [summary.get(f"diff_translation_{arm}_ci") for arm in ("wrong_document", "random_map")]
    if any(ci is None for ci in intervals):
        return None
    return all(not math.isnan(ci[0]) and ci[0] > 0 for ci in intervals)


def _positive(x: float) -> float:
    return x if x > 0 else math.nan
