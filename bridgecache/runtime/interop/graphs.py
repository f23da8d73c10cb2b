"""The handoff's two forwards at fixed shapes, replayed from CUDA graphs.

A source reading 16 prompt tokens, or a 0.5B target computing a few hundred pending tokens,
launches about a thousand small kernels; on a GPU the host's launch work, not the arithmetic,
sets their time at short contexts. Each forward is captured once per shape bucket over buffers of
its own and replayed per handoff:

    ReadingGraph  the source reads the prompt over its cached context (bridgecache.runtime.selection.reading):
                  each run copies the context's KV, positions and the prompt into the buffers
                  (bytes the reading reads once anyway); columns past the real context and prompt
                  slots past the real prompt are masked (`ReadingMask.context_end`, `query_valid`),
                  so a 3,000-token context reads a 4,096-column buffer and scores exactly alike.
    PassGraph     the target's native-work pass (bridgecache.runtime.native_work.forward): its slots and
                  buffers are already shape-bucketed (placeholder slots, rows past the last
                  column are never visible), so the replay computes what the eager pass computes.

`captured=False` (ReadingGraph) runs the same buffers eagerly: the CPU tests' path.

Knows transformers' forward conventions and the masks; nothing about bridges or tokenizers.
"""

from __future__ import annotations

import torch

from bridgecache.kv.rope import kept_rotary
from bridgecache.runtime.interop.attention import (
    NAME,
    ReadingMask,
    attending,
    layers_read,
    read_without_logits,
)
from bridgecache.runtime.interop.views import ModelView

__all__ = ["ReadingGraph", "PassGraph", "as_view", "bucket", "capture", "kv_bytes", "reading_bytes"]


def as_view(model) -> ModelView:
    """`model`'s ModelView: the view itself, or one made for a model given directly."""
    return model if isinstance(model, ModelView) else ModelView(model, NAME)


def capture(forward):
    """A CUDA graph of `forward()` (run twice first, on a side stream: lazy initialisation,
    autotuning and the allocator's state stay out of the graph). Returns (graph, forward's output).

    cuBLAS keeps a workspace per (handle, stream) for the life of the process, outside any graph:
    the warm-ups' side stream (one of torch's pool of 32) would keep one each (an H100 soak found
    1.03 GiB still allocated after close() before this, 8.6 KiB after). So, as torch inductor's CUDA
    graph trees do, the workspaces are dropped after the warm-ups and after the capture: the
    capture then allocates the one it uses in the graph's own pool, freed with the graph
    (`HandoffEngine.close()`). Other streams' workspaces are allocated again on their next matmul."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    _drop_cublas_workspaces()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()
    _drop_cublas_workspaces()
    return graph, output


def _drop_cublas_workspaces() -> None:
    torch.cuda.synchronize()  # no kernel still using one
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private; inductor calls it too
    if clear is not None:
        clear()


def bucket(n: int, smallest: int = 16, steps: int = 8) -> int:
    """The shape bucket of n: at least `smallest`, then `steps` steps between consecutive powers
    of two past 256 (8 waste at most 12.5% of a bucket's slots: at 6,566 refreshed tokens, 6,656
    rather than 8,192), so a few dozen captured shapes cover 16 to 64K."""
    size = smallest
    while size < n:
        size *= 2
    if size <= smallest or size <= 256:
        return size
    step = size // (2 * steps)  # `steps` steps across (size / 2, size]
    return max(smallest, -(-n // step) * step)


def kv_bytes(model, batch: int, columns: int, layers: int | None = None) -> int:
    """Bytes of `layers` (None: all) of `model`'s layers' keys and values, `batch` rows of `columns`
    columns each, in the model's dtype: what a captured forward's KV buffers hold."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size = model.get_input_embeddings().weight.element_size()
    layers = config.num_hidden_layers if layers is None else layers
    return 2 * layers * batch * heads * columns * dim * size


def reading_bytes(model, batch: int, capacity: int, layers: int | None) -> int:
    """Bytes of a ReadingGraph's KV buffers (before its capture pool) for `model`."""
    return kv_bytes(model, batch, capacity, layers_read(model, layers))


