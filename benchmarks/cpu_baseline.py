"""CPU baseline: load time of each built-in model (first = GGUF conversion, then cached) and the
target prefill time at 512 and 2048 tokens, the cost that a handoff must beat.

    python benchmarks/cpu_baseline.py [--models smollm2-135m ...] [--lengths 512 2048]

"First load" converts the GGUF into a fresh temporary cache (the already-downloaded wheels are
reused, so network time is excluded and reported separately by nobody); "cached load" reads the
converted safetensors directory. Prefill: one forward over `pydoc` evaluation text, median of 3
after one warm-up, at the machine's default thread count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bridgecache.models.zoo import BUILTIN_MODELS, GGUF_FILE, cache_root, load_model
from bridgecache.text import token_sequences


def _timed_load_in_subprocess(name: str, home: Path) -> float:
    """Seconds for load_model(name) in a fresh interpreter with BRIDGECACHE_HOME=home."""
    code = (
        "import time; t = time.perf_counter(); from bridgecache.models.zoo import load_model; "
        f"load_model({name!r}); print(time.perf_counter() - t)"
    )
    env = dict(os.environ, BRIDGECACHE_HOME=str(home))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"loading {name} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def first_and_cached_load(name: str) -> tuple[float, float]:
    load_model(name)  # make sure the model is in the real cache
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        (home / "gguf").mkdir()  # the first load builds the folder from the verified GGUF (no download)
        shutil.copyfile(cache_root() / "models" / name / GGUF_FILE, home / "gguf" / f"{name}.gguf")
        first = _timed_load_in_subprocess(name, home)
        cached = _timed_load_in_subprocess(name, home)
    return first, cached


@torch.no_grad()
def prefill_seconds(model, tokenizer, length: int, repeats: int = 3) -> float:
    ids = token_sequences(tokenizer, 1, length, domain="prose", split="eval", seed=0)
    model(ids[:, :32])  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids, use_cache=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(BUILTIN_MODELS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--skip-first-load", action="store_true", help="do not time the GGUF conversion")
    args = parser.parse_args()
    header = ["model", "first load s", "cached load s"] + [f"prefill {n} s" for n in args.lengths]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in args.models:
        first, cached = (float("nan"), float("nan")) if args.skip_first_load else first_and_cached_load(name)
        model, tokenizer = load_model(name)
        prefill = [prefill_seconds(model, tokenizer, n) for n in args.lengths]
        cells = [name, f"{first:.1f}", f"{cached:.1f}"] + [f"{p:.2f}" for p in prefill]
        print("| " + " | ".join(cells) + " |", flush=True)
        del model
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
