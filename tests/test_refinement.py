"""The optional trained refinement (bridgecache.refinement, bridgecache.fitting.refine): exact at
zero, lowers the held-out attention loss when trained, survives save/load, corrupted files are
refused, and every translation path applies it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from bridgecache.kernels import map_heads
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model

from bridgecache import Bridge, BridgedCache, capture_kv
from bridgecache.bridge import BridgeFormatError, LayerMap
from bridgecache.bridge import tensors_path as bridge_tensors_path
from bridgecache.fitting.heldout import attention_cosine
from bridgecache.fitting.refine import refine_bridge, strip_refinement, train_refinement
from bridgecache.integrations.pages import bridge_fingerprint
from bridgecache.refinement import LayerRefinement, gather_inputs, refinement_shapes


def _poor_bridge(model, *, full_head: bool, scale: float = 0.5, seed: int = 0) -> Bridge:
    """A deliberately imperfect bridge of `model` onto itself: noisy identity maps, each target head
    reading its own source head (head-local) or every source head of its layer (full-head)."""
    bridge = Bridge.identity(model)
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for i, layer in enumerate(bridge.layers):
        heads, dim = layer.key_bias.shape
        if full_head:
            inputs = torch.stack([torch.full((heads,), i), torch.arange(heads)], -1).expand(heads, heads, 2)
            eye = torch.zeros(heads, heads * dim, dim)
            for h in range(heads):
                eye[h, h * dim : (h + 1) * dim] = torch.eye(dim)
            layer = LayerMap(
                [i], inputs.contiguous(), eye.clone(), layer.key_bias, eye.clone(), layer.value_bias
            )
        for name in ("key_weight", "value_weight"):
            weight = getattr(layer, name)
            weight += scale * torch.randn(weight.shape, generator=generator) / weight.shape[1] ** 0.5
        layers.append(layer)
    return dataclasses.replace(bridge, layers=layers, method="fullhead")


def _with_random_refinement(bridge, *, zero_up: bool, rank: int = 4, seed: int = 1) -> Bridge:
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for layer in bridge.layers:
        heads, width, dim = layer.key_weight.shape
        shapes = refinement_shapes(heads, width, rank, dim)
        parts = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
        if zero_up:
            parts["key_up"].zero_()
            parts["value_up"].zero_()
        layers.append(dataclasses.replace(layer, refinement=LayerRefinement(**parts)))
    return dataclasses.replace(bridge, layers=layers, refinement={"rank": rank})


def _cache_kv(bridge, model, ids, **kwargs):
    cache = BridgedCache(bridge, capture_kv(model, ids), model, ids, **kwargs).materialize()
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("full_head", [False, True])
def test_refinement_at_zero_is_exactly_the_closed_form(family, full_head):
    model = tiny_model(family)
    ids = torch.randint(3, 300, (1, 24))
    bridge = _poor_bridge(model, full_head=full_head)
    zero = _with_random_refinement(bridge, zero_up=True)
    live = _with_random_refinement(bridge, zero_up=False)
    closed = _cache_kv(bridge, model, ids)
    every_row = max(k.shape[2] for k, _ in closed)  # sliding layers keep only their window
    for (k0, v0), (k1, v1), (k2, v2) in zip(closed, _cache_kv(zero, model, ids), _cache_kv(live, model, ids)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
        assert not torch.equal(k0, k2) and not torch.equal(v0, v2)  # a nonzero residual does change them
        if k0.shape[2] == every_row:
            assert torch.equal(k0[:, :, :1], k2[:, :, :1])  # the native sink row is never refined


@pytest.mark.parametrize("full_head", [False, True])
def test_gathered_inputs_are_what_the_closed_form_map_reads(full_head):
    """x W + b over `gather_inputs` reproduces `map_heads` (keys un-rotated, rows -1 zero), so the
    residual reads exactly the closed form's inputs."""
    torch.manual_seed(0)
    heads, tokens, dim = 2, 7, 8
    src = [torch.randn(1, heads, tokens, dim) for _ in range(2)]
    angles = torch.rand(1, tokens, dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rows = torch.tensor([[-1, 0, 2, 2, 5, 6]])
    heads_in = torch.tensor([[0, 1, 2, 3]] * 2) if full_head else torch.tensor([[0, 2], [1, 3]])
    weight = torch.randn(2, heads_in.shape[1] * dim, dim)
    bias = torch.randn(2, dim)
    x = gather_inputs(src, rows, heads_in, cos, sin)
    assert x.shape == (1, 1 if full_head else 2, 6, heads_in.shape[1] * dim)
    mapped = map_heads(src, rows=rows, heads=heads_in, weight=weight, bias=bias, src_cos=cos, src_sin=sin)
    expected = (x @ weight + bias[:, None]) * (rows >= 0)[:, None, :, None]
    torch.testing.assert_close(mapped, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_training_lowers_the_heldout_attention_loss(family):
    model = tiny_model(family)
    bridge = _poor_bridge(model, full_head=family == "qwen2")
    generator = torch.Generator().manual_seed(0)
    train = [(ids, ids, None) for ids in torch.randint(3, 300, (10, 1, 32), generator=generator)]
    heldout = [(ids, ids, None) for ids in torch.randint(3, 300, (4, 1, 32), generator=generator)]
    refined = train_refinement(
        bridge, model, model, train, rank=8, steps=60, validate_every=5, progress=False
    )
    before = attention_cosine(bridge, model, model, heldout)
    after = attention_cosine(refined, model, model, heldout)
    kept = [i for i, layer in enumerate(refined.layers) if layer.refinement is not None]
    assert kept, "no layer kept its residual"
    assert sum(after) / len(after) > sum(before) / len(before) + 0.02
    assert all(after[i] > before[i] for i in kept)
    info = refined.refinement
    assert info["rank"] == 8 and info["steps"] == 60 and info["contexts"] == 8
    pairs = zip(info["validation_loss_refined"], info["validation_loss_closed_form"])
    assert [i for i, (a, b) in enumerate(pairs) if a < b] == kept  # kept exactly where it paid
    # the input bridge is untouched and refining starts from its closed form
    assert all(layer.refinement is None for layer in bridge.layers) and not bridge.refinement
    assert all(layer.refinement is None for layer in strip_refinement(refined).layers)


def test_refine_bridge_on_texts_and_its_argument_errors():
    from tiny_models import byte_tokenizer

    model, tok = tiny_model("llama"), byte_tokenizer()
    bridge = _poor_bridge(model, full_head=True)
    texts = [f"calibration text number {i}: the quick brown fox jumps over the lazy dog." for i in range(6)]
    refined = refine_bridge(
        bridge, model, model, texts, tok, tok, rank=4, steps=30, validate_every=3, progress=False
    )
    assert refined.refinement["contexts"] == 4 and refined.refinement["validation_contexts"] == 2
    with pytest.raises(ValueError, match="rank"):
        refine_bridge(bridge, model, model, texts, tok, tok, rank=0, progress=False)
    with pytest.raises(ValueError, match="loss"):
        refine_bridge(bridge, model, model, texts, tok, tok, loss="l1", progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        refine_bridge(bridge, model, model, texts, progress=False)
    with pytest.raises(ValueError, match="usable contexts"):
        refine_bridge(bridge, model, model, texts[:2], tok, tok, progress=False)


def _refined_tiny(tmp_path):
    model = tiny_model("qwen2")
    bridge = _with_random_refinement(_poor_bridge(model, full_head=True), zero_up=False)
    # one layer left closed form: the file lists which layers carry a residual
    bridge.layers[1] = dataclasses.replace(bridge.layers[1], refinement=None)
    bridge.refinement = {"rank": 4, "loss": "cosine"}
    bridge.save_pretrained(tmp_path / "b")
    return model, bridge, tmp_path / "b"


def test_save_load_round_trip(tmp_path):
    model, bridge, directory = _refined_tiny(tmp_path)
    meta = json.loads((directory / "bridge.json").read_text())
    assert meta["refinement"]["layers"] == [0, 2] and meta["refinement"]["rank"] == 4
    loaded = Bridge.from_pretrained(directory)
    assert loaded.refinement == {"rank": 4, "loss": "cosine"}
    assert loaded.layers[1].refinement is None
    for a, b in zip(bridge.layers, loaded.layers):
        if a.refinement is not None:
            for name, tensor in a.refinement.tensors().items():
                assert torch.equal(tensor, getattr(b.refinement, name))
    ids = torch.randint(3, 300, (1, 20))
    for (k0, v0), (k1, v1) in zip(_cache_kv(bridge, model, ids), _cache_kv(loaded, model, ids)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert loaded.num_parameters() > strip_refinement(loaded).num_parameters()


def test_a_corrupted_refinement_is_refused(tmp_path):
    _, _, directory = _refined_tiny(tmp_path)
    tensors_path, json_path = bridge_tensors_path(directory), directory / "bridge.json"
    original_tensors, original_json = tensors_path.read_bytes(), json_path.read_text()

    tensors = load_file(str(tensors_path))
    tensors["layers.0.refinement.key_up"][0, 0, 0] += 1.0  # one weight changed after saving
    save_file(tensors, str(tensors_path))
    with pytest.raises(BridgeFormatError, match="layers.0.refinement.key_up.*checksum"):
        Bridge.from_pretrained(directory)
    tensors_path.write_bytes(original_tensors)

    tensors_path.write_bytes(original_tensors[: len(original_tensors) // 2])  # truncated
    with pytest.raises(BridgeFormatError, match="not a readable safetensors"):
        Bridge.from_pretrained(directory)
    tensors_path.write_bytes(original_tensors)

    def with_meta(change):
        meta = json.loads(original_json)
        change(meta)
        json_path.write_text(json.dumps(meta))

    with_meta(lambda m: m["refinement"].update(rank=0))
    with pytest.raises(BridgeFormatError, match="refinement.rank"):
        Bridge.from_pretrained(directory)
    with_meta(lambda m: m["refinement"].update(layers=[0, 0]))
    with pytest.raises(BridgeFormatError, match="refinement.layers"):
        Bridge.from_pretrained(directory)
    with_meta(lambda m: m["refinement"].update(layers=[0, 1, 2]))  # layer 1 has no residual stored
    with pytest.raises(BridgeFormatError, match="tensors"):
        Bridge.from_pretrained(directory)
    with_meta(lambda m: m.pop("refinement"))  # residuals present but undeclared: never silently dropped
    with pytest.raises(BridgeFormatError, match="tensors"):
        Bridge.from_pretrained(directory)
    with_meta(lambda m: m["refinement"].update(rank=5))  # shapes disagree with the declared rank
    with pytest.raises(BridgeFormatError, match="refinement.key_down has shape"):
        Bridge.from_pretrained(directory)
    json_path.write_text(original_json)
    assert Bridge.from_pretrained(directory).layers[0].refinement is not None


def test_grouped_translation_falls_back_and_pages_get_their_own_namespace(tmp_path):
    model, bridge, _ = _refined_tiny(tmp_path)
    ids = torch.randint(3, 300, (1, 20))
    grouped = BridgedCache(bridge, capture_kv(model, ids), model, ids, one_launch=True)
    assert grouped.translator.groups is None  # the stacked kernels know no residual
    closed = strip_refinement(bridge)
    assert (
        BridgedCache(closed, capture_kv(model, ids), model, ids, one_launch=True).translator.groups
        is not None
    )
    for (k0, v0), (k1, v1) in zip(
        _cache_kv(bridge, model, ids, one_launch=True), _cache_kv(bridge, model, ids, one_launch=False)
    ):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert bridge_fingerprint(bridge) != bridge_fingerprint(closed)


def test_refine_cli_checks_its_arguments_before_loading(tmp_path, capsys):
    from bridgecache.cli import main

    _, _, directory = _refined_tiny(tmp_path)
    assert main(["refine", "--bridge", str(directory), "--out", str(tmp_path / "r"), "--rank", "0"]) == 2
    assert "--rank is 0" in capsys.readouterr().err
    assert main(["refine", "--bridge", str(directory), "--out", str(directory)]) == 2
    assert "--force" in capsys.readouterr().err


def test_a_refined_bridge_is_not_exported_as_builtin(tmp_path):
    from bridgecache.artifacts.export import export_builtin

    _, _, directory = _refined_tiny(tmp_path)
    with pytest.raises(ValueError, match="refined bridge"):
        export_builtin(directory, root=tmp_path / "shipped")
    assert not (tmp_path / "shipped").exists()
