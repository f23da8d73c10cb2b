"""Writing files so that a reader never sees half of one, with the modes a user expects.

    with staging_folder(folder) as staging:   # hidden, unpredictable name, locked while we live
        write(staging / "x")
        publish(staging / "x", folder / "final")   # one rename (or, exclusive=True, one link)

`staging_folder(folder)` makes an empty hidden folder (`STAGING_PREFIX` + random) in `folder`
and holds an exclusive `flock` on it for as long as the writer lives (on the folder: a library
that replaces a file it writes, as safetensors does, cannot drop the lock); `publish` fsyncs a
file, gives it the umask's mode and renames it into place (atomic, same filesystem;
`exclusive=True` links instead, so an existing file is never replaced). A killed writer leaves
its staging folder behind, unlocked: `clean_leftovers(folder)` removes exactly those (a live
writer's is locked, so it is kept), and every save and load of bridgecache's files calls it.
`directory_lock(folder)` serialises the short commit steps of writers that must not interleave
(a `flock` on the folder itself: no lock file). `apply_umask(path)` gives files and folders the
process umask's mode: safetensors and `tempfile` create 0600 files and 0700 folders, which other
users of a shared cache could not read. `writable_destination(path)` / `writable_file(path)`
check, before any long work, that a folder / a file could be created at `path`.

`replace_file(path, data)` writes one small file by a temporary name and one rename (a failure
half-way leaves nothing under `path`). `set_aside(path, problem)` renames a file bridgecache
wrote and reads back, found damaged, to `<name>.bad-<UTC time>` beside it and warns
(`DamagedFileWarning`): the next call writes a fresh one instead of failing on it forever, and
the bad copy stays for whoever wants to look. `remove_tree(path, root)` deletes a file or folder
under `root` without ever following a link (a link on the way from `root` is refused; links
inside are removed, never their targets) and raises `RemovalError` naming what stayed.

POSIX only (fcntl). Knows nothing about bridges, models or caches.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "DamagedFileWarning",
    "RemovalError",
    "STAGING_PREFIX",
    "TEMP_PREFIX",
    "apply_umask",
    "clean_leftovers",
    "current_umask",
    "directory_lock",
    "publish",
    "remove_tree",
    "replace_file",
    "set_aside",
    "staging_folder",
    "writable_destination",
    "writable_file",
]

STAGING_PREFIX = ".bridgecache-staging-"
TEMP_PREFIX = ".bridgecache-tmp-"


class DamagedFileWarning(UserWarning):
    """A file bridgecache wrote and reads back was damaged; it was set aside and is made again."""


class RemovalError(OSError):
    """Something bridgecache meant to delete is still there (or was refused: a link on the way)."""


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
def directory_lock(directory: str | Path, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive flock on `directory` itself; yields False (not locked) when
    `blocking=False` and another process holds it. Released when the block ends or the process dies."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def staging_folder(directory: str | Path) -> Iterator[Path]:
    """An empty hidden folder in `directory` (unpredictable name), flock-ed by this process until
    the block ends; then removed with whatever `publish` did not move out of it."""
    directory = Path(directory)
    with directory_lock(directory):  # clean_leftovers never sees it unlocked
        path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory))
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def publish(temporary: str | Path, final: str | Path, *, exclusive: bool = False) -> None:
    """Move a finished temporary file to `final` in one step, with the umask's mode, durably.

    exclusive=True never replaces an existing `final` (FileExistsError): the file is linked in
    (atomic create-if-absent) and the temporary name removed."""
    temporary, final = Path(temporary), Path(final)
    fd = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(temporary, 0o666 & ~current_umask())
    if exclusive:
        os.link(temporary, final)  # FileExistsError if another writer got there first
        os.unlink(temporary)
    else:
        os.replace(temporary, final)
    _fsync_directory(final.parent)


def clean_leftovers(directory: str | Path) -> list[Path]:
    """Remove the temporary files and staging folders that killed writers left in `directory`;
    returns them. Those of live writers are locked and kept; errors (a read-only folder) are ignored."""
    removed = []
    try:
        with directory_lock(directory, blocking=False) as locked:
            if not locked:  # a writer is committing: its leftovers-to-be are its own business
                return removed
            for path in Path(directory).glob(STAGING_PREFIX + "*"):
                if _abandoned(path):
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(path)
    except OSError:
        pass
    return removed


def _abandoned(path: Path) -> bool:
    """True if no live process holds `path`'s lock (its writer was killed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return path.is_symlink()  # a planted symlink is removed (the link, never its target)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def writable_destination(path: str | Path) -> str | None:
    """None if a folder could be created (or written) at `path`; otherwise the reason, in words."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{path} exists and is a file, not a directory"
    return _writable_ancestor(path)


def writable_file(path: str | Path) -> str | None:
    """None if a file could be created (or replaced) at `path`; otherwise the reason, in words."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a directory, not a file"
    if path.exists() and not os.access(path, os.W_OK):
        return f"cannot write {path} (Permission denied)"
    return _writable_ancestor(path.parent if path.parent != path else path)


