"""Rotary position embeddings: tables from a model's own rotary module, rotate and un-rotate.

Keys in a transformers cache are stored AFTER RoPE. Bridges map keys in un-rotated space, so a
source key is un-rotated with the source's tables at source positions, mapped, and re-rotated
with the target's tables at target positions. The tables come from the model's own rotary module
(so every rope type and scaling transformers supports is honoured), per layer type where the
model has several (Gemma 3: "sliding_attention" base 1e4, "full_attention" base 1e6).

Convention (transformers' `rotate_half`): x_rot = x * cos + rotate_half(x) * sin, with
cos/sin of shape [..., tokens, head_dim] holding each frequency twice (halves, not interleaved).
Some rope types scale cos and sin by an attention factor f; un-rotation divides by
cos^2 + sin^2 (= f^2 per channel), so it is exact for every type. A layer without RoPE (SmolLM3's
`no_rope_layers`) gets cos = 1, sin = 0: rotating and un-rotating its keys leave them as they are.
Architectures whose rotary is partial or interleaved are refused before any table is built
(`bridgecache.models.layout.check_supported`).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json

import torch

from bridgecache.models.layout import rope_layers, rotary_module

__all__ = ["RopeTables", "rotate", "unrotate", "rotate_half", "both_halves", "NO_ROPE"]

NO_ROPE = "no_rope"  # RopeTables.layer_types entry of a layer without rotary embeddings


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) over the two halves of the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def both_halves(table: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A cos or sin table [..., head_dim] as `rotate` reads it: GPT-OSS's rotary module returns
    each frequency once ([..., head_dim / 2], for its own half-split rotation), `rotate_half`'s
    convention holds it twice."""
    return torch.cat([table, table], dim=-1) if 2 * table.shape[-1] == head_dim else table


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE. x: [batch, heads, tokens, d]; cos, sin: [batch or 1, tokens, d]."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo `rotate`. x: [batch, heads, tokens, d]; cos, sin: [batch or 1, tokens, d]."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


class RopeTables:
    """cos/sin tables of one model, by layer: `tables.cos_sin(layer, positions)`.

    Built from the model's own rotary module(s) (`RopeTables.from_model`), or from a config alone
    (`from_config`, `from_spec`: the rotary class of that model type, so a bridge can re-derive a
    source's tables without the source model). Computes in float32 on the module's device.

    layer_types: per layer, which tables it reads (layers with equal entries share them): its
    layer type, or NO_ROPE for a layer whose keys carry no RoPE.
    """

    def __init__(self, config, rotary: torch.nn.Module, rotary_local: torch.nn.Module | None = None):
        self.config = config
        self.rotary = rotary
        self.rotary_local = rotary_local  # older Gemma 3 layouts keep a second module
        self._takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
        n = config.num_hidden_layers
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
        self._rotary_types = types  # what the rotary module is asked for
        self.layer_types = [t if rotary else NO_ROPE for t, rotary in zip(types, rope_layers(config))]

    @classmethod
    def from_model(cls, model) -> RopeTables:
        rotary = rotary_module(model)
        if rotary is None:
            raise ValueError(f"{type(model).__name__} has no rotary_emb module: not a RoPE model")
        base = getattr(model, "model", model)
        return cls(model.config.get_text_config(), rotary, getattr(base, "rotary_emb_local", None))

    @classmethod
    def from_config(cls, config) -> RopeTables:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if class_name is None:
            raise ValueError(f"no causal-LM class for model type {config.model_type!r}")
        module = importlib.import_module(f"transformers.models.{_module_name(config.model_type)}")
        modeling = importlib.import_module(f"{module.__name__}.modeling_{_module_name(config.model_type)}")
        rotary_classes = [getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding")]
        if not rotary_classes:
            raise ValueError(f"transformers has no rotary embedding for model type {config.model_type!r}")
        return cls(config, rotary_classes[0](config=config))

    @classmethod
    def from_spec(cls, spec) -> RopeTables:
        """Tables of a `ModelSpec` (what a bridge records of each side)."""
        from transformers import AutoConfig

        config = AutoConfig.for_model(
            spec.model_type,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_q_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            hidden_size=spec.hidden_size,
            layer_types=list(spec.layer_types),
            max_position_embeddings=spec.max_position_embeddings,
            rope_parameters=json.loads(spec.rope),
            **_no_rope_flags(spec),
        )
        return cls.from_config(config)

    def to(self, device: torch.device) -> RopeTables:
        """A copy whose rotary modules live on `device` (this one is left where it is)."""
        local = self.rotary_local
        return RopeTables(
            self.config,
            copy.deepcopy(self.rotary).to(device),
            None if local is None else copy.deepcopy(local).to(device),
        )

    def cos_sin(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [batch, tokens] (or [tokens]) -> cos, sin: [batch, tokens, head_dim] float32."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        layer_type = self._rotary_types[layer]
        rotary = self.rotary
        if layer_type == "sliding_attention" and self.rotary_local is not None:
            rotary = self.rotary_local
        device = _module_device(rotary, positions.device)
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        positions = positions.to(device)
        with torch.no_grad():
            if self._takes_layer_type:
                tables = rotary(probe, positions, layer_type=layer_type)
            else:
                tables = rotary(probe, positions)
        # Llama 4: one complex table (freqs_cis) [..., head_dim / 2]; model_spec refuses its layers
        # with RoPE (pairs (2j, 2j + 1)), so only its NoPE layers' shape is read here
        is_complex = isinstance(tables, torch.Tensor) and tables.is_complex()
        cos, sin = (tables.real, tables.imag) if is_complex else tables
        dim = (
            getattr(self.config, "head_dim", None)
            or self.config.hidden_size // self.config.num_attention_heads
        )
        cos, sin = both_halves(cos, dim), both_halves(sin, dim)
        if self.layer_types[layer] == NO_ROPE:  # the identity rotation, in the tables' shape
            return torch.ones_like(cos, dtype=torch.float32), torch.zeros_like(sin, dtype=torch.float32)
        return cos.float(), sin.float()


def _no_rope_flags(spec) -> dict:
    """The config field that marks layers without RoPE (SmolLM3's `no_rope_layers`: 1 = RoPE)."""
    no_rope = getattr(spec, "no_rope_layers", ())
    if not no_rope:
        return {}
    return {"no_rope_layers": [0 if i in no_rope else 1 for i in range(spec.num_layers)]}


def _module_name(model_type: str) -> str:
    # gemma3_text lives in transformers.models.gemma3; others are named after their type
    known = {"gemma3_text": "gemma3", "gemma2_text": "gemma2", "llama4_text": "llama4"}
    return known.get(model_type, model_type.replace("-", "_"))


def _module_device(module: torch.nn.Module, fallback: torch.device) -> torch.device:
    for buffer in module.buffers():
        return buffer.device
    return fallback
