"""Which context tokens does each refresh-selection rule pick? Recall of the answer, per rule.

    python benchmarks/refresh_recall.py --pair smollm2-to-qwen0.5b --bridge DIR [--first 48 --count 48]

A cheap proxy that steers the choice of a selection rule before the accuracy runs of
benchmarks/native_dial.py: on the built-in fact questions (facts-choice-512), where the answer
sits in the context is known, so each rule's pick of the top `--budget` share of the target's
context columns can be scored by how many of the answer's tokens (and of its fact's line) it
includes. Items 48-95 by default: the accuracy runs use items 0-47, so the rule is chosen on
other items than those it is reported on.

Rules (scores per source token, carried to target columns through the alignment as the
library does; the source reads "Question: ... Answer:" over its own cache):
    sum            attention summed over layers, heads and question tokens
    readout        only the last 2 question tokens ("Answer:"), where the answer is read out
    max            the largest attention any (layer, head, question token) gives the token
    sum+spread2    sum, each score also reaching 2 neighbours either side (spans)
    sum+afterK     sum, each score also reaching the K tokens AFTER it (what follows a mention)
    max+after4, readout+after4   the same reach on the other rules (max+after4: the library's
                   default, `SourceAttention()` with a prompt)
--layers L [L ...]: instead of the rules, "max+after4" scored only by the source's first L layers
(what a reading that stops after layer L would pick; a later layer cannot change an earlier one).
Prints a table: mean recall of the answer's target tokens and of its line, 95% bootstrap
intervals over items.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from native_dial import PAIRS  # noqa: E402

from bridgecache.bridge.maps import Bridge  # noqa: E402
from bridgecache.evaluation.builtin import builtin_items  # noqa: E402
from bridgecache.evaluation.prompts import _plain_prompt  # noqa: E402
from bridgecache.kv.capture import capture_kv  # noqa: E402
from bridgecache.models.zoo import load_model, load_tokenizer  # noqa: E402
from bridgecache.runtime.entry.handoff import align_context  # noqa: E402
from bridgecache.runtime.interop.attention import ReadingMask, attending, read_without_logits  # noqa: E402
from bridgecache.runtime.interop.graphs import as_view  # noqa: E402
from bridgecache.runtime.selection.reading import attention_scores  # noqa: E402


def after(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's score also reaches the k tokens after it (running max over the k before)."""
    padded = torch.nn.functional.pad(scores[:, None], (k, 0), value=float("-inf"))
    return torch.nn.functional.max_pool1d(padded, k + 1, stride=1)[:, 0]


