"""The attention our own forwards need, plugged into transformers' attention interface.

Two of bridgecache's forwards attend in ways transformers' masks cannot say cheaply:

    ColumnMask   the native-work pass (bridgecache.runtime.native_work.forward): queries sit at scattered
                 context columns (the native head, refreshed tokens) and after the cached prefix
                 (the held-back token, the prompt); each attends to every cached column up to its
                 own, within its layer's window, and its fresh keys/values land in the cache's
                 buffers first. A dense [queries, keys] mask would forfeit flash attention's block
                 skipping; `column_attention` skips what no query can see.
    ReadingMask  a model reading a prompt over a context it cached (bridgecache.runtime.selection.reading):
                 the context's KV are read in place (never copied to append the prompt), and the
                 attention probabilities each context token receives are reduced on the fly into
                 a score (the largest any layer, head and prompt token gives it, or their sum).

A forward runs inside `attending(mask)` through a `ModelView` of the model
(bridgecache.runtime.interop.views), whose config copies name `dispatch`'s implementation; transformers
then builds no mask at all (it builds none for an attention implementation without a mask
function). The mask travels in a context variable, not as a forward keyword: some decoder layers
(StableLM's, Nemotron's) call their attention without handing the forward's keywords on. It is
set for the block only and only in the thread (or task) that runs it, and read only by
`dispatch`, which only our config copies name: the user's own model and config are never
switched over, and their forwards elsewhere never see it.

Knows transformers' attention-module conventions (scaling, softcapping, GPT-OSS's sink logits:
`layer_sinks`, one more softmax column per head with no value; Llama 4's chunks, `layer_chunk`, and
the temperature its NoPE layers give queries by position); a layer's window is the
cache layout's (`bridgecache.models.layout.layer_window`: Mistral, Phi-3 and StarCoder2 keep no
attribute for it). Nothing about bridges or tokenizers.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from bridgecache.kernels import column_attention
from bridgecache.models.code import decoder_of
from bridgecache.models.layout import layer_chunk, layer_sinks, layer_window, query_temperature
from bridgecache.runtime.interop.views import FALLBACK

__all__ = ["ColumnMask", "ReadingMask", "attending", "layers_read", "read_without_logits", "NAME"]

NAME = "bridgecache"  # the attention implementation's name
# The ColumnMask / ReadingMask of the forward running in this context (None: none of ours).
_MASK: contextvars.ContextVar = contextvars.ContextVar("bridgecache_attention", default=None)


@contextlib.contextmanager
def attending(mask):
    """Forwards through a `ModelView` inside this block attend with `mask` (a ColumnMask or a
    ReadingMask); in this thread or task only, and never after the block."""
    token = _MASK.set(mask)
    try:
        yield mask
    finally:
        _MASK.reset(token)


@dataclass(eq=False)
class ColumnMask:
    """Queries at given context columns, each seeing the cached columns up to its own, their keys
    and values written into per-layer buffers as the layers compute them.

    query_columns: [batch, slots] int64, ascending per row (left-padded layout).
    write_rows: [batch, slots] int64, the buffer row each slot's fresh keys/values land in (its
        column; a row no query sees for a slot that must write nothing).
    first_column: [batch] int64, the first real (non-padding) column of each row.
    keys, values: per layer [batch, kv_heads, capacity, head_dim]; row j holds column j (rows past
        the last query's column are never read, but must hold finite numbers).
    fill: called with a layer's index before its attention, to load its cached rows into the
        buffers just in time (None: they are loaded already).
    """

    query_columns: torch.Tensor
    write_rows: torch.Tensor
    first_column: torch.Tensor
    keys: tuple
    values: tuple
    fill: object = None

    def __post_init__(self):
        self.key_columns = torch.arange(self.keys[0].shape[2], device=self.query_columns.device)

    def attend(self, module, query, key, value, scaling):
        """query [batch, heads, slots, dim]; key/value: this forward's [batch, kv_heads, slots,
        dim] -> [batch, slots, heads, dim] (transformers' attention-function layout)."""
        layer = module.layer_idx
        if self.fill is not None:
            self.fill(layer)
        keys, values = self.keys[layer], self.values[layer]
        rows = self.write_rows[:, None, :, None]
        keys.scatter_(2, rows.expand(-1, key.shape[1], -1, key.shape[3]), key.to(keys.dtype))
        values.scatter_(2, rows.expand(-1, value.shape[1], -1, value.shape[3]), value.to(values.dtype))
        fix = retemper(module, self.query_columns, query.shape[2])
        if fix is not None:
            query = query * fix.to(query.dtype)
        return column_attention(
            query,
            keys,
            values,
            self.query_columns,
            self.key_columns,
            self.first_column,
            scale=scaling,
            window=layer_window(module),
            softcap=getattr(module, "attn_logit_softcapping", None),
            chunk=layer_chunk(module),
            sinks=layer_sinks(module),
        )


@dataclass(eq=False)
class ReadingMask:
    """A prompt read over a cached context, scoring each context token by the attention it gets.

    keys, values: per layer [batch, kv_heads, context, dim] the context's KV (read, never copied).
    context_positions: [batch, context] int64; first_column: [batch] first real context column.
    query_positions: [batch, queries] int64 (the prompt, right after the context).
    scores: [batch, context] float32, reduced in place over layers, heads and counted queries
        ("max": the largest probability any gives the token; "sum": their sum).
    counted: count only the last this many prompt tokens (None: all).
    layers: only layers below this index score (None: all); later layers still attend.
    context_end: [batch] int64, columns from it on are not context (a buffer longer than the
        context, as a captured graph's); None: every column is.
    query_valid: [batch, queries] bool, queries that count (the rest pad a captured graph's
        buffer: they come after the real ones, so no real query sees them); None: all.
    """

    keys: tuple
    values: tuple
    context_positions: torch.Tensor
    first_column: torch.Tensor
    query_positions: torch.Tensor
    scores: torch.Tensor
    reduce: str = "max"
    counted: int | None = None
    layers: int | None = None
    context_end: torch.Tensor | None = None
    query_valid: torch.Tensor | None = None

    def __post_init__(self):
        self._biases: dict = {}  # window -> this forward's visibility as an additive mask

    def forget(self) -> None:
        """Start a new forward: the masks made for the last one are made again (a captured graph's
        forward makes them inside the capture, so every replay recomputes them)."""
        self._biases.clear()

    def attend(self, module, query, key, value, scaling):
        """query [batch, heads, q, dim]; key/value: the prompt's own [batch, kv_heads, q, dim].

        One softmax over the context's keys and the prompt's, side by side: a few kernels per layer
        (a reading is bound by its kernels, not its bytes: 16 queries over 4K keys)."""
        layer = module.layer_idx
        context_k, context_v = self.keys[layer], self.values[layer]
        batch, heads, q, dim = query.shape
        kv_heads, n = context_k.shape[1], context_k.shape[2]
        group = heads // kv_heads
        fix = retemper(module, self.first_column[:, None] + self.query_positions, q)
        if fix is not None:
            query = query * fix.to(query.dtype)
        # Query heads of one KV head side by side: [batch, kv_heads, group * q, dim], no K copy.
        grouped = query.reshape(batch, kv_heads, group * q, dim)
        logits = torch.cat(
            [
                torch.matmul(grouped, context_k.transpose(-1, -2)),
                torch.matmul(grouped, key.transpose(-1, -2)),
            ],
            dim=-1,
        ).float()  # [batch, kv_heads, group * q, context + q]
        logits.mul_(scaling)
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits.div_(softcap)).mul_(softcap)
        logits.add_(self._bias(module, group, q))
        sinks = layer_sinks(module)
        if sinks is None:
            probs = torch.softmax(logits, dim=-1)
        else:  # one more column per query head (rows of kv head k: its heads' queries in turn)
            column = sinks.to(logits.device).view(kv_heads, group, 1).repeat_interleave(q, 1)
            column = column.view(1, kv_heads, group * q, 1).expand(batch, -1, -1, -1)
            probs = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
        weights = probs.to(value.dtype)
        out = torch.matmul(weights[..., :n], context_v) + torch.matmul(weights[..., n:], value)
        if self.layers is None or layer < self.layers:
            self._score(probs[..., :n].view(batch, kv_heads, group, q, n))
        out = out.view(batch, kv_heads, group, q, dim).reshape(batch, heads, q, dim)
        return out.transpose(1, 2)

    def _bias(self, module, group: int, q: int) -> torch.Tensor:
        """[batch, 1, group * q, context + q] float32: 0 where a query sees a key (the context's visible
        columns, the prompt's tokens up to its own), -inf elsewhere; made once per forward and
        window, shared by the layers."""
        key = (layer_window(module), layer_chunk(module))
        if key not in self._biases:
            visible = self._context_visible(module, group)  # [batch, 1, 1 or group * q, n]
            batch = visible.shape[0]
            causal = torch.ones(q, q, dtype=torch.bool, device=visible.device).tril()[None]
            chunk = key[1]
            if chunk:  # the prompt's tokens see each other only within a chunk
                at = self.query_positions // chunk
                causal = causal & (at[:, :, None] == at[:, None, :])
            causal = causal.repeat(1, group, 1)[:, None]  # [batch or 1, 1, group * q, q]
            seen = torch.cat([visible.expand(-1, -1, group * q, -1), causal.expand(batch, 1, -1, -1)], dim=-1)
            bias = torch.zeros(seen.shape, dtype=torch.float32, device=seen.device)
            self._biases[key] = bias.masked_fill_(~seen, float("-inf"))
        return self._biases[key]

    def _context_visible(self, module, group: int) -> torch.Tensor:
        """[batch, 1, 1, context] (or [batch, 1, group * q, context] in a sliding layer) bool."""
        columns = torch.arange(self.context_positions.shape[1], device=self.first_column.device)
        visible = columns[None] >= self.first_column[:, None]
        if self.context_end is not None:
            visible = visible & (columns[None] < self.context_end[:, None])
        visible = visible[:, None, None]
        window, chunk = layer_window(module), layer_chunk(module)
        if window:
            near = self.query_positions[:, :, None] - self.context_positions[:, None, :] < window
            visible = visible & near.repeat(1, group, 1)[:, None]
        if chunk:  # positions count from each row's first real token, as transformers' chunks do
            same = self.query_positions[:, :, None] // chunk == self.context_positions[:, None, :] // chunk
            visible = visible & same.repeat(1, group, 1)[:, None]
        return visible

    def _score(self, probs: torch.Tensor) -> None:
        """probs [batch, kv_heads, group, q, context] -> folded into `scores` [batch, context]."""
        if self.query_valid is not None:
            probs = probs * self.query_valid[:, None, None, :, None]
        if self.counted is not None:
            probs = probs[:, :, :, -self.counted :]
        if self.reduce == "max":
            torch.maximum(self.scores, probs.amax(dim=(1, 2, 3)), out=self.scores)
        else:
            self.scores.add_(probs.sum(dim=(1, 2, 3)))


