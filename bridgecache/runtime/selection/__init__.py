"""Selection: which context columns a refresh recomputes.

    rules       Selector and the rules (SourceAttention, KeyDeviation, GivenScores), the read-only
                SelectionRequest a rule gets, checked_scores
    reading     a model reading a prompt over its cached context (SourceReader, attention_scores)
    words       whole words: a chosen token brings its word (and the token that ends it)

The rules' names are importable from here too (`from bridgecache.runtime.selection import Selector`).
"""

from bridgecache.runtime.selection.rules import (
    GivenScores,
    KeyDeviation,
    SelectionRequest,
    Selector,
    SourceAttention,
    checked_scores,
    selector_named,
)

__all__ = [
    "GivenScores",
    "KeyDeviation",
    "SelectionRequest",
    "Selector",
    "SourceAttention",
    "checked_scores",
    "selector_named",
]
