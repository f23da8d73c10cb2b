"""The quality gate on a deliberately wrong bridge: it falls back to native prefill, and says so.

    python benchmarks/gate_demo.py --bridge DIR --pair smollm2-to-qwen0.5b [--limit 12] [--min-quality 0.7]

Builds a wrong bridge from a good one (target layer i gets the maps fitted for layer L-1-i),
scores both on the held-out calibration sequences (attention-output cosine per layer), then runs
the built-in fact questions through each with the default `HandoffConfig` and with
`HandoffConfig(quality=QualityPolicy(min_quality))`, and prints the accuracies and the gate's
reason to fall back. Nothing here is tuned: the threshold is the command's argument.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from native_dial import PAIRS  # noqa: E402


def reversed_layers(bridge):
    """A copy of `bridge` whose target layer i holds the maps fitted for layer L-1-i."""
    wrong = copy.deepcopy(bridge)
    wrong.layers = list(reversed(wrong.layers))
    wrong.calibration = dict(wrong.calibration, description="deliberately wrong: layer maps reversed")
    wrong.calibration.pop("heldout_scores", None)
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bridge", required=True, help="directory, builtin:SOURCE->TARGET or hub id")
    parser.add_argument("--pair", required=True, choices=list(PAIRS))
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--min-quality", type=float, default=0.7)
    parser.add_argument("--task", default="facts-choice-512")
    args = parser.parse_args()

    import torch

    from bridgecache import Bridge, HandoffConfig, QualityPolicy
    from bridgecache.evaluation import evaluate, load_items, summarise
    from bridgecache.evaluation.runner import Variant
    from bridgecache.fitting.heldout import score_bridge
    from bridgecache.models.zoo import load_model
    from bridgecache.runtime.gate import layer_scores

    torch.set_num_threads(1)
    good = Bridge.from_pretrained(args.bridge)
    source, source_tok = load_model(PAIRS[args.pair][0])
    target, target_tok = load_model(PAIRS[args.pair][1])
    wrong = reversed_layers(good)
    if "heldout_scores" not in good.calibration:
        score_bridge(good, source, target, source_tok, target_tok)
    score_bridge(wrong, source, target, source_tok, target_tok)
    for name, bridge in (("fitted", good), ("reversed layers", wrong)):
        scores = layer_scores(bridge)
        print(
            f"{name}: held-out attention cosine mean {sum(scores) / len(scores):.3f}, min {min(scores):.3f}"
        )

    gated = HandoffConfig(quality=QualityPolicy(min_quality=args.min_quality))
    variants = [
        Variant(good, label="fitted"),
        Variant(good, gated, label="fitted"),
        Variant(wrong, label="reversed"),
        Variant(wrong, gated, label="reversed"),
    ]
    _, items = load_items(f"builtin:{args.task}", None, target_tok, args.limit)
    evaluation = evaluate(source, source_tok, target, target_tok, items, "choice", variants)
    print(f"\n{args.pair}, {args.task}, {len(evaluation.items)} items, min_quality {args.min_quality}\n")
    print("| bridge | gate | accuracy | native | no context | fallbacks | native FLOPs share |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        s = summarise(evaluation, v)
        minimum = v.config.quality.min_quality
        gate = "off" if minimum is None else f"min_quality {minimum}"
        print(
            f"| {v.label} | {gate} | {100 * s['acc_bridged']:.1f}% | {100 * s['acc_native']:.1f}% "
            f"| {100 * s['acc_no_context']:.1f}% | {s['fallbacks']} of {s['n']} "
            f"| {100 * s['native_cost_fraction']:.1f}% |"
        )
    print("\nthe gate's report on the wrong bridge, first item:")
    first = evaluation.items[0]
    print(f"  fallback: {first.fallback[variants[3].name]}")


if __name__ == "__main__":
    main()
