"""The `bridgecache` command: demo, fit, eval.

bridgecache demo                       a real handoff between two built-in models, on CPU (cli.demo)
bridgecache fit --source A --target B  fit and save a bridge
bridgecache eval --bridge DIR ...      measure a bridge with the field's protocols + controls
bridgecache inspect BRIDGE             what a bridge maps, its size, per-layer scores (--plot FILE)
bridgecache export-builtin DIR [NAME]  ship a fitted bridge inside the package (float16)
"""

from __future__ import annotations

import argparse
import sys

from bridgecache.fitting.cached import bridge_for

__all__ = ["main", "bridge_for"]


def _build_parser() -> argparse.ArgumentParser:
    from bridgecache.cli.artifacts import add_export_command, add_inspect_command
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
