"""A refresh sized per request (`RefreshConfig(mass=...)`): the fewest best-scored tokens holding a
share of the selection scores' mass, between a floor and the amount; checked where the config is
built, reaching every path and the CLI flags, and naming the recipe."""

from __future__ import annotations

import argparse

import pytest
import torch
from tiny_models import byte_tokenizer, random_bridge, tiny_model

from bridgecache import BridgedCache, GivenScores, HandoffConfig, RefreshConfig, capture_kv
from bridgecache.cli.handoff_flags import add_handoff_arguments, handoff_config
from bridgecache.runtime.native_work.pending import mass_budgets

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = tiny_model("qwen2", vocab_size=258)
    return model, random_bridge(model, seed=3), byte_tokenizer()


def test_budgets_hold_the_share_of_the_mass_between_floor_and_cap():
    scores = torch.tensor(
        [
            [8.0, 1.0, 1.0, 0.0, 0.0, 0.0],  # one token holds 80%
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # flat: every token a sixth
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # no mass at all: the floor
            [-5.0, 4.0, float("-inf"), 4.0, 2.0, 0.0],  # negatives count 0
        ]
    )
    eligible = torch.ones_like(scores, dtype=torch.bool)
    assert mass_budgets(scores, eligible, 0.5, [0] * 4, [6] * 4) == [1, 3, 0, 2]  # 4 of 10 is short of half
    assert mass_budgets(scores, eligible, 0.85, [0] * 4, [6] * 4) == [2, 6, 0, 3]
    assert mass_budgets(scores, eligible, 0.85, [2, 0, 1, 0], [6, 4, 6, 2]) == [2, 4, 1, 2]
    # only eligible columns count: without the first column, row 0's mass is two equal tokens
    eligible[0, 0] = False
    assert mass_budgets(scores, eligible, 0.5, [0] * 4, [6] * 4)[0] == 1
    assert mass_budgets(scores, eligible, 0.6, [0] * 4, [6] * 4)[0] == 2


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(mass=0.0), ValueError, r"RefreshConfig.mass=0.0; expected None or a share"),
        (dict(mass=1.0), ValueError, r"RefreshConfig.mass=1.0"),
        (dict(mass=float("nan")), ValueError, r"RefreshConfig.mass=nan"),
        (dict(mass="half"), TypeError, r"RefreshConfig.mass='half'"),
        (dict(mass=True), TypeError, r"RefreshConfig.mass=True"),
        (dict(floor=-1), ValueError, r"RefreshConfig.floor=-1"),
        (dict(floor=1.5), ValueError, r"RefreshConfig.floor=1.5"),
        (dict(floor=None), TypeError, r"RefreshConfig.floor=None"),
    ],
)
def test_bad_sizing_is_refused_where_the_config_is_built(fields, error, message):
    with pytest.raises(error, match=message):
        RefreshConfig(**fields)


def test_the_label_and_the_recipe_name_the_sizing():
    fixed, sized = RefreshConfig(), RefreshConfig(mass=0.5)
    assert fixed.label == "0.2:source+whole-ends"  # unchanged for the fixed default
    assert sized.label == "0.2@mass0.5>=0.02:source+whole-ends"
    assert RefreshConfig(mass=0.5, floor=3).label != sized.label
    assert HandoffConfig(refresh=sized).kv_recipe != HandoffConfig().kv_recipe


def test_the_cli_flags_describe_the_sizing():
    parser = argparse.ArgumentParser()
    add_handoff_arguments(parser)
    assert handoff_config(parser.parse_args([])) == HandoffConfig()  # one set of defaults
    args = parser.parse_args(["--refresh-mass", "0.6", "--refresh-floor", "4", "--refresh", "0.3"])
    assert handoff_config(args) == HandoffConfig(refresh=RefreshConfig(0.3, mass=0.6, floor=4))
    args = parser.parse_args(["--refresh-mass", "0.6", "--refresh-floor", "0.05"])
    assert handoff_config(args).refresh == RefreshConfig(mass=0.6, floor=0.05)
    for flags, message in (
        (["--refresh-mass", "1.5"], "--refresh-mass is 1.5"),
        (["--refresh-floor", "-2"], "--refresh-floor is -2"),
    ):
        with pytest.raises(ValueError, match=message):
            handoff_config(parser.parse_args(flags))


