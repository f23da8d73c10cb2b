"""One HandoffConfig, every path: BridgedCache, handoff, handoff_batch, Conversation.handoff,
publish_context, the evaluation runner and the CLI flags all take the same object and it reaches
the cache they build (whole_words decided: True on the paths that know the text); a
handoff_batch row is the handoff() of its context under the default refresh, through a bridge
that is not the identity (so the refresh's choice matters); and the default whole_words=None
refreshes as True wherever the text is known and as False from ids alone."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import CHATML, byte_tokenizer, chat_tokenizer, tiny_model
from tiny_models import random_bridge as _random_bridge

from bridgecache import BridgedCache, HandoffConfig, RefreshConfig, capture_kv, handoff, handoff_batch
from bridgecache.integrations.keys import bridge_salt
from bridgecache.runtime.entry.conversation import Conversation

# Not the defaults in any field a path could drop silently: a tail, no key norm, 3 tokens by deviation.
CONFIG = HandoffConfig(native_tail=2, key_norm=False, refresh=RefreshConfig(amount=3, by="deviation"))
CONTEXTS = [
    "the ship lost its mast near the rocks",
    "a heron towed the ship in",
    "the rocks at dawn were grey",
]
PROMPT = " where?"
GEN = dict(max_new_tokens=3, do_sample=False)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = tiny_model("qwen2", vocab_size=258)
    return model, _random_bridge(model, seed=3), byte_tokenizer()


def _check(cache, rows: int = 1, words: bool = True, config: HandoffConfig = CONFIG):
    assert cache.handoff_config == config.with_words(words)  # the default whole_words, decided
    assert tuple(cache.refreshed_columns.shape) == (rows, 3)
    assert cache.report().tokens_refreshed == 3 and cache.report().refresh_by == "key deviation"


def test_every_path_takes_the_config_and_it_reaches_the_cache(models, tmp_path, monkeypatch):
    model, bridge, tok = models
    ids = tok(CONTEXTS[0], return_tensors="pt").input_ids

    _check(BridgedCache(bridge, capture_kv(model, ids), model, ids, config=CONFIG), words=False)
    caches, published = _every_path(models, CONFIG, tmp_path)
    for cache in caches:
        _check(cache, rows=cache.translator.batch_size)
    assert json.loads(published.manifest_path.read_text())["recipe"] == CONFIG.kv_recipe
    assert published.cache_salt == bridge_salt(bridge, config=CONFIG) != bridge_salt(bridge)

    import bridgecache.evaluation.scoring as scoring
    from bridgecache.evaluation import PplItem, Variant, evaluate

    built, original = [], scoring.HandoffEngine.cache

    def recording(engine, request, config=None):  # the evaluation builds its caches through engines
        built.append(original(engine, request, config))
        return built[-1]

    monkeypatch.setattr(scoring.HandoffEngine, "cache", recording)
    items = [PplItem(CONTEXTS[0], " the heron"), PplItem(CONTEXTS[2], " was grey")]
    evaluate(model, tok, model, tok, items, "ppl", [Variant(bridge, CONFIG)], progress=False)
    assert built
    for cache in built:  # the evaluation scores the bridge: route "auto" runs the handoff there
        _check(cache, config=CONFIG.replace(route="handoff"))


def _every_path(models, config, tmp_path):
    """([the caches handoff, handoff_batch and Conversation.handoff build with `config`], what
    publish_context published with it)."""
    from bridgecache.integrations.publish import publish_context

    model, bridge, tok = models
    tokenizers = dict(source_tokenizer=tok, target_tokenizer=tok)
    caches = [handoff(bridge, model, model, CONTEXTS[0], PROMPT, **tokenizers, config=config, **GEN).cache]
    caches.append(
        handoff_batch(bridge, model, model, CONTEXTS, PROMPT, **tokenizers, config=config, **GEN).cache
    )
    chat = chat_tokenizer(CHATML)
    messages = [{"role": "user", "content": CONTEXTS[0]}, {"role": "assistant", "content": "ok"}]
    conversation = Conversation.handoff(
        bridge, model, model, messages, source_tokenizer=chat, target_tokenizer=chat, config=config
    )
    conversation.ask("where?", **GEN)
    caches.append(conversation.cache)
    published = publish_context(
        bridge, CONTEXTS[0], model, tok, tok, tmp_path, page_size=4, model_name="tiny", source=model,
        config=config,
    )  # fmt: skip
    return caches, published


def test_the_cli_flags_describe_the_same_config():
    import argparse

    from bridgecache.cli.handoff_flags import add_handoff_arguments, handoff_config

    parser = argparse.ArgumentParser()
    add_handoff_arguments(parser)
    flags = ["--native-tail", "2", "--no-key-norm", "--refresh", "3", "--refresh-by", "deviation"]
    assert handoff_config(parser.parse_args(flags)) == CONFIG
    assert handoff_config(parser.parse_args([])) == HandoffConfig()  # one set of defaults
    for flag, whole_words in (("--whole-words", True), ("--no-whole-words", False)):
        refresh = RefreshConfig(3, "deviation", whole_words)
        assert handoff_config(parser.parse_args([*flags, flag])) == CONFIG.replace(refresh=refresh)
    for flag, ends in (("--word-ends", True), ("--no-word-ends", False)):
        refresh = RefreshConfig(3, "deviation", word_ends=ends)
        assert handoff_config(parser.parse_args([*flags, flag])) == CONFIG.replace(refresh=refresh)


def test_a_batch_row_is_the_handoff_of_its_context_with_the_default_refresh(models):
    """Default config: 20% chosen by the source's attention from the prompt, per row."""
    model, bridge, tok = models
    tokenizers = dict(source_tokenizer=tok, target_tokenizer=tok)
    gen = dict(GEN, output_logits=True, return_dict_in_generate=True)
    batch = handoff_batch(bridge, model, model, CONTEXTS, PROMPT, **tokenizers, **gen)
    assert batch.cache.handoff_config == HandoffConfig(refresh=RefreshConfig(whole_words=True))
    assert batch.cache.report().tokens_refreshed > 0
    for b, context in enumerate(CONTEXTS):
        single = handoff(bridge, model, model, context, PROMPT, **tokenizers, **gen)
        padding = batch.cache.translator.prefix_length - single.cache.translator.prefix_length
        chosen = batch.cache.refreshed_columns[b] - padding  # columns of the left-padded row
        assert torch.equal(
            chosen[: single.cache.refreshed_columns.shape[1]], single.cache.refreshed_columns[0]
        )
        assert torch.equal(batch.output_ids[b], single.output_ids[0]), context


