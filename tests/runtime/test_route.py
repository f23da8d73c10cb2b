"""The cost gate (bridgecache.runtime.route): which side reaches the first token sooner, on every path.

Tiny random models and a byte tokenizer; measured costs are planted in a temporary cache
directory (what `HandoffEngine.measure_route` writes), so each route is taken on purpose.
"""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch
from tiny_models import byte_tokenizer, random_bridge, tiny_model

from bridgecache import (
    BridgedCache,
    Conversation,
    GivenScores,
    HandoffConfig,
    HandoffEngine,
    RefreshConfig,
    capture_kv,
    clear_engines,
    handoff,
    handoff_batch,
)
from bridgecache.cli.handoff_flags import add_handoff_arguments, handoff_config
from bridgecache.files import DamagedFileWarning
from bridgecache.integrations.publish import bridged_pages, translate_context
from bridgecache.runtime.engine import generate
from bridgecache.runtime.route import (
    COSTS_FORMAT,
    RouteCosts,
    costs_path,
    decide_route,
    estimated_flops,
    load_costs,
    save_costs,
)
from bridgecache.runtime.route_timing import CALIBRATION, route_lengths

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.route_timing]

SHORT = "the ship came in at dawn"  # 24 bytes: below the planted crossover
LONG = "the ship came in at dawn with salt and rope, and the crew went ashore. " * 8  # ~570 bytes
GREEDY = dict(max_new_tokens=4, do_sample=False)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path / "home"))
    clear_engines()
    yield tmp_path / "home"
    clear_engines()


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen2", max_position_embeddings=4096)
    return random_bridge(model), model, byte_tokenizer()


def plant_costs(bridge, model, config=None, crossover: int = 256) -> RouteCosts:
    """Measured-looking costs of this setup: the target's own prefill faster below `crossover`
    context tokens, the handoff faster above (log-log lines crossing there)."""
    with HandoffEngine(bridge, model, model) as engine:
        key = engine.state.route_key(config or HandoffConfig())
    low, high = crossover // 16, crossover * 16
    costs = RouteCosts(key, "cpu", [low, high], [1.0, 0.01], [0.01, 1.0])  # this device: another is not used
    save_costs(costs)
    return costs


def native_ids(model, tok, context: str, prompt: str) -> torch.Tensor:
    ids = tok(context + prompt, return_tensors="pt").input_ids
    return model.generate(ids, pad_token_id=0, **GREEDY)[:, ids.shape[1] :]


# ---------------------------------------------------------------------- the table and the rule
def test_costs_interpolate_in_log_log_and_keep_the_measured_points():
    costs = RouteCosts("k", "cpu", [100, 400, 1600], [0.010, 0.020, 0.040], [0.004, 0.016, 0.064])
    for n, h, nat in zip(costs.lengths, costs.handoff_s, costs.native_s):
        assert costs.predict(n) == pytest.approx((h, nat))
    handoff_s, native_s = costs.predict(200)  # halfway in log: the geometric mean
    assert handoff_s == pytest.approx((0.010 * 0.020) ** 0.5)
    assert native_s == pytest.approx((0.004 * 0.016) ** 0.5)
    assert costs.predict(3200) == pytest.approx((0.080, 0.128))  # beyond: scaled by the length
    assert costs.covers(1600) and not costs.covers(1601)
    merged = costs.merged(RouteCosts("k", "cpu", [50, 400], [1.0, 2.0], [3.0, 4.0]))
    assert merged.lengths == [50, 100, 400, 1600] and merged.handoff_s[2] == 2.0


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(lengths=[400, 100]), "ascending"),
        (dict(handoff_s=[0.1, float("nan")]), "positive seconds"),
        (dict(native_s=[0.1]), "differ in length"),
    ],
)
def test_bad_costs_are_refused(fields, message):
    values = dict(key="k", device="cpu", lengths=[100, 400], handoff_s=[0.1, 0.2], native_s=[0.1, 0.2])
    with pytest.raises(ValueError, match=message):
        RouteCosts(**(values | fields))


def test_saved_costs_round_trip_and_a_damaged_file_is_measured_again(home):
    costs = RouteCosts("abc", "cpu", [256, 512], [0.1, 0.2], [0.3, 0.4])
    path = save_costs(costs)
    assert path == costs_path("abc") and path.parent.parent == home
    assert load_costs("abc") == costs
    path.write_text(path.read_text()[:20])  # cut short
    with pytest.warns(DamagedFileWarning):
        assert load_costs("abc") is None
    path.write_text(json.dumps({**json.loads(json.dumps(costs.__dict__)), "format": 0}))
    assert load_costs("abc") is None  # another format: never trusted


