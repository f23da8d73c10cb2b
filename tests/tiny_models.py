"""Tiny random-weight models of the three families we support and a byte tokenizer, built in-process
(no download)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

FAMILIES = ("llama", "qwen2", "gemma3")


def tiny_config(family: str, **overrides):
    """A 3-4 layer config of `family` with real-model quirks kept (GQA, q/k-norm, sliding window)."""
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    common |= dict(max_position_embeddings=512, attn_implementation="eager")
    if family == "llama":
        config = LlamaConfig(**common, num_hidden_layers=3, num_key_value_heads=2, head_dim=16)
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    elif family == "qwen2":
        config = Qwen2Config(**common, num_hidden_layers=3, num_key_value_heads=2)
    elif family == "gemma3":
        config = Gemma3TextConfig(
            **common,
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        )
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return model.eval()


def byte_tokenizer(extra: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level fast tokenizer (one token per byte, with offsets; <s> 256, </s> 257), built
    offline; `extra` adds a token (another vocabulary)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<s>": 256, "</s>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if extra:
        out.add_tokens([extra])
    return out


def random_bridge(model, inputs_per_head: int = 2, seed: int = 0):
    """A random (not identity) bridge of `model` onto itself: each target head reads
    `inputs_per_head` random source heads of random layers (a refresh has work to do)."""
    from bridgecache.bridge import Bridge
    from bridgecache.bridge.maps import LayerMap
    from bridgecache.models.spec import model_spec

    gen = torch.Generator().manual_seed(seed)
    spec = model_spec(model)
    heads, dim, n = spec.num_kv_heads, spec.head_dim, inputs_per_head
    layers = []
    for _ in range(spec.num_layers):
        inputs = torch.stack(
            [
                torch.randint(0, spec.num_layers, (heads, n), generator=gen),
                torch.randint(0, heads, (heads, n), generator=gen),
            ],
            dim=-1,
        )
        w = lambda: torch.randn(heads, n * dim, dim, generator=gen) / (n * dim) ** 0.5  # noqa: E731
        b = lambda: torch.randn(heads, dim, generator=gen)  # noqa: E731
        used = sorted({int(x) for x in inputs[..., 0].unique()})
        layers.append(LayerMap(used, inputs, w(), b(), w(), b()))
    return Bridge(spec, spec, "cachebridge", "identity", layers)
