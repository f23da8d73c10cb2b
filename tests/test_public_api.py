"""The public names: one list (`bridgecache.__all__`), each importable, nothing public left off it."""

from __future__ import annotations

import bridgecache


def test_all_lists_every_public_name_once_and_each_imports():
    names = bridgecache.__all__
    assert len(names) == len(set(names)), "a name listed twice"
    for name in names:
        assert getattr(bridgecache, name) is not None, name
    public = {
        n
        for n, v in vars(bridgecache).items()
        if not n.startswith("_") and not isinstance(v, type(bridgecache))
    }
    assert public - set(names) == set(), f"public but not in __all__: {sorted(public - set(names))}"


def test_the_engine_is_public():
    for name in ("HandoffEngine", "clear_engines", "UnsupportedArchitectureError", "BridgedCache", "handoff"):
        assert name in bridgecache.__all__


def test_moved_module_paths_still_import_with_a_deprecation_warning():
    import importlib
    import sys
    import warnings

    from bridgecache._moved import MOVED

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert any(new in str(w.message) and w.category is DeprecationWarning for w in caught), old
