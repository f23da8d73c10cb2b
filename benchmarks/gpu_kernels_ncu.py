"""One fused apply (map_layers for keys, then values) inside an NVTX range, for Nsight Compute.

    ncu --nvtx --nvtx-include "profile/" --clock-control none --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        python3 benchmarks/gpu_kernels_ncu.py --tokens 4096 --kernel persistent

Qwen2.5-7B -> Qwen2.5-1.5B cache shapes, head-local maps (benchmarks/gpu_kernels.py's Case), with
the persistent apply kernel (kernels/persistent.py) or the tiled one (`--kernel tiled`). The
kernel runs once outside the range first (tuning, compilation), so ncu reads only the two
launches of the chosen configuration.
"""

from __future__ import annotations

import argparse

import torch
from gpu_kernels import QWEN25_7B, QWEN25_15B, Case, import_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--kernel", default="persistent", choices=("tiled", "persistent"),
                        help="the apply kernel profiled (kernels.affine.APPLY_KERNEL)")  # fmt: skip
    args = parser.parse_args()
    kernels = import_kernels()
    kernels.affine.APPLY_KERNEL = args.kernel
    for tokens in args.tokens:
        case = Case(QWEN25_7B, QWEN25_15B, tokens, torch.device("cuda"))
        case.fused(kernels)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        case.fused(kernels)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"profiled {tokens} tokens: bytes moved (fewest) {case.bytes_moved() / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
