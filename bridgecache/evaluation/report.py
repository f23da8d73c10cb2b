"""Summaries of an Evaluation: the JSON object and the table printed on stdout.

`summarise(evaluation, variant, **meta)` -> dict with `task`, `n`, `skipped`, the metrics of
`metrics.py` (ppl: nll_* / ppl_* / *_gain_recovered; choice: acc_* / retention) or `answers.py`
(generate: acc_* with Wilson intervals, partial_*, retention; CPU seconds too), the timings summed
over items (`native_prefill_s`, `handoff_s`, `source_prefill_s`, `align_s`, `speedup`) and the
per-item records (for plots), and with extra arms (evaluation.arms) their scores, the gap recovered
and the paired differences (metrics.arm_metrics). `format_table(summary)` renders it for people.

This module knows nothing about models or data files.
"""

from __future__ import annotations

import math

from bridgecache.evaluation.answers import correct, generation_metrics
from bridgecache.evaluation.metrics import (
    COMPARISONS,
    arm_metrics,
    choice_metrics,
    map_uses_input,
    mean_nll,
    pick_choice,
    ppl_metrics,
)
from bridgecache.evaluation.runner import Evaluation, Variant

__all__ = ["summarise", "format_table", "HANDOFF_NOTE"]

HANDOFF_NOTE = (
    "A handoff pays only when the source has read the context anyway: the target skips its prefill, "
    "but reading the context costs the source its own prefill (source_prefill_s)."
)
_PPL_ROWS = (
    ("native", "(a) native prefill"),
    ("bridged", "(b) bridged cache"),
    ("no_context", "(c) no context"),
    ("other_native", "(d) native, unrelated context"),
    ("other_bridged", "(e) bridged, unrelated context"),
)
_GENERATE_ROWS = (
    ("native", "(a) native prefill"),
    ("bridged", "(b) bridged cache"),
    ("no_context", "(c) no context"),
    ("other_native", "(d) native, unrelated context"),
)
_CHOICE_ROWS = (
    ("native", "(a) native prefill"),
    ("bridged", "(b) bridged cache"),
    ("no_context", "(c) no context"),
    ("other_native", "(d) native, unrelated context"),
)
_ARM_ROWS = (  # the extra arms (evaluation.arms), where computed
    ("source_alone", "(s) source alone"),
    ("translation", "(t) translation only"),
    ("chosen_only", "(k) chosen tokens alone"),
    ("wrong_document", "(w) translation, wrong document"),
    ("random_map", "(r) translation, random map"),
)
_PER_VARIANT = ("translation", "chosen_only", "wrong_document", "random_map")


def _conditions(evaluation: Evaluation, variant: Variant) -> dict[str, str]:
    """Our condition name -> the key of its scores in ItemResult.scores."""
    keys = {"native": "native", "no_context": "no_context", "other_native": "other_native"}
    keys["bridged"] = f"bridged[{variant.name}]"
    if evaluation.task == "generate" and not all("other_native" in r.replies for r in evaluation.items):
        del keys["other_native"]  # one item evaluated alone has no unrelated context
    if evaluation.task == "ppl":
        keys["other_bridged"] = f"other_bridged[{variant.name}]"
    for arm in evaluation.arms:
        keys[arm] = f"{arm}[{variant.name}]" if arm in _PER_VARIANT else arm
    return keys


