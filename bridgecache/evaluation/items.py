"""Evaluation items and the JSONL files that hold them.

Formats, one JSON object a line (blank lines are ignored; other keys are ignored):
    ppl:     {"context": str, "continuation": str}
    choice:  {"context": str, "question": str, "choices": [str, ...], "answer": int}
    generate: {"context": str, "question": str, "answers": [str, ...], "max_new_tokens": int}
`answer` indexes `choices` (0-based). `answers` are what a generated reply must hold
(bridgecache.evaluation.answers scores replies); `max_new_tokens` (optional, default 32) caps the
reply, and an optional "kind" labels the item. Every string must be non-empty, choices at least
two and distinct. A file that breaks any of this raises `DataFormatError` naming the line and the field.

`bridgecache.evaluation.data.load_items` reads either a file or a built-in task.

This module knows nothing about models, metrics or the built-in tasks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TASKS",
    "PplItem",
    "ChoiceItem",
    "GenerationItem",
    "EvaluationError",
    "DataFormatError",
    "read_jsonl",
]

TASKS = ("ppl", "choice", "generate")


class EvaluationError(ValueError):
    """An evaluation cannot run as asked (the data, or how it meets the models); says why."""


class DataFormatError(EvaluationError):
    """An evaluation data file (or built-in task name) is not what the task expects."""


@dataclass(frozen=True)
class PplItem:
    """A context and the continuation whose likelihood the target is scored on."""

    context: str
    continuation: str


@dataclass(frozen=True)
class ChoiceItem:
    """A context, a question about it and the choices; `answer` indexes `choices`."""

    context: str
    question: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class GenerationItem:
    """A context, a question about it and the answers a greedy reply must hold.

    answers: one string (exact match of the reply's first answer-shaped span) or several (each
    must appear; partial credit is the share that does). max_new_tokens: the reply's length cap.
    kind: a label for per-kind tables (e.g. a RULER subtask); not read by the scoring.
    """

    context: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int = 32
    kind: str = ""


def read_jsonl(path: str | Path, task: str) -> list[PplItem] | list[ChoiceItem] | list[GenerationItem]:
    """Items of `task` from a JSONL file; DataFormatError names the line and field at fault."""
    if task not in TASKS:
        raise DataFormatError(f"unknown task {task!r}; expected one of {TASKS}")
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"no data file at {path}")
    items = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{where}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict):
                raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
            items.append({"ppl": _ppl, "choice": _choice, "generate": _generation}[task](record, where))
    if not items:
        raise DataFormatError(f"{path}: no items (one JSON object a line expected)")
    return items


def _text(record: dict, key: str, where: str) -> str:
    if key not in record:
        raise DataFormatError(f"{where}: field {key!r} is missing (have {sorted(record)})")
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(f"{where}: field {key!r} must be a non-empty string, got {value!r:.60}")
    return value


def _ppl(record: dict, where: str) -> PplItem:
    return PplItem(_text(record, "context", where), _text(record, "continuation", where))


def _choice(record: dict, where: str) -> ChoiceItem:
    context, question = _text(record, "context", where), _text(record, "question", where)
    choices = record.get("choices")
    if not isinstance(choices, list) or len(choices) < 2:
        raise DataFormatError(f"{where}: field 'choices' must be a list of at least 2 strings")
    for k, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice.strip():
            raise DataFormatError(f"{where}: choices[{k}] must be a non-empty string, got {choice!r:.60}")
    if len(set(choices)) != len(choices):
        raise DataFormatError(f"{where}: field 'choices' holds the same string twice")
    answer = record.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise DataFormatError(f"{where}: field 'answer' must be an integer index into 'choices'")
    if not 0 <= answer < len(choices):
        raise DataFormatError(f"{where}: field 'answer' is {answer}; 'choices' has {len(choices)} entries")
    return ChoiceItem(context, question, tuple(choices), answer)


def _generation(record: dict, where: str) -> GenerationItem:
    context, question = _text(record, "context", where), _text(record, "question", where)
    answers = record.get("answers")
    if not isinstance(answers, list) or not answers:
        raise DataFormatError(f"{where}: field 'answers' must be a non-empty list of strings")
    for k, answer in enumerate(answers):
        if not isinstance(answer, str) or not answer.strip():
            raise DataFormatError(f"{where}: answers[{k}] must be a non-empty string, got {answer!r:.60}")
    tokens = record.get("max_new_tokens", 32)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise DataFormatError(f"{where}: field 'max_new_tokens' must be a positive integer, got {tokens!r}")
    kind = record.get("kind", "")
    return GenerationItem(context, question, tuple(a.strip() for a in answers), tokens, str(kind))
