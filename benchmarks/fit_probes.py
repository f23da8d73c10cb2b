"""The layer probes' scoring at a pair's shapes: what `FitConfig(layer_support="probe")` costs.

    python benchmarks/fit_probes.py --device cuda --pair qwen3-14b-32b [--depth 0.5] [--profile]
    python benchmarks/fit_probes.py --pair qwen2.5-7b-1.5b --depth 0.1 --train 2    # CPU smoke

Random KV rows at the pair's shapes (`fit_statistics.PAIRS`: layers, KV heads, head dims), in
bfloat16 on CUDA (the models' precision, which the probe rows keep) and float32 on the CPU:
`--train` training sequences and one held-out sequence of 1,024 rows each, what the default
`probe_subset` (16, plus a held-out one) reads. Times, after one warm-up, `ProbeRows.update` of
every sequence and `score_probes` (each source layer's float64 moments against every target
layer, one Cholesky per source layer and kind, per-head probes, held-out R^2), at each
`--precisions` value. Before any time is printed the scores are checked: finite, at most 1, and
the precisions' layer scores within 1e-2 of the first's. The first precision runs once more
without the single-head probes (`heads=False`: what a fit scores unless CacheBridge matches heads
across head counts), its layer scores equal to the ones with them. --profile: the top operators
of one more scoring (as the fit runs it for this pair) by GPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from fit_statistics import PAIRS, SEQ

from bridgecache.fitting.support import ProbeRows, score_probes


def rows(shape, sequences: int, device, dtype, seed: int) -> list[list[torch.Tensor]]:
    """Per sequence, (src_k, src_v, tgt_k, tgt_v): per-layer lists of [SEQ, heads, dim] rows."""
    ls, hs, ds, lt, ht, dt = shape
    # one mixing for every call (training and held-out rows share the map), fresh rows per seed
    g = torch.Generator(device=device).manual_seed(0)
    mixing = torch.randn(hs * ds, ht * dt, generator=g, device=device) / (hs * ds) ** 0.5
    g.manual_seed(seed)

    def one():
        src = [torch.randn(SEQ, hs * ds, generator=g, device=device) for _ in range(ls)]
        # targets depend on the sources (one source layer each, plus noise): R^2 well above 0
        tgt = [
            (src[t * ls // lt] @ mixing + 0.5 * torch.randn(SEQ, ht * dt, generator=g, device=device))
            for t in range(lt)
        ]
        return [x.reshape(SEQ, hs, ds).to(dtype) for x in src], [
            y.reshape(SEQ, ht, dt).to(dtype) for y in tgt
        ]

    out = []
    for _ in range(sequences):
        (sk, tk), (sv, tv) = one(), one()
        out.append([sk, sv, tk, tv])
    return out


def timed_scoring(shape, train, held, device, dtype, precision, sync, heads=True):
    """(seconds of the updates, seconds of score_probes, the scores)."""
    sync()
    start = time.perf_counter()
    fit_rows, held_rows = (ProbeRows(*shape, device, dtype, precision) for _ in range(2))
    for seq in train:
        fit_rows.update(*seq)
    for seq in held:
        held_rows.update(*seq)
    sync()
    updated = time.perf_counter()
    scores = score_probes(fit_rows, held_rows, heads=heads)
    sync()
    return updated - start, time.perf_counter() - updated, scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=sorted(PAIRS), default="qwen3-14b-32b")
    ap.add_argument("--depth", type=float, default=1.0)
    ap.add_argument("--train", type=int, default=16, help="training sequences of 1,024 rows")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precisions", nargs="+", default=["bf16-gemm", "tf32x3"])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    base = PAIRS[args.pair]
    shape = dataclasses.astuple(base.at_depth(args.depth))
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    train = rows(shape, args.train, device, dtype, seed=1)
    held = rows(shape, 1, device, dtype, seed=2)
    timed_scoring(shape, train[:1], held, device, dtype, args.precisions[0], sync)  # warm-up
    results = {}
    # each precision with the single-head probes, and the first without them (what a fit
    # scores unless CacheBridge must match heads across head counts)
    variants = [(p, True) for p in args.precisions] + [(args.precisions[0], False)]
    for precision, heads in variants:
        runs = [
            timed_scoring(shape, train, held, device, dtype, precision, sync, heads)
            for _ in range(args.repeats)
        ]
        results[(precision, heads)] = (min(r[0] for r in runs), min(r[1] for r in runs), runs[-1][2])
    first = results[variants[0]][2].layer
    for (precision, heads), (_, _, scores) in results.items():  # checked before any time is printed
        assert torch.isfinite(scores.layer).all(), precision
        assert (scores.head is not None) == heads and (not heads or torch.isfinite(scores.head).all())
        assert scores.layer.max() <= 1 and scores.layer.max() > 0.1, (precision, scores.layer.max())
        assert (scores.layer - first).abs().max() < 1e-2, (precision, (scores.layer - first).abs().max())
    assert torch.equal(results[variants[-1]][2].layer, first), "the head probes changed the layer scores"
    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    ls, hs, ds, lt, ht, dt = shape
    print(f"{args.pair} (depth {args.depth:g}): {ls} x {hs} x {ds} -> {lt} x {ht} x {dt}, "
          f"{args.train} + 1 sequences of {SEQ} rows, {dtype}; {where}")  # fmt: skip
    for (precision, heads), (update_s, score_s, scores) in results.items():
        diff = (scores.layer - first).abs().max()
        label = f"{precision}{'' if heads else ', no head probes'}"
        print(f"  {label:28s}: rows kept {update_s:.3f} s, scoring {score_s:.3f} s "
              f"(min of {args.repeats}); "
              f"layer scores vs {args.precisions[0]}: {diff:.1e}")  # fmt: skip
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else []
        )
        with torch.profiler.profile(activities=activities) as prof:
            timed_scoring(shape, train, held, device, dtype, args.precisions[0], sync, base.hs != base.ht)
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=50))


if __name__ == "__main__":
    main()
