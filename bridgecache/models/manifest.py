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
import re
from pathlib import Path

from bridgecache.files import TEMP_PREFIX, replace_file

__all__ = [
    "MANIFEST",
    "STAMP",
    "file_sha256",
    "is_current",
    "leftovers",
    "manifest_problem",
    "verify_folder",
    "write_manifest",
]

MANIFEST, STAMP = ".manifest.json", ".verified.json"
_FORMAT = "bridgecache.manifest/1"
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


def manifest_problem(folder: Path) -> str | None:
    """None if `folder` holds a well-formed manifest of this format (not checked against the
    files: `verify_folder` does that), else the reason. Proves the folder is bridgecache's."""
    files = _manifest_files(folder)
    return files if isinstance(files, str) else None


def leftovers(folder: Path) -> list[Path]:
    """Temporary files of manifest or stamp writes that a killed process left in `folder`."""
    older = [p for name in (MANIFEST, STAMP) for p in folder.glob(f".{name}-*")]  # earlier versions' names
    return older + list(folder.glob(TEMP_PREFIX + "*"))


def _manifest_files(folder: Path) -> dict | str:
    """The manifest's file table, or the reason it cannot be read."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != _FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
        for name, want in files.items():  # every entry of the shape write_manifest gives it
            want = want if isinstance(want, dict) else {}
            size, sha = want.get("size"), want.get("sha256")
            sized = isinstance(size, int) and not isinstance(size, bool) and size >= 0
            relative = not name.startswith("/") and ".." not in Path(name).parts
            if not (sized and isinstance(sha, str) and _SHA256.fullmatch(sha) and relative):
                raise ValueError(f"entry {name[:80]!r} is not a relative name with a size and a sha256")
        return files
    except FileNotFoundError:
        return f"{folder / MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
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
    replace_file(path, json.dumps(data, indent=1))
