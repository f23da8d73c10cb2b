"""Rotary position embeddings: tables from a model's own rotary module, rotate and un-rotate.

Keys in a transformers cache are stored AFTER RoPE. Bridges map keys in un-rotated space, so a
source key is un-rotated with the source's tables at source positions, mapped, and re-rotated
with the target's tables at target positions. The tables come from the model's own rotary module
(so every rope type and scaling transformers supports is honoured), per layer type where the
model has several (Gemma 3: "sliding_attention" base 1e4, "full_attention" base 1e6).

Which channels RoPE pairs is the model's `RotaryLayout` (bridgecache.models.layout): half-split
(j, j + R/2) or interleaved (2j, 2j + 1) over the leading R = rotary_dim channels of a head. The
tables `cos_sin` returns are the kernels' (bridgecache.kernels.rotary): [..., tokens, head_dim]
indexed by pair, the first half holding pair p's cos / sin and the second half repeating it, with
cos 1, sin 0 on the pass-through pairs. For Llama's layout (half-split over the whole head) they
are exactly transformers' tables and x_rot = x * cos + rotate_half(x) * sin; other layouts'
tables are rearranged from the model's own (Phi-3's [..., R], Cohere's repeat_interleave, GPT-OSS's
[..., R/2] with each frequency once, Llama 4's complex freqs_cis). Some
rope types scale cos and sin by an attention factor f; un-rotation divides by cos^2 + sin^2
(= f^2 per pair), so it is exact for every type. A layer without RoPE (SmolLM3's
`no_rope_layers`) gets cos = 1, sin = 0: rotating and un-rotating its keys leave them as they are.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect

import torch

from bridgecache.kernels.reference import rope_pairs, unrope_pairs
from bridgecache.models.code import modeling_module
from bridgecache.models.layout import RotaryLayout, rope_layers, rotary_layout, rotary_module
from bridgecache.models.spec import config_from_spec

__all__ = ["RopeTables", "rotate", "unrotate", "rotate_half", "cos_sin_of", "kept_rotary", "NO_ROPE"]

NO_ROPE = "no_rope"  # RopeTables.layer_types entry of a layer without rotary embeddings


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) over the two halves of the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def cos_sin_of(tables) -> tuple[torch.Tensor, torch.Tensor]:
    """What a rotary module returns (and hands its attention as `position_embeddings`) -> cos, sin:
    a (cos, sin) pair as it is, Llama 4's one complex table (freqs_cis = cos + i sin) split."""
    if isinstance(tables, torch.Tensor) and tables.is_complex():
        return tables.real, tables.imag
    return tables


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RotaryLayout | None = None
) -> torch.Tensor:
    """Apply RoPE. x: [batch, heads, tokens, d]; cos, sin: [batch or 1, tokens, d] (`cos_sin`'s);
    layout: the keys' RotaryLayout (None: half-split over the whole head)."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if _whole_half(layout, x.shape[-1]):
        return x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2
    return rope_pairs(x, cos[..., :half], sin[..., :half], layout)


def unrotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RotaryLayout | None = None
) -> torch.Tensor:
    """Undo `rotate`. x: [batch, heads, tokens, d]; cos, sin: [batch or 1, tokens, d]; layout as there."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if _whole_half(layout, x.shape[-1]):
        return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)
    half = x.shape[-1] // 2
    return unrope_pairs(x, cos[..., :half], sin[..., :half], layout)


def _whole_half(layout: RotaryLayout | None, head_dim: int) -> bool:
    return layout is None or (layout.kind == "half" and layout.rotary_dim == head_dim)


