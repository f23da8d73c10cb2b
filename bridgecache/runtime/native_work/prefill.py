"""The native route's prefill, replayed from a CUDA graph.

On the native route (the cost gate or the quality gate leaves the whole context to the target) a
`BridgedCache` starts empty and generate()'s first forward is the target's own prefill of context
and prompt. At short contexts that forward is launch-bound: a 0.5B target launches about a
thousand small kernels, and on an H100 its eager prefill of 256 tokens takes several times a
replay of the same forward (benchmarks/reports/route-gate-2026-12-05.md). A serving engine
replays its prefill from CUDA graphs; so does the native route on CUDA:

    PrefillGraph   the target's own forward (its own attention, not our view's) over a fresh
                   transformers DynamicCache, captured once per (batch, length bucket) with the
                   ids right-padded to the bucket; per request: copy the ids in, replay, copy
                   every layer's first m columns into the cache and take the logits at m - 1.

Causal attention: the padding after the last real token changes nothing before it, so the rows
[0, m) of every layer's KV and the logits at m - 1 are what an eager forward of the m tokens
computes (up to the kernels' sums at another shape). Used only where that holds and the forward
is what generate() asks of a first forward (`replays`): an empty cache on the native route, CUDA,
`HandoffConfig(cuda_graphs)` not False, full-attention layers only (a sliding layer would keep the
padded tail), sdpa or flash attention, rows without padding (mask all ones, positions 0..m-1),
the last token's logits only, no other outputs. Anything else runs the target's forward as it is.
A shape is captured on its second request, within the engine's graph budget (`EngineState.graphs`);
`captured=False` runs the same buffers eagerly (the CPU tests' path). Its buckets take 16 steps
between powers of two, not the passes' 8 (4,112 tokens replay as 4,352, not 4,608): the replay
pays for its padding in full, and the prefill is all of the native route's work.

The causal mask under capture: while a stream captures, transformers 5.17 never lets sdpa run
causal without a mask (`masking_utils._ignore_causal_mask_sdpa` returns False whenever
`is_tracing()`, which counts stream capture; later releases skip the mask when none is given), so
a captured prefill materialises a [batch, 1, length, length] mask and sdpa loses its flash and
cuDNN kernels: the graph of a 32K prefill took 2.7x the eager one on an H200
(benchmarks/prefill_mask.py, benchmarks/reports/route-gate-2026-12-05.md). Decoders that take a
prepared mask mapping (`attention_mask` as {"full_attention": ...}: Qwen2, Qwen3, Gemma 3 and most
others) are given the one an eager forward of these shapes computes, none (`no_mask()`); the others
build their mask as before.

Knows transformers' forward and cache conventions; nothing about bridges or tokenizers.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from bridgecache.compat import cache_kwargs
from bridgecache.runtime.interop.graphs import bucket, capture, kv_bytes

__all__ = ["PrefillGraph", "mask_mapping", "no_mask", "prefill_bytes", "replays", "run"]

# Attention implementations whose forward without a padding mask builds no mask on the host (the
# eager one makes its additive mask from a host scalar: no capture). Any other capture that fails
# runs eagerly from then on (GraphStore).
_CAPTURABLE = frozenset({"sdpa", "flash_attention_2", "flash_attention_3"})
# The forward's own keywords a replay reproduces; any other (output_attentions, inputs_embeds,
# a 4D mask ...) runs the target's forward as it is.
_PLAIN = frozenset(
    {"return_dict", "use_cache", "cache_position", "position_ids", "attention_mask", "logits_to_keep"}
)


def no_mask() -> dict:
    """What create_causal_mask returns for a full-attention prefill from position 0 without
    padding, under sdpa or flash attention, as a prepared mapping: no mask (sdpa then runs causal).
    A new dict per call: the caller's own."""
    return {"full_attention": None}


def mask_mapping(target, forward) -> dict | None:
    """`no_mask()` when `target` attends through sdpa / flash attention and `forward(no_mask())` (an
    eager forward given it as `attention_mask`) runs, else None (the decoder builds its own mask:
    one that takes no mapping fails on the dict, a layer type other than full attention on its
    key). The caller's forward must be one `no_mask()` describes (see the module docstring)."""
    if getattr(target.config, "_attn_implementation", None) not in _CAPTURABLE:
        return None
    try:
        forward(no_mask())
    except (AttributeError, KeyError, TypeError):
        return None
    return no_mask()