def around(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.nn.functional.max_pool1d(scores[:, None], 2 * k + 1, stride=1, padding=k)[:, 0]


def rules(source, kv, question: torch.Tensor) -> dict[str, torch.Tensor]:
    """Source-token scores [1, S] per rule: the source reads `question` over its cache `kv`."""
    read = lambda **kw: attention_scores(  # noqa: E731
        source, kv.keys, kv.values, kv.position_ids, kv.padding, question, kv.num_tokens, **kw
    ).cpu()
    total, readout, peak = read(reduce="sum"), read(reduce="sum", counted=2), read(reduce="max")
    return {
        "sum": total,
        "readout": readout,
        "max": peak,
        "sum+spread2": around(total, 2),
        "sum+after2": after(total, 2),
        "sum+after4": after(total, 4),
        "sum+after8": after(total, 8),
        "max+after4": after(peak, 4),
        "readout+after4": after(readout, 4),
    }


class LayerMaxima(ReadingMask):
    """A reading that keeps each layer's "max" scores apart: `per_layer` [layers, batch, context]."""

    def attend(self, module, query, key, value, scaling):
        self.layer = module.layer_idx
        return super().attend(module, query, key, value, scaling)

    def _score(self, probs: torch.Tensor) -> None:
        self.per_layer[self.layer] = probs.amax(dim=(1, 2, 3))


def first_layers_rules(source, kv, question: torch.Tensor, counts: list[int]) -> dict[str, torch.Tensor]:
    """Source-token scores [1, S] of "max+after4" from the first L layers only, per L in counts."""
    n = kv.num_tokens
    positions = kv.position_ids[:, :n]
    query_positions = positions[:, -1:] + 1 + torch.arange(question.shape[1])[None]
    mask = LayerMaxima(
        keys=tuple(k[:, :, :n] for k in kv.keys), values=tuple(v[:, :, :n] for v in kv.values),
        context_positions=positions, first_column=kv.padding, query_positions=query_positions,
        scores=torch.zeros(1, n),
    )  # fmt: skip
    mask.per_layer = torch.zeros(len(kv.keys), 1, n)
    with attending(mask):  # through a view of the source: our attention, the model untouched
        read_without_logits(
            as_view(source), input_ids=question, position_ids=query_positions, use_cache=False
        )
    return {f"max+after4, first {c} layers": after(mask.per_layer[:c].amax(0), 4) for c in counts}


def top_columns(scores: torch.Tensor, eligible: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` highest-scoring eligible columns of each row ([batch, budget] int64)."""
    return torch.where(eligible, scores.float(), float("-inf")).topk(budget, dim=1).indices


def answer_columns(tokenizer, text: str, span: tuple[int, int]) -> set[int]:
    """Target columns whose characters overlap text[span] (columns as context_ids counts them)."""
    enc = tokenizer(text, return_offsets_mapping=True)
    return {c for c, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < span[1] and b > span[0]}


def ci(values: list[float]) -> tuple[float, float]:
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(2000))
    return means[50], means[1949]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", required=True, choices=list(PAIRS))
    parser.add_argument(
        "--bridge",
        required=True,
        help="directory, builtin:SOURCE->TARGET or hub id (its alignment policy is used)",
    )
    parser.add_argument("--task", default="facts-choice-512")
    parser.add_argument("--first", type=int, default=48)
    parser.add_argument("--count", type=int, default=48)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--layers", type=int, nargs="+", help="score by the first L source layers only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bridge = Bridge.from_pretrained(args.bridge)
    source_name, target_name = PAIRS[args.pair]
    source, source_tok = load_model(source_name)
    target_tok = load_tokenizer(target_name)  # the target model itself is not needed
    items = builtin_items(f"{args.task}", target_tok, limit=args.first + args.count)[args.first :]
    recall = {}
    for item in tqdm(items, desc="items"):
        alignment, source_ids, target_ids = align_context(bridge, item.context, source_tok, target_tok)
        answer = item.choices[item.answer]
        at = item.context.find(answer)
        line_start = item.context.rfind("\n", 0, at) + 1
        line_end = item.context.find("\n", at)
        line_end = len(item.context) if line_end < 0 else line_end
        wanted = {
            "answer": answer_columns(target_tok, item.context, (at, at + len(answer))),
            "line": answer_columns(target_tok, item.context, (line_start, line_end)),
        }
        kv = capture_kv(source, source_ids)
        question = source_tok(_plain_prompt(item), add_special_tokens=False, return_tensors="pt")["input_ids"]
        tokens = target_ids.shape[1]
        # The source token each target column reads (-1: none): the one covering its last character.
        rows = (
            torch.arange(tokens)[None] if alignment is None else torch.as_tensor(alignment.source_index)[None]
        )
        eligible = torch.zeros(1, tokens, dtype=torch.bool)
        eligible[0, 1 : tokens - 1] = True  # as BridgedCache: native sink, held-back last token
        budget = round(args.budget * int(eligible.sum()))
        scored = (
            first_layers_rules(source, kv, question, args.layers)
            if args.layers
            else rules(source, kv, question)
        )
        for name, scores in scored.items():
            on_target = torch.where(rows >= 0, scores.gather(1, rows.clamp(min=0)), 0.0)
            picked = set(top_columns(on_target, eligible, budget)[0].tolist())
            for what, columns in wanted.items():
                recall.setdefault((name, what), []).append(len(picked & columns) / max(1, len(columns)))
    print(f"{args.pair}, {args.task} items {args.first}-{args.first + len(items) - 1}, budget {args.budget}")
    print("| rule | answer tokens picked | answer line tokens picked |")
    print("|---|---|---|")
    for name in dict.fromkeys(name for name, _ in recall):
        cells = []
        for what in ("answer", "line"):
            values = recall[(name, what)]
            lo, hi = ci(values)
            cells.append(f"{statistics.fmean(values):.0%} [{lo:.0%}, {hi:.0%}]")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
