"""The boundary: what a caller hands a public entry, checked where it enters, before any work.

    model(source, "source", optional=True)      a transformers model (get_input_embeddings, config)
    tokenizer(tok, "target_tokenizer")          a tokenizer (callable, decode, get_vocab)
    instance(bridge, "bridge", Bridge, "a bridgecache Bridge (Bridge.load, load_builtin)")
    ids(target_ids, "target_ids", vocab=320)    [batch, tokens] integer ids in 0..vocab-1
    mask(mask, "target_attention_mask", ids)    the ids' shape, 0 or 1
    path(value, "path")                         a str or PathLike the file system can look up
    integer(n, "lengths[0]", low=1, high=4096)  an int (not a bool) in [low, high]
    layer_indices(got, "selector.native_layers", 28)   a selector's answer: ints in 0..27
    same(engine.bridge, bridge, "engine", "bridge")    identity compared, never assumed

Every refusal names the argument, shows its value (`untrusted.shown`: escaped, at most ~60
characters) and says what was expected. A value of the wrong type raises `FieldTypeError` (a
TypeError that is also a ValueError, as the configuration objects' checks raise); a value of the
right type out of bounds raises ValueError; an object used with another it was not made for
raises `MismatchError` (a ValueError). The configuration objects check their fields with
`bridgecache.runtime.fields` and the entry points their texts, messages and configs with
`bridgecache.runtime.inputs`; both refuse with these types.

Every check here is O(1) in Python or one pass over a small tensor (ids' minimum and maximum):
nothing is allocated from the value before it is checked.

Knows plain Python values and tensors; nothing about bridges, caches or models' internals.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path

import torch

from bridgecache.untrusted import shown

__all__ = [
    "FieldTypeError",
    "MismatchError",
    "ids",
    "instance",
    "integer",
    "layer_indices",
    "mask",
    "model",
    "path",
    "same",
    "shown",
    "tokenizer",
]


class FieldTypeError(TypeError, ValueError):
    """A value of the wrong type (also a ValueError, as these checks raised before)."""


class MismatchError(ValueError):
    """An object used with another it was not made for (an engine of another bridge or model)."""


def _kind(value) -> str:
    return type(value).__name__


def instance(value, name: str, types, expected: str, *, optional: bool = False):
    """`value` if it is an instance of `types` (or None with `optional`); else FieldTypeError."""
    if (optional and value is None) or isinstance(value, types):
        return value
    also = " or None" if optional else ""
    raise FieldTypeError(f"{name}={shown(value)}; expected {expected}{also}, not a {_kind(value)}")


def model(value, name: str, *, optional: bool = False):
    """`value` if it looks like a transformers causal LM: a torch Module with `config` and
    `get_input_embeddings()` (None with `optional`); else FieldTypeError."""
    if optional and value is None:
        return value
    embeddings = callable(getattr(value, "get_input_embeddings", None))
    if isinstance(value, torch.nn.Module) and embeddings and getattr(value, "config", None) is not None:
        return value
    also = " or None" if optional else ""
    raise FieldTypeError(
        f"{name}={shown(value)}; expected a transformers causal LM (AutoModelForCausalLM, "
        f"bridgecache.load_model){also}, not a {_kind(value)}"
    )


def tokenizer(value, name: str, *, optional: bool = False):
    """`value` if it looks like a transformers tokenizer (callable, with `decode` or `get_vocab`:
    a fit reads only the vocabulary, a reply only decodes; None with `optional`); else
    FieldTypeError."""
    if optional and value is None:
        return value
    methods = any(callable(getattr(value, m, None)) for m in ("decode", "get_vocab"))
    if callable(value) and methods and not isinstance(value, type):
        return value
    also = " or None" if optional else ""
    raise FieldTypeError(
        f"{name}={shown(value)}; expected a transformers tokenizer (AutoTokenizer, "
        f"bridgecache.load_tokenizer){also}, not a {_kind(value)}"
    )


def integer(value, name: str, *, low: int | None = None, high: int | None = None, what: str = "an int"):
    """`value` as an int if it is an integer (not a bool or float) in [low, high]."""
    bounds = what + (f" >= {low}" if low is not None else "") + (f" <= {high}" if high is not None else "")
    if isinstance(value, (bool, float)):
        raise FieldTypeError(f"{name}={shown(value)}; expected {bounds}, not a {_kind(value)}")
    try:
        number = operator.index(value)
    except TypeError:
        raise FieldTypeError(f"{name}={shown(value)}; expected {bounds}, not a {_kind(value)}") from None
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name}={shown(number)}; expected {bounds}")
    return number


def ids(value, name: str, *, vocab: int | None = None, batch: int | None = None, optional: bool = False):
    """`value` if it is a [batch, tokens] tensor of integer ids, each in 0..vocab-1 (when `vocab`
    is known) and `batch` rows (when given); None with `optional`. One min/max pass over the ids:
    an id past the embedding would otherwise fail inside the model (an IndexError on the CPU, a
    device-side assert on CUDA that poisons the process)."""
    if optional and value is None:
        return value
    instance(value, name, torch.Tensor, "a torch.Tensor of token ids [batch, tokens]")
    if value.dim() != 2 or value.dtype in (torch.bool,) or value.is_floating_point() or value.is_complex():
        raise ValueError(
            f"{name} is a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; expected "
            "integer token ids of shape [batch, tokens]"
        )
    if batch is not None and value.shape[0] != batch:
        raise ValueError(f"{name} has {value.shape[0]} rows; expected {batch} (one per context)")
    if vocab is not None and value.numel():
        low, high = torch.stack(torch.aminmax(value)).tolist()  # one read back from the device
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            expected = f"ids in 0..{vocab - 1} (the model's vocabulary)"
            raise ValueError(f"{name} holds the id {bad}; expected {expected}")
    return value


def mask(value, name: str, like: torch.Tensor, *, optional: bool = True):
    """`value` if it is a 0/1 tensor of `like`'s shape (an attention mask of those ids)."""
    if optional and value is None:
        return value
    instance(value, name, torch.Tensor, f"a 0/1 torch.Tensor of shape {tuple(like.shape)}")
    if tuple(value.shape) != tuple(like.shape) or value.is_complex():
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}; expected {tuple(like.shape)} (a 0/1 mask of the ids' "
            f"shape, not {value.dtype})"
        )
    if value.numel() and not bool(((value == 0) | (value == 1)).all()):
        raise ValueError(f"{name} holds values other than 0 and 1; expected a 0/1 attention mask")
    return value


