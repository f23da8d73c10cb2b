"""A handoff's cache is freed when its last reference goes, by reference counting alone: no
reference cycle (layer <-> cache, translator <-> its groups, the pass's lazy fill) holds a cache's
translated KV and source KV until Python's cyclic collector happens to run. On a GPU that memory
is gigabytes per request (a batch of 32 x 4K contexts held three requests' caches at once)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tiny_models import CHATML, chat_tokenizer, random_bridge, tiny_model

from bridgecache import (
    BridgedCache,
    GivenScores,
    HandoffConfig,
    RefreshConfig,
    capture_kv,
    handoff,
    handoff_batch,
)
from bridgecache.runtime.engine import HandoffEngine, generate
from bridgecache.runtime.entry.conversation import Conversation

CONFIGS = {
    "groups": HandoffConfig(one_launch=True, route="handoff"),
    "per layer": HandoffConfig(one_launch=False, route="handoff"),
    "translation only": HandoffConfig(one_launch=True, refresh=None, route="handoff"),
}


@pytest.fixture
def no_cyclic_collector():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _bridged(model, bridge, ids, config, engine=None) -> BridgedCache:
    scores = GivenScores(torch.rand(ids.shape))
    config = config if config.refresh is None else config.replace(refresh=RefreshConfig(5, scores))
    return BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config, engine=engine)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_cache_is_freed_by_reference_counting_after_generate_and_materialize(name, no_cyclic_collector):
    model = tiny_model("qwen2")
    bridge = random_bridge(model)
    ids = torch.randint(3, 300, (2, 20))
    engine = HandoffEngine(bridge, model, model)
    for run in (
        lambda cache: generate(model, cache, ids, max_new_tokens=3, do_sample=False, pad_token_id=0),
        lambda cache: cache.materialize(),  # the pass alone, before any forward
        lambda cache: generate(
            model, cache, ids, max_new_tokens=2, num_beams=2, do_sample=False, pad_token_id=0
        ),
    ):
        for owner in (engine, None):
            cache = _bridged(model, bridge, ids, CONFIGS[name], owner)
            kv, translator = weakref.ref(cache.translator.source.keys[0]), weakref.ref(cache.translator)
            out = run(cache)
            gone = weakref.ref(cache)
            del cache, out
            assert gone() is None and translator() is None and kv() is None


def test_every_path_frees_its_cache_by_reference_counting(byte_bpe, no_cyclic_collector):
    model = tiny_model("qwen2")
    bridge = random_bridge(model)
    tokenizers = dict(source_tokenizer=byte_bpe, target_tokenizer=byte_bpe)
    gen = dict(max_new_tokens=3, do_sample=False)
    config = HandoffConfig(one_launch=True, route="handoff")
    results = {
        "handoff": handoff(
            bridge, model, model, "hello world the world", " the", **tokenizers, config=config, **gen
        ),
        "handoff_batch": handoff_batch(
            bridge, model, model, ["hello world", "the hello the"], " the", **tokenizers, config=config, **gen
        ),
    }
    chat = chat_tokenizer(CHATML)
    messages = [{"role": "user", "content": "hello world the world"}, {"role": "assistant", "content": "ok"}]
    conversation = Conversation.handoff(
        bridge, model, model, messages, source_tokenizer=chat, target_tokenizer=chat, config=config
    )
    conversation.ask("where?", **gen)
    caches = {path: weakref.ref(result.cache) for path, result in results.items()}
    caches["Conversation"] = weakref.ref(conversation.cache)
    assert all(ref() is not None for ref in caches.values())
    del results, conversation
    assert [path for path, ref in caches.items() if ref() is not None] == []
