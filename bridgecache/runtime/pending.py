"""Pending native work: the context columns the target computes itself, and how many per row.

Pending columns, per row: the native head (the attention sink / BOS), columns without source text
(chat-template markers), and the refreshed columns a selection rule picks (a budget per row).
They wait in a `PendingWork` until the target's first forward over the cache computes them
(bridgecache.runtime.native_pass).

Knows column indices and scores; nothing about models, bridges or tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["PendingWork", "pending_columns", "refresh_budget"]


def refresh_budget(amount, eligible: int) -> int:
    """Tokens to refresh: `amount` is a fraction in [0, 1] of the `eligible` (translated) tokens,
    or an int token count (capped at `eligible`); None refreshes nothing."""
    if amount is None:
        return 0
    if isinstance(amount, float):
        return min(eligible, round(amount * eligible))
    return min(eligible, amount)


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


def pending_columns(
    always: torch.Tensor, scores: torch.Tensor | None, eligible: torch.Tensor, budgets: list[int]
):
    """[batch, n] pending columns (ascending) and their validity (None: all valid).

    always: [batch, prefix] bool (CPU), columns computed natively whatever the budget (native head,
    no source text); scores: [batch, prefix] float (any device) or None; eligible: [batch, prefix]
    bool (CPU), columns a refresh may pick; budgets: per row, how many of them to pick.
    Returns tensors on the scores' device (CPU without scores).
    """
    device = scores.device if scores is not None else torch.device("cpu")
    batch = always.shape[0]
    counts = always.sum(1).tolist()
    width = max(c + b for c, b in zip(counts, budgets)) if batch else 0
    # Always-native columns first (stable order on the CPU), then the budget's best.
    order = torch.argsort((~always).to(torch.uint8), dim=1, stable=True)[:, : max(counts)].to(device)
    parts, known = [order], [torch.arange(max(counts))[None] < torch.tensor(counts)[:, None]]
    top = max(budgets)
    if top:
        masked = torch.where(eligible.to(device), scores.float(), float("-inf"))
        parts.append(masked.topk(top, dim=1).indices)
        known.append(torch.arange(top)[None] < torch.tensor(budgets)[:, None])
    columns = torch.cat(parts, dim=1)
    valid = torch.cat(known, dim=1).to(device)
    # Unused slots repeat the row's last valid column, so after sorting the surplus sits at the
    # end and is cut; rows with none keep a placeholder (column 0, marked invalid).
    last = torch.where(valid, columns, -1).amax(dim=1, keepdim=True).clamp(min=0)
    columns = torch.where(valid, columns, last).sort(dim=1).values[:, :width]
    empty = [c + b == 0 for c, b in zip(counts, budgets)]
    if not any(empty):
        return columns, None
    row_valid = torch.tensor([not e for e in empty], device=device)[:, None]
    return columns, row_valid.expand(-1, columns.shape[1]).contiguous()