def _writable_ancestor(path: Path) -> str | None:
    ancestor = path
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, so {path} cannot be created under it"
    try:  # os.access is not enough: root passes it on read-only mounts' neighbours, ACLs differ
        probe = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=ancestor)
        os.rmdir(probe)
    except OSError as err:
        return f"cannot write in {ancestor} ({err.strerror or err})"
    return None


def replace_file(path: str | Path, data: bytes | str) -> Path:
    """Write `data` to `path` by a temporary name beside it and one rename, with the umask's mode.

    A failure at any point (a full disk, a kill) leaves nothing under `path` but its old content:
    the temporary file is removed on error; a killed writer's stays under a hidden
    `TEMP_PREFIX` name that no reader looks at (and `bridgecache cache clear` removes)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def set_aside(path: str | Path, problem: str) -> Path | None:
    """Rename a damaged file (or folder) to `<name>.bad-<UTC time>` beside it and warn; returns the
    new name, or None when it could not be moved (it is then left as it is, and the warning says so)."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.bad-{stamp}")
    if aside.exists() or aside.is_symlink():
        aside = path.with_name(f"{path.name}.bad-{stamp}-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    try:
        os.rename(path, aside)  # rename never follows a link at `path`: the link itself moves
    except FileNotFoundError:
        return None  # another process set it aside (or replaced it) first
    except OSError as err:
        warnings.warn(
            f"{path} is damaged ({problem}) and could not be set aside ({err.strerror or err}); "
            "it is ignored: delete it to stop this warning",
            DamagedFileWarning,
            stacklevel=2,
        )
        return None
    warnings.warn(
        f"{path} was damaged ({problem}); moved it to {aside.name} and made a new one",
        DamagedFileWarning,
        stacklevel=2,
    )
    return aside


def remove_tree(path: str | Path, root: str | Path) -> None:
    """Delete `path` (a file or a folder and all it holds) that lies under `root`, following no link.

    Every component from `root` down to `path` must be a real folder (lstat): a link on the way is
    refused, since deleting through it would reach outside `root`. Inside `path`, links are
    removed themselves, never what they point at (shutil.rmtree's fd-based walk). Raises
    RemovalError naming what is still there; a `path` that is already gone is fine."""
    path, root = Path(path), Path(root)
    relative = path.relative_to(root)  # ValueError: not under root, a caller's bug
    here = root
    for part in relative.parts:
        here = here / part
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise RemovalError(f"refused to delete {path}: {here} is a link (it may lead out of {root})")
        if here != path and not stat.S_ISDIR(st.st_mode):
            return  # the way down is no longer a folder: nothing of ours below it
    failures: list[str] = []

    def failed(function, name, exc_info_or_exc) -> None:
        err = exc_info_or_exc[1] if isinstance(exc_info_or_exc, tuple) else exc_info_or_exc
        if not isinstance(err, FileNotFoundError):  # removed meanwhile: fine
            failures.append(f"{name} ({getattr(err, 'strerror', None) or err})")

    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, onerror=failed)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            failures.append(f"{path} ({err.strerror or err})")
    if failures:
        more = f" and {len(failures) - 3} more" if len(failures) > 3 else ""
        raise RemovalError(f"could not delete {'; '.join(failures[:3])}{more}")
