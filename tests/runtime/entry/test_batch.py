"""handoff_batch: a batch of contexts of different lengths gives what one handoff per context gives
(identity bridge: the target's own answer), across tokenizers too; one grouped and one per-layer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from bridgecache import HandoffConfig
from bridgecache.bridge.maps import Bridge
from bridgecache.runtime.entry.batch import handoff_batch, left_pad
from bridgecache.runtime.entry.handoff import handoff

CONTEXTS = ["hello world the world", "the hello", "hello the world hello world the hello the", "world"]
PROMPT = " the"


@pytest.mark.parametrize("one_launch", [False, True])
def test_batched_identity_handoff_equals_one_by_one_and_native(byte_bpe, one_launch):
    model = tiny_model("qwen2")
    bridge = Bridge.identity(model)
    kwargs = dict(source_tokenizer=byte_bpe, target_tokenizer=byte_bpe, max_new_tokens=5, do_sample=False)
    kwargs["config"] = HandoffConfig(one_launch=one_launch)
    batched = handoff_batch(bridge, model, model, CONTEXTS, PROMPT, **kwargs)
    assert batched.cache.translator.batch_size == len(CONTEXTS)
    assert (batched.cache.plan.groups is not None) == one_launch
    for b, context in enumerate(CONTEXTS):
        single = handoff(bridge, model, model, context, PROMPT, **kwargs)
        assert torch.equal(batched.output_ids[b], single.output_ids[0]), context
        assert batched.texts[b] == single.text
        ids = byte_bpe(context + PROMPT, return_tensors="pt").input_ids
        native = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(single.output_ids[0], native[0, ids.shape[1] :])


def test_batched_handoff_across_tokenizers_equals_one_by_one(byte_bpe, sp_bpe):
    """Per-row alignments; the sources differ in length (source padding), the targets do not (a
    row with more target padding widens the batch's native head: see bridgecache.runtime.entry.batch)."""
    model = tiny_model("llama")
    bridge = Bridge.identity(model)
    contexts = ["hello world", "the world", "hello the"]
    assert len({len(sp_bpe(c).input_ids) for c in contexts}) == 1
    assert len({len(byte_bpe(c).input_ids) for c in contexts}) > 1
    kwargs = dict(source_tokenizer=byte_bpe, target_tokenizer=sp_bpe, max_new_tokens=4, do_sample=False)
    batched = handoff_batch(bridge, model, model, contexts, PROMPT, **kwargs)
    for b, context in enumerate(contexts):
        single = handoff(bridge, model, model, context, PROMPT, **kwargs)
        assert torch.equal(batched.output_ids[b], single.output_ids[0]), context


def test_left_pad_and_bad_input():
    ids, mask = left_pad([torch.tensor([[5, 6, 7]]), torch.tensor([[8]])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="contexts is empty"):
        handoff_batch(Bridge.identity(model), model, model, [], source_tokenizer=None, target_tokenizer=None)
