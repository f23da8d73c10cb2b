"""The engine's generate(): transformers' generate() over a BridgedCache whose first forward is the
native-work pass (bridgecache.runtime.native_work.forward), on a view of the target.

    out = generate(target, cache, input_ids, max_new_tokens=16)

The view (bridgecache.runtime.interop.views.generate_view) is a shallow copy of the user's model:
generate() writes its state there, and the user's model is left as it was. Its input preparation
is the model's own, except where the model drops a cache the pass has already made valid for the
forward that reads it (`_prepared_keeping`).

Knows transformers' generate() conventions and the cache's pending work; nothing about bridges.
"""

from __future__ import annotations

import functools
import weakref

import torch
from transformers.generation.utils import GenerationMixin

from bridgecache.compat import cache_kwargs
from bridgecache.runtime.interop.views import generate_view
from bridgecache.runtime.native_work import prefill
from bridgecache.runtime.native_work.forward import FirstForward, forward_with_pass, launch

__all__ = ["MAX_DECODE_ROOM", "decode_room", "generate"]

# Decoded tokens the native-work pass leaves room for in its buffers (past them, decoding
# concatenates as transformers' layers do): enough for an answer, bounded so that a large
# max_new_tokens does not reserve memory that an early end of sequence never uses.
MAX_DECODE_ROOM = 512


def generate(target, cache, input_ids, attention_mask=None, **generate_kwargs):
    """`target.generate(input_ids, cache=cache, ...)` whose first forward also does `cache`'s native
    work (one forward instead of two), run on a view of the target (`generate_view`): the user's
    model is not changed, and its later forwards run as they always do. A plain `target.generate`
    over a BridgedCache works too; its native work then runs as a forward of its own."""
    room = decode_room(target, cache, generate_kwargs)
    # The first forward's work starts now, replayed from a graph where one is captured (the
    # native route's prefill or the handoff's pass): generate()'s own host work runs beside it.
    launched = prefill.launch(cache, target, input_ids, attention_mask, generate_kwargs)
    if launched is None:
        launched = launch(cache, target, input_ids, attention_mask, generate_kwargs, room)
    first = FirstForward(room, launched)
    forward = functools.update_wrapper(
        functools.partial(forward_with_pass, target, first=first), target.forward
    )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    view = generate_view(target, forward)
    # the view by a weak reference: a cycle through it would outlive generate() until a gc pass
    keeping = functools.partial(_prepared_keeping, weakref.ref(view), cache)
    view.__dict__["prepare_inputs_for_generation"] = keeping
    return view.generate(
        input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(target, cache), **generate_kwargs
    )


def decode_room(target, cache, generate_kwargs: dict) -> int:
    """How many tokens generate() will append after its first forward over a BridgedCache with
    pending work (max_new_tokens - 1, at most MAX_DECODE_ROOM; 0 without pending work): the
    pass keeps room for them."""
    if getattr(cache, "pending_work", None) is None:
        return 0
    config = generate_kwargs.get("generation_config") or target.generation_config
    new = generate_kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    return min(max(int(new) - 1, 0), MAX_DECODE_ROOM) if new else 0


def _prepared_keeping(view_ref, bridged, /, *args, **kwargs) -> dict:
    """The model's own `prepare_inputs_for_generation`, keeping the BridgedCache `bridged` where
    the model drops it while it has pending work.

    Phi-3 (longrope) drops a cache of at most `original_max_position_embeddings` tokens once
    generate()'s input crosses that length: its keys were rotated with the short factors, and the
    model recomputes the whole input instead. The pass moves a bridged cache's keys to the tables
    of the forward that reads them (`NativePass.load`, `Translator.move_keys`), so dropping it
    would only throw the handoff away: transformers 5.25 then prefills the whole input
    natively, 5.17 reads the prompt alone, without the context. Such a step is prepared by
    transformers' generic method instead, which keeps the cache and slices the input after it."""
    view = view_ref()
    inputs = type(view).prepare_inputs_for_generation(view, *args, **kwargs)
    given = kwargs.get("cache", kwargs.get("past_key_values"))
    kept = inputs.get("cache", inputs.get("past_key_values"))
    if given is bridged and kept is not bridged and getattr(bridged, "pending_work", None) is not None:
        inputs = GenerationMixin.prepare_inputs_for_generation(view, *args, **kwargs)
    return inputs
