"""`bridgecache fit`: fit a bridge between two models and save it, printing a per-layer report.

    bridgecache fit --source qwen2.5-coder-1.5b --target qwen2.5-coder-0.5b \\
        --method cachebridge --out bridges/q15-q05 [--calib-seqs 32 --seq-len 256 --layers-k 2]

    bridgecache fit --recipe builtin:NAME --out DIR [--calib-seqs 4 --seq-len 64]

`add_fit_command(subparsers)` registers the subcommand; `bridgecache/cli/__init__.py` wires it in.
Its fitting flags are FitConfig's fields (the flag: the name with dashes, `--calib-seqs` for
num_sequences; the help: the field's entry in FitConfig's docstring; the default: FitConfig()'s),
and the flags given become one FitConfig (over the recipe's, with --recipe).
Every option, both model references (or the recipe, validated with the bridge it comes from, and
the models it names) and `--out` are checked before a model loads: a fit can take an hour, and
it is never lost to a typo or an unwritable destination. An existing bridge in `--out` is
replaced only with `--force`; a folder holding anything else (a model, a README.md) is refused.
`--seq-len` beyond either model's context window is refused once the models are loaded, before
any forward. If `--out` breaks while the fit runs, the bridge is saved to a
`bridgecache-unsaved-*` folder in the temporary directory instead.

Knows argparse and the zoo; the fitting itself is `bridgecache.fitting.fit_bridge`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import typing
from pathlib import Path

from bridgecache.bridge.recipe import CHOICES, FLAGS, FitConfig, FitOptionError, field_docs
from bridgecache.untrusted import printable

__all__ = ["add_fit_command", "fit_config", "run_fit", "save_or_rescue"]

_DEFAULT = FitConfig()


def _count_or_all(text: str) -> int | None:
    """--probe-subset, --score-sequences: a count, or all (None: every sequence)."""
    if text == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count or all") from None


def _kind(name: str, hint) -> dict:
    """argparse's type, choices or action for the field `name` of type `hint`."""
    if name in ("probe_subset", "score_sequences"):
        return {"type": _count_or_all}
    if name == "text":  # files (or the digest a recipe names them by)
        return {"nargs": "+"}
    if name in CHOICES:
        return {"choices": CHOICES[name]}
    base = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    return {"action": argparse.BooleanOptionalAction} if base is bool else {"type": base}


def add_fit_command(subparsers) -> argparse.ArgumentParser:
    """Add `fit` to an argparse subparsers object; returns its parser."""
    fit = subparsers.add_parser("fit", help="fit a bridge (Full-Head Mapping or CacheBridge) and save it")
    fit.add_argument("--source", help="model that reads the context (built-in name, hub id, dir)")
    fit.add_argument("--target", help="model that continues from the mapped cache")
    fit.add_argument(
        "--recipe",
        help="fit again from a bridge's recorded recipe (dir, builtin:NAME or hub id); "
        "fitting options given here override it",
    )
    fit.add_argument("--out", required=True, help="directory for the bridge (bridge.json, tensors, card)")
    fit.add_argument("--force", action="store_true", help="replace a bridge already in --out")
    fit.add_argument("--device", default="cpu", help="cpu or cuda")
    group = fit.add_argument_group("fitting (the fields of a FitConfig; default: FitConfig()'s own)")
    docs, hints = field_docs(), typing.get_type_hints(FitConfig)
    for field in dataclasses.fields(FitConfig):
        text = f"{docs[field.name]} (default: {getattr(_DEFAULT, field.name)})"
        group.add_argument(
            FLAGS[field.name],
            dest=field.name,
            default=argparse.SUPPRESS,  # absent unless given: FitConfig (or the recipe) decides
            help=text.replace("%", "%%"),
            metavar=None if field.name in CHOICES else FLAGS[field.name][2:].upper().replace("-", "_"),
            **_kind(field.name, hints[field.name]),
        )
    fit.set_defaults(func=run_fit)
    return fit


