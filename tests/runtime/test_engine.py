"""The handoff engine: the user's objects untouched on every path, state owned and freed, threads.

Tiny random models and a byte tokenizer (no download); the same checks on the real SmolLM2 ->
Qwen pair run in benchmarks/engine_soak.py (reported in benchmarks/reports/engine-soak.md).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache import (
    BridgedCache,
    Conversation,
    HandoffEngine,
    capture_kv,
    clear_engines,
    handoff,
    handoff_batch,
)
from bridgecache.bridge.maps import Bridge
from bridgecache.integrations.publish import publish_context
from bridgecache.runtime.engine import _ENGINES, engine_for

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXTS = [
    "the ship came in at dawn with salt and rope",
    "a short one",
    "numbers 1234 and 5678 sit in this longer context of words",
]


def _setup():
    """(bridge, model, tokenizer): an identity bridge marked fitted, so that the default refresh
    runs (the source reads the prompt through our attention, the pass runs through a view)."""
    model = tiny_model("qwen2", max_position_embeddings=4096)
    bridge = Bridge.identity(model)
    bridge.method = "fullhead"
    return bridge, model, byte_tokenizer()


def snapshot(model) -> dict:
    """Everything a library call could leave changed on a model: its own and every module's
    instance attributes (forward wrappers, hooks, the config's attention implementation), the
    decoder's layer list, each parameter's identity and version."""
    modules = {}
    for name, module in model.named_modules():
        state = {}
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules") or isinstance(value, dict):
                state[key] = tuple((k, id(v)) for k, v in value.items())
            elif isinstance(value, torch.Tensor):
                state[key] = (id(value), value._version)
            else:
                state[key] = id(value)
        modules[name] = state
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    return {
        "modules": modules,
        "configs": {k: (c.to_json_string(), c._attn_implementation_internal) for k, c in configs.items()},
        "layers": tuple(id(layer) for layer in model.model.layers),
        "parameters": tuple((n, id(p), p._version) for n, p in model.named_parameters()),
    }


def test_every_path_leaves_the_models_as_they_were(tmp_path):
    bridge, model, tok = _setup()
    before = snapshot(model)
    kw = dict(source_tokenizer=tok, target_tokenizer=tok)
    handoff(bridge, model, model, CONTEXTS[0], " and", max_new_tokens=3, do_sample=False, **kw)
    handoff_batch(bridge, model, model, CONTEXTS, " and", max_new_tokens=3, do_sample=False, **kw)
    chat = Conversation.handoff(bridge, model, model, [{"role": "user", "content": CONTEXTS[0]}], **kw)
    chat.ask("and then?", max_new_tokens=3)
    publish_context(
        bridge, CONTEXTS[2], model, tok, tok, tmp_path / "pages", page_size=4, source=model, model_name="tiny"
    )
    with HandoffEngine(bridge, model, model, **kw) as engine:
        engine.handoff(CONTEXTS[1], " so", max_new_tokens=2, do_sample=False)
    ids = tok(CONTEXTS[2], return_tensors="pt").input_ids
    cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, source_model=model)
    model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, past_key_values=cache)
    clear_engines()
    assert snapshot(model) == before
    assert "forward" not in vars(model)


def test_concurrent_handoffs_equal_the_sequential_run_and_leave_a_plain_generate_alone():
    bridge, model, tok = _setup()
    engine = HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok)
    prompts = [f" and {i}" for i in range(100)]  # 2 threads x 50 handoffs (issue 36's goal)
    jobs = [(CONTEXTS[i % 3] * (1 + i % 4), prompts[i]) for i in range(100)]
    run = lambda job: engine.handoff(*job, max_new_tokens=4, do_sample=False).output_ids  # noqa: E731
    plain_ids = tok(CONTEXTS[2] * 3, return_tensors="pt").input_ids
    plain = lambda: model.generate(plain_ids, max_new_tokens=6, do_sample=False, pad_token_id=0)  # noqa: E731
    sequential = [run(job) for job in jobs]
    alone = plain()
    results: dict = {}
    plains: list = []

    def worker(offset: int) -> None:
        for i in range(offset, len(jobs), 2):
            results[i] = run(jobs[i])

    def generator() -> None:
        for _ in range(10):
            plains.append(plain())

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)] + [
        threading.Thread(target=generator)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(results[i], sequential[i]) for i in range(len(jobs)))
    assert len(plains) == 10 and all(torch.equal(p, alone) for p in plains)


def test_close_frees_what_the_engine_made_and_refuses_new_requests():
    bridge, model, tok = _setup()
    engine = HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok)
    result = engine.handoff(CONTEXTS[2], " and", max_new_tokens=2, do_sample=False)
    state = engine.state
    assert state._plans and state._views  # plans per layer, views of the models
    engine.close()
    assert not state._plans and not state._views and len(state.graphs) == 0
    with pytest.raises(RuntimeError, match="this handoff engine is closed"):
        engine.handoff(CONTEXTS[0], " and", max_new_tokens=2)
    assert result.cache.get_seq_length() > 0  # what it built stays usable


def test_the_module_level_calls_share_a_bounded_set_of_engines():
    bridge, model, tok = _setup()
    clear_engines()
    kw = dict(source_tokenizer=tok, target_tokenizer=tok, max_new_tokens=2, do_sample=False)
    handoff(bridge, model, model, CONTEXTS[0], " and", **kw)
    handoff(bridge, model, model, CONTEXTS[1], " and", **kw)
    assert len(_ENGINES) == 1
    first = engine_for(bridge, model, model, tok, tok)
    for _ in range(3):  # other setups push it out: at most 2 kept
        engine_for(Bridge.identity(model), model, model, tok, tok)
    assert len(_ENGINES) == 2 and first not in _ENGINES.values()
    clear_engines()
    assert not _ENGINES


def test_an_engine_refuses_weights_changed_after_it_was_built():
    bridge, model, tok = _setup()
    engine = HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok)
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(0.0)  # an in-place write: a new version
    with pytest.raises(RuntimeError, match="weights changed after this handoff engine was built"):
        engine.handoff(CONTEXTS[0], " and", max_new_tokens=2)


def test_a_request_longer_than_the_window_is_refused_before_the_source_reads():
    bridge, model, tok = _setup()
    engine = HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok)
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match="reads at most 4096"):
            engine.handoff("x" * 5000, " and", max_new_tokens=2)
    finally:
        hook.remove()
    assert not calls


def test_cpu_memory_stays_flat_over_repeated_handoffs_of_many_lengths():
    """RSS after 3 rounds over 15 lengths within 5% of RSS after the first round (CI's short form
    of benchmarks/engine_soak.py's 300 handoffs over 30 lengths)."""
    bridge, model, tok = _setup()
    engine = HandoffEngine(bridge, model, model, source_tokenizer=tok, target_tokenizer=tok)
    contexts = [("word " * (8 + 13 * k))[: 40 + 37 * k] for k in range(15)]
    marks = []
    for _ in range(3):
        for context in contexts:
            engine.handoff(context, " and", max_new_tokens=2, do_sample=False)
        gc.collect()
        marks.append(_rss())
    assert marks[-1] <= marks[0] * 1.05, [m / 2**20 for m in marks]


def _rss() -> int:
    """Resident bytes of this process now (Linux: /proc/self/statm)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
