"""Integrity of a folder of files: a manifest of sizes and sha256, checked once per change.

`write_manifest(folder)` records every file's size and sha256 (`.manifest.json`) and a stamp of
their sizes and modification times (`.verified.json`). `is_current(folder)` is the cheap test (a
few `stat` calls, writes nothing): every file still has the size and mtime of the last full
check. `verify_folder(folder)` is the full one: it hashes every file against the manifest and
on success stamps the folder again; it returns None when the folder is intact, else the reason.
Callers that share a folder between processes run `verify_folder` under their own lock.

An edit that keeps a file's size and restores its mtime is seen only by `verify_folder`.

Knows nothing about models: the zoo uses it for converted model folders.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from bridgecache.files import current_umask

__all__ = ["MANIFEST", "STAMP", "file_sha256", "is_current", "leftovers", "verify_folder", "write_manifest"]

MANIFEST, STAMP = ".manifest.json", ".verified.json"
_FORMAT = "bridgecache.manifest/1"


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            hasher.update(block)
    return hasher.hexdigest()


def write_manifest(folder: Path, **info) -> None:
    """Record every file under `folder` (but the manifest and stamp) with its size and sha256."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, STAMP)):
        files[path.relative_to(folder).as_posix()] = {
            "size": path.stat().st_size,
            "sha256": file_sha256(path),
        }
    _write_json(folder / MANIFEST, {"format": _FORMAT, **info, "files": files})
    _write_json(folder / STAMP, _stat_table(folder, files))


def is_current(folder: Path) -> bool:
    """True if the manifest is readable and every file matches the stamp of the last full check."""
    files = _manifest_files(folder)
    if not isinstance(files, dict):
        return False
    try:
        return json.loads((folder / STAMP).read_text()) == _stat_table(folder, files)
    except (OSError, ValueError):
        return False


def verify_folder(folder: Path) -> str | None:
    """Hash every file against the manifest; None (and a fresh stamp) if intact, else the reason."""
    files = _manifest_files(folder)
    if isinstance(files, str):
        return files
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want.get("size"):
            return f"{path} has {path.stat().st_size} bytes; the manifest says {want.get('size')}"
        if file_sha256(path) != want.get("sha256"):
            return f"{path} fails its sha256 (modified or corrupted)"
    _write_json(folder / STAMP, _stat_table(folder, files))
    return None


def leftovers(folder: Path) -> list[Path]:
    """Temporary files of manifest or stamp writes that a killed process left in `folder`."""
    return [p for name in (MANIFEST, STAMP) for p in folder.glob(f".{name}-*")]


def _manifest_files(folder: Path) -> dict | str:
    """The manifest's file table, or the reason it cannot be read."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != _FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
        return files
    except FileNotFoundError:
        return f"{folder / MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{folder / MANIFEST} is unreadable ({err})"


def _stat_table(folder: Path, files: dict) -> dict:
    """{name: [size, mtime_ns]} of the listed files (None where a file is missing)."""
    table = {}
    for name in files:
        try:
            st = (folder / name).stat()
            table[name] = [st.st_size, st.st_mtime_ns]
        except OSError:
            table[name] = None
    return table


def _write_json(path: Path, data: dict) -> None:
    """Write by rename: a reader (or a kill) never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
