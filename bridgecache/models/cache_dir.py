"""What the bridgecache cache directory holds, and removing it: `bridgecache cache`'s library side.

`cache_entries()` lists each entry under the cache root (`bridgecache.models.zoo.cache_root`):
every built-in model folder, every fitted bridge, the downloads still there, the cost gate's
measured times (`route-costs/`), the benchmarks' folders; each with its size, when it was last
used and what uses it. `remove_entry(name)` and `clear()` delete entries, a model's folder under
the lock that keeps two processes from building one model.

Only what bridgecache wrote and can prove is ever deleted, each by its own mark: a model folder
by its manifest (`.manifest.json` of format bridgecache.manifest/1, or the `.complete` marker of
an earlier layout), a bridge by a `bridge.json` of format bridgecache.bridge, a download by its
name and content (only `.whl` files in `wheels/<built-in>/`, a file starting with `GGUF` at
`gguf/<built-in>.gguf`), a cost table by its name and the key inside it, a lock by its name and
emptiness, a killed writer's leftovers by the hidden names bridgecache gives them. Anything
else is listed as not bridgecache's and left alone (a root set to a home directory by mistake,
or a user's own model folder under `models/`, loses nothing). Nothing is found or deleted through
a link: a link anywhere under the root is listed as not bridgecache's, and deleting refuses a
path with a link on its way (`bridgecache.files.remove_tree`). A deletion that fails raises
`CacheRemovalError` naming what is still there; what did go is in its `removed`.

Knows the zoo's layout and the bridges folder's; nothing about models' contents.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from bridgecache.files import STAGING_PREFIX, RemovalError, remove_tree
from bridgecache.models.manifest import manifest_problem
from bridgecache.models.zoo import BUILTIN_MODELS, KEEP_WHEELS, ZooError, _exclusive, cache_root

__all__ = ["CacheEntry", "CacheRemovalError", "cache_entries", "clear", "remove_entry"]

_BENCHMARK_FOLDERS = ("quality", "needle")  # results and controls the benchmarks keep there
_ROUTE_COSTS = "route-costs"  # the cost gate's measured times (bridgecache.runtime.route)
_COST_FILE = re.compile(r"[0-9a-f]{24}\.json")
_COST_LEFTOVER = re.compile(r"(\.tmp-.*\.json|\.bridgecache-tmp-.*|[0-9a-f]{24}\.json\.bad-.*)")
_MARK_BYTES = 1 << 20  # a bridge.json or cost table read to prove it is ours: at most this much


class CacheRemovalError(ZooError):
    """Some of what was asked to be deleted is still there; `removed` lists the entries that went."""

    def __init__(self, message: str, removed: list):
        super().__init__(message)
        self.removed = removed


@dataclass(frozen=True)
class CacheEntry:
    """One thing in the cache directory."""

    name: str  # what `remove_entry` takes: its path under the root, e.g. "models/smollm2-135m"
    kind: str  # "model", "bridge", "download", "timing", "benchmark", "lock", "leftover" or "other"
    path: Path
    size: int  # bytes of its files
    last_used: float  # seconds since the epoch: its files' latest access or change
    used_by: str  # in words
    parts: tuple[Path, ...] = field(default=())  # what deleting it removes (empty: the whole path)

    @property
    def removable(self) -> bool:
        return self.kind not in ("other", "benchmark")


def cache_entries(root: Path | None = None) -> list[CacheEntry]:
    """Every entry under the cache root, models first, then bridges, downloads and the rest."""
    root = Path(root) if root is not None else cache_root()
    if not root.is_dir():
        return []
    entries: list[CacheEntry] = []
    for folder in _children(root, "models"):
        entries.append(_model(root, folder))
    entries += _bridges(root)
    for path in _children(root, "wheels"):
        if path.name in BUILTIN_MODELS and _only_wheels(path):
            words = f"downloads of {path.name}, removed once its model is built ({KEEP_WHEELS}=1 keeps them)"
            entries.append(_entry(root, path, "download", words))
        else:
            entries.append(_other(root, path, "not a folder of built-in model wheels"))
    for path in _children(root, "gguf"):
        stem = path.name.removesuffix(".partial").removesuffix(".gguf")
        named = stem in BUILTIN_MODELS and path.name in (f"{stem}.gguf", f"{stem}.gguf.partial")
        if named and _is_gguf(path):
            words = "an assembled GGUF, moved into models/ once checked"
            entries.append(_entry(root, path, "download", words))
        else:
            entries.append(_other(root, path, "not a GGUF bridgecache assembles"))
    entries += _costs(root)
    for name in _BENCHMARK_FOLDERS:
        if _real(root / name) is not None:
            words = "results and controls kept by the scripts in benchmarks/ (delete it yourself)"
            entries.append(_entry(root, root / name, "benchmark", words))
    entries += _locks(root)
    ours = {"models", "bridges", "wheels", "gguf", "locks", _ROUTE_COSTS, *_BENCHMARK_FOLDERS}
    for path in _children(root, "."):
        if path.name not in ours or _real(path) != "dir":
            entries.append(_other(root, path, "not bridgecache's: left alone"))
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
        raise ZooError(
            f"{match.path} is not bridgecache's to delete ({match.used_by}); "
            "remove it yourself if you mean to"
        )
    try:
        _delete(root, match)
    except RemovalError as err:
        raise CacheRemovalError(f"{match.name}: {err}", []) from err
    return match


def clear(root: Path | None = None) -> list[CacheEntry]:
    """Delete every entry bridgecache wrote (never the others); returns what went.

    Raises CacheRemovalError (with `removed`) when anything could not be deleted: the rest is
    still deleted first."""
    root = Path(root) if root is not None else cache_root()
    removed, failures = [], []
    entries = [e for e in cache_entries(root) if e.removable and e.kind != "lock"]
    locks = [e for e in cache_entries(root) if e.kind == "lock"]  # last: held while a model goes
    for entry in entries + locks:
        try:
            _delete(root, entry)
            removed.append(entry)
        except RemovalError as err:
            failures.append(f"{entry.name}: {err}")
    if failures:
        raise CacheRemovalError("; ".join(failures), removed)
    return removed


def _delete(root: Path, entry: CacheEntry) -> None:
    if entry.kind == "model":  # never under a process that is building or checking it
        locks = root / "locks"
        if _real(locks) not in (None, "dir"):
            raise RemovalError(f"{locks} is not a folder (a link?): refused to take a model's lock there")
        with _exclusive(locks / f"{entry.path.name.removeprefix('.')}.lock"):
            remove_tree(entry.path, root)
        return
    for part in entry.parts or (entry.path,):
        remove_tree(part, root)
    if entry.parts:  # a folder of files proven one by one: the folder goes once it is empty
        with contextlib.suppress(OSError):  # something not ours is still in it: it stays
            entry.path.rmdir()


# ---------------------------------------------------------------- what is whose


def _model(root: Path, folder: Path) -> CacheEntry:
    name = folder.name.removeprefix(".")
    if _real(folder) != "dir":
        return _other(root, folder, "not a folder bridgecache built (a link or a file)")
    staging = folder.name.startswith(".") and re.fullmatch(r"(.+)-[A-Za-z0-9_]{8}", name)
    if staging and staging.group(1) in BUILTIN_MODELS:
        words = "a build that did not finish (removed by the next load of the model)"
        return _entry(root, folder, "model", words)
    problem = manifest_problem(folder)
    if problem is not None and _real(folder / ".complete") != "file":
        return _other(root, folder, "not a model folder bridgecache built (no manifest of its own)")
    known = BUILTIN_MODELS.get(name)
    words = f'load_model("{name}"): {known.description}' if known else "a model folder bridgecache built"
    return _entry(root, folder, "model", words)


def _bridges(root: Path) -> list[CacheEntry]:
    """Folders under bridges/ holding a bridge.json of bridgecache's format; the rest is other."""
    base = root / "bridges"
    if _real(base) is None:
        return []
    if _real(base) != "dir":
        return [_other(root, base, "not a folder (a link or a file): left alone")]
    entries = []
    for folder, dirs, files in os.walk(base):  # followlinks=False: links are listed, not entered
        here = Path(folder)
        if here != base and here.name.startswith(STAGING_PREFIX):
            entries.append(_entry(root, here, "leftover", "a killed save's staging folder"))
            dirs.clear()
            continue
        if "bridge.json" in files:
            if _json_mark(here / "bridge.json", "format") == "bridgecache.bridge":
                entries.append(_entry(root, here, "bridge", f'Bridge.from_pretrained("{here}")'))
            else:
                entries.append(_other(root, here, "its bridge.json is not a bridgecache bridge's"))
            dirs.clear()
            continue
        for name in sorted(dirs + files):
            kind = _real(here / name)
            if kind not in ("dir", None) and (kind != "file" or here == base):
                entries.append(_other(root, here / name, "not a bridge folder: left alone"))
        dirs[:] = [d for d in dirs if _real(here / d) == "dir"]
    return sorted(entries, key=lambda e: e.name)


