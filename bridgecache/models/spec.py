"""ModelSpec: the identity of a model as far as a bridge cares (shapes, rope, tokenizer).

A bridge records the spec of its source and target; applying it to other models is refused
with the name of the field that differs. Built from a transformers config (+ tokenizer).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import json
import weakref
from dataclasses import asdict, dataclass, replace

import bridgecache.checks as checks
from bridgecache.models.layout import (
    ROTARY_KINDS,
    RotaryLayout,
    UnsupportedArchitectureError,
    check_supported,
    layer_windows,
    rope_layers,
    rotary_layout,
)
from bridgecache.models.zoo import builtin_name
from bridgecache.untrusted import shown

__all__ = [
    "ModelSpec",
    "model_spec",
    "tokenizer_fingerprint",
    "SpecMismatchError",
    "WeightMismatchWarning",
    "SPEC_LIMITS",
    "check_spec_dict",
    "spec_from_untrusted",
    "config_from_spec",
]

# Upper bounds of a spec's counts. Real models are far inside them (the largest open models have
# ~128 layers, 128 heads, head_dim 256, hidden size 25,600, 10M positions); a value beyond them
# comes from a corrupted or hostile file.
SPEC_LIMITS = {
    "num_layers": 1024,
    "num_kv_heads": 4096,
    "num_q_heads": 4096,
    "head_dim": 4096,
    "hidden_size": 2**20,
    "max_position_embeddings": 2**31,
    "sliding_window": 2**31,
    "bos_token_id": 2**31 - 1,
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


class SpecMismatchError(ValueError):
    """A bridge was used with a model it was not fitted for."""


class WeightMismatchWarning(UserWarning):
    """A model has the bridge's architecture but not the weights the bridge was fitted on."""


@dataclass(frozen=True)
class ModelSpec:
    """What a bridge needs to know about one side of the handoff."""

    name: str  # informative only (zoo name, hub id or path); not compared
    model_type: str
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    hidden_size: int
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention", one per layer
    sliding_window: int | None
    rope: str  # canonical JSON of the rope parameters (per layer type where there are several)
    max_position_embeddings: int
    tokenizer: str = ""  # fingerprint of the vocabulary; "" when unknown
    bos_token_id: int | None = None
    no_rope_layers: tuple[int, ...] = ()  # layers whose keys carry no RoPE (SmolLM3); older files: none
    # which channels RoPE pairs (bridgecache.models.layout.RotaryLayout); None, and files written
    # before the field: the half-split over the whole head
    rotary: RotaryLayout | None = None

    def __post_init__(self):
        if self.rotary is None:
            object.__setattr__(self, "rotary", RotaryLayout.whole(self.head_dim))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["no_rope_layers"] = list(self.no_rope_layers)
        d["rotary"] = self.rotary._asdict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["layer_types"] = tuple(known["layer_types"])
        known["no_rope_layers"] = tuple(known.get("no_rope_layers", ()))
        if known.get("rotary") is not None:
            known["rotary"] = RotaryLayout(**known["rotary"])
        return cls(**known)

    def mismatches(self, other: ModelSpec) -> list[str]:
        """Fields (other than `name`) that differ, as 'field: expected X, got Y' strings."""
        if all(getattr(self, f) == getattr(other, f) for f in self.__dataclass_fields__ if f != "name"):
            return []  # the usual case, checked once per handoff: no asdict() copies
        out = []
        for key, expected in self.to_dict().items():
            got = other.to_dict()[key]
            if key == "name" or expected == got:
                continue
            if key == "tokenizer" and "" in (expected, got):
                continue  # one side was built without a tokenizer
            out.append(f"{key}: expected {_short(expected)}, got {_short(got)}")
        return out

    def check(self, other: ModelSpec, role: str) -> None:
        """Raise SpecMismatchError naming every differing field."""
        diffs = self.mismatches(other)
        if diffs:
            raise SpecMismatchError(
                f"this bridge was fitted for {role} model {self.name!r} ({self.model_type}), but the "
                f"{role} model given ({other.name!r}) differs: " + "; ".join(diffs)
            )


def _recorded_name(config) -> str:
    """What a bridge records of a model it was not given a name for: the built-in name of a zoo
    model (never its cache folder's path), else the path or hub id it was loaded from, else its
    model type."""
    path = getattr(config, "_name_or_path", "") or ""
    return builtin_name(path) or path or config.model_type


