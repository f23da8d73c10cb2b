"""CacheBridge's per-head statistics of one group of target layers: the group's heads on one
stacked head axis (`gram.StackedHeads`, the default on CUDA) against one `LayerAccumulator` per
layer, at each statistics precision asked for.

    python benchmarks/fit_statistics.py [--rows 7168 --batches 2 --repeats 3 --heldout]   # CPU
    python benchmarks/fit_statistics.py --device cuda --batches 16                        # one GPU
    python benchmarks/fit_statistics.py --device cuda --pair qwen3-14b-32b --rows 2048 \\
        --precisions bf16-gemm tf32x3 --paths stacked --profile                         # where time goes

Random KV at a pair's shapes (--pair: qwen2.5-7b-1.5b, 28 source layers x 4 heads -> 28 target
layers x 2 heads; qwen3-14b-32b, 40 x 8 -> 64 x 8; head dim 128; --depth keeps that fraction of
both models' layers), CacheBridge's default k = 2 matched source heads per target head (random
layers and heads); batches of `--rows` rows (1,024-token sequences), shifted as the fit shifts
them, with attention weights (weighted training rows) or as held-out rows. Times
`GroupStatistics.add` over the batches after one warm-up batch (CUDA synchronised), the paths and
precisions alternately on the same data; prints the minimum and median of `--repeats` runs of
each. Before any time is printed, each precision's statistics of the last run are checked against
the first precision's (relative difference of the Gram matrices, which must be below 1e-2). The
paths are chosen by answering True or False from `group.stacks_heads` (as the tests do; a fit
stacks on CUDA only). --profile: one more run of each (path, precision) under torch.profiler, its
top operators by GPU time.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import torch

from bridgecache.fitting import group as group_module
from bridgecache.fitting.core import PairedKV, Shift
from bridgecache.fitting.group import GroupStatistics

SEQ, K = 1024, 2


@dataclass(frozen=True)
class Shapes:
    ls: int  # source layers, KV heads, head dim
    hs: int
    ds: int
    lt: int  # target layers, KV heads, head dim
    ht: int
    dt: int

    def at_depth(self, depth: float, least_source: int = 1) -> Shapes:
        """These shapes with round(depth x) of each model's layers (at least `least_source`
        source layers and one target layer), every width as it is."""
        ls, lt = max(least_source, round(self.ls * depth)), max(1, round(self.lt * depth))
        return Shapes(ls, self.hs, self.ds, lt, self.ht, self.dt)


PAIRS = {"qwen2.5-7b-1.5b": Shapes(28, 4, 128, 28, 2, 128), "qwen3-14b-32b": Shapes(40, 8, 128, 64, 8, 128)}


def matched_inputs(s: Shapes, seed: int = 0) -> list[torch.Tensor]:
    """Per target layer int64 [ht, K, 2]: K random source layers, a random source head each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(s.lt):
        x = torch.zeros(s.ht, K, 2, dtype=torch.long)
        for j, layer in enumerate(sorted(torch.randperm(s.ls, generator=g)[:K].tolist())):
            x[:, j, 0], x[:, j, 1] = layer, torch.randint(0, s.hs, (s.ht,), generator=g)
        out.append(x)
    return out


def batch(s: Shapes, seed: int, sequences: int, heldout: bool, device) -> PairedKV:
    g = torch.Generator(device=device).manual_seed(seed)

    def layers(n, heads, dim):
        return [torch.randn(sequences, heads, SEQ, dim, generator=g, device=device) for _ in range(n)]

    rows = torch.arange(1, SEQ, device=device).expand(sequences, -1).clone()
    weights = (
        None
        if heldout
        else [torch.rand(sequences, s.ht, SEQ, generator=g, device=device) for _ in range(s.lt)]
    )
    kv = (
        layers(s.ls, s.hs, s.ds),
        layers(s.ls, s.hs, s.ds),
        layers(s.lt, s.ht, s.dt),
        layers(s.lt, s.ht, s.dt),
    )
    return PairedKV(*kv, rows, rows.clone(), heldout, weights, weights)


