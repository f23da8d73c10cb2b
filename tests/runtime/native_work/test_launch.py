"""The handoff's pass launched before generate() (bridgecache.runtime.native_work.forward.launch).

The engine's generate() replays the pass of generate()'s first forward before transformers'
generate() runs its own host work; that forward takes the launched output and buffers when it
reads the same ids at their own positions, and runs its own pass otherwise. On the CPU an eager
pass over the same buffers stands in for the replay; test_graphs runs the replay on CUDA machines.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from bridgecache import BridgedCache, GivenScores, HandoffConfig, RefreshConfig, capture_kv
from bridgecache.bridge.maps import Bridge
from bridgecache.compat import cache_kwargs
from bridgecache.runtime.native_work import forward, prefill
from bridgecache.runtime.native_work.forward import NativePass, forward_with_pass

pytestmark = pytest.mark.usefixtures("one_thread")


def _caches(model, ids, count: int, **config):
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"  # refreshed like a fitted bridge
    refresh = RefreshConfig(
        6, GivenScores(torch.rand(1, ids.shape[1], generator=torch.Generator().manual_seed(0)))
    )
    config = HandoffConfig(refresh=refresh, route="handoff", **config)
    kv = capture_kv(model, ids)
    return [BridgedCache(bridge, kv, model, ids, config=config) for _ in range(count)]


def _launched(cache, new_ids, room: int):
    """What `launch` leaves on the cache, from an eager pass over the same buffers (the CPU's
    stand-in for the replay)."""
    prefix, m = cache.translator.prefix_length, new_ids.shape[1]
    work = cache.pending_for_batch(1)
    native = NativePass(cache.state.view("target"), 1, work.count + m, prefix + m + 1)
    positions = torch.arange(prefix, prefix + m)[None]
    native.load(cache, work, new_ids, positions)
    return prefill.Launched(new_ids, (native.forward(1, {}), native.held(prefix + m, room)))


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_launched_pass_serves_the_forward_that_reads_its_ids_and_no_other(family, monkeypatch):
    model = tiny_model(family)
    ids = torch.randint(3, 300, (1, 30))
    requested = []
    monkeypatch.setattr(forward, "_graphs", lambda cache, keep, extra: keep == 1)  # as on CUDA
    monkeypatch.setattr(forward, "_pass_graph", lambda *args: requested.append(args) and None)
    own, launched, other = _caches(model, ids, 3)
    prefix = own.translator.prefix_length
    new = ids[:, prefix:]
    expected = forward_with_pass(model, input_ids=new, logits_to_keep=1, **cache_kwargs(model, own))
    assert requested  # the cache's own pass asked for a graph (none: eager)

    requested.clear()
    first = forward.FirstForward(3, _launched(launched, new.clone(), room=3))  # equal ids, another tensor
    out = forward_with_pass(
        model, input_ids=new, logits_to_keep=1, first=first, **cache_kwargs(model, launched)
    )
    assert not requested and first.launched is None and launched.pending_work is None
    assert torch.allclose(out.logits, expected.logits, atol=1e-5)
    for a, b in zip(own.layers, launched.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    full = next(layer for layer in launched.layers if getattr(layer, "sliding_window", None) is None)
    assert full._room[0].shape[2] == prefix + 1 + 3  # room for generate()'s tokens, as the pass leaves

    first = forward.FirstForward(0, _launched(other, new + 1, room=0))  # other ids
    out = forward_with_pass(model, input_ids=new, logits_to_keep=1, first=first, **cache_kwargs(model, other))
    assert requested and first.launched is None  # its own pass ran
    assert torch.allclose(out.logits, expected.logits, atol=1e-5)


def test_a_pass_run_before_the_first_forward_drops_the_launched_one(monkeypatch):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (1, 30))
    monkeypatch.setattr(forward, "_graphs", lambda cache, keep, extra: keep == 1)
    monkeypatch.setattr(forward, "_pass_graph", lambda *args: None)
    (cache,) = _caches(model, ids, 1)
    new = ids[:, cache.translator.prefix_length :]
    first = forward.FirstForward(0, _launched(cache, new, room=0))
    cache.run_pending()  # a read of the cache before generate()'s first forward (crop, materialize)
    assert cache.pending_work is None
    taken = []
    monkeypatch.setattr(forward, "run", lambda *args: taken.append(args))
    out = forward_with_pass(model, input_ids=new, logits_to_keep=1, first=first, **cache_kwargs(model, cache))
    assert first.launched is None and not taken  # the first forward dropped it: a plain forward
    assert out.logits.shape[1] == 1


def test_only_a_plain_generate_is_launched():
    model = tiny_model("qwen2", _attn_implementation="sdpa")
    ids = torch.randint(3, 300, (2, 12))
    plain = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert prefill.plain_generate(model, ids, None, plain)
    assert prefill.plain_generate(model, ids, torch.ones_like(ids), plain | {"output_logits": True})
    padded = torch.ones_like(ids)
    padded[0, :2] = 0
    assert not prefill.plain_generate(model, ids, padded, plain)
    assert not prefill.plain_generate(model, ids, None, plain | {"num_beams": 2})
    assert not prefill.plain_generate(model, ids, None, plain | {"output_hidden_states": True})
