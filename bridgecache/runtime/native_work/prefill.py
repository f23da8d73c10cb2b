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

Launched before generate() (`launch`): the engine's generate() replays the prefill before calling
transformers' generate(), whose own host work before its first forward then runs while the GPU
computes; the result travels to that forward as a value (native_work.forward.FirstForward), which
takes it when its ids are the ones launched (`run`), and runs as above otherwise.

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

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from bridgecache.compat import cache_kwargs
from bridgecache.runtime.interop.graphs import bucket, capture, kv_bytes

__all__ = [
    "Launched",
    "PrefillGraph",
    "launch",
    "launches",
    "mask_mapping",
    "no_mask",
    "plain_generate",
    "prefill_bytes",
    "replays",
    "run",
]

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
    if not _replayable(cache, target, input_ids):
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


def _replayable(cache, target, input_ids) -> bool:
    """`replays`' conditions on the cache and the model alone (no device work)."""
    if not getattr(cache, "native_route", False) or cache.get_seq_length() != 0:
        return False
    if cache.handoff_config.cuda_graphs is False or input_ids.shape[1] == 0:
        return False
    if any(window is not None for window in cache.translator.windows):
        return False
    return getattr(target.config, "_attn_implementation", None) in _CAPTURABLE


@dataclass(eq=False)
class Launched:
    """A first forward replayed before generate() asked for it (the native route's prefill, or the
    handoff's pass: native_work.forward.launch): the ids it read [batch, m] and its result, as
    the module's `run` takes it, or None (no graph for this shape yet: the forward runs eagerly,
    and the request counts once toward the shape's capture)."""

    ids: torch.Tensor
    result: tuple | None

    def reads(self, input_ids: torch.Tensor) -> bool:
        """Whether `input_ids` are the ids launched (the same tensor, else compared on the device)."""
        if input_ids is self.ids:
            return True
        if input_ids.shape != self.ids.shape or input_ids.device != self.ids.device:
            return False
        return bool(torch.equal(input_ids, self.ids))


# generate() keywords under which its first forward is the prefill of its input ids as given
# (any other may add a forward keyword, expand the rows or embed the inputs: not launched).
_LAUNCH_SAFE = frozenset(
    {
        "max_new_tokens", "min_new_tokens", "max_length", "min_length", "do_sample", "temperature",
        "top_k", "top_p", "min_p", "repetition_penalty", "pad_token_id", "eos_token_id",
        "bos_token_id", "output_logits", "output_scores", "return_dict_in_generate",
        "generation_config", "logits_processor", "stopping_criteria", "streamer", "use_cache",
    }
)  # fmt: skip


def launch(cache, target, input_ids: torch.Tensor, attention_mask, generate_kwargs: dict) -> Launched | None:
    """Replay the native route's prefill of `input_ids` [batch, m] now, before generate() asks for
    it (see the module docstring), where `launches` says generate()'s first forward will be one a
    graph replays; returns the result for `run` (None: nothing launched)."""
    if input_ids.is_cuda and launches(cache, target, input_ids, attention_mask, generate_kwargs):
        return Launched(input_ids, _replay(cache, target, input_ids))
    return None


def launches(cache, target, input_ids: torch.Tensor, attention_mask, generate_kwargs: dict) -> bool:
    """Whether generate(input_ids, attention_mask=attention_mask, **generate_kwargs) over `cache`
    will send a first forward `replays` accepts, as far as the cache, the model, the mask
    [batch, m] (None: all ones; a device sync where given) and generate()'s keywords tell."""
    return _replayable(cache, target, input_ids) and plain_generate(
        target, input_ids, attention_mask, generate_kwargs
    )


def plain_generate(target, input_ids: torch.Tensor, attention_mask, generate_kwargs: dict) -> bool:
    """Whether generate() of `target` with these arguments sends its first forward the rows of
    `input_ids` [batch, m] as they are (no padding, no beams or extra sequences, no keyword that
    adds a forward argument), at positions 0..m-1. A device sync where a mask is given."""
    config = generate_kwargs.get("generation_config") or target.generation_config
    rows = (getattr(config, "num_beams", None) or 1) * (getattr(config, "num_return_sequences", None) or 1)
    if not generate_kwargs.keys() <= _LAUNCH_SAFE or rows != 1:
        return False
    if attention_mask is None:
        return True
    return attention_mask.shape == input_ids.shape and bool(attention_mask.bool().all())


def run(cache, target, input_ids: torch.Tensor, launched: Launched | None = None):
    """The native route's first forward from a captured graph when the engine's graph budget has
    one for this shape (captured on a shape's second request), else None (run it eagerly); the
    result `launch` returned (`launched`) where it read these ids. Returns the forward's output:
    logits of the last token, the cache (now holding the context)."""
    if launched is not None and launched.reads(input_ids):
        result = launched.result
    else:
        result = _replay(cache, target, input_ids)
    if result is None:
        return None
    logits, held = result
    for idx, layer in enumerate(cache.layers):
        layer.settle(held[2 * idx], held[2 * idx + 1])
    return CausalLMOutputWithPast(logits=logits, past_key_values=cache)


def _replay(cache, target, input_ids: torch.Tensor) -> tuple | None:
    """(logits [batch, 1, vocab], per layer keys then values [batch, kv_heads, m, head_dim]: copies)
    of a replay of `input_ids`, or None when the graph budget holds no graph for their shape."""
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
        return logits, _copies([t for pair in layers for t in pair])


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (one allocation and one batched copy where their shapes agree)."""
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        return [t.clone() for t in tensors]
    block = first.new_empty(len(tensors), *first.shape)
    copies = list(block)
    torch._foreach_copy_(copies, tensors)
    return copies
