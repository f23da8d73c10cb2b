"""Is this still the right model (bridgecache.runtime.identity): one full check when an engine is
built, one cheap check per request, and one definition of "the weights changed"
(bridgecache.models.fingerprint.weights_version). Tiny models, byte tokenizer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import HandoffEngine, capture_kv
from bridgecache.bridge.maps import Bridge
from bridgecache.kv import capture
from bridgecache.models.fingerprint import weight_fingerprint, weights_version
from bridgecache.runtime.identity import ModelIdentity

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(model):
    tok = byte_tokenizer()
    return HandoffEngine(Bridge.identity(model), model, model, source_tokenizer=tok, target_tokenizer=tok)


def test_weights_version_moves_on_every_kind_of_change_and_on_nothing_else():
    weight = torch.nn.Parameter(torch.ones(4))
    before = weights_version([weight, None])
    _ = weight.sum(), weight.clone()  # reads change nothing
    assert weights_version([weight, None]) == before
    with torch.no_grad():
        weight.add_(0.0)  # written in place
    assert weights_version([weight, None]) != before
    written = weights_version([weight])
    weight.data = torch.ones(4)  # new storage, no version bump
    assert weights_version([weight]) != written
    assert weights_version([torch.nn.Parameter(torch.ones(4))]) != weights_version([weight])  # replaced


def test_an_engine_refuses_a_request_after_a_key_norm_weight_was_edited():
    model = tiny_model("gemma3", max_position_embeddings=4096)
    with _engine(model) as engine:
        engine.handoff("the ship came in at dawn", " and", max_new_tokens=2, do_sample=False)
        with torch.no_grad():
            model.model.layers[2].self_attn.k_norm.weight.add_(1.0)
        with pytest.raises(RuntimeError, match="weights changed after this handoff engine was built"):
            engine.handoff("the ship came in at dawn", " and", max_new_tokens=2, do_sample=False)


def test_the_engine_fingerprints_its_source_once_not_per_request(monkeypatch):
    model = tiny_model("qwen2", max_position_embeddings=4096)
    with _engine(model) as engine:
        taken = []
        monkeypatch.setattr(capture, "weight_fingerprint", lambda m: taken.append(m) or weight_fingerprint(m))
        for text in ("the ship came in at dawn", "a short one", "numbers 1234 and 5678"):
            request = engine.request([text], " and")
            assert request.source_kv.fingerprint == weight_fingerprint(model)
        assert not taken  # the engine's, taken when it was built
        assert engine.identity.source_fingerprint == weight_fingerprint(model)
        ids = torch.randint(3, 300, (1, 8))
        assert capture_kv(model, ids).fingerprint == weight_fingerprint(model) and taken  # alone: taken here


def test_the_identity_check_is_cheap_and_watches_embeddings_and_key_norms():
    model = tiny_model("gemma3")
    identity = ModelIdentity(Bridge.identity(model), model, model)
    identity.check()  # unchanged: no error
    layers = model.config.num_hidden_layers
    assert len(identity.watched()) == 2 + layers  # both embeddings, one key norm per layer: no walk
    norm = model.model.layers[1].self_attn.k_norm
    norm.weight = torch.nn.Parameter(norm.weight.clone())  # replaced, same values
    with pytest.raises(RuntimeError, match="weights changed"):
        identity.check()
    identity = ModelIdentity(Bridge.identity(model), model, model)
    model.model.embed_tokens.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
    with pytest.raises(RuntimeError, match="weights changed"):
        identity.check()
