"""`bridgecache fit`: fit a bridge between two models and save it, printing a per-layer report.

    bridgecache fit --source qwen2.5-coder-1.5b --target qwen2.5-coder-0.5b \\
        --method cachebridge --out bridges/q15-q05 [--calib-seqs 32 --seq-len 256 --layers-k 2]

    bridgecache fit --recipe builtin:NAME --out DIR [--calib-seqs 4 --seq-len 64]

`add_fit_command(subparsers)` registers the subcommand; `bridgecache/cli.py` wires it in.
Every option, both model references (or the recipe, validated with the bridge it comes from, and
the models it names) and `--out` are checked before a model loads: a fit can take an hour, and
it is never lost to a typo or an unwritable destination. An existing bridge in `--out` is
replaced only with `--force`; if `--out` breaks while the fit runs, the bridge is saved to a
`bridgecache-unsaved-*` folder in the temporary directory instead.

Knows argparse and the zoo; the fitting itself is `bridgecache.fitting.fit_bridge`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bridgecache.untrusted import printable

__all__ = ["add_fit_command", "run_fit", "save_or_rescue"]

DEFAULT_CALIB_SEQS = 32
DEFAULT_SEQ_LEN = 256


def add_fit_command(subparsers) -> argparse.ArgumentParser:
    """Add `fit` to an argparse subparsers object; returns its parser."""
    fit = subparsers.add_parser("fit", help="fit a bridge (Full-Head Mapping or CacheBridge) and save it")
    fit.add_argument("--source", help="model that reads the context (built-in name, hub id, dir)")
    fit.add_argument("--target", help="model that continues from the mapped cache")
    fit.add_argument(
        "--recipe",
        help="fit again from a bridge's recorded recipe (dir, builtin:NAME or hub id) instead of options; "
        "--calib-seqs/--seq-len given here override it",
    )
    fit.add_argument(
        "--method",
        default="fullhead",
        choices=["fullhead", "cachebridge"],
        help="fullhead (default: it beats cachebridge on every measured pair, benchmarks/reports/quality.md)",
    )
    fit.add_argument("--out", required=True, help="directory for the bridge (bridge.json, tensors, card)")
    fit.add_argument("--force", action="store_true", help="replace a bridge already in --out")
    fit.add_argument("--calib-seqs", type=int, help=f"calibration sequences (default {DEFAULT_CALIB_SEQS})")
    fit.add_argument("--seq-len", type=int, help=f"target tokens per sequence (default {DEFAULT_SEQ_LEN})")
    fit.add_argument(
        "--layers-k", type=int, default=None, help="source layers per target layer (method default)"
    )
    fit.add_argument("--layer-support", default="probe", choices=["probe", "depth"])
    fit.add_argument("--weighting", default=None, choices=["uniform", "attention"], help="(method default)")
    fit.add_argument("--domain", default="prose", choices=["prose", "code", "mixed"])
    fit.add_argument(
        "--alignment-policy",
        default=None,
        choices=["last", "first", "mean"],
        help="which source rows feed a target token across tokenizers (default last; recorded in the bridge)",
    )
    fit.add_argument(
        "--key-scale",
        default="variance",
        choices=["variance", "none"],
        help="variance (default): stretch mapped keys to the target keys' spread (sharper attention)",
    )
    fit.add_argument(
        "--stats-precision",
        default="tf32x3",
        choices=["tf32x3", "tf32", "bf16"],
        help="products of the fused statistics kernel on CUDA: tf32x3 (default, about float32) or the "
        "faster, less exact tf32 / bf16 (benchmarks/reports/gpu-kernels.md); the CPU path is float64",
    )
    fit.add_argument("--lam", type=float, default=1e-2, help="ridge strength relative to the data scale")
    fit.add_argument("--native-head", type=int, default=1, help="target positions computed natively")
    fit.add_argument("--device", default="cpu", help="cpu or cuda")
    fit.add_argument("--seed", type=int, default=0)
    fit.set_defaults(func=run_fit)
    return fit


# fit_bridge's option names -> this command's flags, for error messages.
_FLAGS = {"num_sequences": "--calib-seqs", "seq_len": "--seq-len", "layers_k": "--layers-k", "lam": "--lam"}
_FLAGS |= {"native_head": "--native-head", "alignment_policy": "--alignment-policy"}


def check_fit_args(args) -> str | None:
    """The first problem with the arguments, destination included, in words; None if none."""
    from bridgecache.files import writable_destination
    from bridgecache.fitting.options import check_fit_options, check_model_reference
    from bridgecache.models.zoo import BUILTIN_MODELS

    if args.recipe:
        problem = _check_recipe(args)
        if problem:
            return problem
    try:
        check_fit_options(
            method=args.method,
            num_sequences=args.calib_seqs,
            seq_len=args.seq_len,
            domain=args.domain,
            layers_k=args.layers_k,
            lam=args.lam,
            alignment_policy=args.alignment_policy,
            native_head=args.native_head,
        )
    except ValueError as err:
        name, _, rest = str(err).partition(" is ")
        return f"{_FLAGS.get(name, name)} is {rest}" + (" (the recipe's value)" if args.recipe else "")
    for flag, name in (("--source", args.source), ("--target", args.target)):
        if name is None:
            return "give --source and --target (or --recipe BRIDGE)"
        problem = check_model_reference(name, BUILTIN_MODELS)
        if problem:
            return f"{flag}: {problem}" + (" (named by the recipe)" if args.recipe else "")
    problem = writable_destination(args.out)
    if problem:
        return f"--out: {problem}"
    if (Path(args.out) / "bridge.json").exists() and not args.force:
        return (
            f"--out: {args.out} already holds a bridge; pass --force to replace it, or choose another --out"
        )
    return None


def _check_recipe(args) -> str | None:
    """With --recipe: load the bridge (every field validated, the recipe included) and take the
    recipe's options into `args` (--calib-seqs/--seq-len given here override it)."""
    from bridgecache.bridge.format import BridgeFormatError
    from bridgecache.bridge.maps import Bridge

    if args.source or args.target:
        return "--recipe names the models; drop --source/--target"
    try:
        recipe = dict(Bridge.from_pretrained(args.recipe).calibration.get("recipe") or {})
    except (BridgeFormatError, OSError, ValueError) as err:
        return f"--recipe: {err}"
    if not recipe:
        return f"--recipe: {args.recipe} records no fit recipe (an identity bridge, or fitted before recipes)"
    sizes = (("num_sequences", args.calib_seqs), ("seq_len", args.seq_len))
    fields = {**recipe, **{k: v for k, v in sizes if v is not None}}
    args.recipe_fields = fields
    args.source, args.target = fields["source"], fields["target"]
    args.calib_seqs, args.seq_len = fields.get("num_sequences"), fields.get("seq_len")
    for key in ("method", "domain", "layers_k", "lam", "native_head"):  # checked as the options are
        if key in fields:
            setattr(args, key, fields[key])
    args.alignment_policy = fields.get("alignment_policy")
    return None


