"""`bridgecache cache` and bridgecache.models.cache_dir: list the cache directory, remove entries,
clear it; never anything bridgecache did not write."""

from __future__ import annotations

import io
import json
import os

import pytest

from bridgecache.cli import main
from bridgecache.files import RemovalError
from bridgecache.models import cache_dir
from bridgecache.models.manifest import write_manifest
from bridgecache.models.zoo import ZooError


def _file(path, size: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def _model_folder(folder, size: int = 3000):
    """A model folder as the zoo leaves it: its files and a manifest of them."""
    _file(folder / "model.gguf", size)
    _file(folder / "config.json", 100)
    write_manifest(folder, source="test")


def _bridge(folder, size: int):
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": "bridgecache.bridge"}).encode()
    (folder / "bridge.json").write_bytes(text + b" " * (size - len(text)))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A cache root holding one of each kind of entry, and one thing that is not bridgecache's."""
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path))
    _model_folder(tmp_path / "models" / "smollm2-135m")
    _bridge(tmp_path / "bridges" / "a-to-b-fullhead", 50)
    _file(tmp_path / "bridges" / "a-to-b-fullhead" / "bridge.safetensors", 950)
    _bridge(tmp_path / "bridges" / "quality" / "pair-fullhead-1234", 40)
    _file(tmp_path / "wheels" / "gemma3-270m" / "part1.whl", 700)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "gemma3-270m.gguf").write_bytes(b"GGUF" + b"x" * 796)
    _file(tmp_path / "needle" / "controls.json", 20)
    key = "3b047b397c103ef67621e502"
    _file(tmp_path / "route-costs" / f"{key}.json", 0)
    (tmp_path / "route-costs" / f"{key}.json").write_text(json.dumps({"key": key}))
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
    assert entries["models/smollm2-135m"].kind == "model"
    assert entries["models/smollm2-135m"].size > 3100  # its files, the manifest and the stamp
    assert 'load_model("smollm2-135m")' in entries["models/smollm2-135m"].used_by
    assert (
        entries["bridges/a-to-b-fullhead"].size == 1000
        and entries["bridges/a-to-b-fullhead"].kind == "bridge"
    )
    assert entries["route-costs"].kind == "timing" and entries["route-costs"].size == 35
    assert entries["my-notes"].kind == "other" and not entries["my-notes"].removable
    assert entries["needle"].kind == "benchmark" and not entries["needle"].removable  # no mark of ours
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
    assert "my-notes" not in {e.name for e in removed} and len(removed) == 7
    assert [e.name for e in cache_dir.cache_entries()] == ["needle", "my-notes"]
    assert (home / "my-notes" / "todo.txt").read_bytes() == b"xxxxx"


def test_the_command_lists_and_removes_only_when_told_to(home, capsys, monkeypatch):
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "models/smollm2-135m" in out and "9 entries" in out and str(home) in out
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
    assert sorted(p.name for p in home.iterdir() if any(p.rglob("*.*"))) == ["my-notes", "needle"]