class PrefillGraph:
    """The target's forward over `length` token slots of `batch` rows (see the module docstring).

    Buffers: ids [batch, length]; last [1], the index of the last real token; after a run the
    captured cache holds per layer [batch, kv_heads, length, head_dim] and logits [batch, 1, vocab].
    """

    def __init__(self, target, batch: int, length: int, captured: bool = True):
        device = target.get_input_embeddings().weight.device
        self.target = target
        self.ids = torch.zeros(batch, length, dtype=torch.long, device=device)
        self.last = torch.zeros(1, dtype=torch.long, device=device)
        self.graph, self.masks = None, None
        self.masks = mask_mapping(target, self._forward)  # an eager run of the buffers decides
        if captured:
            self.graph, (self.logits, self.kv) = capture(self._forward)

    @torch.no_grad()
    def _forward(self, masks: dict | None = None):
        kv = DynamicCache(config=self.target.config)
        kwargs = cache_kwargs(self.target, kv)
        masks = masks if masks is not None else self.masks
        if masks is not None:
            kwargs["attention_mask"] = masks
        out = self.target(input_ids=self.ids, use_cache=True, logits_to_keep=self.last, **kwargs)
        return out.logits, kv

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list]:
        """(logits [batch, 1, vocab] of the last of `input_ids` [batch, m], a copy; per layer
        (keys, values) [batch, kv_heads, m, head_dim], views of the buffers: read them before
        the next run, which overwrites them)."""
        m = input_ids.shape[1]
        self.ids[:, :m].copy_(input_ids)
        self.ids[:, m:].copy_(input_ids[:, -1:].expand(-1, self.ids.shape[1] - m))  # any token: unseen
        self.last.fill_(m - 1)
        if self.graph is not None:
            self.graph.replay()
            logits, kv = self.logits, self.kv
        else:
            logits, kv = self._forward()
        return logits.clone(), [(layer.keys[:, :, :m], layer.values[:, :, :m]) for layer in kv.layers]


def prefill_bytes(target, batch: int, length: int) -> int:
    """Device bytes a PrefillGraph of `length` slots holds, estimated before its capture: every
    layer's keys and values, and the widest activations of one layer (hidden states, the MLP's
    inner width) that the capture pool keeps."""
    config = target.config.get_text_config()
    size = target.get_input_embeddings().weight.element_size()
    inner = getattr(config, "intermediate_size", 4 * config.hidden_size)
    activations = batch * length * (6 * config.hidden_size + 3 * inner) * size
    return kv_bytes(target, batch, length) + activations


def replays(cache, target, input_ids, kwargs: dict) -> bool:
    """Whether this forward of `target` (`input_ids` [batch, m], its other keywords `kwargs`) is one a
    PrefillGraph reproduces (see the module docstring; the device is the caller's to check).
    Costs one device sync when the cheap conditions hold (mask and positions checked there)."""
    if not getattr(cache, "native_route", False) or cache.get_seq_length() != 0:
        return False
    if cache.handoff_config.cuda_graphs is False or input_ids.shape[1] == 0:
        return False
    if any(window is not None for window in cache.translator.windows):
        return False
    if getattr(target.config, "_attn_implementation", None) not in _CAPTURABLE:
        return False
    if set(kwargs) - _PLAIN or kwargs.get("logits_to_keep") != 1:
        return False
    checks = []
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2 or mask.shape != input_ids.shape:
            return False
        checks.append(mask.bool().all())
    positions = kwargs.get("position_ids")
    if positions is not None:
        expected = torch.arange(input_ids.shape[1], device=positions.device)
        checks.append((positions == expected).all())
    return bool(torch.stack(checks).all()) if checks else True


def run(cache, target, input_ids: torch.Tensor):
    """The native route's first forward from a captured graph when the engine's graph budget has
    one for this shape (captured on a shape's second request), else None (run it eagerly).
    Returns the forward's output: logits of the last token, the cache (now holding the context)."""
    batch, m = input_ids.shape
    length = bucket(m, 256, steps=16)
    state = cache.state
    graph = state.graphs.get(
        ("prefill", batch, length),
        lambda: PrefillGraph(target, batch, length),
        prefill_bytes(target, batch, length),
    )
    if graph is None:
        return None
    with state.replay_lock:  # the buffers serve one request at a time
        logits, layers = graph.run(input_ids)
        held = _copies([t for pair in layers for t in pair])
    for idx, layer in enumerate(cache.layers):
        layer.settle(held[2 * idx], held[2 * idx + 1])
    return CausalLMOutputWithPast(logits=logits, past_key_values=cache)


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (one allocation and one batched copy where their shapes agree)."""
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        return [t.clone() for t in tensors]
    block = first.new_empty(len(tensors), *first.shape)
    copies = list(block)
    torch._foreach_copy_(copies, tensors)
    return copies
