"""`bridgecache inspect`, `bridgecache export-builtin` and `bridgecache fit --recipe`.

    bridgecache inspect builtin:qwen2.5-coder-1.5b->qwen2.5-coder-0.5b [--plot bridge.png]
    bridgecache export-builtin FITTED_DIR [NAME] [--dtype float16]
    bridgecache fit --recipe builtin:NAME --out DIR [--calib-seqs 4 --seq-len 64]

`add_inspect_command` / `add_export_command` register the subcommands (bridgecache/cli.py wires
them in); `run_fit_recipe` is what `bridgecache fit --recipe` runs.
"""

from __future__ import annotations

import argparse
import json
import time

__all__ = ["add_inspect_command", "add_export_command", "run_fit_recipe", "run_inspect", "run_export"]


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

    directory = resolve_bridge(args.bridge, **_hub_kwargs(args))
    bridge = Bridge.from_pretrained(directory)
    print(inspect_report(bridge, location=args.bridge, directory=directory))
    if args.plot:
        print(f"plot: {plot_bridge(bridge, args.plot)}")
    return 0


def run_export(args) -> int:
    from bridgecache.bridge.export import export_builtin
    from bridgecache.bridge.maps import Bridge

    out = export_builtin(args.source_dir, args.name, dtype=args.dtype, root=args.root)
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


def run_fit_recipe(args) -> int:
    """Fit again from the recipe a bridge records (the zoo loads the models it names)."""
    import torch

    from bridgecache.bridge.recipe import RecipeError, recipe_command
    from bridgecache.bridge.resolve import resolve_bridge
    from bridgecache.fitting.refit import refit
    from bridgecache.models.zoo import load_model

    if args.source or args.target:
        raise SystemExit("bridgecache fit --recipe: the recipe names the models; drop --source/--target")
    meta = json.loads((resolve_bridge(args.recipe) / "bridge.json").read_text())
    recipe = meta.get("calibration", {}).get("recipe")
    if not recipe:
        raise RecipeError(f"{args.recipe} records no fit recipe")
    overrides = {k: v for k, v in (("num_sequences", args.calib_seqs), ("seq_len", args.seq_len)) if v}
    torch.manual_seed(recipe["seed"])
    source, source_tok = load_model(recipe["source"], device=args.device)
    target, target_tok = load_model(recipe["target"], device=args.device)
    print(f"recipe of {args.recipe}: {recipe_command({**recipe, **overrides}, args.out)}")
    start = time.perf_counter()
    bridge = refit(recipe, source, target, source_tok, target_tok, **overrides)
    bridge.save_pretrained(args.out)
    print(bridge.summary())
    print(f"fit time: {time.perf_counter() - start:.1f} s; saved to {args.out}")
    return 0