def run(s: Shapes, inputs, seqs, path: str, precision: str, device, sync) -> tuple[float, GroupStatistics]:
    """Seconds of GroupStatistics.add over seqs[1:] after seqs[0], and the statistics."""
    group_module.stacks_heads = lambda *_: path == "stacked"
    stats = GroupStatistics(
        list(range(s.lt)), inputs, None, (s.hs, s.ds, s.ht, s.dt), True, device, precision
    )
    stats.add(seqs[0])  # warm-up
    sync()
    start = time.perf_counter()
    for seq in seqs[1:]:
        stats.add(seq)
    sync()
    return time.perf_counter() - start, stats


def gram_difference(a: GroupStatistics, b: GroupStatistics) -> float:
    """Largest relative difference of the training Gram matrices (plain moments, keys) per layer."""
    worst = 0.0
    for x, y in zip(a.accumulators(), b.accumulators()):
        gx, gy = x.train["k"].plain.xtx.double(), y.train["k"].plain.xtx.double()
        worst = max(worst, float((gx - gy).norm() / gy.norm()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="qwen2.5-7b-1.5b")
    parser.add_argument("--depth", type=float, default=1.0, help="fraction of both models' layers")
    parser.add_argument("--rows", type=int, default=7168, help="rows per batch (1,024-token sequences)")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heldout", action="store_true", help="held-out rows (unweighted) instead")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--paths", nargs="+", default=["per-layer", "stacked"], choices=["per-layer", "stacked"]
    )
    parser.add_argument("--precisions", nargs="+", default=["bf16-gemm"])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    s = PAIRS[args.pair].at_depth(args.depth, least_source=K)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    inputs, sequences = matched_inputs(s), max(1, args.rows // SEQ)
    seqs = [batch(s, seed, sequences, args.heldout, device) for seed in range(args.batches + 1)]
    shift = Shift.of(seqs[0])
    seqs = [shift.apply(seq) for seq in seqs]
    stacks_heads = group_module.stacks_heads
    variants = list(itertools.product(args.paths, args.precisions))
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    last: dict[tuple, GroupStatistics] = {}
    for _ in range(args.repeats):
        for variant in variants:
            last.pop(variant, None)
            times[variant].append(run(s, inputs, seqs, *variant, device, sync)[0])
    for variant in variants:  # checked before any time is printed
        _, last[variant] = run(s, inputs, seqs[:2], *variant, device, sync)
    reference = last[variants[0]]
    diffs = {v: gram_difference(last[v], reference) for v in variants}
    bad = {v: d for v, d in diffs.items() if not d < 1e-2}
    if bad:
        raise SystemExit(f"statistics differ from {variants[0]}'s: {bad}")
    group_module.stacks_heads = stacks_heads
    rows = "held-out" if args.heldout else "weighted training"
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"{args.pair} (depth {args.depth:g}): {args.batches} batches x {sequences * (SEQ - 1)} "
          f"{rows} rows, {s.lt} target layers x {s.ht} heads, p = {K * s.ds}; {name}")  # fmt: skip
    for variant, ts in times.items():
        best, median, per_batch = min(ts), sorted(ts)[len(ts) // 2], min(ts) / args.batches * 1e3
        print(f"  {' '.join(variant):20s}: min {best:.3f} s, median {median:.3f} s of {len(ts)} "
              f"({per_batch:.1f} ms/batch); Gram vs {' '.join(variants[0])}: "
              f"{diffs[variant]:.1e}")  # fmt: skip
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        for variant in variants:
            with torch.profiler.profile(activities=activities) as prof:
                run(s, inputs, seqs, *variant, device, sync)
            group_module.stacks_heads = stacks_heads
            key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(f"\n## {' '.join(variant)}\n")
            print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=50))


if __name__ == "__main__":
    main()