@pytest.mark.parametrize(
    "content",
    [
        "[1, 2, 3]",  # parses, wrong shape
        '{"key": "KEY"}',  # fields missing
        "null",
        '{"key": "KEY", "device": "cpu", "lengths": ["256"], "handoff_s": [0.1], "native_s": [0.1], '
        '"prompt_tokens": 16, "format": 1}',  # a length that is a text
        '{"key": "KEY", "device": "cpu", "lengths": [256], "handoff_s": [NaN], "native_s": [0.1], '
        '"prompt_tokens": 16, "format": 1}',
        '{"key": "OTHER", "device": "cpu", "lengths": [256], "handoff_s": [0.1], "native_s": [0.1], '
        '"prompt_tokens": 16, "format": 1}',  # another setup's table under this key
        "\x00\xff not json",
    ],
)
def test_a_damaged_cost_table_is_set_aside_and_later_handoffs_work(setup, home, content):
    """A cost table that parses but has the wrong shape no longer breaks every default handoff:
    it is renamed aside with a warning, the routes are timed again (a CPU engine's calibration)
    into a new table, and the next handoff finds nothing to trip on."""
    bridge, model, tok = setup
    with HandoffEngine(bridge, model, model) as engine:
        key = engine.state.route_key(HandoffConfig())
    path = costs_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", key))
    kw = dict(source_tokenizer=tok, target_tokenizer=tok)
    with pytest.warns(DamagedFileWarning, match="moved it to"):
        first = handoff(bridge, model, model, SHORT, " and", **kw, **GREEDY)
    assert first.cache.report().route_reason.startswith("measured")
    assert load_costs(key) is not None  # a table of this setup, timed again
    aside = list(path.parent.glob(f"{path.name}.bad-*"))
    assert len(aside) == 1 and aside[0].read_text() == content.replace("KEY", key)
    clear_engines()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left to warn about
        again = handoff(bridge, model, model, SHORT, " and", **kw, **GREEDY)
    assert torch.equal(again.output_ids, first.output_ids)


def test_another_versions_table_is_measured_again_without_a_warning(home):
    """A table of another format, or with a field this version does not know, is not damaged:
    it is not used, and not set aside (the newer bridgecache that wrote it still reads it)."""
    costs = RouteCosts("abc", "cpu", [256], [0.1], [0.3])
    path = save_costs(costs)
    for data in ({"format": COSTS_FORMAT + 1, "key": "abc"}, {**costs.__dict__, "spread_s": [0.01]}):
        path.write_text(json.dumps(data))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert load_costs("abc") is None
        assert path.exists()


def test_the_rule_takes_the_faster_side_and_says_why(setup):
    bridge, model, _ = setup
    costs = RouteCosts("k", "NVIDIA H100 (cuda:0)", [256, 4096], [0.020, 0.030], [0.010, 0.060])
    models = (bridge, model.config, model.config)
    short = decide_route(HandoffConfig(), costs, tokens=300, prompt_tokens=16, models=models)
    long = decide_route(HandoffConfig(), costs, tokens=4000, prompt_tokens=16, models=models)
    assert (short.route, long.route) == ("native", "handoff")
    assert "measured on NVIDIA H100 (cuda:0): at 300 context tokens" in short.reason
    beyond = decide_route(HandoffConfig(), costs, tokens=9000, prompt_tokens=16, models=models)
    assert beyond.route == "handoff" and "extrapolated from 4096 tokens" in beyond.reason
    forced = decide_route(HandoffConfig(route="handoff"), costs, tokens=300, prompt_tokens=16, models=models)
    assert forced == type(forced)("handoff", "HandoffConfig(route='handoff')")


def test_without_measured_costs_flops_decide(setup):
    bridge, model, _ = setup
    models = (bridge, model.config, model.config)
    default = decide_route(HandoffConfig(), None, tokens=500, prompt_tokens=16, models=models)
    assert default.route == "handoff" and "estimated from FLOPs" in default.reason
    whole = HandoffConfig(refresh=RefreshConfig(amount=1.0))  # refreshing everything: a prefill and more
    assert decide_route(whole, None, tokens=500, prompt_tokens=16, models=models).route == "native"


