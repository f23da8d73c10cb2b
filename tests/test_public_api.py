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
