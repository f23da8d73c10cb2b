"""A bridge per (source, target, method, fit settings), fitted on first use and cached on disk.

Cache: $BRIDGECACHE_HOME/bridges/<source>-to-<target>-<method>[-<hash of the fit settings>]/.
"""

from __future__ import annotations

import hashlib
import json
import sys

__all__ = ["bridge_for"]


def bridge_for(source_name: str, target_name: str, method: str, source=None, target=None, **fit_kwargs):
    """A cached bridge for two built-in/hub models, fitted (and cached) on first use.

    fit_kwargs (see `bridgecache.fitting.fit_bridge`) are part of the cache key: a bridge fitted
    with other settings is never returned for these.
    """
    from bridgecache.bridge.maps import Bridge
    from bridgecache.fitting import fit_bridge
    from bridgecache.models.zoo import cache_root, load_model

    directory = cache_root() / "bridges" / _bridge_dir_name(source_name, target_name, method, fit_kwargs)
    if (directory / "bridge.json").exists():
        return Bridge.from_pretrained(directory)
    source, source_tok = (source, None) if source is not None else load_model(source_name)
    target, target_tok = (target, None) if target is not None else load_model(target_name)
    from bridgecache.models.zoo import load_tokenizer

    source_tok = source_tok or load_tokenizer(source_name)
    target_tok = target_tok or load_tokenizer(target_name)
    print(
        f"fitting a {method} bridge {source_name} -> {target_name} (once; cached in {directory})",
        file=sys.stderr,
    )
    bridge = fit_bridge(source, target, source_tok, target_tok, method=method, **fit_kwargs)
    bridge.save_pretrained(directory)
    return bridge


def _bridge_dir_name(source_name: str, target_name: str, method: str, fit_kwargs: dict) -> str:
    """`A-to-B-method`, plus a hash of the fit settings that change the bridge (none: the defaults)."""
    safe = lambda name: name.replace("/", "--")  # noqa: E731
    name = f"{safe(source_name)}-to-{safe(target_name)}-{method}"
    settings = {k: v for k, v in fit_kwargs.items() if k != "progress"}  # progress bars change nothing
    if settings:
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
        name += f"-{digest[:12]}"
    return name
