"""Modules that moved: their old import paths keep working, with a DeprecationWarning naming the new one.

`install()` (called by `bridgecache/__init__.py`) appends a finder to `sys.meta_path` that answers
only the names below: an old name becomes an alias of the new module in `sys.modules`. Paths
removed earlier (0.1.0's flat modules) are listed in CHANGELOG.md instead.

Knows module names; nothing else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install"]

MOVED = {  # old -> new (2026-12-03: runtime/ by phase)
    "bridgecache.runtime.attention": "bridgecache.runtime.interop.attention",
    "bridgecache.runtime.graphs": "bridgecache.runtime.interop.graphs",
    "bridgecache.runtime.static": "bridgecache.runtime.interop.static",
    "bridgecache.runtime.translator": "bridgecache.runtime.translation.translator",
    "bridgecache.runtime.translate": "bridgecache.runtime.translation.layers",
    "bridgecache.runtime.grouped": "bridgecache.runtime.translation.grouped",
    "bridgecache.runtime.native": "bridgecache.runtime.native_work.layers",
    "bridgecache.runtime.native_pass": "bridgecache.runtime.native_work.forward",
    "bridgecache.runtime.plan": "bridgecache.runtime.native_work.plan",
    "bridgecache.runtime.pending": "bridgecache.runtime.native_work.pending",
    "bridgecache.runtime.reading": "bridgecache.runtime.selection.reading",
    "bridgecache.runtime.words": "bridgecache.runtime.selection.words",
    # 2026-12-07: the entry points over an engine in their own room (runtime/ keeps 12 at its top)
    "bridgecache.runtime.handoff": "bridgecache.runtime.entry.handoff",
    "bridgecache.runtime.batch": "bridgecache.runtime.entry.batch",
    "bridgecache.runtime.conversation": "bridgecache.runtime.entry.conversation",
    "bridgecache.runtime.likelihood": "bridgecache.runtime.entry.likelihood",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} has moved to {self.new}; import it from there", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:  # the new module is loaded already
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        return None if new is None else importlib.util.spec_from_loader(name, _Alias(new))


def install() -> None:
    """Answer the old names (once per process)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