def test_the_ladder_stops_at_the_request_and_the_window():
    assert route_lengths(100, 4000) == [256]  # the smallest, always
    assert route_lengths(1100, 4000) == [256, 512, 1024]  # never past the request
    assert route_lengths(1100, 4000, measured=[256]) == [512, 1024]
    assert route_lengths(100_000, 4000) == [256, 512, 1024, 2048]


def test_route_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_handoff_arguments(parser)
    assert handoff_config(parser.parse_args([])).route == "auto"
    assert handoff_config(parser.parse_args(["--route", "native"])).route == "native"
    with pytest.raises(SystemExit):
        parser.parse_args(["--route", "sometimes"])


def test_a_wrong_route_is_refused_where_the_config_is_built():
    with pytest.raises(ValueError, match="HandoffConfig.route='fast'; expected one of auto, handoff, native"):
        HandoffConfig(route="fast")


# ---------------------------------------------------------------------- the cache and every path
def test_the_native_route_is_the_targets_own_prefill_exactly(setup, home):
    bridge, model, _ = setup
    ids = torch.randint(3, 250, (1, 60))
    full = torch.cat([ids, torch.randint(3, 250, (1, 5))], 1)
    gen = dict(pad_token_id=0, output_logits=True, return_dict_in_generate=True, **GREEDY)
    native = model.generate(full, **gen)
    cache = BridgedCache(
        bridge, capture_kv(model, ids), model, ids, config=HandoffConfig(route="native"), source_model=model
    )
    assert cache.native_route and cache.get_seq_length() == 0  # generate()'s first forward reads it all
    assert cache.translated_positions == range(0)
    out = generate(model, cache, full, **gen)
    assert torch.equal(out.sequences, native.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(out.logits, native.logits)) < 1e-5
    report = cache.report()
    assert report.route == "native" and report.layers_translated == [] and report.tokens_translated == 0
    assert str(report).startswith("FALLBACK to native prefill: HandoffConfig(route='native')")
    config = HandoffConfig(route="native")
    plain = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config, source_model=model)
    assert torch.equal(model.generate(full, past_key_values=plain, **gen).sequences, native.sequences)

    # materialize() computes the context now, as the target's own prefill (what publishing reads)
    held = BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config).materialize()
    prefix = held.translator.prefix_length
    own = model(ids[:, :prefix], use_cache=True).past_key_values
    assert held.get_seq_length() == prefix > 0
    for layer, mine in zip(own.layers, held.layers):
        assert torch.allclose(layer.keys, mine.keys, atol=1e-6) and torch.allclose(
            layer.values, mine.values, atol=1e-6
        )
    continued = model.generate(full, past_key_values=held, **gen)
    assert torch.equal(continued.sequences, native.sequences)


def test_every_path_takes_the_route_the_measured_costs_give(setup, home, tmp_path):
    bridge, model, tok = setup
    plant_costs(bridge, model)
    kw = dict(source_tokenizer=tok, target_tokenizer=tok)
    short = handoff(bridge, model, model, SHORT, " and", **kw, **GREEDY)
    assert short.cache.report().route == "native"
    assert "measured on cpu: at 24 context tokens" in short.cache.report().route_reason
    assert torch.equal(short.output_ids, native_ids(model, tok, SHORT, " and"))
    long = handoff(bridge, model, model, LONG, " and", **kw, **GREEDY)
    assert long.cache.report().route == "handoff" and long.cache.report().layers_translated
    forced_config = HandoffConfig(route="handoff")
    forced = handoff(bridge, model, model, SHORT, " and", config=forced_config, **kw, **GREEDY)
    assert forced.cache.report().route == "handoff"

    batch = handoff_batch(bridge, model, model, [SHORT, SHORT[:-4]], " and", **kw, **GREEDY)
    assert batch.cache.report().route == "native"
    mixed = handoff_batch(bridge, model, model, [SHORT, LONG], " and", **kw, **GREEDY)
    assert mixed.cache.report().route == "handoff"  # the longest row decides: the batch shares one cache
    chat = Conversation.handoff(bridge, model, model, [{"role": "user", "content": SHORT}], **kw)
    chat.ask("and then?", max_new_tokens=2)
    assert chat.cache.report().route == "native"

    cache, ids = translate_context(bridge, SHORT, model, tok, tok, source=model)
    assert cache.report().route == "native"
    assert bridged_pages(cache, ids, page_size=4, model_name="tiny").meta["route"] == "native"
    cache, ids = translate_context(bridge, LONG, model, tok, tok, source=model)
    assert bridged_pages(cache, ids, page_size=4, model_name="tiny").meta["route"] == "handoff"


