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
value, not part of the cache, which bridgecache's own attention adds where the model's does);
attention modules that compute one call of transformers' attention function from a query
projection bridgecache reads (`bridgecache.models.code`). Everything else is refused by name
before any model runs: a bridge would be silently wrong. Knows transformers configs and, through
`models.code`, what the model's own modeling code does; nothing about bridges, KV or caches.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from bridgecache.kernels.rotary import ROTARY_KINDS
from bridgecache.models.code import (
    QUERY_PROJECTIONS,
    attention_code,
    decoder_of,
    modeling_module,
    module_pairing,
    rope_on_sliding_only,
)

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
    """Per decoder layer, whether its keys carry RoPE (SmolLM3's `no_rope_layers`: 1 = RoPE; rope
    parameters of None for a layer type; with a window, only the sliding layers of a family whose
    attention rotates under a condition on its window, a rule of its code and no config field:
    Cohere 2, EXAONE 4, Flint)."""
    config = config.get_text_config()
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)  # despite the name, 1 marks a RoPE layer
    if flags is not None:
        return tuple(bool(f) for f in flags)
    rope = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    if types and "rope_type" not in rope and any(rope.get(t, {}) is None for t in types):
        # per layer type, and None for a type without RoPE (ERGO's full layers): its rotary
        # module keeps no tables for that type and its attention skips the rotation
        return tuple(rope.get(t, {}) is not None for t in types)
    if getattr(config, "sliding_window", None) is not None and rope_on_sliding_only(config.model_type):
        return tuple(w is not None for w in layer_windows(config))
    return (True,) * n


def check_supported(model_or_config) -> None:
    """Raise UnsupportedArchitectureError (layer, feature, what is supported) for a model whose
    cache a bridge cannot translate exactly; reads the config, and the modules of a model."""
    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    config = getattr(model_or_config, "config", model_or_config).get_text_config()
    kind = config.model_type
    for name in ("head_dim", "num_key_value_heads", "num_attention_heads"):  # one value for every layer
        try:
            getattr(config, name, None)
        except Exception as error:  # noqa: BLE001 - transformers' per-layer configs raise their own
            raise UnsupportedArchitectureError(
                kind, None, f"a {name} that differs by layer", f"{type(error).__name__}: {error}"
            ) from None
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
    inline = getattr(config, "rotary_dim", None)  # GPT-J, CodeGen: RoPE, but no rotary module
    if (
        not getattr(config, "alibi", False)
        and (rope is not None or isinstance(inline, int))
        and (rope is None or no_module)
    ):
        raise UnsupportedArchitectureError(
            kind, None, "rotary embeddings computed inside its attention",
            "no rotary_emb module and rope parameters to read the tables from",
        )  # fmt: skip
    if rope is None or no_module or getattr(config, "alibi", False):
        raise UnsupportedArchitectureError(
            kind, None, "no rotary position embeddings", "learned absolute or ALiBi positions"
        )
    if getattr(config, "rope_interleave", False):  # DeepSeek's: pairs permuted before rotate_half
        raise UnsupportedArchitectureError(kind, None, "rope_interleave", "channels permuted before RoPE")
    rotary_layout(model_or_config)  # a rotary width the head cannot hold is refused by name
    if model is not None and model not in _MODULES_CHECKED:
        _check_attention_modules(model, kind)
        # model_spec runs on every capture and handoff: the walk of every module (~2 ms on 80
        # layers) once per model; a model's attention classes do not change between requests
        _MODULES_CHECKED[model] = True


_MODULES_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # models whose modules passed


def _check_attention_modules(model, kind: str) -> None:
    """Refuse a model whose attention modules (transformers' `...Attention` classes with a
    `layer_idx`) are not ones bridgecache reads: a query projection of QUERY_PROJECTIONS (JetMoE
    routes its queries through experts), the module's `config` and `scaling` (what transformers'
    attention functions take; GPT-NeoX-Japanese's older module keeps neither)."""
    found = False
    for module in model.modules():
        if not (hasattr(module, "layer_idx") and type(module).__name__.endswith("Attention")):
            continue
        found = True
        missing = [] if any(hasattr(module, n) for n in QUERY_PROJECTIONS) else ["query projection"]
        missing += [name for name in ("config", "scaling") if not hasattr(module, name)]
        calls = attention_code(type(module))[0]
        if calls != 1:  # bridgecache's own attention stands in for that one call
            raise UnsupportedArchitectureError(
                kind, module.layer_idx, "attention that is not one call of transformers' attention function",
                f"{type(module).__name__}.forward calls it {calls} times (DiffLlama's differential "
                "attention: two softmaxes, one subtracted; older modules compute attention themselves)",
            )  # fmt: skip
        if missing:
            raise UnsupportedArchitectureError(
                kind, module.layer_idx, "an attention module bridgecache cannot read",
                f"{type(module).__name__} has no {', '.join(missing)}; bridgecache recomputes a layer's "
                f"queries from one of {', '.join(QUERY_PROJECTIONS)} and reads its config and scaling",
            )  # fmt: skip
    if not found:
        raise UnsupportedArchitectureError(
            kind, None, "no attention modules bridgecache can find",
            "no module of an `...Attention` class with a `layer_idx`",
        )  # fmt: skip


def layer_sinks(module) -> torch.Tensor | None:
    """An attention module's sink logits [q_heads] float32 (GPT-OSS's `sinks`: one more logit per
    head in the softmax, with no value), or None where it has none."""
    sinks = getattr(module, "sinks", None)
    return sinks.detach().float() if isinstance(sinks, torch.Tensor) else None


def rotary_module(model) -> torch.nn.Module | None:
    """The decoder's rotary embedding module (`rotary_emb`), or None."""
    for base in (decoder_of(model), getattr(model, "model", None), model):
        rotary = getattr(base, "rotary_emb", None)
        if isinstance(rotary, torch.nn.Module):
            return rotary
    return None


def _rotation_pairing(model, model_type: str) -> str:
    """The pairing of the model's own rotation, read from its modeling module (`_module_pairing`:
    memoised per module, model_spec runs on every handoff): "half" (j, j + D/2), "interleaved"
    (2j, 2j + 1: Cohere, Helium, GLM; Llama 4's complex `apply_rotary_emb`), or another result."""
    name = type(model).__module__ if model is not None else ""
    if not name.startswith("transformers.models."):
        name = modeling_module(model_type)
    return module_pairing(name)


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
    kind = _rotation_pairing(model, config.model_type)
    if kind not in ROTARY_KINDS:  # NanoChat's rotate_half turns the other way: (x2, -x1)
        raise UnsupportedArchitectureError(
            config.model_type, None, "a rotation bridgecache does not know",
            f"its rotate_half maps [0, 1, 2, 3] to {kind}; known: [-2, -3, 0, 1] (half-split pairs) "
            "and [-1, 0, -3, 2] (interleaved pairs)",
        )  # fmt: skip
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
