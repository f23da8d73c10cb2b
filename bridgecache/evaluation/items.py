"""Evaluation items and the JSONL files that hold them.

Formats, one JSON object a line (blank lines are ignored; other keys are ignored):
    ppl:     {"context": str, "continuation": str}
    choice:  {"context": str, "question": str, "choices": [str, ...], "answer": int}
`answer` indexes `choices` (0-based). Every string must be non-empty, choices at least two and
distinct. A file that breaks any of this raises `DataFormatError` naming the line and the field.

`load_items(spec, task, tokenizer)` reads a file path or a built-in task `builtin:NAME`
(`bridgecache.evaluation.builtin`, sized in the given tokenizer's tokens).

This module knows nothing about models or metrics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TASKS",
    "PplItem",
    "ChoiceItem",
    "EvaluationError",
    "DataFormatError",
    "read_jsonl",
    "data_task",
    "load_items",
]

TASKS = ("ppl", "choice")


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


def read_jsonl(path: str | Path, task: str) -> list[PplItem] | list[ChoiceItem]:
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
            items.append(_ppl(record, where) if task == "ppl" else _choice(record, where))
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


def data_task(spec: str, task: str | None) -> str:
    """The task of a data spec: implied by a built-in name (and checked against `task`), else `task`."""
    if spec.startswith("builtin:"):
        from bridgecache.evaluation.builtin import builtin_task

        implied = builtin_task(spec.removeprefix("builtin:"))
        if task is not None and task != implied:
            raise DataFormatError(f"{spec} is a {implied!r} task, but --task {task} was given")
        return implied
    if task is None:
        raise DataFormatError(f"say which task {spec} holds: --task {' or --task '.join(TASKS)}")
    if task not in TASKS:
        raise DataFormatError(f"unknown task {task!r}; expected one of {TASKS}")
    return task


def load_items(spec: str, task: str | None, tokenizer=None, limit: int | None = None):
    """(task, items) from a JSONL path or `builtin:NAME`; built-ins are sized in `tokenizer`'s
    tokens (the target's), so they need it; `task` may be None for a built-in."""
    task = data_task(spec, task)
    if spec.startswith("builtin:"):
        from bridgecache.evaluation.builtin import builtin_items

        if tokenizer is None:
            raise ValueError("built-in tasks are sized in the target's tokens: pass its tokenizer")
        return task, builtin_items(spec.removeprefix("builtin:"), tokenizer, limit)
    items = read_jsonl(spec, task)
    return task, items[:limit] if limit else items
