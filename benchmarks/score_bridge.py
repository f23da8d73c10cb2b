"""Add held-out attention-output cosine scores to a bridge fitted before fitting recorded them.

    python benchmarks/score_bridge.py --bridge DIR [--out DIR]

Loads the bridge's own models (`bridge.source.name`, `bridge.target.name`), scores the held-out
sequences of its calibration recipe (`bridgecache.fitting.heldout.score_bridge`, what
`bridgecache fit` now does at the end of every fit) and saves the bridge with the scores
(in place unless --out is given). Prints the per-layer table.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bridge", required=True, help="directory, builtin:SOURCE->TARGET or hub id")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from bridgecache.bridge.maps import Bridge
    from bridgecache.fitting.heldout import score_bridge
    from bridgecache.models.zoo import load_model

    torch.set_num_threads(args.threads)
    bridge = Bridge.from_pretrained(args.bridge)
    source, source_tok = load_model(bridge.source.name)
    target, target_tok = load_model(bridge.target.name)
    scores = score_bridge(bridge, source, target, source_tok, target_tok)
    bridge.save_pretrained(args.out or args.bridge)
    print(f"held-out attention-output cosine over {scores['sequences']} sequences, mean {scores['mean']}")
    print("| target layer | cosine | R^2 K | R^2 V |\n|---|---|---|---|")
    for i, (cosine, layer) in enumerate(zip(scores["attention_cosine"], bridge.layers)):
        print(f"| {i} | {cosine:.4f} | {layer.r2_key:.3f} | {layer.r2_value:.3f} |")


if __name__ == "__main__":
    main()