def retemper(module, columns: torch.Tensor, slots: int) -> torch.Tensor | None:
    """[batch, 1, slots, 1] float32: what turns the temperature a Llama 4 NoPE layer gave its
    queries into the one due at `columns` [batch, slots]; None for every other layer.

    Its attention scales queries by position p = arange(slots) + the cache's length
    (`query_temperature`); our forwards run without a cache (p = arange(slots)), and their queries
    sit at `columns`, the p transformers gives them when it reads the whole sequence."""
    given = query_temperature(module, torch.arange(slots, device=columns.device))
    if given is None:
        return None
    return (query_temperature(module, columns) / given)[:, None, :, None]


def dispatch(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as `NAME`: ours for our masks, else the implementation the
    user's config names (kept on our config copy: bridgecache.runtime.interop.views)."""
    ours = _MASK.get()
    if ours is not None:
        scaling = module.scaling if scaling is None else scaling
        # contiguous, as transformers' own functions return it: some modules view() it (AFMoE)
        return ours.attend(module, query, key, value, scaling).contiguous(), None
    original = module.config.__dict__.get(FALLBACK, "sdpa")
    function = ALL_ATTENTION_FUNCTIONS.get(original) or ALL_ATTENTION_FUNCTIONS["sdpa"]
    return function(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


# Registered once, at import: the one change bridgecache makes to transformers' process state, and
# one that changes nothing for anyone else (only our config copies name it). No mask function is
# registered for NAME: transformers then builds no mask for our forwards (theirs: `attending`).
AttentionInterface.register(NAME, dispatch)


def layers_read(model, layers: int | None) -> int:
    """How many decoder layers `read_without_logits(view, layers)` runs: `layers` where the
    decoder keeps its layers in a `layers` list it loops over, else all of them."""
    stack = getattr(decoder_of(model), "layers", None)
    total = model.config.get_text_config().num_hidden_layers
    if layers is None or not isinstance(stack, torch.nn.ModuleList):
        return total
    return min(layers, total)


def read_without_logits(view, layers: int | None = None, **kwargs) -> None:
    """Run a `ModelView` for what its attention sees, not for logits: through its decoder (no final
    vocabulary projection, ~0.1 s of a 1.5B model's reading on a CPU) where it has one, and only
    through its first `layers` decoder layers where it can (`layers_read`; None: all)."""
    if view.decoder is None:
        view.model(**kwargs, logits_to_keep=1)
        return
    count = layers_read(view.original, layers)
    stack = view.layer_stack()
    if stack is None or count >= len(stack):
        view.decoder(**kwargs)
        return
    view.decoder_through(count)(**kwargs)
