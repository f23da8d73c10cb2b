"""`bridgecache cache` and bridgecache.models.cache_dir: list the cache directory, remove entries,
clear it; never anything bridgecache did not write."""

from __future__ import annotations

import io

import pytest

from bridgecache.cli import main
from bridgecache.models import cache_dir
from bridgecache.models.zoo import ZooError


def _file(path, size: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A cache root holding one of each kind of entry, and one thing that is not bridgecache's."""
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path))
    _file(tmp_path / "models" / "smollm2-135m" / "model.gguf", 3000)
    _file(tmp_path / "models" / "smollm2-135m" / "config.json", 100)
    _file(tmp_path / "bridges" / "a-to-b-fullhead" / "bridge.json", 50)
    _file(tmp_path / "bridges" / "a-to-b-fullhead" / "bridge.safetensors", 950)
    _file(tmp_path / "bridges" / "quality" / "pair-fullhead-1234" / "bridge.json", 10)
    _file(tmp_path / "wheels" / "gemma3-270m" / "part1.whl", 700)
    _file(tmp_path / "gguf" / "gemma3-270m.gguf", 800)
    _file(tmp_path / "needle" / "controls.json", 20)
    _file(tmp_path / "route-costs" / "3b047b397c103ef67621e502.json", 30)
    _file(tmp_path / "locks" / "smollm2-135m.lock", 0)
    _file(tmp_path / "my-notes" / "todo.txt", 5)
    return tmp_path


def test_every_entry_is_listed_with_its_size_and_use(home):
    entries = {e.name: e for e in cache_dir.cache_entries()}
    assert set(entries) == {
        "models/smollm2-135m",
        "bridges/a-to-b-fullhead",
        "bridges/quality/pair-fullhead-1234",
        "wheels/gemma3-270m",
        "gguf/gemma3-270m.gguf",
        "needle",
        "route-costs",
        "locks",
        "my-notes",
    }
    assert entries["models/smollm2-135m"].size == 3100 and entries["models/smollm2-135m"].kind == "model"
    assert 'load_model("smollm2-135m")' in entries["models/smollm2-135m"].used_by
    assert (
        entries["bridges/a-to-b-fullhead"].size == 1000
        and entries["bridges/a-to-b-fullhead"].kind == "bridge"
    )
    assert entries["route-costs"].kind == "timing" and entries["route-costs"].size == 30
    assert entries["my-notes"].kind == "other" and not entries["my-notes"].removable
    assert all(e.last_used > 0 for e in entries.values())


def test_remove_takes_a_listed_name_or_a_model_name_and_nothing_else(home):
    assert cache_dir.remove_entry("smollm2-135m").name == "models/smollm2-135m"
    assert not (home / "models" / "smollm2-135m").exists()
    cache_dir.remove_entry("bridges/a-to-b-fullhead")
    assert not (home / "bridges" / "a-to-b-fullhead").exists()
    assert (home / "bridges" / "quality" / "pair-fullhead-1234" / "bridge.json").exists()
    with pytest.raises(ZooError, match=r"no cache entry 'qwen' in .*there is: bridges/quality"):
        cache_dir.remove_entry("qwen")
    with pytest.raises(ZooError, match="not bridgecache's"):
        cache_dir.remove_entry("my-notes")
    assert (home / "my-notes" / "todo.txt").exists()


def test_clear_removes_what_bridgecache_wrote_and_leaves_the_rest(home):
    removed = cache_dir.clear()
    assert "my-notes" not in {e.name for e in removed} and len(removed) == 8
    assert [e.name for e in cache_dir.cache_entries()] == ["my-notes"]
    assert (home / "my-notes" / "todo.txt").read_bytes() == b"xxxxx"


def test_the_command_lists_and_removes_only_when_told_to(home, capsys, monkeypatch):
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "models/smollm2-135m" in out and "3.1 kB" in out and "9 entries" in out and str(home) in out
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no terminal to ask on: refuse
    assert main(["cache", "rm", "smollm2-135m"]) == 2
    assert "nothing removed (give --yes" in capsys.readouterr().err
    assert (home / "models" / "smollm2-135m").exists()
    assert main(["cache", "rm", "smollm2-135m", "wheels/gemma3-270m", "--yes"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert not (home / "models" / "smollm2-135m").exists() and not (home / "wheels" / "gemma3-270m").exists()
    assert main(["cache", "rm", "nothing-here", "-y"]) == 2
    assert "no cache entry 'nothing-here'" in capsys.readouterr().err
    assert main(["cache", "clear", "--yes"]) == 0
    assert [p.name for p in home.iterdir() if any(p.rglob("*.*"))] == ["my-notes"]


def test_an_empty_or_missing_cache_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path / "never-made"))
    assert main(["cache", "ls"]) == 0
    assert "is empty" in capsys.readouterr().out
    assert main(["cache", "clear", "-y"]) == 0
    assert "nothing to remove" in capsys.readouterr().out
