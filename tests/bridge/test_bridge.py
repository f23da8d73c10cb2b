"""Bridge: exact identity, save -> load round trip, and clear errors for bad files or models."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import tiny_model

from bridgecache.bridge import Bridge, BridgeFormatError, LayerMap, tensors_path
from bridgecache.fitting import FitConfig, PairedKV, fit_layer_maps
from bridgecache.models.spec import SpecMismatchError, model_spec


@pytest.fixture(scope="module")
def fitted():
    """A small cachebridge-style bridge (llama 3x2x16 -> gemma3 4x1x32) fitted on random KV."""
    src, tgt = tiny_model("llama"), tiny_model("gemma3")
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(4):
        sk = [torch.randn(1, 2, 30, 16, generator=g) for _ in range(3)]
        tk = [torch.randn(1, 1, 30, 32, generator=g) for _ in range(4)]
        rows = torch.arange(1, 30)
        seqs.append(PairedKV(sk, sk, tk, tk, rows, rows, heldout=i == 3))
    layers, info = fit_layer_maps(
        lambda w: seqs,
        (3, 2, 16),
        (4, 1, 32),
        FitConfig(method="cachebridge", layers_k=2, weighting="uniform"),
    )
    bridge = Bridge(model_spec(src), model_spec(tgt), "cachebridge", "identity", layers, 1, info)
    return bridge, src, tgt


def test_identity_is_exact(tiny):
    family, model = tiny
    bridge = Bridge.identity(model)
    spec = model_spec(model)
    assert bridge.method == "identity" and bridge.alignment_policy == "identity"
    assert len(bridge.layers) == spec.num_layers
    x = torch.randn(spec.num_kv_heads, 7, spec.head_dim) * 100
    for layer_idx, layer in enumerate(bridge.layers):
        assert layer.source_layers == [layer_idx]
        assert layer.inputs[:, 0].tolist() == [[layer_idx, h] for h in range(spec.num_kv_heads)]
        for w, b in ((layer.key_weight, layer.key_bias), (layer.value_weight, layer.value_bias)):
            assert torch.equal(x @ w + b[:, None], x)  # bit-exact, not merely close
        assert math.isnan(layer.r2_key) and math.isnan(layer.r2_value)
    bridge.check(model, model)


def test_save_load_roundtrip_is_identical(fitted, tmp_path):
    bridge, src, tgt = fitted
    bridge.save_pretrained(tmp_path / "b")
    again = Bridge.from_pretrained(tmp_path / "b")
    assert again.source == bridge.source and again.target == bridge.target
    assert (again.method, again.alignment_policy, again.native_head) == ("cachebridge", "identity", 1)
    assert again.calibration == json.loads(json.dumps(bridge.calibration))
    for a, b in zip(again.layers, bridge.layers):
        assert a.source_layers == b.source_layers
        for name in ("inputs", "key_weight", "key_bias", "value_weight", "value_bias"):
            assert (
                torch.equal(getattr(a, name), getattr(b, name))
                and getattr(a, name).dtype == getattr(b, name).dtype
            )
        assert a.r2_key == b.r2_key and a.r2_value == b.r2_value
    meta = json.loads((tmp_path / "b" / "bridge.json").read_text())
    assert meta["format_version"] == 2 and meta["layers"][0]["inputs"] == bridge.layers[0].inputs.tolist()
    again.check(src, tgt)
    assert again.summary() == bridge.summary()


def test_identity_roundtrip_keeps_nan_r2(tmp_path):
    bridge = Bridge.identity(tiny_model("qwen2"))
    bridge.save_pretrained(tmp_path)
    again = Bridge.from_pretrained(tmp_path)
    assert math.isnan(again.layers[0].r2_key) and again.method == "identity"


def test_wrong_model_names_the_field(fitted):
    bridge, src, tgt = fitted
    with pytest.raises(SpecMismatchError, match="num_layers"):
        bridge.check(src, tiny_model("qwen2"))  # 3 layers, not gemma3's 4
    with pytest.raises(SpecMismatchError, match="source.*head_dim"):
        bridge.check(tiny_model("llama", head_dim=8), tgt)
    bridge.check(model_spec(src), model_spec(tgt))  # specs work as well as models


def _corrupt_byte(path, offset_from_end=50):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_tensor_is_named(fitted, tmp_path):
    bridge, _, _ = fitted
    bridge.save_pretrained(tmp_path)
    _corrupt_byte(tensors_path(tmp_path))
    with pytest.raises(BridgeFormatError, match=r"tensor 'layers\.\d+\.\w+': checksum mismatch"):
        Bridge.from_pretrained(tmp_path)


def test_truncated_file_is_reported(fitted, tmp_path):
    bridge, _, _ = fitted
    bridge.save_pretrained(tmp_path)
    path = tensors_path(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(BridgeFormatError, match="truncated or corrupted"):
        Bridge.from_pretrained(tmp_path)
    (tmp_path / "bridge.json").write_text((tmp_path / "bridge.json").read_text()[:200])
    with pytest.raises(BridgeFormatError, match="not valid JSON"):
        Bridge.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m.update(format_version=99), "format_version"),
        (lambda m: m.pop("method"), "'method' is missing"),
        (lambda m: m["layers"][1].pop("source_layers"), r"layers\[1\].*'source_layers' is missing"),
        (lambda m: m["tensors"]["layers.0.key_bias"].update(shape=[9, 9]), "layers.0.key_bias.*shape"),
        (
            lambda m: m["tensors"]["layers.2.value_weight"].update(dtype="float16"),
            "layers.2.value_weight.*dtype",
        ),
        (lambda m: m["target"].update(head_dim=64), "layers.0.inputs|layers.0.key_weight"),
        (lambda m: m["layers"][0]["inputs"][0][0].__setitem__(1, 5), "layers.0.inputs differs"),
    ],
)
def test_inconsistent_metadata_names_the_field(fitted, tmp_path, edit, message):
    bridge, _, _ = fitted
    bridge.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "bridge.json").read_text())
    edit(meta)
    (tmp_path / "bridge.json").write_text(json.dumps(meta))
    with pytest.raises(BridgeFormatError, match=message):
        Bridge.from_pretrained(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(BridgeFormatError, match="no bridge metadata"):
        Bridge.from_pretrained(tmp_path / "nowhere")


def test_sizes_and_summary(fitted):
    bridge, _, _ = fitted
    # k=2 matched heads of 16 dims -> 32 dims, one target head, keys and values, four layers.
    per_layer = 2 * (1 * 32 * 32 + 32)
    assert bridge.num_parameters() == 4 * per_layer
    assert bridge.nbytes() == 4 * (per_layer * 4 + 1 * 2 * 2 * 8)
    text = bridge.summary()
    assert text.count("\n") == 4 + 3 and "R2 K" in text and f"{bridge.nbytes():,} bytes" in text


def test_layer_map_dataclass_fields():
    layer = LayerMap([0], torch.zeros(1, 1, 2, dtype=torch.long), torch.eye(2)[None], torch.zeros(1, 2),
                     torch.eye(2)[None], torch.zeros(1, 2))  # fmt: skip
    assert math.isnan(layer.r2_key) and layer.num_parameters == 12


@pytest.mark.real_model
def test_tokenizer_fingerprint_is_remembered_until_the_vocabulary_changes(monkeypatch):
    from bridgecache.models.spec import tokenizer_fingerprint
    from bridgecache.models.zoo import load_tokenizer

    tokenizer, fresh = load_tokenizer("smollm2-135m"), load_tokenizer("smollm2-135m")
    reads = []
    get_vocab = tokenizer.get_vocab
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: reads.append(1) or get_vocab())
    first = tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(tokenizer) == first == tokenizer_fingerprint(fresh)
    assert len(reads) == 1  # the second call did not hash the vocabulary again

    tokenizer.add_tokens(["<bridgecache-new-token>"])
    changed = tokenizer_fingerprint(tokenizer)
    assert len(reads) == 2 and changed != first
    fresh.add_tokens(["<bridgecache-new-token>"])
    assert tokenizer_fingerprint(fresh) == changed