def test_whole_words_reach_every_path_and_name_the_recipe(models, tmp_path, monkeypatch):
    """RefreshConfig(whole_words=True) travels like the other refresh fields: each path computes
    the context's words and the plan pools the scores over them (the target's word of each
    column); the recipe and salt name it, and the defaults keep it off."""
    import bridgecache.runtime.native_work.plan as plan

    model, bridge, tok = models
    words = HandoffConfig(refresh=RefreshConfig(amount=3, by="deviation", whole_words=True))
    tokens = HandoffConfig(refresh=RefreshConfig(amount=3, by="deviation", whole_words=False))
    assert words.kv_recipe != tokens.kv_recipe
    assert bridge_salt(bridge, config=words) != bridge_salt(bridge, config=tokens)
    pooled = []
    rank = plan.word_ranking
    monkeypatch.setattr(plan, "word_ranking", lambda s, g, **kw: pooled.append(g.clone()) or rank(s, g, **kw))
    caches, published = _every_path(models, words, tmp_path)
    assert json.loads(published.manifest_path.read_text())["recipe"] == words.kv_recipe
    assert len(pooled) == len(caches) + 1  # each path's plan pooled over its words, publishing's too
    for cache, groups in zip(caches, pooled, strict=False):  # groups: [rows, prefix] the target's words
        assert cache.handoff_config == words
        assert groups.shape == (cache.translator.batch_size, cache.translator.prefix_length)
        for b, chosen in enumerate(cache.refreshed_columns):  # words whole but for the budget's last
            cut = {
                g
                for g in groups[b, chosen].tolist()
                if not set(chosen.tolist()) >= set(_columns(groups[b], g))
            }
            assert len(cut) <= 1

    import argparse

    from bridgecache.cli.handoff_flags import add_handoff_arguments, handoff_config

    parser = argparse.ArgumentParser()
    add_handoff_arguments(parser)
    flags = ["--refresh", "3", "--refresh-by", "deviation", "--whole-words"]
    assert handoff_config(parser.parse_args(flags)) == words


