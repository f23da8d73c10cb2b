"""What the held-out architecture probe (benchmarks/architecture_probe.py: transformers' own causal-LM
registry, configs built by one generic shrink, nobody's choice) found, one class of fix each, on the
probe's own tiny models: exact through the identity bridge and a full refresh of a wrong bridge,
with fits both ways (benchmarks/architectures.py's `measure_model`), or refused at entry by name
before any forward.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from tiny_models import script
from transformers import AttentionInterface

from bridgecache.bridge.maps import Bridge
from bridgecache.fitting.attention import QueryRecorder, boundary_rows
from bridgecache.kv.capture import capture_kv
from bridgecache.kv.rope import RopeTables
from bridgecache.models.layout import UnsupportedArchitectureError, rope_layers
from bridgecache.models.spec import config_from_spec, model_spec
from bridgecache.runtime.report import prefill_flops

probe = script("benchmarks/architecture_probe.py")
architectures = script("benchmarks/architectures.py")


def _assert_exact(model):
    row = architectures.measure_model(model, {})
    (identity, same), (refresh, same_refresh) = row["identity"], row["full refresh"]
    assert same and identity < 1e-4, row
    assert same_refresh and refresh < 1e-4, row
    assert row["wrong bridge"][0] > 1e-3  # the wrong bridge is really wrong
    assert row["un-rotation"] < 1e-5, row
    assert probe.shifted_unrotation(model) < 1e-4  # every layer's tables, layout and RoPE flag
    assert all(ran and math.isfinite(score) for score, ran in (row["to qwen2"], row["from qwen2"])), row


@pytest.mark.parametrize(
    "model_type",
    [
        "exaone",  # runs Llama's modeling code: the registry, not the type's name, gives the module
        "aria_text",  # its text model lives in `aria`, beside a vision rotary that is not the keys'
        "ergo",  # rope parameters of None for its full layers; no intermediate_size
        "flint",  # RoPE only on its sliding layers, a rule of its code (the full layer 0 has none)
        "cohere2_moe",  # the same rule (Cohere 2's own family was known by name, its MoE was not)
        "afmoe",  # the same, through an attribute (`if self.is_local_attention`); views the attention
        # function's output, so ours must be contiguous, as transformers' own
        "falcon",  # multi-query queries in a fused query_key_value; a head_dim its config derives
        "minicpm5_moe",  # queries and an output gate in one q_gate_proj
        "modernbert-decoder",  # get_decoder() returns its output projection, not the decoder stack
    ],
)
def test_a_held_out_architecture_is_exact_and_fits_both_ways_with_qwen2(model_type):
    _assert_exact(probe.build(model_type))


def test_the_tables_a_bridge_rebuilds_from_a_spec_are_the_models_own():
    # a bridge re-derives each side's rotary tables from its spec alone: the rotary class of the
    # module that holds the type's causal-LM class (EXAONE -> Llama's), a config the class can
    # take (Falcon's head_dim is a read-only property), and no tables for layers without RoPE
    for model_type in ("exaone", "aria_text", "falcon", "ergo", "flint"):
        model = probe.build(model_type)
        spec = model_spec(model)
        own, rebuilt = RopeTables.from_model(model), RopeTables.from_spec(spec)
        positions = torch.arange(20)
        for layer in range(spec.num_layers):
            for a, b in zip(own.cos_sin(layer, positions), rebuilt.cos_sin(layer, positions)):
                assert torch.allclose(a, b, atol=1e-6), (model_type, layer)
        assert config_from_spec(spec) is not config_from_spec(spec)  # a copy per call: the memo stays


def test_layers_without_rope_are_read_from_the_config_and_from_the_models_code():
    ergo, flint = probe.build("ergo").config, probe.build("flint").config
    assert ergo.rope_parameters["full_attention"] is None
    assert rope_layers(ergo) == tuple(t == "sliding_attention" for t in ergo.layer_types)
    assert rope_layers(flint) == tuple(t == "sliding_attention" for t in flint.layer_types)
    assert not all(rope_layers(flint)) and any(rope_layers(flint))
    tables = RopeTables.from_spec(model_spec(ergo))
    cos, sin = tables.cos_sin(ergo.layer_types.index("full_attention"), torch.arange(5))
    assert torch.equal(cos, torch.ones(1, 5, 16)) and torch.equal(sin, torch.zeros(1, 5, 16))


@pytest.mark.parametrize("model_type", ["falcon", "minicpm5_moe"])
def test_the_fits_queries_from_fused_projections_are_the_ones_the_attention_receives(model_type):
    seen = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = query.detach().float()
        eager = importlib.import_module(type(module).__module__).eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("bridgecache-test-held-out", recording)
    model = probe.build(model_type)
    model.config._attn_implementation = "bridgecache-test-held-out"
    ids = torch.randint(3, 256, (2, 21), generator=torch.Generator().manual_seed(4))
    rows = boundary_rows(21, 6, first=1)
    with QueryRecorder(model, rows) as recorder, torch.no_grad():
        model(input_ids=ids)
    assert sorted(recorder.queries) == sorted(seen) == list(range(model.config.num_hidden_layers))
    for layer, queries in recorder.queries.items():
        own = seen[layer][:, :, rows]
        assert queries.shape == own.shape
        assert (queries - own).abs().max() <= 1e-5 * own.abs().max(), layer


def test_the_route_estimate_takes_a_config_without_intermediate_size():
    config = probe.build("ergo").config
    assert not hasattr(config, "intermediate_size")
    assert prefill_flops(config, 100) > prefill_flops(config, 10) > 0


@pytest.mark.parametrize(
    "model_type, feature",
    [
        ("diffllama", "not one call of transformers' attention function"),  # two softmaxes
        ("gpt_neox_japanese", "not one call of transformers"),  # computes attention itself
        ("jetmoe", "an attention module bridgecache cannot read"),  # queries routed through experts
        ("nanochat", "a rotation bridgecache does not know"),  # rotate_half turning the other way
        ("gptj", "rotary embeddings computed inside its attention"),  # not "no rotary embeddings"
        ("hrm_text", "cannot rebuild from the model's spec"),  # a layer per call of recurrent stacks
        ("gemma4_unified_text", "head_dim that differs by layer"),
    ],
)
def test_refused_by_name_at_entry_before_any_forward(model_type, feature):
    model = probe.build(model_type)
    ran = []
    hook = model.register_forward_pre_hook(lambda *a: ran.append(1))
    for entry in (lambda: model_spec(model), lambda: Bridge.identity(model)):
        with pytest.raises(UnsupportedArchitectureError, match=feature) as caught:
            entry()
        assert "bridgecache supports" in str(caught.value)
    with pytest.raises(UnsupportedArchitectureError, match=feature):
        capture_kv(model, torch.randint(3, 256, (1, 8)))
    hook.remove()
    assert ran == []
