"""bridgecache.files' writers and removers: nothing half-written under a final name, nothing
deleted through a link, a damaged file set aside rather than tripped over forever."""

from __future__ import annotations

import os

import pytest

from bridgecache.files import (
    TEMP_PREFIX,
    DamagedFileWarning,
    RemovalError,
    remove_tree,
    replace_file,
    set_aside,
)
from bridgecache.models.manifest import is_current, manifest_problem, verify_folder, write_manifest


def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    replace_file(path, "old")
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        replace_file(path, "new" * 1000)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]
    replace_file(tmp_path / "fresh.json", b"{}")
    assert not list(tmp_path.glob(TEMP_PREFIX + "*"))


def test_a_damaged_file_is_set_aside_with_a_warning(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text("[1, 2]")
    with pytest.warns(DamagedFileWarning, match=r"costs.json was damaged \(a JSON list\); moved it"):
        aside = set_aside(path, "a JSON list")
    assert not path.exists() and aside.read_text() == "[1, 2]" and aside.name.startswith("costs.json.bad-")
    path.write_text("[3]")  # damaged again within the same second: a second name, nothing lost
    with pytest.warns(DamagedFileWarning):
        second = set_aside(path, "again")
    assert second != aside and second.read_text() == "[3]" and aside.read_text() == "[1, 2]"
    assert set_aside(tmp_path / "gone.json", "missing") is None  # another process moved it first


def test_remove_tree_never_follows_a_link(tmp_path):
    outside, root = tmp_path / "outside", tmp_path / "root"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "file").write_text("mine")
    (root / "a").mkdir(parents=True)
    os.symlink(outside / "keep", root / "a" / "link-to-folder")  # inside what is removed: the link goes
    os.symlink(outside, root / "via")
    with pytest.raises(RemovalError, match="is a link"):
        remove_tree(root / "via" / "keep", root)  # a link on the way: refused
    remove_tree(root / "a", root)
    assert not (root / "a").exists() and (outside / "keep" / "file").read_text() == "mine"
    remove_tree(root / "a", root)  # already gone: fine
    with pytest.raises(ValueError):
        remove_tree(outside, root)  # not under the root: a caller's bug, never deleted


@pytest.mark.parametrize(
    "files",
    [
        [1, 2],
        {"model.gguf": [5, "x"]},
        {"model.gguf": {"size": "5", "sha256": "0" * 64}},
        {"../../etc/passwd": {"size": 5, "sha256": "0" * 64}},
        {"model.gguf": {"size": 5, "sha256": "zz"}},
    ],
)
def test_a_manifest_of_the_wrong_shape_is_a_reason_not_a_crash(tmp_path, files):
    """A model folder whose manifest parses but has the wrong shape is built again (the zoo acts
    on verify_folder's reason) and is not proof that the folder is bridgecache's."""
    import json

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    write_manifest(tmp_path)
    assert manifest_problem(tmp_path) is None and verify_folder(tmp_path) is None and is_current(tmp_path)
    (tmp_path / ".manifest.json").write_text(json.dumps({"format": "bridgecache.manifest/1", "files": files}))
    assert "is unreadable" in manifest_problem(tmp_path)
    assert "is unreadable" in verify_folder(tmp_path) and not is_current(tmp_path)