def _columns(groups: torch.Tensor, word: int) -> list[int]:
    return (groups == word).nonzero()[:, 0].tolist()


def test_the_default_takes_whole_words_wherever_the_text_is_known(models, tmp_path):
    """whole_words=None (the default): handoff, every handoff_batch row, Conversation.handoff and
    publish_context refresh the columns whole_words=True refreshes (which False does not), under
    True's recipe; a BridgedCache from ids alone refreshes as False and records False, and what
    it publishes says so. Labels tell the three apart."""
    from bridgecache.integrations.publish import publish

    model, bridge, tok = models
    auto = HandoffConfig(refresh=RefreshConfig(amount=3, by="deviation"))
    words = HandoffConfig(refresh=RefreshConfig(amount=3, by="deviation", whole_words=True))
    tokens = HandoffConfig(refresh=RefreshConfig(amount=3, by="deviation", whole_words=False))
    assert auto.wants_words and words.wants_words and not tokens.wants_words
    assert not HandoffConfig(refresh=None).wants_words and HandoffConfig().wants_words
    columns, recipes = {}, {}
    for name, config in (("auto", auto), ("words", words), ("tokens", tokens)):
        caches, published = _every_path(models, config, tmp_path / name)
        assert [c.handoff_config for c in caches] == [config.with_words(True)] * len(caches)
        columns[name] = [cache.refreshed_columns for cache in caches]
        recipes[name] = json.loads(published.manifest_path.read_text())["recipe"]
    assert all(torch.equal(a, w) for a, w in zip(columns["auto"], columns["words"], strict=True))
    assert not all(torch.equal(w, t) for w, t in zip(columns["words"], columns["tokens"], strict=True))
    assert recipes == {"auto": words.kv_recipe, "words": words.kv_recipe, "tokens": tokens.kv_recipe}
    assert auto.kv_recipe == words.kv_recipe != tokens.kv_recipe
    assert bridge_salt(bridge) == bridge_salt(
        bridge, config=HandoffConfig(refresh=RefreshConfig(whole_words=True))
    )

    ids = tok(CONTEXTS[0], return_tensors="pt").input_ids
    kv = capture_kv(model, ids)
    alone = BridgedCache(bridge, kv, model, ids, config=auto)
    assert alone.handoff_config == tokens
    assert torch.equal(
        alone.refreshed_columns, BridgedCache(bridge, kv, model, ids, config=tokens).refreshed_columns
    )
    written = publish(alone, ids, tmp_path / "alone", page_size=4, model_name="tiny")
    assert json.loads(written.manifest_path.read_text())["recipe"] == tokens.kv_recipe
    assert written.cache_salt == bridge_salt(bridge, config=tokens) != bridge_salt(bridge, config=auto)

    assert [c.refresh.label for c in (auto, words, tokens)] == [
        "3:deviation+whole-ends",
        "3:deviation:words+whole-ends",
        "3:deviation:no-words",
    ]
    assert HandoffConfig().label == "default" and tokens.replace(
        refresh=RefreshConfig(whole_words=False)
    ).label == ("refresh=0.2:source:no-words")
