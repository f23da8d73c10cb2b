"""What a model's own modeling code does, read from transformers' registry and its source: no
configs, no weights, nothing about bridges.

    modeling_module(model_type)     the module that holds the type's causal-LM class
    module_pairing(module name)     the channel pairing its rotate_half applies
    attention_code(class)           its attention's calls of transformers' attention function, and
                                    whether it rotates only under a condition on its window
    rope_on_sliding_only(type)      the latter for any attention class of the type's module
    decoder_of(model)               the decoder stack a causal LM runs input_ids through
    QUERY_PROJECTIONS               where bridgecache reads a layer's queries from

bridgecache.models.layout turns these into layouts and refusals.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap

import torch

__all__ = [
    "QUERY_PROJECTIONS",
    "attention_code",
    "decoder_of",
    "modeling_module",
    "module_pairing",
    "rope_on_sliding_only",
]

# Where a layer's queries come from, as bridgecache recomputes them (the fit's attention weights,
# its held-out scores): q_proj; Phi-3's fused qkv_proj, queries first; query_key_value, per KV head
# its query heads, key and value (GPT-NeoX, Falcon); q_gate_proj, per head [query | gate] (MiniCPM5).
QUERY_PROJECTIONS = ("q_proj", "qkv_proj", "query_key_value", "q_gate_proj")


@functools.cache
def attention_code(attention_class) -> tuple[int, bool]:
    """What an attention class's own `forward` does, read from its source: how many times it calls
    transformers' attention function (`attention_interface(...)`, `eager_attention_forward(...)`,
    `ALL_ATTENTION_FUNCTIONS[...](...)`), and whether it rotates (a call naming "rotary") only
    under a condition on its window: one naming "sliding", or an attribute its `__init__` sets from
    one (AFMoE's `is_local_attention`). Without source: one call, no condition."""
    forward, own = _parsed(attention_class.forward), _parsed(attention_class)
    if forward is None:
        return 1, False
    # the class's own source, not its __init__'s: a decorator may wrap that (AFMoE's kernels)
    nodes = ast.walk(own) if own is not None else ()
    inits = [n for n in nodes if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    windowed = {"sliding"} | {
        ast.unparse(target)
        for init in inits
        for node in ast.walk(init)
        if isinstance(node, ast.Assign) and "sliding" in ast.unparse(node.value)
        for target in node.targets
    }
    calls, sliding_only = 0, False
    for node in ast.walk(forward):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            calls += name in ("attention_interface", "eager_attention_forward") or (
                name.startswith("ALL_ATTENTION_FUNCTIONS[")
            )
        if isinstance(node, ast.If) and any(w in ast.unparse(node.test) for w in windowed):
            body = ast.Module(body=node.body, type_ignores=[])
            sliding_only |= any(
                isinstance(n, ast.Call) and "rotary" in ast.unparse(n.func) for n in ast.walk(body)
            )
    return calls, sliding_only


def _parsed(function_or_class):
    """The syntax tree of a function's or class's source, or None where it has none."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function_or_class)))
    except (OSError, TypeError, SyntaxError):
        return None


@functools.cache
def rope_on_sliding_only(model_type: str) -> bool:
    """Whether the attention of `model_type`'s modeling module rotates only under a condition on
    its window (`attention_code`; Cohere 2: "if self.sliding_window is not None")."""
    try:
        module = importlib.import_module(modeling_module(model_type))
    except (ImportError, ValueError):
        return False
    return any(
        attention_code(cls)[1]
        for name, cls in vars(module).items()
        if inspect.isclass(cls) and name.endswith("Attention") and cls.__module__ == module.__name__
    )


def decoder_of(model) -> torch.nn.Module | None:
    """A causal LM's decoder stack (what runs input_ids to hidden states without the vocabulary
    head): its `get_decoder()` where that takes input_ids (ModernBERT-decoder's returns its output
    projection, which it names `decoder`), else its base model; None where it has neither."""
    get = getattr(model, "get_decoder", None)
    for decoder in (get() if callable(get) else None, getattr(model, "base_model", None)):
        if isinstance(decoder, torch.nn.Module) and decoder is not model and _takes_input_ids(decoder):
            return decoder
    return None


def _takes_input_ids(module: torch.nn.Module) -> bool:
    try:
        return "input_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


@functools.cache
def modeling_module(model_type: str) -> str:
    """The name of the transformers module that holds the causal-LM class of `model_type` (the
    registry's `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: EXAONE and InternLM3 run Llama's code, Aria's
    text model lives in `aria`); "" where transformers has none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    try:
        return getattr(transformers, class_name).__module__ if class_name else ""
    except (AttributeError, ImportError):  # a class that cannot be imported here
        return ""


@functools.cache
def module_pairing(name: str) -> str:
    """The pairing the modeling module `name`'s own rotation applies, read by applying it to
    [0, 1, 2, 3]: "half" for (-2, -3, 0, 1), "interleaved" for (-1, 0, -3, 2), "half" where the
    module has no rotation of its own; else what it gave (a rotation bridgecache does not know)."""
    try:
        module = importlib.import_module(name)
    except (ImportError, ValueError):  # ValueError: no module ("")
        return "half"
    rotate_half = getattr(module, "rotate_half", None)
    complex_rotation = getattr(module, "apply_rotary_emb", None)
    if rotate_half is not None:
        turned = rotate_half(torch.arange(4.0)).tolist()
    elif complex_rotation is not None:
        # Llama 4: x [batch, tokens, heads, dim] times freqs_cis [batch, tokens, dim / 2], a quarter turn
        x, quarter = torch.arange(4.0).view(1, 1, 1, 4), torch.full((1, 1, 2), 1j)
        try:
            turned = complex_rotation(x, x, quarter)[0].flatten().tolist()
        except (TypeError, RuntimeError, ValueError):  # some other function of that name
            return "half"
    else:
        return "half"
    known = {(-2.0, -3.0, 0.0, 1.0): "half", (-1.0, 0.0, -3.0, 2.0): "interleaved"}
    return known.get(tuple(turned), str([round(v, 3) for v in turned]))
