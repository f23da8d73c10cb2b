"""`bridgecache fit`: fit a bridge between two models and save it, printing a per-layer report.

    bridgecache fit --source qwen2.5-coder-1.5b --target qwen2.5-coder-0.5b \\
        --method cachebridge --out bridges/q15-q05 [--calib-seqs 32 --seq-len 256 --layers-k 2]

`add_fit_command(subparsers)` registers the subcommand; `bridgecache/cli.py` wires it in.
Knows argparse and the zoo; the fitting itself is `bridgecache.fitting.fit_bridge`.
"""

from __future__ import annotations

import argparse
import time

__all__ = ["add_fit_command", "run_fit"]


def add_fit_command(subparsers) -> argparse.ArgumentParser:
    """Add `fit` to an argparse subparsers object; returns its parser."""
    fit = subparsers.add_parser("fit", help="fit a bridge (Full-Head Mapping or CacheBridge) and save it")
    fit.add_argument(
        "--source", required=True, help="model that reads the context (built-in name, hub id, dir)"
    )
    fit.add_argument("--target", required=True, help="model that continues from the mapped cache")
    fit.add_argument("--method", default="cachebridge", choices=["cachebridge", "fullhead"])
    fit.add_argument("--out", required=True, help="directory for bridge.safetensors + bridge.json")
    fit.add_argument("--calib-seqs", type=int, default=32, help="calibration sequences (default 32)")
    fit.add_argument("--seq-len", type=int, default=256, help="target tokens per sequence (default 256)")
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
    fit.add_argument("--lam", type=float, default=1e-2, help="ridge strength relative to the data scale")
    fit.add_argument("--native-head", type=int, default=1, help="target positions computed natively")
    fit.add_argument("--device", default="cpu", help="cpu or cuda")
    fit.add_argument("--seed", type=int, default=0)
    fit.set_defaults(func=run_fit)
    return fit


def run_fit(args) -> int:
    """Load both models, fit, save, print the report. Returns the exit status."""
    import torch

    from bridgecache.fitting import fit_bridge
    from bridgecache.zoo import load_model

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
    )  # fmt: skip
    seconds = time.perf_counter() - start
    bridge.save_pretrained(args.out)
    print(bridge.summary())
    if "rows" in bridge.calibration:
        rows = bridge.calibration["rows"]
        print(
            f"calibration: {args.calib_seqs} x {args.seq_len} tokens of {args.domain}; "
            f"{rows['train']} training rows, {rows['heldout']} held-out rows"
        )
    print(f"fit time: {seconds:.1f} s; saved to {args.out}")
    return 0
