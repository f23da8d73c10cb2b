"""A bridge per (source, target, FitConfig), fitted on first use and cached on disk.

Cache: $BRIDGECACHE_HOME/bridges/<source>-to-<target>-<method>[-<hash of the other settings>]/.
A cached bridge that fails to load (a damaged file) is set aside (`<folder>.bad-<time>`, with a
DamagedFileWarning) and fitted again.
"""

from __future__ import annotations

import hashlib
import json
import sys

from bridgecache.bridge.recipe import FitConfig

__all__ = ["bridge_for"]


def bridge_for(
    source_name: str,
    target_name: str,
    config: FitConfig | None = None,
    source=None,
    target=None,
    *,
    progress: bool = True,
):
    """A cached bridge for two built-in/hub models, fitted (and cached) on first use.

    The config is part of the cache key: a bridge fitted with other settings is never returned
    for it. source, target: the models, if already loaded (else loaded by name).
    """
    from bridgecache.bridge.format import BridgeFormatError
    from bridgecache.bridge.maps import Bridge
    from bridgecache.files import set_aside
    from bridgecache.fitting import fit_bridge
    from bridgecache.models.zoo import cache_root, load_model

    config = config or FitConfig()
    directory = cache_root() / "bridges" / _bridge_dir_name(source_name, target_name, config)
    if (directory / "bridge.json").exists():
        try:
            return Bridge.from_pretrained(directory)
        except (BridgeFormatError, OSError) as err:  # damaged: fitted again, not a failure forever
            set_aside(directory, str(err)[:200])
    source, source_tok = (source, None) if source is not None else load_model(source_name)
    target, target_tok = (target, None) if target is not None else load_model(target_name)
    from bridgecache.models.zoo import load_tokenizer

    source_tok = source_tok or load_tokenizer(source_name)
    target_tok = target_tok or load_tokenizer(target_name)
    print(
        f"fitting a bridge {source_name} -> {target_name} ({config.label}; once, cached in {directory})",
        file=sys.stderr,
    )
    bridge = fit_bridge(source, target, source_tok, target_tok, config, progress=progress)
    bridge.save_pretrained(directory)
    return bridge


def _bridge_dir_name(source_name: str, target_name: str, config: FitConfig) -> str:
    """`A-to-B-method`, plus a hash of the other settings that differ from the defaults (none:
    the defaults, so the folder of a default fit keeps its name)."""
    safe = lambda name: name.replace("/", "--")  # noqa: E731
    name = f"{safe(source_name)}-to-{safe(target_name)}-{config.method}"
    settings = {k: v for k, v in config.changes().items() if k != "method"}
    if settings:
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
        name += f"-{digest[:12]}"
    return name
