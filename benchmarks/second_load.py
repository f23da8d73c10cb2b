"""A built-in model's second load in a new process: where the seconds go (issue 59).

    flock /tmp/heavy.lock python -P benchmarks/second_load.py              # every row, both models
    python -P benchmarks/second_load.py --one qwen2.5-coder-0.5b [--check 3]  # one process, one row

Each row is a new process that times its imports and `load_model(name)` (weights and tokenizer),
and the part of it spent dequantising. cold: the model's GGUF is first evicted from the page
cache (posix_fadvise DONTNEED on that file only); warm: the run right after. `--before PYTHON`
adds a warm row run by another environment's python (e.g. one installed from an older commit).
`--check N` compares N tensors of each type with gguf's own numpy dequantiser, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def one(name: str, check: int) -> None:
    start = time.perf_counter()
    import torch

    from bridgecache.models import gguf_weights, zoo

    imports = time.perf_counter() - start
    spent = {"dequant": 0.0}
    original = gguf_weights.dequantize

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = original(*args, **kwargs)
        spent["dequant"] += time.perf_counter() - t
        return out

    gguf_weights.dequantize = timed
    t = time.perf_counter()
    zoo.load_model(name)
    load = time.perf_counter() - t
    line = (
        f"{name}: threads {torch.get_num_threads()} imports {imports:.1f}s load_model {load:.1f}s "
        f"(dequant {spent['dequant']:.1f}s) process {time.perf_counter() - start:.1f}s"
    )
    if check:
        import json

        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf import dequantize as reference

        folder = zoo.model_dir(name)
        table = json.loads((folder / zoo.TABLE_FILE).read_text())
        data = np.memmap(folder / zoo.GGUF_FILE, dtype=np.uint8, mode="r")
        seen, bad = {}, 0
        for entry in table["tensors"]:
            if seen.get(entry["type"], 0) >= check:
                continue
            seen[entry["type"]] = seen.get(entry["type"], 0) + 1
            qtype = GGMLQuantizationType[entry["type"]]
            raw = gguf_weights._raw(data, entry, qtype)
            ours, theirs = original(raw, qtype).numpy(), reference(raw, qtype)
            bad += not np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
        line += f"; bit-identical to gguf.dequantize on {seen}: {bad == 0}"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", metavar="MODEL", help="measure one load in this process")
    parser.add_argument("--check", type=int, default=0, metavar="N")
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    parser.add_argument("--before", metavar="PYTHON", help="another environment's python for a warm row")
    args = parser.parse_args()
    if args.one:
        return one(args.one, args.check)
    from bridgecache.models.zoo import GGUF_FILE, model_dir

    me = [sys.executable, "-P", os.path.abspath(__file__)]
    one_thread = dict(os.environ, OMP_NUM_THREADS="1")
    for name in args.models:
        fd = os.open(model_dir(name) / GGUF_FILE, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        rows = [("cold, 1 thread", me, one_thread), ("warm, 1 thread", me, one_thread)]
        rows.append(("warm, default threads", me, dict(os.environ)))
        if args.before:
            rows.append(
                ("warm, 1 thread, before", [args.before, "-P", os.path.abspath(__file__)], one_thread)
            )
        for label, command, env in rows:
            print(f"{label}: load average {os.getloadavg()[0]:.2f}", flush=True)
            subprocess.run([*command, "--one", name, "--check", str(args.check)], env=env, check=True)


if __name__ == "__main__":
    main()