def _cache(models, scores, refresh):
    model, bridge, _ = models
    ids = torch.randint(
        3, 250, (scores.shape[0], scores.shape[1]), generator=torch.Generator().manual_seed(1)
    )
    config = HandoffConfig(refresh=refresh)
    return BridgedCache(bridge, capture_kv(model, ids), model, ids, config=config)


def test_a_peaked_request_refreshes_few_and_a_flat_one_up_to_the_amount(models):
    tokens = 41  # the native head (1) and the held-back last token leave 39 translated columns
    peaked = torch.full((1, tokens), 0.01)
    peaked[0, [10, 20, 30]] = 10.0  # three tokens hold nearly all the mass
    flat = torch.ones(1, tokens)
    rule = lambda s: RefreshConfig(0.5, GivenScores(s), whole_words=False, mass=0.8, floor=2)  # noqa: E731
    few = _cache(models, peaked, rule(peaked))
    assert few.report().tokens_refreshed == 3
    assert set(few.refreshed_columns[0].tolist()) >= {10, 20, 30}
    many = _cache(models, flat, rule(flat))
    assert many.report().tokens_refreshed == round(0.5 * 39)  # the amount caps it
    floored = RefreshConfig(0.5, GivenScores(peaked), whole_words=False, mass=0.1, floor=5)
    assert _cache(models, peaked, floored).report().tokens_refreshed == 5  # the floor
    fixed = RefreshConfig(0.5, GivenScores(peaked), whole_words=False)
    assert _cache(models, peaked, fixed).report().tokens_refreshed == round(0.5 * 39)


def test_each_row_of_a_batch_is_sized_alone(models):
    tokens = 41
    scores = torch.ones(2, tokens)
    scores[0] = 0.01
    scores[0, 7] = 10.0
    refresh = RefreshConfig(0.5, GivenScores(scores), whole_words=False, mass=0.8, floor=1)
    cache = _cache(models, scores, refresh)
    assert cache.report().tokens_refreshed == 1  # the report speaks of the first row
    assert [len(set(row.tolist())) for row in cache.refreshed_columns] == [1, round(0.5 * 39)]
    assert cache.refreshed_columns[0, 0] == 7


def test_every_path_takes_the_sizing(models, tmp_path):
    """handoff, handoff_batch, Conversation.handoff and publish_context size the refresh by the
    mass when the config says so (the config reaches each cache; the recipe names it)."""
    import json

    from tiny_models import CHATML, chat_tokenizer

    from bridgecache import Conversation, handoff, handoff_batch
    from bridgecache.integrations.publish import publish_context

    model, bridge, tok = models
    context = "the ship lost its mast near the rocks and a heron towed it in at dawn"
    sized = HandoffConfig(refresh=RefreshConfig(0.5, "deviation", mass=0.3, floor=1))
    fixed = HandoffConfig(refresh=RefreshConfig(0.5, "deviation"))
    kw = dict(source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=2, do_sample=False)
    caches = {}
    for name, config in (("sized", sized), ("fixed", fixed)):
        chat = chat_tokenizer(CHATML)
        conversation = Conversation.handoff(
            bridge, model, model, [{"role": "user", "content": context}], source_tokenizer=chat,
            target_tokenizer=chat, config=config,
        )  # fmt: skip
        conversation.ask("where?", max_new_tokens=2)
        caches[name] = [
            handoff(bridge, model, model, context, " where?", config=config, **kw).cache,
            handoff_batch(
                bridge, model, model, [context, context[:30]], " where?", config=config, **kw
            ).cache,
            conversation.cache,
        ]
        published = publish_context(
            bridge, context, model, tok, tok, tmp_path / name, page_size=4, model_name="tiny", source=model,
            config=config,
        )  # fmt: skip
        assert json.loads(published.manifest_path.read_text())["recipe"] == config.kv_recipe
    for cache, plain in zip(caches["sized"], caches["fixed"], strict=True):
        assert cache.handoff_config.refresh.mass == 0.3
        assert 1 <= cache.report().tokens_refreshed < plain.report().tokens_refreshed