def model_spec(model_or_config, tokenizer=None, name: str | None = None) -> ModelSpec:
    """Spec of a transformers model (or config) and, optionally, its tokenizer.

    Raises UnsupportedArchitectureError (layer, feature, what is supported) for a model a bridge
    cannot translate exactly (`bridgecache.models.layout.check_supported`)."""
    config = getattr(model_or_config, "config", model_or_config)
    if not callable(getattr(config, "get_text_config", None)):
        raise checks.FieldTypeError(
            f"model_or_config={checks.shown(model_or_config)}; expected a transformers model or its "
            f"config, not a {type(model_or_config).__name__}"
        )
    checks.tokenizer(tokenizer, "tokenizer", optional=True)
    check_supported(model_or_config)
    config = config.get_text_config()
    n = config.num_hidden_layers
    heads = config.num_attention_heads
    windows = layer_windows(config)  # the layout the target's own cache keeps
    layer_types = tuple("full_attention" if w is None else "sliding_attention" for w in windows)
    rope = getattr(config, "rope_parameters", None)  # 5.x: no rope_theta; a dict per layer type (Gemma 3)
    bos = getattr(config, "bos_token_id", None)
    if isinstance(bos, list):
        bos = bos[0]
    spec = ModelSpec(
        name=name or _recorded_name(config),
        model_type=config.model_type,
        num_layers=n,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        num_q_heads=heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden_size=config.hidden_size,
        layer_types=layer_types,
        sliding_window=next((w for w in windows if w is not None), None),
        rope=json.dumps(rope, sort_keys=True, default=str),
        max_position_embeddings=config.max_position_embeddings,
        tokenizer=tokenizer_fingerprint(tokenizer) if tokenizer is not None else "",
        bos_token_id=bos,
        no_rope_layers=tuple(i for i, rotary in enumerate(rope_layers(config)) if not rotary),
        rotary=rotary_layout(model_or_config),
    )
    try:  # a bridge re-derives each side's rotary tables from its spec: refuse what cannot be
        _config_from_spec(_unnamed(spec))
    except Exception as error:  # noqa: BLE001 - transformers' own validation, whatever it raises
        raise UnsupportedArchitectureError(
            config.model_type, None, "a config transformers cannot rebuild from the model's spec",
            f"{type(error).__name__}: {error}",
        ) from None  # fmt: skip
    return spec


def config_from_spec(spec: ModelSpec):
    """A transformers config of the spec's model type with its shapes, layer layout and rope
    parameters: enough for that type's rotary module (a bridge re-derives a side's tables from the
    spec alone). A fresh copy per call; ValueError where the class builds another layer count
    from them (HRM counts each attention call of its recurrent stacks as a layer)."""
    return copy.deepcopy(_config_from_spec(_unnamed(spec)))


def _unnamed(spec: ModelSpec) -> ModelSpec:
    """The spec without what a config does not hold: one memo entry per architecture."""
    return replace(spec, name="", tokenizer="", bos_token_id=None)


@functools.lru_cache(maxsize=64)  # a handoff rebuilds its source's; configs cost ~1 ms
def _config_from_spec(spec: ModelSpec):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[spec.model_type]
    fields = dict(
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_q_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        layer_types=list(spec.layer_types),
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters=json.loads(spec.rope),
    )
    original = fields["rope_parameters"] or {}
    if "original_max_position_embeddings" in original and _takes(cls, "original_max_position_embeddings"):
        # Phi-3's class overwrites the rope parameters' value with its own field (default 4096)
        fields["original_max_position_embeddings"] = original["original_max_position_embeddings"]
    if spec.no_rope_layers:  # SmolLM3's field: 1 marks a RoPE layer
        fields["no_rope_layers"] = [0 if i in spec.no_rope_layers else 1 for i in range(spec.num_layers)]
    # what the class derives and cannot take (Falcon's head_dim: a property of hidden size and heads)
    derived = {k for k in fields if _read_only(cls, k)}
    config = cls(**{k: v for k, v in fields.items() if k not in derived})
    if config.num_hidden_layers != spec.num_layers:
        raise ValueError(
            f"{spec.model_type}: its config turns num_hidden_layers={spec.num_layers} into "
            f"{config.num_hidden_layers}"
        )
    return config


