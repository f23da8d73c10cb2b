"""The native work of a bridged cache: the context columns the target computes itself, in one pass.

Pending columns, per row: the native head (the attention sink / BOS), columns without source text
(chat-template markers), and the refreshed columns a selection rule picks. They go through the
target in ONE forward together with whatever the target reads next (generate()'s first forward:
the native tail, the held-back last token, the prompt), each query at its own column and
position, attending to the cache up to its column (`ColumnMask`). At every layer the fresh rows
are written over the placeholder / translated rows before that layer's attention reads them, so
the pending tokens attend to each other's fresh rows and the prompt reads a repaired cache.
Refreshing every column reproduces the target's own prefill; the first new token's logits come
from the same forward.

How the pass joins a forward: a pre-hook on the target (installed once per model) sees a forward
over a `BridgedCache` with pending work, puts the pending tokens in front of the forward's own
(ids and positions), passes the column masks, and points the model's attention at
bridgecache.runtime.attention; the cache's `update` then calls `pass_update`. A post-hook (run even
when the forward raises) restores the model and drops the pending tokens' logits. When the cache is
read before any forward (materialize(), to_static, crop, a layer's tensors), the same pass runs
alone: a forward of no new tokens.

Knows transformers' forward conventions and the cache's layers; nothing about bridges or
tokenizers.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch

from bridgecache.compat import cache_keyword
from bridgecache.runtime.attention import KEYWORD, ColumnMask, attention_override

__all__ = ["PendingWork", "pending_columns", "refresh_budget", "install", "pass_update", "run_alone"]


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


# ------------------------------------------------------------------------------------- the pass


@dataclass
class _Pass:
    """One native-work forward in flight: its pending work and where each layer's keys start."""

    work: PendingWork
    new_tokens: int
    spans: list  # per layer (start, kept): attention reads columns [start, ...), the layer keeps [kept, ...)
    override: object = None  # the attention_override context in force during the forward


def pass_update(cache, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
    """A layer's `update` during the pass: key_states/value_states [batch, kv_heads, n + m, dim]
    hold the n pending tokens' fresh KV, then the m new tokens'. Writes the fresh rows over their
    columns, appends the new tokens as the layer's own update would, and returns the keys/values
    the attention reads: columns [start, prefix + m)."""
    state = cache.native_pass
    work, n = state.work, state.work.count
    start, kept = state.spans[layer_idx]
    layer = cache.layers[layer_idx]
    batch = key_states.shape[0]
    # Read the columns a window dropped first: reading the layer may consume what they come from.
    earlier = None
    if start < kept:
        earlier = cache.translator.columns(layer_idx, start, kept)
        index = layer.batch_index_for(batch) if not layer.is_materialized else None
        if index is not None:
            earlier = tuple(t.index_select(0, index.to(t.device)) for t in earlier)
    if not layer.is_materialized:  # columns [kept, prefix), as many rows as this forward's
        layer._materialize(key_states.device, key_states.dtype, batch)
    keys, values = layer.keys, layer.values
    if earlier is not None:
        keys = torch.cat([earlier[0].to(keys.device, keys.dtype), keys], dim=2)
        values = torch.cat([earlier[1].to(values.device, values.dtype), values], dim=2)
    else:
        keys, values = keys.clone(), values.clone()  # the layer's tensors may be views of a shared buffer
    index = (work.columns.to(keys.device) - start)[:, None, :, None]
    index_k = index.expand(-1, keys.shape[1], -1, keys.shape[3])
    fresh_k, fresh_v = key_states[:, :, :n].to(keys.dtype), value_states[:, :, :n].to(values.dtype)
    if work.valid is not None:  # a row without pending columns: its placeholder writes what is there
        keep = work.valid.to(keys.device)[:, None, :, None]
        fresh_k = torch.where(keep, fresh_k, keys.gather(2, index_k))
        fresh_v = torch.where(keep, fresh_v, values.gather(2, index_k))
    keys.scatter_(2, index_k, fresh_k)
    values.scatter_(2, index_k, fresh_v)
    layer.keys, layer.values = keys[:, :, kept - start :], values[:, :, kept - start :]
    # The new tokens: transformers' own layer update (a sliding layer trims to its window).
    full_k, full_v = layer.update(key_states[:, :, n:], value_states[:, :, n:])
    if start < kept:
        full_k = torch.cat([keys[:, :, : kept - start], full_k], dim=2)
        full_v = torch.cat([values[:, :, : kept - start], full_v], dim=2)
    return full_k, full_v


def _spans(cache, work: PendingWork) -> list:
    """Per layer (start, kept): a sliding layer keeps columns [kept, prefix); a pending query's
    window may reach back to `start` (from the first real column of any row, as no column before
    the earliest pending one is known on the host without a device sync)."""
    tr = cache.translator
    first = int(tr.target_pad.min())
    spans = []
    for idx, window in enumerate(tr.windows):
        kept = tr.window_start(idx)
        spans.append((min(kept, max(0, first - (window - 1))), kept) if window is not None else (0, 0))
    return spans


def _mask(cache, work: PendingWork, new_tokens: int, spans) -> ColumnMask:
    tr = cache.translator
    prefix = tr.prefix_length
    device = work.columns.device
    tail = torch.arange(prefix, prefix + new_tokens, device=device).expand(work.columns.shape[0], -1)
    starts = {window: start for window, (start, _) in zip(tr.windows, spans) if window is not None}
    return ColumnMask(torch.cat([work.columns, tail], dim=1), work.first_column, starts)


_HOOKED: weakref.WeakSet = weakref.WeakSet()


def install(target) -> None:
    """Put the pre- and post-hooks on `target` (once per model object)."""
    if target in _HOOKED:
        return
    target.register_forward_pre_hook(_before_forward, with_kwargs=True)
    target.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)
    _HOOKED.add(target)


