"""How `column_attention`'s Triton kernel is launched: the configurations its autotuner tries,
and the split launch for few queries over many keys.

    configs(), prune(...)       the autotuner's lists per (padded head dim, float32 operands)
    split_count(programs, ...)  key shares per query block (1: no split)
    search_steps(n)             steps of the kernel's key search over n columns (SEARCH_K probes each)
    split_config(n_q, ...)      the split launch's fixed blocks
    merge_shares(part, stats, out, sinks)   the exact softmax over every share from each share's partial one

A prompt's few queries over a long context make fewer programs than the GPU has multiprocessors,
each walking every key (a 32K-token pass of 17 queries used 14 programs: 0.55 ms a layer on an
H100). Each query block's keys are then split into shares, one program each, which write their
unnormalised output, running max and sum (float32); `merge_shares` rescales and adds them
(flash-decoding): 13.2 -> 1.3 ms of GPU time for that pass's 24 layers
(benchmarks/reports/route-gate-2026-12-05.md).

Plain PyTorch and numbers: imports nothing of the kernel (bridgecache.kernels.attention imports this).
"""

from __future__ import annotations

import torch

from ._dispatch import next_pow2

__all__ = ["SEARCH_K", "configs", "prune", "search_steps", "split_count", "split_config", "merge_shares"]

# (BLOCK_M, BLOCK_N, warps, stages) the autotuner tries, per (padded head dim, float32 operands).
# Chosen from offline sm_90 builds (Triton 3.9, ptxas): 16-bit lists hold no register spills except
# the last entry at 256; float32 ones fit 100 KB of shared memory (they spill: a correctness path).
_CONFIGS = {
    (16, False): ((64, 64, 4, 3), (128, 64, 8, 3)),
    (32, False): ((64, 64, 4, 3), (128, 64, 8, 3)),
    (64, False): ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)),
    (128, False): ((128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 8, 3)),
    (256, False): ((32, 32, 8, 2), (64, 16, 4, 2), (64, 32, 8, 2)),
    (16, True): ((32, 32, 4, 2),),
    (32, True): ((32, 32, 4, 2),),
    (64, True): ((32, 32, 4, 2),),
    (128, True): ((32, 32, 4, 2),),
    (256, True): ((32, 16, 4, 2),),
}


def configs():
    import triton

    listed = dict.fromkeys(c for options in _CONFIGS.values() for c in options)
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=nw, num_stages=ns)
        for bm, bn, nw, ns in listed
    ]


def prune(configs, named_args, **kwargs):
    """Keep the configurations listed for this launch's padded head dim and operand type."""

    def arg(name):
        return named_args[name] if name in named_args else kwargs[name]

    listed = set(_CONFIGS[arg("BLOCK_D"), bool(arg("FP32"))])
    kept = [
        c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in listed
    ]
    return kept or configs[:1]


# The split launch: at most this many queries (one block of at most 64), keys in blocks of 64 where
# the tuned lists allow it (16-bit operands, head dims up to 128: measured on an H100).
_SPLIT_MAX_QUERIES = 64
_LOG2E = 1.4426950408889634
_SPLIT_BLOCK_N = 64


SEARCH_K = 32  # probes per step of the kernel's search over key columns


def search_steps(n: int) -> int:
    """Steps of the kernel's `_lower_bounds` that pin an answer in [0, n]: (K + 1) ** steps > n."""
    steps = 0
    while (SEARCH_K + 1) ** steps <= n:
        steps += 1
    return steps


def split_count(programs: int, n_q: int, n_k: int, sms: int) -> int:
    """Key shares per query block for `programs` (batch rows x query heads) over `n_k` keys on a
    GPU of `sms` multiprocessors: about two programs per multiprocessor, each share at least 4
    key blocks; 1 (no split) past `_SPLIT_MAX_QUERIES` queries or when the programs fill the GPU."""
    if n_q > _SPLIT_MAX_QUERIES or programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), n_k // (4 * _SPLIT_BLOCK_N)))


def split_config(n_q: int, block_d: int, fp32: bool) -> dict:
    """The split launch's blocks: one block of the queries (16-64 rows) and 64 keys, 4 warps, 3
    stages, for 16-bit operands up to head dim 128; elsewhere the tuned list's first entry for
    the shape (no larger blocks than the autotuner would try), its query block no larger than
    the queries need."""
    rows = max(16, next_pow2(n_q))
    if block_d <= 128 and not fp32:
        return dict(BLOCK_M=min(64, rows), BLOCK_N=_SPLIT_BLOCK_N, num_warps=4, num_stages=3)
    bm, bn, nw, ns = _CONFIGS[block_d, fp32][0]
    return dict(BLOCK_M=min(bm, rows), BLOCK_N=bn, num_warps=nw, num_stages=ns)


def merge_shares(
    part: torch.Tensor, stats: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None = None
) -> None:
    """The softmax over every share from each share's partial one.

    part: [S, B * Hq, Nq, BLOCK_D] float32 unnormalised sums of p v per share; stats: [S, B * Hq,
    Nq, 2] float32, the share's running max (log2 units, -inf where it saw no key) and sum of
    exp2; sinks: [Hq] float32 logits (natural units) that take a share of the softmax with no value,
    or None; out: [B, Nq, Hq, D], written (zeros for a query that saw no key in any share)."""
    bsz, n_q, hq, dim = out.shape
    top, total = stats[..., 0], stats[..., 1]
    best = top.amax(0)
    best = torch.where(best == float("-inf"), 0.0, best)
    weight = torch.exp2(top - best)  # 0 for a share that saw nothing
    norm = (weight * total).sum(0)
    if sinks is not None:  # [B * Hq, 1]: row b * Hq + h holds head h
        norm = norm + torch.exp2(sinks.float().repeat(bsz)[:, None] * _LOG2E - best)
    merged = (weight[..., None] * part).sum(0) / torch.where(norm > 0, norm, 1.0)[..., None]
    out.copy_(merged[..., :dim].view(bsz, hq, n_q, dim).transpose(1, 2))
