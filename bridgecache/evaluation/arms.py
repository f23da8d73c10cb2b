"""The arms of an evaluation beyond the handoff itself: what each one feeds the target, and why.

Every arm scores the same target tokens (continuation or choices) of the same items:
    native          the target prefills the context itself
    source_alone    the SOURCE reads the context and answers by itself (its own tokens; choice
                    task, or ppl when both models share a tokenizer): what the target adds
    translation     the bridge's translation only: no refresh (native head and the held-back last
                    token are still the target's own, as in every bridged arm)
    bridged         the default handoff (the variant's config: translation + refreshed tokens)
    chosen_only     the target reads ONLY the tokens the default handoff computes itself (native
                    head, refreshed tokens, held-back last token), at their own positions, with no
                    translated cache: the speculative-prefill baseline
    wrong_document  translation only, the map fed ANOTHER item's source KV (the target's tokens,
                    alignment and positions unchanged): a map that uses its input must lose here
    random_map      translation only through a random map of the bridge's shape (each weight
                    tensor redrawn with its own mean and spread, biases kept): the learned
                    weights must matter
    no_context      the target reads only the bare prompt
    other_native    the target prefills an unrelated context (another item's, cut to this length)
`DEFAULT_ARMS` are what every evaluation computes; `EXTRA_ARMS` are asked for (`evaluate(arms=)`,
`bridgecache eval --arms`). Each extra arm costs a pass per item: choose them when they are the
question.

This module builds the arms' inputs (a random map, another document's source ids, the chosen
columns) and scores them for one item (`score_arms`, `source_alone`, called by the runner); it
knows nothing about metrics or reports.
"""

from __future__ import annotations

import dataclasses

import torch

from bridgecache.evaluation.scoring import chosen_prefix, native_prefix, score

__all__ = [
    "DEFAULT_ARMS",
    "EXTRA_ARMS",
    "ALL_ARMS",
    "check_arms",
    "random_map",
    "wrong_source_ids",
    "chosen_columns",
    "score_arms",
    "source_alone",
]

DEFAULT_ARMS = ("native", "bridged", "no_context", "other_native")
EXTRA_ARMS = ("source_alone", "translation", "chosen_only", "wrong_document", "random_map")
ALL_ARMS = DEFAULT_ARMS + EXTRA_ARMS
PER_VARIANT = ("translation", "chosen_only", "wrong_document", "random_map")  # keyed "arm[variant]"


def check_arms(arms, task: str, same_tokenizer: bool, chat: bool) -> tuple[str, ...]:
    """The extra arms asked for, checked before any model runs (ValueError names the arm).

    arms: None (none), "all" (every extra arm the task allows) or names from EXTRA_ARMS."""
    if arms is None:
        return ()
    if arms == "all":
        wanted = [a for a in EXTRA_ARMS if _why_not(a, task, same_tokenizer, chat) is None]
        return tuple(wanted)
    if isinstance(arms, str) or not all(isinstance(a, str) for a in arms):
        raise ValueError(f"arms={arms!r}; expected None, 'all' or a list of names from {EXTRA_ARMS}")
    wanted = []
    for arm in arms:
        if arm in DEFAULT_ARMS:
            continue  # always computed
        if arm not in EXTRA_ARMS:
            raise ValueError(f"arms: unknown arm {arm!r}; expected names from {ALL_ARMS}")
        problem = _why_not(arm, task, same_tokenizer, chat)
        if problem:
            raise ValueError(f"arms: {arm!r} {problem}")
        if arm not in wanted:
            wanted.append(arm)
    return tuple(wanted)


def _why_not(arm: str, task: str, same_tokenizer: bool, chat: bool) -> str | None:
    if task == "generate":
        return "is not available for generation tasks (score a choice or ppl task)"
    if arm == "source_alone" and task == "ppl" and not same_tokenizer:
        return "of a ppl task needs one tokenizer on both sides (NLL per token is per tokenizer)"
    if arm == "source_alone" and chat:
        return "reads plain text only (evaluate without --chat)"
    return None


