"""What each decoder layer of a model caches and attends over, read from its config (and modules).

    layer_windows(config)        per layer, the sliding window its cache keeps (None: every token)
    layer_window(module)         the same for one attention module (its config and `layer_idx`)
    layer_sinks(module)          its learned sink logits [q_heads] (GPT-OSS), or None
    layer_chunks(config)         per layer, the chunk its queries attend within (Llama 4), or None
    layer_chunk(module)          the same for one attention module
    query_temperature(module, p) the scale Llama 4's NoPE layers give queries at positions p, or None
    check_supported(model)       raise UnsupportedArchitectureError for what a bridge cannot do exactly
    rotary_layout(model)         the RotaryLayout of its keys: which channels RoPE pairs, over how many

The window comes from transformers' own `get_layer_types_and_kwargs`, the reading
`DynamicCache(config=...)` builds its layers from, so the spec, the native pass, the reading and
the fit's attention weights attend over exactly what the target's cache keeps (Mistral, Phi-3 and
StarCoder2 pass their window as a keyword and keep no attribute for it).

Supported: per-head K/V on every layer ("full_attention", "sliding_attention", or Llama 4's
"chunked_attention": its cache keeps a window of the chunk size, as transformers' does, and
bridgecache's own attention masks to the chunk), RoPE in any `RotaryLayout` (half-split or
interleaved pairs, over the whole head or its first `rotary_dim` channels; any rope type and
scaling), or no RoPE on a layer; a learned sink logit per head (GPT-OSS: a softmax column with no
value, not part of the cache, which bridgecache's own attention adds where the model's does).
Everything else is refused by name before any model runs: a bridge would be silently wrong.
Knows transformers configs; nothing about bridges, KV or caches.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch

from bridgecache.kernels.rotary import ROTARY_KINDS

__all__ = [
    "ROTARY_KINDS",
    "RotaryLayout",
    "UnsupportedArchitectureError",
    "SUPPORTED_LAYER_TYPES",
    "layer_windows",
    "layer_window",
    "layer_sinks",
    "layer_chunks",
    "layer_chunk",
    "query_temperature",
    "check_supported",
    "rope_layers",
    "rotary_layout",
    "rotary_module",
]

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
_SUPPORTED = (
    "per-head keys and values on every layer (full, sliding-window or chunked attention), RoPE with "
    "half-split or interleaved pairs over the whole head or a part of it (any rope type and "
    "scaling) or none"
)
# Families whose layers without a window carry no RoPE, a rule of their modeling code and no config
# field (Cohere 2, EXAONE 4: "if self.sliding_window is None or self.is_sliding: apply RoPE").
_ROPE_ON_SLIDING_ONLY = {"cohere2", "exaone4"}


class RotaryLayout(NamedTuple):
    """Which key channels RoPE rotates together: a value, read from the model's own rotary code.

    kind: "half" pairs channels (j, j + rotary_dim / 2), as Llama's `rotate_half`; "interleaved"
        pairs (2j, 2j + 1), as Cohere's, Helium's and GLM's `rotate_half`.
    rotary_dim: how many leading channels of the head are rotated (partial rotary: Phi-4-mini
        0.75, GPT-NeoX and StableLM 0.25 of the head); the rest pass through unrotated.

    A plain (str, int) tuple, so the kernels take it without importing bridgecache.
    """

    kind: str
    rotary_dim: int

    @classmethod
    def whole(cls, head_dim: int) -> RotaryLayout:
        """The half-split over the whole head: what files written before the field mean."""
        return cls("half", head_dim)


class UnsupportedArchitectureError(ValueError):
    """A model whose KV layout a bridge cannot translate exactly (named feature, layer)."""

    def __init__(self, model_type: str, layer: int | None, feature: str, detail: str = ""):
        where = "every layer" if layer is None else f"layer {layer}"
        self.model_type, self.layer, self.feature, self.detail = model_type, layer, feature, detail
        super().__init__(
            f"{model_type!r} models are not supported: {where} has {feature}"
            + (f" ({detail})" if detail else "")
            + f"; bridgecache supports {_SUPPORTED}"
        )


def layer_windows(config) -> tuple[int | None, ...]:
    """Per decoder layer, the window its cache keeps (None: every token), as transformers'
    `DynamicCache(config=config)` lays the cache out; other layer kinds raise."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = config.get_text_config()
    known = _WINDOWS.get(id(config))
    signature = _signature(config)
    if known is not None and known[0]() is config and known[1] == signature:
        return known[2]
    types, kwargs = get_layer_types_and_kwargs(config)
    types = list(types)
    if isinstance(kwargs, dict):  # transformers <= 5.17: one kwargs dict for every windowed layer
        windowed = ("sliding_attention", "chunked_attention", "hybrid_sliding")
        kwargs = [kwargs if kind in windowed else {} for kind in types]
    for i, kind in enumerate(types):
        if kind not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedArchitectureError(
                config.model_type, i, f"layer type {kind!r}", _KIND_WHY.get(kind, "")
            )
    windows = tuple(k.get("sliding_window") for k in kwargs)
    if len(_WINDOWS) > 256:  # configs come and go (tests, zoo loads): drop the dead ones
        for key in [key for key, entry in _WINDOWS.items() if entry[0]() is None]:
            del _WINDOWS[key]
    _WINDOWS[id(config)] = (weakref.ref(config), signature, windows)
    return windows


