"""Built-in evaluation tasks: generated offline from the EVALUATION split of `bridgecache.text`.

Names (`--data builtin:NAME`), N = context length in the target's tokens (default 512, 64..8192):
    prose-ppl[-N]     continue Python's language reference (pydoc topics) for 64 tokens
    code-ppl[-N]      continue standard-library source code for 64 tokens
    manual-ppl[-N]    continue Vim's help files for 64 tokens: prose unlike any calibration text
                      (bridgecache.text's "manual" domain, reserved for evaluation)
    facts-choice[-N]  5-choice questions on invented facts (people, towns, years, codes, ships)
                      stated in N tokens of reference prose that serves as distractor text
    needle[-N]        RULER's needle retrieval (generate: the reply is scored by exact match),
                      its three subtasks in turn; needle-single[-N], needle-multikey[-N] and
                      needle-multivalue[-N] hold one subtask each (bridgecache.evaluation.needles).
                      N counts the whole input as RULER does: context, question and the reply's
                      token budget (so the context is N less ~40-90 tokens); N up to 32768.
Documented lengths: 256, 512, 1024, 2048, 4096 (e.g. `builtin:facts-choice-2048`); needle: 4096,
8192 (`builtin:needle-4096`).

Each task is seeded and reproducible for a given tokenizer: the evaluation documents are
shuffled (seed 0), laid end to end, tokenized once with the target's tokenizer, and items are
windows spread evenly over that stream. Perplexity windows (context + continuation) never
overlap, so the unrelated-context control never holds the continuation it is scored on; prose
holds ~55K tokens,
so prose-ppl has about 95 items at N = 512 and fewer than 24 from N = 2048 on. Calibration reads only
the "calib" split (bridgecache.text splits by document), so no text here was fitted on.

This module knows nothing about models; it only calls the tokenizer (fast, with offsets).
"""

from __future__ import annotations

import random
import re

from bridgecache.evaluation.facts import KINDS, choices_for, fact_set
from bridgecache.evaluation.items import ChoiceItem, DataFormatError, GenerationItem, PplItem
from bridgecache.evaluation.needles import SUBTASKS, needle_item, needle_plan, overhead_tokens
from bridgecache.text import documents

__all__ = ["BUILTIN_FAMILIES", "DOCUMENTED_LENGTHS", "builtin_task", "builtin_items"]

BUILTIN_FAMILIES = {"prose-ppl": "ppl", "code-ppl": "ppl", "manual-ppl": "ppl", "facts-choice": "choice"}
BUILTIN_FAMILIES |= {"needle": "generate"} | {f"needle-{s}": "generate" for s in SUBTASKS}
DOCUMENTED_LENGTHS = (256, 512, 1024, 2048, 4096)
DEFAULT_LENGTH = 512
CONTINUATION_TOKENS = 64  # as in PAPERS.md's CPU experiment (~75); each scored token costs a forward
MAX_ITEMS = 96  # 45+ items per cell separate variants' 95% intervals on choice tasks
SEED = 0
NEEDLE_MAX_LENGTH = 32768
_NAME = re.compile(r"^(?P<family>[a-z]+(?:-[a-z]+)?)(?:-(?P<length>\d+))?$")


def _parse(name: str) -> tuple[str, int]:
    match = _NAME.match(name)
    if not match or match["family"] not in BUILTIN_FAMILIES:
        known = ", ".join(f"{f}[-N]" for f in BUILTIN_FAMILIES)
        raise DataFormatError(f"unknown built-in task {name!r}; expected one of {known} (N = context tokens)")
    length = int(match["length"] or DEFAULT_LENGTH)
    longest = NEEDLE_MAX_LENGTH if match["family"].startswith("needle") else 8192
    if not 64 <= length <= longest:
        raise DataFormatError(f"built-in context length {length} is outside 64..{longest} tokens")
    return match["family"], length


def builtin_task(name: str) -> str:
    """'ppl', 'choice' or 'generate': the task a built-in name implies."""
    return BUILTIN_FAMILIES[_parse(name)[0]]


def builtin_items(
    name: str, tokenizer, limit: int | None = None
) -> list[PplItem] | list[ChoiceItem] | list[GenerationItem]:
    """The items of built-in task `name`, sized in `tokenizer`'s tokens (first `limit` of them)."""
    family, length = _parse(name)
    count = min(limit or MAX_ITEMS, MAX_ITEMS)
    if family == "facts-choice":
        return _facts_items(tokenizer, length, count)
    if family.startswith("needle"):
        return _needle_items(tokenizer, family, length, count)
    domain = family.removesuffix("-ppl")
    window = length + CONTINUATION_TOKENS
    stream = _Stream(domain, tokenizer, window * MAX_ITEMS)
    items = []
    for start in stream.starts(window, count, overlap=False):
        items.append(PplItem(*stream.split(start, start + length, start + window)))
    return items