def test_costs_are_kept_per_config(setup, home):
    bridge, model, tok = setup
    plant_costs(bridge, model)  # for HandoffConfig() only
    fewer = HandoffConfig(refresh=RefreshConfig(amount=0.1))
    with HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as engine:
        assert engine.route_costs() is not None and engine.route_costs(fewer) is None
        ids = tok(SHORT, return_tensors="pt").input_ids
        cache = BridgedCache(
            bridge, capture_kv(model, ids), model, ids, config=fewer, source_model=model, engine=engine
        )
        assert engine.route_costs(fewer.with_words(False)) is None  # a cache built directly times nothing
        assert cache.report().route == "handoff"  # no costs for it: FLOPs say hand off
        assert "estimated from FLOPs" in cache.report().route_reason


def test_measure_route_times_both_routes_and_a_later_engine_reads_them(setup, home):
    bridge, model, tok = setup
    with HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as engine:
        costs = engine.measure_route(lengths=[32, 64], repeats=1, progress=False)
        assert costs.lengths == [32, 64] and costs.device == "cpu"
        assert all(s > 0 for s in costs.handoff_s + costs.native_s)
        more = engine.measure_route(lengths=[128], repeats=1, progress=False)
        assert more.lengths == [32, 64, 128] and more.handoff_s[:2] == costs.handoff_s
    with HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as later:
        assert later.route_costs() == more  # from the cache directory
        assert later.measure_route(repeats=1, progress=False).lengths == sorted({32, 64, 128, *CALIBRATION})
        more = later.route_costs()
        result = later.handoff(SHORT, " and", **GREEDY)
    faster = "handoff" if more.predict(24)[0] <= more.predict(24)[1] else "native"
    assert result.cache.report().route == faster


@pytest.mark.parametrize(
    "config",
    [
        HandoffConfig().with_words(True),  # a request's config, resolved: its words were known
        HandoffConfig(refresh=RefreshConfig(8, GivenScores(torch.rand(1, 40)))),  # the request's scores
        HandoffConfig(native_head=300),  # a head longer than the shortest timed length
    ],
    ids=["whole words", "given scores", "long native head"],
)
def test_the_routes_are_timed_under_a_config_that_holds_its_request(setup, home, config):
    # the timing's random ids have no words and another length than the request's scores: it
    # times the same work on them and files the costs under the request config's key
    bridge, model, tok = setup
    with HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as engine:
        costs = engine.measure_route(config, lengths=[64], repeats=1, progress=False)
        assert costs.lengths == [64] and engine.route_costs(config) == costs


def test_a_cpu_engine_times_its_calibration_once_and_scales_it_by_flops(setup, home):
    bridge, model, tok = setup
    with HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as engine:
        first = engine.handoff(SHORT, " and", **GREEDY)
        costs = engine.route_costs()
        assert costs.lengths == list(CALIBRATION) and costs.device == "cpu" and costs.scale == "flops"
        engine.handoff(LONG, " and", **GREEDY)  # longer than the calibration: nothing timed again
        assert engine.route_costs() is costs
    assert load_costs(costs.key) == costs  # kept for later processes
    models = (bridge, model.config, model.config)
    config = HandoffConfig().with_words(True)
    for text, result in ((SHORT, first),):
        tokens = tok(text, return_tensors="pt").input_ids.shape[1]
        expected = decide_route(config, costs, tokens=tokens, prompt_tokens=16, models=models)
        assert result.cache.report().route == expected.route
    long = decide_route(config, costs, tokens=5000, prompt_tokens=16, models=models)
    assert "scaled by FLOPs" in long.reason and "extrapolated from 512 tokens" in long.reason


def test_flops_scaled_costs_are_affine_in_each_routes_flops():
    costs = RouteCosts("k", "cpu", [64, 512], [0.5, 0.9], [0.1, 0.8], scale="flops")
    flops = lambda n: (1000.0 + n, 10.0 * n)  # noqa: E731 - (the handoff's, the target's prefill)
    assert costs.predict(64, flops) == pytest.approx((0.5, 0.1))
    assert costs.predict(512, flops) == pytest.approx((0.9, 0.8))
    handoff_s, native_s = costs.predict(2048, flops)  # beyond: the same lines
    assert handoff_s == pytest.approx(0.5 + 0.4 * (2048 - 64) / 448)
    assert native_s == pytest.approx(0.1 + 0.7 * (2048 - 64) / 448)
    assert costs.predict(32, flops) == costs.predict(32)  # below the first: scaled by the length
    slower = RouteCosts("k", "cpu", [64, 512], [0.9, 0.5], [0.1, 0.8], scale="flops")
    assert slower.predict(2048, flops)[0] == pytest.approx(0.9)  # a falling time is held, never below
    with pytest.raises(ValueError, match="RouteCosts.scale='time'"):
        RouteCosts("k", "cpu", [64], [0.1], [0.1], scale="time")