def summarise(evaluation: Evaluation, variant: Variant, **meta) -> dict:
    """The JSON-able result of one variant (meta: source, target, data, chat, ...)."""
    bridge, items, config = variant.bridge, evaluation.items, variant.config
    keys = _conditions(evaluation, variant)
    out = {
        "task": evaluation.task,
        "n": len(items),
        "skipped": len(evaluation.skipped),
        "skipped_items": [{"index": i, "reason": reason} for i, reason in evaluation.skipped],
        "method": bridge.method,
        "native_head": bridge.native_head if config.native_head is None else config.native_head,
        "native_tail": config.native_tail,
        "key_norm": config.key_norm,
        "native_layers": config.native_layers,
        "refresh": None if config.refresh is None else config.refresh.amount,
        "refresh_by": None if config.refresh is None else config.refresh.selector.name,
        "min_quality": config.quality.min_quality,
        "variant": variant.name,
        "alignment_policy": bridge.alignment_policy,
        **meta,
        "context_tokens_mean": sum(r.context_tokens for r in items) / len(items),
    }
    if evaluation.task == "generate":
        out |= generation_metrics(
            {c: [r.replies[k] for r in items] for c, k in keys.items()}, _answers(items)
        )
        out["native_prefill_cpu_s"] = sum(r.cpu_s["native_prefill"] for r in items)
        out["source_prefill_cpu_s"] = sum(r.cpu_s["source_prefill"] for r in items)
        out["handoff_cpu_s"] = sum(r.cpu_s[f"handoff[{variant.name}]"] for r in items)
    elif evaluation.task == "ppl":
        tokens = [r.scores["native"][0][1] for r in items]
        nll = {c: [-r.scores[k][0][0] for r in items] for c, k in keys.items()}
        out["scored_tokens_mean"] = sum(tokens) / len(tokens)
        out |= ppl_metrics(nll, tokens)
        source_tokens = [r.scores["source_alone"][0][1] for r in items] if "source_alone" in keys else tokens

        def quality(arm: str, ix: list[int]) -> float:  # minus the token-weighted NLL
            counts = source_tokens if arm == "source_alone" else tokens
            return -mean_nll([nll[arm][i] for i in ix], [counts[i] for i in ix])

        if evaluation.arms:
            out |= arm_metrics(quality, list(keys), len(items))
    else:
        picks = {c: [pick_choice(*zip(*r.scores[k], strict=True)) for r in items] for c, k in keys.items()}
        answers = [r.answer for r in items]
        out |= choice_metrics(picks, answers, [len(r.scores["native"]) for r in items])
        right = {c: [int(p == a) for p, a in zip(ps, answers)] for c, ps in picks.items()}
        if evaluation.arms:
            share = lambda arm, ix: sum(right[arm][i] for i in ix) / len(ix)  # noqa: E731
            out |= arm_metrics(share, list(keys), len(items))
    out["native_prefill_s"] = sum(r.native_prefill_s for r in items)
    out["handoff_s"] = sum(r.handoff_s[variant.name] for r in items)
    out["source_prefill_s"] = sum(r.source_prefill_s for r in items)
    out["align_s"] = sum(r.align_s[variant.name] for r in items)
    out["speedup"] = out["native_prefill_s"] / out["handoff_s"] if out["handoff_s"] > 0 else math.nan
    costs = [r.native_cost[variant.name] for r in items if variant.name in r.native_cost]
    out["native_cost_fraction"] = sum(costs) / len(costs) if costs else math.nan
    guides = [r.guide_cost[variant.name] for r in items if variant.name in r.guide_cost]
    out["guide_cost_fraction"] = sum(guides) / len(guides) if guides else 0.0
    out["fallbacks"] = sum(1 for r in items if r.fallback.get(variant.name))
    out["arms"] = list(evaluation.arms)
    if evaluation.arms:
        out["map_uses_input"] = map_uses_input(out)
    shares = [r.chosen_share[variant.name] for r in items if variant.name in r.chosen_share]
    if shares:
        out["chosen_share"] = sum(shares) / len(shares)  # chosen_only: context columns read
    out["note"] = HANDOFF_NOTE
    out["items"] = [_item_record(r, keys, evaluation.task, variant) for r in items]
    return out


def _item_record(result, keys: dict[str, str], task: str, variant: Variant) -> dict:
    record = {
        "index": result.index,
        "other_index": result.other_index,
        "context_tokens": result.context_tokens,
        "source_tokens": result.source_tokens,
        "native_prefill_s": result.native_prefill_s,
        "handoff_s": result.handoff_s[variant.name],
        "source_prefill_s": result.source_prefill_s,
        "native_cost_fraction": result.native_cost.get(variant.name),
        "guide_cost_fraction": result.guide_cost.get(variant.name),
        "fallback": result.fallback.get(variant.name),
    }
    if task == "generate":
        record["answers"] = list(result.answer)
        record |= {f"reply_{c}": result.replies[k] for c, k in keys.items()}
        record |= {f"correct_{c}": correct(result.replies[k], result.answer) for c, k in keys.items()}
        record["cpu_s"] = {
            "native_prefill": result.cpu_s["native_prefill"],
            "source_prefill": result.cpu_s["source_prefill"],
            "handoff": result.cpu_s[f"handoff[{variant.name}]"],
        }
        record["refreshed"] = result.refreshed.get(variant.name, [])
    elif task == "ppl":
        record["tokens"] = result.scores["native"][0][1]
        record |= {f"nll_{c}": -result.scores[k][0][0] for c, k in keys.items()}
    else:
        record["answer"] = result.answer
        record |= {f"pick_{c}": pick_choice(*zip(*result.scores[k], strict=True)) for c, k in keys.items()}
        record["refreshed"] = result.refreshed.get(variant.name, [])
    return record


def _answers(items) -> list[tuple[str, ...]]:
    return [tuple(r.answer) for r in items]


def _pct(x: float) -> str:
    return "  n/a" if x is None or math.isnan(x) else f"{100 * x:5.1f}%"


def _ci(interval) -> str:
    lo, hi = interval
    return "" if math.isnan(lo) else f"  [95% CI {100 * lo:.1f}, {100 * hi:.1f}]"


