"""The documents of the bridgecache_facts_* tasks: facts.jsonl beside this file, read offline
(lm_eval's `custom_dataset` hook; a `dataset_path` would be resolved from the working directory).

facts.jsonl holds the first 5 items of `builtin:facts-choice-64` sized in qwen2.5-coder-0.5b's
tokens (bridgecache.evaluation.builtin: invented facts in Python's own documentation), each cut
to 3 choices (the right one and the first two others)."""

import json
from pathlib import Path

import datasets


def load(**_metadata):
    """{"test": the documents}: one per line of facts.jsonl."""
    lines = (Path(__file__).with_name("facts.jsonl")).read_text(encoding="utf-8").splitlines()
    return {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}
