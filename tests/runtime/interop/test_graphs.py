"""A captured reading reads bucketed buffers: its scores equal the eager reading's exactly.

The buffers are larger than the context and the prompt (shape buckets); the masks keep the extra
columns and prompt slots out. On the CPU the same buffers run eagerly (`captured=False`); the
capture itself runs on CUDA machines only.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import tiny_model

from bridgecache.kv.capture import capture_kv
from bridgecache.runtime.interop.graphs import ReadingGraph, as_view, bucket
from bridgecache.runtime.selection.reading import attention_scores
from bridgecache.runtime.state import GraphStore


def test_buckets_waste_at_most_an_eighth_past_256_or_a_sixteenth_in_16_steps():
    assert [bucket(n, 16) for n in (1, 16, 17, 100, 256)] == [16, 16, 32, 128, 256]
    assert bucket(3000, 256) == 3072 and bucket(6566, 16) == 6656 and bucket(32785, 256) == 36864
    for n in range(200, 70000, 997):
        assert n <= bucket(n, 16) <= max(256, n * 1.125)
        assert n <= bucket(n, 256, steps=16) <= max(256, n * 1.0625)  # the native prefill's buckets
    assert bucket(4112, 256, steps=16) == 4352 and bucket(4112, 256) == 4608


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("reduce", ["max", "sum"])
@pytest.mark.parametrize("layers", [None, 2])
def test_bucketed_reading_scores_what_the_eager_reading_scores(family, reduce, layers):
    model = tiny_model(family)  # gemma3: sliding layers (window 8) read only the context's end
    ids = torch.randint(3, 300, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # a left-padded row
    kv = capture_kv(model, ids, attention_mask=mask)
    graph = ReadingGraph(
        model, batch=2, queries=16, capacity=64, reduce=reduce, captured=False, layers=layers
    )
    assert len(graph.keys) == (layers or model.config.num_hidden_layers)  # buffers for the layers read
    for _ in range(2):  # a second run over the same buffers: nothing stale leaks in
        prompt = torch.randint(3, 300, (2, int(torch.randint(1, 6, ()))))
        expected = attention_scores(
            model, kv.keys, kv.values, kv.position_ids, kv.padding, prompt, 20, reduce=reduce, layers=layers
        )
        got = graph.run(kv.keys, kv.values, kv.position_ids, kv.padding, prompt, 20)
        assert got.shape == expected.shape == (2, 20)
        assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_a_captured_reading_replays_the_eager_scores_on_cuda():
    model = tiny_model("llama", head_dim=32).cuda()
    ids = torch.randint(3, 300, (1, 40), device="cuda")
    kv = capture_kv(model, ids)
    first = torch.zeros(1, dtype=torch.long, device="cuda")
    store, lock, view = GraphStore(1 << 30), threading.RLock(), as_view(model)
    for layers in (None, None, 1, 1, 1, 2, 2):  # captured on a shape's second request, then replayed
        prompt = torch.randint(3, 300, (1, 5), device="cuda")
        eager = attention_scores(view, kv.keys, kv.values, kv.position_ids, first, prompt, 40, layers=layers)
        replayed = attention_scores(
            view,
            kv.keys,
            kv.values,
            kv.position_ids,
            first,
            prompt,
            40,
            layers=layers,
            graphs=store,
            replay_lock=lock,
        )
        assert torch.allclose(eager, replayed, atol=1e-5)
    assert len(store) == 3  # one graph per layer count


def test_a_graph_past_its_share_of_the_budget_is_never_made():
    store, made = GraphStore(1000), []
    for _ in range(3):  # a shape's second request would capture it: this one never is
        assert store.get("long prefill", lambda: made.append(1), 251) is None
    assert made == [] and len(store) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_a_long_reading_is_captured_past_a_quarter_of_the_budget_on_cuda():
    """A reading's launches bound it at every length: its graph may take the whole budget (any
    other graph only a quarter), and the replay scores what the eager reading scores."""
    from bridgecache.runtime.interop.graphs import reading_bytes

    model = tiny_model("llama", head_dim=32).cuda()
    ids = torch.randint(3, 300, (1, 40), device="cuda")
    kv = capture_kv(model, ids)
    first = torch.zeros(1, dtype=torch.long, device="cuda")
    buffers = reading_bytes(model, 1, bucket(40, 256), None)
    store, lock, view = GraphStore(2 * buffers), threading.RLock(), as_view(model)  # half the budget
    for _ in range(3):
        prompt = torch.randint(3, 300, (1, 5), device="cuda")
        eager = attention_scores(view, kv.keys, kv.values, kv.position_ids, first, prompt, 40)
        replayed = attention_scores(
            view, kv.keys, kv.values, kv.position_ids, first, prompt, 40, graphs=store, replay_lock=lock
        )
        assert torch.allclose(eager, replayed, atol=1e-5)
    assert len(store) == 1
    assert store.get("a prefill as large", lambda: None, buffers) is None  # the default share refuses it


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_bucketed_pass_computes_what_the_exact_pass_computes(family):
    """The shapes a captured pass uses (placeholder slots, a longer buffer) change nothing: the
    last logits and every cached row equal the exact-shape pass's."""
    from bridgecache import BridgedCache, GivenScores, HandoffConfig, RefreshConfig
    from bridgecache.bridge.maps import Bridge
    from bridgecache.compat import cache_kwargs
    from bridgecache.runtime.native_work.forward import NativePass, forward_with_pass

    model = tiny_model(family)
    ids = torch.randint(3, 300, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"  # refreshed like a fitted bridge
    config = HandoffConfig(refresh=RefreshConfig(5, GivenScores(torch.rand(2, 24))))
    kv = capture_kv(model, ids, attention_mask=mask)
    made = [
        BridgedCache(
            bridge, kv, model, ids, config=config, target_attention_mask=mask, source_attention_mask=mask
        )
        for _ in range(2)
    ]
    prefix = made[0].translator.prefix_length
    new = ids[:, prefix:]
    positions = (mask.cumsum(-1) - 1)[:, prefix:]
    exact = forward_with_pass(  # the exact-shape pass, as generate()'s first forward runs it
        model, input_ids=new, position_ids=positions, logits_to_keep=1, **cache_kwargs(model, made[0])
    ).logits
    work = made[1].pending_for_batch(2)
    native = NativePass(made[1].state.view("target"), 2, bucket(work.count + 1), bucket(prefix + 2, 256))
    native.load(made[1], work, new, positions)
    bucketed = native.forward(1, {}).logits
    native.commit(made[1], 1, copy=True)
    assert torch.allclose(bucketed, exact, atol=1e-5)
    for a, b in zip(made[0].layers, made[1].layers):
        assert a.keys.shape == b.keys.shape
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_a_captured_pass_generates_what_the_eager_pass_generates_on_cuda():
    """The engine's generate() launches the captured pass before transformers' generate()
    (native_work.forward.launch) and its first forward takes it."""
    from bridgecache import HandoffEngine
    from bridgecache.bridge.maps import Bridge
    from bridgecache.runtime.interop.graphs import PassGraph

    model = tiny_model("llama", head_dim=32).cuda()
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"
    engine = HandoffEngine(bridge, model, model)
    calls = []
    launch, run = PassGraph.launch, PassGraph.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PassGraph, "launch", lambda *a, **k: calls.append("launch") or launch(*a, **k))
        patch.setattr(PassGraph, "run", lambda *a, **k: calls.append("run") or run(*a, **k))
        for _ in range(3):  # new contexts through the same captured graph
            outputs = _eager_and_captured(model, bridge, engine)
            assert torch.equal(outputs[0], outputs[1])
    assert calls == ["launch", "launch"]  # the captured pass ran once per request, before generate()
    assert len(engine.state.graphs) == 1  # one pass graph (captured on its second request), replayed
    engine.close()
    assert len(engine.state.graphs) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