_KIND_WHY = {
    # hybrids: their state after a context needs the prefill through the last recurrent layer, so a
    # translated cache saves nothing (docs/latent-and-hybrid.md, measured)
    "linear_attention": "a recurrent state instead of per-token keys and values (a hybrid model)",
    "conv": "a convolution state instead of per-token keys and values (a hybrid model)",
    "mamba": "a recurrent state instead of per-token keys and values (a hybrid model)",
    "dummy": "no cache of its own (shared or attention-free)",
}
# id(config) -> (weak reference, signature, windows): the attention of every layer of every forward
# reads its window, and transformers' reading costs ~0.4 ms (configs are unhashable).
_WINDOWS: dict[int, tuple] = {}


def _signature(config) -> tuple:
    types = getattr(config, "layer_types", None)
    return (
        config.num_hidden_layers,
        None if types is None else tuple(types),
        getattr(config, "sliding_window", None),
        getattr(config, "attention_chunk_size", None),
    )


def layer_window(module) -> int | None:
    """The window of an attention module's layer (its `config` and `layer_idx`)."""
    return layer_windows(module.config)[module.layer_idx]


def layer_chunks(config) -> tuple[int | None, ...]:
    """Per decoder layer, the chunk its queries attend within (Llama 4's "chunked_attention" layers:
    `attention_chunk_size` columns, counted from each row's first real token, as transformers'
    chunked mask), or None. Its cache is a window of the same size (`layer_windows`)."""
    config = config.get_text_config()
    types = getattr(config, "layer_types", None) or ()
    chunk = getattr(config, "attention_chunk_size", None)
    return tuple(chunk if kind == "chunked_attention" else None for kind in types) or (None,) * (
        config.num_hidden_layers
    )


def layer_chunk(module) -> int | None:
    """The chunk of an attention module's layer (its `config` and `layer_idx`), or None."""
    return layer_chunks(module.config)[module.layer_idx]


def query_temperature(module, positions: torch.Tensor) -> torch.Tensor | None:
    """float32, `positions`' shape: the scale a Llama 4 NoPE layer gives its queries at `positions`
    (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, transformers' `attn_temperature_tuning`,
    where p counts columns from the sequence's start); None for every other attention module."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def rope_layers(config) -> tuple[bool, ...]:
    """Per decoder layer, whether its keys carry RoPE (SmolLM3's `no_rope_layers`: 1 = RoPE;
    EXAONE 4 and Cohere 2 with a window: only their sliding layers)."""
    config = config.get_text_config()
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)  # despite the name, 1 marks a RoPE layer
    if flags is not None:
        return tuple(bool(f) for f in flags)
    if config.model_type in _ROPE_ON_SLIDING_ONLY and getattr(config, "sliding_window", None) is not None:
        return tuple(w is not None for w in layer_windows(config))
    return (True,) * n


def check_supported(model_or_config) -> None:
    """Raise UnsupportedArchitectureError (layer, feature, what is supported) for a model whose
    cache a bridge cannot translate exactly; reads the config, and the modules of a model."""
    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = getattr(model_or_config, "config", model_or_config).get_text_config()
    kind = config.model_type
    if getattr(config, "kv_lora_rank", None) is not None:  # docs/latent-and-hybrid.md: why, measured
        raise UnsupportedArchitectureError(
            kind, None, "multi-head latent attention (MLA)",
            f"its cache holds one latent of {config.kv_lora_rank} as keys and the shared rotary key of "
            f"{config.qk_rope_head_dim} as values, not per-head keys and values",
        )  # fmt: skip
    windows = {w for w in layer_windows(config) if w is not None}  # raises for other layer kinds
    if len(windows) > 1:
        raise UnsupportedArchitectureError(
            kind, None, "sliding windows of several sizes", str(sorted(windows))
        )
    rope = getattr(config, "rope_parameters", None)
    no_module = model is not None and rotary_module(model) is None
    if rope is None or no_module or getattr(config, "alibi", False):
        raise UnsupportedArchitectureError(
            kind, None, "no rotary position embeddings", "learned absolute or ALiBi positions"
        )
    if getattr(config, "rope_interleave", False):  # DeepSeek's: pairs permuted before rotate_half
        raise UnsupportedArchitectureError(kind, None, "rope_interleave", "channels permuted before RoPE")
    rotary_layout(model_or_config)  # a rotary width the head cannot hold is refused by name


def layer_sinks(module) -> torch.Tensor | None:
    """An attention module's sink logits [q_heads] float32 (GPT-OSS's `sinks`: one more logit per
    head in the softmax, with no value), or None where it has none."""
    sinks = getattr(module, "sinks", None)
    return sinks.detach().float() if isinstance(sinks, torch.Tensor) else None


def rotary_module(model) -> torch.nn.Module | None:
    """The decoder's rotary embedding module (`rotary_emb`), or None."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    for base in (decoder, getattr(model, "model", None), model):
        rotary = getattr(base, "rotary_emb", None)
        if isinstance(rotary, torch.nn.Module):
            return rotary
    return None


