"""Writing files so that a reader never sees half of one, with the modes a user expects.

`staged_directory(target)` yields an empty temporary directory beside `target`; when the block
succeeds, its files move into `target` (a missing target is created by one rename), and when it
fails nothing of it is left. `apply_umask(path)` gives files and folders the process umask's
mode: safetensors and `tempfile` create 0600 files and 0700 folders, which other users of a
shared cache could not read. `writable_destination(path)` checks, before any long work, that a
file or folder could be created at `path`.

Knows nothing about bridges, models or caches.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["STAGING_PREFIX", "apply_umask", "current_umask", "staged_directory", "writable_destination"]

STAGING_PREFIX = ".bridgecache-staging-"


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: the classic read-by-setting (restored at once)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """chmod `path` (and everything under it) to 0666 / 0777 minus the umask, as open()/mkdir() would."""
    path, mask = Path(path), current_umask()
    paths = [path] + (sorted(path.rglob("*")) if path.is_dir() else [])
    for p in paths:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


@contextmanager
def staged_directory(target: str | Path) -> Iterator[Path]:
    """Yield an empty folder to write into; on success its files land in `target`.

    A missing `target` appears in one rename, complete. An existing `target` keeps any other
    files; each staged file replaces its namesake by rename, in sorted order except that files
    named `*.json` move last, so metadata is never newer than the data it describes. On any
    error (or a kill: the staging folder is hidden and starts with STAGING_PREFIX, for cleanup)
    `target` is untouched.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} exists and is not a directory")
    home = target if target.is_dir() else target.parent  # same filesystem: renames are atomic
    home.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=home))
    try:
        yield staging
        apply_umask(staging)
        if not target.exists():
            try:
                os.replace(staging, target)
                return
            except OSError:
                if not target.is_dir():  # not a race with another writer: a real failure
                    raise
        for item in sorted(staging.iterdir(), key=lambda p: (p.suffix == ".json", p.name)):
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def writable_destination(path: str | Path) -> str | None:
    """None if a folder could be created (or written) at `path`; otherwise the reason, in words."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{path} exists and is a file, not a directory"
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, so {path} cannot be created under it"
    try:  # os.access is not enough: root passes it on read-only mounts' neighbours, ACLs differ
        probe = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=ancestor)
        os.rmdir(probe)
    except OSError as err:
        return f"cannot write in {ancestor} ({err.strerror or err})"
    return None
