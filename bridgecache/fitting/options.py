"""Whether a model argument can possibly load, checked before any model is loaded.

`check_model_reference(name, builtin_names)` says why not (None if it may: a built-in name, an
existing model directory, or a string shaped like a hub id). The fitting options are checked by
`FitConfig` itself (bridgecache.bridge.recipe).

Knows paths and name shapes; nothing about models or statistics.
"""

from __future__ import annotations

import re

import bridgecache.checks as checks
from bridgecache.untrusted import shown

__all__ = ["check_model_reference"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_model_reference(name: str, builtin_names) -> str | None:
    """None if `name` may load (built-in, model directory, hub-id-shaped); else the reason."""
    if name in builtin_names:
        return None
    try:  # a name the file system cannot look up (too long, NUL, unencodable) is no directory
        path = checks.path(name, "model").expanduser()
    except ValueError as err:
        return str(err)
    reference, name = str(name), shown(name)  # in messages: escaped, cut
    if path.is_dir():
        if not (path / "config.json").exists():
            return f"{name} is a directory without config.json (not a saved transformers model)"
        return None
    if path.exists():
        return f"{name} is a file; expected a model directory"
    if _HUB_ID.match(reference) and ".." not in reference:
        return None
    return (
        f"{name} is neither a built-in name ({', '.join(builtin_names)}), an existing model "
        "directory, nor a hub id like 'Qwen/Qwen2.5-0.5B'"
    )
