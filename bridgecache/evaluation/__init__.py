"""Evaluation of bridges: the field's protocols plus the controls that keep the numbers honest.

    bridgecache eval --bridge DIR --data FILE.jsonl|builtin:NAME [--task ppl|choice|generate] ...

Modules, one job each:
    items     evaluation items and their JSONL formats (DataFormatError names line and field)
    facts     invented facts (people, towns, numbers, ships) for in-context retrieval questions
    needles   RULER's needle-in-a-haystack items (single, several keys, several values)
    builtin   the offline built-in tasks, from bridgecache.text's evaluation split
    data      where items come from: a JSONL file or a built-in task
    prompts   an item's parts as token ids for each model: plain text or each model's chat template
    scoring   native / bridged prefixes (timed) and log-likelihoods after them
    decoding  greedy replies after a prefix (the generation task)
    runner    every condition for every item, shared work done once -> Evaluation
    metrics   gain-recovered, accuracy, retention, bootstrap intervals (pure arithmetic)
    answers   exact match of generated answers, partial credit, Wilson intervals (pure arithmetic)
    report    the JSON summary and the table on stdout
    cli       the `bridgecache eval` subcommand
"""

from bridgecache.evaluation.data import load_items
from bridgecache.evaluation.items import ChoiceItem, DataFormatError, EvaluationError, GenerationItem, PplItem
from bridgecache.evaluation.report import format_table, summarise
from bridgecache.evaluation.runner import Evaluation, Variant, evaluate

__all__ = [
    "ChoiceItem",
    "DataFormatError",
    "Evaluation",
    "EvaluationError",
    "GenerationItem",
    "PplItem",
    "Variant",
    "evaluate",
    "format_table",
    "load_items",
    "summarise",
]
