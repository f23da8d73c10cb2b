"""The native-work pass: the pending columns and the target's next tokens in ONE forward.

The pending columns of a bridged cache (its native head, columns without source text, the
refreshed ones: bridgecache.runtime.native_work.pending) go through the target together with
whatever it reads next (generate()'s first forward: the native tail, the held-back last token, the prompt),
each token at its own column and position, attending to the cached columns up to its own
(`ColumnMask`): handoff time = the source's reading + translation + this one forward, whose last
logits give the first new token. Refreshing every column reproduces the target's own prefill.

    slots    [placeholders][pending columns][new tokens]       (per row, columns ascending)
    buffers  per layer [batch, kv_heads, capacity, head_dim]    row j = context column j

Every layer first writes its fresh rows into the buffers (pending columns over their translated
rows, new tokens after the prefix), then attends over them: the pending tokens see each other's
fresh rows, the prompt sees a repaired cache. After the forward the buffers become the cache's
layers, with room after them for the tokens generate() appends (`FirstForward.room`, from the
engine's generate(): the layers write them in place, bridgecache.runtime.cache). A group of layers
translated in one launch is translated straight into the buffers: the pass holds one copy of the
translated cache. Placeholder slots (a shape bucket wider than the work, or a row with nothing pending)
repeat the row's first pending column or write to the buffers' last row, which no query sees.

How the pass joins a forward: the engine's `generate()` runs on a view of the target
(bridgecache.runtime.interop.views.generate_view) whose forward is `forward_with_pass`: a forward
over a BridgedCache with pending work runs the pass, through the target's `ModelView` (our attention),
every other forward goes to the user's model as it is. The cache is left untouched if the forward
raises. On the native route (an empty cache, no pending work) the first forward is the target's own
prefill, replayed from a CUDA graph where one fits (bridgecache.runtime.native_work.prefill).
A read of the cache before any such forward (the first layer's update in a user's own
`target.generate(past_key_values=cache)`, materialize(), to_static, crop) runs the pass alone,
with no new tokens.

Launched before generate() (`launch`): the engine's generate() (native_work.generation) replays the pass
of its first forward (the prompt's ids after the cached prefix, at their own positions) before
transformers' generate() runs its own host work, which then overlaps the GPU's; the output and a
copy of the buffers travel as a value (`FirstForward`, bound into that generate()'s forward, never
parked on the cache) until the first forward takes them, where it reads the same ids (`run`); the
cache's layers are set only then (generate() counts the cache's columns before its first forward).

Knows transformers' forward conventions and the cache's layers; nothing about bridges or
tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bridgecache.compat import cache_keyword
from bridgecache.kv.rope import kept_rotary
from bridgecache.runtime.interop.attention import ColumnMask, attending
from bridgecache.runtime.interop.graphs import PassGraph, bucket, kv_bytes
from bridgecache.runtime.native_work import prefill

__all__ = [
    "FirstForward",
    "NativePass",
    "forward_with_pass",
    "launch",
    "pass_bytes",
    "run_alone",
]


class NativePass:
    """Inputs and buffers of one native-work forward of `slots` tokens over `capacity` columns."""

    def __init__(self, view, batch: int, slots: int, capacity: int):
        target = view.original
        config = target.config.get_text_config()
        weight = target.get_input_embeddings().weight
        device, dtype = weight.device, weight.dtype
        heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = config.num_hidden_layers
        self.view, self.slots, self.capacity = view, slots, capacity
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
        self, cache, work, new_ids: torch.Tensor, new_positions: torch.Tensor, lazy: bool = False, length=None
    ) -> None:
        """Copy this forward's slots and the cache's rows into the buffers; a group of layers
        translated in one launch is written there directly (`LayerGroups.translate_into`): the pass
        then holds one copy of the translated cache, not two.

        work: the cache's PendingWork for this batch; new_ids, new_positions: [batch, m].
        lazy: load a layer's rows when its attention runs (translation of layer i then follows the
            compute of layer i-1), else all of them now.
        length: the positions of the forward that reads these keys, where it is not this one (a
            pass run alone before the model's own forward); None: this forward's.
        The cached keys were rotated for a forward over the prefix alone; where the target's
        tables depend on the forward's length (longrope, dynamic NTK) they are moved to this
        forward's, as the target's own prefill of context + prompt rotates every key.
        """
        plan = cache.plan
        prefix, m, n = plan.translator.prefix_length, new_ids.shape[1], work.count
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
        positions = torch.cat([front(work.positions), work.positions, new_positions.to(device)], dim=1)
        if length is not None and pad and plan.translator.by_length():
            # run alone before a longer forward: a placeholder at that forward's last position, so
            # this forward's tables (and the fresh rows) are that one's; it writes nowhere
            positions[:, 0], rows = length - 1, rows.clone()
            rows[:, 0] = self.capacity - 1
        self.positions.copy_(positions)
        mask.query_columns.copy_(columns)
        mask.write_rows.copy_(rows)
        mask.first_column.copy_(work.first_column)
        batch = self.ids.shape[0]

        def rows(idx: int) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = plan.columns(idx, 0, prefix)  # [context batch, heads, prefix, dim]
            index = cache.layers[idx].batch_index_for(batch)
            if index is not None:  # generate() expanded the rows (beams, several sequences)
                index = index.to(keys.device)
                keys, values = keys.index_select(0, index), values.index_select(0, index)
            return keys, values

        written: set[int] = set()  # layers whose group translated straight into the buffers

        def translated_here(idx: int) -> bool:
            groups = plan.groups
            if idx in written:
                return True
            if groups is None or not groups.covers(idx) or groups.start(idx) != 0:
                return False
            if cache.layers[idx].batch_index_for(batch) is not None:  # rows to expand: copy them
                return False
            written.update(groups.translate_into(idx, self.store[0], self.store[1]))
            return idx in written

        length = _rope_length(plan.translator, work, new_positions) if length is None else length

        def moved(idx: int) -> None:  # the cached keys to this forward's rotary tables
            if length is not None:
                index = cache.layers[idx].batch_index_for(batch)
                plan.translator.move_keys(mask.keys[idx][:, :, :prefix], idx, length, index)

        def fill(idx: int) -> None:
            if not translated_here(idx):
                keys, values = rows(idx)
                mask.keys[idx][:, :, :prefix].copy_(keys)
                mask.values[idx][:, :, :prefix].copy_(values)
            moved(idx)

        mask.fill = fill if lazy else None
        if not lazy:  # every layer now: groups into the buffers, the rest in one batched copy
            copied = [idx for idx in range(len(cache.layers)) if not translated_here(idx)]
            sources = [t for idx in copied for t in rows(idx)]
            targets = [t[:, :, :prefix] for idx in copied for t in (mask.keys[idx], mask.values[idx])]
            if copied:
                torch._foreach_copy_(targets, sources)
            for idx in range(len(cache.layers)):
                moved(idx)

    @torch.no_grad()
    def forward(self, keep, extra: dict):
        """The model's own forward over the slots, through its view (our attention); the view
        shares the model's rotary buffers, which longrope rewrites in place: left as they were."""
        with attending(self.mask), kept_rotary(self.view.original):
            return self.view.model.forward(
                input_ids=self.ids, position_ids=self.positions, use_cache=False, logits_to_keep=keep, **extra
            )

    def commit(self, cache, new_tokens: int, copy: bool, room: int = 0) -> None:
        """The buffers' columns [0, prefix + new_tokens) become the cache's layers (copied when the
        buffers outlive this pass, as a captured graph's do), with `room` more columns after them
        in each full-attention layer for the tokens generate() appends (`settle`)."""
        total = cache.translator.prefix_length + new_tokens
        self.settle(cache, self.held(total, room) if copy else self.store, total, room)

    def held(self, total: int, room: int) -> torch.Tensor:
        """A copy of every layer's columns [0, total) in one allocation, with `room` columns more."""
        store = self.store.new_empty(*self.store.shape[:-2], total + room, self.store.shape[-1])
        store[..., :total, :].copy_(self.store[..., :total, :])
        return store

    @staticmethod
    def settle(cache, store: torch.Tensor, total: int, room: int) -> None:
        """`store`'s columns [0, total) ([keys | values, layers, batch, heads, >= total + room,
        dim]) become the cache's layers; full-attention layers keep the room after them."""
        for idx, layer in enumerate(cache.layers):
            keys, values = store[0, idx, :, :, :total], store[1, idx, :, :, :total]
            window = getattr(layer, "sliding_window", None)
            if window is not None:  # transformers' sliding layer keeps the last window - 1 columns
                keys, values = keys[:, :, -(window - 1) :], values[:, :, -(window - 1) :]
                layer.cumulative_length = total
                keys, values = keys.clone(), values.clone()  # not a view keeping the whole block
                layer.settle(keys, values)
            else:
                layer.settle(keys, values, (store[0, idx], store[1, idx]) if room else None)


def _rope_length(translator, work, new_positions: torch.Tensor) -> int | None:
    """The length the pass's forward computes its rotary tables for (its largest position + 1),
    where the target's tables depend on it (`Translator.by_length`); else None (nothing to move,
    and no device sync)."""
    if not translator.prefix_length or not translator.by_length():
        return None
    positions = new_positions if new_positions.numel() else work.positions
    return int(positions.max()) + 1 if positions.numel() else None


def _slots(work, new_tokens: int) -> int:
    return work.count + new_tokens


def pass_bytes(target, batch: int, capacity: int) -> int:
    """Bytes of a NativePass's buffers (every layer's keys and values over `capacity` columns)."""
    return kv_bytes(target, batch, capacity)


# A pass of this many query slots or fewer (the prompt, a small refresh) is bound by its launches
# at any context length, as a reading is: its graph may take the whole graph budget, not a
# quarter (translation only at 32K on an H100: 1,149 kernels, the GPU busy 46% of the time).
_FEW_SLOTS = 512


def _graphs(cache, keep, extra: dict) -> bool:
    """Whether this pass may replay a captured graph: CUDA, the config allows it, and the forward
    wants no more than the last token's logits (what the graph keeps)."""
    allowed = cache.handoff_config.cuda_graphs
    on_cuda = cache.translator.home_device.type == "cuda"
    plain = all(key == "return_dict" for key in extra)
    return on_cuda and allowed is not False and keep == 1 and plain


def _own_positions(cache, new_ids: torch.Tensor) -> torch.Tensor:
    """[batch, m]: the positions of `new_ids` [batch, m] as the model numbers them, right after
    the cache's prefix."""
    batch, m = new_ids.shape
    return (torch.arange(m, device=new_ids.device) + cache.translator.prefix_length).expand(batch, -1)


def _pass_graph(cache, batch: int, slots: int, columns: int):
    """The engine's captured pass of this shape bucket, or None (see GraphStore.get)."""
    state = cache.state
    view = state.view("target")
    shape = (batch, bucket(slots), bucket(columns + 1, 256))
    make = lambda: PassGraph(NativePass(view, *shape))  # noqa: E731
    share = 1.0 if shape[1] <= _FEW_SLOTS else 0.25
    return state.graphs.get(("pass", *shape), make, pass_bytes(view.original, batch, shape[2]), share)


def launch(cache, target, input_ids: torch.Tensor, attention_mask, generate_kwargs: dict, room: int = 0):
    """Replay the pass of generate()'s first forward over `cache` now, before transformers'
    generate() runs its own host work (the engine's generate(): see prefill.launch), where that
    forward will be `input_ids` [batch, T] after the cached prefix at their own positions, with
    `room` columns for decoding; returns the output and the buffers' copy as a `Launched` for
    `run` (None: nothing launched)."""
    if getattr(cache, "pending_work", None) is None or not input_ids.is_cuda or not _graphs(cache, 1, {}):
        return None
    prefix = cache.translator.prefix_length
    if input_ids.shape[1] <= prefix or not prefill.plain_generate(
        target, input_ids, attention_mask, generate_kwargs
    ):
        return None
    new_ids = input_ids[:, prefix:]
    batch, m = new_ids.shape
    positions = _own_positions(cache, new_ids)
    work = cache.pending_for_batch(batch)
    graph = _pass_graph(cache, batch, _slots(work, m), prefix + m)
    result = None
    if graph is not None:
        with cache.state.replay_lock:
            result = graph.launch(cache, work, new_ids, positions, room)
    return prefill.Launched(new_ids, result)


def _taken(launched, cache, new_ids, new_positions) -> bool:
    """Whether the launched pass is this forward's: the same ids at their own positions."""
    if launched is None or not launched.reads(new_ids):
        return False
    return bool((new_positions == _own_positions(cache, new_ids)).all())


def run(cache, new_ids, new_positions, keep, extra: dict, launched=None, room: int = 0, length=None):
    """The pass for a forward of `new_ids` [batch, m] at `new_positions` over `cache`; returns the
    forward's output (logits of the new tokens only, the cache in its cache field). launched: what
    `launch` returned for this forward (taken where it read these ids); room: columns to keep
    after the new tokens for the ones generate() appends (0: none known); length: the positions
    of the forward that reads the cache next, where it is not this one (`run_alone`)."""
    batch, m = new_ids.shape
    graphs = _graphs(cache, keep, extra)  # launches are made only for such forwards
    taken = graphs and _taken(launched, cache, new_ids, new_positions)
    work = cache.pending_for_batch(batch)
    prefix = cache.translator.prefix_length
    graph = None
    slots = _slots(work, m) + (length is not None)  # room for `load`'s placeholder at `length`
    if graphs and not taken:  # a launched request was counted already
        graph = _pass_graph(cache, batch, slots, prefix + m)
    if taken and launched.result is not None:
        output, store = launched.result
        NativePass.settle(cache, store, prefix + m, room)
    elif graph is not None:
        with cache.state.replay_lock:
            output = graph.run(cache, work, new_ids, new_positions, room, length)
    else:
        native = NativePass(cache.state.view("target"), batch, slots, prefix + m + 1 + room)
        native.load(cache, work, new_ids, new_positions, lazy=True, length=length)
        try:
            output = native.forward(keep, extra)
        finally:  # the lazy fill's closure holds the pass and the cache: a cycle, broken here
            native.mask.fill = None
        native.commit(cache, m, copy=False, room=room)
    cache.finish_pending()
    field = "cache" if hasattr(output, "cache") else "past_key_values"
    setattr(output, field, cache)
    if m and getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(h[:, -m:] for h in output.hidden_states)
    return output


@dataclass(eq=False)
class FirstForward:
    """What one generate() call knows of its first forward before transformers' generate() runs
    (the engine's `generate`): `room`, the tokens it will append after that forward (the pass
    keeps room for them), and `launched`, that forward replayed early (`launch`,
    `prefill.launch`: a `Launched`, or None), which the call's first forward takes (`take`)."""

    room: int = 0
    launched: prefill.Launched | None = None

    def take(self) -> prefill.Launched | None:
        """The launched forward, once: a later forward of the same generate() gets None."""
        launched, self.launched = self.launched, None
        return launched


def forward_with_pass(target, *args, first: FirstForward | None = None, **kwargs):
    """A forward of `target` (what `generate_view` calls): over a BridgedCache with pending work it
    runs the pass with this forward's tokens; any other forward is the user's model's own.
    first: the `FirstForward` of the engine's generate() call this forward belongs to (None: no
    room for decoding known, nothing launched)."""
    keyword = cache_keyword(target)
    cache = kwargs.get(keyword, kwargs.get("past_key_values"))
    launched = None if first is None else first.take()  # the first forward's only
    room = 0 if first is None else first.room
    if getattr(cache, "pending_work", None) is None:
        input_ids = kwargs.get("input_ids")
        native = getattr(cache, "native_route", False)  # checked first: every decode step comes here
        if native and not args and input_ids is not None and input_ids.is_cuda:  # a graph's prefill
            rest = {k: v for k, v in kwargs.items() if k not in (keyword, "past_key_values", "input_ids")}
            if prefill.replays(cache, target, input_ids, rest):
                output = prefill.run(cache, target, input_ids, launched)
                if output is not None:
                    return output
        return target(*args, **kwargs)
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("input_ids", None)
    if input_ids is None and args:
        input_ids, args = args[0], args[1:]
    if input_ids is None or args:  # inputs_embeds, or positional extras: the pending work runs first
        tokens = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        run_alone(cache, room=room, new_tokens=0 if tokens is None else tokens.shape[1])
        return (
            target(*args, input_ids=input_ids, **kwargs) if input_ids is not None else target(*args, **kwargs)
        )
    for name in (keyword, "past_key_values", "attention_mask", "use_cache", "cache_position"):
        kwargs.pop(name, None)  # the pass masks by columns; its cache is the buffers
    m = input_ids.shape[1]
    positions = kwargs.pop("position_ids", None)
    if positions is None:  # as the model numbers them: right after the cache
        positions = _own_positions(cache, input_ids)
    keep = kwargs.pop("logits_to_keep", None)
    if isinstance(keep, torch.Tensor):  # indices into this forward's tokens: after the other slots
        keep = keep + _slots(cache.pending_for_batch(input_ids.shape[0]), m) - m
    elif keep is None or keep == 0 or keep > m:
        keep = max(m, 1)  # only the new tokens' logits are anyone's
    return run(cache, input_ids, positions, keep, kwargs, launched, room)


def run_alone(cache, batch: int | None = None, room: int = 0, new_tokens: int = 0) -> None:
    """Run the pending work now, in a forward of its own (no new tokens), for `batch` rows (what
    generate() expanded the context's rows to; None: the context's rows), with `room` columns
    for decoding, before a forward of the model's own over `new_tokens` after the prefix (0: none
    known), whose length the cached keys' rotary tables are moved to (`NativePass.load`)."""
    ids = cache.pending_work.ids[:, :0]
    if batch is not None and batch != ids.shape[0]:
        ids = ids.new_zeros(batch, 0)
    length = cache.translator.prefix_length + new_tokens if new_tokens else None
    with torch.no_grad():
        run(cache, ids, ids, 1, {}, room=room, length=length)
