"""The plan of a handoff (bridgecache.runtime.native_work.plan): built once by the engine, frozen,
and only read by the cache it is handed to (which runs no model to be built).

Tiny random models and a byte tokenizer (no download).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import BridgedCache, HandoffConfig, HandoffEngine, capture_kv
from bridgecache.bridge.maps import Bridge
from bridgecache.runtime.native_work.plan import HandoffPlan

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)


def _engine(**config):
    model = tiny_model("qwen2", max_position_embeddings=4096)
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"  # refreshed like a fitted bridge: the source reads the prompt
    tok = byte_tokenizer()
    config = HandoffConfig(route="handoff", native_layers=1, **config)
    return HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok, config=config)


def _forwards(model) -> list:
    """A list that grows by one each time anything runs the model (every forward embeds first)."""
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_the_engine_plans_and_the_cache_built_from_the_plan_runs_no_model():
    with _engine() as engine:
        request = engine.request(["the ship came in at dawn with salt and rope"], " and then")
        calls = _forwards(engine.target)
        plan = engine.plan(request)
        assert calls  # the native layer's forward and the source's reading of the prompt ran here
        assert plan.native_layers == {0} and set(plan.native_kv) == {0} and plan.pending is not None
        calls.clear()
        cache = BridgedCache.from_plan(plan)
        assert not calls and cache.plan is plan and cache.pending_work is plan.pending
        assert cache.report() is plan.report and cache.get_seq_length() == plan.translator.prefix_length


def test_a_plan_is_frozen_and_the_pass_leaves_it_as_it_was():
    with _engine() as engine:
        request = engine.request(["numbers 1234 and 5678 sit in this longer context"], " so")
        plan = engine.plan(request)
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.pending = None
        with pytest.raises(TypeError):
            plan.native_kv[1] = plan.native_kv[0]  # a read-only mapping
        before = dict(vars(plan))
        cache = BridgedCache.from_plan(plan)
        ids, mask = request.inputs(torch.device("cpu"))
        engine.generate(cache, ids, mask, **GREEDY)
        assert cache.pending_work is None  # the cache's own state: its first forward ran the work
        assert vars(plan) == before and plan.pending is not None  # the plan's: untouched


def test_the_low_level_cache_builds_the_same_plan_the_engine_does():
    with _engine() as engine:
        context = ["the ship came in at dawn with salt and rope"]
        request = engine.request(context, " and then")
        ids, mask = request.inputs(torch.device("cpu"))
        planned = engine.generate(engine.cache(request), ids, mask, **GREEDY)
        direct = BridgedCache(
            engine.bridge, request.source_kv, engine.target, request.target_ids, config=engine.config,
            source_model=engine.source, prompt_ids=request.source_prompt, words=request.words, engine=engine,
        )  # fmt: skip
        assert isinstance(direct.plan, HandoffPlan)
        assert torch.equal(direct.plan.pending.columns, engine.plan(request).pending.columns)
        assert torch.equal(engine.generate(direct, ids, mask, **GREEDY), planned)


def test_from_plan_refuses_anything_else():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 10))
    cache = BridgedCache(Bridge.identity(model), capture_kv(model, ids), model, ids)
    with pytest.raises(TypeError, match="plan=.*expected a HandoffPlan"):
        BridgedCache.from_plan(cache)
