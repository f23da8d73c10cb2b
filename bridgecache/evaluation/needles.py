"""Needle-in-a-haystack items in RULER's form (Hsieh et al., arXiv 2404.06654), for any haystack.

A needle is one sentence, "One of the special magic numbers for KEY is: VALUE.", with KEY an
invented adjective-noun pair and VALUE a random 7-digit number, put on its own line into real
prose. Subtasks (RULER's niah_single, niah_multikey_1 and niah_multivalue):
    single      one needle; asked for its number
    multikey    four needles of four keys; asked for one (the other three are distractors)
    multivalue  four needles of ONE key; asked for all four numbers
The asked needle's depth (share of the haystack before it) follows the golden-ratio sequence over
item indices, so the first n items of any subtask spread evenly over 0..100%; the other needles
sit at random depths. Item i of a subtask depends only on (subtask, i, seed), never on how many
items are made. `needle_item` checks that every value occurs exactly once in the context, and
each key as often as it has needles.

The context opens with RULER's instruction; the question is asked after it (plain:
"Question: ... Answer:"), and the reply is scored by exact match of whole numbers
(bridgecache.evaluation.answers).

This module knows nothing about models or where haystack text comes from; tokenizers only count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bridgecache.evaluation.items import DataFormatError, GenerationItem

__all__ = ["SUBTASKS", "PREAMBLE", "NeedlePlan", "needle_plan", "needle_item", "overhead_tokens"]

SUBTASKS = ("single", "multikey", "multivalue")
PREAMBLE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
QUESTION_ALL = "What are all the special magic numbers for {key} mentioned in the provided text?"
NEEDLES = 4  # RULER's num_needle_k (multikey) and num_needle_v (multivalue)
MAX_NEW_TOKENS = {"single": 24, "multikey": 24, "multivalue": 64}
_GOLDEN = (5**0.5 - 1) / 2

_ADJECTIVES = (
    "amber", "brisk", "candid", "dusty", "eager", "fickle", "gentle", "hollow", "icy", "jolly",
    "keen", "lofty", "mellow", "nimble", "odd", "placid", "quaint", "rustic", "shy", "tidy",
    "unruly", "vivid", "wary", "zesty", "bashful", "crimson", "dapper", "frosty", "gaudy", "hushed",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "candle", "dune", "easel", "falcon", "garnet", "harbor", "igloo", "jackal",
    "kettle", "lantern", "meadow", "nutmeg", "orchard", "pebble", "quiver", "raven", "saddle",
    "thimble", "urchin", "violet", "walrus", "yonder", "zephyr", "bramble", "cobalt", "dingo",
    "ferret", "glacier",
)  # fmt: skip


@dataclass(frozen=True)
class NeedlePlan:
    """What one item holds before it meets a haystack.

    needles: (key, value, depth in [0, 1]) each; the asked key's first needle is needles[0].
    answers: the numbers the reply must hold (one, or all of the asked key's).
    """

    subtask: str
    key: str
    needles: tuple[tuple[str, str, float], ...]
    answers: tuple[str, ...]
    question: str

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.subtask]


def needle_plan(subtask: str, index: int, seed: int = 0) -> NeedlePlan:
    """The needles, question and answers of item `index` of `subtask` (see the module docstring)."""
    if subtask not in SUBTASKS:
        raise DataFormatError(f"unknown needle subtask {subtask!r}; expected one of {SUBTASKS}")
    rng = random.Random(f"needle/{subtask}/{seed}/{index}")
    count = 1 if subtask == "single" else NEEDLES
    keys: list[str] = []
    while len(keys) < (count if subtask == "multikey" else 1):
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in keys:
            keys.append(key)
    values: list[str] = []
    while len(values) < count:  # distinct, and none a part of another
        value = str(rng.randrange(1_000_000, 10_000_000))
        if all(value not in v and v not in value for v in values):
            values.append(value)
    depths = [(index * _GOLDEN) % 1.0]
    while len(depths) < count:  # the others at random depths, apart from each other
        depth = rng.random()
        if all(abs(depth - d) > 0.05 for d in depths):
            depths.append(depth)
    owners = keys if subtask == "multikey" else keys * count
    needles = tuple(zip(owners, values, depths, strict=True))
    asked = keys[0]
    answers = tuple(values) if subtask == "multivalue" else (values[0],)
    question = (QUESTION_ALL if subtask == "multivalue" else QUESTION).format(key=asked)
    return NeedlePlan(subtask, asked, needles, answers, question)


def _lines(plan: NeedlePlan) -> list[str]:
    return [NEEDLE.format(key=key, value=value) for key, value, _ in plan.needles]


def overhead_tokens(plan: NeedlePlan, tokenizer) -> int:
    """Target tokens the instruction and the needle lines add to a haystack (about)."""
    text = "\n".join([PREAMBLE, *_lines(plan)])
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + len(plan.needles) + 1


def needle_item(plan: NeedlePlan, haystack: str) -> GenerationItem:
    """The item: `haystack` with each needle on its own line at its depth (the line break at or
    after that share of the haystack's characters), after RULER's instruction."""
    haystack = haystack.strip("\n")
    cuts = []
    for (_, _, depth), line in zip(plan.needles, _lines(plan)):
        at = round(depth * len(haystack))
        while 0 < at < len(haystack) and haystack[at - 1] != "\n":
            at += 1
        cuts.append((min(at, len(haystack)), line))
    pieces, done = [], 0
    for at, line in sorted(cuts, key=lambda c: c[0]):  # stable: needles at one cut keep their order
        piece = haystack[done:at]
        pieces.append(piece[:-1] if piece.endswith("\n") else piece)  # the join puts it back
        pieces.append(line)
        done = at
    pieces.append(haystack[done:])
    body = "\n".join(p for p in pieces if p)
    context = f"{PREAMBLE}\n\n{body}"
    for key, value, _ in plan.needles:
        keys_wanted = sum(k == key for k, _, _ in plan.needles)
        if context.count(value) != 1 or context.count(key) != keys_wanted:
            raise DataFormatError(
                f"needle {key}={value}: the haystack already holds its key or value; pick another seed"
            )
    return GenerationItem(context, plan.question, plan.answers, plan.max_new_tokens, plan.subtask)
