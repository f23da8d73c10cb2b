"""One fused apply (keys, then values: the apply kernel's launcher) inside an NVTX range, for Nsight Compute.

    ncu --nvtx --nvtx-include "profile/" --clock-control none --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        python3 benchmarks/gpu_kernels_ncu.py --tokens 4096 --kernel persistent

Qwen2.5-7B -> Qwen2.5-1.5B cache shapes, head-local maps (benchmarks/gpu_kernels.py's Case), with
the persistent apply kernel (kernels/persistent.py) or the tiled one (`--kernel tiled`). The
kernel runs once outside the range first (tuning, compilation), so ncu reads only the two
launches of the chosen configuration.

`--stats PRECISION` profiles instead one fused statistics update (`SufficientStats.update`, keys:
gather, un-rotation and the Gram / cross products) at Qwen3-14B -> Qwen3-32B shapes, 8 sequences
of 1024 tokens, as gpu_kernels.py's statistics rows time it.
"""

from __future__ import annotations

import argparse

import torch
from gpu_kernels import (
    QWEN3_14B,
    QWEN3_32B,
    QWEN25_7B,
    QWEN25_15B,
    Case,
    alignment_rows,
    import_kernels,
    rope,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--kernel", default="persistent", choices=("tiled", "persistent"),
                        help="the apply kernel profiled (kernels.affine.launch_affine's kernel)")  # fmt: skip
    parser.add_argument("--stats", choices=("tf32x3", "tf32", "bf16"), help="profile a statistics update")
    args = parser.parse_args()
    kernels = import_kernels()
    if args.stats:
        profile_stats(kernels, args.stats)
        return
    for tokens in args.tokens:
        case = Case(QWEN25_7B, QWEN25_15B, tokens, torch.device("cuda"))
        launch = case.launcher(kernels, args.kernel)
        launch()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        launch()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"profiled {tokens} tokens: bytes moved (fewest) {case.bytes_moved() / 1e6:.1f} MB", flush=True)


def profile_stats(kernels, precision: str, seqs: int = 8, tokens: int = 1024) -> None:
    device = torch.device("cuda")
    src, tgt = QWEN3_14B, QWEN3_32B
    g = torch.Generator(device=device).manual_seed(5)
    keys = torch.randn(seqs, src.kv_heads, tokens, src.head_dim, device=device, generator=g).bfloat16()
    ys = torch.randn(seqs, tgt.kv_heads, tokens, tgt.head_dim, device=device, generator=g).bfloat16()
    rows = alignment_rows(tokens, tokens, device).expand(seqs, -1).contiguous()
    heads = torch.tensor([[h * src.kv_heads // tgt.kv_heads] for h in range(tgt.kv_heads)], device=device)
    cos, sin = rope(tokens, src.head_dim, device)
    cos, sin = cos.expand(seqs, -1, -1), sin.expand(seqs, -1, -1)
    stats = kernels.SufficientStats.zeros(tgt.kv_heads, src.head_dim, tgt.head_dim, device=device)

    def update():
        stats.update(keys, rows, heads, ys, None, cos, sin, backend="triton", precision=precision)

    update()  # compilation and tuning outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    update()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"profiled one statistics update ({precision}): {seqs} x {tokens} tokens, Qwen3-14B -> 32B keys")


if __name__ == "__main__":
    main()
