"""The zoo's GGUF reader gives the float32 tensors transformers' own GGUF loader gives, bit for bit.

Random blocks of each quantisation type the built-in models use go through both our torch
dequantiser and gguf's numpy one (what transformers calls); the real SmolLM2 loads both ways
and every parameter is compared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import dequantize as gguf_dequantize
from gguf.constants import GGML_QUANT_SIZES

from bridgecache.models.gguf_weights import dequantize

# byte offsets of each type's float16 scales inside a block (random bytes there could be NaN)
_HALVES = {"Q8_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_1": (0, 2)}


def _random_tensor(qtype, rows: int, blocks_per_row: int, rng) -> np.ndarray:
    """[rows, bytes per row] uint8: random quantised values, finite random float16 scales."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in _HALVES[qtype.name]:
        scales = (rng.standard_normal(data.shape[0]) * 0.05).astype(np.float16)
        data[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q5_1"])
def test_each_block_type_matches_gguf_bit_for_bit(name):
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng()
    data = _random_tensor(qtype, rows=7, blocks_per_row=3, rng=rng)
    ours = dequantize(data, qtype)  # Q5_1: no torch port, gguf's blocks in long runs
    reference = gguf_dequantize(data, qtype)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == reference.shape
    assert np.array_equal(ours.numpy().view(np.uint32), reference.view(np.uint32))


@pytest.mark.parametrize("name", ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "Q5_1"])
def test_a_tensor_of_many_steps_matches_gguf_bit_for_bit(name, monkeypatch):
    """Dequantised in steps of a few blocks (the real step is 1M values), with a short last step."""
    import bridgecache.models.gguf_weights as gguf_weights

    monkeypatch.setattr(gguf_weights, "_VALUES_PER_RUN", 3 * 256)
    qtype = GGMLQuantizationType[name]
    data = _random_tensor(qtype, rows=5, blocks_per_row=7, rng=np.random.default_rng(1))
    ours, reference = dequantize(data, qtype), gguf_dequantize(data, qtype)
    assert np.array_equal(ours.numpy().view(np.uint32), reference.view(np.uint32))


def test_float_tensors_pass_through():
    rng = np.random.default_rng()
    values = rng.standard_normal((5, 8)).astype(np.float32)
    assert np.array_equal(dequantize(values, GGMLQuantizationType.F32).numpy(), values)
    half = values.astype(np.float16)
    assert np.array_equal(dequantize(half, GGMLQuantizationType.F16).numpy(), half.astype(np.float32))


@pytest.mark.real_model
def test_a_builtin_model_loads_as_transformers_loads_its_gguf(smollm2):
    from transformers import AutoModelForCausalLM

    from bridgecache.models import zoo

    model, _ = smollm2
    folder = zoo.model_dir("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=zoo.GGUF_FILE, dtype=torch.float32)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert model.config.model_type == reference.config.model_type
    assert model.config._name_or_path == str(folder)
