"""`bridgecache.kernels` for a bridgecache/ imported straight from a source checkout.

The repository keeps its kernels in the top-level folder kernels/, which installs as
bridgecache/kernels/ (setuptools package-dir); an editable install maps the name to the folder.
Python started in the repository root imports bridgecache/ from the checkout, ahead of any
installed copy, and there a normal install (or none) leaves `bridgecache.kernels` unanswered.
Importing this module (bridgecache/__init__.py does it first) appends a finder that answers that
one name from the checkout's kernels/: appended last, so an install's own answer comes first.

Knows file paths; nothing else.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__all__ = ["install"]

PACKAGE = Path(__file__).resolve().parent
KERNELS = PACKAGE.parent / "kernels"


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "bridgecache.kernels":
            return None
        init = KERNELS / "__init__.py"
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(KERNELS)])


def install() -> None:
    """Append the finder once per process, in a checkout only (an installed bridgecache/ holds
    kernels/ itself; beside it may lie anything, Hugging Face's `kernels` among them)."""
    checkout = (PACKAGE.parent / "pyproject.toml").is_file() and (KERNELS / "__init__.py").is_file()
    if not checkout or (PACKAGE / "kernels").exists():
        return
    if not any(isinstance(finder, _CheckoutFinder) for finder in sys.meta_path):
        sys.meta_path.append(_CheckoutFinder())


install()