def _rotate_half_interleaves(model, model_type: str) -> bool:
    """Whether the model's own rotation pairs channels (2j, 2j + 1) (Cohere, Helium, GLM; Llama 4's
    complex `apply_rotary_emb`) rather than (j, j + D/2): read from its modeling module, applied
    to [0, 1, 2, 3] (memoised per module: model_spec runs on every handoff)."""
    return _module_interleaves(_modeling_module(model, model_type))


def _modeling_module(model, model_type: str) -> str:
    """The name of the transformers modeling module of a model (or of its model type)."""
    name = type(model).__module__ if model is not None else None
    if name is None or not name.startswith("transformers.models."):
        known = {"gemma3_text": "gemma3", "gemma2_text": "gemma2", "llama4_text": "llama4"}
        package = known.get(model_type, model_type)
        name = f"transformers.models.{package}.modeling_{package}"
    return name


@functools.cache
def _module_interleaves(name: str) -> bool:
    import importlib

    try:
        module = importlib.import_module(name)
    except ImportError:
        return False
    rotate_half = getattr(module, "rotate_half", None)
    complex_rotation = getattr(module, "apply_rotary_emb", None)
    if rotate_half is not None:
        return rotate_half(torch.arange(4.0)).tolist() == [-1.0, 0.0, -3.0, 2.0]
    if complex_rotation is None:
        return False
    # Llama 4: x [batch, tokens, heads, dim] times freqs_cis [batch, tokens, dim / 2], a quarter turn
    x, quarter = torch.arange(4.0).view(1, 1, 1, 4), torch.full((1, 1, 2), 1j)
    try:
        turned, _ = complex_rotation(x, x, quarter)
    except (TypeError, RuntimeError, ValueError):  # some other function of that name
        return False
    return turned.flatten().tolist() == [-1.0, 0.0, -3.0, 2.0]


def rotary_layout(model_or_config) -> RotaryLayout:
    """The RotaryLayout of a model's keys: the pairing its own `rotate_half` applies (read from its
    modeling module on [0, 1, 2, 3]) over the leading int(head_dim * partial_rotary_factor)
    channels, as its rotary module sizes its tables (`rotary_pct` on older configs)."""
    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = getattr(model_or_config, "config", model_or_config).get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    factor = _partial_rotary(config)
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise UnsupportedArchitectureError(
            config.model_type, None, "a rotary width the head cannot hold",
            f"partial_rotary_factor {factor} of head_dim {head_dim} gives {rotary_dim} channels",
        )  # fmt: skip
    kind = "interleaved" if _rotate_half_interleaves(model, config.model_type) else "half"
    return RotaryLayout(kind, rotary_dim)


def _partial_rotary(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    values = [rope] if "rope_type" in rope or not rope else list(rope.values())
    for params in values:
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            return float(params["partial_rotary_factor"])
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None and getattr(config, "rotary_pct", None) is not None:
        factor = config.rotary_pct
    return 1.0 if factor is None else float(factor)