def _costs(root: Path) -> list[CacheEntry]:
    """The cost tables (`<key>.json` holding that key) and their writers' leftovers; the rest is other."""

    def ours(path: Path) -> bool:
        table = _COST_FILE.fullmatch(path.name) and _json_mark(path, "key") == path.stem
        return _real(path) == "file" and bool(table or _COST_LEFTOVER.fullmatch(path.name))

    words = "the cost gate's times per device, pair and config (an engine times them again)"
    return _marked_folder(root, _ROUTE_COSTS, ours, "timing", words, "not a cost table bridgecache wrote")


def _locks(root: Path) -> list[CacheEntry]:
    def ours(path: Path) -> bool:
        empty = _real(path) == "file" and os.lstat(path).st_size == 0
        return empty and path.name.endswith(".lock")

    words = "locks that keep two processes from building one model"
    return _marked_folder(root, "locks", ours, "lock", words, "not a lock bridgecache takes")


def _marked_folder(root: Path, name: str, ours, kind: str, words: str, other: str) -> list[CacheEntry]:
    """One entry for root/name holding the children `ours(path)` accepts (when any, or when the
    folder is empty), and an entry left alone for each other child or for a folder that is a link."""
    folder = root / name
    found = _real(folder)
    if found is None:
        return []
    if found != "dir":
        return [_other(root, folder, "not a folder (a link or a file): left alone")]
    mine, others = [], []
    for path in _children(root, name):
        if ours(path):
            mine.append(path)
        else:
            others.append(_other(root, path, other))
    entry = _entry(root, folder, kind, words, parts=tuple(mine)) if mine or not others else None
    return ([entry] if entry else []) + others


