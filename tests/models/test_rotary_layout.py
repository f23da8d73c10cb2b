"""The rotary layout as a value: read from each family's own rotary code, carried by ModelSpec and
the bridge file (old files: the half-split over the whole head), and the tables and rotation of
bridgecache.kv.rope reproduce each model's own apply_rotary_pos_emb."""

from __future__ import annotations

import importlib

import pytest
import torch
from tiny_models import tiny_architecture, tiny_model

from bridgecache.bridge.maps import Bridge
from bridgecache.kv.rope import RopeTables, rotate, unrotate
from bridgecache.models.layout import RotaryLayout, rotary_layout, rotary_module
from bridgecache.models.spec import ModelSpec, model_spec, spec_from_untrusted

# tiny configs of tests/tiny_models.py: head_dim 16
LAYOUTS = {
    "phi4-mini (partial rotary)": RotaryLayout("half", 12),
    "gpt_neox": RotaryLayout("half", 4),
    "helium": RotaryLayout("interleaved", 16),
    "cohere": RotaryLayout("interleaved", 16),
    "cohere2": RotaryLayout("interleaved", 16),
    "glm4 (interleaved, partial 0.5)": RotaryLayout("interleaved", 8),
    "phi (partial 0.5)": RotaryLayout("half", 8),
    "persimmon (partial 0.5, qk-norm)": RotaryLayout("half", 8),
    "qwen2": RotaryLayout("half", 16),
    "gpt_oss (sinks)": RotaryLayout("half", 16),  # its tables hold each frequency once
    "llama4_text (chunked, RoPE, qk-norm)": RotaryLayout("interleaved", 16),  # one complex table
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_layout_is_read_from_the_models_own_code(name):
    model = tiny_architecture(name)
    assert rotary_layout(model) == rotary_layout(model.config) == LAYOUTS[name]
    assert model_spec(model).rotary == LAYOUTS[name]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rotation_reproduces_the_models_own_apply_rotary_pos_emb(name):
    model = tiny_architecture(name)
    modeling = importlib.import_module(type(model).__module__)
    positions = torch.arange(3, 12)[None]
    probe = torch.zeros(1)
    own = rotary_module(model)(probe, positions)  # what the model hands its attention
    q = torch.randn(1, 2, 9, 16, generator=torch.Generator().manual_seed(0))
    if isinstance(own, torch.Tensor):  # Llama 4's freqs_cis, applied to [batch, tokens, heads, dim]
        want = modeling.apply_rotary_emb(q.transpose(1, 2), q.transpose(1, 2), own)[0].transpose(1, 2)
    else:
        try:
            want, _ = modeling.apply_rotary_pos_emb(q, q, *own)
        except RuntimeError:  # Phi's, Persimmon's: their attention splits off the rotated channels
            r = own[0].shape[-1]
            rotated, _ = modeling.apply_rotary_pos_emb(q[..., :r], q[..., :r], *own)
            want = torch.cat((rotated, q[..., r:]), -1)
    tables = RopeTables.from_model(model)
    cos, sin = tables.cos_sin(0, positions)
    assert cos.shape == (1, 9, 16)
    got = rotate(q, cos, sin, tables.layout)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    assert torch.allclose(unrotate(got, cos, sin, tables.layout), q, atol=1e-5)
    # the tables a bridge re-derives from the spec alone rotate alike
    again = RopeTables.from_spec(model_spec(model))
    assert again.layout == tables.layout
    assert torch.allclose(rotate(q, *again.cos_sin(0, positions), again.layout), want, atol=1e-6)
    if tables.layout != RotaryLayout("half", 16):  # Llama's layout would give the wrong keys
        assert not torch.allclose(rotate(q, cos, sin), want, atol=1e-3)


def test_the_bridge_file_keeps_the_layout_and_old_files_mean_the_half_split(tmp_path):
    model = tiny_architecture("glm4 (interleaved, partial 0.5)")
    loaded = Bridge.from_pretrained(Bridge.identity(model).save_pretrained(tmp_path / "bridge"))
    assert loaded.target.rotary == RotaryLayout("interleaved", 8) and loaded.target == model_spec(model)
    old = model_spec(tiny_model("qwen2")).to_dict()
    assert old["rotary"] == {"kind": "half", "rotary_dim": old["head_dim"]}
    del old["rotary"]  # a file written before the field
    assert ModelSpec.from_dict(old).rotary == RotaryLayout("half", old["head_dim"])
    assert spec_from_untrusted(old).rotary == RotaryLayout("half", old["head_dim"])
    wide = 2 * old["head_dim"]
    for bad in (
        {"kind": "spiral", "rotary_dim": 8}, {"kind": "half", "rotary_dim": 7}, {"kind": "half"},
        {"kind": "half", "rotary_dim": wide}, [8], {"kind": "half", "rotary_dim": True},
    ):  # fmt: skip
        with pytest.raises(ValueError, match="rotary"):
            spec_from_untrusted(old | {"rotary": bad})


def test_a_bridge_for_one_layout_refuses_a_model_of_another():
    half = model_spec(tiny_architecture("qwen2"))
    turned = ModelSpec.from_dict(half.to_dict() | {"rotary": {"kind": "interleaved", "rotary_dim": 16}})
    assert any(d.startswith("rotary:") for d in half.mismatches(turned))
