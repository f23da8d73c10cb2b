"""Tiny random-weight models and a byte tokenizer, built in-process (no download): the three zoo
families (`tiny_model`), and one config of each architecture users serve (`ARCHITECTURES`,
`tiny_architecture`: tests/models/test_architectures.py, benchmarks/architectures.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def noisy_bridge(model):
    """The identity bridge of `model` with noise on every map: deliberately wrong, like a poor fit,
    marked as fitted (refreshed like one)."""
    from bridgecache.bridge import Bridge

    bridge = Bridge.identity(model)
    generator = torch.Generator().manual_seed(0)
    for layer in bridge.layers:
        for name in ("key_weight", "value_weight"):
            weight = getattr(layer, name)
            weight += 0.5 * torch.randn(weight.shape, generator=generator)
    bridge.method = "fullhead"
    return bridge


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


# Architectures users serve, one tiny config each (4 layers, window 8 where the family has one,
# contexts in the tests are longer): name -> (config class name, its overrides).
_TINY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_hidden_layers=4, max_position_embeddings=512, attn_implementation="eager",
)  # fmt: skip
_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
_GPT_OSS_YARN = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 128,
}  # fmt: skip
ARCHITECTURES = {
    "llama (llama3 rope)": ("LlamaConfig", dict(rope_parameters=_LLAMA3_ROPE)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral (sliding window)": ("MistralConfig", dict(sliding_window=8)),
    "ministral": ("MinistralConfig", dict(sliding_window=8, layer_types=_ALTERNATING)),
    "ministral3": ("Ministral3Config", dict()),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict()),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gemma2 (soft-capping)": ("Gemma2Config", dict(sliding_window=8, layer_types=_ALTERNATING)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=8)),
    "granite": ("GraniteConfig", dict()),
    "phi3 (sliding window)": ("Phi3Config", dict(sliding_window=8, pad_token_id=0)),
    "olmo2": ("Olmo2Config", dict(initializer_range=0.5)),  # no norm before attention: keys far above eps
    "starcoder2": ("Starcoder2Config", dict(sliding_window=8)),
    "olmo3": ("Olmo3Config", dict(sliding_window=8, initializer_range=0.5)),
    "exaone4 (no RoPE on full layers)": (
        "Exaone4Config",
        dict(sliding_window=8, layer_types=_ALTERNATING, initializer_range=0.5),
    ),  # fmt: skip
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "glm (interleaved, partial 0.5)": ("GlmConfig", dict(pad_token_id=0)),
    "glm4 (interleaved, partial 0.5)": ("Glm4Config", dict(pad_token_id=0)),
    "phi (partial 0.5)": ("PhiConfig", dict()),
    "persimmon (partial 0.5, qk-norm)": ("PersimmonConfig", dict(num_key_value_heads=4)),  # no GQA
    # partial or interleaved rotary, and the families refused by name (test_architectures.REFUSED)
    "phi4-mini (partial rotary)": (
        "Phi3Config",
        dict(
            pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
        ),
    ),  # fmt: skip
    "gpt_neox": ("GPTNeoXConfig", dict(num_key_value_heads=4)),  # no GQA: every head its own KV
    "stablelm": ("StableLmConfig", dict()),
    "nemotron": ("NemotronConfig", dict()),
    "helium": ("HeliumConfig", dict()),
    "gpt2 (learned positions)": ("GPT2Config", dict(n_embd=64, n_layer=4, n_head=4)),
    "cohere": ("CohereConfig", dict()),
    "cohere2": ("Cohere2Config", dict(sliding_window=8, layer_types=_ALTERNATING)),
    "smollm3 (no-RoPE layers)": ("SmolLM3Config", dict(no_rope_layers=[0, 1, 1, 1], pad_token_id=0)),
    "gpt_oss (sinks)": (
        "GptOssConfig",
        dict(
            sliding_window=8,
            layer_types=_ALTERNATING,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=_GPT_OSS_YARN,
        ),
    ),  # fmt: skip
    "deepseek_v3 (MLA)": (
        "DeepseekV3Config",
        dict(
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=4,
            head_dim=8,
            num_key_value_heads=4,
        ),
    ),  # fmt: skip
    # Llama 4's chunked layers and NoPE layers (each with its query temperature: floor_scale small
    # enough that it bites within 30 tokens); then its published pattern: RoPE (complex tables,
    # interleaved pairs) and qk-norm after it on the chunked layers, NoPE on every fourth
    "llama4_text (chunked, NoPE)": (
        "Llama4TextConfig",
        dict(
            attention_chunk_size=8,
            num_local_experts=2,
            no_rope_layers=[0, 0, 0, 0],
            floor_scale=4,
            attn_scale=0.5,
            layer_types=["chunked_attention"] * 3 + ["full_attention"],
        ),
    ),  # fmt: skip
    "llama4_text (chunked, RoPE, qk-norm)": (
        "Llama4TextConfig",
        dict(attention_chunk_size=8, num_local_experts=2, floor_scale=4, attn_scale=0.5),
    ),
    "qwen3_next (hybrid)": ("Qwen3NextConfig", dict(num_experts=4, num_experts_per_tok=2)),
}


def tiny_architecture_config(name: str):
    """The tiny config of ARCHITECTURES[name]."""
    import transformers

    class_name, overrides = ARCHITECTURES[name]
    return getattr(transformers, class_name)(**(_TINY | overrides))


def tiny_architecture(name: str, seed: int = 0, config=None):
    """The tiny model of ARCHITECTURES[name] (`config`: that config, changed by the caller)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or tiny_architecture_config(name)).eval()
    with torch.no_grad():  # GPT-OSS's sinks start near 0 (std 0.02): logits of a few units, as trained ones
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.normal_(0.0, 2.0)
    return model


# Chat templates of two families (the Zephyr style of SmolLM2's tokenizer, Qwen's ChatML).
ZEPHYR = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(template: str, extra: str | None = None):
    """`byte_tokenizer(extra)` with a chat template."""
    tok = byte_tokenizer(extra)
    tok.chat_template = template
    return tok


def script(path: str):
    """A repository script (e.g. "benchmarks/multi_turn_drift.py") imported as a module."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, Path(__file__).resolve().parents[1] / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