class ReadingGraph:
    """One reading at fixed shapes (see the module docstring).

    view: the model's `ModelView` (bridgecache.runtime.interop.views; or the model); batch,
    queries, capacity: the buffers' batch, prompt slots and context columns; reduce, layers: as
    ReadingMask's (buffers only for the layers read). The model's cache layout (layers, kv heads,
    head dim) comes from its config.
    """

    def __init__(
        self, view, batch: int, queries: int, capacity: int, reduce: str, captured: bool, layers=None
    ):
        view = as_view(view)
        model = view.original
        config = model.config.get_text_config()
        weight = model.get_input_embeddings().weight
        device, dtype = weight.device, weight.dtype
        heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.view, self.queries, self.capacity, self.layers = view, queries, capacity, layers
        zeros = lambda *shape, kind=torch.long: torch.zeros(*shape, dtype=kind, device=device)  # noqa: E731
        self.ids, self.query_positions = zeros(batch, queries), zeros(batch, queries)
        read = layers_read(model, layers)
        self.keys = [zeros(batch, heads, capacity, dim, kind=dtype) for _ in range(read)]
        self.values = [zeros(batch, heads, capacity, dim, kind=dtype) for _ in range(read)]
        self.mask = ReadingMask(
            keys=tuple(self.keys),
            values=tuple(self.values),
            context_positions=zeros(batch, capacity),
            first_column=zeros(batch),
            query_positions=self.query_positions,
            scores=zeros(batch, capacity, kind=torch.float32),
            reduce=reduce,
            layers=layers,
            context_end=zeros(batch),
            query_valid=zeros(batch, queries, kind=torch.bool),
        )
        self.graph = capture(self._forward)[0] if captured else None

    @torch.no_grad()
    def _forward(self) -> None:
        self.mask.forget()
        self.mask.scores.zero_()
        with attending(self.mask):
            read_without_logits(
                self.view, self.layers, input_ids=self.ids, position_ids=self.query_positions, use_cache=False
            )

    @torch.no_grad()
    def run(self, keys, values, positions, first_column, query_ids, context_tokens: int) -> torch.Tensor:
        """Scores [batch, context_tokens] float32, as `reading.attention_scores` computes them.

        keys, values: per layer [batch, kv_heads, >= context_tokens, head_dim]; positions
        [batch, >= context_tokens]; first_column [batch]; query_ids [batch, q <= queries].
        """
        q, n = query_ids.shape[1], context_tokens
        mask = self.mask
        self.ids[:, :q].copy_(query_ids)
        self.ids[:, q:].copy_(query_ids[:, -1:].expand(-1, self.queries - q))
        start = positions[:, n - 1 : n].to(self.ids.device) + 1  # left padding: the last column is real
        torch.add(start, torch.arange(self.queries, device=start.device)[None], out=self.query_positions)
        mask.context_positions[:, :n].copy_(positions[:, :n])
        mask.first_column.copy_(first_column)
        mask.context_end.fill_(n)
        mask.query_valid.fill_(False)
        mask.query_valid[:, :q] = True
        read = len(self.keys)  # the layers read: their KV only
        torch._foreach_copy_(
            [t[:, :, :n] for t in (*self.keys, *self.values)],
            [t[:, :, :n] for t in (*keys[:read], *values[:read])],
        )
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()
        return mask.scores[:, :n].clone()


class PassGraph:
    """A native-work pass (`native_work.forward.NativePass`, its shapes fixed) captured once, replayed per
    handoff; the captured forward keeps the last slot's logits only (generate()'s first token)."""

    def __init__(self, native):
        self.native = native
        self.graph, output = capture(lambda: native.forward(1, {}))
        self.logits = output.logits  # [batch, 1, vocab], rewritten by every replay
        self.output_type = type(output)

    def run(
        self, cache, work, new_ids: torch.Tensor, new_positions: torch.Tensor, room: int = 0, length=None
    ):
        """The pass over `cache` for new_ids / new_positions [batch, m]; returns the forward's
        output (logits of the last token; the cache's layers hold the buffers' copy, with `room`
        columns more for generate()'s tokens)."""
        output, store = self.launch(cache, work, new_ids, new_positions, room, length)
        self.native.settle(cache, store, cache.translator.prefix_length + new_ids.shape[1], room)
        return output

    def launch(
        self, cache, work, new_ids: torch.Tensor, new_positions: torch.Tensor, room: int = 0, length=None
    ):
        """`run` up to the cache: (the forward's output, the buffers' columns [0, prefix + m) with
        `room` more, copied), the cache's layers untouched."""
        self.native.load(cache, work, new_ids, new_positions, length=length)
        with kept_rotary(self.native.view.original):  # the replay rewrites longrope's shared buffer
            self.graph.replay()
        store = self.native.held(cache.translator.prefix_length + new_ids.shape[1], room)
        return self.output_type(logits=self.logits.clone()), store