class RopeTables:
    """cos/sin tables of one model, by layer: `tables.cos_sin(layer, positions)`.

    Built from the model's own rotary module(s) (`RopeTables.from_model`), or from a config alone
    (`from_config`, `from_spec`: the rotary class of that model type, so a bridge can re-derive a
    source's tables without the source model). Computes in float32 on the module's device.

    layer_types: per layer, which tables it reads (layers with equal entries share them): its
    layer type, or NO_ROPE for a layer whose keys carry no RoPE.
    layout: the RotaryLayout of the model's keys (read from the model, its config, or a spec).
    """

    def __init__(
        self,
        config,
        rotary: torch.nn.Module,
        rotary_local: torch.nn.Module | None = None,
        layout: RotaryLayout | None = None,
    ):
        self.config = config
        self.rotary = rotary
        self.rotary_local = rotary_local  # older Gemma 3 layouts keep a second module
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layout = layout or rotary_layout(config)
        self._repeated: bool | None = None  # whether the module's tables repeat_interleave (Cohere)
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
        config = model.config.get_text_config()
        return cls(config, rotary, getattr(base, "rotary_emb_local", None), rotary_layout(model))

    @classmethod
    def from_config(cls, config) -> RopeTables:
        """Tables of a config alone: the text rotary class of the module that holds its causal-LM
        class (`modeling_module`; a multimodal module's vision or audio rotary is not the keys')."""
        name = modeling_module(config.model_type)
        if not name:
            raise ValueError(f"no causal-LM class for model type {config.model_type!r}")
        modeling = importlib.import_module(name)
        rotary_classes = [
            getattr(modeling, n)
            for n in dir(modeling)
            if n.endswith("RotaryEmbedding") and "Vision" not in n and "Audio" not in n
        ]
        if not rotary_classes:
            raise ValueError(f"transformers has no rotary embedding for model type {config.model_type!r}")
        return cls(config, rotary_classes[0](config=config))

    @classmethod
    def from_spec(cls, spec) -> RopeTables:
        """Tables of a `ModelSpec` (what a bridge records of each side), in its rotary layout."""
        config = config_from_spec(spec)
        tables = cls.from_config(config)
        tables.layout = spec.rotary
        return tables

    def to(self, device: torch.device) -> RopeTables:
        """A copy whose rotary modules live on `device` (this one is left where it is)."""
        local = self.rotary_local
        return RopeTables(
            self.config,
            copy.deepcopy(self.rotary).to(device),
            None if local is None else copy.deepcopy(local).to(device),
            self.layout,
        )

    def cos_sin(
        self, layer: int, positions: torch.Tensor, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [batch, tokens] (or [tokens]) -> cos, sin: [batch, tokens, head_dim] float32,
        indexed by pair (the module docstring).

        length: the number of positions of the forward these tables are for (None: positions.max()
            + 1). Some rope types pick their frequencies from the forward's largest position (longrope:
            long or short factors past original_max_position_embeddings; dynamic NTK: rescaled to the
            length), so a forward over context + prompt rotates the context's keys differently from
            a forward over the context alone: the tables here are the former's when `length` says so.
        The module is called on a copy: those rope types rewrite its frequencies in place, and the
        model's own module is left as it was.
        """
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        if self.layer_types[layer] == NO_ROPE:  # the identity rotation; the module may keep no tables
            ones = torch.ones(*positions.shape, self.head_dim, device=positions.device)
            return ones, torch.zeros_like(ones)
        layer_type = self._rotary_types[layer]
        rotary = self.rotary
        if layer_type == "sliding_attention" and self.rotary_local is not None:
            rotary = self.rotary_local
        device = _module_device(rotary, positions.device)
        positions = positions.to(device)
        tokens = positions.shape[1]
        if length is not None and tokens:  # one column more, at the forward's last position
            last = torch.full_like(positions[:, :1], length - 1)
            positions = torch.cat([positions, torch.maximum(last, positions.amax(1, keepdim=True))], 1)
        cos, sin = _call(rotary, positions, layer_type if self._takes_layer_type else None)
        return self.canonical(cos[:, :tokens].float(), sin[:, :tokens].float())

    def canonical(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own tables (as its rotary module returns them, or as it hands them to its
        attention; `cos_sin_of`) -> tables [..., head_dim] indexed by pair; Llama's layout
        (half-split over the whole head) as it is. The model's own hold each frequency twice
        ([..., rotary_dim]: cat(f, f) as Llama's and GLM's, repeat_interleave(f, 2) as Cohere's) or
        once ([..., rotary_dim / 2]: GPT-OSS's, Llama 4's complex table)."""
        kind, rotary_dim = self.layout
        width = cos.shape[-1]
        if width not in (rotary_dim, rotary_dim // 2):
            raise ValueError(
                f"{self.config.model_type}: its rotary tables have {width} channels, its rotary layout "
                f"{tuple(self.layout)} says {rotary_dim} (or {rotary_dim // 2}, each frequency once)"
            )
        once = width == rotary_dim // 2
        if not once and kind == "half" and rotary_dim == self.head_dim:
            return cos, sin
        if not once and self._repeated is None:
            self._repeated = _repeats_pairs(self, rotary_dim)
        pad = (self.head_dim - rotary_dim) // 2

        def pairs(table: torch.Tensor, fill: float) -> torch.Tensor:
            per_pair = table[..., 0::2] if self._repeated else table[..., : rotary_dim // 2]
            per_pair = table if once else per_pair
            per_pair = torch.cat((per_pair, per_pair.new_full((*per_pair.shape[:-1], pad), fill)), -1)
            return torch.cat((per_pair, per_pair), -1)

        return pairs(cos, 1.0), pairs(sin, 0.0)


def _repeats_pairs(tables: RopeTables, rotary_dim: int) -> bool:
    """Whether the rotary module lays its tables out as repeat_interleave(freqs, 2) (Cohere) rather
    than cat(freqs, freqs) (Llama, Phi-3, GLM): read from its tables at position 1, where every
    frequency differs from the next."""
    if rotary_dim <= 2:
        return False
    rotary = tables.rotary
    positions = torch.ones(1, 1, dtype=torch.long, device=_module_device(rotary, torch.device("cpu")))
    cos, _ = _call(rotary, positions, tables._rotary_types[0] if tables._takes_layer_type else None)
    return bool(torch.equal(cos[..., 0::2], cos[..., 1::2]))


def _call(rotary: torch.nn.Module, positions: torch.Tensor, layer_type: str | None):
    """cos, sin of `rotary` at positions [batch, tokens]; longrope and dynamic NTK rewrite the
    module's frequencies (and dynamic its cached length) as they run: computed by a copy of it."""
    if _rewrites(rotary):
        rotary = copy.deepcopy(rotary)
    probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
    with torch.no_grad():
        if layer_type is not None:
            return cos_sin_of(rotary(probe, positions, layer_type=layer_type))
        return cos_sin_of(rotary(probe, positions))


def _rewrites(rotary: torch.nn.Module) -> bool:
    """Whether a forward rewrites `rotary`'s frequencies after its length (longrope, dynamic NTK:
    the rope types transformers' `dynamic_rope_update` acts on)."""
    kinds = getattr(rotary, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return any("dynamic" in str(kind) or kind == "longrope" for kind in kinds)


def _module_device(module: torch.nn.Module, fallback: torch.device) -> torch.device:
    for buffer in module.buffers():
        return buffer.device
    return fallback


@contextlib.contextmanager
def kept_rotary(model):
    """Run a forward of the user's `model` and leave its rotary module(s) as they were: longrope
    and dynamic NTK rewrite their frequencies (in place, or as new buffers and attributes) at every
    forward, after the length of that forward; bridgecache's own forwards must not leave them so."""
    base = getattr(model, "model", model)
    # only those a forward rewrites: the others cost no copy on generate()'s first forward
    modules = [m for m in (rotary_module(model), getattr(base, "rotary_emb_local", None)) if m is not None]
    modules = [m for m in modules if _rewrites(m)]
    saved = [
        (m, dict(vars(m)), dict(m._buffers), {k: b.clone() for k, b in m._buffers.items() if b is not None})
        for m in modules
    ]
    try:
        yield
    finally:
        for module, attributes, buffers, values in saved:
            # attributes it added are kept: longrope's long frequencies, a function of the config
            # alone, which a captured graph may read
            vars(module).update(attributes)
            module._buffers.clear()
            module._buffers.update(buffers)
            for name, value in values.items():  # the same tensors (CUDA graphs read their address)
                buffers[name].copy_(value)
