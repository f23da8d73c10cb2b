"""The runtime's public entries check their inputs where they enter (bridgecache.checks, through
bridgecache.runtime.inputs): the engine, the cache, the conversation, the route timing, a custom
selector's answer; an engine is compared with the bridge and models it is used with. Every
refusal names the argument, shows the value and says what was expected, before any model runs
(a forward hook on the models counts their forwards)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tiny_models import byte_tokenizer, random_bridge, tiny_model

from bridgecache import (
    Bridge,
    BridgedCache,
    Conversation,
    HandoffConfig,
    HandoffEngine,
    RefreshConfig,
    Selector,
    capture_kv,
    handoff,
)
from bridgecache.checks import FieldTypeError, MismatchError
from bridgecache.runtime import engine as engine_module
from bridgecache.runtime.route import RouteCosts, costs_path
from bridgecache.runtime.selection.words import ContextWords

MESSAGES = [{"role": "user", "content": "The boat is red."}]


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    return model, tok, Bridge.identity(model, tok)


@pytest.fixture
def forwards(setup):
    """Forwards of the tiny model while the test runs (a refusal must come before any)."""
    model = setup[0]
    count = []
    handle = model.model.register_forward_hook(lambda *_: count.append(1))
    yield count
    handle.remove()


def test_an_engine_refuses_what_is_not_a_bridge_a_model_or_a_tokenizer(setup):
    model, tok, bridge = setup
    cases = [
        (dict(bridge=None, source=model, target=model), r"bridge=None; expected a bridgecache Bridge"),
        (
            dict(bridge=bridge, source=model, target="gpt2"),
            r"target='gpt2'; expected a transformers causal LM",
        ),
        (
            dict(bridge=bridge, source=3, target=model),
            r"source=3; expected a transformers causal LM.* or None",
        ),
        (dict(bridge=bridge, source=model, target=None), r"target=None; expected a transformers causal LM"),
        (
            dict(bridge=bridge, source=model, target=model, source_tokenizer="tok"),
            r"source_tokenizer='tok'; expected a transformers tokenizer",
        ),
        (
            dict(bridge=bridge, source=model, target=model, graph_bytes=-1),
            r"graph_bytes=-1; expected a byte count >= 0",
        ),
        (dict(bridge=bridge, source=model, target=model, graph_bytes=1.5), r"graph_bytes=1.5"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):  # FieldTypeError is a TypeError and a ValueError
            HandoffEngine(**kwargs)


def test_handoff_with_no_bridge_is_refused_naming_it(setup, forwards):
    model, tok, _ = setup
    with pytest.raises(FieldTypeError, match="bridge=None"):
        handoff(None, model, model, "ctx", "q", source_tokenizer=tok, target_tokenizer=tok)
    assert not forwards


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(max_new_tokens=float("nan")),
            r"max_new_tokens=nan; expected a count \(the target.s window\) >= 1",
        ),
        (dict(max_new_tokens=-1), r"max_new_tokens=-1; expected a count \(the target.s window\) >= 1"),
        (dict(num_beams="2"), r"num_beams='2'"),
        (
            dict(max_new_tokens=10**12),
            r"max_new_tokens=1000000000000; expected a count \(the target.s window\) >= 1 <= 512",
        ),
    ],
)
def test_generate_counts_are_checked_before_the_source_reads(setup, forwards, kwargs, message):
    model, tok, bridge = setup
    with pytest.raises(ValueError, match=message):
        handoff(bridge, model, model, "ctx", "q", source_tokenizer=tok, target_tokenizer=tok, **kwargs)
    assert not forwards


def test_a_lone_surrogate_is_refused_naming_the_argument(setup, forwards):
    model, tok, bridge = setup
    with pytest.raises(ValueError, match=r"prompt holds a lone surrogate '\\udc80' at character 2"):
        handoff(bridge, model, model, "ctx", "ab\udc80", source_tokenizer=tok, target_tokenizer=tok)
    assert not forwards


def test_a_cache_checks_its_ids_mask_words_and_alignment(setup, forwards):
    model, tok, bridge = setup
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    kv = capture_kv(model, ids)
    forwards.clear()
    cases = [
        (dict(target_ids=ids.float()), r"target_ids is a tensor of shape \(1, 6\) and dtype torch.float32"),
        (dict(target_ids=ids[0]), r"target_ids is a tensor of shape \(6,\)"),
        (dict(target_ids=ids * 100), r"target_ids holds the id 600; expected ids in 0..319"),
        (dict(target_ids=-ids), r"target_ids holds the id -6"),
        (dict(target_ids=[[1, 2]]), r"target_ids=\[\[1, 2\]\]; expected a torch.Tensor"),
        (
            dict(target_attention_mask=torch.full((1, 6), 2)),
            r"target_attention_mask holds values other than 0 and 1",
        ),
        (dict(words="words"), r"words='words'; expected ContextWords"),
        (
            dict(words=ContextWords(ids, ids[:, :3])),
            r"words.target has shape \(1, 3\); expected the target_ids' shape",
        ),
        (dict(words=ContextWords(ids.flip(-1), ids)), r"words.source decreases within a row"),
        (dict(alignment="identity"), r"alignment='identity'; expected a tokenalign.Alignment"),
        (dict(prompt_ids=torch.tensor([[999]]), source_model=model), r"prompt_ids holds the id 999"),
        (dict(engine="engine"), r"engine='engine'; expected a bridgecache HandoffEngine or None"),
    ]
    for changes, message in cases:
        kwargs = dict(target_ids=ids) | changes
        target_ids = kwargs.pop("target_ids")
        with pytest.raises(ValueError, match=message):
            BridgedCache(bridge, kv, model, target_ids, **kwargs)
    assert not forwards


def test_an_engine_is_compared_with_the_bridge_and_models_it_is_used_with(setup, forwards):
    model, tok, bridge = setup
    other_model = tiny_model("llama", seed=1)
    other_bridge = random_bridge(model)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    kv = capture_kv(model, ids)
    forwards.clear()
    engine = HandoffEngine(bridge, model, model)
    with pytest.raises(MismatchError, match=r"engine was built for another bridge"):
        BridgedCache(other_bridge, kv, model, ids, source_model=model, engine=engine)
    with pytest.raises(MismatchError, match=r"engine was built for another target model"):
        BridgedCache(bridge, kv, other_model, ids, source_model=model, engine=engine)
    with pytest.raises(MismatchError, match=r"engine was built for another source model"):
        BridgedCache(bridge, kv, model, ids, source_model=other_model, engine=engine)
    assert not forwards
    # the same objects: accepted (and the engine's plans used)
    cache = BridgedCache(bridge, kv, model, ids, source_model=model, engine=engine)
    assert cache.state is engine.state
    engine.close()
    with pytest.raises(ValueError, match="engine is closed"):
        BridgedCache(bridge, kv, model, ids, source_model=model, engine=engine)


class _Layers(Selector):
    def __init__(self, layers):
        self.layers = layers

    def native_layers(self, num_layers):
        return self.layers

    def scores(self, request):
        return torch.zeros(request.target_ids.shape[0], request.prefix_length)


@pytest.mark.parametrize(
    "layers, error, message",
    [
        ((-1,), ValueError, r"native_layers\(3\)\[0\]=-1; expected a target layer index >= 0 <= 2"),
        ((3,), ValueError, r"\[0\]=3; expected a target layer index >= 0 <= 2"),
        (("0",), FieldTypeError, r"\[0\]='0'"),
        (0, FieldTypeError, r"native_layers\(3\) gave 0; expected a tuple of target layer indices"),
        (range(10), ValueError, r"gave 10 layers; the target has 3"),
    ],
)
def test_a_selectors_native_layers_are_checked_before_any_work(setup, forwards, layers, error, message):
    model, tok, bridge = setup
    config = HandoffConfig(refresh=RefreshConfig(by=_Layers(layers)))
    with pytest.raises(error, match=message):
        handoff(
            bridge, model, model, "context", "q", source_tokenizer=tok, target_tokenizer=tok, config=config
        )
    ids = torch.tensor([[1, 2, 3, 4]])
    kv = capture_kv(model, ids)
    forwards.clear()
    with pytest.raises(error, match=message):
        BridgedCache(bridge, kv, model, ids, config=config)
    assert not forwards


def test_a_selectors_valid_layers_are_reported_as_given(setup):
    model, tok, bridge = setup
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    config = HandoffConfig(refresh=RefreshConfig(by=_Layers([1]), amount=1))
    cache = BridgedCache(random_bridge(model), capture_kv(model, ids), model, ids, config=config)
    assert cache.report().layers_native == [1]


def test_a_conversation_checks_its_config_engine_and_messages(setup, forwards):
    model, tok, bridge = setup
    with pytest.raises(TypeError, match=r"config is a dict; expected a bridgecache HandoffConfig"):
        Conversation.handoff(
            bridge, model, model, MESSAGES, source_tokenizer=tok, target_tokenizer=tok, config={}
        )
    engine = HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=byte_tokenizer())
    with pytest.raises(MismatchError, match=r"engine was built for another target tokenizer"):
        Conversation.handoff(
            bridge, model, model, MESSAGES, source_tokenizer=tok, target_tokenizer=tok, engine=engine
        )
    with pytest.raises(TypeError, match=r"messages is a str"):
        Conversation.native(model, tok, "hello")
    with pytest.raises(FieldTypeError, match=r"target_tokenizer=None"):
        Conversation.native(model, None, MESSAGES)
    assert not forwards
    chat = Conversation.native(model, tok, MESSAGES)
    with pytest.raises(TypeError, match=r"content is a int"):
        chat.ask(3)
    with pytest.raises(TypeError, match=r"replies is a str"):
        chat.score("which?", "yes")
    assert not forwards


@pytest.mark.route_timing  # time_routes itself, not the suite's CPU stand-in (conftest)
def test_route_timing_refuses_a_length_past_the_window_before_allocating(setup, monkeypatch):
    model, tok, bridge = setup
    engine = HandoffEngine(bridge, model, model)
    timed = []  # the timing makes the ids of each length: it must not be reached
    monkeypatch.setattr(engine_module, "measure_route_costs", lambda *args, **kwargs: timed.append(args))
    with pytest.raises(ValueError, match=r"lengths\[0\]=1000000000; expected a context length .* <= 495"):
        engine.measure_route(lengths=[10**9], progress=False)
    assert not timed  # refused before the gigabytes of ids a 10**9-token timing would allocate
    for lengths, message in [("256", r"lengths='256'; expected a list"), ([], "lengths has 0 entries"),
                             ([0], r"lengths\[0\]=0"), ([2.5], r"lengths\[0\]=2.5")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            engine.measure_route(lengths=lengths, progress=False)
    with pytest.raises(ValueError, match=r"repeats=0"):
        engine.measure_route(lengths=[8], repeats=0, progress=False)
    with pytest.raises(ValueError, match=r"tokens=-1"):
        engine.time_routes(HandoffConfig(), -1)


def test_a_saved_cost_table_of_another_device_is_not_used(setup, tmp_path, monkeypatch):
    model, tok, bridge = setup
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path))
    engine = HandoffEngine(bridge, model, model)
    key = engine.state.route_key(engine.config)
    path = costs_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = RouteCosts(key, "NVIDIA H100 80GB HBM3 (cuda:0)", [256], [0.01], [0.02])
    path.write_text(json.dumps(table.__dict__))
    with pytest.warns(UserWarning, match=r"measured for .* on 'NVIDIA H100.*not for this setup on cpu"):
        assert engine.route_costs() is None
    fresh = HandoffEngine(bridge, model, model)  # the same table, this device: used
    path.write_text(json.dumps(RouteCosts(key, "cpu", [256], [0.01], [0.02]).__dict__))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.route_costs().lengths == [256]


def test_engine_methods_check_what_they_are_handed(setup, forwards):
    model, tok, bridge = setup
    engine = HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok)
    with pytest.raises(FieldTypeError, match=r"request='r'; expected a HandoffRequest"):
        engine.cache("r")
    with pytest.raises(FieldTypeError, match=r"request=None; expected a HandoffRequest"):
        engine.check_fits(None)
    with pytest.raises(FieldTypeError, match=r"cache=None; expected a BridgedCache"):
        engine.generate(None, torch.tensor([[1]]), None)
    with pytest.raises(TypeError, match=r"context is a NoneType"):
        engine.translate_context(None)
    assert not forwards