def _takes(cls, name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


def _read_only(cls, name: str) -> bool:
    attribute = inspect.getattr_static(cls, name, None)
    return isinstance(attribute, property) and attribute.fset is None


# tokenizer -> (len(tokenizer), fingerprint). Hashing a 150k vocabulary costs ~0.6 s of CPU and
# handoff() checks the pair's tokenizers on every call; adding tokens changes len(), which
# invalidates the entry.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer) -> str:
    """16 hex digits of sha256 over the vocabulary (token -> id) and the special tokens."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    try:
        known_size, known = _FINGERPRINTS[tokenizer]
        if known_size == size:
            return known
    except (KeyError, TypeError):  # TypeError: an object that cannot be weakly referenced
        pass
    vocab = sorted(tokenizer.get_vocab().items())
    specials = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    payload = json.dumps([vocab, specials], ensure_ascii=False).encode()
    fingerprint = hashlib.sha256(payload).hexdigest()[:16]
    with contextlib.suppress(TypeError):
        _FINGERPRINTS[tokenizer] = (size, fingerprint)
    return fingerprint


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_spec_dict(spec, role: str, fail) -> None:
    """Check a spec read from a file (bridge.json, a KV file's header) field by field, with bounds;
    `fail(field, value, expected)` raises. A missing field is reported with the value None."""
    if not isinstance(spec, dict):
        fail(role, spec, "an object describing a model")
    for key in (
        "num_layers",
        "num_kv_heads",
        "num_q_heads",
        "head_dim",
        "hidden_size",
        "max_position_embeddings",
    ):
        _int(fail, f"{role}.{key}", spec.get(key), 1, SPEC_LIMITS[key])
    for key, limit in (("model_type", 200), ("rope", 65536), ("name", 4096), ("tokenizer", 200)):
        value = spec.get(key, "" if key in ("name", "tokenizer") else None)
        if not isinstance(value, str) or len(value) > limit:
            fail(f"{role}.{key}", value, f"a string of at most {limit:,} characters")
    try:
        rope = json.loads(spec["rope"])
    except (ValueError, RecursionError):
        rope = ...
    if not (rope is None or isinstance(rope, dict)):
        fail(f"{role}.rope", spec["rope"], "the JSON text of an object (the rope parameters) or null")
    types = spec.get("layer_types")
    if (
        not isinstance(types, list)
        or len(types) != spec["num_layers"]
        or any(t not in _LAYER_TYPES for t in types)
    ):
        fail(f"{role}.layer_types", types, f"a list of {spec['num_layers']} of {_LAYER_TYPES}")
    if spec.get("sliding_window") is not None:
        _int(
            fail,
            f"{role}.sliding_window",
            spec["sliding_window"],
            1,
            SPEC_LIMITS["sliding_window"],
            "null or ",
        )
    if spec.get("bos_token_id") is not None:
        _int(fail, f"{role}.bos_token_id", spec["bos_token_id"], 0, SPEC_LIMITS["bos_token_id"], "null or ")
    no_rope = spec.get("no_rope_layers", [])  # absent from files written before the field
    if (
        not isinstance(no_rope, list)
        or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < spec["num_layers"] for i in no_rope
        )
        or no_rope != sorted(set(no_rope))
    ):
        fail(
            f"{role}.no_rope_layers",
            no_rope,
            f"an ascending list of distinct layer indices in [0, {spec['num_layers']})",
        )

    rotary = spec.get("rotary")  # absent from files written before the field: the half-split
    if rotary is not None:
        expected = (
            f'an object {{"kind": one of {list(ROTARY_KINDS)}, "rotary_dim": an even integer in '
            f"[2, {spec['head_dim']}]}}"
        )
        if not isinstance(rotary, dict) or set(rotary) != {"kind", "rotary_dim"}:
            fail(f"{role}.rotary", rotary, expected)
        dim = rotary["rotary_dim"]
        if (
            rotary["kind"] not in ROTARY_KINDS
            or not isinstance(dim, int)
            or isinstance(dim, bool)
            or dim % 2
            or not 2 <= dim <= spec["head_dim"]
        ):
            fail(f"{role}.rotary", rotary, expected)


def spec_from_untrusted(d) -> ModelSpec:
    """A ModelSpec from a dict read from a file, every field checked (ValueError names it)."""

    def fail(field: str, value, expected: str):
        raise ValueError(f"field {field!r} is {shown(value)} ({type(value).__name__}); expected {expected}")

    check_spec_dict(d, "model", fail)
    return ModelSpec.from_dict(d)


def _int(fail, field: str, value, low: int, high: int, prefix: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        fail(field, value, f"{prefix}an integer in [{low}, {high:,}]")