def _facts_items(tokenizer, length: int, count: int) -> list[ChoiceItem]:
    rng = random.Random(f"facts-choice/{length}/{SEED}")
    plans = [fact_set(rng, KINDS[i % len(KINDS)]) for i in range(count)]
    # Filler tokens per item: the length less its facts (one line each); at least a few lines.
    fillers = [
        max(16, length - len(_ids(tokenizer, "\n".join(f.sentence for f in facts))) - len(facts))
        for facts, _ in plans
    ]
    stream = _Stream("prose", tokenizer, max(fillers) * MAX_ITEMS)
    items = []
    for (facts, asked), filler, start in zip(
        plans, fillers, stream.starts(max(fillers), count, overlap=True)
    ):
        lines = stream.text_of(start, start + filler).split("\n")
        # Facts go on their own lines, evenly spaced through the filler (the asked one at a
        # random depth, since fact_set shuffled them).
        for j in reversed(range(len(facts))):
            lines.insert(round((j + 1) * len(lines) / (len(facts) + 1)), facts[j].sentence)
        choices, answer = choices_for(rng, asked, facts)
        items.append(ChoiceItem("\n".join(lines).strip(), asked.question, choices, answer))
    return items


def _needle_items(tokenizer, family: str, length: int, count: int) -> list[GenerationItem]:
    """Item i: subtask i mod 3 (the mixed family) or the family's own, its needles from
    `needle_plan`, its haystack window i of MAX_ITEMS spread over the prose (windows overlap, as
    RULER's haystacks share one essay collection): item i is the same whatever `count` is."""
    subtasks = SUBTASKS if family == "needle" else (family.removeprefix("needle-"),)
    plans = [needle_plan(subtasks[i % len(subtasks)], i // len(subtasks), SEED) for i in range(count)]
    # RULER's length counts the question and the reply's budget: the haystack gets the rest.
    fillers = [
        length
        - overhead_tokens(p, tokenizer)
        - len(_ids(tokenizer, f"\nQuestion: {p.question}\nAnswer:"))
        - p.max_new_tokens
        for p in plans
    ]
    if min(fillers) < 16:
        raise DataFormatError(f"{family}-{length}: too short for its needles and question")
    stream = _Stream("prose", tokenizer, max(fillers) * MAX_ITEMS)
    starts = stream.starts(max(fillers), MAX_ITEMS, overlap=True)
    return [
        needle_item(plan, stream.text_of(start, start + filler))
        for plan, filler, start in zip(plans, fillers, starts)
    ]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class _Stream:
    """A domain's evaluation documents (shuffled, blank line between them) and their tokens."""

    def __init__(self, domain: str, tokenizer, tokens_wanted: int):
        docs = [text for _, text in documents(domain, "eval")]
        random.Random(f"builtin/{domain}/{SEED}").shuffle(docs)
        pieces, chars = [], 0
        for doc in docs:  # ~6 characters a token is generous for every tokenizer here
            pieces.append(doc)
            chars += len(doc) + 2
            if chars >= 6 * tokens_wanted:
                break
        self.text = "\n\n".join(pieces)
        try:
            encoded = tokenizer(self.text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as err:
            raise DataFormatError("built-in tasks need a fast tokenizer (one that reports offsets)") from err
        self.offsets = [tuple(o) for o in encoded["offset_mapping"]]

    def starts(self, window: int, count: int, overlap: bool) -> list[int]:
        """Token indices of `count` windows of `window` tokens spread evenly over the stream, each
        moved forward to the start of a line where one begins within the slack between windows."""
        total = len(self.offsets)
        if total < window:
            raise DataFormatError(f"the evaluation text holds {total} tokens; a window needs {window}")
        if not overlap:
            count = min(count, total // window)
        stride = (total - window) // (count - 1) if count > 1 else 0
        slack = 32 if overlap else min(32, stride - window)
        starts = []
        for i in range(count):
            first = start = i * stride
            while start < min(first + slack, total - window) and not self._line_start(start):
                start += 1
            starts.append(start if self._line_start(start) else first)
        return starts

    def _line_start(self, token: int) -> bool:
        begin = self.offsets[token][0]
        return begin == 0 or self.text[begin - 1] == "\n"

    def text_of(self, first: int, end: int) -> str:
        """Text of tokens [first, end)."""
        return self.text[self.offsets[first][0] : self.offsets[end - 1][1]]

    def split(self, first: int, cut: int, end: int) -> tuple[str, str]:
        """Texts of tokens [first, cut) and [cut, end), meeting exactly at the cut."""
        middle = self.offsets[cut - 1][1]
        return self.text[self.offsets[first][0] : middle], self.text[middle : self.offsets[end - 1][1]]
