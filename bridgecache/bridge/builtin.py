"""Built-in bridges: fitted maps shipped inside the package, for pairs of the zoo's models.

    Bridge.from_pretrained("builtin:qwen2.5-coder-1.5b->qwen2.5-coder-0.5b")

Each lives in `bridgecache/bridges/<source>--<target>/` as an ordinary bridge directory whose
tensors are float16 (half the bytes of float32; loading upcasts) and whose `calibration` carries
`fingerprints`: for each side, the zoo name, the zoo's pin of its GGUF file and the tokenizer's
fingerprint. A bridge with fingerprints refuses to load when this bridgecache's zoo pins another
file under that name, and refuses to be applied to a zoo model converted from another file or to a
tokenizer with another vocabulary. `bridgecache.bridge.export.export_builtin` turns a fitted
bridge directory into that form.

Knows the zoo's pins (`bridgecache.models.zoo.BUILTIN_MODELS`); nothing about caches or fitting.
"""

from __future__ import annotations

import re
from pathlib import Path

from bridgecache.bridge.format import BridgeFormatError
from bridgecache.models.spec import SpecMismatchError

__all__ = [
    "PREFIX",
    "builtin_root",
    "builtin_names",
    "builtin_dir",
    "zoo_fingerprint",
    "model_fingerprint",
    "check_fingerprints",
    "check_models",
]

PREFIX = "builtin:"


def builtin_root() -> Path:
    """The folder of shipped bridges (package data)."""
    return Path(__file__).resolve().parents[1] / "bridges"


def builtin_names() -> list[str]:
    """Names of the shipped bridges, "source->target"."""
    root = builtin_root()
    dirs = sorted(p for p in root.iterdir() if (p / "bridge.json").exists()) if root.exists() else []
    return [p.name.replace("--", "->", 1) for p in dirs]


def builtin_dir(name: str) -> Path:
    """Directory of the built-in bridge `name` ("source->target", with or without "builtin:")."""
    name = name.removeprefix(PREFIX)
    if not re.fullmatch(r"[\w.-]+->[\w.-]+", name):
        raise BridgeFormatError(
            f"built-in bridge name {name!r}: expected 'SOURCE->TARGET', e.g. {_example()}"
        )
    directory = builtin_root() / name.replace("->", "--")
    if not (directory / "bridge.json").exists():
        known = ", ".join(builtin_names()) or "none in this installation"
        raise FileNotFoundError(f"no built-in bridge {name!r}; shipped: {known}")
    return directory


def zoo_fingerprint(name: str) -> str:
    """The zoo's pin of a built-in model's file: its assembled GGUF's sha256."""
    from bridgecache.models.zoo import BUILTIN_MODELS

    return f"sha256:{BUILTIN_MODELS[name].sha256}"


def model_fingerprint(model) -> str | None:
    """The GGUF sha256 a zoo-converted model was made from (its `.complete` marker), else None."""
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    marker = Path(path) / ".complete" if path else None
    if marker is None or not marker.is_file():
        return None
    text = marker.read_text().strip()
    return f"sha256:{text}" if re.fullmatch(r"[0-9a-f]{64}", text) else None


def check_fingerprints(bridge, where: str | Path = "bridge") -> None:
    """Refuse a bridge whose recorded zoo models are not the files this bridgecache pins."""
    from bridgecache.models.zoo import BUILTIN_MODELS

    recorded = bridge.calibration.get("fingerprints")
    if not recorded:
        return
    for role in ("source", "target"):
        entry = recorded[role]
        name = entry["zoo"]
        if name not in BUILTIN_MODELS:
            raise SpecMismatchError(
                f"{where}: fitted on {role} model {name!r}, which this bridgecache's zoo does not know "
                f"(known: {', '.join(BUILTIN_MODELS)})"
            )
        if zoo_fingerprint(name) != entry["gguf"]:
            raise SpecMismatchError(
                f"{where}: fitted on {role} model {name!r} from file {entry['gguf']}, but this "
                f"bridgecache's {name!r} is {zoo_fingerprint(name)}; fit it again with "
                f"`bridgecache fit --recipe {where} --out DIR`"
            )


def check_models(bridge, source=None, target=None, source_tokenizer=None, target_tokenizer=None) -> None:
    """Refuse models or tokenizers other than the ones `bridge` was fitted on: what every entry
    point that is given models calls (handoff, handoff_batch, Conversation.handoff, eval, demo).

    Any bridge: each given side's spec, with its tokenizer's fingerprint when given
    (SpecMismatchError; `Bridge.check`), and its weights (WeightMismatchWarning for another
    checkpoint of the same architecture). A built-in bridge also refuses a zoo model converted
    from another GGUF than the one it was fitted on.
    """
    bridge.check(source, target, source_tokenizer=source_tokenizer, target_tokenizer=target_tokenizer)
    recorded = bridge.calibration.get("fingerprints")
    if not recorded:
        return
    for role, model in (("source", source), ("target", target)):
        made_from = model_fingerprint(model) if model is not None else None
        if made_from is not None and made_from != recorded[role]["gguf"]:
            raise SpecMismatchError(
                f"this bridge was fitted on {role} model {recorded[role]['zoo']!r} from "
                f"{recorded[role]['gguf']}, but the {role} model given was converted from {made_from}"
            )


def _example() -> str:
    return "'builtin:qwen2.5-coder-1.5b->qwen2.5-coder-0.5b'"
