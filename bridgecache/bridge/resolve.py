"""Where a bridge named by `Bridge.from_pretrained` lives on this machine.

    "some/dir"                                   a local bridge directory (kept as is)
    "builtin:qwen2.5-coder-1.5b->qwen2.5-coder-0.5b"   shipped with bridgecache
    "org/name"                                   a Hugging Face Hub repo (downloaded into its cache)

Knows the three kinds of names; loading and validation stay in `bridgecache.bridge.maps`.
"""

from __future__ import annotations

import re
from pathlib import Path

from bridgecache.bridge.builtin import PREFIX, builtin_dir, check_fingerprints

__all__ = ["resolve_bridge", "check_fingerprints", "is_hub_id"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(name: str) -> bool:
    """ "org/name" (one slash, Hub-safe characters) that is not a local path."""
    return bool(_HUB_ID.fullmatch(name)) and not Path(name).exists()


def resolve_bridge(
    name_or_path: str | Path,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
) -> Path:
    """A local directory holding bridge.json + bridge.safetensors for `name_or_path`."""
    text = str(name_or_path)
    if isinstance(name_or_path, str) and text.startswith(PREFIX):
        return builtin_dir(text)
    if isinstance(name_or_path, str) and is_hub_id(text):
        from bridgecache.bridge.hub import download

        return download(
            text, revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only
        )
    return Path(name_or_path)
