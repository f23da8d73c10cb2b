"""The native-work pass: the pending columns and the target's next tokens in ONE forward.

The pending columns of a bridged cache (its native head, columns without source text, the
refreshed ones: bridgecache.runtime.pending) go through the target together with whatever it
reads next (generate()'s first forward: the native tail, the held-back last token, the prompt),
each token at its own column and position, attending to the cached columns up to its own
(`ColumnMask`): handoff time = the source's reading + translation + this one forward, whose last
logits give the first new token. Refreshing every column reproduces the target's own prefill.

    slots    [placeholders][pending columns][new tokens]       (per row, columns ascending)
    buffers  per layer [batch, kv_heads, capacity, head_dim]    row j = context column j

Every layer first writes its fresh rows into the buffers (pending columns over their translated
rows, new tokens after the prefix), then attends over them: the pending tokens see each other's
fresh rows, the prompt sees a repaired cache. After the forward the buffers become the cache's
layers. Placeholder slots (a shape bucket wider than the work, or a row with nothing pending)
repeat the row's first pending column or write to the buffers' last row, which no query sees.

How the pass joins a forward: `install(target)` wraps the target's `forward` (once per model, as
accelerate wraps it) so that a forward over a BridgedCache with pending work runs the pass
instead; the cache is left untouched if the forward raises. A read of the cache before any
forward (materialize(), to_static, crop) runs the pass alone, with no new tokens.

Knows transformers' forward conventions and the cache's layers; nothing about bridges or
tokenizers.
"""

from __future__ import annotations

import functools

import torch

from bridgecache.compat import cache_keyword
from bridgecache.runtime.attention import KEYWORD, ColumnMask, attention_override
from bridgecache.runtime.graphs import PassGraph, bucket
from bridgecache.runtime.memo import MEMO

__all__ = ["NativePass", "install", "run_alone"]