def _only_wheels(folder: Path) -> bool:
    if _real(folder) != "dir":
        return False
    return all(_real(p) == "file" and p.suffix == ".whl" for p in folder.iterdir())


def _is_gguf(path: Path) -> bool:
    if _real(path) != "file":
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"GGUF" or (head == b"" and path.name.endswith(".partial"))


def _json_mark(path: Path, key: str):
    """`key` of the JSON object in `path` (a small regular file), else None."""
    try:
        if _real(path) != "file" or os.lstat(path).st_size > _MARK_BYTES:
            return None
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def _real(path: Path) -> str | None:
    """ "dir" or "file" for a real folder or regular file (lstat: never through a link); "link" or
    "special" otherwise; None if nothing is there."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    return "link" if stat.S_ISLNK(mode) else "special"


def _children(root: Path, name: str) -> list[Path]:
    """What a real folder `root / name` holds (nothing when it is a link: never looked through)."""
    folder = root / name if name != "." else root
    return sorted(folder.iterdir()) if _real(folder) == "dir" else []


def _other(root: Path, path: Path, words: str) -> CacheEntry:
    return _entry(root, path, "other", words)


def _entry(root: Path, path: Path, kind: str, used_by: str, parts: tuple[Path, ...] = ()) -> CacheEntry:
    if _real(path) == "dir":
        files = []
        for folder, _, names in os.walk(path):  # never through a link
            files += [Path(folder) / n for n in names]
    else:
        files = [path]
    size, last = 0, 0.0
    for file in files:
        try:
            st = os.lstat(file)
        except OSError:  # removed while we looked
            continue
        size += st.st_size if stat.S_ISREG(st.st_mode) else 0
        last = max(last, st.st_atime, st.st_mtime)
    return CacheEntry(path.relative_to(root).as_posix(), kind, path, size, last, used_by, parts)
