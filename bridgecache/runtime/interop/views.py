"""Our own views of the user's models: they run bridgecache's forwards and change nothing of theirs.

Two of bridgecache's forwards need an attention function of our own (`bridgecache.runtime.
attention`): the native-work pass and a model's reading of a prompt. transformers picks a module's
attention function from its config (`config._attn_implementation`) at every forward, so switching
it on the user's config, even for one call, changes what a `generate()` in another thread runs.
Instead a `ModelView` is a twin of the model's module tree: every module shallow-copied, every
parameter and buffer shared (no weight is copied), each config replaced by a copy whose attention
implementation is ours. Forwards through the twin run our attention; the user's tree is never
touched, so their forwards, in any thread, run as they always do. Instance-level forwards bound to
a module (accelerate's device hooks, `torch.compile` wrappers of a submodule) are re-bound to its
twin, so device placement behaves as in the original.

    view = ModelView(model)
    view.model(...)                     # the twin: our attention in every layer
    view.decoder_through(layers)        # the twin's decoder stopping after its first `layers`

`generate_view(model, forward)` is the other half: a shallow copy of the top-level model whose
`forward` is `forward` (its submodules are the user's own): `generate()` on it runs transformers'
loop with our first forward, and every other forward through the user's model itself.

Knows transformers' module and config conventions; nothing about bridges or caches.
"""

from __future__ import annotations

import copy
import functools
import types

import torch
from transformers import PretrainedConfig

from bridgecache.models.code import decoder_of

__all__ = ["FALLBACK", "ModelView", "generate_view"]

FALLBACK = "_bridgecache_fallback"  # on our config copies: the implementation the user's config names

# Containers a Module keeps per instance. A twin gets copies, so registering a hook or assigning a
# buffer on the twin (transformers' output recorders, dynamic RoPE) never reaches the original.
_PER_MODULE = (
    "_parameters", "_buffers", "_non_persistent_buffers_set", "_forward_hooks", "_forward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
    "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip


class ModelView:
    """A twin of `model` whose attention modules call bridgecache's attention function (see the
    module docstring). `attention`: the implementation name our config copies carry."""

    def __init__(self, model: torch.nn.Module, attention: str):
        self.original = model
        configs: dict[int, PretrainedConfig] = {}
        twins: dict[int, torch.nn.Module] = {}
        self.model = _twin(model, twins, configs, attention)
        for config in configs.values():  # sub-configs (text_config, ...) point at their copies too
            for name, value in list(vars(config).items()):
                if isinstance(value, PretrainedConfig) and id(value) in configs:
                    config.__dict__[name] = configs[id(value)]
        self.configs = list(configs.values())
        decoder = decoder_of(model)
        self.decoder = None if decoder is None else twins[id(decoder)]
        self._through: dict[int, torch.nn.Module] = {}

    def layer_stack(self) -> torch.nn.ModuleList | None:
        """The twin decoder's `layers` list, where it keeps them in one it loops over."""
        stack = getattr(self.decoder, "layers", None)
        return stack if isinstance(stack, torch.nn.ModuleList) else None

    def decoder_through(self, layers: int) -> torch.nn.Module:
        """The twin's decoder running only its first `layers` layers (a later layer cannot change
        what an earlier one attended to): a copy of the twin decoder with a shorter `layers` list,
        made once per count."""
        if layers not in self._through:
            decoder = copy.copy(self.decoder)
            decoder.__dict__["_modules"] = dict(self.decoder._modules)
            decoder._modules["layers"] = torch.nn.ModuleList(list(self.layer_stack())[:layers])
            self._through[layers] = decoder
        return self._through[layers]


def _twin(module, twins: dict, configs: dict, attention: str):
    """The twin of `module` and (recursively) of its submodules; shared submodules stay shared."""
    if id(module) in twins:
        return twins[id(module)]
    twin = copy.copy(module)
    twins[id(module)] = twin
    state = twin.__dict__
    for name in _PER_MODULE:
        if name in state:
            state[name] = copy.copy(state[name])
    state["_modules"] = type(module._modules)(
        (name, None if child is None else _twin(child, twins, configs, attention))
        for name, child in module._modules.items()
    )
    for name, value in list(state.items()):
        if isinstance(value, PretrainedConfig):
            state[name] = _config_copy(value, configs, attention)
        elif isinstance(value, types.MethodType) and value.__self__ is module:
            state[name] = types.MethodType(value.__func__, twin)
        elif isinstance(value, functools.partial) and value.args and value.args[0] is module:
            state[name] = functools.partial(value.func, twin, *value.args[1:], **value.keywords)
    return twin


def _config_copy(config: PretrainedConfig, configs: dict, attention: str) -> PretrainedConfig:
    if id(config) not in configs:
        ours = copy.copy(config)
        ours.__dict__[FALLBACK] = config._attn_implementation or "sdpa"
        ours._attn_implementation_internal = attention
        configs[id(config)] = ours
    return configs[id(config)]


def generate_view(model: torch.nn.Module, forward) -> torch.nn.Module:
    """A shallow copy of `model` (its submodules, weights and config are the user's own) whose
    `forward` is `forward`, with hook containers of its own (empty: `forward` calls the user's model,
    whose hooks then run once). What `generate()` writes on the model lands on the copy."""
    view = copy.copy(model)
    state = view.__dict__
    for name in _PER_MODULE:
        if name in state and name not in ("_parameters", "_buffers", "_non_persistent_buffers_set"):
            state[name] = type(state[name])()
    state["forward"] = forward
    return view
