"""Rope types whose tables depend on the forward's length (longrope, dynamic NTK): a handoff
rotates every target key as the target's own prefill of context + prompt does, and leaves the
user's rotary module as it found it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import noisy_bridge
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Phi3Config

from bridgecache import BridgedCache, HandoffConfig, RefreshConfig, capture_kv
from bridgecache.bridge import Bridge
from bridgecache.compat import cache_kwargs
from bridgecache.runtime.engine import generate

FULL_REFRESH = HandoffConfig(refresh=RefreshConfig(1.0, "deviation"), route="handoff")
PROMPT = 8
TINY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)
TINY |= dict(num_hidden_layers=3, attn_implementation="eager", pad_token_id=0)


def longrope(seed: int = 0):
    """Phi-4-mini's layout (longrope, partial rotary 0.75) switching factors past 64 positions."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0], "short_factor": [1.0] * 6,
            "original_max_position_embeddings": 64}  # fmt: skip
    config = Phi3Config(
        **TINY, max_position_embeddings=512, original_max_position_embeddings=64, rope_parameters=rope
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def dynamic(seed: int = 0):
    """Dynamic NTK: the frequencies rescale for a forward past the 64-position window."""
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}
    config = LlamaConfig(**TINY, head_dim=16, max_position_embeddings=64, rope_parameters=rope)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def refreshed_cache(model, context, prompt, source=None) -> BridgedCache:
    """A full refresh of `source`'s (default: `model`'s) KV of `context` through a wrong bridge."""
    kv = capture_kv(model if source is None else source, context)
    return BridgedCache(noisy_bridge(model), kv, model, context, prompt_ids=prompt, config=FULL_REFRESH)


def identity_cache(model, context, prompt) -> BridgedCache:
    """The default handoff of `model`'s own KV of `context` through an identity bridge."""
    config = HandoffConfig(route="handoff")
    return BridgedCache(
        Bridge.identity(model), capture_kv(model, context), model, context, prompt_ids=prompt, config=config
    )


def inputs(n: int):
    generator = torch.Generator().manual_seed(n)
    context = torch.randint(3, 300, (1, n), generator=generator)
    return context, torch.randint(3, 300, (1, PROMPT), generator=generator)


# (model, context tokens): below the switch, context + prompt across it, the context past it
CASES = [(longrope, 40), (longrope, 60), (longrope, 80), (dynamic, 40), (dynamic, 60)]
CROSSING = [(longrope, 60), (dynamic, 60)]


def ids(case) -> str:
    return f"{case[0].__name__}-{case[1]}"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_a_full_refresh_is_the_targets_own_prefill_of_context_and_prompt(case):
    build, n = case
    model, native = build(), build()
    context, prompt = inputs(n)
    full = torch.cat([context, prompt], 1)
    reference = native(full).logits[0, -1]
    # a forward of the user's own over the cache: the pass runs alone first, then the prompt
    cache = refreshed_cache(model, context, prompt)
    new = full[:, cache.translator.prefix_length :]
    logits = model(new, use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]
    assert (logits - reference).abs().max() < 1e-4
    # the engine's generate(): the pass carries the prompt
    kwargs = dict(
        max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    expected = build().generate(full, **kwargs)
    cache = refreshed_cache(model, context, prompt)
    out = generate(model, cache, full, **kwargs)
    # Phi-3 drops a cache of at most 64 tokens once generate()'s input crosses 64: the handoff's
    # is kept (its keys were moved to the reading forward's tables), not silently recomputed
    assert out.past_key_values is cache
    assert torch.equal(out.sequences, expected.sequences)
    assert (torch.stack(out.logits) - torch.stack(expected.logits)).abs().max() < 1e-4


@pytest.mark.parametrize("case", [c for c in CASES if c not in CROSSING], ids=ids)
def test_an_identity_bridge_is_exact_where_context_and_prompt_stay_on_one_side(case):
    # the source's tables come from the bridge's spec: Phi-3's original_max_position_embeddings kept
    build, n = case
    model = build()
    context, prompt = inputs(n)
    full = torch.cat([context, prompt], 1)
    cache = identity_cache(model, context, prompt)
    logits = model(
        full[:, cache.translator.prefix_length :], use_cache=True, **cache_kwargs(model, cache)
    ).logits
    assert (logits[0, -1] - build()(full).logits[0, -1]).abs().max() < 1e-4


@pytest.mark.parametrize("case", CROSSING, ids=ids)
def test_across_the_switch_the_cached_keys_take_the_tables_of_context_and_prompt(case):
    # an identity bridge carries what the source read of the context alone (deeper layers see
    # other hidden states than a prefill of context + prompt); layer 0's keys depend on each
    # token and its rotary tables only: those of the target's own prefill of context + prompt
    build, n = case
    model = build()
    context, prompt = inputs(n)
    full = torch.cat([context, prompt], 1)
    cache = identity_cache(model, context, prompt)
    model(full[:, cache.translator.prefix_length :], use_cache=True, **cache_kwargs(model, cache))
    native = DynamicCache()
    build()(full, use_cache=True, **cache_kwargs(model, native))
    assert (cache.layers[0].keys - native.layers[0].keys).abs().max() < 1e-5


def rotary_state(model) -> dict:
    rotary = model.model.rotary_emb
    state = {k: v.clone() for k, v in rotary.named_buffers()}
    return state | {k: v for k, v in vars(rotary).items() if isinstance(v, (int, float))}


def test_a_handoff_leaves_the_users_rotary_module_as_it_found_it():
    # longrope rewrites its frequencies in place at every forward: the target's reading of the
    # context (past the switch) and the pass through the model's view must not leave them so
    model = longrope()
    context, prompt = inputs(80)
    before = rotary_state(model)
    cache = refreshed_cache(model, context, prompt, source=longrope())
    assert_same(before, rotary_state(model))
    cache.run_pending()  # the pass alone, through the model's view
    assert_same(before, rotary_state(model))


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[name])), name