def path(value, name: str) -> Path:
    """`value` as a Path if it is a str or os.PathLike naming a path this system can look up: not
    empty, no NUL, at most 4,096 bytes and 255 bytes a component (else the lookup itself fails
    with an OSError that quotes the whole name). Whether it exists is the caller's question."""
    instance(value, name, (str, os.PathLike), "a path (str or os.PathLike)")
    try:
        raw = os.fsencode(value)
    except (UnicodeError, TypeError) as err:  # a lone surrogate the file system cannot encode
        raise ValueError(
            f"{name}={shown(value)}; expected a path the file system can encode ({err})"
        ) from None
    if not raw or b"\0" in raw:
        raise ValueError(f"{name}={shown(value)}; expected a non-empty path without NUL characters")
    if len(raw) > 4096 or any(len(part) > 255 for part in raw.split(b"/")):
        expected = "a path of at most 4,096 bytes and 255 a component"
        raise ValueError(f"{name}={shown(value)} ({len(raw):,} bytes); expected {expected}")
    return Path(os.fsdecode(raw))


def layer_indices(value, name: str, num_layers: int) -> tuple[int, ...]:
    """`value` (a selector's `native_layers()` answer, a user's list) as a tuple of layer indices,
    each an int in 0..num_layers-1; else FieldTypeError / ValueError naming `name`."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise FieldTypeError(
            f"{name} gave {shown(value)}; expected a tuple of target layer indices in 0..{num_layers - 1}, "
            f"not a {_kind(value)}"
        )
    items = list(value)
    if len(items) > num_layers:
        raise ValueError(f"{name} gave {len(items)} layers; the target has {num_layers}")
    return tuple(
        integer(item, f"{name}[{k}]", low=0, high=num_layers - 1, what="a target layer index")
        for k, item in enumerate(items)
    )


def same(used, expected, name: str, what: str) -> None:
    """Refuse `used` unless it IS `expected` (identity, not equality): `name`'s `what` was made
    for another object than the one it is used with."""
    if used is not expected:
        raise MismatchError(
            f"{name} was built for another {what} ({shown(used, 40)}) than the one given "
            f"({shown(expected, 40)}); pass the {what} it was built for, or build a new {name}"
        )
