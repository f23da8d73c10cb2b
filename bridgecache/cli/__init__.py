"""The `bridgecache` command: demo, fit, eval.

bridgecache demo                       a real handoff between two built-in models, on CPU (cli.demo)
bridgecache fit --source A --target B  fit and save a bridge
bridgecache eval --bridge DIR ...      measure a bridge with the field's protocols + controls
bridgecache inspect BRIDGE             what a bridge maps, its size, per-layer scores (--plot FILE)
bridgecache export-builtin DIR [NAME]  ship a fitted bridge inside the package (float16)
bridgecache cache [ls | rm NAME | clear]  the models, bridges and downloads on disk (cli.cache)

Every command checks its arguments, inputs and output paths before it loads a model, and reports
a user error (a bad option, a missing or damaged file, a model the bridge does not fit) in one
line on stderr with exit status 2, never with a traceback. Text from files is escaped before it
is printed (bridgecache.untrusted).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from bridgecache.fitting.cached import bridge_for
from bridgecache.untrusted import printable

__all__ = ["main", "bridge_for"]


def _build_parser() -> argparse.ArgumentParser:
    from bridgecache.cli.artifacts import add_export_command, add_inspect_command
    from bridgecache.cli.cache import add_cache_command
    from bridgecache.cli.demo import add_demo_command
    from bridgecache.cli.evaluate import add_eval_command
    from bridgecache.cli.fit import add_fit_command

    parser = argparse.ArgumentParser(
        prog="bridgecache",
        description="Hand one LLM's KV cache to another: fit bridges, run handoffs, measure them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_demo_command(sub)
    add_fit_command(sub)
    add_eval_command(sub)
    add_inspect_command(sub)
    add_export_command(sub)
    add_cache_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    for arg in argv or ():  # in-process callers: what no command line can hold (sys.argv can)
        if not isinstance(arg, str) or not _encodable(arg):
            print(
                f"bridgecache: error: argument {printable(repr(arg), 80)} is not text a command line holds",
                file=sys.stderr,
            )
            return 2
    args = _build_parser().parse_args(argv)
    try:
        return args.func(args)
    except _user_errors() as err:  # what a command did not catch itself: still one line
        print(f"bridgecache {args.command}: error: {printable(str(err), 2000)}", file=sys.stderr)
        return 2
    except OSError as err:  # a path named on the command line that no lookup takes: the user's too
        if err.errno not in _NAME_ERRORS:
            raise
        print(f"bridgecache {args.command}: error: {printable(str(err), 300)}", file=sys.stderr)
        return 2


# errno of a lookup refused for the name itself: too long, a loop of links, a device without a
# reader (a FIFO opened without blocking), a file where a folder belongs or the reverse.
_NAME_ERRORS = {errno.ENAMETOOLONG, errno.ELOOP, errno.ENXIO, errno.ENOTDIR, errno.EISDIR, errno.EINVAL}


def _encodable(arg: str) -> bool:
    """Whether `arg` is a string a command line can hold: encodable to the file system's bytes (a
    lone surrogate other than the surrogateescape ones that stand for undecodable bytes is not)."""
    try:
        os.fsencode(arg)
    except UnicodeEncodeError:
        return False
    return "\0" not in arg


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that describe the user's input (a file, a name, a model), not a bug."""
    from bridgecache.bridge.format import BridgeFormatError
    from bridgecache.bridge.recipe import RecipeError
    from bridgecache.evaluation.items import EvaluationError
    from bridgecache.kv.source import KVFileError, KVMismatchError
    from bridgecache.models.spec import SpecMismatchError
    from bridgecache.models.zoo import ZooError

    files = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
    return (
        BridgeFormatError,
        SpecMismatchError,
        KVFileError,
        KVMismatchError,
        RecipeError,
        EvaluationError,
        ZooError,
        *files,
    )
