"""Pending native work: the context columns the target computes itself, and how many per row.

Pending columns, per row: the native head (the attention sink / BOS), columns without source text
(chat-template markers), and the refreshed columns a selection rule picks (a budget per row).
They wait in a `PendingWork` until the target's first forward over the cache computes them
(bridgecache.runtime.native_work.forward).

Knows column indices and scores; nothing about models, bridges or tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bridgecache.runtime.config import refresh_budget  # re-exported: its home is the config's

__all__ = ["PendingPlan", "PendingWork", "mass_budgets", "pending_columns", "ranked", "refresh_budget"]


def mass_budgets(
    scores: torch.Tensor, eligible: torch.Tensor, mass: float, floors: list, caps: list
) -> list[int]:
    """Per row, the fewest best-scored eligible columns whose scores hold `mass` of the row's
    score sum (scores [batch, prefix], negative and -inf counting 0; eligible [batch, prefix]
    bool), within [floors[i], caps[i]]; a row without mass gets its floor. Reads the scores
    on the host once (the budgets size the work)."""
    weights = scores.float().nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(min=0.0)
    weights = torch.where(eligible.to(weights.device), weights, 0.0)
    ordered = weights.sort(dim=1, descending=True).values
    total = ordered.sum(1, keepdim=True)
    held = (ordered.cumsum(1) < mass * total).sum(1) + 1  # the first prefix reaching the share
    held = torch.where(total[:, 0] > 0, held, 0).tolist()
    return [min(cap, max(floor, n)) for n, floor, cap in zip(held, floors, caps)]


@dataclass(frozen=True)
class PendingWork:
    """Context columns waiting for the target's own compute (on the target's device).

    columns: [batch, n] int64, ascending per row; rows with fewer columns repeat their first one
        (the same column computed twice writes the same rows).
    valid: [batch, n] bool, False where a row has no pending column at all (its placeholder query
        writes nothing); None when every entry is valid.
    ids, positions: [batch, n] int64, the tokens at those columns and their positions.
    first_column: [batch] int64, each row's first real column (left padding before it).
    """

    columns: torch.Tensor
    valid: torch.Tensor | None
    ids: torch.Tensor
    positions: torch.Tensor
    first_column: torch.Tensor

    @property
    def count(self) -> int:
        return self.columns.shape[1]

    def select(self, index: torch.Tensor) -> PendingWork:
        """The work of batch rows `index` (generate()'s beam expansion and reorders)."""
        index = index.to(self.columns.device)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return replace(
            self,
            columns=pick(self.columns),
            valid=pick(self.valid),
            ids=pick(self.ids),
            positions=pick(self.positions),
            first_column=pick(self.first_column),
        )


@dataclass
class PendingPlan:
    """What `pending_columns` knows before the scores exist, already on the device (so that the
    device never waits for the host between the scoring and the selection).

    order: [batch, max always] the always-native columns of each row first (by column);
    known: [batch, max always + max budget] bool, which slots are real; budgets: per row.
    """

    order: torch.Tensor
    known: torch.Tensor
    eligible: torch.Tensor
    counts: list[int]
    budgets: list[int]

    @classmethod
    def prepare(cls, always: torch.Tensor, eligible: torch.Tensor, budgets: list[int], device) -> PendingPlan:
        """always, eligible: [batch, prefix] bool (CPU); budgets: refreshed columns per row."""
        counts = always.sum(1).tolist()
        order = torch.argsort((~always).to(torch.uint8), dim=1, stable=True)[:, : max(counts)]
        known = [torch.arange(max(counts))[None] < torch.tensor(counts)[:, None]]
        if max(budgets):
            known.append(torch.arange(max(budgets))[None] < torch.tensor(budgets)[:, None])
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return cls(move(order), move(torch.cat(known, dim=1)), move(eligible), counts, budgets)

    def select(self, scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[batch, n] pending columns (ascending) and their validity (None: all valid), on the
        device: the always-native columns, then each row's budget of the best-scoring eligible
        ones (scores [batch, prefix], higher first; None without a budget)."""
        counts, budgets = self.counts, self.budgets
        width = max(c + b for c, b in zip(counts, budgets))
        parts = [self.order]
        if max(budgets):
            parts.append(ranked(scores.to(self.eligible.device), self.eligible)[:, : max(budgets)])
        columns = torch.cat(parts, dim=1)
        valid = self.known
        # Unused slots repeat the row's last valid column, so after sorting the surplus sits at the
        # end and is cut; rows with none keep a placeholder (column 0, marked invalid).
        last = torch.where(valid, columns, -1).amax(dim=1, keepdim=True).clamp(min=0)
        columns = torch.where(valid, columns, last).sort(dim=1).values[:, :width]
        empty = [c + b == 0 for c, b in zip(counts, budgets)]
        if not any(empty):
            return columns, None
        row_valid = torch.tensor([not e for e in empty])[:, None].to(columns.device)
        return columns, row_valid.expand(-1, columns.shape[1]).contiguous()


def ranked(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """[batch, prefix] column indices: the eligible columns first, best score first, then the
    others. scores [batch, prefix] (NaN ranks as -inf: last), eligible [batch, prefix] bool.
    Eligibility is its own key, not a score of -inf: an eligible column scored -inf still comes
    before every ineligible one, so a budget (at most the eligible count) never reaches a column
    that is already native or padding. Stable sorts, not topk: equal scores (a reach spreads one
    score over several tokens) go to the earliest column, so a row picks what it picks alone,
    padded or not."""
    scores = scores.float()
    scores = scores.masked_fill(scores.isnan(), float("-inf"))
    order = scores.sort(dim=1, descending=True, stable=True).indices
    outside = (~eligible).gather(1, order).to(torch.uint8)
    return order.gather(1, outside.argsort(dim=1, stable=True))


def pending_columns(always: torch.Tensor, scores: torch.Tensor | None, eligible: torch.Tensor, budgets: list):
    """`PendingPlan.prepare(...).select(scores)` in one call, on the scores' device (the CPU
    without scores)."""
    device = scores.device if scores is not None else torch.device("cpu")
    return PendingPlan.prepare(always, eligible, budgets, device).select(scores)