def _pending_cache(module, kwargs):
    cache = kwargs.get(cache_keyword(module), kwargs.get("past_key_values"))
    return cache if getattr(cache, "pending_work", None) is not None else None


def _before_forward(module, args, kwargs):
    cache = _pending_cache(module, kwargs)
    if cache is None or cache.native_pass is not None:
        return None
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("input_ids", None)
    if input_ids is None and args:
        input_ids, args = args[0], args[1:]
    if input_ids is None:  # inputs_embeds: the pending tokens cannot join; compute them first
        run_alone(cache, module)
        return None
    work = cache.pending_for_batch(input_ids.shape[0])
    device = work.columns.device
    new = input_ids.shape[1]
    prefix = cache.translator.prefix_length
    positions = kwargs.get("position_ids")
    if positions is None:  # as the model would number them: right after the cache
        positions = (torch.arange(new, device=device) + prefix).expand(input_ids.shape[0], -1)
    spans = _spans(cache, work)
    kwargs["input_ids"] = torch.cat([work.ids, input_ids.to(device)], dim=1)
    kwargs["position_ids"] = torch.cat([work.positions, positions.to(device)], dim=1)
    kwargs["attention_mask"] = None  # transformers builds none under the override: ours travels below
    kwargs[KEYWORD] = _mask(cache, work, new, spans)
    keep = kwargs.get("logits_to_keep")
    if keep is None or (isinstance(keep, int) and (keep == 0 or keep > new)):
        kwargs["logits_to_keep"] = max(new, 1)  # the pending tokens' logits are never wanted
    elif isinstance(keep, torch.Tensor):
        kwargs["logits_to_keep"] = keep + work.count
    cache.begin_pass(_Pass(work, new, spans))
    override = attention_override(module)
    override.__enter__()
    cache.native_pass.override = override
    return args, kwargs


def _after_forward(module, args, kwargs, output):
    # Runs after every forward of a hooked model, also one that raised (then output is None).
    cache = kwargs.get(cache_keyword(module), kwargs.get("past_key_values"))
    state = getattr(cache, "native_pass", None)
    if state is None:
        return None
    cache.end_pass()
    state.override.__exit__(None, None, None)
    return None


def run_alone(cache, target) -> None:
    """Run the pending work in a forward of its own (no new tokens), now."""
    ids = cache.pending_work.ids[:, :0]
    with torch.no_grad():
        target(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword(target): cache})
