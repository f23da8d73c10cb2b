"""`bridgecache inspect` and `bridgecache export-builtin`.

    bridgecache inspect builtin:qwen2.5-coder-1.5b->qwen2.5-coder-0.5b [--plot bridge.png]
    bridgecache export-builtin FITTED_DIR [NAME] [--dtype float16]

`add_inspect_command` / `add_export_command` register the subcommands (bridgecache/cli/__init__.py
wires them in). Output paths are checked before anything is read; what is printed from a bridge file
is escaped (bridgecache.untrusted). `bridgecache fit --recipe` lives in bridgecache.cli.fit.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bridgecache.untrusted import printable

__all__ = ["add_inspect_command", "add_export_command", "run_inspect", "run_export"]


def _add_hub_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of a hub id")
    parser.add_argument("--cache-dir", help="Hub cache directory (default: huggingface_hub's)")
    parser.add_argument("--local-files-only", action="store_true", help="never reach the Hub")


def _hub_kwargs(args) -> dict:
    return dict(revision=args.revision, cache_dir=args.cache_dir, local_files_only=args.local_files_only)


def add_inspect_command(subparsers) -> argparse.ArgumentParser:
    """Add `inspect` to an argparse subparsers object; returns its parser."""
    inspect = subparsers.add_parser(
        "inspect", help="what a bridge maps, its size and held-out scores per layer (and a plot)"
    )
    inspect.add_argument("bridge", metavar="BRIDGE", help="a bridge directory, builtin:NAME or hub id")
    inspect.add_argument(
        "--plot", metavar="FILE", help="write a PNG: per-layer quality and source-layer feeds"
    )
    _add_hub_options(inspect)
    inspect.set_defaults(func=run_inspect)
    return inspect


def add_export_command(subparsers) -> argparse.ArgumentParser:
    """Add `export-builtin` to an argparse subparsers object; returns its parser."""
    export = subparsers.add_parser(
        "export-builtin", help="turn a fitted bridge directory into a shipped built-in bridge (float16)"
    )
    export.add_argument("source_dir", metavar="SRC_DIR", help="a bridge fitted between two zoo models")
    export.add_argument("name", metavar="NAME", nargs="?", help="SOURCE->TARGET (default: the bridge's pair)")
    export.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    export.add_argument("--root", help="where to write (default: the package's bridgecache/bridges)")
    export.set_defaults(func=run_export)
    return export


def run_inspect(args) -> int:
    from bridgecache.bridge.maps import Bridge
    from bridgecache.bridge.resolve import resolve_bridge
    from bridgecache.bridge.summary import inspect_report, plot_bridge

    problem = check_plot_path(args.plot) if args.plot else None
    if problem:
        return _fail("inspect", f"--plot: {problem}")
    directory = resolve_bridge(args.bridge, **_hub_kwargs(args))
    bridge = Bridge.from_pretrained(directory)
    print(printable(inspect_report(bridge, location=args.bridge, directory=directory), lines=True))
    if args.plot:
        print(f"plot: {plot_bridge(bridge, args.plot)}")
    return 0


def check_plot_path(path) -> str | None:
    """None if a plot can be written at `path` (a format matplotlib knows, a writable place)."""
    from bridgecache.files import writable_file

    try:
        from matplotlib.figure import Figure
    except ImportError:  # an optional dependency (the dev and examples extras)
        return "needs matplotlib, which is not installed here (pip install matplotlib)"

    suffix = Path(path).suffix.lstrip(".").lower()
    known = Figure().canvas.get_supported_filetypes()
    if suffix and suffix not in known:
        return f"{path}: matplotlib cannot write .{suffix} files (it writes {', '.join(sorted(known))})"
    return writable_file(path)


def run_export(args) -> int:
    from bridgecache.bridge import builtin
    from bridgecache.bridge.export import export_builtin
    from bridgecache.bridge.maps import Bridge
    from bridgecache.files import writable_destination

    if args.name is not None and not re.fullmatch(r"(builtin:)?[\w.-]+->[\w.-]+", args.name):
        return _fail("export-builtin", f"NAME {args.name!r}: expected SOURCE->TARGET")
    root = Path(args.root) if args.root else builtin.builtin_root()
    problem = writable_destination(root)
    if problem:
        return _fail("export-builtin", f"--root: {problem}")
    try:
        out = export_builtin(args.source_dir, args.name, dtype=args.dtype, root=args.root)
    except ValueError as err:  # not a zoo pair, a refined bridge, a map that does not fit the dtype
        return _fail("export-builtin", str(err))
    fitted, shipped = Bridge.from_pretrained(args.source_dir), Bridge.from_pretrained(out)
    worst = max(
        float((getattr(b, f) - getattr(a, f)).abs().max() / getattr(a, f).abs().max().clamp_min(1e-30))
        for a, b in zip(fitted.layers, shipped.layers)
        for f in ("key_weight", "value_weight")
    )
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(
        f"wrote {out} ({size / 1e6:.2f} MB, {args.dtype}); worst weight error {worst:.2e} of the layer's max"
    )
    return 0


def _fail(command: str, problem: str) -> int:
    print(f"bridgecache {command}: error: {printable(problem, 2000)}", file=sys.stderr)
    return 2
