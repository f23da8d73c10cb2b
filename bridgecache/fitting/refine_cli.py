"""`bridgecache refine`: train the optional refinement of a fitted bridge and save the result.

    bridgecache refine --bridge DIR --out DIR [--rank 32 --steps 200 --lr 3e-3 --loss cosine
        --texts 48 --batch 8 --rows 64 --threads N --force]

Loads the bridge and its own models (`bridge.source.name`, `bridge.target.name`), trains the
refinement on the training sequences of the bridge's calibration recipe (`bridgecache.text`,
split "calib"; the held-out ones are never trained on), scores the held-out sequences before and
after (`heldout.score_bridge`: attention-output cosine per target layer; "before" is the score the
fit recorded, when it did), prints both, and saves
the refined bridge (its `calibration["heldout_scores"]` are the refined scores; the closed form's
are kept in `refinement["heldout_closed_form"]`). Options, the bridge, the models it names and
`--out` are checked before a model loads; if `--out` breaks during the run, the refined bridge is
saved to a `bridgecache-unsaved-*` folder instead. The closed-form bridge is never modified.

Knows argparse; the training itself is `bridgecache.fitting.refine.refine_bridge`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bridgecache.untrusted import printable

__all__ = ["add_refine_command", "run_refine"]


def add_refine_command(subparsers) -> argparse.ArgumentParser:
    """Add `refine` to an argparse subparsers object; returns its parser."""
    refine = subparsers.add_parser(
        "refine", help="train a low-rank residual on top of a bridge's closed-form maps (off by default)"
    )
    refine.add_argument("--bridge", required=True, help="closed-form bridge (dir, builtin:NAME, hub id)")
    refine.add_argument("--out", required=True, help="directory for the refined bridge")
    refine.add_argument("--force", action="store_true", help="replace a bridge already in --out")
    refine.add_argument("--rank", type=int, default=32, help="hidden width of each residual (default 32)")
    refine.add_argument("--steps", type=int, default=200, help="Adam steps per target layer (default 200)")
    refine.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    refine.add_argument("--loss", default="cosine", choices=["cosine", "mse"], help="attention-output loss")
    refine.add_argument("--texts", type=int, default=48, help="calibration texts to train on (default 48)")
    refine.add_argument("--batch", type=int, default=8, help="texts per Adam step (default 8)")
    refine.add_argument("--rows", type=int, default=64, help="query rows per text (default 64)")
    refine.add_argument("--validate-every", type=int, default=8, help="every Nth text validates (default 8)")
    refine.add_argument("--seed", type=int, default=0)
    refine.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    refine.set_defaults(func=run_refine)
    return refine


def check_refine_args(args) -> str | None:
    """The first problem with the arguments, the bridge and its models, destination included, in
    words; None if none. Sets `args.closed` to the loaded bridge."""
    from bridgecache.bridge import Bridge
    from bridgecache.bridgeformat import BridgeFormatError
    from bridgecache.files import writable_destination
    from bridgecache.fitting.options import check_model_reference
    from bridgecache.zoo import BUILTIN_MODELS

    limits = (("--rank", args.rank, 1), ("--steps", args.steps, 0), ("--texts", args.texts, 2))
    limits += (("--validate-every", args.validate_every, 2),)
    if args.threads is not None:
        limits += (("--threads", args.threads, 1),)
    for flag, value, low in limits:
        if value < low:
            return f"{flag} is {value}; expected an integer >= {low}"
    for flag, value in (("--batch", args.batch), ("--rows", args.rows)):
        if value < 1:
            return f"{flag} is {value}; expected an integer >= 1"
    if not args.lr > 0:
        return f"--lr is {args.lr}; expected a number > 0"
    problem = writable_destination(args.out)
    if problem:
        return f"--out: {problem}"
    if (Path(args.out) / "bridge.json").exists() and not args.force:
        return f"--out: {args.out} already holds a bridge; pass --force to replace it, or choose another"
    try:
        args.closed = Bridge.from_pretrained(args.bridge)
    except (BridgeFormatError, OSError) as err:
        return f"--bridge: {err}"
    for role, spec in (("source", args.closed.source), ("target", args.closed.target)):
        problem = check_model_reference(spec.name, BUILTIN_MODELS)
        if problem:
            return f"--bridge: its {role} model cannot be loaded: {problem}"
    return None


def run_refine(args) -> int:
    """Check, load, score, refine, score again, save, print. Returns the exit status."""
    problem = check_refine_args(args)
    if problem:
        print(f"bridgecache refine: error: {printable(problem, 2000)}", file=sys.stderr)
        return 2
    import torch

    from bridgecache.fitting.cli import save_or_rescue
    from bridgecache.fitting.heldout import score_bridge
    from bridgecache.fitting.refine import refine_bridge
    from bridgecache.zoo import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    bridge = args.closed
    source, source_tok = load_model(bridge.source.name)
    target, target_tok = load_model(bridge.target.name)
    before = bridge.calibration.get("heldout_scores")
    if not isinstance(before, dict) or "attention_cosine" not in before:  # older bridges: score now
        before = score_bridge(bridge, source, target, source_tok, target_tok)
    start = time.perf_counter()
    refined = refine_bridge(
        bridge,
        source,
        target,
        None,
        source_tok,
        target_tok,
        rank=args.rank,
        steps=args.steps,
        max_texts=args.texts,
        lr=args.lr,
        loss=args.loss,
        batch=args.batch,
        rows_per_context=args.rows,
        validate_every=args.validate_every,
        seed=args.seed,
    )
    seconds = time.perf_counter() - start
    after = score_bridge(refined, source, target, source_tok, target_tok)
    if refined.refinement:
        refined.refinement["heldout_closed_form"] = before
        refined.refinement["source_bridge"] = str(args.bridge)
    if not save_or_rescue(refined, args.out, True, "refine"):
        return 1
    kept = [i for i, layer in enumerate(refined.layers) if layer.refinement is not None]
    print(f"held-out attention-output cosine over {after['sequences']} held-out calibration sequences")
    print("| target layer | closed form | refined | residual kept |\n|---|---|---|---|")
    for i, (b, a) in enumerate(zip(before["attention_cosine"], after["attention_cosine"])):
        print(f"| {i} | {b:.4f} | {a:.4f} | {'yes' if i in kept else 'no'} |")
    print(f"| mean | {before['mean']:.4f} | {after['mean']:.4f} | {len(kept)} of {len(refined.layers)} |")
    print(f"refine time: {seconds:.1f} s; saved to {args.out}")
    return 0