def test_an_empty_or_missing_cache_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BRIDGECACHE_HOME", str(tmp_path / "never-made"))
    assert main(["cache", "ls"]) == 0
    assert "is empty" in capsys.readouterr().out
    assert main(["cache", "clear", "-y"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_a_folder_under_models_without_our_manifest_is_never_deleted(home):
    """A user's own fine-tune in models/ (the root pointed there by mistake) is not bridgecache's."""
    mine = home / "models" / "my-finetune"
    _file(mine / "model.safetensors", 100)
    _file(home / "models" / "qwen2.5-coder-0.5b" / "config.json", 10)  # a built-in's name, no manifest
    entries = {e.name: e for e in cache_dir.cache_entries()}
    assert entries["models/my-finetune"].kind == "other"
    assert entries["models/qwen2.5-coder-0.5b"].kind == "other"
    with pytest.raises(ZooError, match="not bridgecache's"):
        cache_dir.remove_entry("models/my-finetune")
    cache_dir.clear()
    assert (mine / "model.safetensors").read_bytes() == b"x" * 100
    assert (home / "models" / "qwen2.5-coder-0.5b" / "config.json").exists()
    assert not (home / "models" / "smollm2-135m").exists()


def test_nothing_is_listed_or_deleted_through_a_link(tmp_path, monkeypatch):
    """models/, a model folder, bridges/ or a cost table that is a link: its target is never touched."""
    outside, root = tmp_path / "outside", tmp_path / "root"
    _model_folder(outside / "models" / "smollm2-135m")
    _bridge(outside / "bridge", 30)
    (outside / "costs").mkdir()
    (outside / "costs" / "3b047b397c103ef67621e502.json").write_text('{"key": "3b047b397c103ef67621e502"}')
    before = sorted(p for p in outside.rglob("*"))
    root.mkdir()
    monkeypatch.setenv("BRIDGECACHE_HOME", str(root))
    os.symlink(outside / "models", root / "models")
    (root / "bridges").mkdir()
    os.symlink(outside / "bridge", root / "bridges" / "linked")
    os.symlink(outside / "costs", root / "route-costs")
    entries = {e.name: e for e in cache_dir.cache_entries()}
    assert {e.kind for e in entries.values()} == {"other"}, entries
    assert cache_dir.clear() == []
    assert sorted(p for p in outside.rglob("*")) == before
    # and a link planted between listing and deleting is refused, not followed
    (root / "models").unlink()
    _model_folder(root / "models" / "smollm2-135m")
    entry = next(e for e in cache_dir.cache_entries() if e.name == "models/smollm2-135m")
    os.rename(root / "models", root / "models-real")
    os.symlink(outside / "models", root / "models")
    with pytest.raises(RemovalError, match="is a link"):
        cache_dir._delete(root, entry)
    assert sorted(p for p in outside.rglob("*")) == before


def test_a_failed_removal_is_reported_as_a_failure(home, monkeypatch, capsys):
    """What could not be deleted is named, the command exits 1, and the rest still goes."""
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):  # the filesystem refuses one file (as root, chmod cannot)
        if os.fspath(path).endswith("part1.whl"):
            raise PermissionError(13, "Permission denied")
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    assert main(["cache", "clear", "--yes"]) == 1
    captured = capsys.readouterr()
    assert "not removed: wheels/gemma3-270m: could not delete" in captured.err
    assert "part1.whl (Permission denied)" in captured.err
    assert "removed 6 of 7" in captured.out and "removed 7 entries" not in captured.out
    assert (home / "wheels" / "gemma3-270m" / "part1.whl").exists()
    assert not (home / "models" / "smollm2-135m").exists()
    with pytest.raises(cache_dir.CacheRemovalError, match="Permission denied"):
        cache_dir.remove_entry("wheels/gemma3-270m")


def test_leftovers_and_foreign_files_in_our_folders_are_told_apart(home):
    """A killed writer's hidden temporary file goes with clear; a file of the user's beside it stays."""
    (home / "route-costs" / ".bridgecache-tmp-abc123").write_text("{")
    (home / "route-costs" / "notes.txt").write_text("mine")
    (home / "gguf" / "notes.gguf").write_text("mine")
    (home / "wheels" / "gemma3-270m" / "readme.txt").write_text("mine")
    entries = {e.name: e for e in cache_dir.cache_entries()}
    assert entries["route-costs/notes.txt"].kind == "other" and entries["gguf/notes.gguf"].kind == "other"
    assert entries["wheels/gemma3-270m"].kind == "other"  # not only wheels: not provably ours
    cache_dir.clear()
    assert sorted(p.name for p in (home / "route-costs").iterdir()) == ["notes.txt"]
    assert (home / "gguf" / "notes.gguf").exists()
    assert (home / "wheels" / "gemma3-270m" / "readme.txt").exists()