def test_a_pass_of_few_slots_is_captured_past_a_quarter_of_the_budget_on_cuda():
    """A pass of a few query slots is bound by its launches at any length: its graph may take the
    whole budget, and it generates what the eager pass generates."""
    from bridgecache import BridgedCache, GivenScores, HandoffConfig, HandoffEngine, RefreshConfig
    from bridgecache.bridge.maps import Bridge
    from bridgecache.runtime.engine import generate
    from bridgecache.runtime.native_work.forward import pass_bytes

    model = tiny_model("llama", head_dim=32).cuda()
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"
    buffers = pass_bytes(model, 1, bucket(40 + 2, 256))
    engine = HandoffEngine(bridge, model, model, graph_bytes=2 * buffers)  # half the budget
    config = HandoffConfig(refresh=RefreshConfig(8, GivenScores(torch.rand(1, 40))), route="handoff")
    for _ in range(3):
        ids = torch.randint(3, 300, (1, 40), device="cuda")
        kv = capture_kv(model, ids)
        outputs = []
        for graphs in (False, True):
            cache = BridgedCache(
                bridge, kv, model, ids, config=config.replace(cuda_graphs=graphs), engine=engine
            )
            outputs.append(generate(model, cache, ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
        assert torch.equal(outputs[0], outputs[1])
    assert len(engine.state.graphs) == 1
    engine.close()


# What a captured pass must carry besides a plain causal mask: windows (and GPT-OSS's sinks),
# Llama 4's chunks, partial rotary. gpu_families.py's GPT-OSS-20B row at 4K (bf16, 2026-12-07)
# replayed 0.369 (relative L2) from its eager warm-up: this asks the same in float32.
_CAPTURED_FAMILIES = [
    "gpt_oss (sinks)",
    "llama4_text (chunked, RoPE, qk-norm)",
    "cohere2",
    "gemma2 (soft-capping)",
    "phi4-mini (partial rotary)",
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graph capture)")
@pytest.mark.parametrize("name", _CAPTURED_FAMILIES)
def test_a_captured_pass_of_each_attention_kind_gives_the_eager_logits_on_cuda(name):
    """Past the window (40 tokens, windows and chunks of 8), the same refreshed tokens: the pass
    replayed from its graph gives the eager pass's first-token logits and tokens (float32)."""
    from tiny_models import tiny_architecture

    from bridgecache import HandoffEngine
    from bridgecache.bridge.maps import Bridge

    model = tiny_architecture(name).cuda()
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"  # refreshed like a fitted bridge
    engine = HandoffEngine(bridge, model, model)
    for _ in range(3):  # the graph is captured on a shape's second request, then replayed
        runs = _eager_and_captured(model, bridge, engine, output_logits=True, return_dict_in_generate=True)
        eager, replayed = (run.logits[0].double() for run in runs)
        assert (replayed - eager).norm() <= 1e-4 * eager.norm(), name
        assert torch.equal(runs[0].sequences, runs[1].sequences), name
    assert len(engine.state.graphs) >= 1, name  # a pass graph was captured and replayed
    engine.close()


def _eager_and_captured(model, bridge, engine, **generate_kwargs):
    """A new 40-token context and 5-token prompt on CUDA, 8 refreshed tokens given: generate()'s
    output through the eager pass, then through the captured one (`cuda_graphs`), same engine.
    route="handoff": the cost gate's timing would capture a graph of its own (at its length)."""
    from bridgecache import BridgedCache, GivenScores, HandoffConfig, RefreshConfig
    from bridgecache.runtime.engine import generate

    ids = torch.randint(3, 300, (1, 40), device="cuda")
    prompt = torch.cat([ids, torch.randint(3, 300, (1, 5), device="cuda")], 1)
    kv = capture_kv(model, ids)
    config = HandoffConfig(refresh=RefreshConfig(8, GivenScores(torch.rand(1, 40))), route="handoff")
    outputs = []
    for graphs in (False, True):
        cache = BridgedCache(bridge, kv, model, ids, config=config.replace(cuda_graphs=graphs), engine=engine)
        outputs.append(
            generate(
                model, cache, prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, **generate_kwargs
            )
        )
    return outputs