class NativePass:
    """Inputs and buffers of one native-work forward of `slots` tokens over `capacity` columns."""

    def __init__(self, target, batch: int, slots: int, capacity: int):
        config = target.config.get_text_config()
        weight = target.get_input_embeddings().weight
        device, dtype = weight.device, weight.dtype
        heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = config.num_hidden_layers
        self.target, self.slots, self.capacity = target, slots, capacity
        self.ids = torch.zeros(batch, slots, dtype=torch.long, device=device)
        self.positions = torch.zeros_like(self.ids)
        # [keys | values, layers, batch, heads, capacity, dim] in one allocation: one copy out
        self.store = torch.zeros(2, layers, batch, heads, capacity, dim, dtype=dtype, device=device)
        self.mask = ColumnMask(
            query_columns=torch.zeros_like(self.ids),
            write_rows=torch.zeros_like(self.ids),
            first_column=torch.zeros(batch, dtype=torch.long, device=device),
            keys=tuple(self.store[0]),
            values=tuple(self.store[1]),
        )

    def load(
        self, cache, work, new_ids: torch.Tensor, new_positions: torch.Tensor, lazy: bool = False
    ) -> None:
        """Copy this forward's slots and the cache's rows into the buffers.

        work: the cache's PendingWork for this batch; new_ids, new_positions: [batch, m].
        lazy: load a layer's rows when its attention runs (translation of layer i then follows the
            compute of layer i-1), else all of them now.
        """
        tr = cache.translator
        prefix, m, n = tr.prefix_length, new_ids.shape[1], work.count
        pad = self.slots - n - m
        if pad < 0 or prefix + m >= self.capacity:
            raise ValueError(f"{n} pending + {m} new tokens over {prefix} columns exceed this pass's shape")
        device = self.ids.device
        front = lambda t: t[:, :1].expand(-1, pad)  # noqa: E731  placeholders repeat the first pending column
        new_columns = (torch.arange(m, device=device) + prefix).expand(new_ids.shape[0], -1)
        columns = torch.cat([front(work.columns), work.columns, new_columns], dim=1)
        rows = columns
        if work.valid is not None:  # rows with nothing pending write their placeholders nowhere
            valid = torch.cat(
                [front(work.valid), work.valid, torch.ones_like(new_columns, dtype=torch.bool)], 1
            )
            rows = torch.where(valid, columns, self.capacity - 1)
        mask = self.mask
        self.ids.copy_(torch.cat([front(work.ids), work.ids, new_ids.to(device)], dim=1))
        self.positions.copy_(
            torch.cat([front(work.positions), work.positions, new_positions.to(device)], dim=1)
        )
        mask.query_columns.copy_(columns)
        mask.write_rows.copy_(rows)
        mask.first_column.copy_(work.first_column)
        batch = self.ids.shape[0]

        def rows(idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = tr.columns(idx, 0, prefix)  # [context batch, heads, prefix, dim]
            index = cache.layers[idx].batch_index_for(batch)
            if index is not None:  # generate() expanded the rows (beams, several sequences)
                index = index.to(keys.device)
                keys, values = keys.index_select(0, index), values.index_select(0, index)
            return keys, values

        def fill(idx: int) -> None:
            keys, values = rows(idx)
            mask.keys[idx][:, :, :prefix].copy_(keys)
            mask.values[idx][:, :, :prefix].copy_(values)

        mask.fill = fill if lazy else None
        if not lazy:  # every layer now, in one batched copy
            sources = [t for idx in range(len(cache.layers)) for t in rows(idx)]
            targets = [t[:, :, :prefix] for pair in zip(mask.keys, mask.values) for t in pair]
            torch._foreach_copy_(targets, sources)

    @torch.no_grad()
    def forward(self, original, keep, extra: dict):
        """The model's own forward over the slots (`original`: its unwrapped forward)."""
        with attention_override(self.target):
            return original(
                input_ids=self.ids,
                position_ids=self.positions,
                use_cache=False,
                logits_to_keep=keep,
                **{KEYWORD: self.mask},
                **extra,
            )

    def commit(self, cache, new_tokens: int, copy: bool) -> None:
        """The buffers' columns [0, prefix + new_tokens) become the cache's layers (copied when the
        buffers outlive this pass, as a captured graph's do)."""
        total = cache.translator.prefix_length + new_tokens
        block = self.store[..., :total, :]
        if copy:  # one copy of every layer's columns
            block = block.clone()
        for idx, layer in enumerate(cache.layers):
            keys, values = block[0, idx], block[1, idx]
            window = getattr(layer, "sliding_window", None)
            if window is not None:  # transformers' sliding layer keeps the last window - 1 columns
                keys, values = keys[:, :, -(window - 1) :], values[:, :, -(window - 1) :]
                layer.cumulative_length = total
                keys, values = keys.clone(), values.clone()  # not a view keeping the whole block
            layer.settle(keys, values)


def _slots(work, new_tokens: int) -> int:
    return work.count + new_tokens


def _graphs(cache, target, keep, extra: dict) -> bool:
    """Whether this pass replays a captured graph: CUDA, the config allows it, and the forward
    wants no more than the last token's logits (what the graph keeps)."""
    allowed = cache.handoff_config.cuda_graphs
    on_cuda = target.get_input_embeddings().weight.is_cuda
    plain = all(key == "return_dict" for key in extra)
    return on_cuda and allowed is not False and keep == 1 and plain


def run(cache, target, original, new_ids, new_positions, keep, extra: dict):
    """The pass for a forward of `new_ids` [batch, m] at `new_positions` over `cache`; returns the
    forward's output (logits of the new tokens only, the cache in its cache field)."""
    batch, m = new_ids.shape
    work = cache.pending_for_batch(batch)
    prefix = cache.translator.prefix_length
    if _graphs(cache, target, keep, extra):
        shape = (batch, bucket(_slots(work, m)), bucket(prefix + m + 1, 256))
        make = lambda: PassGraph(NativePass(target, *shape), original)  # noqa: E731
        output = MEMO.pass_graph(target, shape, make).run(cache, work, new_ids, new_positions)
    else:
        native = NativePass(target, batch, _slots(work, m), prefix + m + 1)
        native.load(cache, work, new_ids, new_positions, lazy=True)
        output = native.forward(original, keep, extra)
        native.commit(cache, m, copy=False)
    cache.pending_work = None
    field = "cache" if hasattr(output, "cache") else "past_key_values"
    setattr(output, field, cache)
    if m and getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(h[:, -m:] for h in output.hidden_states)
    return output


def _forward(model, original, *args, **kwargs):
    """The target's forward, wrapped: a forward over a BridgedCache with pending work runs the pass."""
    keyword = cache_keyword(model)
    cache = kwargs.get(keyword, kwargs.get("past_key_values"))
    if getattr(cache, "pending_work", None) is None:
        return original(*args, **kwargs)
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("input_ids", None)
    if input_ids is None and args:
        input_ids, args = args[0], args[1:]
    if input_ids is None or args:  # inputs_embeds, or positional extras: the pending work runs first
        cache.run_pending()
        return (
            original(*args, input_ids=input_ids, **kwargs)
            if input_ids is not None
            else original(*args, **kwargs)
        )
    for name in (keyword, "past_key_values", "attention_mask", "use_cache", "cache_position"):
        kwargs.pop(name, None)  # the pass masks by columns; its cache is the buffers
    m = input_ids.shape[1]
    positions = kwargs.pop("position_ids", None)
    if positions is None:  # as the model numbers them: right after the cache
        prefix = cache.translator.prefix_length
        positions = (torch.arange(m, device=input_ids.device) + prefix).expand(input_ids.shape[0], -1)
    keep = kwargs.pop("logits_to_keep", None)
    if isinstance(keep, torch.Tensor):  # indices into this forward's tokens: after the other slots
        keep = keep + _slots(cache.pending_for_batch(input_ids.shape[0]), m) - m
    elif keep is None or keep == 0 or keep > m:
        keep = max(m, 1)  # only the new tokens' logits are anyone's
    return run(cache, model, original, input_ids, positions, keep, kwargs)


def install(target) -> None:
    """Wrap `target.forward` (once per model object; deepcopy and pickle carry the wrapper along)."""
    forward = target.forward
    if getattr(forward, "bridgecache_native_pass", False):
        return
    wrapped = functools.update_wrapper(functools.partial(_forward, target, forward), forward)
    wrapped.bridgecache_native_pass = True
    target.forward = wrapped


def run_alone(cache, target) -> None:
    """Run the pending work now, in a forward of its own (no new tokens)."""
    ids = cache.pending_work.ids[:, :0]
    with torch.no_grad():
        target(input_ids=ids, logits_to_keep=1, **{cache_keyword(target): cache})
