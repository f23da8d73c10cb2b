"""ModelSpec: the identity of a model as far as a bridge cares (shapes, rope, tokenizer).

A bridge records the spec of its source and target; applying it to other models is refused
with the name of the field that differs. Built from a transformers config (+ tokenizer).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import weakref
from dataclasses import asdict, dataclass

__all__ = ["ModelSpec", "model_spec", "tokenizer_fingerprint", "SpecMismatchError"]


class SpecMismatchError(ValueError):
    """A bridge was used with a model it was not fitted for."""


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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        known["layer_types"] = tuple(known["layer_types"])
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


def model_spec(model_or_config, tokenizer=None, name: str | None = None) -> ModelSpec:
    """Spec of a transformers model (or config) and, optionally, its tokenizer."""
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config()
    n = config.num_hidden_layers
    heads = config.num_attention_heads
    layer_types = tuple(getattr(config, "layer_types", None) or ["full_attention"] * n)
    rope = getattr(config, "rope_parameters", None)  # 5.x: no rope_theta; a dict per layer type (Gemma 3)
    bos = getattr(config, "bos_token_id", None)
    if isinstance(bos, list):
        bos = bos[0]
    return ModelSpec(
        name=name or getattr(config, "_name_or_path", "") or config.model_type,
        model_type=config.model_type,
        num_layers=n,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        num_q_heads=heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden_size=config.hidden_size,
        layer_types=layer_types,
        sliding_window=getattr(config, "sliding_window", None)
        if "sliding_attention" in layer_types
        else None,
        rope=json.dumps(rope, sort_keys=True, default=str),
        max_position_embeddings=config.max_position_embeddings,
        tokenizer=tokenizer_fingerprint(tokenizer) if tokenizer is not None else "",
        bos_token_id=bos,
    )


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
