"""CacheBridge's per-head float64 statistics of one group of target layers: the group's heads on one
stacked head axis (`gram.StackedHeads`, the default) against one `LayerAccumulator` per layer.

    python benchmarks/fit_statistics.py [--rows 7168 --batches 2 --repeats 3 --heldout]   # CPU
    python benchmarks/fit_statistics.py --device cuda --batches 16                        # one GPU

Random KV at Qwen2.5-7B -> Qwen2.5-1.5B shapes (28 source layers x 4 heads, 28 target layers x
2 heads, head dim 128), CacheBridge's default k = 2 matched source heads per target head (random
layers and heads); batches of `--rows` rows (1,024-token sequences), shifted as the fit shifts
them, with attention weights (weighted training rows) or as held-out rows. Times
`GroupStatistics.add` over the batches after one warm-up batch (CUDA synchronised), both paths
alternately on the same data; prints the minimum and median of `--repeats` runs of each. The
paths are chosen by answering True or False from `group.stacks_heads` (as the tests do; a fit
stacks on CUDA only).
"""

from __future__ import annotations

import argparse
import time

import torch

from bridgecache.fitting import group as group_module
from bridgecache.fitting.core import PairedKV, Shift
from bridgecache.fitting.group import GroupStatistics

LS, HS, DS, LT, HT, DT, K, SEQ = 28, 4, 128, 28, 2, 128, 2, 1024


def matched_inputs(seed: int = 0) -> list[torch.Tensor]:
    """Per target layer int64 [HT, K, 2]: K random source layers, a random source head each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LT):
        x = torch.zeros(HT, K, 2, dtype=torch.long)
        for j, layer in enumerate(sorted(torch.randperm(LS, generator=g)[:K].tolist())):
            x[:, j, 0], x[:, j, 1] = layer, torch.randint(0, HS, (HT,), generator=g)
        out.append(x)
    return out


def batch(seed: int, sequences: int, heldout: bool, device) -> PairedKV:
    g = torch.Generator(device=device).manual_seed(seed)

    def layers(n, heads, dim):
        return [torch.randn(sequences, heads, SEQ, dim, generator=g, device=device) for _ in range(n)]

    rows = torch.arange(1, SEQ, device=device).expand(sequences, -1).clone()
    weights = (
        None if heldout else [torch.rand(sequences, HT, SEQ, generator=g, device=device) for _ in range(LT)]
    )
    kv = layers(LS, HS, DS), layers(LS, HS, DS), layers(LT, HT, DT), layers(LT, HT, DT)
    return PairedKV(*kv, rows, rows.clone(), heldout, weights, weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=7168, help="rows per batch (1,024-token sequences)")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heldout", action="store_true", help="held-out rows (unweighted) instead")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    inputs, sequences = matched_inputs(), max(1, args.rows // SEQ)
    seqs = [batch(seed, sequences, args.heldout, device) for seed in range(args.batches + 1)]
    shift = Shift.of(seqs[0])
    seqs = [shift.apply(seq) for seq in seqs]
    stacks_heads = group_module.stacks_heads
    times: dict[str, list[float]] = {"per-layer": [], "stacked": []}
    for _ in range(args.repeats):
        for path in times:
            group_module.stacks_heads = (lambda *_: True) if path == "stacked" else (lambda *_: False)
            stats = GroupStatistics(list(range(LT)), inputs, None, (HS, DS, HT, DT), True, device, "tf32x3")
            stats.add(seqs[0])  # warm-up
            sync()
            start = time.perf_counter()
            for seq in seqs[1:]:
                stats.add(seq)
            sync()
            times[path].append(time.perf_counter() - start)
            del stats
    group_module.stacks_heads = stacks_heads
    rows = "held-out" if args.heldout else "weighted training"
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"{args.batches} batches x {sequences * (SEQ - 1)} {rows} rows, {LT} target layers x {HT} heads, "
          f"p = {K * DS}, float64; {name}")  # fmt: skip
    for path, ts in times.items():
        best, median, per_batch = min(ts), sorted(ts)[len(ts) // 2], min(ts) / args.batches * 1e3
        print(f"  {path:9s}: min {best:.3f} s, median {median:.3f} s of {len(ts)} ({per_batch:.1f} ms/batch)")


if __name__ == "__main__":
    main()