def test_estimated_flops_of_the_handoff_grow_with_the_context(setup):
    bridge, model, _ = setup
    short = estimated_flops(HandoffConfig(), bridge, model.config, model.config, 64, 16)
    long = estimated_flops(HandoffConfig(), bridge, model.config, model.config, 512, 16)
    assert long[0] > short[0] > 0 and long[1] > short[1] > 0


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2, 3]",
        '"costs"',
        '{"format": 1, "key": "abc", "device": "cpu"}',
        '{"format": 1, "key": "abc", "device": "cpu", "lengths": "64", "handoff_s": [1], "native_s": [1]}',
        '{"format": 1, "key": "abc", "device": "cpu", "lengths": [64.5], "handoff_s": [1], "native_s": [1]}',
        '{"format": 1, "key": "other", "device": "cpu", "lengths": [64], "handoff_s": [1], "native_s": [1]}',
        '{"format": 1, "key": "abc", "device": "cpu", "lengths": [64], "handoff_s": ["1"], "native_s": [1]}',
    ],
    ids=[
        "a list",
        "a string",
        "no times",
        "lengths a string",
        "a fractional length",
        "another key",
        "text times",
    ],
)
def test_a_saved_file_of_the_wrong_shape_is_set_aside_and_measured_again(home, text):
    path = costs_path("abc")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.warns(DamagedFileWarning, match="moved it to abc.json.bad-"):
        assert load_costs("abc") is None  # no exception for the caller
    (aside,) = path.parent.glob("abc.json.bad-*")
    assert not path.exists() and aside.read_text() == text
    assert load_costs("abc") is None  # nothing left to trip on
    fresh = RouteCosts("abc", "cpu", [64, 512], [0.1, 0.2], [0.3, 0.4], scale="flops")
    save_costs(fresh)
    assert load_costs("abc") == fresh


def test_a_cpu_engine_over_a_damaged_file_times_again(setup, home):
    bridge, model, tok = setup
    with HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as engine:
        key = engine.state.route_key(HandoffConfig().with_words(True))
    path = costs_path(key)
    path.parent.mkdir(parents=True)
    path.write_text("[64, 512]")
    with (
        HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as engine,
        pytest.warns(DamagedFileWarning),
    ):
        engine.handoff(SHORT, " and", **GREEDY)
        assert engine.route_costs().lengths == list(CALIBRATION)
    assert (
        load_costs(key).lengths == list(CALIBRATION)
        and len(list(path.parent.glob(path.name + ".bad-*"))) == 1
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA engines time the routes themselves")
def test_a_cuda_engine_times_what_a_request_needs_once_and_keeps_it(home):
    model = tiny_model("qwen2", max_position_embeddings=4096).cuda()
    bridge, tok = random_bridge(model), byte_tokenizer()
    with HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok) as engine:
        first = engine.handoff(SHORT, " and", **GREEDY)
        costs = engine.route_costs()
        assert costs.lengths == [256] and costs.device.startswith(torch.cuda.get_device_name())
        engine.handoff(SHORT + " again", " and", **GREEDY)
        assert engine.route_costs() is costs  # covered: nothing measured again
        engine.handoff(LONG, " and", **GREEDY)  # ~570 tokens: the ladder up to 512
        assert engine.route_costs().lengths == [256, 512]
        native = engine.handoff(LONG, " and", config=HandoffConfig(route="native"), **GREEDY)
        ids = tok(LONG + " and", return_tensors="pt").input_ids.cuda()
        own = model.generate(ids, pad_token_id=0, **GREEDY)[:, ids.shape[1] :]
        assert torch.equal(native.output_ids, own)  # the target's own prefill, on CUDA too
    faster = "handoff" if costs.predict(24)[0] <= costs.predict(24)[1] else "native"
    assert first.cache.report().route == faster
    assert load_costs(costs.key).lengths == [256, 512]
