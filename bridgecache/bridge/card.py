"""The bridge card: README.md beside every saved bridge, like a PEFT adapter's model card.

YAML front matter (what the Hub indexes and `huggingface_hub.metadata_load` reads): source,
target, method, calibration, held-out scores and the command that made the bridge; then a short
human-readable body (what it maps, how to load it, the per-layer table).
Knows a Bridge's fields; nothing about where the card is uploaded.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from bridgecache.untrusted import printable

__all__ = ["CARD", "card_metadata", "render_card", "write_card"]

CARD = "README.md"
# Calibration entries worth a reader's eye (the rest stays in bridge.json).
_CALIBRATION_KEYS = ("text", "domain", "split", "num_sequences", "seq_len", "seed", "rows", "description")


def card_metadata(bridge) -> dict:
    """The card's front matter as a plain dict (YAML-safe: no NaN, no tensors)."""
    from bridgecache.bridge.recipe import RecipeError, recipe_command, recipe_of

    try:
        command = recipe_command(recipe_of(bridge))
    except RecipeError:
        command = bridge.calibration.get("command", "unknown (no recipe recorded)")
    calibration = {k: bridge.calibration[k] for k in _CALIBRATION_KEYS if k in bridge.calibration}
    meta = {
        "library_name": "bridgecache",
        "tags": ["bridgecache", "kv-cache", "kv-cache-transfer"],
        "source": bridge.source.name,
        "target": bridge.target.name,
        "method": bridge.method,
        "alignment_policy": bridge.alignment_policy,
        "native_head": bridge.native_head,
        "calibration": calibration,
        "heldout_scores": _scores(bridge),
        "command": command,
        "parameters": bridge.num_parameters(),
    }
    if "fingerprints" in bridge.calibration:
        meta["fingerprints"] = bridge.calibration["fingerprints"]
    return meta


def render_card(bridge) -> str:
    """README.md text: YAML front matter + body."""
    from bridgecache.bridge.summary import markdown_summary

    meta = card_metadata(bridge)
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    source, target = bridge.source.name, bridge.target.name
    body = (
        f"# Bridge {source} -> {target}\n\n"
        f"Maps the KV cache of `{source}` into the cache space of `{target}` "
        f"with per-layer affine maps ({bridge.method}), so the target continues from a context the "
        "source has read without reading it again.\n\n"
        "```python\nfrom bridgecache import Bridge\n\n"
        'bridge = Bridge.from_pretrained("REPO_OR_DIR")\n```\n\n'
        f"{markdown_summary(bridge)}\n\n"
        f"Made with:\n\n```bash\n{meta['command']}\n```\n"
    )
    return printable(f"---\n{front}---\n\n{body}", lines=True)  # names and recipe come from a file


def write_card(bridge, directory: str | Path) -> Path:
    """Write README.md into `directory` (by rename: never half a card); returns its path."""
    from bridgecache.files import replace_file

    return replace_file(Path(directory) / CARD, render_card(bridge))


def _scores(bridge) -> dict:
    """Held-out R^2 of keys and values: mean and per target layer (None where not measured)."""
    keys = [_clean(layer.r2_key) for layer in bridge.layers]
    values = [_clean(layer.r2_value) for layer in bridge.layers]
    return {
        "metric": "held-out R^2 per target layer",
        "key_mean": _mean(keys),
        "value_mean": _mean(values),
        "key": keys,
        "value": values,
    }


def _clean(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 4)


def _mean(xs: list) -> float | None:
    known = [x for x in xs if x is not None]
    return round(sum(known) / len(known), 4) if known else None