def _given(args) -> dict:
    """The FitConfig fields given on the command line, by name (--text: file paths, or a digest)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(FitConfig) if hasattr(args, f.name)}
    if isinstance(given.get("text"), list):
        text = given["text"]
        given["text"] = (
            text[0] if len(text) == 1 and text[0].startswith("sha256:") else [Path(t) for t in text]
        )
    return given


def fit_config(args, base: FitConfig | None = None) -> FitConfig:
    """`base` (default FitConfig()) with the fitting flags given (FitOptionError naming the field)."""
    return (base or _DEFAULT).replace(**_given(args))


def check_fit_args(args) -> str | None:
    """The first problem with the arguments, destination included, in words; None if none.
    Sets `args.config` (the FitConfig) and, with --recipe, `args.source`, `args.target` and
    `args.recipe_fields` from the recipe."""
    from bridgecache.files import writable_destination
    from bridgecache.fitting.options import check_model_reference
    from bridgecache.models.zoo import BUILTIN_MODELS

    base = None
    if args.recipe:
        problem = _check_recipe(args)
        if problem:
            return problem
        base = FitConfig.from_recipe(args.recipe_fields)
    try:
        args.config = fit_config(args, base)
    except FitOptionError as err:
        from_recipe = args.recipe and err.option not in _given(args)
        return f"{FLAGS[err.option]} is {err.value!r}; expected {err.expected}" + (
            " (the recipe's value)" if from_recipe else ""
        )
    for flag, name in (("--source", args.source), ("--target", args.target)):
        if name is None:
            return "give --source and --target (or --recipe BRIDGE)"
        problem = check_model_reference(name, BUILTIN_MODELS)
        if problem:
            return f"{flag}: {problem}" + (" (named by the recipe)" if args.recipe else "")
    problem = writable_destination(args.out)
    if problem:
        return f"--out: {problem}"
    out = Path(args.out)
    if (out / "bridge.json").exists() and not args.force:
        return (
            f"--out: {args.out} already holds a bridge; pass --force to replace it, or choose another --out"
        )
    if out.is_dir() and not (out / "bridge.json").exists():
        others = sorted(p.name for p in out.iterdir())
        if others:  # a model folder, a README.md of one's own: a save would write over or beside them
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            return (
                f"--out: {args.out} holds other files ({shown}), not a bridge; a bridge writes "
                "bridge.json, bridge-*.safetensors and README.md: choose a new or empty folder"
            )
    return None


def _check_recipe(args) -> str | None:
    """With --recipe: load the bridge (every field validated, the recipe included) and take the
    models it names into `args` (its options are read by `check_fit_args`)."""
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
    args.recipe_fields = recipe
    args.source, args.target = recipe["source"], recipe["target"]
    return None


def run_fit(args) -> int:
    """Check the arguments, load both models, fit, save, print the report. Returns the exit status."""
    problem = check_fit_args(args)
    if problem:
        print(f"bridgecache fit: error: {printable(problem, 2000)}", file=sys.stderr)
        return 2

    import torch

    from bridgecache.fitting import fit_bridge
    from bridgecache.models.zoo import load_model

    if args.recipe:
        return _fit_recipe(args)
    config = args.config
    torch.manual_seed(config.seed)
    source, source_tok = load_model(args.source, device=args.device)
    target, target_tok = load_model(args.target, device=args.device)
    start = time.perf_counter()
    try:
        bridge = fit_bridge(
            source, target, source_tok, target_tok, config, source_name=args.source, target_name=args.target
        )
    except FitOptionError as err:  # a bound that needs the models (layers_k, seq_len): before any forward
        print(
            f"bridgecache fit: error: {FLAGS[err.option]} is {err.value!r}; expected {err.expected}",
            file=sys.stderr,
        )
        return 2
    seconds = time.perf_counter() - start
    if not save_or_rescue(bridge, args.out, args.force, "fit"):
        return 1
    print(bridge.summary())
    if "rows" in bridge.calibration:
        rows = bridge.calibration["rows"]
        print(
            f"calibration: {config.num_sequences} x {config.seq_len} tokens of {config.domain}; "
            f"{rows['train']} training rows, {rows['heldout']} held-out rows"
        )
    print(f"fit time: {seconds:.1f} s; saved to {args.out}")
    return 0


def _fit_recipe(args) -> int:
    """Fit again from the recipe a bridge records, with the options given here (checked by
    `check_fit_args`; the zoo loads the models it names), then save like a plain fit."""
    import torch

    from bridgecache.bridge.recipe import recipe_command
    from bridgecache.fitting.refit import refit
    from bridgecache.models.zoo import load_model

    recipe, config = args.recipe_fields, args.config
    torch.manual_seed(config.seed)
    source, source_tok = load_model(recipe["source"], device=args.device)
    target, target_tok = load_model(recipe["target"], device=args.device)
    command = recipe_command(config.recipe(recipe["source"], recipe["target"]), args.out)
    print(f"recipe of {printable(args.recipe)}: {printable(command)}")
    start = time.perf_counter()
    try:
        bridge = refit(recipe, source, target, source_tok, target_tok, **_given(args))
    except FitOptionError as err:
        print(
            f"bridgecache fit: error: {FLAGS[err.option]} is {err.value!r}; expected {err.expected}",
            file=sys.stderr,
        )
        return 2
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