def random_map(bridge, seed: int = 0):
    """A bridge of `bridge`'s shape whose weights are random: each key/value weight tensor redrawn
    from a normal with that tensor's own mean and standard deviation (seeded), biases, inputs and
    source layers kept. An identity bridge becomes a "fullhead" one (the identity skips the refresh
    and the native-work rules). The bridge given is not changed."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for layer in bridge.layers:
        drawn = {}
        for name in ("key_weight", "value_weight"):
            w = getattr(layer, name)
            spread = float(w.float().std()) if w.numel() > 1 else 1.0
            noise = torch.randn(w.shape, generator=generator, dtype=torch.float32)
            drawn[name] = (noise * spread + float(w.float().mean())).to(w.dtype)
        layers.append(dataclasses.replace(layer, **drawn))
    method = "fullhead" if bridge.method == "identity" else bridge.method
    calibration = {"description": f"random map of the shape of a {bridge.method} bridge (seed {seed})"}
    return dataclasses.replace(bridge, method=method, layers=layers, calibration=calibration)


def wrong_source_ids(length: int, other: torch.Tensor) -> torch.Tensor:
    """[1, length] source ids of ANOTHER document for a context of `length` source tokens: `other`
    [1, S'] cut to `length`, or repeated until it is that long (the map reads every row it would
    read for the right document)."""
    if length < 1 or other.shape[1] < 1:
        raise ValueError(f"wrong_source_ids: lengths {length} and {other.shape[1]}; expected >= 1")
    times = -(-length // other.shape[1])
    return other.repeat(1, times)[:, :length]


def chosen_columns(cache, length: int) -> torch.Tensor:
    """[n] int64 ascending: the context columns a bridged `cache` of `length` columns has the target
    compute itself (row 0): outside its translated positions (native head, native tail, held-back
    last token), and its refreshed columns."""
    translated = cache.translated_positions
    own = [c for c in range(length) if c not in translated]
    refreshed = cache.refreshed_columns[0].tolist() if cache.refreshed_columns.numel() else []
    return torch.tensor(sorted(set(own) | set(refreshed)), dtype=torch.long)


def source_alone(source, prompts, item, own) -> list[tuple[float, int]]:
    """The source reads the context (`own.context.source_ids`) and the prompt and scores each
    string, all in its own tokens (the runner's prepared item `own`)."""
    prompt, scored = prompts.source_prompt_and_scored(item)
    prefix = native_prefix(source, own.context.source_ids)
    return score(source, prefix, [prompt + s for s in scored], len(prompt))


def score_arms(run, variant, context, item, own, other_item, columns, result) -> None:
    """Score one item's per-variant extra arms (those in `run.arms`) into `result.scores`, each on
    the same rows as the variant's `bridged` condition. run: the runner's item run (its
    `bridged(...)`, prompts, target and `random_bridges`); columns: the default handoff's own
    columns (chosen_columns) when "chosen_only" is wanted, else None."""
    name, rows, start, target = variant.name, own.rows(), len(own.prompt), run.target
    # Translation only, forced through the map (the cost gate never routes a control native).
    translation = variant.config.replace(refresh=None, route="handoff")
    if "translation" in run.arms:
        prefix = run.bridged(variant, context, item, config=translation)
        result.scores[f"translation[{name}]"] = score(target, prefix, rows, start)
    if "wrong_document" in run.arms:
        other = run.prompts.context(other_item.context, variant.bridge).source_ids
        wrong = wrong_source_ids(context.source_ids.shape[1], other)
        prefix = run.bridged(variant, context, item, source_ids=wrong, config=translation)
        result.scores[f"wrong_document[{name}]"] = score(target, prefix, rows, start)
    if "random_map" in run.arms:
        known = run.random_bridges.get(id(variant.bridge))
        if known is None or known[0] is not variant.bridge:
            known = run.random_bridges[id(variant.bridge)] = (variant.bridge, random_map(variant.bridge))
        prefix = run.bridged(variant, context, item, bridge=known[1], config=translation)
        result.scores[f"random_map[{name}]"] = score(target, prefix, rows, start)
    if columns is not None:
        prefix = chosen_prefix(target, own.context.target_ids, columns)
        result.chosen_share[name] = columns.numel() / own.context.target_ids.shape[1]
        result.scores[f"chosen_only[{name}]"] = score(target, prefix, rows, start)