def run_fit(args) -> int:
    """Check the arguments, load both models, fit, save, print the report. Returns the exit status."""
    if not args.recipe:  # a recipe brings its own sizes; options given here override them
        args.calib_seqs = DEFAULT_CALIB_SEQS if args.calib_seqs is None else args.calib_seqs
        args.seq_len = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
    problem = check_fit_args(args)
    if problem:
        print(f"bridgecache fit: error: {printable(problem, 2000)}", file=sys.stderr)
        return 2

    import torch

    from bridgecache.fitting import fit_bridge
    from bridgecache.models.zoo import load_model

    if args.recipe:
        return _fit_recipe(args)
    torch.manual_seed(args.seed)
    source, source_tok = load_model(args.source, device=args.device)
    target, target_tok = load_model(args.target, device=args.device)
    start = time.perf_counter()
    bridge = fit_bridge(
        source, target, source_tok, target_tok, method=args.method,
        num_sequences=args.calib_seqs, seq_len=args.seq_len, domain=args.domain, layers_k=args.layers_k,
        layer_support=args.layer_support, lam=args.lam, weighting=args.weighting,
        alignment_policy=args.alignment_policy, key_scale=args.key_scale,
        native_head=args.native_head, seed=args.seed, source_name=args.source, target_name=args.target,
        stats_precision=args.stats_precision,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if not save_or_rescue(bridge, args.out, args.force, "fit"):
        return 1
    print(bridge.summary())
    if "rows" in bridge.calibration:
        rows = bridge.calibration["rows"]
        print(
            f"calibration: {args.calib_seqs} x {args.seq_len} tokens of {args.domain}; "
            f"{rows['train']} training rows, {rows['heldout']} held-out rows"
        )
    print(f"fit time: {seconds:.1f} s; saved to {args.out}")
    return 0


def _fit_recipe(args) -> int:
    """Fit again from the recipe a bridge records (checked by `_check_recipe`; the zoo loads the
    models it names), then save like a plain fit."""
    import torch

    from bridgecache.bridge.recipe import recipe_command
    from bridgecache.fitting.refit import refit
    from bridgecache.models.zoo import load_model

    recipe = args.recipe_fields
    torch.manual_seed(recipe.get("seed", 0))
    source, source_tok = load_model(recipe["source"], device=args.device)
    target, target_tok = load_model(recipe["target"], device=args.device)
    print(f"recipe of {printable(args.recipe)}: {printable(recipe_command(recipe, args.out))}")
    start = time.perf_counter()
    bridge = refit(recipe, source, target, source_tok, target_tok)
    if not save_or_rescue(bridge, args.out, args.force, "fit"):
        return 1
    print(bridge.summary())
    print(f"fit time: {time.perf_counter() - start:.1f} s; saved to {args.out}")
    return 0


def save_or_rescue(bridge, out, overwrite: bool, command: str) -> bool:
    """Save `bridge` to `out`; if that fails (the destination changed or filled up during a long
    run, another process saved a bridge there meanwhile), save it to a `bridgecache-unsaved-*`
    folder in the temporary directory and say where, on stderr. True if it reached `out`."""
    try:
        bridge.save_pretrained(out, overwrite=overwrite)
        return True
    except OSError as err:  # FileExistsError included: never lose finished work
        rescue = Path(tempfile.mkdtemp(prefix="bridgecache-unsaved-"))
        bridge.save_pretrained(rescue)
        print(
            f"bridgecache {command}: error: could not save to {out} ({err}); saved to {rescue}",
            file=sys.stderr,
        )
        return False
