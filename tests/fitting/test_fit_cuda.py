"""fit_bridge on CUDA end to end (statistics, solve, held-out scoring) gives the bridge the CPU fit
gives: a tiny pair with both methods, the source on another device than the target, and a
random pair at real widths (Qwen2.5-7B -> 1.5B layers). Skipped without CUDA."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

from bridgecache.fitting import FitConfig, fit_bridge

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _same_bridge(gpu, cpu, tol: float) -> None:
    assert [layer.source_layers for layer in gpu.layers] == [layer.source_layers for layer in cpu.layers]
    for g, c in zip(gpu.layers, cpu.layers):
        assert torch.equal(g.inputs, c.inputs)
        for name in ("key_weight", "key_bias", "value_weight", "value_bias"):
            rel = _rel(getattr(g, name), getattr(c, name))
            assert rel < tol, (name, rel)
    gs, cs = gpu.calibration["heldout_scores"], cpu.calibration["heldout_scores"]
    assert gs["sequences"] == cs["sequences"] > 0
    for a, b in zip(gs["attention_cosine"], cs["attention_cosine"]):
        assert abs(a - b) < 5e-3


def _fit(source, target, tok, config, device_source, device_target):
    source = copy.deepcopy(source).to(device_source)
    target = copy.deepcopy(target).to(device_target)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a scoring failure would only warn
        return fit_bridge(source, target, tok, tok, config, progress=False)


@pytest.mark.parametrize("method", ["fullhead", "cachebridge"])
def test_tiny_pair_on_cuda_matches_cpu(method):
    source, target, tok = tiny_model("qwen2", seed=0), tiny_model("llama", seed=1), byte_tokenizer()
    config = FitConfig(method=method, num_sequences=6, seq_len=48, heldout_every=3, probe_subset=3)
    cpu = _fit(source, target, tok, config, "cpu", "cpu")
    gpu = _fit(source, target, tok, config, "cuda", "cuda")
    _same_bridge(gpu, cpu, 2e-3)
    split = _fit(source, target, tok, config, "cpu", "cuda")  # the source on another device
    _same_bridge(split, cpu, 2e-3)


def test_real_width_random_pair_on_cuda_matches_cpu():
    """Qwen2.5-7B and Qwen2.5-1.5B layers at their published widths (2 layers each, a small
    vocabulary: neither changes the KV shapes), float32 on both devices."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    def model(seed, **widths):
        torch.manual_seed(seed)
        config = Qwen2Config(
            vocab_size=512, num_hidden_layers=2, max_position_embeddings=4096, rope_theta=1e6, **widths
        )
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()

    source = model(
        0, hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4
    )
    target = model(1, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2)
    tok = byte_tokenizer()
    for method in ("fullhead", "cachebridge"):
        config = FitConfig(method=method, num_sequences=4, seq_len=64, heldout_every=2, probe_subset=2)
        cpu = _fit(source, target, tok, config, "cpu", "cpu")
        gpu = _fit(source, target, tok, config, "cuda", "cuda")
        _same_bridge(gpu, cpu, 5e-3)
