"""Where evaluation items come from: a JSONL file or a built-in task (`builtin:NAME`).

    data_task(spec, task)                          the task a data spec holds ("ppl", "choice", "generate")
    load_items(spec, task, tokenizer, limit)       (task, items)

Built-in tasks (`bridgecache.evaluation.builtin`) are sized in the given tokenizer's tokens.
This module knows nothing about models or metrics.
"""

from __future__ import annotations

from bridgecache.evaluation.builtin import builtin_items, builtin_task
from bridgecache.evaluation.items import TASKS, DataFormatError, read_jsonl

__all__ = ["data_task", "load_items"]


def data_task(spec: str, task: str | None) -> str:
    """The task of a data spec: implied by a built-in name (and checked against `task`), else `task`."""
    if spec.startswith("builtin:"):
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
        if tokenizer is None:
            raise ValueError("built-in tasks are sized in the target's tokens: pass its tokenizer")
        return task, builtin_items(spec.removeprefix("builtin:"), tokenizer, limit)
    items = read_jsonl(spec, task)
    return task, items[:limit] if limit else items