def _arm_lines(s: dict) -> list[str]:
    """The gap recovered and the paired differences between arms, where computed."""
    lines = []
    if "gap_recovered" in s:
        lines.append(
            f"  gap recovered (b-s)/(a-s)           {_pct(s['gap_recovered'])}{_ci(s['gap_recovered_ci'])}"
            + ("" if not math.isnan(s["gap_recovered"]) else "  (the target is not stronger here)")
        )
    unit = "minus NLL per token" if s["task"] == "ppl" else "accuracy points"
    for a, b in COMPARISONS:
        if f"diff_{a}_{b}" not in s:
            continue
        value, (lo, hi) = s[f"diff_{a}_{b}"], s[f"diff_{a}_{b}_ci"]
        scale, form = (1, "+.4f") if s["task"] == "ppl" else (100, "+.1f")
        interval = "" if math.isnan(lo) else f"  [95% CI {scale * lo:{form}}, {scale * hi:{form}}]"
        lines.append(f"  {a} - {b}: {scale * value:{form}}{interval}  ({unit})")
    if s.get("chosen_share") is not None:
        lines.append(f"  chosen tokens alone read {_pct(s['chosen_share']).strip()} of the context's columns")
    if s.get("map_uses_input") is not None:
        verdict = "yes" if s["map_uses_input"] else "NO (an interval reaches zero)"
        lines.append(f"  translation beats wrong document and random map: {verdict}")
    return [""] + lines if lines else []


def format_table(s: dict) -> str:
    """A readable report of one summary."""
    lines = [
        f"bridgecache eval: {s.get('source', '?')} -> {s.get('target', '?')}  ({s['method']} bridge, "
        f"native_head={s['native_head']}, native_tail={s['native_tail']}, alignment={s['alignment_policy']})",
        f"native compute: layers={s.get('native_layers')}, "
        f"refresh={s.get('refresh')} by {s.get('refresh_by')}, "
        f"min_quality={s.get('min_quality')}; native FLOPs {_pct(s.get('native_cost_fraction', math.nan))} "
        f"of the target's prefill (+{_pct(s.get('guide_cost_fraction') or 0.0)} choosing refreshed tokens); "
        f"{s.get('fallbacks', 0)} fallbacks",
        f"task {s['task']} on {s.get('data', '?')}: {s['n']} items, {s['skipped']} skipped"
        f"{' (longer than a window)' if s['skipped'] else ''}; "
        f"context {s['context_tokens_mean']:.0f} target tokens on average",
        "",
    ]
    if s["task"] == "ppl":
        lines.append(f"  {'condition':<34}{'NLL/token':>10}{'PPL':>10}")
        for key, label in _PPL_ROWS + _ARM_ROWS:
            if f"nll_{key}" in s:
                lines.append(f"  {label:<34}{s[f'nll_{key}']:>10.4f}{s[f'ppl_{key}']:>10.2f}")
        lines += [
            "",
            f"  context-gain recovered (c-b)/(c-a)  {_pct(s['context_gain_recovered'])}"
            f"{_ci(s['context_gain_recovered_ci'])}",
            f"  content-gain recovered (d-b)/(d-a)  {_pct(s['content_gain_recovered'])}"
            f"{_ci(s['content_gain_recovered_ci'])}",
            f"  (NLL per continuation token, {s['scored_tokens_mean']:.0f} tokens per item on average)",
        ]
    elif s["task"] == "generate":
        lines.append(
            f"  {'condition':<34}{'exact match':>12}  {'95% CI (Wilson)':<18}{'several: partial':>16}"
        )
        for key, label in _GENERATE_ROWS:
            if f"acc_{key}" not in s:
                continue
            share = s[f"partial_{key}"]
            partial = f"{_pct(share)} of {s[f'partial_{key}_n']}" if s[f"partial_{key}_n"] else "-"
            interval = _ci(s[f"acc_{key}_ci"]).strip()
            lines.append(f"  {label:<34}{_pct(s[f'acc_{key}']):>12}  {interval:<18}{partial:>16}")
        lines += ["", f"  retention (b)/(a)                   {_pct(s['retention'])}{_ci(s['retention_ci'])}"]
    else:
        lines.append(f"  {'condition':<34}{'accuracy':>10}")
        for key, label in _CHOICE_ROWS + _ARM_ROWS:
            if f"acc_{key}" in s:
                lines.append(f"  {label:<34}{_pct(s[f'acc_{key}']):>10}")
        lines += [
            "",
            f"  retention (b)/(a)                   {_pct(s['retention'])}{_ci(s['retention_ci'])}",
            f"  retention above chance ({_pct(s['chance']).strip()})   {_pct(s['retention_above_chance'])}",
        ]
    lines += _arm_lines(s)
    n = s["n"]
    lines += [
        "",
        f"  time, summed over {n} items",
        f"    target native prefill of the context               {s['native_prefill_s']:9.3f} s",
        f"    handoff (translate + native work + held-back)      {s['handoff_s']:9.3f} s"
        f"   ({s['speedup']:.1f}x faster)",
        f"    source prefill of the context                      {s['source_prefill_s']:9.3f} s",
        f"    tokenization, alignment and words                  {s['align_s']:9.3f} s",
    ]
    if s["task"] == "generate":
        lines += [
            f"    CPU (process) seconds: native prefill {s['native_prefill_cpu_s']:.3f}, handoff "
            f"{s['handoff_cpu_s']:.3f}, source prefill {s['source_prefill_cpu_s']:.3f}",
        ]
    lines += [
        "",
        HANDOFF_NOTE,
    ]
    return "\n".join(lines)
