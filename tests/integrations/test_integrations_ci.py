"""The engine import rule: a package .ci/run installed (BRIDGECACHE_REQUIRE) that does not
import FAILS the suite; one that is simply absent skips its tests."""

from __future__ import annotations

import sys

import pytest
from conftest import REQUIRE_VARIABLE, require_engine, require_program, required_engines


@pytest.fixture
def broken_package(tmp_path, monkeypatch):
    """An installed package whose import fails the way SGLang's did without orjson."""
    (tmp_path / "brokenengine").mkdir()
    (tmp_path / "brokenengine" / "__init__.py").write_text("import orjson_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "brokenengine"
    sys.modules.pop("brokenengine", None)


def test_a_required_engine_that_does_not_import_fails_the_suite(broken_package, monkeypatch):
    monkeypatch.setenv(REQUIRE_VARIABLE, f"sglang,{broken_package}")
    with pytest.raises(
        pytest.fail.Exception, match="brokenengine does not import.*orjson_that_is_not_installed"
    ):
        require_engine(broken_package)
    with pytest.raises(pytest.fail.Exception, match="submodule"):
        require_engine(f"{broken_package}.submodule")  # a submodule of a required package too


def test_an_engine_that_is_not_required_is_skipped(broken_package, monkeypatch):
    monkeypatch.setenv(REQUIRE_VARIABLE, "sglang")
    with pytest.raises(pytest.skip.Exception):
        require_engine(broken_package)
    monkeypatch.setenv(REQUIRE_VARIABLE, "no-such-program-here")
    with pytest.raises(pytest.fail.Exception, match="not on PATH"):
        require_program("no-such-program-here")
    monkeypatch.delenv(REQUIRE_VARIABLE)
    with pytest.raises(pytest.skip.Exception):
        require_program("no-such-program-here")


@pytest.mark.parametrize("name", sorted(required_engines()) or ["(none required here)"])
def test_every_engine_ci_installed_imports(name):
    """In CI (BRIDGECACHE_REQUIRE set by .ci/run) each named package imports / program exists."""
    if name == "(none required here)":
        pytest.skip(f"{REQUIRE_VARIABLE} is not set (only .ci/run sets it)")
    if name == "redis-server":
        require_program(name)
    else:
        require_engine(name)
