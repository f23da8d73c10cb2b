"""Synthetic facts for in-context retrieval questions: fictional people, towns, numbers, ships.

Every fact is one sentence with one question and one answer; the names and places are invented
(no model knows them), so a question is answerable only from the context that states the fact.
`fact_set(rng, asked_kind)` makes the facts of one context: three of the asked kind about
different subjects (so the other two values are in-context distractors: the model must bind
the value to the right subject, not just recognise a value it has seen) plus others of mixed
kinds. `choices_for` adds out-of-context distractors of the same kind.

This module knows nothing about tokenizers, models or the text the facts are embedded in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Fact", "KINDS", "fact_set", "choices_for"]

_FIRST = (
    "Marta", "Ilya", "Soren", "Adaeze", "Tomasz", "Keiko", "Rafael", "Ingrid", "Dmitri", "Lucia",
    "Emeka", "Freya", "Anselm", "Noor", "Bastian", "Ottilie", "Casimir", "Yara", "Leopold", "Mirela",
    "Tobiah", "Saskia", "Ewan", "Petra", "Jovan", "Henrike", "Amadou", "Liesel", "Corwin", "Ysolde",
)  # fmt: skip
_LAST = (
    "Ilves", "Brandt", "Okafor", "Varga", "Lindqvist", "Moreau", "Tanaka", "Ferreira", "Kowal",
    "Halloran", "Strand", "Quist", "Abernethy", "Castellan", "Drummond", "Eberle", "Fenwick",
    "Gallo", "Hartigan", "Jessup", "Kettering", "Lowther", "Marchetti", "Nyberg", "Orsini",
)  # fmt: skip
_TOWNS = (
    "Velmora", "Ashcombe", "Dunmere", "Karsk", "Thornwick", "Briarholt", "Calvenna", "Eastmoor",
    "Fallowby", "Grennick", "Harrowgate", "Iskaven", "Jorvale", "Kelmarsh", "Lunderby", "Marrowick",
    "Nethercot", "Ostravel", "Pellington", "Quenby", "Rothmere", "Silverlea", "Tavistow", "Umberley",
)  # fmt: skip
_JOBS = (
    "baker", "glassblower", "cartographer", "beekeeper", "locksmith", "ferry pilot", "bookbinder",
    "clockmaker", "surveyor", "lighthouse keeper", "potter", "saddler", "brewer", "stonemason",
    "violin maker", "radio operator", "tailor", "gardener", "archivist", "chemist",
)  # fmt: skip
_SHIPS = (
    "Marigold", "Heron", "Alder", "Calypso", "Wren", "Juniper", "Sable", "Kestrel", "Halcyon",
    "Tamarind", "Osprey", "Bellwether", "Corriedale", "Nightjar", "Perpetua", "Quillon",
)  # fmt: skip
_CARGO = (
    "copper", "salt", "timber", "wool", "coffee", "tin", "barley", "marble", "cotton", "olive oil",
    "glass", "coal", "rice", "saffron", "paper", "cement", "tea", "iron ore",
)  # fmt: skip


@dataclass(frozen=True)
class Fact:
    """One stated fact: the sentence for the context, the question about it, its answer."""

    kind: str
    subject: str
    sentence: str
    question: str
    answer: str


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _value(kind: str, rng: random.Random) -> str:
    """A random answer of `kind` (the pool distractors are drawn from)."""
    if kind == "town":
        return rng.choice(_TOWNS)
    if kind == "year":
        return str(rng.randrange(1890, 2000))
    if kind == "code":
        return str(rng.randrange(1000, 10000))
    if kind == "job":
        return rng.choice(_JOBS)
    if kind == "cargo":
        return rng.choice(_CARGO)
    if kind == "goats":
        return str(rng.randrange(12, 98))
    raise ValueError(kind)


# kind -> (subject maker, sentence template, question template); {s} subject, {v} value.
_TEMPLATES = {
    "town": (_person, "{s} lives in the town of {v}.", "In which town does {s} live?"),
    "year": (_person, "{s} was born in the year {v}.", "In which year was {s} born?"),
    "code": (_person, "The locker code of {s} is {v}.", "What is the locker code of {s}?"),
    "job": (_person, "{s} works as a {v}.", "What does {s} work as?"),
    "cargo": (lambda rng: rng.choice(_SHIPS), "The ship {s} carries {v}.", "What does the ship {s} carry?"),
    "goats": (_person, "{s} keeps {v} goats.", "How many goats does {s} keep?"),
}
KINDS = tuple(_TEMPLATES)


def _fact(kind: str, subject: str, value: str) -> Fact:
    _, sentence, question = _TEMPLATES[kind]
    return Fact(kind, subject, sentence.format(s=subject, v=value), question.format(s=subject), value)


def fact_set(
    rng: random.Random, asked_kind: str, same_kind: int = 3, others: int = 5
) -> tuple[list[Fact], Fact]:
    """(facts in context order, the fact to ask about). Subjects are distinct, as are the values of
    the asked kind, so every question has exactly one right answer in the context."""
    subjects: set[str] = set()
    asked_values: set[str] = set()
    kinds = [asked_kind] * same_kind + [
        rng.choice([k for k in KINDS if k != asked_kind]) for _ in range(others)
    ]
    facts = []
    for kind in kinds:
        make_subject = _TEMPLATES[kind][0]
        subject = make_subject(rng)
        while subject in subjects:
            subject = make_subject(rng)
        value = _value(kind, rng)
        while kind == asked_kind and value in asked_values:
            value = _value(kind, rng)
        subjects.add(subject)
        if kind == asked_kind:
            asked_values.add(value)
        facts.append(_fact(kind, subject, value))
    asked = facts[rng.randrange(same_kind)]
    rng.shuffle(facts)
    return facts, asked


def choices_for(
    rng: random.Random, asked: Fact, facts: list[Fact], n_choices: int = 5
) -> tuple[tuple[str, ...], int]:
    """(choices, answer index): the answer, the other in-context values of its kind, then random
    values of the kind until there are `n_choices` distinct ones; shuffled."""
    options = [asked.answer]
    for fact in facts:
        if fact.kind == asked.kind and fact.answer not in options and len(options) < n_choices:
            options.append(fact.answer)
    while len(options) < n_choices:
        value = _value(asked.kind, rng)
        if value not in options:
            options.append(value)
    rng.shuffle(options)
    return tuple(options), options.index(asked.answer)
