"""What the bridgecache cache directory holds, and removing it: `bridgecache cache`'s library side.

`cache_entries()` lists each entry under the cache root (`bridgecache.models.zoo.cache_root`):
every built-in model folder, every fitted bridge, the downloads still there, the cost gate's
measured times (`route-costs/`), the benchmarks' folders; each with its size, when it was last
used and what uses it. `remove_entry(name)` and `clear()` delete entries, a model's folder under
the lock that keeps two processes from building one model. Only the names bridgecache writes are
ever deleted: anything else found under the root is listed as not bridgecache's and left alone (a
root set to a home directory by mistake loses nothing).

Knows the zoo's layout and the bridges folder's; nothing about models' contents.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from bridgecache.models.zoo import BUILTIN_MODELS, KEEP_WHEELS, ZooError, _exclusive, cache_root

__all__ = ["CacheEntry", "cache_entries", "clear", "remove_entry"]

_BENCHMARK_FOLDERS = ("quality", "needle")  # results and controls the benchmarks keep there
_ROUTE_COSTS = "route-costs"  # the cost gate's measured times (bridgecache.runtime.route)


@dataclass(frozen=True)
class CacheEntry:
    """One thing in the cache directory."""

    name: str  # what `remove_entry` takes: its path under the root, e.g. "models/smollm2-135m"
    kind: str  # "model", "bridge", "download", "timing", "benchmark", "lock" or "other"
    path: Path
    size: int  # bytes of its files
    last_used: float  # seconds since the epoch: its files' latest access or change
    used_by: str  # in words

    @property
    def removable(self) -> bool:
        return self.kind != "other"


def cache_entries(root: Path | None = None) -> list[CacheEntry]:
    """Every entry under the cache root, models first, then bridges, downloads and the rest."""
    root = Path(root) if root is not None else cache_root()
    if not root.is_dir():
        return []
    entries = []
    for folder in _children(root / "models"):
        name = folder.name.removeprefix(".")
        known = BUILTIN_MODELS.get(name)
        if folder.name.startswith("."):
            words = "a build that did not finish (removed by the next load of the model)"
        else:
            words = f'load_model("{name}"): {known.description}' if known else "not a built-in model"
        entries.append(_entry(root, folder, "model", words))
    for folder in sorted({p.parent for p in (root / "bridges").rglob("bridge.json")}):
        entries.append(_entry(root, folder, "bridge", f'Bridge.from_pretrained("{folder}")'))
    for path in _children(root / "wheels"):
        words = f"downloads of {path.name}, removed once its model is built ({KEEP_WHEELS}=1 keeps them)"
        entries.append(_entry(root, path, "download", words))
    for path in _children(root / "gguf"):
        entries.append(_entry(root, path, "download", "an assembled GGUF, moved into models/ once checked"))
    if (root / _ROUTE_COSTS).is_dir():
        words = "the cost gate's times per device, pair and config (an engine times them again)"
        entries.append(_entry(root, root / _ROUTE_COSTS, "timing", words))
    for name in _BENCHMARK_FOLDERS:
        if (root / name).exists():
            words = "results and controls kept by the scripts in benchmarks/"
            entries.append(_entry(root, root / name, "benchmark", words))
    if (root / "locks").is_dir():
        entries.append(
            _entry(root, root / "locks", "lock", "locks that keep two processes from building one model")
        )
    ours = {"models", "bridges", "wheels", "gguf", "locks", _ROUTE_COSTS, *_BENCHMARK_FOLDERS}
    for path in _children(root):
        if path.name not in ours:
            entries.append(_entry(root, path, "other", "not bridgecache's: left alone"))
    return entries


def remove_entry(name: str, root: Path | None = None) -> CacheEntry:
    """Delete one entry (its listed name, or a built-in model's bare name); returns what went."""
    root = Path(root) if root is not None else cache_root()
    entries = cache_entries(root)
    wanted = f"models/{name}" if name in BUILTIN_MODELS else name.strip("/")
    match = next((e for e in entries if e.name == wanted), None)
    if match is None:
        known = ", ".join(e.name for e in entries if e.removable) or "nothing"
        raise ZooError(f"no cache entry {name!r} in {root}; there is: {known}")
    if not match.removable:
        raise ZooError(f"{match.path} is not bridgecache's; remove it yourself if you mean to")
    _delete(match)
    return match


def clear(root: Path | None = None) -> list[CacheEntry]:
    """Delete every entry bridgecache wrote (never the others); returns what went."""
    removed = [e for e in cache_entries(root) if e.removable and e.kind != "lock"]
    for entry in removed:
        _delete(entry)
    locks = [e for e in cache_entries(root) if e.kind == "lock"]
    for entry in locks:  # last: a model's lock is held while its folder goes
        _delete(entry)
    return removed + locks


def _delete(entry: CacheEntry) -> None:
    if entry.kind == "model":  # never under a process that is building or checking it
        with _exclusive(entry.path.parent.parent / "locks" / f"{entry.path.name.removeprefix('.')}.lock"):
            shutil.rmtree(entry.path, ignore_errors=True)
    elif entry.path.is_dir():
        shutil.rmtree(entry.path, ignore_errors=True)
    else:
        entry.path.unlink(missing_ok=True)


def _children(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _entry(root: Path, path: Path, kind: str, used_by: str) -> CacheEntry:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    size, last = 0, 0.0
    for file in files:
        try:
            st = os.stat(file)
        except OSError:  # removed while we looked
            continue
        size += st.st_size
        last = max(last, st.st_atime, st.st_mtime)
    return CacheEntry(path.relative_to(root).as_posix(), kind, path, size, last, used_by)
