"""`bridgecache cache`: what the cache directory holds, and removing it (like the Hub's `hf cache`).

    bridgecache cache                    list every entry: size, last used, what uses it
    bridgecache cache ls                 the same
    bridgecache cache rm NAME... [-y]    remove entries (a built-in model's bare name works too)
    bridgecache cache clear [-y]         remove everything bridgecache wrote there

Removing asks first unless --yes is given (and refuses without a terminal to ask on). A removed
model is fetched again on its next use; a removed bridge is fitted again. Only what bridgecache
wrote and can prove is removed (bridgecache.models.cache_dir), never through a link; anything
that could not be removed is named on stderr and the exit status is 1.
"""

from __future__ import annotations

import sys
import time

from bridgecache.untrusted import printable

__all__ = ["add_cache_command", "run_cache"]


def add_cache_command(subparsers):
    cache = subparsers.add_parser(
        "cache", help="list the cache directory's models, bridges and downloads; remove them"
    )
    actions = cache.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("ls", aliases=["list"], help="list every entry (the default)")
    remove = actions.add_parser("rm", aliases=["remove"], help="remove entries by name")
    remove.add_argument("names", metavar="NAME", nargs="+", help="as listed (e.g. models/smollm2-135m)")
    remove.add_argument("-y", "--yes", action="store_true", help="do not ask")
    clear = actions.add_parser("clear", help="remove everything bridgecache wrote in the cache directory")
    clear.add_argument("-y", "--yes", action="store_true", help="do not ask")
    cache.set_defaults(func=run_cache, action=None)
    return cache


def run_cache(args) -> int:
    from bridgecache.models import cache_dir
    from bridgecache.models.zoo import ZooError, cache_root

    root = cache_root()
    entries = cache_dir.cache_entries(root)
    if args.action in (None, "ls", "list"):
        print(_table(entries, root))
        return 0
    if args.action in ("rm", "remove"):
        known = {e.name: e for e in entries}
        chosen = [known.get(f"models/{n}", known.get(n.strip("/"))) for n in args.names]
        missing = [n for n, e in zip(args.names, chosen) if e is None]
        if missing:
            listed = ", ".join(e.name for e in entries if e.removable) or "nothing"
            return _fail(f"no cache entry {', '.join(map(repr, missing))} in {root}; there is: {listed}")
        foreign = [e.name for e in chosen if not e.removable]
        if foreign:
            return _fail(f"{', '.join(foreign)}: not bridgecache's; remove it yourself if you mean to")
    else:
        chosen = [e for e in entries if e.removable]
        if not chosen:
            print(f"nothing to remove in {root}")
            return 0
    total = sum(e.size for e in chosen)
    what = f"{len(chosen)} entr{'y' if len(chosen) == 1 else 'ies'} ({_size(total)}) from {root}"
    if not args.yes and not _confirm(f"remove {what}: {', '.join(e.name for e in chosen)}?"):
        return _fail("nothing removed (give --yes to remove without asking)")
    removed, failures = [], []
    if args.action == "clear":
        try:
            removed = cache_dir.clear(root)
        except cache_dir.CacheRemovalError as err:
            removed, failures = err.removed, [str(err)]
    else:
        for entry in chosen:
            try:
                removed.append(cache_dir.remove_entry(entry.name, root))
            except ZooError as err:  # CacheRemovalError, or an entry that changed since it was listed
                failures.append(str(err))
    if not failures:
        print(f"removed {what}")
        return 0
    if removed:
        print(f"removed {len(removed)} of {len(chosen)}: {', '.join(e.name for e in removed)}")
    print(f"bridgecache cache: error: not removed: {printable('; '.join(failures), 2000)}", file=sys.stderr)
    return 1


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    print(printable(question, 2000) + " [y/N] ", end="", flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _table(entries, root) -> str:
    if not entries:
        return f"the cache directory {root} is empty (BRIDGECACHE_HOME moves it)"
    rows = [("NAME", "KIND", "SIZE", "LAST USED", "USED BY")]
    rows += [(e.name, e.kind, _size(e.size), _ago(e.last_used), e.used_by) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    total = sum(e.size for e in entries)
    lines.append(f"\n{len(entries)} entries, {_size(total)} in {root}")
    return printable("\n".join(lines), lines=True)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _ago(seconds: float) -> str:
    if not seconds:
        return "-"
    delta = max(0.0, time.time() - seconds)
    for unit, scale in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if delta >= scale:
            count = int(delta // scale)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"


def _fail(problem: str) -> int:
    print(f"bridgecache cache: error: {printable(problem, 2000)}", file=sys.stderr)
    return 2
